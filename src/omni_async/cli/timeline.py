"""Timelines of ``omni-async demo``: each request's phases, as a Chrome trace and a picture.

``request_spans`` turns a finished request's ``RequestTimings`` into its phases on one
clock (``time.monotonic()``, which the worker's stamps share):

* ``queued``: from ``generate`` until its forward started (the engine's queue, then
  behind the forward before it on the worker);
* ``forward``: the forward on the device, from when the device began it to when it
  finished its kernels (a real pipeline's call returns before: its tail is in);
* ``pack``: the device stage and the copy into shared memory, from the copy's start on
  the device (on the packer thread on the asynchronous output path, on the main thread
  on the synchronous one; ``omni_async.worker.stamps``);
* ``wait``: from the end of the copy until the engine's host stage started (the
  message, the unpack, the answer of a synchronous call);
* ``postprocess``: the engine's host stage and the release, until the result.

``chrome_trace`` writes them as Chrome trace events (``{"traceEvents": [...]}``; open in
https://ui.perfetto.dev or chrome://tracing): one process per output path, one thread
per request plus a ``worker`` thread with the forwards and the device's idle gaps
between them.
``draw_timeline`` draws one output path as a PNG with matplotlib (imported when called).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

import attrs

from omni_async.cli.figures import idle_gaps
from omni_async.engine.metrics import RequestTimings

__all__ = ["PHASES", "Span", "chrome_trace", "draw_timeline", "forward_intervals", "request_order", "request_spans"]

#: A request's phases, in the order they happen.
PHASES: tuple[str, ...] = ("queued", "forward", "pack", "wait", "postprocess")
_COLORS = {
    "queued": "#d9d9d9",
    "forward": "#4c72b0",
    "pack": "#dd8452",
    "wait": "#8172b3",
    "postprocess": "#55a868",
    "idle": "#e31a1c",
}
# The trace's thread of the worker's forwards (requests are 1, 2, ... in submission order).
WORKER_TID = 0


@attrs.frozen
class Span:
    """One phase of one request: ``start`` and ``end`` in seconds on one clock."""

    request_id: str
    phase: str
    start: float
    end: float


def request_spans(request_id: str, t: RequestTimings) -> list[Span]:
    """The phases of a finished request (see the module docstring); a phase whose stamps
    are missing (an output that carried none) falls back on the engine's own stamps:
    the forward from sending to COMPUTE_DONE, no ``pack``.  Empty phases are left out."""
    f0 = t.forward_started_at if t.forward_started_at is not None else t.submitted_at
    f1 = t.forward_ended_at if t.forward_ended_at is not None else t.compute_done_at
    post0 = t.postprocess_started_at if t.postprocess_started_at is not None else t.output_ready_at
    spans = [Span(request_id, "queued", t.enqueued_at, f0), Span(request_id, "forward", f0, f1)]
    wait0 = f1
    if t.pack_started_at is not None and t.pack_ended_at is not None:
        spans.append(Span(request_id, "pack", t.pack_started_at, t.pack_ended_at))
        wait0 = t.pack_ended_at
    spans.append(Span(request_id, "wait", wait0, post0))
    spans.append(Span(request_id, "postprocess", post0, t.finished_at))
    return [s for s in spans if s.end > s.start]


def request_order(spans: Sequence[Span]) -> list[str]:
    """The request ids of ``spans`` in the order the worker served them (their forward's
    start; a request without a forward after those with one, by its first span)."""
    first: dict[str, tuple[int, float]] = {}
    for s in spans:
        key = (0, s.start) if s.phase == "forward" else (1, s.start)
        if s.request_id not in first or key < first[s.request_id]:
            first[s.request_id] = key
    return sorted(first, key=lambda rid: first[rid])


def forward_intervals(spans: Sequence[Span]) -> list[tuple[float, float]]:
    """The ``(start, end)`` of every ``forward`` span, in start order."""
    return sorted((s.start, s.end) for s in spans if s.phase == "forward")


class ChromeTrace(TypedDict):
    """The JSON object of a Chrome trace (what ``chrome_trace`` returns)."""

    traceEvents: list[dict[str, object]]
    displayTimeUnit: str


def chrome_trace(modes: Mapping[str, Sequence[Span]], *, origin: Mapping[str, float] | None = None) -> ChromeTrace:
    """The Chrome trace (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) of one or
    more runs: ``modes`` maps a run's name (an output path) to its spans.  Each run is a
    process (``pid`` 1, 2, ... in ``modes``' order, named after it), each request a
    thread (``tid`` 1, 2, ... in ``request_order``, named after the request),
    each span an ``"X"`` event named ``"<request id> <phase>"``; thread 0, ``worker``,
    repeats the forwards (named ``"forward <request id>"``) and shows the idle gaps
    between them (``"idle"``).  Times are microseconds from ``origin[name]`` (default:
    the run's earliest stamp), so runs line up side by side."""
    events: list[dict[str, object]] = []
    for pid, (mode, spans) in enumerate(modes.items(), start=1):
        t0 = (origin or {}).get(mode, min((s.start for s in spans), default=0.0))

        def us(t: float, t0: float = t0) -> float:
            return round((t - t0) * 1e6, 3)

        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": mode}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": WORKER_TID, "args": {"name": "worker"}})
        tids = {rid: tid for tid, rid in enumerate(request_order(spans), start=1)}
        for rid, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": rid}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for s in spans:
            events.append(
                _event(f"{s.request_id} {s.phase}", s.phase, us(s.start), us(s.end), pid, tids[s.request_id], mode)
            )
        forwards = sorted((s for s in spans if s.phase == "forward"), key=lambda s: s.start)
        busy_until: float | None = None
        for s in forwards:
            if busy_until is not None and s.start > busy_until:
                events.append(_event("idle", "idle", us(busy_until), us(s.start), pid, WORKER_TID, mode))
            events.append(_event(f"forward {s.request_id}", "forward", us(s.start), us(s.end), pid, WORKER_TID, mode))
            busy_until = s.end if busy_until is None else max(busy_until, s.end)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _event(name: str, cat: str, ts: float, end: float, pid: int, tid: int, mode: str) -> dict[str, object]:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(end - ts, 3), "pid": pid, "tid": tid,
            "args": {"mode": mode}}  # fmt: skip


