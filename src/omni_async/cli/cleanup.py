"""``omni-async cleanup``: remove what crashed executors left in ``/dev/shm``.

The segments and lock files of pools, and the result channels' credit semaphores
(``sem.omni-<pid>-sem-...``), whose executor (the pid in their names) no longer runs.  ``--dry-run`` only lists them.  A live executor's files are never touched.
"""

from __future__ import annotations

import argparse

from omni_async.cli.parsers import add_cleanup as add_parser
from omni_async.transport.shm import files

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Remove (or with --dry-run list) the /dev/shm files of executors that died; 1 if one could not go."""
    found = files.dead_executor_files()
    removed: list[files.DeadFile] = []
    failed = 0
    for f in found:
        why = f"{f.size} bytes, executor pid {f.pid} not running"
        if args.dry_run:
            print(f"would remove {f.path} ({why})")
            removed.append(f)
            continue
        try:
            gone = files.unlink(f.name)
        except OSError as exc:
            print(f"cannot remove {f.path}: {exc}")
            failed += 1
            continue
        if gone:
            print(f"removed {f.path} ({why})")
            removed.append(f)
    verb = "would remove" if args.dry_run else "removed"
    pids = sorted({f.pid for f in removed})
    print(
        f"{verb} {len(removed)} file(s), {sum(f.size for f in removed)} bytes, "
        f"of {len(pids)} dead executor(s)" + (f": pid(s) {', '.join(map(str, pids))}" if pids else "")
    )
    return 1 if failed else 0
