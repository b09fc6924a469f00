"""The family matrix: a tiny random pipeline of each diffusers family (Stable Diffusion,
SDXL, SD3, Flux, PixArt-Sigma, Sana, DiT, DDIM, Wan, CogVideoX, LTX), served by
``DiffusersPipelineWorker`` and each output compared bit for bit with the pipeline called
directly.  The slow tier serves each family through one ``AsyncDiffusionEngine`` over a
worker process, which serves all of that family's cases (one process start per family:
that start, not the tiny forwards, is most of a case's cost): a streamed request with
precomputed embeddings and the pooled embeddings and masks its pipeline requires, and its
preview; a batch (an image family's asks for PNG, JPEG and WebP files); an MP4 file for a
video family; a prompt through the pipeline's own tiny text encoders; ``decode="device"``
wherever the pipeline can stop at its latents.  The fast tier runs the lightest families'
worker in this process."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from helpers.diffusers_direct import (
    direct_family_call,
    family_params,
    family_pipeline,
    family_spec_kwargs,
    one_torch_thread,
    pixels_of,
    text_params,
)
from omni_async.core.config import Deadlines
from omni_async.core.errors import InvalidRequest, UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationChunk, GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.integrations.diffusers import DiffusersPipelineWorker
from omni_async.integrations.diffusers.decode import decode_of
from omni_async.integrations.diffusers.edge import PipelineHandle
from omni_async.integrations.diffusers.pixels import device_stage, to_uint8
from omni_async.integrations.diffusers.tiny import TEXT_ENCODERS
from omni_async.worker.host import WorkerSpec

IMAGES = ["sd", "sdxl", "sd3", "flux", "pixart", "sana", "dit", "ddim"]
VIDEOS = ["wan", "cogvideox", "ltx"]
FAMILIES = IMAGES + VIDEOS
#: Families whose pipeline returns latents (output_type="latent"): decode="device" serves them.
LATENT = {"sd", "sdxl", "sd3", "flux", "pixart", "sana", "wan", "cogvideox", "ltx"}
#: Families with a text encoder (all but DiT, class-conditional, and DDIM, unconditional):
#: served with their tiny text encoders, so one engine takes prompts and embeddings.
TEXT = set(TEXT_ENCODERS)
DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread() -> Iterator[None]:
    """One torch thread here and in the workers (``one_torch_thread``)."""
    with one_torch_thread():
        yield


def _worker(name: str, **kwargs: object) -> DiffusersPipelineWorker:
    return DiffusersPipelineWorker(**family_spec_kwargs(name), **kwargs)  # type: ignore[arg-type]


def _served(output: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The uint8 pixels a client got (``images`` or ``frames``)."""
    value = output["images"] if "images" in output else output["frames"]
    assert isinstance(value, np.ndarray) and value.dtype == np.uint8
    return value


