"""Taking over what a stopped consumer read: ``XAUTOCLAIM`` follows its cursor, batch after
batch, past entries live consumers hold (``broker/idle_claims.py``)."""

from __future__ import annotations

import msgspec

from broker.client import Client
from broker.connection import Connection, ensure_group, open_connection
from broker.envelope import Envelope
from broker.event_log import events_key
from broker.idle_claims import IdleClaim
from workers.dispatcher import Dispatcher
from workers.event_relay import EVENTS_GROUP, EventRelay

LONG_IDLE_MS = 3_600_000  # an entry whose reader stopped an hour ago
CLAIM_AFTER_MS = 60_000


async def read_all(conn: Connection, stream: str, group: str, consumer: str) -> list[bytes]:
    """Every entry of ``stream`` read (and so pending) under ``consumer``; their ids."""
    reply = await conn.call(
        "XREADGROUP", "GROUP", group, consumer, "COUNT", 100_000, "STREAMS", stream, ">"
    )
    return [entry_id for entry_id, _ in reply[0][1]]


async def idle_for(
    conn: Connection, stream: str, group: str, consumer: str, ids: list[bytes]
) -> None:
    """``ids`` pending under ``consumer`` as if read an hour ago (``XCLAIM ... IDLE``)."""
    await conn.call("XCLAIM", stream, group, consumer, 0, *ids, "IDLE", LONG_IDLE_MS, "JUSTID")


async def pending_count(conn: Connection, stream: str, group: str) -> int:
    return int((await conn.call("XPENDING", stream, group))[0])


async def test_a_claim_goes_on_past_the_entries_live_consumers_hold(conn: Connection) -> None:
    """2,000 entries a live consumer has just read come first in the pending list, 150 a stopped
    one left come after. One XAUTOCLAIM of 100 looks at 1,000 entries at most and finds none of
    them; following the cursor finds them all."""
    stream = conn.keys.ingress + ":claims"
    await ensure_group(conn, stream, "g")
    for _ in range(2150 // 50):
        await conn.call_many([("XADD", stream, "*", "n", "1") for _ in range(50)])
    ids = await read_all(conn, stream, "g", "live")
    await idle_for(conn, stream, "g", "stopped", ids[2000:])

    first = await IdleClaim(conn, stream, "g", "me").batch(CLAIM_AFTER_MS, 100)
    assert first.ids == []  # the scan stopped among the live consumer's entries

    claim = IdleClaim(conn, stream, "g", "me")
    claimed = [c async for c in claim.sweep(CLAIM_AFTER_MS, 100, max_batches=100)]
    assert sorted(i for c in claimed for i in c.ids) == sorted(ids[2000:])
    assert claim.wrapped
    owners = await conn.call("XPENDING", stream, "g")
    assert {name: int(n) for name, n in owners[3]} == {b"live": 2000, b"me": 150}


async def test_a_sweep_stops_at_its_bound_and_the_next_goes_on_from_there(
    conn: Connection,
) -> None:
    stream = conn.keys.ingress + ":claims"
    await ensure_group(conn, stream, "g")
    await conn.call_many([("XADD", stream, "*", "n", "1") for _ in range(50)])
    ids = await read_all(conn, stream, "g", "stopped")
    await idle_for(conn, stream, "g", "stopped", ids)
    claim = IdleClaim(conn, stream, "g", "me")

    first = [c async for c in claim.sweep(CLAIM_AFTER_MS, 10, max_batches=2)]
    assert [len(c.ids) for c in first] == [10, 10] and not claim.wrapped
    second = [c async for c in claim.sweep(CLAIM_AFTER_MS, 10, max_batches=10)]
    assert [len(c.ids) for c in second] == [10, 10, 10]
    claimed = [i for c in first + second for i in c.ids]
    assert sorted(claimed) == sorted(ids) and len(set(claimed)) == 50


async def test_a_dispatcher_takes_over_more_than_a_batch_of_ingress_in_one_sweep(
    conn: Connection,
) -> None:
    """600 entries a dispatcher read before it died, thirty times ``ingress_batch``: the next
    sweep of another dispatcher handles them all, not one batch."""
    settings = msgspec.structs.replace(conn.settings, ingress_batch=20)
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as small_batches:
        client = Client(small_batches)
        ids = await client.submit_many(
            [Envelope(capability="text.echo", payload=msgspec.Raw(b"{}")) for _ in range(600)]
        )
        ingress = small_batches.keys.ingress
        await ensure_group(small_batches, ingress, "dispatch")
        read = await read_all(small_batches, ingress, "dispatch", "gone-1")
        await idle_for(small_batches, ingress, "dispatch", "gone-1", read)

        dispatcher = Dispatcher(small_batches, consumer="d2")
        await dispatcher.refresh()
        assert await dispatcher.claim_abandoned() == 600
        assert await pending_count(small_batches, ingress, "dispatch") == 0
        stages = await small_batches.call_many(
            [("HGET", small_batches.keys.record(m), "stage") for m in ids]
        )
    assert None not in stages  # every message has its record


async def test_an_event_relay_takes_over_more_than_a_batch_of_events(conn: Connection) -> None:
    """A notifier stopped with 700 events read and not relayed, 50 of them trimmed since:
    another relays the rest at its next look, not 256 every ``claim_idle_s``, and lets go of
    the trimmed ones."""
    stream = events_key(conn)
    await ensure_group(conn, stream, EVENTS_GROUP)
    for _ in range(700 // 100):
        await conn.call_many([("XADD", stream, "*", "type", "x") for _ in range(100)])
    read = await read_all(conn, stream, EVENTS_GROUP, "n1")
    await idle_for(conn, stream, EVENTS_GROUP, "n1", read)
    await conn.call("XDEL", stream, *read[:50])  # trimmed while pending (events_max)

    relay = EventRelay(conn, consumer="n2")
    await relay.take_over_abandoned()
    assert await pending_count(conn, stream, EVENTS_GROUP) == 0
    assert relay.skipped == 650  # each left was read (none is an event) and acknowledged


async def test_entries_deleted_while_pending_are_named_to_be_acknowledged(
    conn: Connection,
) -> None:
    """A stream trimmed under a stopped consumer's pending entries: Redis 6.2 claims each and
    answers a bare nil in its place, Redis 7 names it apart. Either way the claim comes back
    with the entries that still exist and the ids of those gone, which the caller acknowledges:
    nothing stays pending for ever."""
    stream = conn.keys.ingress + ":claims"
    await ensure_group(conn, stream, "g")
    await conn.call_many([("XADD", stream, "*", "n", str(i)) for i in range(40)])
    ids = await read_all(conn, stream, "g", "stopped")
    await idle_for(conn, stream, "g", "stopped", ids)
    deleted = ids[5:40:3]
    await conn.call("XDEL", stream, *deleted)  # after XCLAIM, which on 7 drops deleted ones

    claim = IdleClaim(conn, stream, "g", "me")
    claimed = [c async for c in claim.sweep(CLAIM_AFTER_MS, 10, max_batches=100)]
    alive = [e[0] for c in claimed for e in c.entries]
    gone = [i for c in claimed for i in c.gone]
    assert sorted(alive) == sorted(set(ids) - set(deleted))
    assert sorted(gone) == sorted(deleted)
    assert all(len(e[1]) == 2 for c in claimed for e in c.entries)  # read with their fields
    await conn.call("XACK", stream, "g", *gone)
    owners = await conn.call("XPENDING", stream, "g")
    assert {name: int(n) for name, n in owners[3]} == {b"me": len(alive)}
