"""A TCP proxy on loopback in front of a real Redis, that can lose one connection's answers.

Redis behind it keeps the connection: it reads what the client sends and runs it, and its
answers go nowhere — no FIN, no RST reaches either side. That is what a half-open
connection through a partition (or a NAT entry dropped under a long blocking read) looks
like to both: the client waits for an answer, and Redis has done the work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc


class PartitionProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._marker: bytes | None = None
        self.cut = anyio.Event()  # set once a connection's answers are lost

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def lose_answer_with(self, marker: bytes) -> None:
        """The first answer from Redis that holds ``marker`` (on any connection) is dropped,
        and everything after it on that connection: Redis did what was asked, and the client
        never hears of it."""
        self._marker = marker
        self.cut = anyio.Event()

    async def _serve(self, client: anyio.abc.SocketStream) -> None:
        lost = False

        async def up(redis: anyio.abc.SocketStream) -> None:
            async for chunk in client:
                await redis.send(chunk)

        async def down(redis: anyio.abc.SocketStream) -> None:
            nonlocal lost
            tail = b""  # the end of the last chunk: a marker may straddle two
            async for chunk in redis:
                marker = self._marker
                if not lost and marker is not None and marker in tail + chunk:
                    self._marker, lost = None, True
                    self.cut.set()
                if not lost:
                    await client.send(chunk)
                tail = chunk[-len(marker) :] if marker else b""

        async def pipe(tg: anyio.abc.TaskGroup, one_way: Any, redis: Any) -> None:
            try:
                await one_way(redis)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            tg.cancel_scope.cancel()  # one side went away: the other goes too

        async with client, await anyio.connect_tcp("127.0.0.1", self.upstream_port) as redis:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipe, tg, up, redis)
                tg.start_soon(pipe, tg, down, redis)


@asynccontextmanager
async def partition_proxy(upstream_port: int) -> AsyncIterator[PartitionProxy]:
    """A :class:`PartitionProxy` serving on a free loopback port until the block ends."""
    proxy = PartitionProxy(upstream_port)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    proxy.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, proxy._serve)
        try:
            yield proxy
        finally:
            tg.cancel_scope.cancel()
