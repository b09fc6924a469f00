"""The stop signals in the library's child processes (workers, encoders).

A terminal's Ctrl-C sends SIGINT to the whole process group, and a service manager's stop
sends SIGTERM to every process of the service (systemd's default ``KillMode=control-group``;
``kill -TERM -PGID`` does the same).  The children must not die of either: their parent
orders their end (it asks each one to leave, and kills the one that does not), and a child
that died first would fail the requests in flight that the parent's graceful stop lets end.
A child whose parent is gone leaves by itself (the worker's ``ExecutorWatch``, the encoder's
pipe reaching EOF), so ignoring them leaves no orphan behind.

A SIGTERM from the child's own parent still ends it, as by default: ``multiprocessing``
terminates a process's daemonic children at its exit and then joins them, so a child that
ignored that one would hang its parent's exit.  Telling the two apart needs the sender's
pid, which only ``sigwaitinfo`` gives: SIGTERM stays blocked in every thread of the child
and one thread waits for it.

``stop_signals_blocked()`` around the child's ``start()`` keeps a signal that arrives during
its start-up (imports, unpickling) pending; ``ignore_stop_signals()``, first thing in the
child, ignores SIGINT (a pending one is discarded) and starts the SIGTERM thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
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
    """In a child: ignore SIGINT, and SIGTERM unless its parent sends it (see the module)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if not hasattr(signal, "sigwaitinfo"):  # not on macOS: SIGTERM ends the child, whoever sends it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from now on inherit it
    parent = os.getppid()
    threading.Thread(target=_end_on_parents_sigterm, args=(parent,), name="omni-sigterm", daemon=True).start()


def _end_on_parents_sigterm(parent: int) -> None:
    """Take SIGTERMs until one comes from ``parent``, then die of it (the default action)."""
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass
    # This thread alone lets it through now, and SIGTERM's disposition is the default.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)
