"""Worker models whose ranks share a process group (imported by name in spawned workers
and Ray actors): ``WorkerSpec("helpers.dist_workers:CollectiveWorker", pass_dist=True)``."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.worker.dist import DistContext


class CollectiveWorker:
    """Each forward all-reduces ``rank + 1`` over the group: every rank's output is
    ``world_size * (world_size + 1) / 2``.  ``die_rank`` (a request param) SIGKILLs that
    rank, ``hang_rank`` puts it to sleep for ``hang_s``, after the others entered the
    collective (``enter_s`` later), so they wait inside it for a peer that never comes."""

    def __init__(self, dist: DistContext, rank: int | None = None) -> None:
        self.ctx = dist
        self.rank = rank  # pass_rank beside pass_dist: both arrive

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        p = request.params
        if p.get("die_rank") == self.ctx.rank:
            time.sleep(float(p.get("enter_s", 0.5)))
            os.kill(os.getpid(), signal.SIGKILL)
        if p.get("hang_rank") == self.ctx.rank:
            time.sleep(float(p.get("hang_s", 3600)))
        t = torch.full((int(p.get("numel", 4)),), float(self.ctx.rank + 1), device=self.ctx.device)
        dist.all_reduce(t, group=self.ctx.group)
        return DiffusionOutput(request.request_id, {"sum": t.cpu()})

    def dist_info(self) -> dict[str, object]:
        return {
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "backend": self.ctx.backend,
            "device": str(self.ctx.device),
            "reply_rank": self.ctx.reply_rank,
            "pass_rank": self.rank,
            "group_size": dist.get_world_size(self.ctx.group),
            "pid": os.getpid(),
        }
