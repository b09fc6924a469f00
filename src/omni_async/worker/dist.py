"""A rank's process group: how a model split across ranks meets its peers.

An executor with ``process_group`` on (``omni_async.executor.config.ProcessGroupConfig``)
owns a rendezvous and sends each rank a ``Rendezvous``: where to meet, the backend, the
collective timeout.  ``join_process_group`` runs on the rank before its model is built
(``build_worker``): it initialises ``torch.distributed``'s default group on the rank's
device and returns the ``DistContext`` that a factory asks for with
``WorkerSpec(..., pass_dist=True)``.  ``leave_process_group`` destroys it when the rank
stops.

Two rendezvous, both private to one executor, so two executors on one machine never
meet each other's ranks:

* ``tcp://host:port``: a ``torch.distributed.TCPStore`` that the executor itself hosts on
  a port the kernel chose for it (port 0: no window between "found free" and "bound");
  the ranks connect to it as clients.  On Ray the executor hosts it on the driver's node.
* ``file://path``: a ``FileStore`` in a temporary directory the executor made (mode
  0700) and removes at shutdown; the ranks must share the file system (one machine).

Why not ``MASTER_ADDR``/``MASTER_PORT`` in the environment: they are per process, and two
executors in one engine process would hand their ranks the same address.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Literal

import attrs

from omni_async.core.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["Backend", "DistContext", "Rendezvous", "backend_for", "join_process_group", "leave_process_group"]

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[Backend, ...] = ("gloo", "nccl")


def backend_for(device: str) -> Backend:
    """The backend a device's ranks use by default: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.startswith("cuda") else "gloo"


@attrs.frozen
class Rendezvous:
    """Where the ranks of one executor meet, sent to every rank (it pickles).

    ``address``: ``"tcp://host:port"`` (a store the executor hosts) or ``"file:///path"``;
    ``backend``: ``"gloo"`` or ``"nccl"`` (None: ``backend_for`` the rank's device);
    ``timeout``: seconds a rank waits in one collective (and in the rendezvous) before
    it fails; ``reply_rank``: the rank that ships the outputs (``DistContext.reply_rank``).
    """

    address: str
    world_size: int
    backend: Backend | None
    timeout: float
    reply_rank: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.address.startswith(("tcp://", "file://")):
            raise UsageError(f"Rendezvous.address must be 'tcp://host:port' or 'file:///path', got {self.address!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise UsageError(f"Rendezvous.backend must be one of {BACKENDS} or None, got {self.backend!r}")


@attrs.frozen
class DistContext:
    """What a model split across ranks knows about its world, handed to its factory as
    ``dist=`` (``WorkerSpec(..., pass_dist=True)``).

    ``rank`` and ``world_size``; ``device``: this rank's device (``cuda:<rank>`` with
    ``WorkerOptions(device="cuda")`` on a machine with that many GPUs); ``group``: the
    process group of every rank of the executor (``torch.distributed``'s default group,
    initialised before the factory runs: pass it to collectives); ``backend``: ``"gloo"``
    or ``"nccl"``; ``reply_rank``: the rank whose output is shipped -- the others'
    outputs are discarded, so their model may skip work whose only use is the output
    (a decoder)."""

    rank: int
    world_size: int
    device: torch.device
    group: ProcessGroup = attrs.field(repr=False)
    backend: Backend
    reply_rank: int = 0

    @property
    def is_reply_rank(self) -> bool:
        return self.rank == self.reply_rank


def join_process_group(rank: int, rendezvous: Rendezvous, device: torch.device) -> DistContext:
    """Initialise ``torch.distributed``'s default process group for ``rank`` on ``device``
    (on the calling thread; it blocks until every rank joined, or ``rendezvous.timeout``)."""
    import torch.distributed as dist

    # torch.distributed re-exports the stores from here; its stubs do not mark them exported.
    from torch._C._distributed_c10d import FileStore, Store, TCPStore

    if not dist.is_available():
        raise UsageError("process_group needs torch.distributed, which this build of torch lacks")
    if dist.is_initialized():
        raise UsageError(
            f"rank {rank}: torch.distributed is already initialised in this process; a rank joins the "
            "executor's process group itself (do not call init_process_group in the factory's module)"
        )
    backend: Backend = rendezvous.backend or backend_for(device.type)
    timeout = datetime.timedelta(seconds=rendezvous.timeout)
    if rendezvous.address.startswith("tcp://"):
        host, _, port = rendezvous.address.removeprefix("tcp://").rpartition(":")
        store: Store = TCPStore(host, int(port), is_master=False, timeout=timeout)
    else:
        store = FileStore(rendezvous.address.removeprefix("file://"), rendezvous.world_size)
    # The store is prefixed per executor incarnation by its address already; a rank that
    # joins late fails the others' rendezvous after ``timeout`` (the executor's start-up
    # bound usually fires first and stops every rank).
    dist.init_process_group(backend, store=store, rank=rank, world_size=rendezvous.world_size, timeout=timeout)
    group = dist.group.WORLD
    assert group is not None  # just initialised
    return DistContext(
        rank=rank,
        world_size=rendezvous.world_size,
        device=device,
        group=group,
        backend=backend,
        reply_rank=rendezvous.reply_rank,
    )


def leave_process_group() -> None:
    """Destroy this process's default group, if any (a rank stopping); never raises: a
    peer that died already must not turn a clean stop into a crash."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort: the process is about to exit
        log.debug("destroying the process group failed", exc_info=True)
