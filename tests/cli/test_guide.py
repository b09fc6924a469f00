"""docs/guide.md stays true to the package: every public name described, every name it
imports or cites importable, every path it cites present, every Python block compiles,
and the blocks marked to run do run."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import omni_async

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
RUN_MARKER = "<!-- guide: run -->"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def _text() -> str:
    return GUIDE.read_text(encoding="utf-8")


def python_blocks(markdown: str) -> list[tuple[str, bool]]:
    """Each ```python block's body, and whether the line before it is the run marker."""
    blocks = []
    for m in _FENCE.finditer(markdown):
        if m.group(1) != "python":
            continue
        before = markdown[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((m.group(2), before.strip() == RUN_MARKER))
    return blocks


def inline_code(markdown: str) -> list[str]:
    """The `inline code` spans outside fenced blocks."""
    return re.findall(r"`([^`\n]+)`", _FENCE.sub("", markdown))


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def imports_from_omni_async(markdown: str) -> list[tuple[str, str]]:
    """(module, name) for every ``from omni_async... import ...`` in the text, code or prose."""
    found = []
    for m in re.finditer(r"from\s+(omni_async(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n`]+)", markdown):
        names = m.group(2).strip().strip("()")
        for item in names.split(","):
            item = item.split("#")[0].strip()
            if not item or item == "...":
                continue
            found.append((m.group(1), item.split(" as ")[0].strip()))
    return found


# -- the parsers themselves ---------------------------------------------------------------


def test_the_parsers_see_what_they_should() -> None:
    sample = (
        "Use `SegmentPool` and `omni_async.verify.tlc`.\n"
        f"{RUN_MARKER}\n```python\nfrom omni_async import (\n    Deadlines,\n    UsageError,  # why\n)\n```\n"
        "```python\nx = 1\n```\n```\nnot python `Inside`\n```\n"
    )
    assert python_blocks(sample) == [
        ("from omni_async import (\n    Deadlines,\n    UsageError,  # why\n)\n", True),
        ("x = 1\n", False),
    ]
    assert inline_code(sample) == ["SegmentPool", "omni_async.verify.tlc"]
    assert imports_from_omni_async(sample) == [("omni_async", "Deadlines"), ("omni_async", "UsageError")]
    assert resolve("omni_async.verify.tlc.main") is importlib.import_module("omni_async.verify.tlc").main
    with pytest.raises(AttributeError):
        resolve("omni_async.NoSuchName")


# -- the guide ------------------------------------------------------------------------------


def test_every_public_name_is_named_in_backticks() -> None:
    spans = inline_code(_text())
    missing = [
        name
        for name in omni_async.__all__
        if not any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", span) for span in spans)
    ]
    assert not missing, f"docs/guide.md never names these public names in backticks: {missing}"


AUDIENCES = ("omni_async", "omni_async.worker", "omni_async.errors")


def test_the_name_index_lists_exactly_each_audiences_public_api_with_a_description() -> None:
    index = _text().split("## 13. Every public name", 1)[1].split("\n## ", 1)[0]
    sections = dict(re.findall(r"^### `([\w.]+)`: [^\n]*\n(.*?)(?=^### |\Z)", index, re.M | re.S))
    assert set(AUDIENCES) <= sections.keys(), sorted(sections)
    for module in AUDIENCES:
        public: list[str] = importlib.import_module(module).__all__
        entries = dict(re.findall(r"^\* `(\w+)`: (.*)$", sections[module], re.M))
        assert sorted(entries) == sorted(public), (
            f"{module}: missing: {sorted(set(public) - set(entries))}, not public: {sorted(set(entries) - set(public))}"
        )
        assert all(len(description.split()) >= 3 for description in entries.values()), entries
    # The names listed elsewhere resolve in the module named beside them.
    elsewhere = re.findall(r"^\* `(\w+)` \(`([\w.]+)`\): ", index, re.M)
    assert elsewhere
    for name, module in elsewhere:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_every_name_omni_async_exported_before_the_audiences_still_imports() -> None:
    """Code written against the one flat namespace keeps working (no behaviour change)."""
    index = _text().split("## 13. Every public name", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\* `(\w+)`", index, re.M))
    assert len(listed) >= 100, len(listed)
    for name in sorted(listed):
        assert getattr(omni_async, name) is not None, name


def test_every_import_from_omni_async_in_the_guide_exists() -> None:
    found = imports_from_omni_async(_text())
    assert found, "the guide imports nothing from omni_async"
    for module, name in found:
        mod = importlib.import_module(module)
        assert hasattr(mod, name), f"`from {module} import {name}` in docs/guide.md does not exist"
        if module == "omni_async":
            assert name in omni_async.__all__, f"{name} is not in omni_async.__all__"


def test_every_omni_async_path_the_guide_cites_resolves() -> None:
    text = _text()
    cited = {m.rstrip(".") for m in re.findall(r"\bomni_async(?:\.\w+)+", text)}
    assert "omni_async.verify.tlc" in cited
    unresolved = []
    for dotted in sorted(cited):
        try:
            resolve(dotted)
        except (ImportError, AttributeError):
            unresolved.append(dotted)
    assert not unresolved, f"docs/guide.md cites what does not exist: {unresolved}"
    for module, name in re.findall(r"\"(omni_async(?:\.\w+)+):(\w+)\"", text):
        assert hasattr(importlib.import_module(module), name), f"{module}:{name}"


def test_every_repository_path_the_guide_cites_exists() -> None:
    text = _text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    for link in links:
        assert (GUIDE.parent / link).exists(), f"broken link in docs/guide.md: {link}"
    assert "../spec/PROTOCOL.md" in links
    paths = {p for span in inline_code(text) for p in re.findall(r"^[\w.-]+/[\w./-]+\.(?:md|py|tla|cfg)$", span)}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/guide.md cites files that do not exist: {missing}"


def test_every_python_block_compiles() -> None:
    blocks = python_blocks(_text())
    assert len(blocks) >= 8
    for i, (body, _) in enumerate(blocks):
        compile(body, f"docs/guide.md python block {i}", "exec")


def test_every_run_marker_precedes_a_python_block() -> None:
    text = _text()
    marked = sum(1 for _, run in python_blocks(text) if run)
    markers = sum(1 for line in text.splitlines() if line.strip() == RUN_MARKER)
    assert marked == markers, "a run marker that is not right before a ```python block"


@pytest.mark.slow
def test_the_marked_blocks_run(tmp_path: Path) -> None:
    """The self-contained blocks (threads, no worker processes, no TLC), in one fresh interpreter."""
    runnable = [body for body, run in python_blocks(_text()) if run]
    assert len(runnable) >= 5
    for i, body in enumerate(runnable):
        (tmp_path / f"block_{i}.py").write_text(body, encoding="utf-8")
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import runpy, sys\n"
        f"for i in range({len(runnable)}):\n"
        "    print(f'--- block {i}', flush=True)\n"
        "    runpy.run_path(f'block_{i}.py', run_name='__main__')\n"
        "print('--- all blocks ran')\n",
        encoding="utf-8",
    )
    done = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    last = [line for line in done.stdout.splitlines() if line.startswith("--- block")][-1:]
    assert done.returncode == 0, (
        f"guide block failed ({last}, in order of the run markers):\n{done.stdout}\n{done.stderr}"
    )
    assert done.stdout.rstrip().endswith("--- all blocks ran")
    # A few of the results the guide states in comments.
    assert "RuntimeError - forward of bad failed on purpose" in done.stdout
    assert "OutputError no-such-id" in done.stdout
    assert "[None, None]" in done.stdout
    assert "['GenerationChunk', 'GenerationChunk', 'GenerationResult']" in done.stdout


# -- the other documents that name modules ---------------------------------------------------

OTHER_DOCS = [
    "README.md",
    "spec/PROTOCOL.md",
    "tla/README.md",
    "tla/AsyncOutput.tla",
    "tla/AsyncOutputState.tla",
    "tla/AsyncOutputRegistry.tla",
    "tla/AsyncOutputWorker.tla",
    "tla/AsyncOutputExecutor.tla",
    "tla/TraceAsyncOutput.tla",
]


@pytest.mark.parametrize("doc", OTHER_DOCS)
def test_other_documents_cite_only_what_exists(doc: str) -> None:
    """Module paths (``omni_async.core.registry.OutputRegistry``) and repository paths
    (``tests/verify/test_tla_gen.py``) in the documents that describe the code."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    unresolved = []
    for dotted in sorted({m.rstrip(".") for m in re.findall(r"\bomni_async(?:\.\w+)+", text)}):
        try:
            resolve(dotted)
        except (ImportError, AttributeError):
            unresolved.append(dotted)
    assert not unresolved, f"{doc} cites what does not exist: {unresolved}"
    if doc.endswith(".md"):
        paths = {p for span in inline_code(text) for p in re.findall(r"^[\w.-]+/[\w./-]+\.(?:md|py|tla|cfg)$", span)}
        # Relative to the repository, to the document's folder, or to the package.
        bases = (ROOT, (ROOT / doc).parent, ROOT / "src" / "omni_async")
        missing = sorted(p for p in paths if not any((base / p).exists() for base in bases))
        assert not missing, f"{doc} cites files that do not exist: {missing}"
