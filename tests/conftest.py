"""Shared test configuration.

* Hypothesis profiles: ``ci`` (derandomized, no example database) is loaded when
  ``CI`` is set, ``dev`` otherwise.  The fast tier (a mark expression that deselects
  ``slow``, as in ``pytest -m "not slow"``) loads ``ci-fast`` or ``dev-fast`` instead:
  the same, with a fifth of the examples (``helpers.hypo.examples`` scales the tests
  that set their own count); ``--hypothesis-profile`` still wins.
* The session tags its shared-memory files (``OMNI_ASYNC_SHM_TAG``, helpers/leaks.py):
  every test checks that it left no segment or lock file of this session in
  /dev/shm, and blames nothing else (another suite, engine or crashed run on the
  machine); the executors it builds sweep only this session's dead files.
* Under ``pytest -n auto`` (pytest-xdist; README's test command) each worker is a
  session of its own, with its own tag.  The test that checks the traces other tests
  recorded is moved to the end of the collection.
* One intra-op thread per process (``OMP_NUM_THREADS=1``, set before torch loads and
  inherited by every worker process a test starts), unless the environment says
  otherwise: under ``-n auto`` every core already runs a test, and torch's intra-op
  threads then wait on each other at every op (a tiny DiT call took 0.88 s on two
  threads against 0.012 s on one on the 2-core machine).  Outputs do not depend on it.
* ``ray_session``: one local Ray instance for every module that needs one (its start
  is the dear part), started on first use, shut down at the end of the session;
  skips the test where Ray is not installed (CI installs it with ``.[dev]``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (the docstring says why)

import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from helpers.hypo import FAST_MAX_EXAMPLES

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
_PROFILE = "ci" if os.environ.get("CI") else "dev"
for _name in ("ci", "dev"):
    settings.register_profile(f"{_name}-fast", parent=settings.get_profile(_name), max_examples=FAST_MAX_EXAMPLES)
settings.load_profile(_PROFILE)

from helpers.leaks import ours, tag_session  # noqa: E402 (after the profile is loaded)
from omni_async.transport.shm import SHM_DIR  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Tag this session's shared memory; the fast tier (``-m "not slow"``) runs the
    Hypothesis tests with fewer examples."""
    tag_session()  # before any test builds a pool (children inherit the tag)
    if config.getoption("hypothesis_profile", None) is None and deselects_slow(config.getoption("markexpr", "")):
        settings.load_profile(f"{_PROFILE}-fast")


# Checks what the other tests of its session (or xdist worker) recorded: it runs last.
_LAST = "test_traces_collected_by_other_tests_are_behaviours"


# The longest tests (TLC's models and trace checks: most of the full run's time), run first.
_FIRST_FILES = ("test_tlc_models.py", "test_trace_validation.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the longest tests to the front and the test that checks the traces other
    tests collected to the end.  Under ``-n auto`` (``--dist worksteal``) the front
    goes to one worker while the other starts on the short tests, and an idle worker
    steals from the end of the other's queue: the run ends on short tests, both cores
    busy until then, instead of on one TLC model with the other core idle."""
    items.sort(key=lambda item: (item.name == _LAST, item.path.name not in _FIRST_FILES))  # stable


def deselects_slow(markexpr: str) -> bool:
    """Whether a ``-m`` expression is the fast tier's: it deselects the ``slow`` tests."""
    return re.search(r"\bnot\s+slow\b", markexpr) is not None


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
    """The ``ray`` module, connected to a local two-node cluster (``ray.cluster_utils.Cluster``:
    two raylets, two object stores on this machine), as issue 11 asks of CI.

    The head node (where the driver and every executor run) carries the custom resource
    ``HEAD_NODE``, the other ``OTHER_NODE`` (tests/helpers/executors.py), so a test puts a
    rank on either node by its bundle.  4 logical CPUs each (the machine has 2; the
    actors mostly wait).  No dashboard; the actors' logs are kept out of the output.  At
    the end no actor of ours may be alive and the object stores must hold no output."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from helpers.executors import HEAD_NODE, OTHER_NODE, leftover_actors, plasma_objects

    store = 256 << 20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {HEAD_NODE: 64},
            "object_store_memory": store,
            "include_dashboard": False,
        },
    )
    _CLUSTER[:] = [cluster]
    try:
        cluster.add_node(num_cpus=4, resources={OTHER_NODE: 64}, object_store_memory=store)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield ray
        # Issue 11: no actor left, every stored output freed, whatever ran (once the
        # garbage of the last tests -- cycles through their frames -- is collected).
        import gc

        gc.collect()
        deadline = time.monotonic() + 20  # Ray frees and reaps asynchronously
        while (leftover_actors() or plasma_objects()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not leftover_actors(), f"Ray actors left alive: {leftover_actors()}"
        if plasma_objects():
            from ray._private.internal_api import memory_summary

            address = ray.get_runtime_context().gcs_address
            summary = memory_summary(address=address)  # type: ignore[no-untyped-call]
            pytest.fail(f"objects left in the Ray object stores:\n{summary}")
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        _CLUSTER.clear()


_CLUSTER: list[Any] = []


@pytest.fixture
def local_cluster(ray_session: ModuleType) -> Any:
    """The session's ``ray.cluster_utils.Cluster``: for a test that adds a node (and loses it)."""
    return _CLUSTER[0]
