"""Blocking stream reads on a dedicated connection.

A blocked ``XREADGROUP`` holds its connection for the whole block time, so each consuming
loop owns one :class:`GroupReader` rather than borrowing from a shared pool. Replies are
parsed from raw RESP into ``(entry_id, fields)`` pairs with ``str`` keys and ``bytes`` values.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import anyio

from .cluster_map import REDIRECT_CODES
from .errors import RedisReplyError, RedisUnavailable
from .resp import RespConnection


class Router(Protocol):
    """Where a key lives, on a cluster (:class:`~broker.cluster_pipeliner.ClusterPipeliner`)."""

    def url_for_key(self, key: str) -> str: ...

    def mark_stale(self) -> None: ...

    async def refresh_soon(self) -> None: ...

    @property
    def stale(self) -> bool: ...

    async def refresh(self) -> None: ...


StreamEntry = tuple[str, dict[str, bytes]]
RawEntry = tuple[str, list[bytes]]

log = logging.getLogger("agent_reach.streams")


READ_SILENCE_S = 10.0


class GroupReader:
    """Reads of one consuming loop, on a connection of its own (opened on first use, and
    again after a failure). A lost connection raises :class:`RedisUnavailable`; an error
    reply is raised as the :class:`~broker.errors.RedisReplyError` it is — except
    ``NOGROUP``: the stream or its group is gone (deleted, or lost by a Redis that restarted
    without its last writes), so the group is created again at id 0 and the read repeated
    once. Every consuming loop rests on this one rule: none stops, or spins, on a lost
    group."""

    def __init__(
        self, url: str, route: Router | None = None, *, silence_s: float = READ_SILENCE_S
    ) -> None:
        self._url = url
        self._route = route
        self._silence_s = silence_s  # past a blocking read's block: Redis is taken as lost
        self._conn: RespConnection | None = None
        self._conn_url = url

    async def read(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int,
        block_ms: int | None,
        pending: bool = False,
    ) -> list[StreamEntry]:
        """New entries (``>``), or this consumer's own pending ones when ``pending``."""
        raw = await self.read_raw(
            stream, group, consumer, count=count, block_ms=block_ms, pending=pending
        )
        return [(entry_id, fields_of(flat)) for entry_id, flat in raw]

    async def read_raw(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int,
        block_ms: int | None,
        pending: bool = False,
    ) -> list[RawEntry]:
        """As :meth:`read`, the fields as Redis gave them: a flat list of name, value bytes
        (a name may repeat; nothing is decoded)."""
        command: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block_ms is not None:
            command += ["BLOCK", block_ms]
        command += ["STREAMS", stream, "0" if pending else ">"]
        try:
            reply = await self._execute(tuple(command), stream, block_ms)
        except RedisReplyError as exc:
            if exc.code != "NOGROUP":
                raise
            log.warning("group %s on %s is gone: creating it again", group, stream)
            await self._create_group(stream, group)
            reply = await self._execute(tuple(command), stream, block_ms)
        return raw_entries(reply[0][1]) if reply else []

    async def _create_group(self, stream: str, group: str) -> None:
        try:
            await self._execute(("XGROUP", "CREATE", stream, group, "0", "MKSTREAM"), stream)
        except RedisReplyError as exc:
            if exc.code != "BUSYGROUP":  # another consumer got there first: as good
                raise

    async def read_stream(
        self, stream: str, after: str, *, count: int = 1000, block_ms: int | None = None
    ) -> list[StreamEntry]:
        """Entries after ``after`` (plain ``XREAD``, no group): for reply streams."""
        command: list[Any] = ["XREAD", "COUNT", count]
        if block_ms is not None:
            command += ["BLOCK", block_ms]
        command += ["STREAMS", stream, after]
        return parse_read_reply(await self._execute(tuple(command), stream, block_ms))

    async def _execute(
        self, command: tuple[Any, ...], stream: str, block_ms: int | None = None
    ) -> Any:
        """On a cluster: on the connection to the master of ``stream``; a ``MOVED`` reply
        has the slot map read again and the command sent once more, there. A map marked stale
        (this reader or another lost a node) is read again first: a reader alone in its
        process (``events --follow``) would otherwise dial a failed master for ever."""
        if self._route is not None and self._route.stale:
            await self._route.refresh()
        try:
            reply = await self._execute_at(command, self._url_for(stream), block_ms)
        except RedisUnavailable:
            if self._route is not None:
                self._route.mark_stale()  # a failover, perhaps: the map is read again
            raise
        except RedisReplyError as exc:
            if self._route is None or exc.code not in REDIRECT_CODES:
                raise
            # the slot moved: read the map again, and try once more where it says; a slot
            # still moving (ASK, or MOVED again) is "not now": the reading loop backs off
            await self._route.refresh_soon()
            try:
                reply = await self._execute_at(command, self._url_for(stream), block_ms)
            except RedisReplyError as again:
                if again.code not in REDIRECT_CODES:
                    raise
                raise RedisUnavailable(f"redis unavailable: {again}", code=again.code) from again
        return reply

    def _url_for(self, stream: str) -> str:
        return self._route.url_for_key(stream) if self._route is not None else self._url

    async def read_then_run(
        self, stream: str, after: str, block_ms: int, command: tuple[Any, ...]
    ) -> tuple[Any, Any]:
        """A blocking ``XREAD`` of ``stream`` past ``after`` and ``command``, in one write:
        Redis runs ``command`` as soon as an entry comes past ``after`` (or the block ends),
        and both answers come back together — one wake-up, where a blocking read and then a
        command take two. Both answers, error replies in place: ``command`` runs whether the
        read failed or not, so its answer counts either way. Single server only."""
        assert self._route is None
        xread = ("XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", stream, after)
        read, reply = await self._execute_all([xread, command], self._url, block_ms)
        return read, reply

    async def connect(self) -> None:
        """Open this reader's connection now, where it is not open (single server): a caller
        that must tell a Redis it could not reach from a call that went out calls this
        first (:class:`RedisUnavailable` either way)."""
        assert self._route is None
        if self._conn is None:
            self._conn = await RespConnection.open(self._url)
            self._conn_url = self._url

    async def _execute_at(self, command: tuple[Any, ...], url: str, block_ms: int | None) -> Any:
        (reply,) = await self._execute_all([command], url, block_ms)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _execute_all(
        self, commands: list[tuple[Any, ...]], url: str, block_ms: int | None
    ) -> list[Any]:
        """``commands`` in one write on this reader's connection; ``block_ms``: the block
        time of a blocking read among them (given, never read back out of the commands,
        whose names and ids may be any word, ``BLOCK`` too)."""
        if self._conn is not None and self._conn_url != url:
            await self.close()
        try:
            if self._conn is None:
                self._conn = await RespConnection.open(url)
                self._conn_url = url
            # a blocking read may take its block time; only silence beyond that is a failure
            timeout_s = 30.0 if block_ms is None else block_ms / 1000 + self._silence_s
            return await self._conn.execute(commands, timeout_s=timeout_s)
        except BaseException:  # RedisUnavailable, or cancelled mid-read: out of step either way
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with anyio.CancelScope(shield=True):
                await conn.close()


