"""The video job API: ``VideoJobs`` owns every video job, from its creation to its deletion.

A job is one engine request asking for an MP4 (``format="mp4"``), run by a task of its own
while the client polls.  Its ``status`` follows the request: ``queued`` while it waits in
the engine, ``in_progress`` from its send until its MP4 is here, then ``completed`` or
``failed`` (with OpenAI's error object); ``progress`` is read from the request's stage.
The MP4 goes to the engine's file sink (written on a post-processing thread, never on the
event loop) and is kept until the job is deleted or ``keep_s`` after it ended (the file's
ttl; the job is forgotten with it); ``DELETE`` at any stage aborts the request
(``abort(..., wait=True)``: nothing of it is left on a worker or in shared memory) and
forgets the job.  ``close`` (the server's shutdown) aborts every job still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Literal

import attrs

from omni_async.core.engine_states import StageState
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.sinks import OutputFile
from omni_async.serve.errors import ApiError, api_error, not_found
from omni_async.serve.models import RESERVED, ServedModel
from omni_async.serve.parsing import VideoCreation

__all__ = ["VideoJob", "VideoJobs"]

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
            request = DiffusionRequest(job_id, creation.params, format="mp4", sink="file", sink_ttl_s=self._keep_s)
        except Exception as exc:
            raise api_error(exc, job_id, reserved=RESERVED) from exc
        job = VideoJob(
            id=job_id,
            model=self._model.name,
            prompt=creation.prompt,
            seconds=creation.seconds,
            size=creation.size,
            created_at=int(time.time()),
        )
        task = asyncio.create_task(self._engine.generate(request), name=f"omni-serve-{job_id}")
        # generate admits the request in its first step, before it awaits anything: one
        # pass of the loop and a refused request's task is already done with the refusal.
        await asyncio.sleep(0)
        refusal = task.exception() if task.done() else None
        if refusal is not None:
            raise api_error(refusal, job_id, reserved=RESERVED) from refusal
        job.task = asyncio.create_task(self._follow(job, task), name=f"omni-serve-job-{job_id}")
        self._jobs[job_id] = job
        return job

    async def _follow(self, job: VideoJob, task: asyncio.Task[object]) -> None:
        try:
            result = await task
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:  # the job's outcome, told through its status
            err = api_error(exc, job.id, reserved=RESERVED)
            log.warning("video job %s failed: %s", job.id, err)
            job.status, job.error = "failed", {"code": err.code or "failed", "message": err.message}
        else:
            output = getattr(result, "output", None)
            if isinstance(output, OutputFile):
                job.content, job.status, job.progress = output, "completed", 100
            else:
                job.status = "failed"
                job.error = {"code": "internal_error", "message": f"job {job.id}: the engine returned no MP4 file"}
        now = int(time.time())
        job.completed_at = now
        job.expires_at = int(job.content.expires_at) if job.content is not None else now + int(self._keep_s)

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

    def content(self, job_id: str) -> str:
        """The id of the job's MP4 in the engine's file sink (409 until it is completed)."""
        job = self.get(job_id)
        if job.content is None:
            raise ApiError(
                409 if job.status != "failed" else 400,
                f"video {job_id} is {job.status}: its content is there once it is completed",
                param="id",
                code="video_not_ready",
            )
        return job.content.file_id

    async def delete(self, job_id: str) -> dict[str, object]:
        """Abort the job at whatever stage it is, wait until nothing of it is left, forget it."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise not_found("video", job_id)
        await self._stop(job)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    async def _stop(self, job: VideoJob) -> None:
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
        await asyncio.gather(*(self._stop(j) for j in jobs), return_exceptions=True)

    def _sweep(self) -> None:
        now = time.time()
        for job_id in [j.id for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]:
            del self._jobs[job_id]
