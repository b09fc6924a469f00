"""Two ranks on two GPUs of one host (issue 11): each rank on its own GPU, the copy of
each GPU measured in parallel in the same run, and requests through both ranks (every
call completes only when both have answered, F12; rank 0 ships the outputs).

Two running slots, as the engine keeps; the outputs are taken on a consumer thread
(``--consumer thread``, as ``omni-async bench`` does) or on the submitting thread two
requests late (``inline``, the probe's first version).  The warm-up runs the run's own
loop (``--warm-mode run``): the pool must hold, mapped and pinned on rank 0, as many
segments as the run keeps leased at once.  The first version warmed up by taking each
output as it came (``--warm-mode plain``): two segments, while the inline run holds
three, so its third output made a segment inside the run (about 50 ms to create and map
512 MB, then 125-145 ms of cudaHostRegister on rank 0's packer thread, during which
rank 0's main thread waited in its next cudaEventRecord): the 100-150 ms stall at the
fifth forward (bench/results/two_gpu/README.md).

Every process records when things happened (``time.monotonic()``, one clock for the
host): the client its submissions, each call's COMPUTE_DONE, each take; each rank (a
``TimedWorker``) each RPC, forward, pack, segment mapping and registration, its main
thread's event records and sends, its garbage collections, and a heartbeat thread's late
wake-ups (the GIL held).  ``--show N`` prints the first N requests as a table.

Usage (a 2-GPU machine):

    PYTHONPATH=src:bench/probes python3 bench/probes/two_gpu.py --out two_gpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor import RequestHandle
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.synthetic import SyntheticForwardWorker
from omni_async.transport.shm import SegmentPool

# (process, what, key, started, ended, extra) -- process: "client", "rank0", "rank1".
Event = tuple[str, str, str, float, float, dict[str, Any]]
_EVENTS: list[Event] = []
_GC_START: list[float] = []


def _gc_recorder(process: str) -> Any:
    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _GC_START.append(time.monotonic())
        elif _GC_START:
            t0 = _GC_START.pop()
            _EVENTS.append(
                (process, "gc", f"gen{info['generation']}", t0, time.monotonic(), {"collected": info["collected"]})
            )

    return on_gc


class TimedWorker(SyntheticForwardWorker):
    """``SyntheticForwardWorker`` that records its forwards, the loop's RPCs and the packer's packs."""

    def __init__(self, *, register: str = "torch", **kw: Any) -> None:
        super().__init__(**kw)
        from omni_async.transport.shm import cuda_host, mapping
        from omni_async.worker.loop import WorkerLoop
        from omni_async.worker.packer import Packer

        if register == "ctypes":
            # cudaHostRegister through ctypes, which lets go of the GIL during the call.
            lib = cuda_host._cudart_lib()
            assert lib is not None

            def host_register(ptr: int, size: int) -> int:
                rc = int(lib.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_uint(0)))
                if rc != 0:
                    cuda_host.clear_cuda_error()
                return rc

            cuda_host.host_register = host_register
        seg_init = mapping.SegmentMapping.__init__
        seg_pin = mapping.SegmentMapping.pin

        def timed_init(m: Any, name: str, size: int, *, create: bool) -> None:
            t0 = time.monotonic()
            seg_init(m, name, size, create=create)
            _EVENTS.append((f"rank{worker.rank}", "map", name, t0, time.monotonic(), {"create": create}))

        def timed_pin(m: Any) -> bool:
            t0 = time.monotonic()
            was = m.pinned
            ok = bool(seg_pin(m))
            if not was:
                _EVENTS.append((f"rank{worker.rank}", "register", m.name, t0, time.monotonic(), {"ok": ok}))
            return ok

        mapping.SegmentMapping.__init__ = timed_init  # type: ignore[method-assign,assignment]
        mapping.SegmentMapping.pin = timed_pin  # type: ignore[method-assign,assignment]
        threading.Thread(target=self._heartbeat, name="two-gpu-heartbeat", daemon=True).start()

        self.rank = -1
        worker = self
        handle = WorkerLoop.handle_rpc
        finish = Packer._finish

        def handle_rpc(loop: WorkerLoop, req: Any) -> None:
            if worker.rank < 0:
                worker.rank = loop.rank
                record = loop._record_event
                put = loop._sender.put
                submit = loop._packer.submit if loop._packer is not None else None

                def timed(name: str, fn: Any) -> Any:
                    def call(*a: Any, **k: Any) -> Any:
                        t0 = time.monotonic()
                        try:
                            return fn(*a, **k)
                        finally:
                            if threading.current_thread() is threading.main_thread():
                                _EVENTS.append((f"rank{loop.rank}", name, "", t0, time.monotonic(), {}))

                    return call

                loop._record_event = timed("record_event", record)
                loop._sender.put = timed("put", put)  # type: ignore[method-assign]
                if loop._packer is not None:
                    loop._packer.submit = timed("submit", submit)  # type: ignore[method-assign]
            t0 = time.monotonic()
            try:
                handle(loop, req)
            finally:
                key = req.args[0].request_id if req.args and isinstance(req.args[0], DiffusionRequest) else req.method
                _EVENTS.append((f"rank{loop.rank}", "rpc", key, t0, time.monotonic(), {}))

        def timed_finish(packer: Packer, flight: Any) -> None:
            # A pack's end: waiting for its copies, the hand-off and the send.
            t0 = time.monotonic()
            try:
                finish(packer, flight)
            finally:
                _EVENTS.append((f"rank{packer.rank}", "pack", flight.job.output.request_id, t0, time.monotonic(), {}))

        WorkerLoop.handle_rpc = handle_rpc  # type: ignore[method-assign,assignment]
        Packer._finish = timed_finish  # type: ignore[method-assign,assignment]
        gc.callbacks.append(self._on_gc)

    def _heartbeat(self) -> None:
        """Wakes every millisecond: a late wake-up means the GIL (or the CPU) was held."""
        last = time.monotonic()
        while True:
            time.sleep(0.001)
            now = time.monotonic()
            if now - last > 0.01:
                _EVENTS.append((f"rank{self.rank}", "heartbeat_late", "", last, now, {}))
            last = now

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        _gc_recorder(f"rank{self.rank}")(phase, info)

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        t0 = time.monotonic()
        out = super().execute_model(request)
        extra: dict[str, Any] = {}
        if self.device.type == "cuda":
            st = torch.cuda.memory_stats(self.device)
            extra = {
                k: st.get(k, 0) for k in ("segment.all.current", "reserved_bytes.all.current", "num_alloc_retries")
            }
        _EVENTS.append((f"rank{self.rank}", "forward", request.request_id, t0, time.monotonic(), extra))
        return out

    def timeline(self) -> list[Event]:
        events = list(_EVENTS)
        _EVENTS.clear()
        return events


def _table(events: list[Event], t0: float, requests: int) -> list[str]:
    """One line per request: when each step began/ended (ms after t0)."""
    at: dict[tuple[str, str, str], tuple[float, float]] = {}
    for proc, what, key, a, b, _ in events:
        at.setdefault((proc, what, key), (a, b))

    def ms(proc: str, what: str, key: str, end: bool = False) -> str:
        v = at.get((proc, what, key))
        return "      -" if v is None else f"{1e3 * (v[1 if end else 0] - t0):7.1f}"

    lines = ["req   submit | r0 rpc   fwd0   fwd1 | r1 rpc   fwd0   fwd1 | pack0  pack1 | done | take  ready   rel"]
    for i in range(requests):
        k = f"r{i}"
        lines.append(
            f"{k:4s} {ms('client', 'submit', k)} |{ms('rank0', 'rpc', k)}{ms('rank0', 'forward', k)}"
            f"{ms('rank0', 'forward', k, True)} |{ms('rank1', 'rpc', k)}{ms('rank1', 'forward', k)}"
            f"{ms('rank1', 'forward', k, True)} |{ms('rank0', 'pack', k)}{ms('rank0', 'pack', k, True)} |"
            f"{ms('client', 'done', k)} |{ms('client', 'take', k)}{ms('client', 'ready', k)}{ms('client', 'take', k, True)}"
        )
    return lines


def rates(result: dict[str, Any]) -> dict[str, float]:
    """The run's rate from rank 0's forwards (every request runs one): the mean time from
    one forward's start to the next (``forward_period_ms``), as requests per second, and
    against ``ideal_per_s`` (the forward alone, or the copy alone if slower)."""
    fwd, gaps = result["rank0_forward_ms"], result["rank0_gap_ms"]
    period = (sum(fwd[:-1]) + sum(gaps)) / len(gaps)
    return {
        "forward_period_ms": period,
        "requests_per_s": 1e3 / period,
        "efficiency": 1e3 / period / result["ideal_per_s"],
    }


def _phase(
    ex: MultiprocDiffusionExecutor, prefix: str, n: int, params: dict[str, Any], consumer: str
) -> dict[str, Any]:
    """``n`` requests through both ranks, two running (as the engine keeps); their outputs
    taken by ``consumer``: on this thread two outputs late (``inline``, the probe's first
    version), or on a consumer thread as each is announced (``thread``, as ``omni-async
    bench`` does).  Returns when each output was ready and rank 0's forward spans."""
    slots: list[tuple[str, RequestHandle]] = []  # running requests: submitted, COMPUTE_DONE not yet in
    outputs: list[tuple[str, Future[DiffusionOutput]]] = []
    done: list[float] = []
    spans: list[tuple[float, float]] = []

    def take(rid: str, output: Future[DiffusionOutput]) -> None:
        a = time.monotonic()
        out = output.result(300)
        b = time.monotonic()
        done.append(b)
        spans.append((out.metrics["forward_started_at"], out.metrics["forward_ended_at"]))
        ex.release_output(out)
        _EVENTS.append(("client", "take", rid, a, time.monotonic(), {}))
        _EVENTS.append(("client", "ready", rid, b, b, {}))

    announced: queue.Queue[tuple[str, Future[DiffusionOutput]] | None] = queue.Queue()

    def consume() -> None:
        while (item := announced.get()) is not None:
            take(*item)

    thread = threading.Thread(target=consume, name="two-gpu-consumer") if consumer == "thread" else None
    if thread is not None:
        thread.start()

    def announce(rid: str, h: RequestHandle) -> None:
        h.computed.result(300)  # COMPUTE_DONE: the output was claimed for the handle
        if thread is not None:
            announced.put((rid, h.output))
            return
        outputs.append((rid, h.output))
        while len(outputs) > 2:  # the inline consumer takes two outputs late
            take(*outputs.pop(0))

    def on_done(rid: str) -> Any:
        return lambda f: _EVENTS.append(("client", "done", rid, time.monotonic(), time.monotonic(), {}))

    for i in range(n):
        # Two running slots: a call's COMPUTE_DONE comes only once both ranks answered it
        # (F12), and frees its slot for the next request.
        while len(slots) >= 2:
            announce(*slots.pop(0))
        rid = f"{prefix}{i}"
        a = time.monotonic()
        h = ex.submit(DiffusionRequest(rid, {**params, "seed": i}))
        _EVENTS.append(("client", "submit", rid, a, time.monotonic(), {}))
        h.computed.add_done_callback(on_done(rid))
        slots.append((rid, h))
    for rid, h in slots:
        announce(rid, h)
    if thread is not None:
        announced.put(None)
        thread.join()
    for item in outputs:
        take(*item)
    return {"done": sorted(done), "spans": sorted(spans)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="81,3,720,1280")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--forward-ms", type=float, default=30.0)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warm", type=int, default=10, help="requests through the pipeline before the run")
    p.add_argument(
        "--warm-mode",
        choices=("run", "plain"),
        default="run",
        help="warm up with the run's own loop and consumer (run), or take each output as it comes "
        "(plain: the probe's first version, which left the pool a segment short of the inline run)",
    )
    p.add_argument(
        "--consumer",
        choices=("inline", "thread"),
        default="thread",
        help="take outputs on the submitting thread two late (inline) or on a consumer thread (thread)",
    )
    p.add_argument(
        "--register",
        choices=("torch", "ctypes"),
        default="torch",
        help="the workers' cudaHostRegister: as the library calls it, or through ctypes (GIL released)",
    )
    p.add_argument(
        "--prewarm",
        type=int,
        default=0,
        help="segments of the output's size made before the executor starts (pool.prewarm): rank 0 maps "
        "and pins them while starting (SegmentPool.map_segments)",
    )
    p.add_argument("--show", type=int, default=0, help="print the timeline of the first SHOW requests")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = [int(x) for x in args.shape.split(",")]
    cuda = args.device == "cuda"
    nbytes = torch.empty(shape, dtype=getattr(torch, args.dtype), device="meta").numel() * 2
    spec = WorkerSpec("two_gpu:TimedWorker", {"device": args.device, "register": args.register})
    opts = WorkerOptions(device=args.device, lease_timeout=120)
    deadlines = Deadlines(compute_timeout=300, output_timeout=300, rpc_timeout=300)
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "consumer": args.consumer,
        "register": args.register,
        "warm_mode": args.warm_mode,
    }
    gc.callbacks.append(_gc_recorder("client"))
    pool = None
    if args.prewarm:
        pool = SegmentPool(max_segments=64)
        pool.prewarm(nbytes, args.prewarm)
    result["prewarm"] = args.prewarm
    with MultiprocDiffusionExecutor(spec, world_size=2, options=opts, deadlines=deadlines, pool=pool) as ex:
        result["rank_devices"] = ex.collective_rpc("where")
        info0 = ex.worker_metrics()[0]
        result["loop_info_rank0"] = {"mapped_segments": info0.mapped_segments, "pinned_segments": info0.pinned_segments}
        # Both ranks copy at once (a collective call runs on every rank): each GPU's own bandwidth.
        ex.collective_rpc("copy_alone", (2, shape, args.dtype))  # warm (pinned buffers)
        per_rank = ex.collective_rpc("copy_alone", (10, shape, args.dtype))
        result["parallel_copy_GBps"] = [nbytes / statistics.median(t) / 1e9 for t in per_rank]
        fwd = ex.collective_rpc("forward_alone", (20, args.forward_ms, shape, args.dtype))
        result["forward_alone_ms"] = [1e3 * statistics.median(t) for t in fwd]
        params = {"forward_ms": args.forward_ms, "shape": shape, "dtype": args.dtype}
        if args.warm_mode == "run":
            # The run's own loop: the pool ends up with as many segments (mapped and pinned
            # on rank 0) as the run holds at once.
            _phase(ex, "w", args.warm, params, args.consumer)
        else:
            warm = [ex.submit(DiffusionRequest(f"w{i}", {**params, "seed": i})) for i in range(args.warm)]
            for w in warm:
                ex.release_output(w.output.result(300))
        result["pool_after_warm"] = str(ex.pool.stats())
        ex.collective_rpc("timeline")  # the warm-up's events are not the run's
        _EVENTS.clear()
        t0 = time.monotonic()
        run = _phase(ex, "r", args.requests, params, args.consumer)
        done, spans = run["done"], run["spans"]
        # Outputs ready at the consumer, from the second to the last: with the inline
        # consumer the second is taken two requests late, so this overstates the rate by
        # about two requests in the run (3% at 60); ``requests_per_s`` does not.
        result["outputs_ready_per_s"] = (len(done) - 2) / (done[-1] - done[1])
        copy_s = nbytes / 1e9 / result["parallel_copy_GBps"][0]
        result["ideal_per_s"] = 1e3 / max(max(result["forward_alone_ms"]), 1e3 * copy_s)
        result["wall_s"] = time.monotonic() - t0
        result["pool"] = str(ex.pool.stats())
        result["rank0_forward_ms"] = [round(1e3 * (e - b), 2) for b, e in spans]
        result["rank0_gap_ms"] = [round(1e3 * (spans[i + 1][0] - spans[i][1]), 2) for i in range(len(spans) - 1)]
        result.update(rates(result))
        steady = result["requests_per_s"]
        events = list(_EVENTS)
        for per_rank_events in ex.collective_rpc("timeline"):
            events += [tuple(e) for e in per_rank_events]
    events.sort(key=lambda e: e[3])
    result["timeline"] = [
        {
            "process": e[0],
            "what": e[1],
            "key": e[2],
            "at_ms": round(1e3 * (e[3] - t0), 2),
            "ms": round(1e3 * (e[4] - e[3]), 2),
            **e[5],
        }
        for e in events
    ]
    notable = [
        e
        for e in result["timeline"]
        if e["what"] in ("map", "register", "heartbeat_late")
        or (e["what"] == "gc" and e["ms"] > 2)
        or (e["what"] in ("record_event", "put", "submit") and e["ms"] > 5)
    ]
    gaps = result["rank0_gap_ms"]
    print(
        f"consumer={args.consumer} register={args.register} warm={args.warm_mode} prewarm={args.prewarm}: "
        f"{steady:.2f} req/s of {result['ideal_per_s']:.2f} ideal ({result['efficiency']:.3f}; outputs ready "
        f"{result['outputs_ready_per_s']:.2f}/s); "
        f"rank 0 gaps: max {max(gaps):.1f} ms at #{gaps.index(max(gaps))}, median {statistics.median(gaps):.2f} ms"
    )
    print("pool after warm-up:", result["pool_after_warm"])
    print("pool after run:    ", result["pool"])
    for e in notable:
        print("  notable:", e)
    if args.show:
        print("\n".join(_table(events, t0, min(args.show, args.requests))))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
