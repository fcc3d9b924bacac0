"""Taking over stream entries a consumer read and never acknowledged: ``XAUTOCLAIM`` that
follows its cursor.

One ``XAUTOCLAIM`` claims at most ``COUNT`` entries idle past the given time, looks at no
more than ten times ``COUNT`` entries of the group's pending list, and answers with the id to
go on from. Started at ``0-0`` each time and called once a sweep, it took over one batch a
sweep however many a stopped consumer left (an event relay: 256 every 30 s), and never looked
past the first ten batches' worth of entries that live consumers hold. :class:`IdleClaim`
keeps the cursor from one call to the next, and :meth:`IdleClaim.sweep` claims batch after
batch until the pending list has been gone through once (or ``max_batches``: a sweep's work
stays bounded, and the next sweep goes on from where this one stopped).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .connection import Connection

START = "0-0"


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@dataclass(frozen=True, slots=True)
class Claimed:
    """One ``XAUTOCLAIM``'s answer: ``entries``, the claimed entries that still exist, as
    Redis sent them (``[id, [field, value, ...]]``; :func:`broker.streams.raw_entries` or
    ``parse_entries`` reads them), and ``gone``: the ids of entries deleted (trimmed) while
    pending, to acknowledge. Redis 7 names those apart and no longer keeps them pending;
    Redis 6.2 claims them and answers a bare nil in their place, so their ids are found in
    the pending list (:meth:`IdleClaim.batch`)."""

    entries: list[Any]
    gone: list[bytes]

    @property
    def ids(self) -> list[bytes]:
        """Every id claimed: the entries', then the deleted ones'."""
        return [entry[0] for entry in self.entries] + self.gone


class IdleClaim:
    def __init__(self, conn: Connection, stream: str, group: str, consumer: str) -> None:
        self.conn = conn
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.cursor = START

    async def batch(self, idle_ms: int, count: int) -> Claimed:
        """One ``XAUTOCLAIM`` from the cursor, which it moves on (back to ``0-0`` once the
        pending list has been gone through: :attr:`wrapped`)."""
        start = self.cursor
        reply = await self.conn.call(
            "XAUTOCLAIM", self.stream, self.group, self.consumer, idle_ms, start, "COUNT", count
        )
        self.cursor = _text(reply[0])
        listed = list(reply[1] or [])
        entries = [e for e in listed if e and e[1] is not None]
        gone = [e[0] for e in listed if e and e[1] is None]
        if len(reply) > 2:  # Redis 7: deleted, and no longer pending (acknowledging is harmless)
            gone += list(reply[2] or [])
        if not all(listed):  # Redis 6.2: a bare nil for each deleted one it claimed
            gone += await self._deleted(start, 10 * count, {e[0] for e in entries})
        return Claimed(entries, gone)

    async def _deleted(self, start: str, scanned: int, alive: set[bytes]) -> list[bytes]:
        """The ids this consumer now holds between ``start`` and the cursor (the stretch one
        ``XAUTOCLAIM`` looked at: at most ten times its count) whose entries are gone."""
        end = "+" if self.wrapped else "(" + self.cursor
        pending = await self.conn.call(
            "XPENDING", self.stream, self.group, start, end, scanned, self.consumer
        )
        unknown = [row[0] for row in pending if row[0] not in alive]
        found = await self.conn.call_many([("XRANGE", self.stream, i, i) for i in unknown])
        return [i for i, entries in zip(unknown, found, strict=True) if not entries]

    @property
    def wrapped(self) -> bool:
        """Whether the last call went through to the end of the pending list."""
        return self.cursor == START

    async def sweep(self, idle_ms: int, count: int, max_batches: int) -> AsyncIterator[Claimed]:
        """Batch after batch, from where the last sweep stopped, until the pending list has
        been gone through or ``max_batches`` were taken; the caller handles each before the
        next is claimed."""
        for _ in range(max_batches):
            yield await self.batch(idle_ms, count)
            if self.wrapped:
                return
