"""The reaper's clock, ``P:due``: every live message's next deadline, claimed under a lease.

With ``ingress_partitions`` > 1 the clock is as many sorted sets (``P:due``, ``P:due:{1}``, …:
:func:`~broker.keyspace.due_for` picks a message's by its id), each claimed by every reaper."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Any

from .connection import Connection
from .envelope import MESSAGE_ID_PATTERN
from .errors import raised
from .keyspace import Keyspace, due_for, due_sets
from .scripts import ScriptName

log = logging.getLogger("agent_reach.reaper")


def due_command(keys: Keyspace, message_id: str, deadline_ms: int) -> tuple[Any, ...]:
    """Set a message's next deadline in the reaper's clock (``P:due``), which indexes
    every live message."""
    return ("ZADD", due_for(keys, message_id), deadline_ms, message_id)


def due_at_most_command(keys: Keyspace, message_id: str, at_ms: int) -> tuple[Any, ...]:
    """Bring a message's next deadline forward to ``at_ms`` (never later): the delivery
    timeout of an assignment, say, comes before the message's own deadline."""
    return ("ZADD", due_for(keys, message_id), "LT", at_ms, message_id)


_ID = re.compile(MESSAGE_ID_PATTERN.encode())


def message_ids(members: list[bytes]) -> list[str]:
    """The members of a due set that are message ids, decoded; the broker adds no other, but
    anyone who may park work (a sidecar's user) may."""
    return [i.decode() for i in members if _ID.match(i)]


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
        replies = await self.conn.call_many(commands)
        for due, reply in zip(due_sets(self.conn.keys), replies, strict=True):
            ids = message_ids(raised(reply))
            if len(ids) < len(reply):  # not the broker's: anyone who may park may add to it
                junk = [i for i in reply if not _ID.match(i)]
                log.error("%s held %d members that are no message id: removed", due, len(junk))
                await self.conn.call("ZREM", due, *junk)
            misplaced = [i for i in ids if due_for(self.conn.keys, i) != due]
            if misplaced:
                await self._move_home(due, misplaced, now)
                away = set(misplaced)
                ids = [i for i in ids if i not in away]
            claimed += ids
        return claimed

    async def _move_home(self, due: str, misplaced: list[str], now: int) -> None:
        """Ids in a partition not theirs (the broker writes none; a sidecar's user may): the
        lease just taken there would never be rescheduled — every reschedule writes to the
        id's own partition — so the id came due again at every lease's end, for good. Each
        goes to its own partition, due now unless it already has a deadline there."""
        log.error("%s held %d ids of other partitions: moved to theirs", due, len(misplaced))
        # home first, then out of here: on a cluster these are other nodes, so two round
        # trips; a stop between leaves an id in both, and the next claim here moves it again
        await self.conn.run_all(
            [("ZADD", due_for(self.conn.keys, i), "NX", now, i) for i in misplaced]
        )
        await self.conn.run_all([("ZREM", due, *misplaced)])

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
