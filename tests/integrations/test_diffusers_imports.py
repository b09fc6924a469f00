"""diffusers stays inside ``omni_async.integrations``: ``import omni_async``, its audiences
and ``omni-async --help`` import neither diffusers nor transformers, and neither does
importing the integration -- only reading a pipeline's config (``spec()`` does, to check
at once what it can) or building one does.  Each check in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("diffusers", "transformers", "omni_async.integrations")


def _loaded_after(code: str) -> list[str]:
    probe = (
        "import contextlib, io, json, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return [str(m) for m in json.loads(done.stdout.splitlines()[-1])]


def test_import_omni_async_and_its_audiences_import_no_integration() -> None:
    code = "import omni_async, omni_async.worker, omni_async.errors, omni_async.engine, omni_async.executor"
    assert _loaded_after(code) == []


def test_the_help_imports_no_integration() -> None:
    code = "from omni_async.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0"
    assert _loaded_after(code) == []


@pytest.mark.slow
def test_the_integration_imports_diffusers_only_when_a_pipeline_is_read() -> None:
    code = (
        "from omni_async.integrations.diffusers import DiffusersPipelineWorker\n"
        "assert 'diffusers' not in sys.modules and 'transformers' not in sys.modules\n"
        "spec = DiffusersPipelineWorker.spec(builder='omni_async.integrations.diffusers.tiny:tiny_dit')\n"
    )
    loaded = _loaded_after(code)
    assert "diffusers" in loaded and "omni_async.integrations" in loaded, loaded


def test_without_diffusers_the_error_and_the_guide_say_how_to_install_the_extra_from_a_checkout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """omni_async is on no package index: ``pip install 'omni_async[diffusers]'`` finds
    nothing in a fresh venv.  The error (diffusers missing: ``import diffusers`` fails, as
    it does there) and the guide name the installs that work, from a checkout."""
    from pathlib import Path

    from omni_async.core.errors import UsageError
    from omni_async.integrations.diffusers.edge import load_diffusers

    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
    with pytest.raises(UsageError, match="needs diffusers") as err:
        load_diffusers()
    guide = (Path(__file__).resolve().parents[2] / "docs" / "diffusers.md").read_text()
    for text in (str(err.value), guide):
        assert "pip install -e '.[diffusers]'" in text and "pip install '/path/to/omni_async[diffusers]'" in text
        assert "pip install 'omni_async[diffusers]'" not in text  # on no index: it finds nothing
