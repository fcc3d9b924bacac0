"""MCP servers built with the official ``mcp`` SDK (``MCPServer``, streamable HTTP), served on
loopback for the adapter's tests. Tools:

- ``add(a, b)`` (idempotent): ``{"result": a + b}``;
- ``whoami()`` (idempotent): what reached the tool of our ``_meta`` and headers;
- ``fail()``: raises a ``ToolError``;
- ``slow_read(key, seconds)`` (idempotent) and ``slow_write(key, seconds)`` (not): sleep, then
  answer; every start is counted by key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from adapters.asgi import serve_app
from broker.embedded import free_port

IDEMPOTENT = ToolAnnotations(idempotent_hint=True)
NOT_IDEMPOTENT = ToolAnnotations(idempotent_hint=False, destructive_hint=True)


@dataclass
class ToolLog:
    starts: Counter[str] = field(default_factory=Counter)  # key -> times a slow tool started
    running: int = 0


def mcp_server(log: ToolLog) -> MCPServer:
    server = MCPServer("reach-test", version="1.0", log_level="WARNING")

    @server.tool(annotations=IDEMPOTENT)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool(annotations=IDEMPOTENT)
    def whoami(ctx: Context) -> dict[str, str]:
        """What reached the tool."""
        meta = ctx.request_context.meta or {}
        headers = ctx.headers or {}
        return {
            "key": str(meta.get("agent-reach/idempotencyKey")),
            "message": str(meta.get("agent-reach/messageId")),
            "header": str(headers.get("x-reach-message-id")),
        }

    @server.tool(annotations=NOT_IDEMPOTENT)
    def fail() -> str:
        """Always fails."""
        raise ToolError("deliberate failure")

    async def slow(key: str, seconds: float) -> str:
        log.starts[key] += 1
        log.running += 1
        try:
            await anyio.sleep(seconds)
        finally:
            log.running -= 1
        return f"done {key}"

    @server.tool(annotations=IDEMPOTENT)
    async def slow_read(key: str, seconds: float) -> str:
        """Sleep, then answer (idempotent)."""
        return await slow(key, seconds)

    @server.tool(annotations=NOT_IDEMPOTENT)
    async def slow_write(key: str, seconds: float) -> str:
        """Sleep, then answer (not idempotent)."""
        return await slow(key, seconds)

    return server


@dataclass
class RunningServer:
    url: str
    log: ToolLog


@asynccontextmanager
async def mcp_http_server(
    *, port: int = 0, log: ToolLog | None = None
) -> AsyncIterator[RunningServer]:
    """An SDK-built MCP server at ``http://127.0.0.1:PORT/mcp`` for the block's life (``port``:
    the same one again, to restart a server that forgot its sessions)."""
    port = port or free_port()
    log = log or ToolLog()
    server = mcp_server(log)
    app = server.streamable_http_app()
    async with server.session_manager.run(), serve_app(app, "127.0.0.1", port):
        yield RunningServer(f"http://127.0.0.1:{port}/mcp", log)
