"""``omni_async.serve``: the HTTP front door, an OpenAI-compatible server over the engine.

``omni-async serve --model tiny`` (``omni_async.cli.serve``) runs it; any OpenAI client
works unmodified: ``POST /v1/images/generations`` (``n`` as one batch, PNG/JPEG/WebP,
streamed partial images as server-sent events), the video job API (``/v1/videos``), ``GET
/v1/models``, ``GET /health`` (the engine's ``check_health``: its output path is alive),
``GET /metrics`` (the engine's Prometheus metrics and the HTTP requests').  Errors are
OpenAI's error objects with OpenAI's statuses (``errors``).

One module per concern: ``models`` (what is served and how OpenAI's fields map onto its
parameters), ``parsing`` (bodies to checked requests), ``images`` and ``videos`` (the
services over the engine), ``routes`` (thin HTTP handlers), ``errors``, ``disconnect`` (a
client that leaves cancels its work), ``httpmetrics``, ``app`` (the app and its lifespan,
which owns the engine) and ``server`` (uvicorn, the URL, signals).  It calls only the
engine's public face (``AsyncDiffusionEngine``); it needs the ``serve`` extra (FastAPI,
uvicorn, python-multipart) and ``prometheus-client``.
"""

from __future__ import annotations

from omni_async.serve.app import build_app, engine_for
from omni_async.serve.config import ServeConfig
from omni_async.serve.errors import ApiError
from omni_async.serve.models import ServedModel, served_model
from omni_async.serve.server import serve

__all__ = ["ApiError", "ServeConfig", "ServedModel", "build_app", "engine_for", "serve", "served_model"]
