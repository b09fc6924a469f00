"""The documentation in docs/ stays true to the package: every public name described,
every name it imports or cites importable, every path and link it cites present (the
sections a link names included), every page and section reachable from the contents
page, every Python block compiles, and the blocks marked to run do run."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import omni_async

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: The pages, in the order a reader meets them (and their run blocks run).
PAGES = ("engine.md", "models.md", "diffusers.md", "operators.md", "serve.md", "verification.md", "names.md")
#: The contents page, and what is left where the single guide was (a map to the pages).
CONTENTS = "README.md"
MOVED = "guide.md"
RUN_MARKER = "<!-- guide: run -->"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _text() -> str:
    """Every page, in order: what the checks of the whole documentation read."""
    return "\n".join(_page(name) for name in PAGES)


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


def headings(markdown: str) -> list[tuple[int, str]]:
    """(level, text) of every ``#`` heading outside fenced blocks, in order."""
    return [(len(h), text) for h, text in re.findall(r"^(#{1,6}) (.+)$", _FENCE.sub("", markdown), re.M)]


def anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to ``-`` (the headings here are unique within their page)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(markdown: str) -> list[tuple[str, str]]:
    """(target, fragment) of every markdown link outside fenced blocks; either may be empty."""
    found = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", _FENCE.sub("", markdown))
    return [(target, fragment) for target, fragment in found if not target.startswith(("http://", "https://"))]


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
    page = (
        "# Title\n\n## 1. The engine: `AsyncDiffusionEngine`\n```python\n# not a heading\n```\n### omni_async's `x_y`\n"
    )
    assert headings(page) == [(1, "Title"), (2, "1. The engine: `AsyncDiffusionEngine`"), (3, "omni_async's `x_y`")]
    assert [anchor(h) for _, h in headings(page)] == ["title", "1-the-engine-asyncdiffusionengine", "omni_asyncs-x_y"]
    assert links("[a](engine.md#errors), [b](#deadlines), [c](../spec/PROTOCOL.md), [d](https://x.org/y)") == [
        ("engine.md", "errors"),
        ("", "deadlines"),
        ("../spec/PROTOCOL.md", ""),
    ]


# -- the pages -----------------------------------------------------------------------------


def test_every_page_is_checked() -> None:
    """A page added to docs/ without joining PAGES would escape every check below."""
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted([*PAGES, CONTENTS, MOVED])


def test_the_contents_page_links_every_page_and_section() -> None:
    contents = set(links(_page(CONTENTS)))
    for page in PAGES:
        titles = [text for level, text in headings(_page(page)) if level == 1]
        assert len(titles) == 1, f"docs/{page} has {len(titles)} titles"
        assert (page, "") in contents, f"docs/{CONTENTS} does not link docs/{page}"
        unlinked = [text for level, text in headings(_page(page)) if level > 1 and (page, anchor(text)) not in contents]
        assert not unlinked, f"docs/{CONTENTS} does not link these sections of docs/{page}: {unlinked}"


@pytest.mark.parametrize("page", [*PAGES, CONTENTS, MOVED, "../README.md"])
def test_every_link_to_a_section_finds_it(page: str) -> None:
    """``engine.md#errors`` and ``#errors`` name a heading of that page (a renamed
    section must take its links along)."""
    source = DOCS / page
    for target, fragment in links(source.read_text(encoding="utf-8")):
        if not fragment:
            continue
        linked = (source.parent / target) if target else source
        assert linked.suffix == ".md", f"{page}: a fragment of a file that is not markdown: {target}#{fragment}"
        found = {anchor(text) for _, text in headings(linked.read_text(encoding="utf-8"))}
        assert fragment in found, f"{page}: no section #{fragment} in {target or page}"


def test_every_public_name_is_named_in_backticks() -> None:
    spans = inline_code(_text())
    missing = [
        name
        for name in omni_async.__all__
        if not any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", span) for span in spans)
    ]
    assert not missing, f"no page of docs/ names these public names in backticks: {missing}"


AUDIENCES = ("omni_async", "omni_async.worker", "omni_async.errors")


def _name_index() -> str:
    return _page("names.md")


