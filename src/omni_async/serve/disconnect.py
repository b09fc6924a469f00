"""A request's work bound to its client: the client leaves, the work is cancelled.

An ASGI server does not cancel a handler whose client went away (uvicorn answers
``http.disconnect`` on ``receive`` instead), and an engine request left running for nobody
holds a running slot and its outputs' memory.  ``until_disconnect`` runs the work beside a
watch on ``receive``: whichever ends first wins, and cancelling the work cancels the engine
call, which aborts the request and releases everything of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

__all__ = ["ClientGone", "until_disconnect"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready: its work was cancelled."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ``ClientGone`` once the client has left (``work`` cancelled and
    awaited: the engine's release has begun when this raises).  Call after the body is read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone(f"{request.method} {request.url.path}: the client disconnected; its request was cancelled")
    finally:
        watch.cancel()
        if not task.done():  # this handler itself was cancelled (a forced shutdown)
            task.cancel()
