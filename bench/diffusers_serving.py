"""Serving real diffusers pipelines: the direct loop against the engine's two output paths,
and batched DiT against unbatched.

Each workload is a ``diffusers`` pipeline with random weights from configs written here
(``random_pipeline``: nothing downloaded, no network).  For each it measures requests
per second of:

* ``direct``: the loop a client writes: pipeline call, ``.cpu()``, uint8 pixels, next;
  in this process, for every round;
* ``direct-fresh`` (``--fresh-direct``): the same loop in a fresh process each round, as
  the engine's worker is one (its outputs compared with the direct loop's by digest);
* ``engine-sync``: ``AsyncDiffusionEngine(async_output=False)`` over a worker process
  (``MultiprocDiffusionExecutor``): the copy on the worker's main thread;
* ``engine-async``: the same engine with the asynchronous output path (COMPUTE_DONE,
  the next forward, the copy on the packer's side stream);
* ``engine-decode`` (Wan, whose pipeline can stop at its latents): ``engine-async`` with
  ``decode="device"``: the VAE decode moves from the forward to the device stage, on the
  packer's side stream while the next request denoises;
* ``engine-async-pinned`` (``--cpu-affinity gpu-local`` or a CPU list): the engine's
  asynchronous path (its default) with the worker pinned (``WorkerOptions.cpu_affinity``);
* ``engine-async-nograd`` (``--nograd``): the asynchronous path with the worker's forwards
  outside inference mode (``WorkerOptions(inference_mode=False)``), as the direct loop's;
* ``engine-sync-graphs``, ``engine-async-graphs`` (``--graphs``): both paths with the
  denoiser replayed as CUDA graphs (``DiffusersPipelineWorker.spec(..., cuda_graphs=True)``);

with the pixels made uint8 in the worker (``postprocess="diffusers"``) for both engine
runs, and all requests submitted at once.  ``batching`` runs DiT requests in batches of
``--batch`` (one pipeline call each) against one by one: through the engine's own
batching (``AsyncDiffusionEngine(max_batch_size=...)``).

Device time: a pipeline returns on the host before its kernels end, so the direct loop
times each forward with CUDA events around the call (``device_forward_s``: the device's
time per forward).  Per run, ``device_idle_s`` is then the wall time minus requests x
that device time: the device's idle time between forwards (CUDA only; null on the CPU,
where the forward is the host's own work).  ``forward_gap_s`` is the mean gap between one
forward's end and the next one's start on the worker, from the worker's stamps, and
``device_idle_share`` the sum of those gaps over the span of the run's forwards (the
stamps are device-true: CUDA events on a GPU).  Each engine run also times the first
request after the executor started (``first_request_s``; the worker ran one warm-up
forward while starting: ``DiffusersPipelineWorker(warmup=...)``) against one more
request alone once warm (``steady_request_s``), that request's forward and pack
(``steady_forward_s``, ``steady_pack_s``), every forward of the run (``engine_forwards_s``)
and how far the device ran behind each call's return on the host
(``engine_device_behind_s``: near 0, the host's launches set the forward's pace).  The
direct loop's rows give each call's host time (``host_call_s``) beside its device time.
Every row says which CPUs the forwards' launching thread ran on (``launching_cpus``).
Rows are printed and written as they are made: a run cut short keeps them.

Usage:  python bench/diffusers_serving.py --preset tiny --json /tmp/diffusers_serving.json
        python bench/diffusers_serving.py --preset h200 --json $OUT/diffusers_serving.json
        python bench/diffusers_serving.py --preset h200 --workloads pixart --rounds 3 --fresh-direct \\
            --cpu-affinity gpu-local --json $OUT/pixart.json
        python bench/diffusers_serving.py --preset h200 --workloads pixart --requests 6 --rounds 3 --graphs \\
            --json $OUT/pixart_graphs.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import inspect
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from omni_async.cli import options as cli_options
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions
from omni_async.integrations.diffusers import (
    DiffusersPipelineWorker,
    random_pipeline,
    to_uint8,
)
from omni_async.integrations.diffusers.source import ComponentConfig
from omni_async.integrations.diffusers.tiny import FAMILIES, TEXT_DIM, TINY_DIT, TINY_WAN, WAN_TEXT_DIM

BUILDER = "omni_async.integrations.diffusers:random_pipeline"
DEADLINES = Deadlines(compute_timeout=600, output_timeout=600, rpc_timeout=600)

# DiT-XL/2 at 512x512 (facebook/DiT-XL-2-512's shapes) with the SD VAE.
DIT_XL: Mapping[str, ComponentConfig] = {
    "transformer": (
        "DiTTransformer2DModel",
        {
            "sample_size": 64,
            "num_layers": 28,
            "patch_size": 2,
            "attention_head_dim": 72,
            "num_attention_heads": 16,
            "in_channels": 4,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_zero",
            "norm_elementwise_affine": False,
        },
    ),
    "vae": (
        "AutoencoderKL",
        {
            "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "latent_channels": 4,
            "layers_per_block": 2,
            "norm_num_groups": 32,
            "sample_size": 512,
            "scaling_factor": 0.18215,
        },
    ),
    "scheduler": ("DPMSolverMultistepScheduler", {}),
}
# Wan2.1-T2V-1.3B's shapes, no text encoder (requests bring UMT5-shaped prompt_embeds).
WAN_13B_TEXT_DIM = 4096
WAN_13B: Mapping[str, ComponentConfig] = {
    "tokenizer": None,
    "text_encoder": None,
    "transformer": (
        "WanTransformer3DModel",
        {
            "patch_size": [1, 2, 2],
            "num_attention_heads": 12,
            "attention_head_dim": 128,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": WAN_13B_TEXT_DIM,
            "freq_dim": 256,
            "ffn_dim": 8960,
            "num_layers": 30,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "rope_max_seq_len": 1024,
        },
    ),
    "vae": ("AutoencoderKLWan", {}),
    "scheduler": (
        "UniPCMultistepScheduler",
        {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},
    ),
}


# PixArt-Sigma-XL-2-512's shapes: 28 layers of 16 x 72, T5-XXL-shaped captions (4096 wide,
# 300 tokens, with their attention mask), the SDXL VAE.
PIXART_SIGMA_512: Mapping[str, ComponentConfig] = {
    "tokenizer": None,
    "text_encoder": None,
    "transformer": (
        "PixArtTransformer2DModel",
        {
            "sample_size": 64,
            "num_layers": 28,
            "patch_size": 2,
            "attention_head_dim": 72,
            "num_attention_heads": 16,
            "in_channels": 4,
            "out_channels": 8,
            "cross_attention_dim": 1152,
            "caption_channels": 4096,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-6,
        },
    ),
    "vae": ("AutoencoderKL", {**DIT_XL["vae"][1], "scaling_factor": 0.13025}),  # type: ignore[index]
    "scheduler": ("DPMSolverMultistepScheduler", {}),
}
# CogVideoX-2B's shapes: 30 layers of 30 x 64, 226 T5 tokens 4096 wide, its 3D VAE (the
# class's defaults are 2B's), its DDIM scheduler.
COGVIDEOX_2B: Mapping[str, ComponentConfig] = {
    "tokenizer": None,
    "text_encoder": None,
    "transformer": (
        "CogVideoXTransformer3DModel",
        {
            "num_attention_heads": 30,
            "attention_head_dim": 64,
            "in_channels": 16,
            "out_channels": 16,
            "time_embed_dim": 512,
            "text_embed_dim": 4096,
            "num_layers": 30,
            "sample_width": 90,
            "sample_height": 60,
            "sample_frames": 49,
            "patch_size": 2,
            "temporal_compression_ratio": 4,
            "max_text_seq_length": 226,
        },
    ),
    "vae": ("AutoencoderKLCogVideoX", {}),
    "scheduler": (
        "CogVideoXDDIMScheduler",
        {
            "timestep_spacing": "trailing",
            "snr_shift_scale": 3.0,
            "rescale_betas_zero_snr": True,
            "prediction_type": "v_prediction",
            "beta_end": 0.012,
            "clip_sample": False,
        },
    ),
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "device": "cpu",
        "requests": 4,
        "batch": 4,
        "workloads": {
            "dit": {
                "pipeline": "DiTPipeline",
                "components": TINY_DIT,
                "dtype": None,
                "params": {"num_inference_steps": 4},
            },
            "wan": {
                "pipeline": "WanPipeline",
                "components": TINY_WAN,
                "dtype": None,
                "text_dim": WAN_TEXT_DIM,
                "seq": 8,
                "params": {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 5.0},
            },
            "pixart": {
                "pipeline": FAMILIES["pixart"][0],
                "components": FAMILIES["pixart"][1],
                "dtype": None,
                "text_dim": TEXT_DIM,
                "seq": 8,
                "mask": True,
                "params": {"height": 64, "width": 64, "num_inference_steps": 2},
            },
            "cogvideox": {
                "pipeline": FAMILIES["cogvideox"][0],
                "components": FAMILIES["cogvideox"][1],
                "dtype": None,
                "text_dim": TEXT_DIM,
                "seq": 8,
                "params": {"height": 16, "width": 16, "num_frames": 9, "num_inference_steps": 2},
            },
        },
    },
    # PixArt-Sigma-512's 28 layers and 20 steps at a width of 24 (256x256 images, the tiny
    # VAE): a forward bound by the host's Python, as PixArt-Sigma-512's is by its kernel
    # launches on a GPU.  Whether a worker process runs such a forward slower than the
    # direct loop's own process does, on the CPU (bench/results/diffusers_serving_cpu_launch.json).
    "cpu-launch": {
        "device": "cpu",
        "requests": 6,
        "batch": 2,
        "workloads": {
            "pixart": {
                "pipeline": FAMILIES["pixart"][0],
                "components": {
                    **FAMILIES["pixart"][1],
                    "transformer": (
                        FAMILIES["pixart"][1]["transformer"][0],
                        {**FAMILIES["pixart"][1]["transformer"][1], "num_layers": 28},
                    ),
                },
                "dtype": None,
                "text_dim": TEXT_DIM,
                "seq": 8,
                "mask": True,
                "params": {"height": 256, "width": 256, "num_inference_steps": 20},
            },
        },
    },
    "h200": {
        "device": "cuda",
        "requests": 8,
        "batch": 4,
        "workloads": {
            "dit": {
                "pipeline": "DiTPipeline",
                "components": DIT_XL,
                "dtype": "bfloat16",
                "params": {"num_inference_steps": 25},
            },
            "wan": {
                "pipeline": "WanPipeline",
                "components": WAN_13B,
                "dtype": "bfloat16",
                "text_dim": WAN_13B_TEXT_DIM,
                "seq": 512,
                "params": {
                    "height": 480,
                    "width": 832,
                    "num_frames": 81,
                    "num_inference_steps": 4,
                    "guidance_scale": 5.0,
                },
            },
            "pixart": {
                "pipeline": "PixArtSigmaPipeline",
                "components": PIXART_SIGMA_512,
                "dtype": "bfloat16",
                "text_dim": 4096,
                "seq": 300,
                "mask": True,
                "params": {"height": 512, "width": 512, "num_inference_steps": 20},
            },
            "cogvideox": {
                "pipeline": "CogVideoXPipeline",
                "components": COGVIDEOX_2B,
                "dtype": "bfloat16",
                "text_dim": 4096,
                "seq": 226,
                "params": {"height": 480, "width": 720, "num_frames": 25, "num_inference_steps": 10},
            },
        },
    },
}


def builder_kwargs(work: Mapping[str, Any]) -> dict[str, Any]:
    return {"pipeline": work["pipeline"], "components": work["components"], "seed": 0, "dtype": work["dtype"]}


def requests(name: str, work: Mapping[str, Any], count: int, prefix: str) -> list[DiffusionRequest]:
    out = []
    for i in range(count):
        params: dict[str, object] = {**work["params"], "seed": i}
        if name == "dit":
            params["class_labels"] = (7 * i) % 1000
        else:
            gen = torch.Generator().manual_seed(i)
            dtype = getattr(torch, work["dtype"] or "float32")
            params["prompt_embeds"] = torch.randn(1, work["seq"], work["text_dim"], generator=gen).to(dtype)
            params["negative_prompt_embeds"] = torch.randn(1, work["seq"], work["text_dim"], generator=gen).to(dtype)
            if work.get("mask"):  # PixArt needs its captions' masks beside precomputed embeddings
                params["prompt_attention_mask"] = torch.ones(1, work["seq"], dtype=torch.long)
                params["negative_prompt_attention_mask"] = torch.ones(1, work["seq"], dtype=torch.long)
        out.append(DiffusionRequest(f"{prefix}{i}", params))
    return out


class DirectLoop:
    """The client's loop: call, .cpu(), uint8; device time per forward from CUDA events.
    The pipeline is built (and warmed) once, in this process, and measured once a round,
    so its runs alternate with the engine's like theirs do with each other."""

    def __init__(self, name: str, work: Mapping[str, Any], device: str) -> None:
        self.name, self.work, self.device = name, work, device
        with torch.device(device):
            pipe: Any = random_pipeline(work["pipeline"], work["components"], seed=0, dtype=work["dtype"])
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        if hasattr(pipe, "vae") and hasattr(pipe.vae, "enable_slicing"):
            pipe.vae.enable_slicing()
        self.pipe = pipe
        self.host_calls: list[float] = []  # each call's return on the host, from its start
        neg = inspect.signature(pipe.__call__).parameters.get("negative_prompt")
        self.neg_default = None if neg is None else neg.default
        for warm in requests(name, work, 2, "warm"):  # the first calls pay for allocations and kernel choice
            self.call(warm)

    def call(self, r: DiffusionRequest) -> tuple[Any, float | None]:
        kwargs = {k: v for k, v in r.params.items() if k != "seed"}
        if "class_labels" in kwargs:
            kwargs["class_labels"] = [kwargs["class_labels"]]
        if "negative_prompt_embeds" in kwargs and self.neg_default is not None:
            kwargs["negative_prompt"] = None  # PixArt's default "" is refused beside negative embeddings
        for key in (
            "prompt_embeds",
            "negative_prompt_embeds",
            "prompt_attention_mask",
            "negative_prompt_attention_mask",
        ):
            if key in kwargs:
                kwargs[key] = kwargs[key].to(self.device)
        cuda = self.device.startswith("cuda")
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        host_t0 = time.perf_counter()
        out = self.pipe(**kwargs, generator=torch.Generator().manual_seed(int(r.params["seed"])), output_type="pt")
        self.host_calls.append(time.perf_counter() - host_t0)
        if cuda:
            end.record()
        pixels = out.images if "images" in out else out.frames
        made = to_uint8(pixels.cpu())  # what a client does next (the .cpu() waits for the kernels)
        return made.numpy(), (start.elapsed_time(end) / 1e3 if cuda else None)

    def run(self, count: int) -> tuple[dict[str, Any], list[Any]]:
        """One measured run of ``count`` requests: its row and each output's pixels."""
        t0 = time.perf_counter()
        self.host_calls.clear()
        sampler = CpuSampler(os.getpid(), threading.get_native_id())  # this thread launches the forwards
        made = [self.call(r) for r in requests(self.name, self.work, count, "d")]
        wall = time.perf_counter() - t0
        launching_cpus = sampler.stop()
        device_times = [t for _, t in made if t is not None]
        forward = statistics.median(device_times) if device_times else None
        row = summary(self.name, "direct", count, wall, forward, None)
        row["direct_forwards_s"] = [round(t, 4) for t in device_times]
        # The call's return on the host against the device's forward: near equal, the
        # host's launches bound the forward (as engine_device_behind_s near 0 says).
        row["host_call_s"] = round(statistics.median(self.host_calls), 4)
        row["launching_cpus"] = launching_cpus
        return row, [px for px, _ in made]


