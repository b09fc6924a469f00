"""The ``omni-async`` commands' parsers, built without importing what the commands run.

``omni-async --help`` (and ``omni-async COMMAND --help``) builds every command's parser: this
module holds them and imports only argparse, the option types (``options``) and the core, so
that neither torch nor rich, the engine, the executors or the reference models are imported
to print a help or refuse a bad option.  Each command's implementation (``demo``, ``soak``,
``bench``, ``cleanup``) is imported only when that command runs (``_runner``); those modules
re-export the names below that belong to them (``bench.MODES``, ``soak.WARMUP_REQUESTS``, ...).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

from omni_async.cli import options
from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError

__all__ = [
    "CLIENT_PATHS",
    "COMMANDS",
    "DRIVER_RSS_BOUND_MIB",
    "MODES",
    "SIZES",
    "TINY_SIZES",
    "WARMUP_REQUESTS",
    "add_bench",
    "add_cleanup",
    "add_demo",
    "add_serve",
    "add_soak",
    "deadlines",
]


def _runner(command: str) -> Callable[[argparse.Namespace], int]:
    """``run`` of ``omni_async.cli.<command>``, imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(f"omni_async.cli.{command}")
        code: int = module.run(args)
        return code

    run.__qualname__ = run.__name__ = f"run_{command}"
    return run


# ------------------------------------------------------------------------------ demo


#: What ``omni-async demo`` hands its client (``--output``): the formats its pipeline has.
DEMO_OUTPUTS: tuple[str, ...] = ("pixels",)


