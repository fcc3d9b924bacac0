"""What the commands that only serve an endpoint share (``console``, ``a2a-gateway``): where
they listen, and serving until SIGINT / SIGTERM."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import click

from broker.config import Settings
from broker.connection import Connection

from ..runtime import connected, stop_on_signals
from .common import host_option, run

Opener = Callable[[AsyncExitStack, Connection], Awaitable[None]]


def listen_options(default_port: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--host`` (loopback by default) and ``--port``."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            "--port",
            type=click.IntRange(0, 65535),
            default=default_port,
            show_default=True,
            help="The port (0: any).",
        )(command)
        return host_option("--host", "The address to listen on.")(command)

    return decorate


def serve_endpoint(settings: Settings, open_endpoint: Opener) -> None:
    """Connect, open the endpoint, and serve until SIGINT / SIGTERM."""

    async def serve() -> None:
        async with connected(settings) as conn, AsyncExitStack() as stack:
            await open_endpoint(stack, conn)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_on_signals, tg.cancel_scope.cancel, tg.cancel_scope)

    run(serve)
