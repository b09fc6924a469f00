"""Issue 18: ``import omni_async`` imports neither torch nor the reference models, and
``omni-async --help`` builds its parser without importing torch or the commands'
implementations; ``omni-async --version`` prints the package's version.

Each import check runs in a fresh interpreter (this one has imported everything)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import omni_async
from omni_async import cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("omni_async.models.tiny", "omni_async.models.dit", "omni_async.models.synthetic")
# What a help must not import: torch (seconds) and what the commands run.
HEAVY = ("torch", "numpy", "rich", "matplotlib", "ray", "omni_async.engine.engine", "omni_async.cli.demo", *MODELS)


def _loaded_after(code: str, watch: tuple[str, ...]) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter; which of ``watch`` it left in ``sys.modules``, and what it printed."""
    probe = (
        "import contextlib, io, json, sys\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + f"print(json.dumps({{'loaded': [m for m in {list(watch)!r} if m in sys.modules], 'out': out.getvalue()}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    return [str(m) for m in result["loaded"]], str(result["out"])


def test_import_omni_async_leaves_torch_and_the_models_out_and_loads_them_on_use() -> None:
    code = (
        "import omni_async\n"
        "before = [m for m in sys.modules if m == 'torch' or m.startswith('omni_async.models')]\n"
        "worker = omni_async.TinyDiffusionWorker\n"
        "from omni_async.models.tiny import TinyDiffusionWorker\n"
        "assert worker is TinyDiffusionWorker, worker\n"
        "from omni_async import DiTPipelineWorker, SyntheticVideoWorker\n"
        "print(json.dumps(before), DiTPipelineWorker.__module__, SyntheticVideoWorker.__module__)"
    )
    loaded, out = _loaded_after(code, ("omni_async.models.tiny", "omni_async.models.dit"))
    before, *modules = out.split()
    assert json.loads(before) == [], f"`import omni_async` imported {before}"
    assert modules == ["omni_async.models.dit", "omni_async.models.tiny"]
    assert loaded == ["omni_async.models.tiny", "omni_async.models.dit"]  # loaded when used


def test_every_lazy_name_is_the_name_of_its_module_and_typed_for_checkers() -> None:
    lazy: dict[str, str] = omni_async._LAZY
    assert set(omni_async.__all__) <= set(lazy) | set(vars(omni_async))
    for name, module in lazy.items():
        if module == "omni_async.executor.ray_executor":
            pytest.importorskip("ray")
        assert getattr(omni_async, name) is getattr(importlib.import_module(module), name), name
    # The same names, from the same modules, under ``if TYPE_CHECKING:`` (what mypy sees).
    tree = ast.parse((ROOT / "src" / "omni_async" / "__init__.py").read_text(encoding="utf-8"))
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    typed = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == lazy
    # Everything else public is imported eagerly, and every public name resolves.
    assert all(name in vars(omni_async) for name in omni_async.__all__)
    assert set(omni_async.__all__) <= set(dir(omni_async))
    with pytest.raises(AttributeError, match="NoSuchName"):
        _ = omni_async.NoSuchName


def _cpu_build_of_torch() -> bool:
    return importlib.metadata.version("torch").endswith("+cpu")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["demo", "--help"], ["soak", "--help"], ["bench", "--help"], ["cleanup", "--help"], ["--version"]],
)
def test_the_help_imports_neither_torch_nor_the_commands(argv: list[str]) -> None:
    code = f"from omni_async.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code"
    loaded, out = _loaded_after(code, HEAVY)
    if argv[0] == "bench" and not _cpu_build_of_torch():
        # bench's --device defaults to cuda where torch sees a device: only torch can say.
        loaded = [m for m in loaded if m != "torch"]
    assert loaded == [], f"omni-async {' '.join(argv)} imported {loaded}"
    assert out.startswith("omni-async ") if argv == ["--version"] else "usage: omni-async" in out


def test_the_parser_imports_no_command_until_it_runs() -> None:
    code = (
        "from omni_async.cli import build_parser\n"
        "args = build_parser().parse_args(['cleanup', '--dry-run'])\n"
        "print(args.run.__name__)"
    )
    assert _loaded_after(code, ("omni_async.cli.cleanup", *HEAVY)) == ([], "run_cleanup\n")


def test_version_prints_the_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_async.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    try:
        expected = importlib.metadata.version("omni_async")
    except importlib.metadata.PackageNotFoundError:
        expected = omni_async.__version__
    assert done.stdout == f"omni-async {expected}\n"
    # The package's own version is the project's, so the fallback says the same.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert omni_async.__version__ == project["version"]


def test_version_falls_back_to_the_package_version_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == omni_async.__version__
