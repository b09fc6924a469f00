"""The executor's end of its ranks' process group: the rendezvous it owns.

``GroupRendezvous`` is made by an executor with ``process_group`` on, before its ranks
start, and closed after they stopped (``RankLink.stop``).  It owns what the ranks
meet at -- a ``TCPStore`` served from this process on a port the kernel picked, or a
file in a private temporary directory -- so that its lifetime is the executor's and
two executors never share one.  The ranks' side is ``omni_async.worker.dist``.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import tempfile

from omni_async.core.config import Deadlines
from omni_async.executor.config import ExecutorConfig, InvalidConfig, ProcessGroupConfig
from omni_async.worker.dist import Rendezvous, backend_for
from omni_async.worker.host import WorkerSpec

__all__ = ["DEFAULT_GROUP_TIMEOUT", "GroupRendezvous", "check_process_group"]

log = logging.getLogger(__name__)

# The collective timeout when the compute deadline is off (``ProcessGroupConfig.timeout``).
DEFAULT_GROUP_TIMEOUT = 600.0


def check_process_group(spec: WorkerSpec, cfg: ExecutorConfig) -> ProcessGroupConfig | None:
    """The process group ``cfg`` asks for (None: none), refused (``InvalidConfig``) where
    it cannot work: a factory that wants ``dist=`` without one, NCCL without CUDA."""
    pg = cfg.process_group_config
    if pg is None:
        if spec.pass_dist:
            raise InvalidConfig(
                "process_group",
                f"is off, but WorkerSpec({spec.factory!r}, pass_dist=True) asks for the ranks' process group: "
                "pass process_group=True (or a ProcessGroupConfig)",
            )
        return None
    device = cfg.worker_options.device
    if pg.backend == "nccl" and backend_for(device) != "nccl":
        raise InvalidConfig(
            "process_group.backend",
            f"'nccl' needs CUDA ranks, but WorkerOptions.device is {device!r}: use 'gloo' (or None: by device)",
        )
    return pg


class GroupRendezvous:
    """Where this executor's ranks meet (``rendezvous``, sent to every rank), owned until ``close``.

    ``host``: the address the ranks reach this process at (``127.0.0.1`` for worker
    processes; the driver node's address for Ray actors).
    """

    def __init__(
        self, pg: ProcessGroupConfig, cfg: ExecutorConfig, deadlines: Deadlines, *, host: str = "127.0.0.1"
    ) -> None:
        # torch.distributed re-exports it from here; its stubs do not mark it exported.
        from torch._C._distributed_c10d import TCPStore

        timeout = pg.timeout or deadlines.compute_timeout or DEFAULT_GROUP_TIMEOUT
        self._store: TCPStore | None = None
        self._dir: str | None = None
        if pg.rendezvous == "tcp":
            # Port 0: the kernel binds a free port for this store, and it stays ours until
            # close -- no window in which another executor could take it.
            self._store = TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
            )
            address = f"tcp://{host}:{self._store.port}"
        else:
            self._dir = tempfile.mkdtemp(prefix="omni-pg-")  # mode 0700: nobody else's ranks
            address = f"file://{self._dir}/rendezvous"
        self.rendezvous = Rendezvous(address, cfg.world_size, pg.backend, float(timeout), reply_rank=cfg.reply_rank)

    @property
    def address(self) -> str:
        return self.rendezvous.address

    def close(self) -> None:
        """Stop serving the store / remove the directory (idempotent); after the ranks stopped."""
        self._store = None  # the last reference: the store's server stops with it
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
