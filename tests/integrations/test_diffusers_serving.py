"""Diffusers pipelines served end to end: through ``InProcessExecutor`` and real worker
processes (``MultiprocDiffusionExecutor``), the executor's batch path, the engine's
asynchronous and synchronous output paths, streaming previews, the checks at the call,
and the uint8 pixels of the "diffusers" post-process against diffusers' own np/pil path.
Every result is compared bit for bit with the same pipeline called directly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import ImagePipelineOutput
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

from helpers.diffusers_direct import (  # dit_direct, wan_direct: module fixtures, used by name
    DIT,
    WAN,
    direct_call,
    dit_direct,  # noqa: F401  # a module fixture: pytest finds it by its name here
    dit_params,
    tensor,
    wan_direct,  # noqa: F401
    wan_params,
)
from omni_async.core.config import Deadlines
from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationChunk, GenerationResult
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.integrations.diffusers import DiffusersPipelineWorker, host_stage
from omni_async.integrations.diffusers.decode import decode_of
from omni_async.integrations.diffusers.edge import PipelineHandle
from omni_async.integrations.diffusers.pixels import to_uint8
from omni_async.worker.host import WorkerSpec

DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)


def diffusers_uint8(pipe: Any, params: dict[str, object]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """What a client gets from diffusers itself: ``output_type="np"`` scaled as ``numpy_to_pil``
    does; for an image, checked against the ``"pil"`` path too."""
    np_out = direct_call(pipe, {**params, "output_type": "np"})
    floats = np_out.images if "images" in np_out else np_out.frames
    pixels: np.ndarray[Any, np.dtype[np.uint8]] = (np.asarray(floats) * 255).round().astype("uint8")
    if "images" in np_out:
        pil = direct_call(pipe, {**params, "output_type": "pil"}).images
        assert np.array_equal(np.stack([np.asarray(im) for im in pil]), pixels)
    return pixels


def _in_process(spec: WorkerSpec) -> InProcessExecutor:
    return InProcessExecutor(spec.build, deadlines=DEADLINES, validate_request=spec.request_validator())


def _fetch(ex: DiffusionExecutor, output_id: str | None) -> Any:
    assert output_id is not None
    out = ex.wait_output_ready(output_id).result(timeout=120)
    return out


# -- fast: threads ------------------------------------------------------------------------------


@pytest.mark.slow
def test_in_process_executor_single_and_batch_are_bit_exact_through_the_transport(dit_direct: Any) -> None:
    with _in_process(DiffusersPipelineWorker.spec(builder=DIT)) as ex:
        with pytest.raises(InvalidRequest, match=r"request 'bad': parameter 'class_labels' must be one class"):
            ex.submit(DiffusionRequest("bad", dit_params(1, label=5000)))
        assert ex.metrics().pending_rpcs == 0  # refused at the call: nothing reached a worker
        single = dit_params(2, label=17)
        out = _fetch(ex, ex.execute_request(DiffusionRequest("one", single)).async_output_id)
        assert type(out.output) is ImagePipelineOutput
        assert torch.equal(out.output.images, direct_call(dit_direct, single).images)
        ex.release_output(out)
        params = [dit_params(10 + i, label=3 * i) for i in range(3)]
        batch = [DiffusionRequest(f"b{i}", p) for i, p in enumerate(params)]
        # The same batch run here, without the executor: what the transport must deliver bit
        # for bit (a batch member is its own call's only up to the last bits on some CPUs:
        # test_diffusers_worker.py::test_dit_batch_members_match_their_own_calls).
        here = DiffusersPipelineWorker(builder=DIT).execute_model_batch(batch).outputs
        ros = ex.execute_batch(batch)
        for ro, p, want in zip(ros, params, here, strict=True):
            got = _fetch(ex, ro.async_output_id)
            assert torch.equal(got.output.images, want.output.images), ro.request_id
            torch.testing.assert_close(got.output.images, direct_call(dit_direct, p).images, rtol=0, atol=2e-6)
            ex.release_output(got)


def test_engine_async_path_gives_diffusers_uint8_pixels(dit_direct: Any, wan_direct: Any) -> None:
    """The fast end-to-end test: AsyncDiffusionEngine over threads, both pipelines, pixels
    bit-identical to diffusers' own output_type="np"/"pil"."""

    async def serve(
        spec: WorkerSpec, requests: list[DiffusionRequest], bad: DiffusionRequest
    ) -> list[GenerationResult]:
        async with AsyncDiffusionEngine(_in_process(spec), pipeline="diffusers") as engine:
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
            with pytest.raises(InvalidRequest, match=f"request 'bad': parameter '{next(iter(bad.params))}'"):
                await engine.generate(bad)
        engine.executor.shutdown()
        return results

    wan = [wan_params(seed=i) for i in range(2)]
    bad = DiffusionRequest("bad", {"num_frames": 4, **{k: v for k, v in wan[0].items() if k != "num_frames"}})
    results = asyncio.run(
        serve(DiffusersPipelineWorker.spec(builder=WAN), [DiffusionRequest(f"w{i}", p) for i, p in enumerate(wan)], bad)
    )
    for result, p in zip(results, wan, strict=True):
        assert type(result.output) is WanPipelineOutput and result.output.frames.dtype == np.uint8
        assert result.output.frames.shape == (1, 5, 16, 16, 3)
        assert np.array_equal(result.output.frames, diffusers_uint8(wan_direct, p))
    dit = dit_params(seed=9, label=250)
    bad = DiffusionRequest("bad", {"class_labels": -3})
    (image,) = asyncio.run(serve(DiffusersPipelineWorker.spec(builder=DIT), [DiffusionRequest("d", dit)], bad))
    assert np.array_equal(image.output.images, diffusers_uint8(dit_direct, dit))


