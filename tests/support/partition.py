"""A TCP proxy on loopback in front of a real Redis, that can lose one connection's answers,
or hold what a client sends until told to deliver it.

Redis behind it keeps the connection: it reads what the client sends and runs it, and its
answers go nowhere — no FIN, no RST reaches either side. That is what a half-open
connection through a partition (or a NAT entry dropped under a long blocking read) looks
like to both: the client waits for an answer, and Redis has done the work.

Held writes are the other half of a partition: bytes the client sent that reach Redis only
later, after the client gave up on them (its reset never reaches Redis either).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc


@dataclass
class HeldWrite:
    """What one client sent from a held write on, not yet given to Redis."""

    redis: anyio.abc.SocketStream
    chunks: list[bytes] = field(default_factory=list)
    delivered: bool = False

    async def deliver(self) -> None:
        """Redis gets it now, on the connection it came by (kept open since); from then on
        the connection carries both ways again, if its client is still there."""
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.delivered = True
        await self.redis.send(data)


class PartitionProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._marker: bytes | None = None
        self.cut = anyio.Event()  # set once a connection's answers are lost
        self._hold_marker = b""
        self._holds_left = 0
        self.held: list[HeldWrite] = []
        self.all_held = anyio.Event()  # set once the writes to hold are all held

    def hold_writes_with(self, marker: bytes, count: int) -> None:
        """The next ``count`` client writes that hold ``marker`` (each on a connection of
        its own) are held, with everything after them on their connection, until
        :meth:`HeldWrite.deliver`; nothing is answered meanwhile, and Redis keeps such a
        connection open after its client has gone (a partition: nothing reaches it)."""
        self._hold_marker, self._holds_left = marker, count
        self.all_held = anyio.Event()

    def _hold(self, redis: anyio.abc.SocketStream) -> HeldWrite:
        held = HeldWrite(redis)
        self.held.append(held)
        self._holds_left -= 1
        if not self._holds_left:
            self.all_held.set()
        return held

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
        async with client, await anyio.connect_tcp("127.0.0.1", self.upstream_port) as redis:
            await _Link(self, client, redis).run()


class _Link:
    """One client connection and its own connection to Redis, carried both ways."""

    def __init__(
        self, proxy: PartitionProxy, client: anyio.abc.SocketStream, redis: anyio.abc.SocketStream
    ) -> None:
        self.proxy, self.client, self.redis = proxy, client, redis
        self.lost = False  # Redis's answers go nowhere from now on
        self.held: HeldWrite | None = None

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pipe, tg, self._up)
            tg.start_soon(self._pipe, tg, self._down)

    async def _up(self) -> None:
        proxy, tail = self.proxy, b""  # the end of the last chunk: a marker may straddle two
        async for chunk in self.client:
            marker = proxy._hold_marker
            if self.held is None and proxy._holds_left and marker in tail + chunk:
                self.held = proxy._hold(self.redis)
            if self.held is not None and not self.held.delivered:
                self.held.chunks.append(chunk)
            else:
                await self.redis.send(chunk)
            tail = chunk[-len(marker) :] if marker else b""

    async def _down(self) -> None:
        proxy, tail = self.proxy, b""
        async for chunk in self.redis:
            marker = proxy._marker
            if not self.lost and marker is not None and marker in tail + chunk:
                proxy._marker, self.lost = None, True
                proxy.cut.set()
            if not self.lost and (self.held is None or self.held.delivered):
                await self.client.send(chunk)
            tail = chunk[-len(marker) :] if marker else b""

    async def _pipe(self, tg: anyio.abc.TaskGroup, one_way: Any) -> None:
        try:
            await one_way()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        if self.held is not None:  # Redis hears nothing of the client's going
            await anyio.sleep_forever()
        tg.cancel_scope.cancel()  # one side went away: the other goes too


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
