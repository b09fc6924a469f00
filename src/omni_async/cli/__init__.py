"""``omni-async``: the command line.

One module per command (``demo``, ``soak``, ``bench``, ``cleanup``), each registering its own options; ``options`` holds
the option types they share.  ``omni-async --help`` lists the commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from omni_async.cli import bench, cleanup, demo, soak

__all__ = ["build_parser", "main"]

_COMMANDS = (demo, soak, bench, cleanup)


def build_parser() -> argparse.ArgumentParser:
    """The ``omni-async`` parser; every option says what it does and its default."""
    parser = argparse.ArgumentParser(
        prog="omni-async",
        description="Command line of omni_async (asynchronous output path for diffusion serving).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "check"):  # option checks that need more than argparse (the environment)
        args.check(args)
    code: int = args.run(args)
    return code
