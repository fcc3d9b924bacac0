"""The reaper's clock, ``P:due``: every live message's next deadline, claimed under a lease."""

from __future__ import annotations

from typing import Any

from .connection import Connection
from .keyspace import Keyspace
from .record_codec import text
from .scripts import ScriptName


def due_command(keys: Keyspace, message_id: str, deadline_ms: int) -> tuple[Any, ...]:
    """Set a message's next deadline in the reaper's clock (``P:due``), which indexes
    every live message."""
    return ("ZADD", keys.due, deadline_ms, message_id)


def due_at_most_command(keys: Keyspace, message_id: str, at_ms: int) -> tuple[Any, ...]:
    """Bring a message's next deadline forward to ``at_ms`` (never later): the delivery
    timeout of an assignment, say, comes before the message's own deadline."""
    return ("ZADD", keys.due, "LT", at_ms, message_id)


class DueClock:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def claim(self, now: int, lease_ms: int, count: int) -> list[str]:
        """The messages whose next deadline has come, claimed for ``lease_ms`` (see
        ``lua/claim_due.lua``): no other reaper sees them until this one reschedules them."""
        command = self.conn.script_command(
            ScriptName.CLAIM_DUE, (self.conn.keys.due,), (now, lease_ms, count)
        )
        return [text(i) for i in await self.conn.call(*command)]

    async def reschedule(self, lease_score: int, verdicts: list[tuple[str, int | None]]) -> int:
        """Write each leased message's next look (``None``: it ended, forget it), only where
        the lease still stands (see ``lua/reschedule_due.lua``)."""
        if not verdicts:
            return 0
        args: list[Any] = [lease_score]
        for message_id, next_ms in verdicts:
            args += [message_id, "" if next_ms is None else next_ms]
        command = self.conn.script_command(ScriptName.RESCHEDULE_DUE, (self.conn.keys.due,), args)
        return int(await self.conn.call(*command))

    async def set(self, message_id: str, deadline_ms: int) -> None:
        await self.conn.call(*due_command(self.conn.keys, message_id, deadline_ms))

    async def forget(self, message_ids: list[str]) -> None:
        if message_ids:
            await self.conn.call("ZREM", self.conn.keys.due, *message_ids)