def draw_timeline(
    path: str,
    spans: Sequence[Span],
    *,
    title: str,
    xmax: float | None = None,
    main_thread_packs: bool = False,
) -> None:
    """Draw one run's timeline to the PNG ``path``: a row per request (its phases, in
    ``request_order`` from the top) under a ``worker`` row with the forwards and, in
    red, the idle gaps between them (``main_thread_packs``: the copies too, when they
    ran on the worker's main thread).  Seconds from the run's first stamp; ``xmax``: the
    x axis' end (the same for runs compared side by side)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min((s.start for s in spans), default=0.0)
    order = {rid: row for row, rid in enumerate(request_order(spans), start=1)}
    rows = len(order) + 1
    height = min(max(3.0, 1.2 + 0.16 * rows), 40.0)
    fig, ax = plt.subplots(figsize=(12, height), dpi=100)
    try:
        for phase in PHASES:
            mine = [s for s in spans if s.phase == phase]
            if not mine:
                continue
            bar = 0.3 if phase == "queued" else 0.8
            ax.barh([order[s.request_id] for s in mine], [s.end - s.start for s in mine],
                    left=[s.start - t0 for s in mine], height=bar, color=_COLORS[phase], linewidth=0)  # fmt: skip
        worker = [s for s in spans if s.phase == "forward" or (main_thread_packs and s.phase == "pack")]
        if worker:
            ax.barh([0] * len(worker), [s.end - s.start for s in worker], left=[s.start - t0 for s in worker],
                    height=0.8, color=[_COLORS[s.phase] for s in worker], linewidth=0)  # fmt: skip
        intervals = forward_intervals(spans)
        busy = [intervals[0][1]] if intervals else []
        for _start, end in intervals[1:]:
            busy.append(max(busy[-1], end))
        gaps = idle_gaps(intervals)
        idle = [(busy[i], g) for i, g in enumerate(gaps) if g > 0]
        if idle:
            ax.barh([0] * len(idle), [g for _, g in idle], left=[b - t0 for b, _ in idle], height=0.8,
                    color=_COLORS["idle"], linewidth=0)  # fmt: skip
        ax.set_ylim(rows - 0.5, -0.5)
        if rows <= 65:
            ax.set_yticks(range(rows), ["worker", *order])
        else:
            ax.set_yticks([0], ["worker"])
            ax.set_ylabel(f"{rows - 1} requests, in the order the worker ran them")
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(0, xmax if xmax is not None else max((s.end for s in spans), default=t0 + 1.0) - t0)
        ax.set_xlabel("seconds")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        handles = [Patch(color=_COLORS[p], label=p) for p in (*PHASES, "idle")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