def _u8(pixels: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return to_uint8(pixels).numpy()


#: The fast tier's families (the lightest on the CPU); the others run in the slow tier.
FAST = {"sd3", "flux", "ddim"}


@pytest.mark.parametrize("name", sorted(FAST))
def test_family_in_process_bit_exact(name: str) -> None:
    """The fast tier's matrix (the slow tier serves every family through the engine): one
    worker in this process, a request, a batch of two (one pipeline call), the family's
    own decode of the pipeline's latents, decode="device" and an encoded request's
    pixels, each bit for bit."""
    pipe = family_pipeline(name)
    worker = _worker(name)
    params = family_params(name, seed=1)
    want = pixels_of(direct_family_call(pipe, [params]))
    out = worker.execute_model(DiffusionRequest("one", params)).output
    assert torch.equal(pixels_of(out), want), name

    # A batch: one pipeline call, each member the same batch called directly (VAE slicing).
    batch = [family_params(name, seed=2), family_params(name, seed=3)]
    calls = worker.pipeline_calls
    got = worker.execute_model_batch([DiffusionRequest(f"b{i}", p) for i, p in enumerate(batch)]).outputs
    assert worker.pipeline_calls == calls + 1, name
    if hasattr(pipe, "vae") and pipe.vae is not None and hasattr(pipe.vae, "enable_slicing"):
        pipe.vae.enable_slicing()
    stacked = pixels_of(direct_family_call(pipe, batch))
    for i, o in enumerate(got):
        assert torch.equal(pixels_of(o.output), stacked[i : i + 1]), (name, i)

    # An encoded request: the encoder's uint8 pixels, channel-last, one image or one video.
    enc = worker.execute_model(DiffusionRequest("enc", params, format="mp4" if name in VIDEOS else "png")).output
    key = "frames" if name in VIDEOS else "image"
    assert list(enc) == [key] and np.array_equal(enc[key].numpy(), _u8(want[0])), name

    handle = PipelineHandle(pipe)
    decode = decode_of(handle)
    assert decode is not None, name
    if name not in LATENT:
        with pytest.raises(UsageError, match="can stop at its latents"):
            _worker(name, decode="device")
        return
    # The family's decode of the pipeline's own latents: the pipeline's own pixels.
    latents = direct_family_call(pipe, [params], output_type="latent")
    latents = latents.images if "images" in latents else latents.frames
    with torch.no_grad():
        assert torch.equal(pixels_of(decode(handle, latents, params)), want), name
    staged = device_stage(_worker(name, decode="device").execute_model(DiffusionRequest("dev", params))).output
    assert np.array_equal(pixels_of(staged).numpy(), _u8(want)), name


def test_the_guide_shows_the_matrix_the_suite_runs() -> None:
    """docs/diffusers.md's family matrix: a row for each family served here, "works" for
    a prompt where the suite serves one and for decode="device" where it serves that,
    the pipeline class the family's builder makes, the formats encoded."""
    from pathlib import Path

    from omni_async.integrations.diffusers.tiny import FAMILIES as TINY

    guide = (Path(__file__).resolve().parents[2] / "docs" / "diffusers.md").read_text(encoding="utf-8")
    table = guide.split("<!-- family matrix -->")[1].split("<!-- end family matrix -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    assert [row[0] for row in rows] == FAMILIES
    classes = {**{name: spec[0] for name, spec in TINY.items()}, "dit": "DiTPipeline", "wan": "WanPipeline"}
    for name, pipeline, prompt, embeds, previews, device, batch, encode in rows:
        assert pipeline == f"`{classes[name]}`", name
        assert prompt.startswith("works") == (name in TEXT), name
        assert embeds.startswith("works") == (name in TEXT), name
        assert device.startswith("works") == (name in LATENT), name
        assert previews.startswith("works") and batch.startswith("works"), name
        assert encode == "works: " + ("mp4" if name in VIDEOS else "png, jpeg, webp"), name


def test_parameters_come_from_the_pipelines_call_and_checks_from_its_config() -> None:
    """Any argument of __call__ goes through (Flux's true_cfg_scale, SDXL's original_size);
    others are refused naming them and the class; tensors are checked against the field
    each family's pipeline reads (PixArt's caption_channels, not its hidden size;
    CogVideoX's text_embed_dim); a pipeline's required companions are asked for; Flux's
    guidance_scale is not classifier-free guidance.  The schema is data."""
    from omni_async.integrations.diffusers.tiny import TEXT_DIM

    def check(name: str) -> Any:
        return DiffusersPipelineWorker.request_validator(**family_spec_kwargs(name))

    pixart, cog, flux, sdxl, sana = check("pixart"), check("cogvideox"), check("flux"), check("sdxl"), check("sana")
    sana(DiffusionRequest("ok", family_params("sana", 1)))
    with pytest.raises(InvalidRequest, match=r"transformer.config.caption_channels of SanaPipeline is 16"):
        sana(DiffusionRequest("bad", {**family_params("sana", 1), "prompt_embeds": torch.zeros(8, 8)}))
    pixart(DiffusionRequest("ok", family_params("pixart", 1)))  # [8, 16]: caption_channels 16, hidden size 24
    with pytest.raises(InvalidRequest, match=r"transformer.config.caption_channels of PixArtSigmaPipeline is 16"):
        pixart(DiffusionRequest("bad", {**family_params("pixart", 1), "prompt_embeds": torch.zeros(8, 24)}))
    with pytest.raises(InvalidRequest, match=r"'prompt_attention_mask' is required with prompt_embeds by PixArt"):
        pixart(
            DiffusionRequest(
                "bad", {k: v for k, v in family_params("pixart", 1).items() if k != "prompt_attention_mask"}
            )
        )
    with pytest.raises(InvalidRequest, match=r"text_embed_dim of CogVideoXPipeline is 16.*got \[8, 7\]"):
        cog(DiffusionRequest("bad", {**family_params("cogvideox", 1), "prompt_embeds": torch.zeros(8, 7)}))
    # Flux: guidance_scale is distilled guidance, no negative embeddings demanded; true_cfg_scale passes.
    flux(DiffusionRequest("ok", {**family_params("flux", 1), "guidance_scale": 3.5, "true_cfg_scale": 1.0}))
    with pytest.raises(InvalidRequest, match=r"'pooled_prompt_embeds' is required with prompt_embeds by FluxPipeline"):
        flux(DiffusionRequest("bad", {"prompt_embeds": torch.zeros(8, TEXT_DIM), "seed": 1}))
    with pytest.raises(InvalidRequest, match=r"'pooled_prompt_embeds' must have shape \[8\]"):
        sdxl(DiffusionRequest("bad", {**family_params("sdxl", 1), "pooled_prompt_embeds": torch.zeros(9)}))
    sdxl(DiffusionRequest("ok", {**family_params("sdxl", 1), "original_size": (16, 16), "guidance_rescale": 0.5}))
    with pytest.raises(InvalidRequest, match=r"'bogus, generator' are not accepted by FluxPipeline.__call__") as err:
        flux(DiffusionRequest("bad", {**family_params("flux", 1), "bogus": 1, "generator": None}))
    assert "set by the integration" in str(err.value)
    schema = DiffusersPipelineWorker.parameter_schema(**family_spec_kwargs("flux"))
    params = schema["parameters"]
    assert schema["pipeline"] == "FluxPipeline" and isinstance(params, dict)
    assert params["true_cfg_scale"]["default"] == "1.0" and "float" in params["true_cfg_scale"]["type"]
    assert "generator" not in params and params["seed"]["type"] == "int"
    import json

    json.dumps(schema)  # publishable as it is


def test_what_the_pipeline_itself_refuses_reaches_the_caller_with_its_message() -> None:
    """No check is known for DDIM's eta: the request goes through, and the pipeline's own error comes back."""
    worker = _worker("ddim")
    with pytest.raises(TypeError, match="'<=' not supported between instances of 'float' and 'str'"):
        worker.execute_model(DiffusionRequest("odd", {**family_params("ddim", 1), "eta": "x"}))


def test_a_members_own_failure_does_not_turn_batching_off() -> None:
    """A DiT batch where one member makes the transformer raise: that batch runs member
    by member (the failing one fails), and the next batch is still one call."""
    worker = _worker("dit")
    pipe: Any = worker.pipeline

    def refuse(module: object, args: tuple[object, ...], kwargs: dict[str, Any]) -> None:
        labels = kwargs.get("class_labels")
        if isinstance(labels, torch.Tensor) and bool((labels == 666).any()):
            raise RuntimeError("label 666 is cursed")

    hook = pipe.transformer.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        bad = [DiffusionRequest(f"x{i}", family_params("dit", 10 + i)) for i in range(3)]
        bad.append(DiffusionRequest("cursed", {**family_params("dit", 20), "class_labels": 666}))
        with pytest.raises(RuntimeError, match="cursed"):
            worker.execute_model_batch(bad)
    finally:
        hook.remove()
    assert worker.generator_lists
    calls = worker.pipeline_calls
    worker.execute_model_batch([DiffusionRequest(f"y{i}", family_params("dit", 30 + i)) for i in range(3)])
    assert worker.pipeline_calls == calls + 1


def test_ddim_batches_with_batch_size() -> None:
    worker = _worker("ddim")
    calls = worker.pipeline_calls
    worker.execute_model_batch([DiffusionRequest(f"d{i}", family_params("ddim", i)) for i in range(3)])
    assert worker.pipeline_calls == calls + 1 and worker.generator_lists


def test_spec_checks_at_once() -> None:
    with pytest.raises(UsageError, match="cannot be found"):
        DiffusersPipelineWorker.spec(builder="omni_async.integrations.diffusers.tiny:nope")
    with pytest.raises(UsageError, match="cannot read the pipeline config"):
        DiffusersPipelineWorker.spec(pretrained="/nonexistent/model")
    with pytest.raises(UsageError, match="DDIMPipeline cannot"):
        DiffusersPipelineWorker.spec(**family_spec_kwargs("ddim"), decode="device", postprocess="diffusers")


# -- slow: through the engine over worker processes ------------------------------------------


@attrs.frozen
class Served:
    """What one family's engine gave back, by case."""

    stream: list[GenerationChunk | GenerationResult]
    batch: list[GenerationResult]
    batched: int
    encoded: dict[str, GenerationResult]
    prompted: GenerationResult | None


def _serve(
    spec: WorkerSpec,
    streamed: dict[str, object],
    batch: list[tuple[dict[str, object], str | None]],
    formats: list[str],
    prompt: dict[str, object] | None,
) -> Served:
    """Every case of one family through one engine over one worker process: a streamed
    request, a batch (its members' params and formats), ``streamed``'s params once per
    format of ``formats``, and a prompt."""
    params = {k: v for k, v in streamed.items() if k != "preview_every"}

    async def body() -> Served:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES),
            pipeline="diffusers",
            max_batch_size=len(batch),
            batch_wait_s=0.05,
            encode_workers=1,
        )
        async with engine:
            items = [item async for item in engine.generate_stream(DiffusionRequest("s", streamed))]
            # Queued in one tick: the engine sends them together, one execute_model_batch.
            members = [DiffusionRequest(f"b{i}", p, format=f) for i, (p, f) in enumerate(batch)]
            pair = await asyncio.gather(*(engine.generate(m) for m in members))
            batched = engine.metrics().batched
            encoded = {fmt: await engine.generate(DiffusionRequest(fmt, params, format=fmt)) for fmt in formats}
            prompted = None if prompt is None else await engine.generate(DiffusionRequest("t", prompt))
        return Served(items, list(pair), batched, encoded, prompted)

    return asyncio.run(body())


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_family_served_through_the_engine_over_worker_processes(name: str) -> None:
    """Each family served through one AsyncDiffusionEngine over a worker process, with
    decode="device" where the pipeline returns latents, every case against the pipeline
    called directly: a streamed request with embeddings (a class, or nothing, for DiT and
    DDIM), its preview (the family's decode of the latents of that step) and final
    output; a batch (one pipeline call, each member the same batch called directly); a
    prompt through the pipeline's own text encoders; encoded files of the worker's uint8
    pixels, byte for byte what the engine's encoders make of the direct call's pixels
    (an image family's batch asks for PNG, JPEG and WebP, one member each; a video
    family's MP4 is a request of its own)."""
    from omni_async.core.encoding import Encoding
    from omni_async.engine.encoders import encode_image, encode_video

    text, video = name in TEXT, name in VIDEOS
    pipe = family_pipeline(name, text=text)
    params = family_params(name, seed=5)
    streamed = {**params, "preview_every": 1}
    seen: dict[int, torch.Tensor] = {}
    step_hook: dict[str, object] = {}
    if "callback_on_step_end" in pipe.__call__.__code__.co_varnames:

        def record(p: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            seen[i + 1] = tensors["latents"].clone()
            return {}

        step_hook = {"callback_on_step_end": record}
    want = pixels_of(direct_family_call(pipe, [params], **step_hook))
    prompt = text_params(name, seed=6) if text else None
    want_prompt = None if prompt is None else pixels_of(direct_family_call(pipe, [prompt]))
    batch_formats: list[str | None] = [None, None] if video else ["png", "jpeg", "webp"]
    batch = [(family_params(name, seed=7 + i), f) for i, f in enumerate(batch_formats)]
    if getattr(pipe, "vae", None) is not None and hasattr(pipe.vae, "enable_slicing"):
        pipe.vae.enable_slicing()  # as the worker does: a batch decodes member by member
    want_batch = pixels_of(direct_family_call(pipe, [p for p, _ in batch]))
    kwargs = family_spec_kwargs(name, text=text)
    if name in LATENT:
        kwargs["decode"] = "device"
    else:
        with pytest.raises(UsageError, match="can stop at its latents"):
            DiffusersPipelineWorker.spec(postprocess="diffusers", decode="device", **kwargs)
    spec = DiffusersPipelineWorker.spec(postprocess="diffusers", **kwargs)

    served = _serve(spec, streamed, batch, ["mp4"] if video else [], prompt)
    *chunks, final = served.stream
    assert isinstance(final, GenerationResult) and np.array_equal(_served(final.output), _u8(want)), name
    assert [type(c) for c in chunks] == [GenerationChunk] and chunks[0].output["step"] == 1, name
    if seen:  # the preview is the family's own decode of that step's latents
        handle = PipelineHandle(pipe)
        decode = decode_of(handle)
        assert decode is not None
        with torch.no_grad():
            preview = _u8(pixels_of(decode(handle, seen[1], params)))
        assert np.array_equal(_served(chunks[0].output), preview), name
    assert served.batched == 1, name
    for i, (got, fmt) in enumerate(zip(served.batch, batch_formats, strict=True)):
        member = _u8(want_batch[i : i + 1])
        if fmt is None:
            assert np.array_equal(_served(got.output), member), (name, i)
            continue
        file = got.output.data
        assert file == encode_image(member[0], Encoding(fmt)), (name, fmt)
        from PIL import Image

        if fmt != "jpeg":  # PNG and (default) WebP are lossless: the very pixels
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(file)).convert("RGB")), member[0]), (name, fmt)
    for fmt, result in served.encoded.items():
        assert result.output.frames == want.shape[1], name
        assert result.output.data == encode_video(_u8(want[0]), Encoding(fmt)), (name, fmt)
    if want_prompt is not None:
        assert served.prompted is not None
        assert np.array_equal(_served(served.prompted.output), _u8(want_prompt)), name
        assert not np.array_equal(_u8(want_prompt), _u8(want)), name  # the prompt, not the embeddings


