"""Credits and instance streams: an attempt is appended to an instance's stream only against
a free credit (``lua/assign.lua``), and the credit comes back with the entry's ack
(``lua/release.lua``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .cluster_map import ORDER_BARRIER
from .connection import Connection
from .errors import raised
from .notifications import credit_announcement
from .records import AssignResult
from .resp import Command
from .scripts import ScriptName
from .timekeeping import now_ms


def assign_keys(conn: Connection, instance_id: str) -> tuple[str, str, str, str]:
    """The keys ``lua/assign_credit.lua`` reads and writes: the instance's card, credits in
    use, stream and rate state."""
    return (
        conn.keys.card(instance_id),
        conn.keys.inflight(instance_id),
        conn.keys.queue(instance_id),
        conn.fleet.rate("instance", instance_id),
    )


def assign_command(
    conn: Connection, instance_id: str, message_id: str, attempt: int
) -> tuple[Any, ...]:
    keys = assign_keys(conn, instance_id)
    down_after_ms = int(conn.settings.down_after_s * 1000)
    return conn.script_command(
        ScriptName.ASSIGN, keys, (message_id, attempt, now_ms(), down_after_ms)
    )


def release_command(
    conn: Connection, instance_id: str, group: str, finished: list[tuple[str, str]]
) -> tuple[Any, ...]:
    """Free the credits of ``(member, entry_id)`` pairs, ack the entries, announce it
    (:func:`broker.notifications.credit_announcement`)."""
    keys = (conn.keys.inflight(instance_id), conn.keys.queue(instance_id))
    channel, sharded = credit_announcement(conn, instance_id)
    args: list[str] = [group, channel, instance_id, sharded]
    for member, entry_id in finished:
        args += [member, entry_id]
    return conn.script_command(ScriptName.RELEASE, keys, args)


def return_command(
    conn: Connection, instance_id: str, members: Sequence[str | bytes]
) -> tuple[Any, ...]:
    """Return credits (``<id>:<attempt>``, as stored) that no sidecar will return, and
    announce it as a release does: the reaper's and the janitor's way to give one back."""
    channel, sharded = credit_announcement(conn, instance_id)
    return conn.script_command(
        ScriptName.RETURN_CREDITS,
        (conn.keys.inflight(instance_id),),
        (channel, instance_id, sharded, *members),
    )


class Credits:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def assign(self, instance_id: str, message_id: str, attempt: int) -> AssignResult:
        """Append the attempt to the instance's stream, only against a free credit."""
        command = assign_command(self.conn, instance_id, message_id, attempt)
        return AssignResult(await self.conn.call(*command))

    async def assign_many(
        self, assignments: list[tuple[str, str, int]], *, ahead: Sequence[Command] = ()
    ) -> list[AssignResult]:
        """``(instance_id, message_id, attempt)`` triples, in one round trip, after the writes
        ``ahead`` (whose first error reply is raised; on a cluster they are written first)."""
        barrier = [ORDER_BARRIER] if ahead else []
        replies = await self.conn.call_many(
            [*ahead, *barrier, *(assign_command(self.conn, *a) for a in assignments)]
        )
        start = len(ahead) + len(barrier)
        for reply in replies[: len(ahead)]:
            raised(reply)
        return [AssignResult(raised(r)) for r in replies[start:]]
