from __future__ import annotations

import pytest
import torch

from omni_async import DiffusionOutput
from omni_async.errors import UnknownPostProcess, UsageError
from omni_async.worker import (
    PostProcess,
    get_postprocess,
    register_postprocess,
    registered_postprocesses,
)


def _to_uint8(out: DiffusionOutput) -> DiffusionOutput:
    return out


def test_register_and_get_by_name() -> None:
    pp = register_postprocess(PostProcess("test-pp-a", device=_to_uint8))
    assert get_postprocess("test-pp-a") is pp
    assert "test-pp-a" in registered_postprocesses()
    # Registering the same one again is harmless (a module imported twice).
    assert register_postprocess(PostProcess("test-pp-a", device=_to_uint8)) == pp


def test_a_different_one_under_a_taken_name_needs_replace() -> None:
    register_postprocess(PostProcess("test-pp-b", host=lambda o: 1))
    with pytest.raises(UsageError, match="already registered for pipeline 'test-pp-b'"):
        register_postprocess(PostProcess("test-pp-b", host=lambda o: 2))
    new = register_postprocess(PostProcess("test-pp-b", host=lambda o: 3), replace=True)
    assert get_postprocess("test-pp-b") is new


def test_unknown_name_is_typed_and_lists_the_known() -> None:
    register_postprocess(PostProcess("test-pp-c"))
    with pytest.raises(UnknownPostProcess, match=r"pipeline 'nope'.*test-pp-c") as info:
        get_postprocess("nope")
    assert info.value.name == "nope"
    assert isinstance(info.value, KeyError)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(UsageError, match="PostProcess host: must be callable"):
        PostProcess("x", host="not callable")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="non-empty str"):
        PostProcess("")
    with pytest.raises(UsageError, match="takes a PostProcess"):
        register_postprocess("x")  # type: ignore[arg-type]


def test_stages_run_as_given() -> None:
    out = DiffusionOutput(request_id="r", output={"image": torch.ones(2)})
    pp = PostProcess("test-pp-d", host=lambda o: o.request_id, device=_to_uint8)
    assert pp.device is not None and pp.device(out) is out
    assert pp.host is not None and pp.host(out) == "r"


def test_a_reference_pipeline_not_yet_imported_names_its_module() -> None:
    """``import omni_async`` imports no reference model: a driver that names ``"tiny"``
    before importing it is told which module registers it (in a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "from omni_async.worker.postprocess import UnknownPostProcess, get_postprocess\n"
        "try:\n    get_postprocess('tiny')\nexcept UnknownPostProcess as e:\n    print(e)\n"
        "import omni_async.models.tiny\nprint(get_postprocess('tiny').name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "import omni_async.models.tiny first" in out and out.strip().endswith("tiny")
