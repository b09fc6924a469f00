"""``omni-async``: the command line.

One module per command (``demo``, ``soak``, ``bench``, ``cleanup``); ``parsers`` registers
their options and ``options`` holds the option types they share.  ``omni-async --help``
lists the commands.  Building the parser imports neither torch nor the commands'
implementations: each command's module is imported only when the command runs, so that
``omni-async --help``, ``omni-async COMMAND --help`` and ``omni-async --version`` answer
at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from omni_async.cli.parsers import COMMANDS

#: The exit status after Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130

__all__ = ["build_parser", "main", "version"]


def version() -> str:
    """The installed distribution's version, or the package's ``__version__`` where it is not installed."""
    try:
        return importlib.metadata.version("omni_async")
    except importlib.metadata.PackageNotFoundError:
        from omni_async import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``omni-async`` parser; every option says what it does and its default."""
    parser = argparse.ArgumentParser(
        prog="omni-async",
        description="Command line of omni_async (asynchronous output path for diffusion serving).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if hasattr(args, "check"):  # option checks that need more than argparse (the environment)
            args.check(args)
        code: int = args.run(args)
    except KeyboardInterrupt:
        # Ctrl-C before a command took it over (while torch and the model import, say):
        # one line instead of the traceback of wherever the import was.
        print("omni-async: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code
