"""Which CPUs a worker process runs on (``WorkerOptions.cpu_affinity``).

A diffusion forward of many small kernels is bound by the host thread that launches
them, so its speed depends on the CPU that thread runs on.  On a host of several NUMA
nodes (two sockets, eight GPUs) a worker scheduled on the far node from its GPU reaches
the GPU across the socket link, and its Python's memory may sit there too.  Pinning each
worker process to the CPUs its GPU is local to is what the GPU vendors advise
(``nvidia-smi topo -m``'s "CPU Affinity" column); ``cpu_affinity`` does it at start-up,
before the model is built, so the model's host memory is first touched, and placed, on
the pinned node.

* ``None`` (the default): the worker keeps the CPUs it inherited.
* ``"gpu-local"``: the CPUs the kernel lists as local to the rank's GPU
  (``/sys/bus/pci/devices/<address>/local_cpulist``), of those this process may use.
  Where that list is unknown (no such file, a VM that hides the topology) or shares no
  CPU with the allowed ones, the worker keeps its CPUs and logs one line saying why.
* CPU numbers: exactly those, on every rank; one this process may not use fails the
  worker's start (``InvalidConfig``, which the executor raises as
  ``WorkerStartupFailed``), so a typo never passes silently.

Every thread of the process is pinned (the ones started before, too: CUDA's and the
worker's own), and every thread started later inherits it; torch's intra-op threads are
cut to one per pinned CPU where there were more.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from omni_async.core.config import InvalidConfig, given

if TYPE_CHECKING:
    import torch

__all__ = [
    "GPU_LOCAL",
    "CpuAffinity",
    "apply_cpu_affinity",
    "check_cpu_affinity",
    "cpu_affinity_value",
    "format_cpulist",
    "gpu_local_cpus",
    "parse_cpulist",
    "pci_local_cpus",
    "process_cpus",
]

log = logging.getLogger("omni_async.worker")

#: ``WorkerOptions.cpu_affinity``'s value for the CPUs local to the rank's GPU.
GPU_LOCAL = "gpu-local"
#: What ``WorkerOptions.cpu_affinity`` holds: None, ``GPU_LOCAL`` or CPU numbers.
CpuAffinity = str | tuple[int, ...] | None

_FIELD = "WorkerOptions.cpu_affinity"


def cpu_affinity_value(value: str | Iterable[int] | None) -> CpuAffinity:
    """``WorkerOptions.cpu_affinity``'s converter: CPU numbers given as a list, tuple, set
    or range are kept as a tuple (``check_cpu_affinity`` then checks and sorts them);
    anything else is left for it to refuse."""
    if isinstance(value, list | tuple | set | frozenset | range):
        return tuple(value)
    return value  # type: ignore[return-value]  # refused by check_cpu_affinity


def check_cpu_affinity(value: object, device: str) -> CpuAffinity:
    """``value`` as ``WorkerOptions.cpu_affinity`` keeps it (a list of CPUs becomes a
    sorted tuple), or ``InvalidConfig`` naming the field."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != GPU_LOCAL:
            raise InvalidConfig(_FIELD, f"must be None, {GPU_LOCAL!r} or CPU numbers such as (0, 1, 2), got {value!r}")
        if not device.startswith("cuda"):
            raise InvalidConfig(
                _FIELD, f"{GPU_LOCAL!r} pins each worker to its GPU's CPUs, and WorkerOptions.device is {device!r}"
            )
        return GPU_LOCAL
    if isinstance(value, tuple):  # a list, tuple, set or range, as the converter keeps it
        cpus = list(value)
        if cpus and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
            if len(set(cpus)) != len(cpus):
                raise InvalidConfig(_FIELD, f"lists a CPU twice: {cpus}")
            return tuple(sorted(cpus))
    raise InvalidConfig(
        _FIELD, f"must be None, {GPU_LOCAL!r} or a non-empty list of CPU numbers (ints >= 0), got {given(value)}"
    )


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list (``"0-3,8,10-11"``, as sysfs and ``taskset -c`` write it)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"CPU range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``cpus`` as a kernel CPU list, runs folded: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def process_cpus() -> frozenset[int]:
    """The CPUs this process's calling thread may run on."""
    return frozenset(os.sched_getaffinity(0))


