"""A lean RESP connection for pipelined commands: hiredis packs and parses, nothing else.

The coalescing pipeliner sends hundreds of short commands per round trip; through redis-py's
pipeline each reply costs a timeout context and a response callback, which profiled as the
largest cost of the dispatch path. This connection writes one packed buffer and reads the
replies straight out of a hiredis reader. Replies are raw RESP values (bytes, ints, lists;
errors as :class:`redis.exceptions.ResponseError` instances, not raised).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any
from urllib.parse import unquote, urlparse

import hiredis
from redis.exceptions import NoScriptError, ResponseError

from .errors import RedisUnavailable

Command = tuple[Any, ...]
_READ_CHUNK = 1 << 16


# Error replies that mean "Redis cannot serve now" (loading its AOF, over maxmemory, a
# script running, a replica or a cluster in failover): retry later, like a lost connection.
TRANSIENT = frozenset(
    {"LOADING", "BUSY", "OOM", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"}
)


def _error(message: str) -> Exception:
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    if message.split(" ", 1)[0] in TRANSIENT:  # the error code, exactly (not BUSYGROUP)
        return RedisUnavailable(f"redis unavailable: {message}")
    return ResponseError(message)


class RespConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stream = reader
        self._writer = writer
        self._parser = hiredis.Reader(replyError=_error)

    @classmethod
    async def open(cls, url: str, *, timeout_s: float = 10.0) -> RespConnection:
        """Connect to ``redis://``, ``rediss://`` or ``unix://`` URLs, with AUTH and SELECT."""
        parts = urlparse(url)
        try:
            async with asyncio.timeout(timeout_s):
                if parts.scheme == "unix":
                    reader, writer = await asyncio.open_unix_connection(parts.path)
                else:
                    context = ssl.create_default_context() if parts.scheme == "rediss" else None
                    reader, writer = await asyncio.open_connection(
                        parts.hostname or "127.0.0.1", parts.port or 6379, ssl=context
                    )
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable(
                f"cannot connect to {parts.hostname}:{parts.port}: {exc}"
            ) from exc
        conn = cls(reader, writer)
        setup: list[Command] = []
        if parts.password:
            user = unquote(parts.username) if parts.username else None
            password = unquote(parts.password)
            setup.append(("AUTH", user, password) if user else ("AUTH", password))
        db = parts.path.strip("/") if parts.scheme != "unix" else ""
        if db and db != "0":
            setup.append(("SELECT", db))
        for reply in await conn.execute(setup) if setup else []:
            if isinstance(reply, ResponseError):
                await conn.close()
                raise RedisUnavailable(f"redis refused the connection set-up: {reply}")
        return conn

    async def execute(self, commands: list[Command], *, timeout_s: float = 30.0) -> list[Any]:
        """Send every command in one write and return their replies in order. A silent peer
        (a partition: no FIN, no RST) fails after ``timeout_s`` instead of hanging forever;
        the caller must then drop this connection."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._execute(commands)
        except TimeoutError as exc:
            raise RedisUnavailable(f"redis did not answer within {timeout_s:g} s") from exc

    async def _execute(self, commands: list[Command]) -> list[Any]:
        self._writer.write(b"".join(hiredis.pack_command(c) for c in commands))
        await self._writer.drain()
        replies: list[Any] = []
        parser = self._parser
        while len(replies) < len(commands):
            reply = parser.gets()
            if reply is False:
                data = await self._stream.read(_READ_CHUNK)
                if not data:
                    raise ConnectionError("redis closed the connection")
                parser.feed(data)
                continue
            replies.append(reply)
        return replies

    async def read_one(self) -> Any:
        """The next reply or push message (for a subscribed connection)."""
        while (reply := self._parser.gets()) is False:
            data = await self._stream.read(_READ_CHUNK)
            if not data:
                raise ConnectionError("redis closed the connection")
            self._parser.feed(data)
        return reply

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass
