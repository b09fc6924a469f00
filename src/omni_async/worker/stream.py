"""Streaming from inside a forward: what the model calls to ship an intermediate output.

A request asked for as a stream (``DiffusionExecutor.submit(request, stream=True)``,
``AsyncDiffusionEngine.generate_stream``) gets, besides its final output, the
intermediate outputs its model emits while the forward runs -- a preview every k
denoising steps, the chunks of a video as they are decoded.  The model's side is one
function, called from the thread that runs the forward::

    from omni_async.worker import emit_chunk, streaming_requested

    for step in range(steps):
        latents = denoise(latents, step)
        if streaming_requested(request.request_id) and step % k == k - 1:
            emit_chunk(request.request_id, {"image": preview(latents)})

``emit_chunk(request_id, output)`` ships ``output`` (a ``DiffusionOutput`` of that
request, or a mapping that becomes its ``output``) as the next chunk of the request's
stream.  It takes the asynchronous path, as the final output does: the worker loop gives
the chunk an output id of its own, waits for room in its packer (the same back-pressure
budget as every output: a slow consumer slows the forward here, nothing is dropped),
records a device event after the kernels that wrote the chunk, announces the chunk to
the executor (a ``CHUNK`` message naming the call, the request, its place ``seq`` and
its output id) and hands it to the packer, which copies it on its side stream while
the forward goes on.  The announcement is put *before* the hand-off, on the channel
the packer's OUTPUT_READY takes too, so the executor always knows a chunk's id before
its output arrives.  The tensors must not be written again after the call (clone a
buffer the forward keeps updating).

It returns the chunk's ``seq`` (0, 1, ... per request), or None when nothing was
shipped: the call asked for no stream, this rank is not the reply rank (the other ranks
of a tensor-parallel group compute the same chunks; only the reply rank ships them),
the request was cancelled, or no worker loop runs the forward (a script, a test calling
the model directly).  It raises only when the chunk could not be shipped (the packer
stopped, its back-pressure wait timed out, the result channel is closed); then nothing
of the chunk remains.

``streaming_requested(request_id=None)`` says whether the call wants chunks (of that
request): a model can skip computing previews nobody asked for.  It is True on every
rank of a streaming call, so that ranks that exchange tensors to make a preview keep
doing it in step.

A video model that decodes its frames in chunks ships each as a part of the final video
with ``emit_frames(request_id, frames)`` (uint8 ``[T, H, W, C]``, channel-last, the
frames that follow the last part's); a request served by
``AsyncDiffusionEngine.generate_video`` is encoded part by part as they arrive, and its
final output then carries only the frames not emitted yet (``{"frames": rest}``, or
none).  A call that asked for no stream ships nothing: the model then returns every
frame in its final output, as without parts::

    parts = streaming_requested(request.request_id)
    kept = []
    for frames in decode_in_chunks(latents):      # uint8 [t, H, W, 3] each
        if parts and emit_frames(request.request_id, frames) is not None:
            continue
        kept.append(frames)
    return DiffusionOutput(request.request_id, {"frames": torch.cat(kept)} if kept else {})
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput

__all__ = ["VIDEO_PART", "ChunkScope", "emit_chunk", "emit_frames", "streaming_requested"]

#: The key that marks a chunk as a part of the final video (``emit_frames``).
VIDEO_PART = "video_part"

# (request id, output) -> its seq, or None when not shipped.
EmitFn = Callable[[str, DiffusionOutput], "int | None"]


@attrs.define(eq=False)
class ChunkScope:
    """One streaming call running on this thread, as ``emit_chunk`` sees it."""

    rpc_id: str
    request_ids: tuple[str, ...]
    emit: EmitFn


_current: contextvars.ContextVar[ChunkScope | None] = contextvars.ContextVar("omni_async_stream", default=None)


@contextmanager
def streaming(scope: ChunkScope) -> Iterator[ChunkScope]:
    """The worker loop runs a streaming call's forward inside this."""
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)


def _scope_for(request_id: str, caller: str) -> ChunkScope | None:
    if not isinstance(request_id, str) or not request_id:
        raise UsageError(f"{caller}: request_id must be a non-empty str, got {request_id!r:.80}")
    scope = _current.get()
    if scope is not None and request_id not in scope.request_ids:
        raise UsageError(
            f"{caller}({request_id!r}): the call {scope.rpc_id} computes {list(scope.request_ids)}, not that request"
        )
    return scope


def streaming_requested(request_id: str | None = None) -> bool:
    """True when the running call asked for chunks (of ``request_id``, a request of the call)."""
    if request_id is None:
        return _current.get() is not None
    return _scope_for(request_id, "streaming_requested") is not None


def emit_chunk(request_id: str, output: DiffusionOutput | Mapping[str, Any]) -> int | None:
    """Ship ``output`` as the next chunk of ``request_id``'s stream (see the module docstring).

    Returns its ``seq``, or None when nothing was shipped.  ``UsageError`` for a request
    that the running call does not compute, or an ``output`` that is neither a
    ``DiffusionOutput`` of that request nor a mapping.
    """
    scope = _scope_for(request_id, "emit_chunk")
    if isinstance(output, DiffusionOutput):
        if output.request_id != request_id:
            raise UsageError(
                f"emit_chunk({request_id!r}): the output is request {output.request_id!r}'s; "
                "a chunk belongs to the request it is emitted for"
            )
        chunk = output
    elif isinstance(output, Mapping):
        chunk = DiffusionOutput(request_id, dict(output))
    else:
        raise UsageError(
            f"emit_chunk({request_id!r}): output must be a DiffusionOutput or a mapping "
            f"(e.g. {{'image': tensor}}), got {type(output).__name__}"
        )
    if scope is None:
        return None
    return scope.emit(request_id, chunk)


def emit_frames(request_id: str, frames: Any, *, fps: float | None = None) -> int | None:
    """Ship ``frames`` (uint8 ``[T, H, W, C]`` or grey ``[T, H, W]``, a tensor or array
    the forward does not write again) as the next part of ``request_id``'s final video
    (see the module docstring); ``fps``: the video's frame rate.  Returns the chunk's
    ``seq``, or None when nothing was shipped (then the frames belong in the final
    output).  ``UsageError`` for frames that are not uint8 frames."""
    dtype = str(getattr(frames, "dtype", ""))
    shape = tuple(getattr(frames, "shape", ()))
    if (
        dtype not in ("uint8", "torch.uint8")
        or len(shape) not in (3, 4)
        or (len(shape) == 4 and shape[-1] not in (1, 3, 4))
    ):
        raise UsageError(
            f"emit_frames({request_id!r}): frames must be uint8 [T, H, W, C] (C 1, 3 or 4) or [T, H, W], got "
            f"{dtype or type(frames).__name__} {shape}; convert on the device first (the copy is 2-4x smaller)"
        )
    part: dict[str, Any] = {"frames": frames, VIDEO_PART: True}
    if fps is not None:
        part["fps"] = float(fps)
    return emit_chunk(request_id, part)
