"""The stop signals in the library's child processes (workers, encoders).

A terminal's Ctrl-C sends SIGINT to the whole process group, and a service manager's stop
sends SIGTERM to every process of the service (systemd's default ``KillMode=control-group``;
``kill -TERM -PGID`` does the same).  The children must not die of either: their parent
orders their end (it asks each one to leave, and kills the one that does not), and a child
that died first would fail the requests in flight that the parent's graceful stop lets end.
A child whose parent is gone leaves by itself (the worker's ``ExecutorWatch``, the encoder's
pipe reaching EOF), so ignoring them leaves no orphan behind.

``stop_signals_blocked()`` around the child's ``start()`` keeps a signal that arrives during
its start-up (imports, unpickling) pending; ``ignore_stop_signals()``, first thing in the
child, ignores both and so discards it.  A parent that must end a child sends SIGKILL.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["STOP_SIGNALS", "ignore_stop_signals", "stop_signals_blocked"]

#: What a terminal (SIGINT) and a service manager (SIGTERM) send the whole process group.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread for the block (around a child's ``start()``).

    The child inherits the mask through fork and exec.  Only this thread's mask changes;
    a signal for this process meanwhile goes to another thread or waits until the block ends.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_stop_signals() -> None:
    """In a child: ignore SIGINT and SIGTERM (a pending one is discarded), then unblock them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
