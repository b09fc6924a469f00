"""``bench/serve_load.py --tiny`` runs end to end (a smoke test: no timing is asserted)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a server and an engine start (~20 s each here); tests/serve/test_serve_api.py covers the server
def test_the_load_bench_smoke_run_serves_every_request(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "serve_load.py"),
            "--tiny",
            "--params",
            '{"step_ms": 1}',
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Strict JSON: a figure nothing was measured for is null, never NaN.
    report = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the report"))
    assert [r["mode"] for r in report["runs"]] == ["http", "http-mp4", "direct", "direct-mp4"]
    assert [(r["requests"], r["failures"]) for r in report["runs"]] == [(24, 0), (2, 0)] * 2, report["runs"]
    assert report["server_exit"] == 0 and report["runs"][0]["health_probes"] > 0
    assert "http_over_direct =" in done.stdout and "--tiny" in report["command"]
    assert report["config"]["params"] == {"step_ms": 1}


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "bench" / "serve_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_server_keeps_the_callers_python_path() -> None:
    # On the device machine the serve extra is installed with `pip install --target DIR`
    # and found through PYTHONPATH: a server started with src alone failed to import fastapi.
    module = _bench()
    env = module.server_env({"PYTHONPATH": "/opt/site-a:/opt/site-b", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT / "src"), "/opt/site-a", "/opt/site-b"]
    assert env["HOME"] == "/root"
    assert module.server_env({})["PYTHONPATH"] == str(ROOT / "src")


@pytest.mark.parametrize("text", ["[1]", "step_ms=5", '"x"'])
def test_params_must_be_a_json_object(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="JSON"):
        _bench().model_params(text)