@pytest.mark.slow
def test_a_fresh_process_reads_a_config_builds_and_leaves_clean() -> None:
    """Two defects of a fresh interpreter, checked in one (its start, torch and diffusers
    imported, is most of the cost):

    * spec() and the request check read the pipeline's config under diffusers'
      no_init_weights, which swaps torch.nn.init's functions for no-ops process-wide.  In
      a process whose first use of diffusers is spec(), transformers used to be first
      imported under that swap and keep the no-ops: every text encoder built there
      afterwards had other weights than anywhere else, so a prompt's pixels in that
      process (an in-process executor, or the suite's direct call) were not the worker's.
    * tqdm's cross-process lock is a named semaphore in a process whose start method is
      spawn (a worker's); a worker leaves by os._exit, so the resource tracker used to
      warn "leaked semaphore objects" at every worker's end."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    script = (
        "import multiprocessing, sys, torch\n"
        "multiprocessing.set_start_method('spawn')\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "from omni_async.integrations.diffusers import DiffusersPipelineWorker\n"
        "from omni_async.integrations.diffusers.tiny import tiny_family\n"
        "DiffusersPipelineWorker.spec(builder='omni_async.integrations.diffusers.tiny:tiny_family',"
        " builder_kwargs={'name': 'ddim'})\n"
        "from transformers.initialization import TORCH_INIT_FUNCTIONS\n"
        "pipe = tiny_family('sd', text=True)\n"
        "print(TORCH_INIT_FUNCTIONS['normal_'] is torch.nn.init.normal_,"
        " sum(float(v.double().sum()) for v in pipe.text_encoder.state_dict().values()), flush=True)\n"
        "from helpers.diffusers_direct import leave_like_a_worker\n"
        "leave_like_a_worker()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    kept, there = done.stdout.split()[-2:]
    assert kept == "True", "transformers kept diffusers' no-op init functions"
    here = family_pipeline("sd", text=True).text_encoder.state_dict().values()
    assert float(there) == sum(float(v.double().sum()) for v in here)
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_a_refusal_of_generator_lists_runs_batches_member_by_member() -> None:
    """A pipeline that refuses a list of generators (diffusers' own words for it, raised
    here by the transformer of a batched call: none of the tiny families refuses one) runs
    that batch and later ones one call per member, each its own call's pixels."""
    worker = _worker("dit")
    pipe: Any = worker.pipeline

    def refuse(module: object, args: tuple[object, ...], kwargs: dict[str, Any]) -> None:
        labels = kwargs.get("class_labels")
        if isinstance(labels, torch.Tensor) and len(labels) > 2:  # guided: a batch of 2 or more
            raise ValueError(
                "You have passed a list of generators of length 2, but requested an effective batch size of 4"
            )

    hook = pipe.transformer.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        params = [family_params("dit", 40 + i) for i in range(2)]
        got = worker.execute_model_batch([DiffusionRequest(f"g{i}", p) for i, p in enumerate(params)]).outputs
        assert not worker.generator_lists and worker.pipeline_calls == 3  # the refused call, then one each
        worker.execute_model_batch([DiffusionRequest(f"h{i}", p) for i, p in enumerate(params)])
        assert worker.pipeline_calls == 5  # later batches too, without trying again
        for out, p in zip(got, params, strict=True):
            alone = worker.execute_model(DiffusionRequest("alone", p)).output
            assert torch.equal(pixels_of(out.output), pixels_of(alone)), out.request_id
    finally:
        hook.remove()


