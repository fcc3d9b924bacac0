"""Server-sent events read from an HTTP response (A2A streams, MCP answers)."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator

import httpx

MAX_EVENT_BYTES = 1024 * 1024
_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_data(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The ``data`` of each server-sent event, as bytes. Lines end at ``\r\n``, ``\n`` or
    ``\r`` (the three the format allows) only — JSON may hold U+2028 unescaped, which a text
    line splitter would cut at — and no line is kept past :data:`MAX_EVENT_BYTES`: an event
    that long is skipped (what it said, the task's own ``GetTask`` says)."""
    lines = _Lines()
    data: list[bytes] = []
    size, skipping = 0, False
    async for chunk in response.aiter_bytes():
        for line in lines.feed(chunk):
            if line is None:  # over the limit: its event is skipped
                skipping = True
                continue
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


class _Lines:
    """Lines out of chunks, each byte looked at once: only a new chunk is searched for its
    line ends (searching the whole unfinished line again at every chunk made a long line
    sent in small pieces cost the square of its length). A line past
    :data:`MAX_EVENT_BYTES` is not kept: it comes out as ``None`` when it ends."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._over = False  # the line under way passed the limit: its bytes are dropped
        self._after_cr = False  # the last chunk ended a line with \r: a \n first is its end

    def feed(self, chunk: bytes) -> list[bytes | None]:
        lines: list[bytes | None] = []
        start = 1 if self._after_cr and chunk[:1] == b"\n" else 0
        if chunk:
            self._after_cr = False
        for found in _LINE_END.finditer(chunk, start):
            end = found.start()
            if self._over or len(self._pending) + end - start > MAX_EVENT_BYTES:
                lines.append(None)
            else:
                self._pending += chunk[start:end]
                lines.append(bytes(self._pending))
            self._pending.clear()
            self._over = False
            start = found.end()
            # a \r that ends the chunk may be half of a \r\n: the next chunk tells
            self._after_cr = start == len(chunk) and found[0] == b"\r"
        if not self._over:
            self._pending += chunk[start:]
            if len(self._pending) > MAX_EVENT_BYTES:
                self._pending.clear()
                self._over = True
        return lines
