"""``WorkerOptions.cpu_affinity``: which CPUs a worker process runs on.

Real worker processes (``MultiprocDiffusionExecutor`` with the tiny model), read back from
``/proc/<pid>/task/*/status`` (the kernel's own record of every thread's CPUs); the
GPU-local choice on the device only (``cuda``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.executors import worker_pids
from omni_async.core.config import InvalidConfig
from omni_async.core.errors import WorkerStartupFailed
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.worker.affinity import GPU_LOCAL, format_cpulist, parse_cpulist, pci_local_cpus
from omni_async.worker.host import WorkerOptions

TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker")


def output_of(ex: MultiprocDiffusionExecutor, request_id: str) -> object:
    """The output of one request run on ``ex`` (its claim waited for)."""
    claim = ex.execute_request(DiffusionRequest(request_id, {})).async_output_id
    assert claim is not None
    return ex.wait_output_ready(claim).result(timeout=60).output


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of process ``pid`` and the CPUs it may run on, as the kernel reports them."""
    out: dict[int, frozenset[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        line = next(x for x in text.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(tid)] = parse_cpulist(line.split(":", 1)[1])
    return out


@given(st.frozensets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_reads_back_what_it_was_written_from(cpus: frozenset[int]) -> None:
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == cpus
    assert ",," not in text and not text.startswith(",")


def test_cpu_lists_read_as_the_kernel_writes_them() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist([5, 0, 1, 2]) == "0-2,5"
    with pytest.raises(ValueError, match="backwards"):
        parse_cpulist("4-2")


def test_the_kernels_local_cpus_of_each_pci_device_are_cpus_of_this_machine() -> None:
    """Read from the real sysfs: every PCI device's local CPUs are among the machine's."""
    root = Path("/sys/bus/pci/devices")
    if not root.is_dir():
        pytest.skip("no PCI devices in sysfs here")
    possible = parse_cpulist(Path("/sys/devices/system/cpu/possible").read_text())
    seen = 0
    for dev in sorted(root.iterdir()):
        cpus = pci_local_cpus(dev.name)
        if (dev / "local_cpulist").exists():
            assert cpus is not None and cpus <= possible, (dev.name, cpus, possible)
            seen += 1
    assert pci_local_cpus("ffff:ff:1f.7") is None  # no such device
    assert seen > 0


@pytest.mark.parametrize(
    ("value", "device", "words"),
    [
        ("gpu-local", "cpu", "'gpu-local' pins each worker to its GPU's CPUs, and WorkerOptions.device is 'cpu'"),
        ("local", "cpu", "must be None, 'gpu-local' or CPU numbers"),
        ([], "cpu", "non-empty list of CPU numbers"),
        ([0, -1], "cpu", "non-empty list of CPU numbers"),
        ([True], "cpu", "non-empty list of CPU numbers"),
        ([2, 2], "cpu", "lists a CPU twice"),
        (3, "cpu", "got 3 (int)"),
    ],
)
def test_a_bad_affinity_fails_when_the_options_are_made(value: object, device: str, words: str) -> None:
    with pytest.raises(InvalidConfig, match="WorkerOptions.cpu_affinity") as caught:
        WorkerOptions(device=device, cpu_affinity=value)  # type: ignore[arg-type]
    assert words in str(caught.value)


def test_cpu_numbers_are_kept_sorted_and_gpu_local_is_taken_for_cuda() -> None:
    assert WorkerOptions(cpu_affinity=[3, 1]).cpu_affinity == (1, 3)
    assert WorkerOptions(device="cuda", cpu_affinity=GPU_LOCAL).cpu_affinity == GPU_LOCAL
    assert WorkerOptions().cpu_affinity is None


def test_a_worker_asked_for_one_cpu_runs_every_thread_there_and_serves() -> None:
    """Pinned at start-up: every thread of the worker process (its own, torch's, the ones
    started before the pin) may run only on the CPU asked for, and requests still run."""
    allowed = sorted(os.sched_getaffinity(0))
    target = allowed[-1]
    with MultiprocDiffusionExecutor(TINY, options=WorkerOptions(cpu_affinity=[target])) as ex:
        assert ex.execute_request(DiffusionRequest("pinned", {"steps": 2})).request_id == "pinned"
        (pid,) = worker_pids(ex)
        threads = thread_cpus(pid)
        assert len(threads) > 3, threads  # the worker's threads, not just its main one
        assert set(threads.values()) == {frozenset({target})}, threads
    # The executor's own process is left as it was.
    assert sorted(os.sched_getaffinity(0)) == allowed


def test_cpus_the_process_may_not_use_fail_the_start_naming_them() -> None:
    """A CPU outside this process's set (a typo, another container's) fails the executor's
    start with the field, the CPUs and the ones allowed (and leaves no segment: the
    suite's own check after every test)."""
    allowed = os.sched_getaffinity(0)
    outside = max(allowed) + 4096
    with pytest.raises(WorkerStartupFailed) as caught:
        MultiprocDiffusionExecutor(TINY, options=WorkerOptions(cpu_affinity=[outside]))
    text = str(caught.value)
    assert "WorkerOptions.cpu_affinity" in text and f"names CPUs {outside}" in text
    assert f"may use {format_cpulist(allowed)}" in text


def test_serve_takes_a_cpu_list_or_gpu_local_and_refuses_the_rest() -> None:
    """``omni-async serve --cpu-affinity``: a CPU list or gpu-local reach the workers'
    options; gpu-local on the CPU is refused naming the field (the command exits 2)."""
    from omni_async.cli import build_parser, options
    from omni_async.cli.serve import config_of

    assert options.cpu_affinity("0-2,5") == (0, 1, 2, 5)
    assert options.cpu_affinity("gpu-local") == GPU_LOCAL
    for bad in ("", "x", "3-1", "gpu"):
        with pytest.raises(argparse.ArgumentTypeError, match="gpu-local or a CPU list"):
            options.cpu_affinity(bad)
    args = build_parser().parse_args(["serve", "--model", "tiny", "--cpu-affinity", "0"])
    assert config_of(args).worker_options().cpu_affinity == (0,)
    args = build_parser().parse_args(["serve", "--model", "tiny", "--cpu-affinity", "gpu-local"])
    with pytest.raises(InvalidConfig, match="WorkerOptions.cpu_affinity"):
        config_of(args)


@pytest.mark.cuda
def test_a_gpu_local_worker_runs_on_its_gpus_cpus() -> None:
    """On the device: the worker's threads run on the CPUs sysfs lists as local to its
    GPU (of the ones allowed), or keep the executor's where the kernel lists none."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from omni_async.worker.affinity import gpu_local_cpus

    local, _where = gpu_local_cpus(torch.device("cuda", 0))
    allowed = frozenset(os.sched_getaffinity(0))
    want = (local & allowed) or allowed if local is not None else allowed
    opts = WorkerOptions(device="cuda:0", cpu_affinity=GPU_LOCAL)
    with MultiprocDiffusionExecutor(TINY, options=opts) as ex:
        ex.execute_request(DiffusionRequest("local", {"steps": 2}))
        (pid,) = worker_pids(ex)
        assert set(thread_cpus(pid).values()) == {want}


def test_a_pinned_worker_runs_no_more_torch_threads_than_its_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its intra-op pool was sized before the pin (here two threads, from the environment
    the worker inherits): cut to the one pinned CPU (more threads than CPUs spin against
    each other; a CPU forward ran 10x slower)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    spec = WorkerSpec("helpers.mp_workers:TorchThreadsWorker")
    allowed = frozenset(os.sched_getaffinity(0))
    one = [min(allowed)]
    with MultiprocDiffusionExecutor(spec) as ex:
        # Unpinned: the executor's CPUs, and the pool as the environment sized it.
        assert output_of(ex, "unpinned") == {"threads": 2}
        (pid,) = worker_pids(ex)
        assert set(thread_cpus(pid).values()) == {allowed}
    with MultiprocDiffusionExecutor(spec, options=WorkerOptions(cpu_affinity=one)) as ex:
        assert output_of(ex, "pinned") == {"threads": 1}
