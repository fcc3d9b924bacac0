"""Server-sent events read from an HTTP response (A2A streams, MCP answers)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import httpx

MAX_EVENT_BYTES = 1024 * 1024


async def sse_data(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The ``data`` of each server-sent event, as bytes. Lines are split on ``\n`` (and
    ``\r``) only — JSON may hold U+2028 unescaped, which a text line splitter would cut at —
    and no line is kept past :data:`MAX_EVENT_BYTES`: an event that long is skipped (what it
    said, the task's own ``GetTask`` says)."""
    buffer = b""
    data: list[bytes] = []
    size, skipping = 0, False
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if len(buffer) > MAX_EVENT_BYTES:
            buffer, skipping = b"", True
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line.startswith(b"data:"):
                size += len(line)
                skipping = skipping or size > MAX_EVENT_BYTES
                if not skipping:
                    data.append(line[5:].lstrip(b" "))
                continue
            if line:
                continue  # a comment, or an event's name
            if data and not skipping:
                yield b"\n".join(data)
            data, size, skipping = [], 0, False
