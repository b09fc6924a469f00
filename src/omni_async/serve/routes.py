"""The HTTP routes: thin, each parses, calls its service, and answers (errors are ``ApiError``).

``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /v1/images/generations``,
``POST /v1/videos``, ``GET /v1/videos/{video_id}``, ``GET /v1/videos/{video_id}/content``,
``DELETE /v1/videos/{video_id}``, ``GET /v1/files/{file_id}/content`` (an image asked for
with ``response_format="url"``, from the engine's file sink).  Every request gets an id (``x-request-id`` on its
answer; a 500's message carries it).
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from omni_async.engine.errors import OutputFileGone
from omni_async.serve.disconnect import ClientGone, until_disconnect
from omni_async.serve.errors import ApiError, bad_request
from omni_async.serve.httpmetrics import exposition
from omni_async.serve.parsing import form_value, parse_image_body, parse_video_body
from omni_async.serve.state import ServerState
from omni_async.serve.videos import VideoSpool

__all__ = ["router"]

#: A status the client never sees (it left): counted in the HTTP metrics as what it was.
CLIENT_CLOSED = 499


async def _json_body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw) if raw else {}
    except ValueError as exc:
        raise bad_request(None, f"the body is not JSON: {exc}") from exc


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [state.model.describe()]})

    @r.get("/health")
    async def health() -> JSONResponse:
        try:
            state.engine.check_health()
        except Exception as exc:
            raise ApiError(
                503, f"unhealthy: {type(exc).__name__}: {exc}", type="server_error", code="unhealthy"
            ) from exc
        return JSONResponse({"status": "ok"})

    @r.get("/metrics")
    async def metrics() -> Response:
        # Rendered on a thread; the engine's collector asks the loop for its snapshot from
        # there (engine.metrics() off the loop), so the loop only takes the snapshot.
        text = await asyncio.to_thread(exposition, [state.engine.prometheus_registry(), state.http.registry])
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @r.post("/v1/images/generations")
    async def images(request: Request) -> Response:
        gen = parse_image_body(await _json_body(request), state.model)
        rid = f"img_{uuid.uuid4().hex}"
        headers = {"x-request-id": rid}
        try:
            if gen.stream:
                events = await until_disconnect(request, state.images.stream(gen, rid))
                # no-cache: a proxy must pass each event on as it comes, not hold the stream.
                sse_headers = {**headers, "Cache-Control": "no-cache"}
                return StreamingResponse(events, media_type="text/event-stream", headers=sse_headers)
            files_url = f"{str(request.base_url).rstrip('/')}/v1/files"
            body = await until_disconnect(request, state.images.generate(gen, rid, files_url))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return Response(body, media_type="application/json", headers=headers)

    @r.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        if request.headers.get("content-type", "").startswith(
            ("multipart/form-data", "application/x-www-form-urlencoded")
        ):
            form = await request.form()
            fields = {k: form_value(v) if isinstance(v, str) else v for k, v in form.items()}
            if "input_reference" in fields:
                raise bad_request("input_reference", "input_reference is not supported by this server's models")
            body: object = fields
        else:
            body = await _json_body(request)
        job = await state.videos.create(parse_video_body(body, state.model))
        return JSONResponse(job.as_json(), headers=_poll(state))

    @r.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> JSONResponse:
        return JSONResponse(state.videos.get(video_id).as_json(), headers=_poll(state))

    @r.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> Response:
        if variant != "video":
            raise bad_request("variant", f"variant must be 'video' (no thumbnails here), got {variant!r:.40}")
        found = state.videos.content(video_id)
        if isinstance(found, VideoSpool):
            # Not completed yet: the MP4's bytes as they are encoded (a fragmented MP4, whole
            # at the end; the transfer breaks off if the job fails or is deleted meanwhile).
            return StreamingResponse(found.follow(), media_type="video/mp4", headers=_attachment(f"{video_id}.mp4"))
        return _file_response(state, found, f"{video_id}.mp4")

    @r.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return _file_response(state, file_id, None)

    @r.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> JSONResponse:
        return JSONResponse(await state.videos.delete(video_id))

    return r


def _file_response(state: ServerState, file_id: str, filename: str | None) -> FileResponse:
    """A file of the engine's file sink, read from disk on the server's threads (Starlette's
    ``FileResponse``); 404 once it is gone (expired, deleted).  The file is opened as the
    response starts: an expiry after that leaves this response whole (an unlinked file's
    open descriptor still reads)."""
    try:
        written = state.engine.files.get(file_id)
    except OutputFileGone as exc:
        raise ApiError(404, f"file {file_id!r} is gone ({exc.why})", param="file_id", code="not_found") from exc
    return FileResponse(written.path, media_type=written.media_type, filename=filename)


def _attachment(filename: str) -> dict[str, str]:
    """The ``content-disposition`` header ``FileResponse`` sends for ``filename`` (a job id's)."""
    return {"content-disposition": f'attachment; filename="{filename}"'}


def _poll(state: ServerState) -> dict[str, str]:
    return {"openai-poll-after-ms": str(state.config.poll_after_ms)}
