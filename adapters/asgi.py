"""Serving a small ASGI app (Starlette) with uvicorn inside the caller's event loop."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import uvicorn
from starlette.types import ASGIApp


@asynccontextmanager
async def serve_app(app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn in this event loop; yields its URL (``port`` 0: any)."""
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and accepted sockets inherit it. Without it, a response written in two parts waits on
    # the client's delayed ACK: 40 ms a call.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=3
        )
    )

    async def serve() -> None:
        # Shielded: cancelled, uvicorn would leave its listener in the event loop's selector
        # and the next server on that port (a restart) would never see its connections.
        # It stops on `should_exit` instead, closing its listener and connections.
        with anyio.CancelScope(shield=True):
            await server.serve(sockets=[sock])

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        try:
            with anyio.fail_after(10):
                while not server.started:  # noqa: ASYNC110 - uvicorn offers no started event
                    await anyio.sleep(0.01)
            yield f"http://{host}:{bound}/"
        finally:
            server.should_exit = True
