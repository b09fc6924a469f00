"""``DiffusersPipelineWorker``: a ``diffusers`` pipeline as an omni_async worker model.

Built in the worker from a picklable description (``PipelineSource``: a builder
``"module:function"`` plus kwargs, or a pretrained folder), it implements
``DiffusionWorkerModel``:

* ``execute_model(request)``: one pipeline call with the request's parameters
  (``omni_async.integrations.diffusers.profile`` lists them), ``output_type="pt"``
  (or ``"latent"``) and the request's ``seed`` as its own ``torch.Generator`` (on the
  CPU by default, so a seed gives the same noise on every device).  Its output is the
  pipeline's own output object (``ImagePipelineOutput``, ``WanPipelineOutput``: dict
  subclasses the transport carries as they are), its tensors still on the device; with
  ``output_type="latent"``, ``{"latents": tensor}``.  A request with a ``format``
  gets ``{"image": uint8 [H, W, 3]}`` or ``{"frames": uint8 [F, H, W, 3]}``, made on
  the device, which the engine's encoder reads (``pixels.encodable``).
* ``execute_model_batch(requests)``: requests with equal ``batch_key`` share one call,
  batched along the pipeline's batch dimension (lists of ``class_labels`` and prompts,
  stacked embeddings, pooled embeddings and masks; ``batch_size`` for an unconditional
  pipeline, DDIM's) with one generator per member, and the output is split back per
  request.  Each member then draws the noise of its own call; whether its pixels are
  bit-identical to its own call depends on the kernels (see docs/diffusers.md: on the CPU,
  DiT's are -- the VAE decodes a batch one member at a time here -- and Wan's are not,
  to the last bit); they are bit-identical to the same batch called directly.  A
  pipeline that refuses a list of generators (its error says so) fails its first
  batched step: the worker then runs that batch, and later ones, one call per member,
  and logs it once.  Any other failure before the first step ends runs that batch one
  call per member, so the member that fails fails alone, and later batches still batch.

Cancellation and previews run between denoising steps (``omni_async.integrations.diffusers.steps``);
previews and ``decode="device"`` decode with the family's own decode (``decode``).

The executor checks requests before they reach a worker with ``request_validator(**kwargs)``
(built from the pipeline's config, without its weights), and groups them with the
static ``batch_key``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import ClassVar

import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import (
    BatchDiffusionOutput,
    DiffusionOutput,
    DiffusionRequest,
)
from omni_async.integrations.diffusers.decode import DECODES, decode_of
from omni_async.integrations.diffusers.edge import PipelineHandle, no_process_lock_for_progress_bars
from omni_async.integrations.diffusers.pixels import DECODE_LATER, ENCODE_LATER, PIPELINE, encodable
from omni_async.integrations.diffusers.profile import (
    OWN_PARAMETERS,
    PipelineProfile,
    batch_key,
    is_per_member,
    per_request,
    profile_of,
    stack_dims,
    validate_request,
)
from omni_async.integrations.diffusers.source import PipelineSource
from omni_async.integrations.diffusers.steps import DecodeLater, LatentDecoder, StepHook, hooked_scheduler
from omni_async.worker.cancel import cancel_requested
from omni_async.worker.graphs import CudaGraphForward
from omni_async.worker.host import WorkerSpec

__all__ = ["DiffusersPipelineWorker"]

log = logging.getLogger(__name__)

_SOURCE_KEYS = ("builder", "builder_kwargs", "pretrained", "pretrained_kwargs")


def _source(kwargs: Mapping[str, object]) -> PipelineSource:
    unknown = sorted(
        set(kwargs) - {*_SOURCE_KEYS, "device", "generator_device", "slice_vae", "warmup", "decode", "cuda_graphs"}
    )
    if unknown:
        raise UsageError(f"DiffusersPipelineWorker: unknown keyword argument(s) {unknown}")
    builder, pretrained = kwargs.get("builder"), kwargs.get("pretrained")
    builder_kwargs, pretrained_kwargs = kwargs.get("builder_kwargs") or {}, kwargs.get("pretrained_kwargs") or {}
    if not isinstance(builder_kwargs, Mapping) or not isinstance(pretrained_kwargs, Mapping):
        raise UsageError("DiffusersPipelineWorker: builder_kwargs and pretrained_kwargs must be mappings")
    return PipelineSource(
        builder=None if builder is None else str(builder),
        builder_kwargs=dict(builder_kwargs),
        pretrained=None if pretrained is None else str(pretrained),
        pretrained_kwargs=dict(pretrained_kwargs),
    )


class DiffusersPipelineWorker:
    """A ``diffusers`` ``DiffusionPipeline`` served as a worker model (see the module docstring).

    Keyword arguments (all picklable, so they travel in a ``WorkerSpec``): ``builder``
    (``"module:function"`` returning the pipeline) with ``builder_kwargs``, or
    ``pretrained`` (a folder for ``DiffusionPipeline.from_pretrained``) with
    ``pretrained_kwargs``; ``device`` (``"auto"``: the worker's CUDA device when there is
    one, else the CPU); ``generator_device`` (``"cpu"``: where the seeds' generators
    draw); ``slice_vae`` (True: the VAE decodes a batch one member at a time, as its own
    call would); ``warmup`` (a request's parameters: one forward with them while the
    worker starts, so the first client does not pay the first forward's one-time costs);
    ``decode`` (``"forward"``: the pipeline decodes its latents in the forward;
    ``"device"``: where the pipeline can return latents, the forward stops there and the
    VAE decode runs in the device stage, on the packer's side stream while the next
    forward runs -- needs ``postprocess="diffusers"``); ``cuda_graphs`` (False; True: the
    denoiser's forward is captured as a CUDA graph per input signature and replayed,
    ``omni_async.worker.graphs.CudaGraphForward``: the same kernels, launched by one host
    call a step -- for a forward bound by the host's launches; CUDA devices only).
    """

    pipeline_name: ClassVar[str] = PIPELINE

    def __init__(
        self,
        *,
        builder: str | None = None,
        builder_kwargs: Mapping[str, object] | None = None,
        pretrained: str | None = None,
        pretrained_kwargs: Mapping[str, object] | None = None,
        device: str = "auto",
        generator_device: str = "cpu",
        slice_vae: bool = True,
        warmup: Mapping[str, object] | None = None,
        decode: str = "forward",
        cuda_graphs: bool = False,
    ) -> None:
        _check_decode(decode)
        _check_cuda_graphs(cuda_graphs, device)
        no_process_lock_for_progress_bars()
        self.source = _source(
            {
                "builder": builder,
                "builder_kwargs": builder_kwargs,
                "pretrained": pretrained,
                "pretrained_kwargs": pretrained_kwargs,
            }
        )
        if device == "auto":
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.generator_device = torch.device(generator_device)
        self.handle = self.source.load(self.device)
        self.profile: PipelineProfile = profile_of(self.handle)
        # The family's own decode, for previews and (``decode="device"``) the device stage.
        found = decode_of(self.handle)
        self.decoder = None if found is None else LatentDecoder(self.handle, found)
        if decode == "device":
            _check_device_decode(self.profile)
        self.decode_in_device_stage = decode == "device"
        self.sliced_vae = slice_vae and self.handle.slice_vae()
        # False once the pipeline refused a list of generators: batches run member by member.
        self.generator_lists = True
        self.pipeline_calls = 0
        # The denoiser's forward as CUDA graphs (captured on the first call of each signature:
        # the warm-up's, where there is one).
        self.graphed = _graph_denoiser(self.handle, self.device) if cuda_graphs else None
        if warmup is not None:
            # One call with a request's parameters before the worker reports ready: the
            # first forward's one-time costs (kernel choice, allocator growth, lazy
            # initialisation in torch and the pipeline) are paid at start, not by the
            # first client.  A bad parameter fails the start, named.
            self.execute_model(DiffusionRequest("warmup", dict(warmup)))
            self.pipeline_calls = 0

    @property
    def pipeline(self) -> object:
        """The ``diffusers`` pipeline itself (to call it directly, or hook its modules)."""
        return self.handle.pipeline

    # -- what the executor runs without an instance --------------------------------------

    @classmethod
    def request_validator(cls, **kwargs: object) -> Callable[[DiffusionRequest], None]:
        """The check of every request, made from the pipeline's config (its parameters left
        uninitialised: cheap), run by the executor in the caller's thread."""
        profile = profile_of(_source(kwargs).load_config_only())
        return functools.partial(validate_request, profile)

    @classmethod
    def parameter_schema(cls, **kwargs: object) -> dict[str, object]:
        """The request parameters of the pipeline a worker built with ``kwargs`` takes, their
        types and defaults, as JSON-able data (``PipelineProfile.schema``): what a server publishes."""
        return profile_of(_source(kwargs).load_config_only()).schema()

    @staticmethod
    def batch_key(request: DiffusionRequest) -> Hashable | None:
        """Requests with equal keys share one pipeline call (``profile.batch_key``)."""
        return batch_key(request)

    @classmethod
    def spec(cls, *, postprocess: str | None = None, **kwargs: object) -> WorkerSpec:
        """The ``WorkerSpec`` of a worker built with ``kwargs`` (the constructor's);
        ``postprocess="diffusers"`` converts the pixels to uint8 on the device, before the copy."""
        source = _source(kwargs)  # a wrong argument fails here, not in a worker that cannot start
        decode = kwargs.get("decode", "forward")
        _check_decode(decode)
        _check_cuda_graphs(kwargs.get("cuda_graphs", False), kwargs.get("device", "auto"))
        if decode == "device" and postprocess != PIPELINE:
            raise UsageError(
                f"DiffusersPipelineWorker.spec: decode='device' decodes in the device stage of "
                f"postprocess={PIPELINE!r}; got postprocess={postprocess!r}"
            )
        # What can be checked without the weights, now rather than at the worker's start: the
        # builder imports, the pipeline class exists, the folder's config reads, the options fit.
        profile = profile_of(source.load_config_only())
        if decode == "device":
            _check_device_decode(profile)
        return WorkerSpec(f"{cls.__module__}:{cls.__qualname__}", kwargs=kwargs, postprocess=postprocess)

    # -- the model interface ------------------------------------------------------------------

    def validate(self, request: DiffusionRequest) -> None:
        validate_request(self.profile, request)

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        self.validate(request)
        return self._run([request])[0]

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        """One pipeline call per group of requests with equal ``batch_key``; outputs in request order."""
        for r in requests:  # the whole batch is checked before any forward runs
            self.validate(r)
        groups: dict[Hashable, list[int]] = {}
        for i, r in enumerate(requests):
            key = batch_key(r)
            groups.setdefault(("alone", i) if key is None else key, []).append(i)
        outputs: dict[int, DiffusionOutput] = {}
        for indices in groups.values():
            for i, out in zip(indices, self._run([requests[i] for i in indices]), strict=True):
                outputs[i] = out
        return BatchDiffusionOutput(tuple(outputs[i] for i in range(len(requests))))

    # -- internals ------------------------------------------------------------------------------

    def _run(self, requests: Sequence[DiffusionRequest]) -> list[DiffusionOutput]:
        if len(requests) > 1 and not self.generator_lists:
            return [out for r in requests for out in self._run([r])]
        if any(r.format is not None for r in requests) and len({r.format is None for r in requests}) > 1:
            return [out for r in requests for out in self._run([r])]  # an encoded member's output differs
        steps = requests[0].params.get("num_inference_steps", self.profile.default_steps)
        hook = StepHook(self.decoder, requests, int(steps) if isinstance(steps, int) else 0)
        kwargs = self._call_kwargs(requests, hook)
        asked = str(requests[0].params.get("output_type", "pt"))
        later = self.decode_in_device_stage and asked == "pt"
        if later:
            kwargs["output_type"] = "latent"
        try:
            result = self._call(kwargs, hook)
        except Exception as exc:
            if len(requests) == 1 or hook.done > 0 or cancel_requested():
                raise
            if _refuses_generator_lists(exc):
                # The refusal this fallback is for: the pipeline takes one generator, not one per
                # member.  It will refuse every later batch the same way.
                log.warning(
                    "%s refused a batch of %d with one generator per request (%s: %s); running batches one "
                    "request at a time from now on",
                    self.profile.pipeline,
                    len(requests),
                    type(exc).__name__,
                    exc,
                )
                self.generator_lists = False
            # Otherwise a member's own failure: this batch runs one call per member (the failing
            # one fails alone), and later batches still batch.
            return [out for r in requests for out in self._run([r])]
        outputs = []
        for i, r in enumerate(requests):
            member = _member(result, i, len(requests), latent=later or asked == "latent")
            if later:
                # The device stage decodes them (pixels.device_stage), in the worker's process:
                # the decoder never travels.
                assert isinstance(member, Mapping) and self.decoder is not None
                member = {**member, DECODE_LATER: DecodeLater(self.decoder, r.params)}
                if r.format is not None:
                    member[ENCODE_LATER] = True
            elif r.format is not None and asked != "latent":
                member = encodable(member, r.request_id)
            outputs.append(DiffusionOutput(r.request_id, member))
        return outputs

    def _call(self, kwargs: dict[str, object], hook: StepHook) -> object:
        self.pipeline_calls += 1
        # A pipeline that takes gradients in its call cannot run in the worker's inference
        # mode (its tensors could not require grad): it runs in the ordinary mode, under its
        # own no_grad, as when called directly.
        with torch.inference_mode(False) if self.profile.needs_autograd else contextlib.nullcontext():
            if self.profile.step_callback:
                kwargs.update(callback_on_step_end=hook.callback, callback_on_step_end_tensor_inputs=["latents"])
                return self.handle(**kwargs)
            with hooked_scheduler(self.handle, hook):
                return self.handle(**kwargs)

    def _call_kwargs(self, requests: Sequence[DiffusionRequest], hook: StepHook) -> dict[str, object]:
        """The pipeline's arguments for ``requests`` (equal ``batch_key``): the shared ones
        as the first request has them, the per-member ones as lists or stacked tensors."""
        first = requests[0].params
        kwargs: dict[str, object] = {}
        for name, value in first.items():
            if name in OWN_PARAMETERS:
                continue
            if name == "class_labels":
                kwargs[name] = [int(r.params[name]) for r in requests]
            elif not is_per_member(name):
                kwargs[name] = value.to(self.device) if isinstance(value, torch.Tensor) else value
            elif (dims := stack_dims(name)) is not None:
                tensors = [r.params[name] for r in requests]
                assert all(isinstance(t, torch.Tensor) for t in tensors)  # validated
                stacked = [per_request(t, dims) for t in tensors if isinstance(t, torch.Tensor)]
                kwargs[name] = torch.cat(stacked).to(self.device)
            else:
                kwargs[name] = [str(r.params[name]) for r in requests]
        neg_default = self.handle.call_default("negative_prompt")
        if "negative_prompt_embeds" in first and "negative_prompt" not in first and neg_default is not None:
            # PixArt's default negative_prompt is "", which its check refuses beside embeddings.
            kwargs["negative_prompt"] = None
        if self.profile.unconditional and len(requests) > 1:
            kwargs["batch_size"] = len(requests)  # DDIM/DDPM: the batch is its batch_size
        generators = [self._generator(r) for r in requests]
        kwargs["generator"] = generators[0] if len(generators) == 1 else generators
        kwargs["output_type"] = first.get("output_type", "pt")
        kwargs["return_dict"] = True
        return kwargs

    def _generator(self, request: DiffusionRequest) -> torch.Generator:
        gen = torch.Generator(self.generator_device)
        seed = request.params.get("seed")
        if isinstance(seed, int):
            gen.manual_seed(seed)
        else:
            gen.seed()  # no seed asked for: a fresh one, still one generator per request
        return gen


def _refuses_generator_lists(exc: Exception) -> bool:
    """Whether ``exc`` is a pipeline's refusal of a list of generators -- diffusers says
    "list of generators" where it refuses one, and a scheduler that takes one generator
    fails on the list's missing attributes -- not a member's own failure."""
    text = str(exc).lower()
    return "list of generators" in text or (isinstance(exc, AttributeError) and "'list' object" in text)


def _check_device_decode(profile: PipelineProfile) -> None:
    if not profile.latent_output:
        raise UsageError(
            f"DiffusersPipelineWorker: decode='device' needs a pipeline that can stop at its latents "
            f"(output_type='latent'); {profile.pipeline} cannot: use decode='forward'"
        )
    if not profile.decode_known:
        raise UsageError(
            f"DiffusersPipelineWorker: decode='device' runs the pipeline's own decode, and that of "
            f"{profile.pipeline} is not known here (known: {sorted(DECODES)}): use decode='forward'"
        )


def _check_cuda_graphs(cuda_graphs: object, device: object) -> None:
    if not isinstance(cuda_graphs, bool):
        raise UsageError(f"DiffusersPipelineWorker: cuda_graphs must be True or False, got {cuda_graphs!r}")
    if not cuda_graphs or str(device) == "auto":
        return  # "auto": the worker checks the device it finds (_graph_denoiser)
    try:
        kind = torch.device(str(device)).type
    except RuntimeError as exc:
        raise UsageError(f"DiffusersPipelineWorker: device={device!r} is not a device torch knows ({exc})") from exc
    if kind != "cuda":
        raise UsageError(
            f"DiffusersPipelineWorker: cuda_graphs=True replays the denoiser as CUDA graphs, and device={device!r} "
            "is not a CUDA device; leave cuda_graphs off there"
        )


def _graph_denoiser(handle: PipelineHandle, device: torch.device) -> CudaGraphForward[..., object]:
    """Replace the denoiser's ``forward`` with one replayed as CUDA graphs; the wrapper."""
    if device.type != "cuda":
        raise UsageError(
            f"DiffusersPipelineWorker: cuda_graphs=True needs a CUDA device, and this worker's device is "
            f"{str(device)!r}; leave cuda_graphs off there"
        )
    name = handle.denoiser_name()
    module = handle.module(name)
    if module is None:
        raise UsageError(f"DiffusersPipelineWorker: cuda_graphs=True, but {handle.class_name} has no {name} module")
    graphed: CudaGraphForward[..., object] = CudaGraphForward(
        module.forward, device=device, name=f"{handle.class_name}.{name}"
    )
    module.forward = graphed  # nn.Module calls the instance's forward
    return graphed


def _check_decode(decode: object) -> None:
    if decode not in ("forward", "device"):
        raise UsageError(f"DiffusersPipelineWorker: decode must be 'forward' or 'device', got {decode!r}")


def _member(result: object, index: int, size: int, *, latent: bool) -> object:
    """Member ``index`` of a batched pipeline output, in the shape of its own call's output
    (batch dimension 1), as views of the batch's tensors."""
    if latent:
        found = _first_tensor(result)
        if found is None:
            raise UsageError(
                f"the pipeline returned no latents tensor for output_type='latent': {type(result).__name__}"
            )
        return {"latents": _take(found, index, size)}
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        fields = {f.name: _take(getattr(result, f.name), index, size) for f in dataclasses.fields(result)}
        return dataclasses.replace(result, **fields)
    return _take(result, index, size)


def _take(value: object, index: int, size: int) -> object:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
        return value[index : index + 1]
    if isinstance(value, (list, tuple)) and len(value) == size:
        return type(value)([value[index]])
    return value


def _first_tensor(result: object) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, Mapping):
        for value in result.values():
            if isinstance(value, torch.Tensor):
                return value
    return None
