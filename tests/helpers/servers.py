"""``omni-async serve`` in a subprocess, for the tests that drive it over HTTP.

``started_server(*options)`` runs the real command (``python -m omni_async.cli serve
--port 0 ...``), waits for its "ready at URL" line and returns a ``ServerProcess``;
``stop()`` sends SIGTERM and returns the exit status.  Its shared memory (the pool its
executor makes: ``omni-<pid>-...``) is excluded from the per-test leak check while it
lives (``helpers.leaks.LONG_LIVED``); ``left_behind()`` lists what of it remains (after a
stop: nothing may).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from helpers.leaks import LONG_LIVED
from omni_async.transport.shm import files

_READY = re.compile(r"ready at (http://\S+)")
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


class ServerProcess:
    """A running ``omni-async serve``; its output is collected on a thread."""

    def __init__(self, *options: str, start_timeout: float = 60.0, own_group: bool = False) -> None:
        """``own_group``: the server leads a process group of its own (for ``stop(group=True)``)."""
        # This checkout's sources first, then whatever the suite was given (a device run's
        # packages come on PYTHONPATH).
        path = [os.path.abspath(SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        cmd = [sys.executable, "-m", "omni_async.cli", "serve", "--port", "0", *options]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=own_group
        )
        self.prefix = f"{files.SHM_PREFIX_ROOT}{self.proc.pid}-"
        LONG_LIVED.add(self.prefix)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, name="serve-output", daemon=True).start()
        if not self._ready.wait(start_timeout) or not self.url:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"omni-async serve did not start: {self.output()}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _READY.search(line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0, *, group: bool = False) -> int:
        """Send ``sig`` (``group``: to the server's whole process group, as systemd's stop and a
        terminal's Ctrl-C do; the server must have ``own_group``) and wait for the exit; its
        status (SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            if group:
                assert os.getpgid(self.proc.pid) == self.proc.pid, (
                    "stop(group=True) needs ServerProcess(own_group=True)"
                )
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            LONG_LIVED.discard(self.prefix)
        return code

    def left_behind(self) -> list[str]:
        """This server's segments, lock files and semaphores still in /dev/shm."""
        return files.entries(self.prefix) + files.entries(files.SEM_FILE_PREFIX + self.prefix)


def started_server(*options: str) -> Iterator[ServerProcess]:
    """The body of a module-scoped fixture (``yield from``): a server for the module; after
    the module, stopped with SIGTERM: exit 0 and nothing of it left in /dev/shm."""
    server = ServerProcess(*options)
    try:
        yield server
    finally:
        code = server.stop()
        deadline = time.monotonic() + 5
        while server.left_behind() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert code == 0, server.output()
    assert not server.left_behind(), server.left_behind()
