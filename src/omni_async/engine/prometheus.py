"""Prometheus export of one engine's metrics (the ``metrics`` extra: ``prometheus-client``).

Imported only by ``AsyncDiffusionEngine.prometheus_registry()``, so the engine works
without ``prometheus-client`` installed.  The collector reads ``engine.metrics()`` at
each scrape (no second set of counters to keep in step) into a ``CollectorRegistry`` of
its own, never the process-wide default one: two engines in one process, or one per
test, never collide.

Families (all prefixed ``omni_async_``):

* ``engine_requests_total{outcome}``: requests that ended, by outcome (finished,
  failed, aborted, cancelled, closed, rejected);
* ``engine_request_seconds{stage}``: latency histograms of finished requests: queued,
  forward, pack, transfer_wait, postprocess, total;
* ``engine_active_requests{state}``: waiting, running, holding, postprocessing now;
* ``engine_in_flight_limit``: running plus holding allowed (the budget of held outputs);
* ``engine_budget_waits_total`` / ``engine_budget_wait_seconds_total``: back-pressure
  in the engine's queue;
* ``engine_pack_seconds_total`` / ``engine_pack_bytes_total``: the workers' copy time and
  bytes (``rate(bytes) / rate(seconds)`` is the copy throughput);
* ``executor_outputs_held`` / ``executor_bytes_held`` (outputs in shared memory, packed
  and not released), ``executor_outputs_pending`` (ids the executor tracks),
  ``executor_pool_waits_total`` / ``executor_pool_wait_seconds_total`` (packs that
  waited for room);
* ``engine_batches_total`` / ``engine_batched_total`` / ``engine_batch_size_mean`` /
  ``engine_batch_size_max``: batching (``max_batch_size``): groups admitted, those of
  two or more, their mean and largest size;
* ``engine_files_held`` / ``engine_leases_held``: the output sinks' files on disk and
  segments lent now (``sink="file"``, ``sink="segment"``);
* ``engine_loop_up``, ``pump_up``, ``workers_up``: liveness (1 or 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from omni_async.engine.metrics import EngineMetrics
from omni_async.executor.metrics import HeldOutputMetrics

__all__ = ["EngineCollector", "engine_registry"]

_P = "omni_async_"


class EngineCollector(Collector):
    """Reads a snapshot from ``metrics`` (``AsyncDiffusionEngine.metrics``) at each scrape."""

    def __init__(self, metrics: Callable[[], EngineMetrics]) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []  # families are made at scrape time; registering must not scrape

    def collect(self) -> Iterable[Metric]:
        m = self._metrics()
        requests = CounterMetricFamily(f"{_P}engine_requests", "Requests that ended, by outcome", labels=["outcome"])
        for outcome, n in sorted(m.requests.items()):
            requests.add_metric([outcome], n)
        yield requests
        latency = HistogramMetricFamily(
            f"{_P}engine_request_seconds", "Time of finished requests, by stage", labels=["stage"]
        )
        for stage, h in m.latency.items():
            buckets = [(_bound(b), float(c)) for b, c in zip(h.bounds, h.buckets, strict=True)]
            buckets.append(("+Inf", float(h.count)))
            latency.add_metric([stage], buckets, h.sum)
        yield latency
        states = GaugeMetricFamily(
            f"{_P}engine_active_requests", "Requests in the engine now, by state", labels=["state"]
        )
        for state, n in (
            ("waiting", m.waiting),
            ("running", m.running),
            ("holding", m.holding),
            ("postprocessing", m.postprocessing),
        ):
            states.add_metric([state], n)
        yield states
        if m.in_flight_limit is not None:
            yield GaugeMetricFamily(
                f"{_P}engine_in_flight_limit", "Running plus holding requests allowed", value=m.in_flight_limit
            )
        yield CounterMetricFamily(
            f"{_P}engine_budget_waits", "Times a request waited for the budget of held outputs", value=m.budget_waits
        )
        yield CounterMetricFamily(
            f"{_P}engine_budget_wait_seconds", "Time requests waited for the budget of held outputs",
            value=m.budget_wait_s,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{_P}engine_pack_seconds", "Workers' copy time of finished requests", value=m.pack_s_total
        )
        yield CounterMetricFamily(
            f"{_P}engine_pack_bytes", "Bytes copied for finished requests", value=m.pack_bytes_total
        )
        yield CounterMetricFamily(
            f"{_P}engine_chunks", "Intermediate outputs of streams delivered (generate_stream)", value=m.chunks
        )
        yield CounterMetricFamily(
            f"{_P}engine_batches", "Groups of requests admitted to the workers together (one alone included)",
            value=m.batches,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{_P}engine_batched", "Groups of two or more requests sent in one execute_model_batch", value=m.batched
        )
        yield GaugeMetricFamily(
            f"{_P}engine_batch_size_mean", "Requests per admitted group, on average", value=m.batch_size_mean
        )
        yield GaugeMetricFamily(f"{_P}engine_batch_size_max", "The largest admitted group", value=m.batch_size_max)
        yield GaugeMetricFamily(
            f"{_P}engine_files_held", "Files of sink='file' requests on disk now", value=m.files_held
        )
        yield GaugeMetricFamily(
            f"{_P}engine_leases_held", "Outputs lent with sink='segment' and not released", value=m.leases_held
        )
        ex = m.executor
        if ex is not None:
            gauges: list[tuple[str, float, str]] = []
            counters: list[tuple[str, float, str]] = []
            if isinstance(ex, HeldOutputMetrics):
                gauges += [
                    ("executor_outputs_held", ex.held_outputs, "Outputs held in shared memory (packed, not released)"),
                    ("executor_bytes_held", ex.held_bytes, "Bytes held in shared memory (packed, not released)"),
                ]
                counters += [
                    ("executor_pool_waits", ex.pool_waits, "Packs that waited for room in the budget of held outputs"),
                    ("executor_pool_wait_seconds", ex.pool_wait_s_total, "Time packs waited for room"),
                ]
            gauges.append(("executor_outputs_pending", ex.pending_outputs, "Output ids the executor tracks"))
            for name, value, doc in gauges:
                yield GaugeMetricFamily(f"{_P}{name}", doc, value=float(value))
            for name, value, doc in counters:
                yield CounterMetricFamily(f"{_P}{name}", doc, value=float(value))
        yield GaugeMetricFamily(f"{_P}engine_loop_up", "The engine's loop task runs", value=float(m.loop_alive))
        yield GaugeMetricFamily(f"{_P}pump_up", "The executor's result pump runs", value=float(m.pump_alive))
        yield GaugeMetricFamily(
            f"{_P}workers_up", "The executor is healthy: every worker alive", value=float(m.executor_healthy)
        )


def _bound(b: float) -> str:
    return repr(float(b))


def engine_registry(metrics: Callable[[], EngineMetrics]) -> CollectorRegistry:
    """A fresh registry holding only the collector of one engine's ``metrics``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(metrics))
    return registry