def add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``omni-async demo``."""
    d = sub.add_parser(
        "demo",
        help="run the reference stack end to end and check every output",
        description=(
            "Serve DiTPipelineWorker's requests through an AsyncDiffusionEngine twice, on the synchronous output "
            "path (the copy on the worker's main thread) and on the asynchronous one (the copy on its packer, "
            "overlapping the next forward); check every output's bytes (against the digest the worker took) and "
            "that nothing is left behind; write the images, a timeline picture per run and a Chrome trace of both "
            "to --out, and print throughput, latency and the worker's idle time of each run.  Exit status 0: "
            "every output arrived intact and nothing was left behind; 1: a mismatch or a leak; 2: bad arguments."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument(
        "--executor",
        choices=("multiproc", "inproc"),
        default="multiproc",
        help="multiproc: worker processes and shared memory; inproc: worker threads in this process",
    )
    d.add_argument(
        "--device", type=options.device, default="cpu", help="where the workers compute: cpu, cuda or cuda:<index>"
    )
    d.add_argument(
        "--world-size", type=options.positive_int, default=1, help="number of worker ranks (rank 0 ships outputs)"
    )
    d.add_argument("--requests", type=options.positive_int, default=48, help="number of requests per run")
    d.add_argument(
        "--max-running",
        type=options.positive_int,
        default=3,
        help="the engine's max_running: requests sent to the workers whose forward has not finished",
    )
    # On CPU: 384 x 384 RGB uint8 = 432 KiB per image, through the shared-memory pool, about a
    # minute for both runs on 2 cores.  On CUDA: a video, where the output is a real share.
    d.add_argument(
        "--height", type=options.image_side, default=None,
        help="frame height in pixels, a multiple of 8 (default: 384 on CPU, 480 on CUDA)",
    )  # fmt: skip
    d.add_argument(
        "--width", type=options.image_side, default=None,
        help="frame width in pixels, a multiple of 8 (default: 384 on CPU, 832 on CUDA)",
    )  # fmt: skip
    d.add_argument(
        "--frames", type=options.positive_int, default=None,
        help="frames per output: 1 is an image, more a video (default: 1 on CPU, 16 on CUDA)",
    )  # fmt: skip
    d.add_argument("--steps", type=options.positive_int, default=4, help="denoising steps per request")
    d.add_argument(
        "--output",
        choices=DEMO_OUTPUTS,
        default=DEMO_OUTPUTS[0],
        help="what the client receives: pixels (uint8, channel-last: a PIL image, or a frames array)",
    )
    d.add_argument(
        "--compute-timeout",
        type=options.seconds,
        default=60.0,
        help="seconds from submitting an execute call until every rank has answered; 0 or 'none': no limit",
    )
    d.add_argument(
        "--output-timeout",
        type=options.seconds,
        default=60.0,
        help="seconds from COMPUTE_DONE until the output is delivered; 0 or 'none': no limit",
    )
    # The demo hands the engine every request at once: the engine runs at most this many
    # (running or holding an output), the rest wait in its queue.
    d.add_argument(
        "--max-held-outputs",
        type=options.positive_int,
        default=None,
        help=(
            "the executor's budget of outputs held in shared memory (multiproc; None: 64); the engine "
            "keeps its requests in flight within it"
        ),
    )
    d.add_argument(
        "--out",
        default="omni_async_demo",
        help="folder for the images, the timeline pictures and the Chrome trace (created if missing)",
    )
    d.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    d.set_defaults(subparser=d, check=_check_demo, run=_runner("demo"))


def _check_demo(args: argparse.Namespace) -> None:
    # The OMNI_ASYNC_*_TIMEOUT variables are read now as well: a bad one is reported
    # like a bad option, before anything starts.
    try:
        deadlines(args)
    except UsageError as exc:
        args.subparser.error(str(exc))


def deadlines(args: argparse.Namespace) -> Deadlines:
    """The options' deadlines over the environment's (``OMNI_ASYNC_*_TIMEOUT``)."""
    return Deadlines.from_env(compute_timeout=args.compute_timeout, output_timeout=args.output_timeout)


# ------------------------------------------------------------------------------ soak

# Worker memory grows over the first forwards of each shape (torch's allocator and
# kernels, the packer's buffers) and then stays flat; the RSS check starts after these.
WARMUP_REQUESTS = 50
# The driver's RssAnon may grow this much after its warm-up (a tenth of the requests).
# Measured on 2 cores (engine, fault rate 0.1): +2 to +10 MiB from 10 % to the end of
# 3000-10000 requests on 1-2 executors, once the soak's own digest stopped keeping
# 24 MiB of temporaries per engine thread (it was +240 MiB over 3000 requests before).
DRIVER_RSS_BOUND_MIB = 64


def add_soak(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``omni-async soak``."""
    d = sub.add_parser(
        "soak",
        help="run many requests with random faults and account for every one",
        description=(
            "Drive a MultiprocDiffusionExecutor over TinyDiffusionWorker with random output sizes and, "
            "with probability --fault-rate per request, one fault: a forward that raises, an output the "
            "packer refuses, an abort, a cancelled call or wait, the consumer going away, a tight engine "
            "deadline, a claim after the output deadline, or a SIGKILL of a worker.  --executors "
            "executors run side by side, each from --concurrency engine threads, drawing from one plan "
            "sequence.  A dead worker ends its executor (WorkerDied is final): the soak starts a new one "
            "at once from a warm spare built in the background, lets the dead one's requests in flight "
            "end, then checks and shuts it down.  At the end it prints every request's "
            "outcome and the checks: no request unaccounted, no changed bytes, no untyped error, every "
            "executor's registry empty and pool complete (unused spares included), nothing left in "
            "/dev/shm, worker RSS growth under --rss-bound-mib, the driver's own RSS growth after its warm-up "
            "under --driver-rss-bound-mib, every executor started.  Exit status 0: "
            "every check passed; 1: one failed; 2: bad arguments.  --engine: through an AsyncDiffusionEngine."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--requests", type=options.positive_int, default=1000, help="number of requests")
    d.add_argument(
        "--fault-rate", type=options.probability, default=0.1, help="probability that a request gets a fault"
    )
    d.add_argument("--seed", type=options.non_negative_int, default=0, help="seed of every random choice")
    d.add_argument(
        "--concurrency",
        type=options.positive_int,
        default=8,
        help="requests in flight at once per executor (engine threads)",
    )
    d.add_argument(
        "--executors",
        type=options.positive_int,
        default=1,
        help="executors run side by side (each with a warm spare: the next one, built in the background)",
    )
    d.add_argument("--world-size", type=options.positive_int, default=1, help="worker ranks per executor")
    d.add_argument(
        "--max-held-outputs",
        type=options.positive_int,
        default=16,
        help="the executors' budget of outputs held in shared memory",
    )
    d.add_argument(
        "--output-timeout",
        type=options.seconds,
        default=2.0,
        help="the executors' output deadline in seconds (the 'expire' fault claims just after it)",
    )
    d.add_argument(
        "--rss-bound-mib",
        type=options.positive_int,
        default=64,
        help=(
            "most a worker's own memory (RssAnon: heap and stacks) may grow from the end of its executor's "
            f"warm-up (its first {WARMUP_REQUESTS} requests) to the end of its life"
        ),
    )
    d.add_argument(
        "--driver-rss-bound-mib",
        type=options.positive_int,
        default=DRIVER_RSS_BOUND_MIB,
        help=(
            "most the driver's own memory (this process's RssAnon: the engines, executors and pumps it runs) "
            "may grow from the end of its warm-up (the request at a tenth of --requests handed out) to the end "
            "of the run, whatever --requests is: a bounded footprint per finished request, not per 1000"
        ),
    )
    d.add_argument(
        "--engine",
        action="store_true",
        help=(
            "send the requests through an AsyncDiffusionEngine over each executor (the faults become engine "
            "aborts, cancelled generate tasks and per-request deadlines), and check each engine's accounting"
        ),
    )
    d.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the table to PATH as JSON")
    d.set_defaults(subparser=d, check=_check_soak, run=_runner("soak"))


def _check_soak(args: argparse.Namespace) -> None:
    if args.output_timeout is None:
        args.subparser.error("argument --output-timeout: the soak needs an output deadline (the 'expire' fault)")
    if args.json is not None and not args.json.parent.is_dir():
        args.subparser.error(f"argument --json: no directory {str(args.json.parent)!r}")


# ------------------------------------------------------------------------------ bench

MODES: Final = ("sync", "reference", "omni", "omni-u8")
# How the bench makes the client's bytes (bench.client_maker).
CLIENT_PATHS: Final = ("pooled", "fresh")
# name -> (shape, dtype): images are 3 x H x W, videos frames x 3 x H x W.
SIZES: Final[dict[str, tuple[tuple[int, ...], str]]] = {
    "image-1k-fp32": ((3, 1024, 1024), "float32"),
    "image-2k-bf16": ((3, 2048, 2048), "bfloat16"),
    "video-81x720p-bf16": ((81, 3, 720, 1280), "bfloat16"),
    "video-121x1080p-bf16": ((121, 3, 1080, 1920), "bfloat16"),
}
TINY_SIZES: Final[dict[str, tuple[tuple[int, ...], str]]] = {
    "tiny-image-fp32": ((3, 96, 128), "float32"),
    "tiny-video-bf16": ((4, 3, 64, 96), "bfloat16"),
}


T = TypeVar("T")


def _csv(kind: Callable[[str], T], name: str) -> Callable[[str], list[T]]:
    def parse(text: str) -> list[T]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {name}, got {text!r}")
        return [kind(t) for t in items]

    return parse


def _mode(text: str) -> str:
    if text not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from {', '.join(MODES)}")
    return text


def _size(text: str) -> str:
    if text not in SIZES and text not in TINY_SIZES:
        raise argparse.ArgumentTypeError(f"unknown size {text!r}; choose from {', '.join([*SIZES, *TINY_SIZES])}")
    return text


def _ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1e6 ms, got {text!r}")
    return value


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``omni-async bench``."""
    d = sub.add_parser(
        "bench",
        help="measure our output path against the seed's and the reference's (throughput, latency, efficiency)",
        description=(
            "Run SyntheticForwardWorker behind MultiprocDiffusionExecutor and ship its outputs four ways: "
            "sync (the seed: .cpu() and a fresh segment per tensor, step mode), reference (side stream, bf16 "
            "upcast, fresh pinned buffer + sync per tensor, fresh segment + copy), omni (ours: pooled pinned "
            "segment) and omni-u8 (ours with a uint8 device stage).  Sweep output sizes x forward lengths x "
            "concurrency, plus a copy-bound case; per case print requests/s, p50/p95 latency, copy GB/s, the "
            "device's idle gap between forwards and efficiency = throughput / (1 / max(forward, bytes / pinned "
            "copy bandwidth)), forward and copy measured alone around each case, and the time to the client's "
            "bytes (output in hand and post-processed on the host) against the forward alone.  The table fits 100 "
            "columns; --json writes every field, "
            "--plot a PNG (needs matplotlib; --plot-from JSON draws it later from a saved report)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--device", type=options.device, default=options.default_device(), help="the worker's device")
    d.add_argument("--modes", type=_csv(_mode, "modes"), default=list(MODES), help="comma-separated modes")
    d.add_argument("--sizes", type=_csv(_size, "sizes"), default=list(SIZES), help="comma-separated output sizes")
    d.add_argument(
        "--forward-ms",
        type=_csv(_ms, "milliseconds"),
        default=[30.0, 300.0],
        help="forward lengths: a few-step distilled one and a long one",
    )
    d.add_argument(
        "--concurrency",
        type=_csv(options.positive_int, "ints"),
        default=[1, 2, 4],
        help="running slots (each submits its next request at COMPUTE_DONE)",
    )
    d.add_argument("--requests", type=options.positive_int, default=16, help="measured requests per case")
    d.add_argument(
        "--warmup", type=options.positive_int, default=2, help="warm-up requests per client, before the measurement"
    )
    d.add_argument(
        "--alone-reps", type=options.positive_int, default=5, help="forwards and copies alone, before and after a case"
    )
    d.add_argument(
        "--alone-min-s",
        type=float,
        default=1.0,
        help="and at least this many seconds of forwards alone (a sustained loop)",
    )
    d.add_argument(
        "--max-case-s",
        type=float,
        default=20.0,
        help="stop taking new requests in a case after this many seconds (slow modes on large outputs)",
    )
    d.add_argument(
        "--copy-bound",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "include the copy-bound cases (the largest size behind a forward that only writes its output); "
            "--no-copy-bound leaves them out"
        ),
    )
    d.add_argument(
        "--client-bytes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "time each output to the client's bytes: uint8 pixels made on the host as an engine's host stage "
            "does, before the output is released (the 'client ms' column; its ideal is the forward alone); "
            "--no-client-bytes takes the output in hand only"
        ),
    )
    d.add_argument(
        "--client-path",
        choices=CLIENT_PATHS,
        default="pooled",
        help=(
            "how the client's bytes are made: pooled (converted in cache-sized slices into memory reused once "
            "dropped) or fresh (the seed's: fresh memory for every pass, the figures before issue 31)"
        ),
    )
    d.add_argument(
        "--copies-in-flight",
        type=options.positive_int,
        default=2,
        help="the worker's WorkerOptions.copies_in_flight on the omni paths (1: one copy at a time, as before)",
    )
    d.add_argument(
        "--tiny",
        action="store_true",
        help="CI preset: tiny sizes, a 20 ms forward, concurrency 1 and 2, 6 requests, and a short --pump",
    )
    d.add_argument(
        "--loop-stall",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "measure the engine's event loop's longest stall (and p99) while --loop-encodes PNG encodes run, "
            "after the sweep (target under 20 ms); --no-loop-stall leaves it out"
        ),
    )
    d.add_argument(
        "--loop-encodes", type=options.positive_int, default=16, help="PNG requests at once in the --loop-stall run"
    )
    d.add_argument(
        "--loop-side", type=options.positive_int, default=1024, help="their pictures' side in pixels (--tiny: 256)"
    )
    d.add_argument("--pump", action="store_true", help="also run the CPU micro-benchmark of the protocol")
    d.add_argument("--pump-requests", type=options.positive_int, default=2000, help="requests of the --pump run")
    d.add_argument("--pump-only", action="store_true", help="run only the --pump micro-benchmark (no sweep)")
    d.add_argument(
        "--pump-clients",
        type=options.positive_int,
        default=1,
        help="threads submitting in the --pump run (1: the latency of one message, uncontended)",
    )
    d.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    d.add_argument("--plot", type=Path, default=None, help="draw the PNG here (default: the JSON's path, .png)")
    d.add_argument(
        "--plot-from",
        type=Path,
        default=None,
        help="only draw the plot of a saved JSON report (to --plot or beside it)",
    )
    d.set_defaults(run=_runner("bench"))


# ------------------------------------------------------------------------------ serve


def _model_name(text: str) -> str:
    if text in ("tiny", "dit") or (text.startswith("diffusers:") and text.count(":") == 2):
        return text
    raise argparse.ArgumentTypeError(f"unknown model {text!r}; choose tiny, dit or diffusers:MODULE:BUILDER")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: pick a free one), got {value}")
    return value


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``omni-async serve``."""
    d = sub.add_parser(
        "serve",
        help="serve a model over HTTP with an OpenAI-compatible API (images and video jobs)",
        description=(
            "Serve --model through an AsyncDiffusionEngine over worker processes, behind an OpenAI-compatible HTTP "
            "API: POST /v1/images/generations (n as one batch, png/jpeg/webp, streamed partial images), the video "
            "job API (POST /v1/videos, GET /v1/videos/{id}, GET /v1/videos/{id}/content, DELETE /v1/videos/{id}), "
            "GET /v1/models, GET /health and GET /metrics.  Prints the URL once the engine is up; SIGTERM or "
            "Ctrl-C stops it cleanly (requests in flight end, the engine closes, its workers and shared memory go) "
            "and it exits 0."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument(
        "--model",
        type=_model_name,
        default="dit",
        help=(
            "tiny: the library's tiny reference model (grey images 64 pixels wide, short clips; fast on CPU); "
            "dit: the demo's DiT pipeline; diffusers:MODULE:BUILDER: any diffusers pipeline through the integration"
        ),
    )
    d.add_argument("--host", default="127.0.0.1", help="the address to bind (127.0.0.1: this machine only)")
    d.add_argument("--port", type=_port, default=8000, help="the port to bind (0: a free one, printed)")
    d.add_argument(
        "--device", type=options.device, default="cpu", help="where the workers compute: cpu, cuda or cuda:<index>"
    )
    d.add_argument(
        "--max-batch-size",
        type=options.positive_int,
        default=4,
        help="the engine's max_batch_size: a request's n images (and concurrent requests) batch up to this many",
    )
    d.add_argument(
        "--max-waiting",
        type=options.positive_int,
        default=4096,
        help="the engine's queue: beyond it a request is refused with 429 and Retry-After",
    )
    d.add_argument(
        "--max-running", type=options.positive_int, default=None, help="the engine's max_running (default: its own)"
    )
    d.add_argument(
        "--encode-workers",
        type=options.positive_int,
        default=None,
        help="the engine's encoder processes (PNG/JPEG/WebP/MP4; default: one per core)",
    )
    d.add_argument(
        "--max-held-outputs",
        type=options.positive_int,
        default=None,
        help="the executor's budget of outputs held in shared memory (default: 64)",
    )
    d.add_argument(
        "--poll-after-ms",
        type=options.positive_int,
        default=1000,
        help="the openai-poll-after-ms a video job's status answers with (the openai client polls at that pace)",
    )
    d.add_argument(
        "--output-ttl-s",
        type=options.positive_int,
        default=600,
        help="how long an image asked for with response_format=url stays at its URL",
    )
    d.add_argument(
        "--video-keep-s",
        type=options.positive_int,
        default=600,
        help="how long a finished video job and its MP4 are kept",
    )
    d.add_argument(
        "--graceful-s",
        type=options.positive_int,
        default=30,
        help="on SIGTERM, how long the requests in flight get to end before the engine closes",
    )
    d.add_argument(
        "--cpu-affinity",
        type=options.cpu_affinity,
        default=None,
        help=(
            "the CPUs each worker process runs on: gpu-local (the CPUs local to its GPU, as nvidia-smi topo -m "
            "lists them) or a CPU list such as 0-7,16 (default: the CPUs the server has)"
        ),
    )
    d.add_argument(
        "--cuda-graphs",
        action="store_true",
        help=(
            "for a diffusers:... model on a CUDA device: replay the pipeline's denoiser as CUDA graphs "
            "(DiffusersPipelineWorker(cuda_graphs=True)), for a forward bound by the host's kernel launches"
        ),
    )
    d.set_defaults(run=_runner("serve"))


# ------------------------------------------------------------------------------ cleanup


def add_cleanup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``omni-async cleanup``."""
    c = sub.add_parser(
        "cleanup",
        help="remove the shared memory (/dev/shm) left by executors that died without cleaning up",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    c.set_defaults(run=_runner("cleanup"))


#: ``omni-async``'s commands, in the order its help lists them.
COMMANDS: Final[tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...]] = (
    add_demo,
    add_soak,
    add_bench,
    add_serve,
    add_cleanup,
)