def test_streaming_previews_are_the_decoded_latents_of_their_step(wan_direct: Any) -> None:
    steps, every = 4, 2
    params = wan_params(seed=6, steps=steps, preview_every=every)
    seen: dict[int, torch.Tensor] = {}

    def record(pipe: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen[i + 1] = tensors["latents"].clone()
        return {}

    final = direct_call(wan_direct, {**params, "callback_on_step_end": record})

    async def body() -> list[Any]:
        async with AsyncDiffusionEngine(
            _in_process(DiffusersPipelineWorker.spec(builder=WAN)), pipeline="diffusers"
        ) as engine:
            items = [item async for item in engine.generate_stream(DiffusionRequest("s", params))]
            plain = await engine.generate(DiffusionRequest("p", params))  # not streamed: no previews
            assert engine.metrics().chunks == len(items) - 1
        engine.executor.shutdown()
        return [*items, plain]

    *chunks, result, plain = asyncio.run(body())
    assert [type(c) for c in chunks] == [GenerationChunk] and [c.output["step"] for c in chunks] == [2]
    handle = PipelineHandle(wan_direct)
    decode = decode_of(handle)
    assert decode is not None
    with torch.no_grad():
        want = to_uint8(decode(handle, seen[2], params)["frames"]).numpy()
    assert np.array_equal(chunks[0].output["frames"], want)
    assert isinstance(result, GenerationResult)
    assert np.array_equal(result.output.frames, to_uint8(final.frames).numpy())
    assert np.array_equal(plain.output.frames, result.output.frames)


def test_host_stage_never_writes_its_input_and_owns_its_result(dit_direct: Any) -> None:
    from omni_async.core.messages import DiffusionOutput

    images = direct_call(dit_direct, dit_params(1)).images
    before = images.clone()
    out = host_stage(DiffusionOutput("h", ImagePipelineOutput(images=images)))
    assert isinstance(out, ImagePipelineOutput) and torch.equal(images, before)
    assert out.images.flags.owndata or out.images.base is not None and not np.shares_memory(out.images, images.numpy())


# -- slow: worker processes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def processes() -> Iterator[MultiprocDiffusionExecutor]:
    with MultiprocDiffusionExecutor(DiffusersPipelineWorker.spec(builder=WAN), deadlines=DEADLINES) as ex:
        yield ex


@pytest.mark.slow
def test_worker_processes_check_at_the_call_and_ship_diffusers_classes(
    processes: MultiprocDiffusionExecutor, wan_direct: Any
) -> None:
    ex = processes
    with pytest.raises(InvalidRequest, match=r"request 'bad': parameter 'height' must be a multiple of 16") as err:
        ex.submit(DiffusionRequest("bad", {**wan_params(1), "height": 20}))
    assert err.value.parameter == "height" and ex.metrics().pending_rpcs == 0
    params = [wan_params(seed=30 + i) for i in range(3)]
    single = _fetch(ex, ex.execute_request(DiffusionRequest("p0", params[0])).async_output_id)
    assert type(single.output) is WanPipelineOutput  # diffusers' own class, out of a worker process
    assert torch.equal(single.output.frames, direct_call(wan_direct, params[0]).frames)
    ex.release_output(single)
    # The executor's batch path: one pipeline call, each member split back.
    wan_direct.vae.enable_slicing()
    stacked = wan_direct(
        prompt_embeds=torch.cat([tensor(p, "prompt_embeds") for p in params]),
        negative_prompt_embeds=torch.cat([tensor(p, "negative_prompt_embeds") for p in params]),
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=5.0,
        generator=[torch.Generator().manual_seed(30 + i) for i in range(3)],
        output_type="pt",
    ).frames
    for i, ro in enumerate(ex.execute_batch([DiffusionRequest(f"b{i}", p) for i, p in enumerate(params)])):
        got = _fetch(ex, ro.async_output_id)
        assert type(got.output) is WanPipelineOutput and torch.equal(got.output.frames, stacked[i : i + 1])
        ex.release_output(got)
    assert ex.pool.stats().outstanding == 0


@pytest.mark.slow
@pytest.mark.parametrize("async_output", [True, False], ids=["async-path", "sync-path"])
def test_engine_over_worker_processes_with_the_device_stage(async_output: bool, dit_direct: Any) -> None:
    """Both engine paths over worker processes, the pixels made uint8 in the worker
    (``postprocess="diffusers"``): still diffusers' own pixels, bit for bit."""
    spec = DiffusersPipelineWorker.spec(builder=DIT, postprocess="diffusers")
    params = [dit_params(seed=40 + i, label=i) for i in range(2)]

    async def body() -> list[GenerationResult]:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES),
            pipeline="diffusers",
            async_output=async_output,
        )
        async with engine:
            with pytest.raises(InvalidRequest, match="parameter 'class_labels'"):
                await engine.generate(DiffusionRequest("bad", {"seed": 1}))
            return list(
                await asyncio.gather(*(engine.generate(DiffusionRequest(f"e{i}", p)) for i, p in enumerate(params)))
            )

    for result, p in zip(asyncio.run(body()), params, strict=True):
        assert type(result.output) is ImagePipelineOutput
        assert np.array_equal(result.output.images, diffusers_uint8(dit_direct, p))


