"""Credits no one will return: held for a message attempt that no longer holds its credit,
whose entry no sidecar holds either. The janitor returns them, for live instances too.

A credit (``<id>:<attempt>`` in the instance's in-flight set) is returned by whoever lets go
of the attempt: its sidecar when it drops or finishes the entry, the reaper when it moves or
ends a message of a dead instance, or one whose entry it took over. A process stopped between
its move and its return (a reaper killed after a retry, say) leaves the credit held for good,
and the instance runs one short. The rule here is the narrow one that is safe on a live
instance: the attempt's record has moved on (another attempt, another instance, a stage that
holds no credit, or no record) *and* no pending entry of the instance's stream names it — a
sidecar still working on it (a call that outlived the reaper's patience) holds its entry
pending until it returns the credit itself. An entry not yet read is no concern: its sidecar
will find it stale and return what is already returned (``SREM`` twice changes nothing).
"""

from __future__ import annotations

import logging

from broker.connection import Connection
from broker.entries import parse_assignment
from broker.errors import RedisReplyError
from broker.keyspace import SIDECAR_GROUP
from broker.store import MessageStore
from broker.streams import parse_entries

from .takeover import stale_credits

log = logging.getLogger("agent_reach.janitor")

PENDING_READ = 10_000  # an instance's pending entries read at most (its credits are fewer)


async def orphaned_credits(conn: Connection, store: MessageStore, instance_id: str) -> list[str]:
    """The credits of ``instance_id`` that no attempt and no pending entry holds."""
    raw = await conn.call("SMEMBERS", conn.keys.inflight(instance_id))
    members = {m.decode(errors="replace") for m in raw}
    ids = sorted({m.rpartition(":")[0] for m in members})
    records = await store.get_records(ids) if ids else []
    stale = {
        member
        for message_id, record in zip(ids, records, strict=True)
        for member in stale_credits(message_id, record, instance_id, members)
    }
    if not stale:
        return []
    return sorted(stale - await _pending_members(conn, instance_id))


async def _pending_members(conn: Connection, instance_id: str) -> set[str]:
    """The credits the pending entries of the instance's stream name (``<id>:<attempt>``)."""
    queue = conn.keys.queue(instance_id)
    try:
        pending = await conn.call("XPENDING", queue, SIDECAR_GROUP, "-", "+", PENDING_READ)
    except RedisReplyError:  # no stream, or no group: no sidecar has read anything
        return set()
    ranges = [("XRANGE", queue, p[0], p[0]) for p in pending]
    held: set[str] = set()
    for reply in await conn.call_many(ranges) if ranges else []:
        for entry_id, fields in parse_entries(reply):
            assignment = parse_assignment(entry_id, fields)
            if not isinstance(assignment, str):
                held.add(f"{assignment.message_id}:{assignment.attempt}")
    return held


async def return_orphaned_credits(
    conn: Connection, store: MessageStore, instance_ids: list[str]
) -> int:
    """Return the orphaned credits of each instance; how many were returned."""
    returned = 0
    for instance_id in instance_ids:
        orphaned = await orphaned_credits(conn, store, instance_id)
        if orphaned:
            await conn.call("SREM", conn.keys.inflight(instance_id), *orphaned)
            returned += len(orphaned)
            log.warning(
                "returned %d credits of %s that no attempt and no entry held: %s",
                len(orphaned),
                instance_id,
                ", ".join(orphaned[:10]),
            )
    return returned
