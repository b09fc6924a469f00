"""Running the app on uvicorn: bind, announce the URL once the engine is up, stop on a signal.

``serve(config, host, port)`` binds the socket itself (port 0: the system picks a free one,
and the URL says which), runs uvicorn on it and returns 0 once it has stopped.  SIGTERM
and SIGINT stop it gracefully: no new connection is taken, the requests in flight get
``graceful_s`` to end, then the lifespan's shutdown aborts the video jobs and closes the
engine (its worker processes exit and its shared memory is unlinked).  uvicorn on its own
would re-raise the signal after that, which makes the exit status the signal's; a clean
stop the operator asked for is exit 0 here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator

import uvicorn

from omni_async.serve.app import build_app
from omni_async.serve.config import ServeConfig
from omni_async.serve.videos import QuietBrokenStreams

__all__ = ["bind", "serve"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, whose signals stop it without being raised again afterwards."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, *, announce: Callable[[str], None] | None = None
) -> int:
    """Serve until SIGTERM/SIGINT; ``announce(url)`` once the engine is up and the socket
    takes requests (default: a line on stdout).  Returns 0 after a clean stop."""
    app = build_app(config)  # a bad setting fails here, before anything is bound
    sock = bind(host, port)
    url = _url(sock)
    say = announce if announce is not None else _print
    server = _Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=max(1, round(config.graceful_s)),
            access_log=False,
            lifespan="on",
        )
    )
    # (After uvicorn.Config, which sets up uvicorn's loggers.)
    logging.getLogger("uvicorn.error").addFilter(QuietBrokenStreams())

    async def main() -> None:
        running = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not running.done():
            await asyncio.sleep(0.02)
        if server.started:
            say(url)
        await running

    try:
        asyncio.run(main())
    finally:
        sock.close()
    return 0 if server.started else 1


def _print(url: str) -> None:
    print(f"omni-async serve: ready at {url} (stop with Ctrl-C or SIGTERM)", flush=True)
    sys.stdout.flush()
