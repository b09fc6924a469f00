"""``build_app``: the FastAPI app of ``omni-async serve``, owning its engine's life.

The engine runs on the server's event loop: the app's lifespan starts it (its executor's
worker processes spawn off the loop) before the first request and, at shutdown, aborts the
video jobs still running and closes it, so that when the server returns no worker process
and no shared-memory segment of it is left.  ``engine_for`` builds the engine a
``ServeConfig`` describes (worker processes over the model's ``WorkerSpec``; its file sink
in a private directory the engine removes at close).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.serve.config import ServeConfig
from omni_async.serve.errors import ApiError
from omni_async.serve.httpmetrics import MetricsMiddleware
from omni_async.serve.routes import router
from omni_async.serve.state import ServerState
from omni_async.serve.videos import VideoStreamBroken

__all__ = ["build_app", "engine_for"]

log = logging.getLogger("omni_async.serve")


def engine_for(config: ServeConfig) -> AsyncDiffusionEngine:
    """An engine over worker processes running ``config.model`` (built at its start)."""
    spec, options, held = config.model.spec, config.worker_options(), config.max_held_outputs

    def executor() -> MultiprocDiffusionExecutor:
        return MultiprocDiffusionExecutor(spec, options=options, max_held_outputs=held)

    return AsyncDiffusionEngine.from_factory(
        executor,
        max_waiting=config.max_waiting,
        max_batch_size=config.max_batch_size,
        max_running=config.max_running,
        encode_workers=config.encode_workers,
        output_ttl_s=config.output_ttl_s,
    )


def build_app(config: ServeConfig, engine: AsyncDiffusionEngine | None = None) -> FastAPI:
    """The app serving ``config.model`` through ``engine`` (default: ``engine_for(config)``),
    which the app starts and closes with its lifespan."""
    state = ServerState.build(config, engine if engine is not None else engine_for(config))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.engine.start()
        try:
            yield
        finally:
            await state.videos.close()
            await state.engine.close()

    app = FastAPI(title="omni_async", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.include_router(router(state))

    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=dict(exc.headers))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code="not_found")
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        rid = f"req_{uuid.uuid4().hex}"
        if not isinstance(exc, VideoStreamBroken):  # that one is told where it breaks off
            log.exception("%s %s failed (%s)", request.method, request.url.path, rid, exc_info=exc)
        err = ApiError(500, f"internal error ({rid}): {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_middleware(MetricsMiddleware, metrics=state.http)
    return app
