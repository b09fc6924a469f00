from __future__ import annotations

import pytest
import torch

from omni_async import DiffusionOutput, DiffusionRequest
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
    assert pp.host is not None and pp.run_host(out, DiffusionRequest("r")) == "r"


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


def test_the_host_stage_form_is_detected_once_at_construction() -> None:
    out = DiffusionOutput("r", {"x": 1})
    request = DiffusionRequest("r", {"scale": 2})

    def one(output: DiffusionOutput) -> object:
        return output.output["x"]

    def two(output: DiffusionOutput, request: DiffusionRequest) -> object:
        return output.output["x"] * request.params["scale"]

    def two_with_default(output: DiffusionOutput, request: DiffusionRequest | None = None) -> object:
        return request is not None

    class Callable1:
        def __call__(self, output: DiffusionOutput) -> object:
            return "one"

    assert PostProcess("f1", host=one).host_takes_request is False
    assert PostProcess("f2", host=two).host_takes_request is True
    assert PostProcess("f1", host=one).run_host(out, request) == 1
    assert PostProcess("f2", host=two).run_host(out, request) == 2
    assert PostProcess("f3", host=two_with_default).run_host(out, request) is True
    assert PostProcess("f4", host=Callable1()).run_host(out, request) == "one"
    assert PostProcess("f5", host=lambda *args: len(args)).run_host(out, request) == 2
    with pytest.raises(UsageError, match=r"must take \(output\) or \(output, request\)"):
        PostProcess("f6", host=lambda a, b, c: None)  # type: ignore[arg-type]  # the point: refused
    with pytest.raises(UsageError, match="host_reads_only must be a bool"):
        PostProcess("f7", host=one, host_reads_only=1)  # type: ignore[arg-type]
    # Equal post-processes stay equal (register twice is harmless); the flag is part of it.
    assert PostProcess("f1", host=one) == PostProcess("f1", host=one)
    assert PostProcess("f1", host=one) != PostProcess("f1", host=one, host_reads_only=True)


def test_an_unknown_name_asked_for_by_a_request_names_the_request() -> None:
    register_postprocess(PostProcess("test-pp-a", device=_to_uint8))
    with pytest.raises(UnknownPostProcess) as err:
        get_postprocess("test-pp-nope", request_id="req-7")
    assert str(err.value).startswith("request 'req-7' asks for post-process 'test-pp-nope': no post-process")
    assert err.value.request_id == "req-7" and "test-pp-a" in err.value.known
