"""The video job API: ``VideoJobs`` owns every video job, from its creation to its deletion.

A job is one engine request asking for an MP4 (``format="mp4"``), run by a task of its own
while the client polls.  Its ``status`` follows the request: ``queued`` while it waits in
the engine, ``in_progress`` from its send until its MP4 is here, then ``completed`` or
``failed`` (with OpenAI's error object); ``progress`` is read from the request's stage.
The job runs ``generate_video(..., fragmented=True)``: its fragmented MP4 is encoded while
the model decodes (from the frame parts a model emits, else from its final output), and its
bytes gather in the job's ``VideoSpool`` as they are made, so a GET of the content before
the job is completed streams them as they come (``VideoSpool.follow``).  Once whole, the
MP4 goes to the engine's file sink (written on a worker thread, never on the event loop)
and is kept until the job is deleted or ``keep_s`` after it ended (the file's ttl; the job
is forgotten with it); later GETs read that file.  ``DELETE`` at any stage aborts the
request (``abort(..., wait=True)``: nothing of it is left on a worker or in shared memory),
ends any stream of it unfinished, and forgets the job.  ``close`` (the server's shutdown)
aborts every job still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal

import attrs

from omni_async.core.engine_states import StageState
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput, VideoBytes
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.engine.sinks import OutputFile
from omni_async.serve.errors import ApiError, api_error, not_found
from omni_async.serve.models import RESERVED, ServedModel
from omni_async.serve.parsing import VideoCreation

__all__ = ["QuietBrokenStreams", "VideoJob", "VideoJobs", "VideoSpool", "VideoStreamBroken"]

log = logging.getLogger("omni_async.serve")

Status = Literal["queued", "in_progress", "completed", "failed"]

# How far along a request is, by the stage the engine has it in (the forward is most of it).
_PROGRESS: dict[StageState, int] = {
    StageState.WAITING: 0,
    StageState.SUBMITTED: 5,
    StageState.COMPUTING: 10,
    StageState.COMPUTED: 80,
    StageState.POSTPROCESSING: 90,
    StageState.RESOLVED: 99,
}


class VideoStreamBroken(Exception):
    """A streamed MP4 ended before it was whole: its job failed or was deleted.  Raised
    into the response's body, so the connection closes short of its end and the client
    sees a broken transfer, never a truncated file that looks whole."""


class QuietBrokenStreams(logging.Filter):
    """Drops the ASGI server's traceback for a ``VideoStreamBroken`` (the stream's end is
    logged once, as a warning, where it breaks off): install it on ``uvicorn.error``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], VideoStreamBroken))


class VideoSpool:
    """The bytes of a job's MP4 as its encoder makes them, in order, for every GET of the
    content that comes before the job is completed.  Written and read on the event loop."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._pieces: list[bytes] = []
        self._ended = False
        self._failure: str | None = None
        self._changed = asyncio.Event()

    def add(self, data: bytes) -> None:
        self._pieces.append(data)
        self._wake()

    def end(self, failure: str | None = None) -> None:
        """No more bytes: whole (``failure`` None), or broken off for ``failure``; the
        first call says which, later ones change nothing."""
        if not self._ended:
            self._ended, self._failure = True, failure
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # the next wait is for the next change

    async def follow(self) -> AsyncIterator[bytes]:
        """Every piece from the first, then each as it is made, until the MP4 is whole;
        ``VideoStreamBroken`` if it is broken off."""
        sent = 0
        while True:
            while sent < len(self._pieces):
                sent += 1
                yield self._pieces[sent - 1]
            if self._ended:
                if self._failure is not None:
                    log.warning("video %s: its content's stream broke off: %s", self.job_id, self._failure)
                    raise VideoStreamBroken(f"video {self.job_id}: {self._failure}")
                return
            await self._changed.wait()


@attrs.define
class VideoJob:
    """One video job: what was asked, where it is, and its MP4 once made."""

    id: str
    model: str
    prompt: str
    seconds: str
    size: str
    created_at: int
    status: Status = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, object] | None = None
    content: OutputFile | None = None
    spool: VideoSpool | None = attrs.field(default=None, repr=False)
    task: asyncio.Task[None] | None = attrs.field(default=None, repr=False)

    def as_json(self) -> dict[str, object]:
        """OpenAI's ``Video`` object."""
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "prompt": self.prompt,
            "seconds": self.seconds,
            "size": self.size,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "error": self.error,
            "remixed_from_video_id": None,
        }


