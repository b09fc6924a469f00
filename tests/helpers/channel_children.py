"""Process targets for test_channel (spawned children import this module by name).

Kept free of torch so a spawned writer starts in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

from omni_async.core.messages import RpcResult
from omni_async.transport.channel import PipeSender


def write_from_threads(sender: PipeSender, threads: int, per_thread: int) -> None:
    """``threads`` threads each send ``per_thread`` numbered messages through one sender (F7)."""
    errors: list[BaseException] = []

    def run(tid: int) -> None:
        try:
            for i in range(per_thread):
                # A little padding so back-pressure (the byte budget) is exercised too.
                sender.put(RpcResult(f"t{tid}", (tid, i, "x" * 2000)), timeout=30.0)
        except BaseException as exc:  # reported through the exit code
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(t,), name=f"writer-{t}") for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    sender.close()
    if errors:
        raise SystemExit(f"writer errors: {errors!r}")


def write_then_hang(sender: PipeSender, count: int) -> None:
    """Send ``count`` messages, then wait to be SIGKILLed with the pipe still open."""
    for i in range(count):
        sender.put(RpcResult("dying", i), timeout=10.0)
    time.sleep(60)
    os.kill(os.getpid(), signal.SIGKILL)


def write_then_corrupt(sender: PipeSender, count: int) -> None:
    """Send ``count`` messages, then a frame header of negative length (unparseable), and exit."""
    for i in range(count):
        sender.put(RpcResult("corrupt", i), timeout=10.0)
    os.write(sender._conn.fileno(), struct.pack("!i", -2))
    sender.close()