def pci_local_cpus(address: str, sysfs: str = "/sys/bus/pci/devices") -> frozenset[int] | None:
    """The CPUs the kernel lists as local to PCI device ``address`` (``"0000:19:00.0"``);
    None where it lists none (no such device or file, or an empty list)."""
    try:
        with open(os.path.join(sysfs, address.lower(), "local_cpulist"), encoding="ascii") as fh:
            cpus = parse_cpulist(fh.read())
    except (OSError, ValueError):
        return None
    return cpus or None


def _pci_address(device: torch.device) -> str | None:
    """The PCI address of CUDA device ``device``, from the properties torch reads, or by
    its UUID from the NVIDIA driver's ``/proc`` entries; None if neither says."""
    import torch

    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int):
        domain = int(getattr(props, "pci_domain_id", 0) or 0)
        dev = int(getattr(props, "pci_device_id", 0) or 0)
        return f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    uuid = str(getattr(props, "uuid", "") or "").lower().removeprefix("gpu-")
    root = "/proc/driver/nvidia/gpus"
    if not uuid or not os.path.isdir(root):
        return None
    for address in sorted(os.listdir(root)):
        try:
            with open(os.path.join(root, address, "information"), encoding="utf-8") as fh:
                text = fh.read().lower()
        except OSError:
            continue
        if uuid in text:
            return address
    return None


def gpu_local_cpus(device: torch.device) -> tuple[frozenset[int] | None, str]:
    """The CPUs local to CUDA device ``device`` and where that came from (for the log
    line); (None, why) when unknown."""
    address = _pci_address(device)
    if address is None:
        return None, f"{device}'s PCI address is not known here"
    cpus = pci_local_cpus(address)
    if cpus is None:
        return None, f"the kernel lists no local CPUs for {device} at {address}"
    return cpus, f"local to {device} at {address}"


def _pin_every_thread(cpus: frozenset[int]) -> None:
    """Pin every thread of this process to ``cpus`` (a thread that ended meanwhile is skipped)."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue


def apply_cpu_affinity(choice: CpuAffinity, device: torch.device, rank: int) -> frozenset[int] | None:
    """Pin this process (every thread) as ``choice`` says (module docstring); the CPUs it
    now runs on, or None where it kept its own.  ``InvalidConfig`` for CPU numbers this
    process may not use."""
    if choice is None or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = process_cpus()
    if choice == GPU_LOCAL:
        local, where = gpu_local_cpus(device)
        cpus = None if local is None else local & allowed
        if not cpus:
            why = where if local is None else f"none of the CPUs {where} ({format_cpulist(local)}) is allowed here"
            log.warning(
                "omni-worker-%d: cpu_affinity=%r: %s; the worker keeps CPUs %s",
                rank,
                GPU_LOCAL,
                why,
                format_cpulist(allowed),
            )
            return None
    else:
        assert isinstance(choice, tuple)
        cpus = frozenset(choice)
        refused = cpus - allowed
        if refused:
            raise InvalidConfig(
                _FIELD,
                f"names CPUs {format_cpulist(refused)}, which worker rank {rank}'s process may not use (it may use "
                f"{format_cpulist(allowed)}); name CPUs from that list, or {GPU_LOCAL!r}",
            )
        where = "as asked"
    _pin_every_thread(cpus)
    _fit_intra_op_threads(len(cpus))
    log.info("omni-worker-%d: pinned to CPUs %s (%s)", rank, format_cpulist(cpus), where)
    return cpus


def _fit_intra_op_threads(count: int) -> None:
    """At most one torch intra-op thread per pinned CPU: its pool was sized from the CPUs
    before the pin, and more threads than CPUs spin against each other at every barrier
    (a CPU forward ran 10x slower pinned to one CPU with two threads)."""
    import torch

    if torch.get_num_threads() > count:
        torch.set_num_threads(count)
