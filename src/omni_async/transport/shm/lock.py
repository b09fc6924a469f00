"""The segment pool's lock: threads and processes, and no dead process can wedge it.

A process can be killed anywhere, also inside the lock.  So the lock is a
``threading.Lock`` (the threads of one process) in front of ``flock(2)`` on the pool's
lock file (the processes): the kernel drops a flock when its holder dies, however it
dies.  Inside, the holder's pid is written into the shared table and cleared on the
way out; whoever next finds it still set knows the previous holder died mid-update and
calls ``repair(dead_pid)`` before going on (the pool's write orders make every cut
repairable, see ``pool``).  A holder that is alive but stuck makes an acquire time out
with ``TransportError`` instead of hanging.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from omni_async.transport.errors import TransportError

__all__ = ["CrashSafeLock"]


class CrashSafeLock:
    """Context manager over ``fd``'s flock; ``holder`` is a one-element int64 view into shared memory."""

    __slots__ = ("_fd", "_holder", "_label", "_repair", "_thread_lock", "_timeout")

    def __init__(
        self,
        label: str,
        fd: int,
        holder: npt.NDArray[np.int64],
        *,
        timeout: float,
        repair: Callable[[int], None],
    ) -> None:
        self._label = label
        self._fd = fd
        self._holder = holder
        self._timeout = timeout
        self._repair = repair
        self._thread_lock = threading.Lock()

    def __enter__(self) -> None:
        deadline = time.monotonic() + self._timeout
        if not self._thread_lock.acquire(True, self._timeout):
            raise self._stuck()
        try:
            delay = 1e-5
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._stuck() from None
                    time.sleep(min(delay, left))
                    delay = min(delay * 2, 1e-3)
            holder = int(self._holder[0])
            if holder:  # should the repair fail, the mark stays and the next holder retries
                self._repair(holder)
            self._holder[0] = os.getpid()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        if self._holder[0] == os.getpid():
            self._holder[0] = 0
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _stuck(self) -> TransportError:
        return TransportError(
            f"{self._label}: lock not acquired within {self._timeout} s (held by live process {int(self._holder[0])})"
        )
