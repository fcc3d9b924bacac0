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


@dataclass(frozen=True, slots=True)
class Claimed:
    """One ``XAUTOCLAIM``'s answer: ``entries`` as Redis sent them (``[id, [field, value,
    ...]]``; :func:`broker.streams.raw_entries` or ``parse_entries`` reads them) and ``gone``:
    the ids of entries deleted while pending, which Redis 6.2 names without fields and leaves
    pending until they are acknowledged (Redis 7 drops them itself)."""

    entries: list[Any]
    gone: list[bytes]

    @property
    def ids(self) -> list[bytes]:
        """Every id claimed, the deleted ones included."""
        return [entry[0] for entry in self.entries if entry]


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
        reply = await self.conn.call(
            "XAUTOCLAIM", self.stream, self.group, self.consumer, idle_ms, self.cursor,
            "COUNT", count,
        )  # fmt: skip
        cursor = reply[0]
        self.cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        entries = list(reply[1] or [])
        return Claimed(entries, [e[0] for e in entries if e and not e[1]])

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