@pytest.mark.slow
def test_engine_batches_diffusers_requests_over_worker_processes(dit_direct: Any) -> None:
    """The engine's own batching with the batch key the spec publishes
    (``WorkerSpec.batch_keyer``): compatible DiT requests share one pipeline call in a
    worker process, an incompatible one (other step count) runs alone and is bit-exact
    against its own direct call; the batched ones match theirs up to the last bits (a
    batch rounds differently on some CPUs: test_diffusers_worker.py)."""
    spec = DiffusersPipelineWorker.spec(builder=DIT)
    keyer = spec.batch_keyer()
    assert keyer is not None
    params = {f"b{i}": dit_params(seed=i, label=3 + i) for i in range(4)}
    params["odd"] = dit_params(seed=9, steps=2)
    assert len({keyer(DiffusionRequest(rid, p)) for rid, p in params.items()}) == 2

    async def serve(ex: MultiprocDiffusionExecutor) -> tuple[dict[str, GenerationResult], int, int]:
        async with AsyncDiffusionEngine(ex, max_batch_size=4, batch_wait_s=0.5) as engine:
            got = await asyncio.gather(*(engine.generate(DiffusionRequest(rid, p)) for rid, p in params.items()))
            m = engine.metrics()
            return dict(zip(params, got, strict=True)), m.batched, m.batch_size_max

    with MultiprocDiffusionExecutor(spec, deadlines=DEADLINES) as ex:
        results, batched, largest = asyncio.run(serve(ex))
    assert largest == 4 and batched == 1, (batched, largest)  # the odd one ran alone
    for rid, p in params.items():
        want = direct_call(dit_direct, p).images
        got = results[rid].output
        assert isinstance(got, ImagePipelineOutput)
        if rid == "odd":
            assert torch.equal(got.images, want), rid
        else:
            torch.testing.assert_close(got.images, want, rtol=0, atol=2e-6, msg=rid)