def test_the_name_index_lists_exactly_each_audiences_public_api_with_a_description() -> None:
    sections = dict(re.findall(r"^## `([\w.]+)`: [^\n]*\n(.*?)(?=^## |\Z)", _name_index(), re.M | re.S))
    assert set(AUDIENCES) <= sections.keys(), sorted(sections)
    for module in AUDIENCES:
        public: list[str] = importlib.import_module(module).__all__
        entries = dict(re.findall(r"^\* `(\w+)`: (.*)$", sections[module], re.M))
        assert sorted(entries) == sorted(public), (
            f"{module}: missing: {sorted(set(public) - set(entries))}, not public: {sorted(set(entries) - set(public))}"
        )
        assert all(len(description.split()) >= 3 for description in entries.values()), entries
    # The names listed elsewhere resolve in the module named beside them.
    elsewhere = re.findall(r"^\* `(\w+)` \(`([\w.]+)`\): ", _name_index(), re.M)
    assert elsewhere
    for name, module in elsewhere:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_every_name_omni_async_exported_before_the_audiences_still_imports() -> None:
    """Code written against the one flat namespace keeps working (no behaviour change)."""
    listed = set(re.findall(r"^\* `(\w+)`", _name_index(), re.M))
    assert len(listed) >= 100, len(listed)
    for name in sorted(listed):
        assert getattr(omni_async, name) is not None, name


@pytest.mark.parametrize("page", PAGES)
def test_every_import_from_omni_async_in_the_pages_exists(page: str) -> None:
    for module, name in imports_from_omni_async(_page(page)):
        mod = importlib.import_module(module)
        assert hasattr(mod, name), f"`from {module} import {name}` in docs/{page} does not exist"
        if module == "omni_async":
            assert name in omni_async.__all__, f"{name} is not in omni_async.__all__"


def test_the_pages_import_from_omni_async() -> None:
    assert len(imports_from_omni_async(_text())) >= 20


@pytest.mark.parametrize("page", PAGES)
def test_every_omni_async_path_a_page_cites_resolves(page: str) -> None:
    text = _page(page)
    cited = {m.rstrip(".") for m in re.findall(r"\bomni_async(?:\.\w+)+", text)}
    unresolved = []
    for dotted in sorted(cited):
        try:
            resolve(dotted)
        except (ImportError, AttributeError):
            unresolved.append(dotted)
    assert not unresolved, f"docs/{page} cites what does not exist: {unresolved}"
    for module, name in re.findall(r"\"(omni_async(?:\.\w+)+):(\w+)\"", text):
        assert hasattr(importlib.import_module(module), name), f"{module}:{name}"


def test_the_pages_cite_the_verification_tools() -> None:
    assert "omni_async.verify.tlc" in _page("verification.md")


@pytest.mark.parametrize("page", [*PAGES, CONTENTS, MOVED])
def test_every_repository_path_a_page_cites_exists(page: str) -> None:
    text = _page(page)
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not link.startswith(("http://", "https://")):
            assert (DOCS / link).exists(), f"broken link in docs/{page}: {link}"
    paths = {p for span in inline_code(text) for p in re.findall(r"^[\w.-]+/[\w./-]+\.(?:md|py|tla|cfg)$", span)}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/{page} cites files that do not exist: {missing}"


def test_the_pages_link_the_protocol() -> None:
    assert "](../spec/PROTOCOL.md)" in _page(CONTENTS)
    assert "](../spec/PROTOCOL.md)" in _page("verification.md")


def test_every_python_block_compiles() -> None:
    assert len(python_blocks(_text())) >= 8
    for page in PAGES:
        for i, (body, _) in enumerate(python_blocks(_page(page))):
            compile(body, f"docs/{page} python block {i}", "exec")


@pytest.mark.parametrize("page", PAGES)
def test_every_run_marker_precedes_a_python_block(page: str) -> None:
    text = _page(page)
    marked = sum(1 for _, run in python_blocks(text) if run)
    markers = sum(1 for line in text.splitlines() if line.strip() == RUN_MARKER)
    assert marked == markers, f"docs/{page}: a run marker that is not right before a ```python block"


@pytest.mark.slow
def test_the_marked_blocks_run(tmp_path: Path) -> None:
    """The self-contained blocks (threads, no worker processes, no TLC), in one fresh interpreter."""
    runnable = [body for body, run in python_blocks(_text()) if run]  # in PAGES' order
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
        f"a docs block failed ({last}, in order of the run markers, page by page as in PAGES):\n{done.stdout}\n{done.stderr}"
    )
    assert done.stdout.rstrip().endswith("--- all blocks ran")
    # A few of the results the pages state in comments.
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