class CpuSampler:
    """Which CPUs a thread ran on over a run: ``/proc/<pid>/task/<tid>/stat``'s last CPU,
    every 20 ms on a thread of its own (the forward's launching thread is a process's main
    thread: ``tid = pid``).  ``stop()``: {cpu: samples}, to lay against the GPU's NUMA node
    (the probe's ``lscpu`` lines) when a run's forwards were slow."""

    def __init__(self, pid: int, tid: int | None = None) -> None:
        self._path = f"/proc/{pid}/task/{tid or pid}/stat"
        self._seen: collections.Counter[int] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> bool:
        try:
            with open(self._path, encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return False  # the thread is gone
        self._seen[int(fields[36])] += 1  # field 39 of stat(5): the CPU it last ran on
        return True

    def _run(self) -> None:
        while self._sample() and not self._stop.wait(0.02):
            pass

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()  # and where it is now: a run shorter than one period has a sample too
        return {str(cpu): n for cpu, n in sorted(self._seen.items())}


def pixels_of(output: Any) -> Any:
    """The uint8 pixels of an engine result made by the ``diffusers`` post-process (its
    ``images`` or ``frames``, as the pipeline's own output class or a mapping)."""
    for key in ("images", "frames"):
        value = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if value is not None:
            return np.asarray(value)
    raise TypeError(f"no images or frames in {type(output).__name__}")


def summary(name: str, path: str, count: int, wall: float, forward: float | None, gap: float | None) -> dict[str, Any]:
    return {
        "workload": name,
        "path": path,
        "requests": count,
        "seconds": round(wall, 4),
        "requests_per_s": round(count / wall, 4),
        "device_forward_s": None if forward is None else round(forward, 4),
        "device_idle_s": None if forward is None else round(max(0.0, wall - count * forward), 4),
        "forward_gap_s": None if gap is None else round(gap, 4),
    }


def _spans(results: list[Any]) -> list[tuple[float, float]]:
    """Each result's forward on the worker (start, end), from its device-true stamps, in order."""
    return sorted(
        (float(r.metrics["forward_started_at"]), float(r.metrics["forward_ended_at"]))
        for r in results
        if "forward_started_at" in r.metrics and "forward_ended_at" in r.metrics
    )


def _forward_gap(results: list[Any]) -> float | None:
    gaps = [max(0.0, nxt[0] - cur[1]) for cur, nxt in itertools.pairwise(_spans(results))]
    return statistics.mean(gaps) if gaps else None


def run_engine(
    name: str,
    work: Mapping[str, Any],
    device: str,
    count: int,
    *,
    async_output: bool,
    forward: float | None,
    decode: str = "forward",
    expected: list[Any] | None = None,
    cpu_affinity: str | tuple[int, ...] | None = None,
    inference_mode: bool = True,
    cuda_graphs: bool = False,
) -> dict[str, Any]:
    # warmup=: one forward while the worker starts, so the first client pays no one-time costs
    # (with cuda_graphs, the denoiser's graphs are captured then).
    spec = DiffusersPipelineWorker.spec(
        builder=BUILDER, builder_kwargs=builder_kwargs(work), device=device, postprocess="diffusers",
        warmup=requests(name, work, 1, "warmup")[0].params, decode=decode, cuda_graphs=cuda_graphs,
    )  # fmt: skip

    def factory() -> MultiprocDiffusionExecutor:
        options = WorkerOptions(device=device, cpu_affinity=cpu_affinity, inference_mode=inference_mode)
        return MultiprocDiffusionExecutor(spec, deadlines=DEADLINES, options=options)

    async def one(engine: AsyncDiffusionEngine, r: DiffusionRequest) -> tuple[float, Any]:
        t0 = time.perf_counter()
        result = await engine.generate(r)
        return time.perf_counter() - t0, result

    async def body() -> tuple[float, list[Any], tuple[float, Any], tuple[float, Any], tuple[float, float]]:
        engine = AsyncDiffusionEngine.from_factory(factory, pipeline="diffusers", async_output=async_output)
        async with engine:
            first = await one(engine, requests(name, work, 1, "first")[0])  # the first after start
            executor = engine.executor
            assert isinstance(executor, MultiprocDiffusionExecutor)
            (pid,) = [p.pid for p in executor.procs if p.pid is not None]
            sampler = CpuSampler(pid)  # the worker's main thread: the one that launches the forward
            # time.monotonic(): the clock of the worker's forward stamps (worker/stamps.py).
            t0 = time.monotonic()
            results = await asyncio.gather(*(engine.generate(r) for r in requests(name, work, count, "e")))
            t1 = time.monotonic()
            cpus[:] = [sampler.stop()]
            steady = await one(engine, requests(name, work, 1, "steady")[0])  # alone again, warm
            return t1 - t0, list(results), first, steady, (t0, t1)

    cpus: list[dict[str, int]] = []
    wall, results, (first, _), (steady, alone), (t0, t1) = asyncio.run(body())
    path = "engine-decode" if decode == "device" else "engine-async" if async_output else "engine-sync"
    if cpu_affinity is not None:
        path += "-pinned"
    if not inference_mode:
        path += "-nograd"  # the forward under the pipeline's own no_grad only, as the direct loop's
    if cuda_graphs:
        path += "-graphs"  # the denoiser replayed as CUDA graphs (DiffusersPipelineWorker(cuda_graphs=True))
    row = summary(name, path, count, wall, forward, _forward_gap(results))
    row["device_idle_share"] = _idle_share(results)
    row["launching_cpus"] = cpus[0]  # {cpu: samples} of the worker's main thread over the run
    row["first_request_s"], row["steady_request_s"] = round(first, 4), round(steady, 4)
    row["first_over_steady"] = round(first / steady, 3)
    # Where the wall time went: the engine's own forwards (their median, against the direct
    # loop's), the time before the first forward began and after the last one ended.
    spans = _spans(results)
    if spans:
        row["engine_forward_s"] = round(statistics.median(e - s for s, e in spans), 4)
        row["engine_forwards_s"] = [round(e - s, 4) for s, e in spans]
        row["lead_s"], row["tail_s"] = round(spans[0][0] - t0, 4), round(t1 - spans[-1][1], 4)
        # How far the device ran behind the host's return from each call: near 0, the
        # host's launches bound the forward (it cannot run ahead of them).
        behind = [float(r.metrics["forward_ended_at"]) - float(r.metrics["forward_returned_at"]) for r in results
                  if "forward_returned_at" in r.metrics and "forward_ended_at" in r.metrics]  # fmt: skip
        if behind:
            row["engine_device_behind_s"] = round(statistics.median(behind), 4)
    # The lone request after the run, in parts: its forward on the device and its pack;
    # the rest of steady_request_s is the way there and back.
    m = alone.metrics
    if "forward_started_at" in m and "forward_ended_at" in m:
        row["steady_forward_s"] = round(float(m["forward_ended_at"]) - float(m["forward_started_at"]), 4)
    if "pack_started_at" in m and "pack_ended_at" in m:
        row["steady_pack_s"] = round(float(m["pack_ended_at"]) - float(m["pack_started_at"]), 4)
        row["steady_after_forward_s"] = round(float(m["pack_ended_at"]) - float(m["forward_ended_at"]), 4)
    if expected is not None:
        # The same seeds as the direct loop's requests, in order: every pixel equal.
        row["bit_for_bit"] = all(
            np.array_equal(pixels_of(r.output), want) for r, want in zip(results, expected, strict=True)
        )
    return row


def _idle_share(results: list[Any]) -> float | None:
    """The device's idle time between forwards over the span of the run's forwards, from
    the worker's device-true stamps (CUDA events; the host clock on the CPU)."""
    spans = _spans(results)
    if len(spans) < 2:
        return None
    idle = sum(max(0.0, nxt[0] - cur[1]) for cur, nxt in itertools.pairwise(spans))
    return round(idle / (spans[-1][1] - spans[0][0]), 4)


def run_batching(
    work: Mapping[str, Any], device: str, count: int, batch: int, forward: float | None
) -> list[dict[str, Any]]:
    """DiT through the engine's batching (``max_batch_size``) in batches of ``batch``
    against one by one (``max_batch_size=1``), ``count`` requests each."""
    spec = DiffusersPipelineWorker.spec(
        builder=BUILDER, builder_kwargs=builder_kwargs(work), device=device, postprocess="diffusers"
    )
    rows = []
    for size in (1, batch):

        async def body(size: int = size) -> float:
            engine = AsyncDiffusionEngine.from_factory(
                lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES, options=WorkerOptions(device=device)),
                pipeline="diffusers",
                max_batch_size=size,
                batch_wait_s=0.05,
            )
            async with engine:
                await engine.generate(requests("dit", work, 1, "warm")[0])
                t0 = time.perf_counter()
                await asyncio.gather(*(engine.generate(r) for r in requests("dit", work, count, f"b{size}-")))
                return time.perf_counter() - t0

        rows.append(summary("dit", f"engine-batch-{size}", count, asyncio.run(body()), forward, None))
    return rows


