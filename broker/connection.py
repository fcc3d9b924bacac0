"""Redis connections: one explicitly sized pool per process, scripts loaded, commands coalesced.

Every blocking ``XREADGROUP`` holds a pooled connection for its whole block time, so the pool
is a :class:`~redis.asyncio.BlockingConnectionPool` sized from settings: when exhausted it
waits for a free connection instead of failing at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import anyio
import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection as RedisConnectionBase
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .config import Settings
from .errors import RedisUnavailable
from .keyspace import Keyspace
from .pipeliner import Pipeliner
from .scripts import Script, ScriptName, load_scripts
from .streams import GroupReader

T = TypeVar("T")


class PackedConnection(RedisConnectionBase):
    """A connection that packs commands with hiredis' C packer instead of redis-py's Python one
    (the single largest cost per command in a profile of the dispatch path)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:
            args = (*args[0].split(), *args[1:])
        return [hiredis.pack_command(args)]


def make_client(url: str, *, pool_size: int) -> Redis:
    pool = BlockingConnectionPool.from_url(
        url, max_connections=pool_size, timeout=30, connection_class=PackedConnection
    )
    return Redis.from_pool(pool)


@dataclass(slots=True)
class Connection:
    """What every store shares: the client, the coalescing pipeliner, scripts and key names."""

    redis: Redis
    pipeliner: Pipeliner
    scripts: dict[ScriptName, Script]
    keys: Keyspace
    settings: Settings
    url: str

    async def call(self, *command: Any) -> Any:
        """One command through the pipeliner (raw RESP reply); failures raise
        :class:`RedisUnavailable`, error replies :class:`redis.exceptions.ResponseError`."""
        return await self.pipeliner.call(*command)

    async def evalsha(self, name: ScriptName, keys: tuple[str, ...], args: Any) -> Any:
        return await self.pipeliner.call("EVALSHA", self.scripts[name].sha, len(keys), *keys, *args)

    async def call_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Commands that leave together, in order; error replies come back in place."""
        return await self.pipeliner.call_many(commands)

    def sha(self, name: ScriptName) -> str:
        return self.scripts[name].sha

    def script_command(self, name: ScriptName, keys: tuple[str, ...], args: Any) -> tuple[Any, ...]:
        return ("EVALSHA", self.scripts[name].sha, len(keys), *keys, *args)

    @asynccontextmanager
    async def reader(self) -> AsyncIterator[GroupReader]:
        """A dedicated connection for one blocking consumer loop."""
        reader = GroupReader(self.url)
        try:
            yield reader
        finally:
            await reader.close()


async def translate(awaitable: Awaitable[T]) -> T:
    """Await a direct Redis call, turning connection failures into :class:`RedisUnavailable`."""
    try:
        return await awaitable
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise RedisUnavailable(f"redis unavailable: {exc}") from exc


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


@asynccontextmanager
async def open_connection(settings: Settings, url: str) -> AsyncIterator[Connection]:
    """Connect, check the server, load the scripts and run the pipeliner for the block's life."""
    redis = make_client(url, pool_size=settings.redis_pool_size)
    scripts = load_scripts()
    try:
        try:
            await translate(redis.ping())
        except RedisUnavailable as exc:
            where = redact(url)
            raise RedisUnavailable(f"cannot connect to redis at {where}: {exc.__cause__}") from exc
        for script in scripts.values():
            await translate(redis.script_load(script.source))
        pipeliner = Pipeliner(url, list(scripts.values()))
        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)
            yield Connection(redis, pipeliner, scripts, Keyspace(settings.prefix), settings, url)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await redis.aclose()


async def ensure_group(conn: Connection, stream: str, group: str) -> None:
    """Create a consumer group at id 0 (never ``$``: nothing published meanwhile is skipped).

    ``BUSYGROUP`` (the group exists) is the one error expected here, and handled by name."""
    try:
        await conn.call("XGROUP", "CREATE", stream, group, "0", "MKSTREAM")
    except ResponseError as exc:
        if not str(exc).startswith("BUSYGROUP"):
            raise RedisUnavailable(f"cannot create group {group} on {stream}: {exc}") from exc
