"""``engine_snapshot``: ``AsyncDiffusionEngine.metrics()`` gathered from the engine's
collaborators (each counts its own) and the executor's ``metrics()``."""

from __future__ import annotations

import asyncio
import logging
import time

from omni_async.core.errors import OmniAsyncError
from omni_async.engine.admission import Admission
from omni_async.engine.driver import RequestDriver
from omni_async.engine.metrics import STAGES, EngineMetrics, LatencyHistogram
from omni_async.engine.postprocessor import PostProcessor
from omni_async.engine.sinks import OutputFiles, SegmentLeases
from omni_async.engine.streaming import StreamReader
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.metrics import ExecutorMetrics

__all__ = ["engine_snapshot"]

log = logging.getLogger("omni_async.engine.engine")


def engine_snapshot(
    admission: Admission,
    post: PostProcessor,
    driver: RequestDriver | None,
    streams: StreamReader | None,
    executor: DiffusionExecutor | None,
    loop_task: asyncio.Task[None] | None,
    files: OutputFiles,
    leases: SegmentLeases,
) -> EngineMetrics:
    """The snapshot, on the engine's event loop (the collaborators are read unlocked).
    ``driver``, ``streams``, ``executor``, ``loop_task``: None before the start built them."""
    s = admission.scheduler
    now = time.monotonic()
    ex_metrics: ExecutorMetrics | None = None
    pump_alive = executor_healthy = False
    if executor is not None:
        try:
            ex_metrics = executor.metrics()
        except OmniAsyncError as exc:  # shut down: the engine's numbers still count
            log.debug("engine metrics: the executor's are unavailable: %s", exc)
        pump_alive = executor.pump.healthy()
        try:
            executor.check_health()
            executor_healthy = True
        except OmniAsyncError:
            pass
    task = loop_task
    return EngineMetrics(
        requests=dict(admission.counts),
        waiting=0 if s is None else s.waiting,
        running=0 if s is None else s.running,
        holding=0 if s is None else s.holding,
        postprocessing=post.in_progress,
        in_flight_limit=None if s is None else s.in_flight_limit,
        budget_waits=0 if s is None else s.stats.budget_waits,
        budget_wait_s=0.0 if s is None else s.budget_wait_s(now),
        largest_output_bytes=0 if s is None else s.largest_output,
        pack_s_total=0.0 if driver is None else driver.pack_s_total,
        pack_bytes_total=0.0 if driver is None else driver.pack_bytes_total,
        latency={
            stage: (LatencyHistogram() if driver is None else driver.latency[stage]).snapshot() for stage in STAGES
        },
        loop_alive=task is not None and not task.done(),
        pump_alive=pump_alive,
        executor_healthy=executor_healthy,
        executor=ex_metrics,
        chunks=0 if streams is None else streams.chunks,
        batches=0 if s is None else s.stats.batches,
        batched=0 if s is None else s.stats.batched,
        batch_size_mean=0.0 if s is None or not s.stats.batches else s.stats.admitted / s.stats.batches,
        batch_size_max=0 if s is None else s.stats.max_batch,
        files_held=len(files),
        leases_held=leases.held,
    )
