"""RayDiffusionExecutor across two Ray nodes (issue 11): outputs through Ray's object store.

Starts a two-node ``ray.cluster_utils.Cluster`` on this machine (a head with no CPU, where
the driver and the executor run, and a worker node with the CPUs, where the actors land:
two raylets, two object stores), builds the executor with ``transport="auto"`` (so the
actors choose the object store because their node is not the executor's), checks every
output bit for bit, and prints one JSON line: the transport chosen per rank, the nodes,
and GB/s of output delivered (submit -> output in hand -> released) over ``--requests``
requests of ``--mib`` MiB each, ``--in-flight`` at a time.  ``--transport shm`` with
``--one-node`` gives the same-node shared-memory path to compare.

Usage:  PYTHONPATH=src python3 bench/probes/ray_cross_node.py --mib 64 --requests 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from omni_async.core.messages import (
    BatchDiffusionOutput,
    DiffusionOutput,
    DiffusionRequest,
)

if TYPE_CHECKING:
    from omni_async.executor import RequestHandle


class BlobWorker:
    """Returns ``numel`` int32 elements of a fixed pattern (no compute: the transport alone)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._blob = torch.empty(0, dtype=torch.int32)

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        n = int(request.params["numel"])
        if self._blob.numel() < n:
            self._blob = expected(n)
        return DiffusionOutput(request.request_id, {"image": self._blob[:n], "rank": self.rank})

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))


def expected(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32) * 2654435761 % (1 << 31)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=2)
    p.add_argument("--transport", default="auto")
    p.add_argument("--one-node", action="store_true", help="one node (compare the paths on it)")
    a = p.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from omni_async.core.config import Deadlines
    from omni_async.executor.multiproc import WorkerSpec
    from omni_async.executor.ray_executor import RayDiffusionExecutor

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1 if a.one_node else 0, "include_dashboard": False},
    )
    if not a.one_node:
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    n = int(a.mib * (1 << 20)) // 4
    result: dict[str, Any] = {"mib": a.mib, "requests": a.requests, "in_flight": a.in_flight}
    try:
        cluster.wait_for_nodes()
        here = ray.get_runtime_context().get_node_id()
        spec = WorkerSpec("ray_cross_node:BlobWorker", pass_rank=True)  # this file, on the actors' path too
        dl = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
        with RayDiffusionExecutor(spec, deadlines=dl, transport=a.transport, start_timeout=120) as ex:
            result.update(via_store=ex.via_store, driver_node=here, actor_nodes=ex.nodes)
            result["remote"] = [not node.startswith(here) for node in ex.nodes]
            exp = expected(n)

            def one(i: int) -> RequestHandle:
                return ex.submit(DiffusionRequest(f"r{i}", {"numel": n}))

            # warm-up and the bit-exact check
            ro = ex.execute_request(DiffusionRequest("w", {"numel": n}))
            assert ro.async_output_id is not None
            out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
            result["bit_exact"] = bool(torch.equal(out.output["image"], exp))
            del out.output["image"]
            ex.release_output(out)
            t0 = time.perf_counter()
            pending = [one(i) for i in range(min(a.in_flight, a.requests))]
            sent = len(pending)
            ok = True
            while pending:
                out = pending.pop(0).output.result(timeout=120)
                ok = ok and out.output["image"].shape[0] == n
                del out.output["image"]
                ex.release_output(out)
                if sent < a.requests:
                    pending.append(one(sent))
                    sent += 1
            dt = time.perf_counter() - t0
            result.update(
                seconds=round(dt, 3),
                gb_per_s=round(a.requests * n * 4 / dt / 1e9, 3),
                all_sizes_ok=ok,
                stored_outputs_after=ex.stored_outputs(),
            )
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
    print(json.dumps(result))
    return 0 if result.get("bit_exact") else 1


if __name__ == "__main__":
    sys.exit(main())
