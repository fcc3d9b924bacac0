"""An HTTP server on loopback written on bare sockets: it answers whatever bytes a test tells
it to, at whatever pace — what no well-behaved framework would send (a body a byte at a
time, a compressed bomb, a header no client may send back)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


async def _request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + (await reader.readexactly(length) if length else b"")


@asynccontextmanager
async def raw_http(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """``(base URL, the requests read so far)``; ``answer`` writes each request's answer."""
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _request(reader)
                requests.append(request)
                await answer(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/", requests
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
