"""``omni-async serve``: the HTTP front door (``omni_async.serve``) from the command line.

Builds the ``ServeConfig`` of the options and runs the server until SIGTERM or Ctrl-C; the
URL is printed once the engine is up (``--port 0``: the free port picked).  Exit status 0
after a clean stop, 1 when the server could not start, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from omni_async.cli.parsers import add_serve as add_parser
from omni_async.core.errors import UsageError
from omni_async.serve import ServeConfig, serve, served_model

__all__ = ["add_parser", "run"]


def config_of(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model=served_model(args.model, device=args.device, cuda_graphs=args.cuda_graphs),
        device=args.device,
        max_waiting=args.max_waiting,
        max_batch_size=args.max_batch_size,
        max_running=args.max_running,
        encode_workers=args.encode_workers,
        max_held_outputs=args.max_held_outputs,
        poll_after_ms=args.poll_after_ms,
        graceful_s=float(args.graceful_s),
        output_ttl_s=float(args.output_ttl_s),
        video_keep_s=float(args.video_keep_s),
        cpu_affinity=args.cpu_affinity,
    )


def run(args: argparse.Namespace) -> int:
    try:
        return serve(config_of(args), args.host, args.port)
    except UsageError as exc:  # a model or engine setting refused (InvalidConfig names it)
        print(f"omni-async serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the address is taken, or not ours to bind
        print(f"omni-async serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