def round_order(r: int, *, pinned: bool, fresh: bool = False, nograd: bool = False, graphs: bool = False) -> list[str]:
    """The paths of round ``r`` in the order they run: the direct loop (and the same loop
    in a fresh process, with ``--fresh-direct``), the engine's sync and async paths (and
    the async one pinned, with ``--cpu-affinity``; without the worker's inference mode,
    with ``--nograd``; both with the denoiser as CUDA graphs, with ``--graphs``), reversed
    every other round, so that order effects (a warmer GPU, the allocator, the page cache)
    fall on all of them alike."""
    paths = ["direct", *(["direct-fresh"] if fresh else []), "sync", "async"]
    paths += ["async-pinned"] if pinned else []
    paths += ["async-nograd"] if nograd else []
    paths += ["sync-graphs", "async-graphs"] if graphs else []
    return paths if r % 2 == 0 else paths[::-1]


def digests(outputs: list[Any]) -> list[str]:
    """Each output's pixels as a digest: what a fresh process's outputs are compared by."""
    return [hashlib.sha256(np.ascontiguousarray(px).tobytes()).hexdigest() for px in outputs]


def run_direct_fresh(preset: str, name: str, count: int, expected: list[Any]) -> dict[str, Any]:
    """The direct loop in a process of its own, built and warmed there as the engine's
    worker is: the spread of a launch-bound forward from process to process falls on the
    direct loop's runs as on the engine's, not only on the bench's one process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--direct-child", "--preset", preset, "--workloads", name,
           "--requests", str(count)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith('{"row"')), None)
    if line is None:
        raise RuntimeError(f"the direct loop's process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(line)
    row: dict[str, Any] = got["row"]
    row["path"] = "direct-fresh"
    row["bit_for_bit"] = got["digests"] == digests(expected)
    return row


def paths_table(rows: list[dict[str, Any]]) -> str:
    """Per workload and path: the median requests/s over its runs, over the direct loop's
    median, the median forward (the direct loop's by CUDA events around the call, the
    engine's from its worker's device stamps), and whether every output was equal to the
    direct loop's."""
    head = f"{'workload':9} {'path':20} {'runs':>4} {'median req/s':>12} {'/ direct':>8} {'fwd s':>6} {'all equal':>9}"
    lines = [head]
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == name]
        direct = statistics.median(r["requests_per_s"] for r in mine if r["path"] == "direct")
        for path, key in (
            ("direct", "device_forward_s"),
            ("direct-fresh", "device_forward_s"),
            ("engine-sync", "engine_forward_s"),
            ("engine-async", "engine_forward_s"),
            ("engine-async-pinned", "engine_forward_s"),
            ("engine-async-nograd", "engine_forward_s"),
            ("engine-sync-graphs", "engine_forward_s"),
            ("engine-async-graphs", "engine_forward_s"),
        ):
            runs = [r for r in mine if r["path"] == path]
            if runs:
                med = statistics.median(r["requests_per_s"] for r in runs)
                # On the CPU the direct loop's forward is its call (no device time).
                fwds = [r.get(key) or r.get("host_call_s") for r in runs]
                fwds = [f for f in fwds if f is not None]
                fwd = f"{statistics.median(fwds):6.3f}" if fwds else f"{'-':>6}"
                equal = "-" if path == "direct" else str(all(r.get("bit_for_bit") for r in runs))
                lines.append(f"{name:9} {path:20} {len(runs):4} {med:12.3f} {med / direct:8.3f} {fwd} {equal:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default: the preset's)")
    parser.add_argument(
        "--workloads", default="dit,wan,pixart,cogvideox", help="comma-separated: dit, wan, pixart, cogvideox"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every path each, in alternating order (round_order)"
    )
    parser.add_argument(
        "--cpu-affinity",
        type=cli_options.cpu_affinity,  # as omni-async serve reads it: gpu-local or a CPU list
        default=None,
        help="also run the engine's async path with its worker pinned so (WorkerOptions.cpu_affinity: gpu-local "
        "or a CPU list such as 0-7), as path engine-async-pinned, in the same rounds",
    )
    parser.add_argument(
        "--fresh-direct",
        action="store_true",
        help="also run the direct loop in a fresh process each round (path direct-fresh), as the engine's worker is",
    )
    parser.add_argument(
        "--nograd",
        action="store_true",
        help="also run the engine's async path with WorkerOptions(inference_mode=False), the forward under the "
        "pipeline's own no_grad only as in the direct loop (path engine-async-nograd), in the same rounds",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="also run the engine's sync and async paths with the denoiser replayed as CUDA graphs "
        "(DiffusersPipelineWorker(cuda_graphs=True): paths engine-sync-graphs, engine-async-graphs), in the same rounds",
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--direct-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.direct_child:  # run_direct_fresh's process: one run, its row and digests on stdout
        preset_ = PRESETS[args.preset]
        child_loop = DirectLoop(args.workloads, preset_["workloads"][args.workloads], str(preset_["device"]))
        row, outputs = child_loop.run(int(args.requests or preset_["requests"]))
        print(json.dumps({"row": row, "digests": digests(outputs)}))
        return 0
    preset = PRESETS[args.preset]
    device = str(preset["device"])
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("the h200 preset needs a CUDA device")
    count = int(args.requests or preset["requests"])
    rounds = int(args.rounds)
    rows: list[dict[str, Any]] = []

    def write(complete: bool) -> None:
        """The figures so far (a device run cut short by its time limit keeps its rows)."""
        if args.json:
            report = {
                "command": " ".join(["python3", *sys.argv]),
                "preset": args.preset,
                "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                "torch": torch.__version__,
                "complete": complete,
                "runs": rows,
            }
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=2)

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        fwd = row.get("engine_forward_s") or row.get("device_forward_s") or row.get("host_call_s")
        print(f"  {row['workload']} {row['path']} round {row.get('round')}: {row['requests_per_s']} req/s, forward {fwd}",
              flush=True)  # fmt: skip
        write(complete=False)

    for name in args.workloads.split(","):
        work = preset["workloads"][name]
        loop = DirectLoop(name, work, device)
        direct, expected = loop.run(count)
        direct["round"] = 0
        keep(direct)
        # The direct loop and the engine's paths in turn, round after round (round_order).
        for r in range(rounds):
            order = round_order(
                r, pinned=bool(args.cpu_affinity), fresh=args.fresh_direct, nograd=args.nograd, graphs=args.graphs
            )
            for path in order:
                if path == "direct":
                    if r == 0:
                        continue  # measured above, first: its pixels are the reference
                    row, _ = loop.run(count)
                elif path == "direct-fresh":
                    row = run_direct_fresh(args.preset, name, count, expected)
                else:
                    try:
                        row = run_engine(
                            name, work, device, count, async_output=path.startswith("async"),
                            forward=direct["device_forward_s"], expected=expected,
                            cpu_affinity=args.cpu_affinity if path.endswith("-pinned") else None,
                            inference_mode=not path.endswith("-nograd"), cuda_graphs=path.endswith("-graphs"),
                        )  # fmt: skip
                    except Exception as exc:  # noqa: BLE001  # one path's failure: said, and the other paths still run
                        print(f"  {name} {path} round {r}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        continue
                row["round"] = r
                keep(row)
        del loop
        if name == "wan":
            keep(run_engine(name, work, device, count, async_output=True, forward=direct["device_forward_s"],
                            decode="device"))  # fmt: skip
        if name == "dit":
            for row in run_batching(work, device, count, int(preset["batch"]), direct["device_forward_s"]):
                keep(row)
    print(
        f"{'workload':9} {'path':20} {'req/s':>7} {'seconds':>8} {'dev fwd s':>9} {'dev idle s':>10} {'gap s':>6} {'idle':>6} {'1st/steady':>10} {'bits':>5}"
        f" {'eng fwd s':>9} {'lead s':>6} {'tail s':>6}"
    )
    for row in rows:
        keys = ("device_forward_s", "device_idle_s", "forward_gap_s", "engine_forward_s", "lead_s", "tail_s")
        cells = [row.get(k) for k in keys]
        shown = ["-" if c is None else f"{c:.3f}" for c in cells]
        share = row.get("device_idle_share")
        idle = "-" if share is None else f"{100 * share:.1f}%"
        ratio = "-" if row.get("first_over_steady") is None else f"{row['first_over_steady']:.2f}"
        bits = {True: "equal", False: "DIFF", None: "-"}[row.get("bit_for_bit")]
        print(
            f"{row['workload']:9} {row['path']:20} {row['requests_per_s']:7.3f} {row['seconds']:8.2f} {shown[0]:>9} {shown[1]:>10} {shown[2]:>6} {idle:>6} {ratio:>10} {bits:>5}"
            f" {shown[3]:>9} {shown[4]:>6} {shown[5]:>6}"
        )
    print(paths_table(rows))
    write(complete=True)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
