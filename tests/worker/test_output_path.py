"""The worker's extension point for output paths (``omni_async.worker.output_path``):
an ``OutputPath`` given by import path packs in the worker process and is read and freed
in the executor's; a value that names none is refused when the options are made; and the
default path never loads the bench's comparison paths."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import output_paths
from omni_async import DiffusionRequest, MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.core.config import Deadlines, InvalidConfig
from omni_async.models.synthetic import DTYPES, synthetic_output
from omni_async.worker.output_path import InvalidOutputPath, check_output_path

SYNTH = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker")
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
BOXED = "helpers.output_paths:BOXED"


@pytest.mark.parametrize("step_mode", [False, True])
def test_a_path_given_by_import_path_packs_in_the_worker_and_is_read_and_freed_in_the_executor(
    step_mode: bool,
) -> None:
    """``BOXED`` (step_mode None: either mode) through a real worker process: the output
    arrives unboxed (the executor's store called ``receive``), packed by the worker (its
    pid in the box), with the model's values; an output dropped unread is handed to
    ``discard`` in the executor's process."""
    with MultiprocDiffusionExecutor(
        SYNTH, step_mode=step_mode, deadlines=DEADLINES, options=WorkerOptions(output_path=BOXED)
    ) as ex:
        params = {"shape": (2, 64, 64), "dtype": "float32", "seed": 3}
        ro = ex.execute_request(DiffusionRequest("a", params))
        if step_mode:
            assert ro.result is not None
            out = ro.result
        else:
            assert ro.async_output_id is not None
            out = ex.wait_output_ready(ro.async_output_id).result(timeout=60)
        assert out.output["packed_in"] == ex.procs[0].pid != os.getpid()
        assert torch.equal(out.output["video"], synthetic_output((2, 64, 64), DTYPES["float32"], 3, "cpu"))
        ex.release_output(out)
        if not step_mode:
            ro = ex.execute_request(DiffusionRequest("d", params))
            assert ro.async_output_id is not None
            deadline = time.monotonic() + 30
            while ex.metrics().held_payloads < 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # its OUTPUT_READY reached the executor (a drop before goes to the worker)
            assert output_paths.DISCARDED == []
            ex.drop_output(ro.async_output_id).result(timeout=60)
            while not output_paths.DISCARDED and time.monotonic() < deadline:
                time.sleep(0.01)
            assert output_paths.DISCARDED == [ro.async_output_id]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("fast", "must be one of"),
        (":BOXED", "must be one of"),
        ("helpers.output_paths:", "must be one of"),
        ("helpers.no_such_module:BOXED", "cannot import 'helpers.no_such_module'"),
        ("helpers.output_paths:MISSING", "not an OutputPath"),
        ("helpers.output_paths:NOT_A_PATH", "not an OutputPath"),
        ("helpers.output_paths:BoxedPath", "not an OutputPath"),  # the class, not a path
        ("helpers.output_paths:BAD_STEP_MODE", "step_mode must be True, False or None"),
    ],
)
def test_a_value_that_names_no_output_path_is_refused_when_the_options_are_made(value: str, problem: str) -> None:
    with pytest.raises(InvalidOutputPath, match=problem) as info:
        WorkerOptions(output_path=value)
    assert str(info.value).startswith("WorkerOptions.output_path=") and info.value.value == value


def test_a_value_that_is_no_string_is_an_invalid_config_naming_the_field() -> None:
    with pytest.raises(InvalidConfig, match="must be one of") as info:
        WorkerOptions(output_path=5)  # type: ignore[arg-type]  # the mistake under test
    assert info.value.field == "WorkerOptions.output_path"


def test_the_registered_names_and_their_import_paths_are_one_path_each() -> None:
    from omni_async.bench.paths import REFERENCE, SYNC

    assert check_output_path("sync") is SYNC is check_output_path("omni_async.bench.paths:SYNC")
    assert check_output_path("reference", step_mode=False) is REFERENCE
    assert check_output_path(BOXED, step_mode=True) is check_output_path(BOXED, step_mode=False)
    with pytest.raises(InvalidOutputPath, match="step mode"):
        check_output_path("omni_async.bench.paths:SYNC", step_mode=False)


def test_the_default_path_never_loads_the_bench_package() -> None:
    """Options, configs and the executor's module on the default path leave
    ``omni_async.bench`` unimported; naming a comparison path imports it (the check can fail)."""
    code = (
        "import sys\n"
        "from omni_async import WorkerOptions\n"
        "from omni_async.executor.config import ExecutorConfig\n"
        "import omni_async.executor.multiproc, omni_async.worker.host, omni_async.cli.bench\n"
        "ExecutorConfig(options=WorkerOptions(), step_mode=True)\n"
        "before = 'omni_async.bench' in sys.modules\n"
        "WorkerOptions(output_path='sync')\n"
        "print(before, 'omni_async.bench' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
