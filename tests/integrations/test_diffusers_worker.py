"""``DiffusersPipelineWorker`` on its own (no executor): bit-exact against the pipeline
called directly, batches split per request, the checks made from the pipeline's config,
the batch key.  Real tiny pipelines (DiT and Wan, random weights from configs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import ImagePipelineOutput
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

from helpers.diffusers_direct import (  # dit_direct, wan_direct: module fixtures, used by name
    DIT,
    WAN,
    direct_call,
    dit_direct,  # noqa: F401
    dit_params,
    tensor,
    wan_direct,  # noqa: F401
    wan_params,
)
from omni_async.core.errors import InvalidRequest, UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.integrations.diffusers import DiffusersPipelineWorker, batch_key
from omni_async.integrations.diffusers.tiny import tiny_prompt_embeds


@pytest.fixture(scope="module")
def dit() -> DiffusersPipelineWorker:
    return DiffusersPipelineWorker(builder=DIT)


@pytest.fixture(scope="module")
def wan() -> DiffusersPipelineWorker:
    return DiffusersPipelineWorker(builder=WAN)


def test_dit_request_is_bit_exact_against_the_direct_call(dit: DiffusersPipelineWorker, dit_direct: Any) -> None:
    params = dit_params(seed=5, label=42)
    out = dit.execute_model(DiffusionRequest("d", params))
    want = direct_call(dit_direct, params)
    assert type(out.output) is ImagePipelineOutput and out.request_id == "d"
    assert out.output.images.shape == (1, 3, 16, 16) and torch.equal(out.output.images, want.images)
    other = dit.execute_model(DiffusionRequest("e", dit_params(seed=6, label=42))).output.images
    assert not torch.equal(other, want.images)  # the seed is the request's own


def test_wan_request_is_bit_exact_against_the_direct_call(wan: DiffusersPipelineWorker, wan_direct: Any) -> None:
    params = wan_params(seed=3)
    out = wan.execute_model(DiffusionRequest("w", params))
    want = direct_call(wan_direct, params)
    assert type(out.output) is WanPipelineOutput
    assert out.output.frames.shape == (1, 5, 3, 16, 16) and torch.equal(out.output.frames, want.frames)


def test_dit_batch_members_match_their_own_calls(dit: DiffusersPipelineWorker, dit_direct: Any) -> None:
    """Each member draws its own call's noise and takes its own label: its pixels are its
    own call's up to the last bits.  Bit for bit on some CPUs, not on all: on an AMD EPYC
    the batch of four rounds differently from a single call (at most 3.6e-7 here, the
    transformer's gemms by batch size, as Wan's below)."""
    params = [dit_params(seed=10 + i, label=i * 100) for i in range(4)]
    calls = dit.pipeline_calls
    batch = dit.execute_model_batch([DiffusionRequest(f"b{i}", p) for i, p in enumerate(params)])
    assert dit.pipeline_calls == calls + 1  # one pipeline call for the four
    assert [o.request_id for o in batch.outputs] == ["b0", "b1", "b2", "b3"]
    for out, p in zip(batch.outputs, params, strict=True):
        assert type(out.output) is ImagePipelineOutput
        torch.testing.assert_close(out.output.images, direct_call(dit_direct, p).images, rtol=0, atol=2e-6)
    # ...and not any other member's: the seed and the label are each request's own.
    first = batch.outputs[0].output.images
    assert all((o.output.images - first).abs().max() > 1e-3 for o in batch.outputs[1:])


@pytest.mark.slow
def test_wan_batch_is_the_direct_batched_call_and_each_member_close_to_its_own(
    wan: DiffusersPipelineWorker, wan_direct: Any
) -> None:
    """Each member draws its own call's noise (one generator each).  Its pixels equal the
    direct call of the same batch bit for bit (with the VAE decoding member by member, as the
    worker has it); against its own call they differ in the last bits on the CPU: Wan's
    transformer rounds by batch size (oneDNN's Conv3d, a gemm against a gemv)."""
    params = [wan_params(seed=20 + i) for i in range(3)]
    wan_direct.vae.enable_slicing()  # a no-op for the single calls of the other tests
    calls = wan.pipeline_calls
    batch = wan.execute_model_batch([DiffusionRequest(f"v{i}", p) for i, p in enumerate(params)])
    assert wan.pipeline_calls == calls + 1
    stacked = wan_direct(
        prompt_embeds=torch.cat([tensor(p, "prompt_embeds") for p in params]),
        negative_prompt_embeds=torch.cat([tensor(p, "negative_prompt_embeds") for p in params]),
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=5.0,
        generator=[torch.Generator().manual_seed(20 + i) for i in range(3)],
        output_type="pt",
    ).frames
    for i, (out, p) in enumerate(zip(batch.outputs, params, strict=True)):
        assert torch.equal(out.output.frames, stacked[i : i + 1])
        torch.testing.assert_close(out.output.frames, direct_call(wan_direct, p).frames, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_mixed_batch_runs_one_call_per_batch_key(dit: DiffusersPipelineWorker, dit_direct: Any) -> None:
    params = [
        dit_params(seed=1),
        dit_params(seed=2, steps=2),
        dit_params(seed=3),
        dit_params(seed=4, guidance_scale=1.0),
    ]
    calls = dit.pipeline_calls
    batch = dit.execute_model_batch([DiffusionRequest(f"m{i}", p) for i, p in enumerate(params)])
    assert dit.pipeline_calls == calls + 3
    for out, p in zip(batch.outputs, params, strict=True):
        # m0 and m2 share a call: up to the last bits (test_dit_batch_members_match_their_own_calls).
        torch.testing.assert_close(out.output.images, direct_call(dit_direct, p).images, rtol=0, atol=2e-6)


@pytest.mark.slow
def test_latent_output_where_the_pipeline_has_it(wan: DiffusersPipelineWorker, wan_direct: Any) -> None:
    params = wan_params(seed=4, output_type="latent")
    out = wan.execute_model(DiffusionRequest("l", params)).output
    assert list(out) == ["latents"] and out["latents"].shape == (1, 16, 2, 2, 2)
    assert torch.equal(out["latents"], direct_call(wan_direct, params).frames)


def test_batch_key_groups_what_can_share_a_call() -> None:
    def key(**params: object) -> object:
        return batch_key(DiffusionRequest("k", params))

    assert key(**dit_params(1)) == key(**dit_params(2, label=3))
    assert key(**dit_params(1)) != key(**dit_params(1, steps=4))
    assert key(**wan_params(1)) == key(**wan_params(2))
    assert key(**wan_params(1)) != key(**wan_params(1, frames=9))
    assert key(**wan_params(1)) != key(**{**wan_params(1), "prompt_embeds": tiny_prompt_embeds(1, seq=4)})
    assert key(**dit_params(1)) != key(**dit_params(1, output_type="latent"))
    assert key(class_labels=1, guidance_scale=[1]) is None  # unhashable: alone
    assert DiffusersPipelineWorker.batch_key is not None


# -- the checks, from the config --------------------------------------------------------------


@pytest.fixture(scope="module")
def check_dit() -> Any:
    return DiffusersPipelineWorker.request_validator(builder=DIT)


@pytest.fixture(scope="module")
def check_wan() -> Any:
    return DiffusersPipelineWorker.request_validator(builder=WAN)


@pytest.mark.parametrize(
    ("params", "parameter", "message"),
    [
        (
            {"class_labels": 1000},
            "class_labels",
            r"must be one class, an int in 0\.\.999 .*num_embeds_ada_norm=1000.*got 1000",
        ),
        ({}, "class_labels", r"is required by DiTPipeline"),
        ({"class_labels": 1, "height": 64}, "height", r"is not accepted by DiTPipeline.__call__ \(it takes \["),
        ({"class_labels": 1, "num_inference_steps": 0}, "num_inference_steps", r"must be an int in 1\.\.10000, got 0"),
        ({"class_labels": 1, "seed": -1}, "seed", r"must be an int in 0\.\.2\*\*64-1"),
        ({"class_labels": 1, "output_type": "latent"}, "output_type", r"must be one of \['pt'\]"),
        ({"class_labels": 1, "guidance_scale": "high"}, "guidance_scale", r"must be a finite number >= 0"),
    ],
)
def test_dit_checks_name_the_request_the_parameter_and_the_fix(
    check_dit: Any, params: dict[str, object], parameter: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=rf"request 'bad': parameter '{parameter}' {message}") as err:
        check_dit(DiffusionRequest("bad", params))
    assert err.value.request_id == "bad" and err.value.parameter == parameter


@pytest.mark.parametrize(
    ("change", "parameter", "message"),
    [
        (
            {"height": 24},
            "height",
            r"must be a multiple of 16 \(the VAE's scale factor times the transformer's patch size\), got 24: send 16 or 32",
        ),
        ({"num_frames": 6}, "num_frames", r"must be 4k \+ 1 .*got 6: send 5 or 9"),
        ({"prompt_embeds": torch.zeros(1, 8, 31)}, "prompt_embeds", r"must have shape \[seq, 32\] .*got \[1, 8, 31\]"),
        ({"prompt": "a cat"}, "prompt", r"needs a text encoder, and this WanPipeline has none: send prompt_embeds"),
        ({"negative_prompt_embeds": None}, "negative_prompt_embeds", r"must be a float tensor"),
        ({"preview_every": 0}, "preview_every", r"must be an int >= 1"),
    ],
)
def test_wan_checks_name_the_request_the_parameter_and_the_fix(
    check_wan: Any, change: dict[str, object], parameter: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=rf"request 'bad': parameter '{parameter}' {message}"):
        check_wan(DiffusionRequest("bad", {**wan_params(1), **change}))


def test_wan_needs_negative_embeds_for_guidance_without_a_text_encoder(check_wan: Any) -> None:
    params = {k: v for k, v in wan_params(1).items() if k != "negative_prompt_embeds"}
    with pytest.raises(
        InvalidRequest, match=r"'negative_prompt_embeds' is required with prompt_embeds when guidance_scale > 1"
    ):
        check_wan(DiffusionRequest("bad", params))
    check_wan(DiffusionRequest("ok", {**params, "guidance_scale": 1.0}))
    check_wan(DiffusionRequest("ok", wan_params(1)))


def test_the_worker_checks_in_the_forward_too(dit: DiffusersPipelineWorker) -> None:
    with pytest.raises(InvalidRequest, match="'class_labels'"):
        dit.execute_model(DiffusionRequest("bad", {"class_labels": -1}))


def test_a_wrong_source_is_refused_with_what_to_do() -> None:
    with pytest.raises(UsageError, match="give exactly one of builder="):
        DiffusersPipelineWorker.spec()
    with pytest.raises(UsageError, match="unknown keyword argument"):
        DiffusersPipelineWorker.spec(builder=DIT, steps=3)
    with pytest.raises(UsageError, match="cannot be found"):
        DiffusersPipelineWorker.request_validator(builder="omni_async.integrations.diffusers.tiny:nope")


def test_a_pretrained_folder_is_served_and_checked_from_its_json(tmp_path: Path, dit_direct: Any) -> None:
    """``pretrained=``: the worker loads the folder (``from_pretrained``), the executor's check
    reads its JSON configs alone."""
    dit_direct.save_pretrained(tmp_path)
    check = DiffusersPipelineWorker.request_validator(pretrained=str(tmp_path))
    with pytest.raises(InvalidRequest, match="'class_labels' must be one class"):
        check(DiffusionRequest("bad", {"class_labels": 1000}))
    worker = DiffusersPipelineWorker(pretrained=str(tmp_path))
    params = dit_params(seed=8, label=12)
    out = worker.execute_model(DiffusionRequest("p", params)).output
    assert torch.equal(out.images, direct_call(dit_direct, params).images)


def test_a_warmup_forward_runs_at_start_and_changes_no_result(dit_direct: Any) -> None:
    """``warmup=``: one forward with those parameters while the worker is built (the
    first client does not pay for it), counted by the transformer; a later request is
    still bit-exact, and a bad warm-up request fails the start, named."""
    worker = DiffusersPipelineWorker(builder=DIT, warmup=dit_params(seed=1, steps=2))
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    pipeline: Any = worker.handle.pipeline
    hook = pipeline.transformer.register_forward_hook(count)
    try:
        params = dit_params(seed=5, label=42)
        out = worker.execute_model(DiffusionRequest("d", params))
    finally:
        hook.remove()
    assert calls == 3 and worker.pipeline_calls == 1  # the warm-up ran before the hook: 3 steps of "d" only
    assert torch.equal(out.output.images, direct_call(dit_direct, params).images)
    with pytest.raises(InvalidRequest, match="warmup"):
        DiffusersPipelineWorker(builder=DIT, warmup=dit_params(seed=1, label=10_000))


def _scheduler_tables(scheduler: object) -> list[torch.Tensor]:
    return [v for v in vars(scheduler).values() if isinstance(v, torch.Tensor)]


def test_schedulers_are_made_on_the_cpu_whatever_the_default_device() -> None:
    """A worker builds its pipeline under its device (``torch.device("cuda")``): the
    scheduler's tables must still be on the CPU, where diffusers reads them (DPMSolver's
    set_timesteps calls .numpy() on them and failed on the H200).  "meta" stands in for
    the GPU here: it fails the same way."""
    from omni_async.integrations.diffusers.edge import PipelineHandle, diffusers_class
    from omni_async.integrations.diffusers.source import random_pipeline
    from omni_async.integrations.diffusers.tiny import TINY_DIT

    with torch.device("meta"):
        pipe: Any = random_pipeline("DiTPipeline", TINY_DIT)
    assert next(pipe.transformer.parameters()).device.type == "meta"  # the models where asked
    assert _scheduler_tables(pipe.scheduler) and all(t.device.type == "cpu" for t in _scheduler_tables(pipe.scheduler))
    pipe.scheduler.set_timesteps(4)

    # A builder of the user's own, run under the worker's device: load() makes the
    # scheduler again on the CPU (PipelineHandle.schedulers_on_cpu).
    made_there = diffusers_class("DPMSolverMultistepScheduler", "test")()
    for name, table in list(vars(made_there).items()):  # as if made under the GPU
        if isinstance(table, torch.Tensor):
            setattr(made_there, name, table.to("meta"))
    assert all(t.device.type == "meta" for t in _scheduler_tables(made_there))
    pipe.register_modules(scheduler=made_there)
    assert PipelineHandle(pipe).schedulers_on_cpu() == ["scheduler"]
    assert pipe.scheduler is not made_there and dict(pipe.scheduler.config) == dict(made_there.config)
    assert all(t.device.type == "cpu" for t in _scheduler_tables(pipe.scheduler))
    pipe.scheduler.set_timesteps(4)
    assert PipelineHandle(pipe).schedulers_on_cpu() == []  # already there: left alone
