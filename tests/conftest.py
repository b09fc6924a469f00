"""Shared test configuration.

* Hypothesis profiles: ``ci`` (derandomized, no example database) is loaded when
  ``CI`` is set, ``dev`` otherwise.
* Every test checks that it left no shared-memory segment of ours in /dev/shm.
* ``ray_session``: one local Ray instance for every module that needs one (its start
  is the dear part), started on first use, shut down at the end of the session;
  skips the test where Ray is not installed (CI installs it with ``.[dev]``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

from helpers.leaks import ours

from omni_async.transport.shm import SHM_DIR


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Fail the test if it leaves a segment with the project's prefix behind."""
    before = ours()
    yield
    leaked = ours() - before
    if leaked:
        for name in leaked:  # clean up so one leak does not fail every later test
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        pytest.fail(f"test leaked shared-memory segments: {sorted(leaked)}")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[ModuleType]:
    """The ``ray`` module, initialised: 4 logical CPUs (two executors of two ranks may be
    up at once; the machine has 2), no dashboard, actors' logs kept out of the output."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
