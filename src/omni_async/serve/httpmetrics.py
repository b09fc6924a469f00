"""The server's own Prometheus metrics: HTTP requests by route, method and status, and their latency.

``HttpMetrics`` keeps them in a ``CollectorRegistry`` of its own (as the engine does: two
servers in one process never collide), and is an ASGI middleware that counts every
request.  Routes are labelled by their template (``/v1/videos/{video_id}``), never the
raw path, so an id does not make a new series; a path no route matches is ``other``.
``/metrics`` serves ``exposition`` of both registries (the engine's and this one).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HTTP_BUCKETS", "HttpMetrics", "MetricsMiddleware", "exposition"]

# From a /health probe (sub-millisecond) to a video job's download.
HTTP_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip


class HttpMetrics:
    """The HTTP series (``MetricsMiddleware`` fills them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "omni_async_http_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "omni_async_http_request_seconds",
            "HTTP request latency, from the request's arrival to the end of its response, by route and method",
            ["route", "method"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )


class MetricsMiddleware:
    """ASGI middleware counting and timing every HTTP request into ``metrics`` (outermost:
    it sees every status, the error handlers' included)."""

    def __init__(self, app: ASGIApp, *, metrics: HttpMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500  # a response that never started: the app failed, or the client left
        t0 = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, sending)
        finally:
            template = getattr(scope.get("route"), "path", None) or "other"
            method = str(scope.get("method", ""))
            self._metrics.requests.labels(template, method, str(status)).inc()
            self._metrics.latency.labels(template, method).observe(time.perf_counter() - t0)


def exposition(registries: Iterable[CollectorRegistry]) -> bytes:
    """The text format of every registry, one after the other (each family is named once)."""
    return b"".join(generate_latest(r) for r in registries)