def test_a_prompt_through_the_pipelines_own_text_encoder() -> None:
    """Stable Diffusion with a (tiny, in-memory) tokenizer and text encoder: a request with
    a prompt and a negative prompt, and a batch of two prompts, bit for bit against the
    pipeline called directly with the same prompts."""
    from omni_async.integrations.diffusers.tiny import tiny_sd_with_text

    pipe: Any = tiny_sd_with_text()
    pipe.set_progress_bar_config(disable=True)
    worker = DiffusersPipelineWorker(builder="omni_async.integrations.diffusers.tiny:tiny_sd_with_text")
    one = {"prompt": "a red cat", "negative_prompt": "blurry", "num_inference_steps": 2, "seed": 3}
    want = pipe(
        prompt="a red cat",
        negative_prompt="blurry",
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator().manual_seed(3),
    ).images
    assert torch.equal(worker.execute_model(DiffusionRequest("p", one)).output.images, want)
    two = [{**one, "prompt": "a blue dog", "seed": 4}, {**one, "prompt": "photo of a cat", "seed": 5}]
    calls = worker.pipeline_calls
    got = worker.execute_model_batch([DiffusionRequest(f"b{i}", p) for i, p in enumerate(two)]).outputs
    assert worker.pipeline_calls == calls + 1
    pipe.vae.enable_slicing()
    stacked = pipe(
        prompt=["a blue dog", "photo of a cat"],
        negative_prompt=["blurry"] * 2,
        num_inference_steps=2,
        output_type="pt",
        generator=[torch.Generator().manual_seed(s) for s in (4, 5)],
    ).images
    for i, out in enumerate(got):
        assert torch.equal(out.output.images, stacked[i : i + 1]), i
    assert not torch.equal(stacked[0], stacked[1])


