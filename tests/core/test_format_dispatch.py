"""Issue 29: every dispatch on a request's format is exhaustive, for ``mypy --strict``.

A copy of the library gets a fifth ``Format`` member that nothing handles; mypy must
then report each place that dispatches on a format (the table, the host encoders, the
device's choice), through ``assert_never``.  A dispatch that falls through instead (a
``match`` without its ``assert_never``, an ``if``/``elif`` chain) is silent here and
returned an empty file at run time.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import omni_async

pytestmark = pytest.mark.slow  # mypy over a copy of the library: tens of seconds

# Each function that dispatches on a format, by the file it lives in.
DISPATCHES = {
    "omni_async/core/encoding.py": ["format_spec"],
    "omni_async/engine/encoders.py": ["encode_image", "_encode"],
    "omni_async/worker/encode.py": ["encodes_on_device"],
}


def test_a_format_no_dispatch_handles_is_a_mypy_error_at_each_dispatch(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    src = Path(omni_async.__file__).parent
    copy = tmp_path / "src" / "omni_async"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    encoding = copy / "core" / "encoding.py"
    text = encoding.read_text()
    assert '    MP4 = "mp4"\n' in text
    encoding.write_text(text.replace('    MP4 = "mp4"\n', '    MP4 = "mp4"\n    TIFF = "tiff"\n'))
    files = [str(tmp_path / "src" / f) for f in DISPATCHES]
    stdout, stderr, _ = api.run(
        [
            "--config-file",
            "",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--follow-imports=skip",
            *files,
        ]
    )
    errors = [line for line in stdout.splitlines() if "assert_never" in line and "Format.TIFF" in line]
    for rel, functions in DISPATCHES.items():
        lines = (tmp_path / "src" / rel).read_text().splitlines()
        starts = {name: i for i, line in enumerate(lines, 1) for name in functions if line.startswith(f"def {name}(")}
        assert set(starts) == set(functions), (rel, starts)
        for name, start in starts.items():
            end = next((i for i, line in enumerate(lines[start:], start + 1) if line.startswith("def ")), len(lines))
            hits = [e for e in errors if e.startswith(str(tmp_path / "src" / rel)) and start < _line(e) < end]
            assert hits, f"{rel}:{name} does not fail mypy for a format it does not handle:\n{stdout}{stderr}"


def _line(error: str) -> int:
    match = re.search(r"\.py:(\d+):", error)
    assert match is not None, error
    return int(match.group(1))