class VideoJobs:
    """Every video job of the server (see the module docstring)."""

    def __init__(self, engine: AsyncDiffusionEngine, model: ServedModel, *, keep_s: float = 600.0) -> None:
        self._engine = engine
        self._model = model
        self._keep_s = keep_s
        self._jobs: dict[str, VideoJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    async def create(self, creation: VideoCreation) -> VideoJob:
        """Start a job; a refusal at the engine's door (a bad parameter, a full queue) raises
        its ``ApiError`` here, and no job is made."""
        self._sweep()
        job_id = f"video_{uuid.uuid4().hex}"
        try:
            request = DiffusionRequest(job_id, creation.params, format="mp4")
        except Exception as exc:
            raise api_error(exc, job_id, reserved=RESERVED) from exc
        job = VideoJob(
            id=job_id,
            model=self._model.name,
            prompt=creation.prompt,
            seconds=creation.seconds,
            size=creation.size,
            created_at=int(time.time()),
            spool=VideoSpool(job_id),
        )
        pieces = self._engine.generate_video(request, fragmented=True)
        first = asyncio.ensure_future(anext(pieces))
        # generate_video admits the request in its first step, before it awaits anything: one
        # pass of the loop and a refused request's step is already done with the refusal.
        await asyncio.sleep(0)
        refusal = first.exception() if first.done() else None
        if refusal is not None:
            await pieces.aclose()
            raise api_error(refusal, job_id, reserved=RESERVED) from refusal
        job.task = asyncio.create_task(self._follow(job, first, pieces), name=f"omni-serve-job-{job_id}")
        self._jobs[job_id] = job
        return job

    async def _follow(
        self,
        job: VideoJob,
        first: asyncio.Future[VideoBytes | GenerationResult],
        pieces: AsyncGenerator[VideoBytes | GenerationResult, None],
    ) -> None:
        spool = job.spool
        assert spool is not None
        failure: str | None = "the server stopped"  # unless it ends below
        try:
            async with contextlib.aclosing(pieces):
                piece = await first
                while isinstance(piece, VideoBytes):
                    spool.add(piece.data)
                    piece = await anext(pieces)
            output = piece.output
            if not isinstance(output, EncodedOutput):
                raise TypeError(f"job {job.id}: the engine returned no MP4 but {type(output).__name__}")
            # The whole MP4 into the file sink, off the loop; the spool's readers keep theirs.
            write = asyncio.ensure_future(asyncio.to_thread(self._engine.files.write, job.id, [output], self._keep_s))
            try:
                (job.content,) = await asyncio.shield(write)
            except asyncio.CancelledError:
                # Deleted while its file was written: the file goes as soon as it exists.
                write.add_done_callback(self._discard_written)
                raise
            job.status, job.progress = "completed", 100
            failure = None
        except asyncio.CancelledError:
            first.cancel()
            raise
        except Exception as exc:  # the job's outcome, told through its status
            err = api_error(exc, job.id, reserved=RESERVED)
            if self._jobs.get(job.id) is job:  # not aborted by its DELETE or the server's stop
                log.warning("video job %s failed: %s", job.id, err)
            job.status, job.error = "failed", {"code": err.code or "failed", "message": err.message}
            failure = f"it failed ({err.message})"
        finally:
            spool.end(failure)
            job.spool = None  # its bytes live on only in the streams still reading them
        now = int(time.time())
        job.completed_at = now
        job.expires_at = int(job.content.expires_at) if job.content is not None else now + int(self._keep_s)

    def _discard_written(self, write: asyncio.Future[tuple[OutputFile, ...]]) -> None:
        if not write.cancelled() and write.exception() is None and not self._engine.closed:
            for written in write.result():
                self._engine.files.delete(written.file_id)

    def get(self, job_id: str) -> VideoJob:
        """The job, its status and progress brought up to date; 404 when unknown or gone."""
        self._sweep()
        job = self._jobs.get(job_id)
        if job is None:
            raise not_found("video", job_id)
        if job.status in ("queued", "in_progress"):
            stage = self._engine.stage_of(job_id)
            if stage is not None:
                job.status = "queued" if stage is StageState.WAITING else "in_progress"
                job.progress = max(job.progress, _PROGRESS.get(stage, job.progress))
        return job

    def content(self, job_id: str) -> str | VideoSpool:
        """Where the job's MP4 is: the id of its file in the engine's file sink once it is
        completed, else the spool its bytes gather in as they are made (a GET streams from
        it); 400 once it failed."""
        job = self.get(job_id)
        if job.content is not None:
            return job.content.file_id
        if job.spool is None:
            raise ApiError(
                400, f"video {job_id} is {job.status}: it has no content", param="id", code="video_not_ready"
            )
        return job.spool

    async def delete(self, job_id: str) -> dict[str, object]:
        """Abort the job at whatever stage it is, wait until nothing of it is left, forget it."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise not_found("video", job_id)
        await self._stop(job, "its job was deleted")
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    async def _stop(self, job: VideoJob, why: str) -> None:
        if job.spool is not None:
            job.spool.end(why)  # a stream of it breaks off, saying why
        if job.task is not None and not job.task.done():
            if not self._engine.closed:
                await self._engine.abort(job.id, wait=True)
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        if job.content is not None and not self._engine.closed:
            self._engine.files.delete(job.content.file_id)  # the unlink runs on the engine's sweeper
        job.content = None

    async def close(self) -> None:
        """Abort every job still running (the server stops)."""
        jobs, self._jobs = list(self._jobs.values()), {}
        await asyncio.gather(*(self._stop(j, "the server stopped") for j in jobs), return_exceptions=True)

    def _sweep(self) -> None:
        now = time.time()
        for job_id in [j.id for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]:
            del self._jobs[job_id]
