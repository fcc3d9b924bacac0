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
from broker.credits import return_command
from broker.entries import parse_assignment
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import SIDECAR_GROUP
from broker.store import MessageStore
from broker.streams import fields_of, raw_entries

from .takeover import credits_by_message, stale_credits

log = logging.getLogger("agent_reach.janitor")

PENDING_READ = 10_000  # an instance's pending entries read at most; more: nothing returned
CHUNK = 1_000  # credits read (with their records) and returned in one round trip
AUDITED_MAX = 100_000  # credits judged per instance and audit


async def orphaned_credits(conn: Connection, store: MessageStore, instance_id: str) -> list[bytes]:
    """The credits of ``instance_id`` that no attempt and no pending entry holds, as stored.
    Where the pending list cannot be read whole, none: a credit is kept when in doubt.

    The set is read :data:`CHUNK` members at a time (``SSCAN``), their records with them:
    whoever may write it (a sidecar's user) may fill it with a million members, and one
    ``SMEMBERS`` and a million record reads in one round trip held the janitor's memory
    and Redis for as long. At most :data:`AUDITED_MAX` are judged per audit: the next one
    goes on from a set the returns have shrunk. The pending list is read once, after every
    record: read before one of them, an entry delivered in between (its record moved on by
    the reaper since) would be missing from it, and a credit its sidecar still works under
    returned."""
    stale: dict[str, bytes] = {}
    cursor, judged = b"0", 0
    while judged < AUDITED_MAX:
        cursor, raw = await conn.call(
            "SSCAN", conn.keys.inflight(instance_id), cursor, "COUNT", CHUNK
        )
        judged += len(raw)
        stale |= await _stale(store, instance_id, raw)
        if cursor in (b"0", 0, "0"):
            break
    if not stale:
        return []
    pending = await _pending_members(conn, instance_id)
    if pending is None:
        return []
    return sorted(member for text, member in stale.items() if text not in pending)


async def _stale(store: MessageStore, instance_id: str, raw: list[bytes]) -> dict[str, bytes]:
    """Of these stored credits, those whose attempt's record has moved on, by their text."""
    stored = {m.decode(errors="replace"): m for m in raw}
    by_id = credits_by_message(set(stored))
    ids = sorted(by_id)
    records = await store.get_records(ids) if ids else []
    return {
        member: stored[member]
        for message_id, record in zip(ids, records, strict=True)
        for member in stale_credits(message_id, record, instance_id, by_id[message_id])
    }


async def _pending_members(conn: Connection, instance_id: str) -> set[str] | None:
    """The credits the pending entries of the instance's stream name (``<id>:<attempt>``);
    ``None`` where that cannot be told for every pending entry (more than
    :data:`PENDING_READ`, or one whose body is gone: deleted or trimmed while pending)."""
    queue = conn.keys.queue(instance_id)
    try:
        pending = await conn.call("XPENDING", queue, SIDECAR_GROUP, "-", "+", PENDING_READ)
    except RedisReplyError as exc:
        if exc.code == "NOGROUP":  # no stream, or no group: no sidecar has read anything
            return set()
        raise
    if len(pending) >= PENDING_READ:
        return None
    ranges = [("XRANGE", queue, p[0], p[0]) for p in pending]
    held: set[str] = set()
    for reply in await conn.call_many(ranges) if ranges else []:
        if isinstance(reply, Exception):
            raise reply
        entries = raw_entries(reply)
        if not entries:
            return None
        for entry_id, flat in entries:
            assignment = parse_assignment(entry_id, fields_of(flat))
            if not isinstance(assignment, str):
                held.add(f"{assignment.message_id}:{assignment.attempt}")
    return held


async def return_orphaned_credits(
    conn: Connection, store: MessageStore, instance_ids: list[str]
) -> int:
    """Return the orphaned credits of each instance; how many were returned. An instance
    whose credits cannot be judged (an unreadable record, a refused read) keeps them."""
    returned = 0
    for instance_id in instance_ids:
        try:
            orphaned = await orphaned_credits(conn, store, instance_id)
            for i in range(0, len(orphaned), CHUNK):
                chunk = orphaned[i : i + CHUNK]
                returned += int(await conn.call(*return_command(conn, instance_id, chunk)))
        except RedisUnavailable:
            raise
        except Exception:  # one instance's defect stays its own
            log.exception("credits of %r: not audited", instance_id)
            continue
        if orphaned:
            log.warning(
                "returned credits of %r that no attempt and no entry held: %r",
                instance_id,
                orphaned[:10],
            )
    return returned
