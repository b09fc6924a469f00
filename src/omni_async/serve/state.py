"""``ServerState``: what the routes reach, composed once per app."""

from __future__ import annotations

import attrs

from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.serve.config import ServeConfig
from omni_async.serve.httpmetrics import HttpMetrics
from omni_async.serve.images import ImageService
from omni_async.serve.models import ServedModel
from omni_async.serve.videos import VideoJobs

__all__ = ["ServerState"]


@attrs.frozen
class ServerState:
    """The engine and the services over it (each owns its own state; none reaches back here)."""

    config: ServeConfig
    engine: AsyncDiffusionEngine
    images: ImageService
    videos: VideoJobs
    http: HttpMetrics

    @property
    def model(self) -> ServedModel:
        return self.config.model

    @classmethod
    def build(cls, config: ServeConfig, engine: AsyncDiffusionEngine) -> ServerState:
        return cls(
            config=config,
            engine=engine,
            images=ImageService(engine),
            videos=VideoJobs(engine, config.model, keep_s=config.video_keep_s),
            http=HttpMetrics(),
        )
