"""The executors a test can run over: ``MultiprocDiffusionExecutor`` and ``RayDiffusionExecutor``.

``executor_class(kind, request)``: the class for ``kind`` ("multiproc" or "ray"); for
"ray" it starts the session's Ray instance (tests/conftest.py ``ray_session``), which
skips the test where Ray is not installed.  Both classes take the same arguments for
what the tests use (spec, world_size, deadlines, options, the budget).
``worker_pids(ex)``: per rank, the pid of the worker process or of the rank's actor.
"""

from __future__ import annotations

import pytest

from omni_async.executor.multiproc import MultiprocDiffusionExecutor

KINDS = ("multiproc", "ray")


def executor_class(kind: str, request: pytest.FixtureRequest) -> type[MultiprocDiffusionExecutor]:
    if kind == "ray":
        request.getfixturevalue("ray_session")  # skips where Ray is not installed
        from omni_async.executor.ray_executor import RayDiffusionExecutor

        return RayDiffusionExecutor
    assert kind == "multiproc", kind
    return MultiprocDiffusionExecutor


def worker_pids(ex: MultiprocDiffusionExecutor) -> list[int]:
    pids: list[int] | None = getattr(ex, "pids", None)  # RayDiffusionExecutor's, one per actor
    if pids is not None:
        return list(pids)
    out = [p.pid for p in ex.procs]
    assert all(pid is not None for pid in out), out
    return [pid for pid in out if pid is not None]