def parse_read_reply(reply: Any) -> list[StreamEntry]:
    if not reply:
        return []
    return parse_entries(reply[0][1])


def raw_entries(raw: Any) -> list[RawEntry]:
    """``[[id, [field, value, ...]], ...]`` as ``(id, flat fields)`` pairs, undecoded;
    entries deleted while pending (no fields, or on Redis 6.2's ``XAUTOCLAIM`` a bare nil)
    are left out."""
    return [(e[0].decode(), list(e[1])) for e in raw if e and e[1] is not None]


def parse_entries(raw: Any) -> list[StreamEntry]:
    """``[[id, [field, value, ...]], ...]`` (XRANGE, XAUTOCLAIM) as ``(id, fields)`` pairs;
    entries deleted while pending come back without fields and are skipped.

    Never raises on what a producer wrote: a field name that is not UTF-8 is kept with its
    undecodable bytes as surrogates (``field_bytes`` gives them back), so the entry's reader
    can refuse it with a reason instead of crashing; a repeated name keeps its last value."""
    return [(entry_id, fields_of(flat)) for entry_id, flat in raw_entries(raw)]


def fields_of(flat: list[bytes]) -> dict[str, bytes]:
    """A flat ``[name, value, ...]`` as a dict (see :func:`parse_entries`)."""
    return {field_name(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def field_name(raw: bytes) -> str:
    """A stream field name as text; bytes that are not UTF-8 become surrogates."""
    return raw.decode("utf-8", "surrogateescape")


def field_bytes(name: str) -> bytes:
    """The original bytes of a field name :func:`field_name` decoded."""
    return name.encode("utf-8", "surrogateescape")


def id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``, or ``<ms>``) as what orders it."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