def test_decode_in_the_device_stage_gives_the_pipelines_own_pixels(wan_direct: Any) -> None:
    """``decode="device"``: the forward stops at the latents and the device stage decodes
    them with the pipeline's VAE, then makes the uint8 pixels: diffusers' own, bit for
    bit.  The decoder rides in the output only inside the worker's process."""
    from omni_async.integrations.diffusers.pixels import DECODE_LATER, device_stage

    worker = DiffusersPipelineWorker(builder=WAN, decode="device")
    assert worker.decode_in_device_stage
    params = wan_params(seed=8)
    out = worker.execute_model(DiffusionRequest("w", params))
    assert set(out.output) == {"latents", DECODE_LATER}  # the VAE did not run in the forward
    staged = device_stage(out).output
    assert set(staged) == {"frames"}
    assert np.array_equal(staged["frames"].numpy(), diffusers_uint8(wan_direct, params))
    # Asked for latents, it still gets them, with nothing to decode.
    latent = worker.execute_model(DiffusionRequest("l", {**params, "output_type": "latent"})).output
    assert set(latent) == {"latents"}


@pytest.mark.slow
def test_decode_in_the_device_stage_over_worker_processes(wan_direct: Any) -> None:
    """Through a worker process and the engine: the same pixels as diffusers' own."""
    spec = DiffusersPipelineWorker.spec(builder=WAN, decode="device", postprocess="diffusers")
    params = [wan_params(seed=20 + i) for i in range(2)]

    async def body() -> list[GenerationResult]:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES), pipeline="diffusers"
        )
        async with engine:
            return list(
                await asyncio.gather(*(engine.generate(DiffusionRequest(f"v{i}", p)) for i, p in enumerate(params)))
            )

    for result, p in zip(asyncio.run(body()), params, strict=True):
        assert np.array_equal(result.output["frames"], diffusers_uint8(wan_direct, p))


def test_decode_in_the_device_stage_needs_its_post_process_and_a_known_value() -> None:
    from omni_async.core.errors import UsageError

    with pytest.raises(UsageError, match="postprocess='diffusers'"):
        DiffusersPipelineWorker.spec(builder=WAN, decode="device")
    with pytest.raises(UsageError, match="decode must be 'forward' or 'device'"):
        DiffusersPipelineWorker.spec(builder=WAN, decode="later", postprocess="diffusers")
    # A pipeline that cannot stop at its latents (DiT): refused at once, not decoded in the forward.
    with pytest.raises(UsageError, match="DiTPipeline cannot: use decode='forward'"):
        DiffusersPipelineWorker.spec(builder=DIT, decode="device", postprocess="diffusers")
    with pytest.raises(UsageError, match="DiTPipeline cannot"):
        DiffusersPipelineWorker(builder=DIT, decode="device")
