"""The reaper's clock, ``P:due``: every live message's next deadline, claimed under a lease.

With ``ingress_partitions`` > 1 the clock is as many sorted sets (``P:due``, ``P:due:{1}``, …:
:func:`~broker.keyspace.due_for` picks a message's by its id), each claimed by every reaper."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .connection import Connection
from .keyspace import Keyspace, due_for, due_sets
from .record_codec import text
from .scripts import ScriptName


def due_command(keys: Keyspace, message_id: str, deadline_ms: int) -> tuple[Any, ...]:
    """Set a message's next deadline in the reaper's clock (``P:due``), which indexes
    every live message."""
    return ("ZADD", due_for(keys, message_id), deadline_ms, message_id)


def due_at_most_command(keys: Keyspace, message_id: str, at_ms: int) -> tuple[Any, ...]:
    """Bring a message's next deadline forward to ``at_ms`` (never later): the delivery
    timeout of an assignment, say, comes before the message's own deadline."""
    return ("ZADD", due_for(keys, message_id), "LT", at_ms, message_id)


class DueClock:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def claim(self, now: int, lease_ms: int, count: int) -> list[str]:
        """The messages whose next deadline has come, claimed for ``lease_ms`` (see
        ``lua/claim_due.lua``): no other reaper sees them until this one reschedules them.
        Up to ``count`` from each partition of the due set."""
        commands = [
            self.conn.script_command(ScriptName.CLAIM_DUE, (due,), (now, lease_ms, count))
            for due in due_sets(self.conn.keys)
        ]
        claimed: list[str] = []
        for reply in await self.conn.call_many(commands):
            if isinstance(reply, Exception):
                raise reply
            claimed += [text(i) for i in reply]
        return claimed

    async def reschedule(self, lease_score: int, verdicts: list[tuple[str, int | None]]) -> int:
        """Write each leased message's next look (``None``: it ended, forget it), only where
        the lease still stands (see ``lua/reschedule_due.lua``), in its own partition."""
        if not verdicts:
            return 0
        by_set: dict[str, list[Any]] = defaultdict(lambda: [lease_score])
        for message_id, next_ms in verdicts:
            by_set[due_for(self.conn.keys, message_id)] += [
                message_id,
                "" if next_ms is None else next_ms,
            ]
        commands = [
            self.conn.script_command(ScriptName.RESCHEDULE_DUE, (due,), args)
            for due, args in by_set.items()
        ]
        total = 0
        for reply in await self.conn.call_many(commands):
            if isinstance(reply, Exception):
                raise reply
            total += int(reply)
        return total

    async def set(self, message_id: str, deadline_ms: int) -> None:
        await self.conn.call(*due_command(self.conn.keys, message_id, deadline_ms))

    async def forget(self, message_ids: list[str]) -> None:
        by_set: dict[str, list[str]] = defaultdict(list)
        for message_id in message_ids:
            by_set[due_for(self.conn.keys, message_id)].append(message_id)
        if by_set:
            await self.conn.run_all([("ZREM", due, *ids) for due, ids in by_set.items()])
