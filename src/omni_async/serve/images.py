"""``POST /v1/images/generations`` against the engine: n images as one batch, or one streamed.

``ImageService.generate`` sends the ``n`` images of a request to the engine at once (one
``DiffusionRequest`` each, with seeds ``seed .. seed + n - 1``), so an engine with
``max_batch_size >= n`` runs them as one batched forward; a member that fails fails the
request and cancels the others (nothing of them is left).  Each image is encoded in the
engine's encoder processes (the request's ``format``); the base64 and the JSON of the
answer are made on a thread, never on the event loop (a 2k PNG's base64 is megabytes).
With ``response_format="url"`` each image goes to the engine's file sink (written on a
post-processing thread, deleted at its ttl) and the answer carries its URL
(``/v1/files/{file_id}/content``).

``ImageService.stream`` runs one image with ``generate_stream``: the engine's previews
(``preview_every``) become ``image_generation.partial_image`` events, the result the
``image_generation.completed`` event, in the shapes the ``openai`` client parses
(``ImageGenPartialImageEvent``, ``ImageGenCompletedEvent``).  The first item is awaited
before the response starts, so a refusal (a bad parameter, a full queue) is still a 400 or
a 429; a failure after that is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator

from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationChunk, GenerationResult
from omni_async.engine.sinks import OutputFile
from omni_async.serve.errors import api_error
from omni_async.serve.models import RESERVED as RESERVED_FIELDS
from omni_async.serve.parsing import ImageGeneration

__all__ = ["ImageService", "sse_event"]


def sse_event(event: str, data: dict[str, object]) -> bytes:
    """One server-sent event (``text/event-stream``)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _file_of(output: object, request_id: str) -> EncodedOutput:
    if isinstance(output, EncodedOutput):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], EncodedOutput):
        return output[0]
    raise TypeError(f"request {request_id}: the engine returned {type(output).__name__}, not an encoded image")


def _written(output: object, request_id: str) -> OutputFile:
    if isinstance(output, OutputFile):
        return output
    raise TypeError(f"request {request_id}: the engine returned {type(output).__name__}, not a written file")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class ImageService:
    """Image generations through ``engine`` (see the module docstring)."""

    def __init__(self, engine: AsyncDiffusionEngine) -> None:
        self._engine = engine

    def _requests(self, gen: ImageGeneration, request_id: str) -> list[DiffusionRequest]:
        # response_format="url": the engine writes each image to its file sink (on a
        # post-processing thread), and the answer names the route that serves it.
        sink = "file" if gen.response_format == "url" else "value"
        try:
            return [
                DiffusionRequest(
                    request_id if gen.n == 1 else f"{request_id}-{i}",
                    params,
                    format=gen.output_format,
                    quality=gen.quality,
                    sink=sink,
                )
                for i, params in enumerate(gen.params)
            ]
        except Exception as exc:
            raise api_error(exc, request_id, reserved=RESERVED_FIELDS) from exc

    async def generate(self, gen: ImageGeneration, request_id: str, files_url: str) -> bytes:
        """The JSON answer (an ``ImagesResponse``) of a non-streamed generation;
        ``files_url``: where the file route is (``.../v1/files``), for ``response_format="url"``."""
        requests = self._requests(gen, request_id)
        try:
            # A TaskGroup: one member's failure (or this task's cancellation: the client
            # left) cancels the others, and each cancelled generate aborts its request.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._engine.generate(r)) for r in requests]
        except* Exception as grouped:
            self._forget_files(tasks)  # of the members that finished: nobody will ask for them
            first = grouped.exceptions[0]
            raise api_error(first, request_id, reserved=RESERVED_FIELDS) from first
        outputs = [t.result().output for t in tasks]
        if gen.response_format == "url":
            data = [{"url": f"{files_url}/{_written(o, request_id).file_id}/content"} for o in outputs]
            return self._render(gen, data)  # small: a few URLs
        files = [_file_of(o, r.request_id) for o, r in zip(outputs, requests, strict=True)]
        # The base64 of megabytes, and its JSON: on a thread.
        return await asyncio.to_thread(lambda: self._render(gen, [{"b64_json": _b64(f.data)} for f in files]))

    def _forget_files(self, tasks: list[asyncio.Task[GenerationResult]]) -> None:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                output = task.result().output
                if isinstance(output, OutputFile):
                    self._engine.files.delete(output.file_id)

    @staticmethod
    def _render(gen: ImageGeneration, data: list[dict[str, str]]) -> bytes:
        body = {
            "created": int(time.time()),
            "data": data,
            "output_format": gen.output_format,
            "size": gen.size,
            "background": "opaque",
        }
        return json.dumps(body, separators=(",", ":")).encode()

    async def stream(self, gen: ImageGeneration, request_id: str) -> AsyncIterator[bytes]:
        """The events of a streamed generation; its first item is awaited here, so a refusal
        raises (as an ``ApiError``) before the response starts."""
        (request,) = self._requests(gen, request_id)
        items = self._engine.generate_stream(request)
        try:
            first = await anext(items)
        except BaseException as exc:
            await items.aclose()
            if isinstance(exc, Exception):
                raise api_error(exc, request_id, reserved=RESERVED_FIELDS) from exc
            raise
        return self._events(gen, request_id, first, items)

    async def _events(
        self,
        gen: ImageGeneration,
        request_id: str,
        first: GenerationChunk | GenerationResult,
        items: AsyncGenerator[GenerationChunk | GenerationResult, None],
    ) -> AsyncIterator[bytes]:
        # Closing the stream (the client left: the response's task is cancelled) aborts the request.
        async with contextlib.aclosing(items):
            sent = 0
            item: GenerationChunk | GenerationResult | None = first
            try:
                while item is not None:
                    encoded = _file_of(item.output, request_id)
                    common = {
                        "b64_json": await asyncio.to_thread(_b64, encoded.data),
                        "background": "opaque",
                        "created_at": int(time.time()),
                        "output_format": gen.output_format,
                        "quality": "auto",
                        "size": gen.size,
                    }
                    if isinstance(item, GenerationResult):
                        usage = {
                            "input_tokens": 0,
                            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                            "output_tokens": 0,
                            "total_tokens": 0,
                        }
                        yield sse_event(
                            "image_generation.completed",
                            {**common, "type": "image_generation.completed", "usage": usage},
                        )
                        return
                    if sent < gen.partial_images:
                        yield sse_event(
                            "image_generation.partial_image",
                            {**common, "type": "image_generation.partial_image", "partial_image_index": sent},
                        )
                        sent += 1
                    item = await anext(items, None)
            except Exception as exc:  # after the response started: the error is an event
                err = api_error(exc, request_id, reserved=RESERVED_FIELDS)
                yield sse_event("error", {"type": "error", **err.body()})