def test_decode_on_the_device_without_its_post_process_says_what_to_do() -> None:
    """The in-process pattern without the spec's post-process: a decode="device" output
    cannot travel (its decoder holds the pipeline), and the error says how to build it."""
    from omni_async.executor.inprocess import InProcessExecutor

    spec = DiffusersPipelineWorker.spec(**family_spec_kwargs("flux"), decode="device", postprocess="diffusers")
    params = family_params("flux", 1)
    with InProcessExecutor(spec.build, deadlines=DEADLINES, validate_request=spec.request_validator()) as ex:
        with pytest.raises(Exception, match=r"postprocess=spec.postprocess") as err:
            ro = ex.execute_request(DiffusionRequest("d", params))
            assert ro.async_output_id is not None
            ex.wait_output_ready(ro.async_output_id).result(timeout=120)
    assert "cannot pickle '_thread.lock'" not in str(err.value)
    with InProcessExecutor(
        spec.build, deadlines=DEADLINES, validate_request=spec.request_validator(), postprocess=spec.postprocess
    ) as ex:
        ro = ex.execute_request(DiffusionRequest("d", params))
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
        assert out.output["images"].dtype == torch.uint8
        ex.release_output(out)
    # The same, in one call: from_spec carries the spec's post-process and its request check.
    with InProcessExecutor.from_spec(spec, deadlines=DEADLINES) as ex:
        out = ex.submit(DiffusionRequest("d", params)).output.result(timeout=120)
        assert out.output["images"].dtype == torch.uint8
        ex.release_output(out)
        with pytest.raises(InvalidRequest, match="no_such_argument"):
            ex.submit(DiffusionRequest("bad", {**params, "no_such_argument": 1}))
