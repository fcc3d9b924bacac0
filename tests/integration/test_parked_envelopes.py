"""A dispatcher drains what it parked itself from the envelopes it kept, fenced on the record
never having moved since (workers/parked_envelopes.py). Real Redis."""

from __future__ import annotations

import pytest

from broker.client import Client
from broker.connection import Connection
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from broker.waiting_sets import RATE_WINDOW_MS
from tests.integration.test_pipeline import parked_behind_earlier_work, watching
from tests.support.harness import card


@pytest.mark.one_server  # a cluster's drain reads the stages back (workers/waiting.py)
async def test_a_drain_assigns_what_it_parked_without_reading_the_records(
    conn: Connection,
) -> None:
    """Each message is read from its waiting entry alone: no record read back, and each
    claim made where the record has not moved since its acceptance."""
    store = MessageStore(conn)
    await Registry(conn).register(card("a-1", ("text.echo",), max_inflight=8), credits=8)
    dispatcher, ids = await parked_behind_earlier_work(conn, Client(conn).new_reply_stream(), 3)
    assert len(dispatcher.waiting.parked) == 3
    with watching(conn) as rounds:
        assert await dispatcher.waiting.drain(["text.echo"]) == 3
    sent = [c for r in rounds for c in r]
    assert not [c for c in sent if c[0] in ("HGETALL", "HGET", "HMGET")], sent
    assert await store.stages(ids) == [Stage.ROUTED] * 3
    assert await store.waiting.depth("text.echo") == 0
    assert len(dispatcher.waiting.parked) == 0


@pytest.mark.one_server  # a cluster's claims and assignments are scripts apart
async def test_a_drain_counts_its_assignments_in_its_claims(conn: Connection) -> None:
    """On one server each claim's script assigns the message and counts the assignment (the
    capability's counter, which ``stats`` reads): a drain pass takes two round trips, the
    heads of the waiting sets and the claims, not a third for the counters."""
    await Registry(conn).register(card("a-1", ("text.echo",), max_inflight=8), credits=8)
    dispatcher, _ = await parked_behind_earlier_work(conn, Client(conn).new_reply_stream(), 3)
    window = now_ms() // RATE_WINDOW_MS
    with watching(conn) as rounds:
        assert await dispatcher.waiting.drain(["text.echo"]) == 3
    windows = range(window, now_ms() // RATE_WINDOW_MS + 1)
    counters = await conn.call("MGET", *(conn.keys.assigned("text.echo", w) for w in windows))
    assert sum(int(n) for n in counters if n) == 3
    sent = [[c[0] for c in r] for r in rounds if r]  # an empty batch sends nothing
    assert sent == [["ZRANGE"], ["EVALSHA"] * 3], sent


@pytest.mark.one_server
async def test_a_spoiled_assignment_counter_costs_the_count_not_the_assignment(
    conn: Connection,
) -> None:
    """Whoever may write the counters may make one another type: the claim's script then
    assigns the message all the same, and only the count is lost."""
    await Registry(conn).register(card("a-1", ("text.echo",), max_inflight=8), credits=8)
    dispatcher, ids = await parked_behind_earlier_work(conn, Client(conn).new_reply_stream(), 1)
    window = now_ms() // RATE_WINDOW_MS
    for w in (window, window + 1):  # the drain may start the next window
        await conn.call("HSET", conn.keys.assigned("text.echo", w), "spoiled", "1")
    assert await dispatcher.waiting.drain(["text.echo"]) == 1
    assert await MessageStore(conn).stages(ids) == [Stage.ROUTED]
    assert await conn.call("XLEN", conn.keys.queue("a-1")) == 1


async def test_a_kept_envelope_whose_record_moved_meanwhile_is_read_again(
    conn: Connection,
) -> None:
    """Kept by the dispatcher that parked it, the message meanwhile went out (another
    dispatcher's claim) and came back to wait out a back-off. A drain from the kept
    envelope would see it as accepted and assign it at once: its claim is refused instead,
    and the record, read again, holds it until its back-off ends."""
    store = MessageStore(conn)
    await Registry(conn).register(card("a-1", ("text.echo",), max_inflight=8), credits=8)
    dispatcher, (message_id,) = await parked_behind_earlier_work(
        conn, Client(conn).new_reply_stream(), 1
    )
    out = await store.move(
        message_id, Stage.ROUTED, only_from=Stage.WAITING, new_attempt="+", new_instance="a-1"
    )
    back_at = now_ms() + 60_000
    back = await store.move(
        message_id,
        Stage.WAITING,
        only_from=Stage.ROUTED,
        new_attempt=0,
        reason="assignment refused",
        fields={"retry_at_ms": back_at},
    )
    assert out.ok and back.ok
    assert dispatcher.waiting.parked.get(message_id) is not None
    assert await dispatcher.waiting.drain(["text.echo"]) == 0
    record = await store.get_record(message_id)
    assert record is not None and (record.stage, record.retry_at_ms) == (Stage.WAITING, back_at)
    assert await conn.call("XLEN", conn.keys.queue("a-1")) == 0
    assert dispatcher.waiting.parked.get(message_id) is None
