"""A record stores nothing it can read elsewhere (``python -m bench.memory``): no copy of the
envelope's ``reply_to``, no idempotency key equal to the id, no empty callback fields on a
first attempt — and reads back as if it did."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from broker.client import Client
from broker.connection import Connection
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import (
    collect_replies,
    eventually,
    running_dispatcher,
    running_sidecar,
)


async def test_a_finished_record_keeps_no_copies_and_reads_back_whole(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    keyed = Envelope(capability="text.echo", payload=msgspec.Raw(b"1"), reply_to=reply_to)
    own_key = Envelope(
        capability="text.echo",
        payload=msgspec.Raw(b"2"),
        reply_to=reply_to,
        idempotency_key="order-77",
    )
    bodies: dict[str, str | None] = {}

    async def seen(envelope: dict[str, Any], request: Request) -> None:
        bodies[envelope["id"]] = envelope.get("idempotency_key")

    async with (
        http_agent("a", behaviour=seen) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        ids = await client.submit_many([keyed, own_key])
        replies = await collect_replies(conn, reply_to, 2)
    assert {r.stage for r in replies.values()} == {Stage.SUCCEEDED}

    store = MessageStore(conn)
    for message_id in ids:
        stored = await conn.call("HGETALL", conn.keys.record(message_id))
        fields = dict(zip(stored[::2], stored[1::2], strict=True))
        assert b"reply_to" not in fields
        assert b"awaiting_callback" not in fields and b"agent_task" not in fields
        record = await store.get_record(message_id)
        assert record is not None
        assert record.reply_to == reply_to
        assert not record.awaiting_callback and record.agent_task == ""
    first, second = [await conn.call("HGET", conn.keys.record(i), "envelope") for i in ids]
    assert b"idempotency_key" not in first
    assert b'"idempotency_key":"order-77"' in second
    # the agent is told the key all the same, in its header and in the envelope it gets: the
    # id where the producer gave none
    sent = {h["x-reach-message-id"]: h["x-reach-idempotency-key"] for h in agent.log.headers}
    assert sent == {ids[0]: ids[0], ids[1]: "order-77"}
    assert bodies == sent


async def test_a_rejected_record_keeps_the_reply_to_it_was_answered_on(conn: Connection) -> None:
    """Refused at admission (a broadcast no instance serves): the record keeps its own copy
    of reply_to, as every REJECTED record does."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    refused = Envelope(
        capability="nobody.serves",
        payload=msgspec.Raw(b"1"),
        reply_to=reply_to,
        mode="broadcast",
    )
    store = MessageStore(conn)
    async with running_dispatcher(conn):
        (message_id,) = await client.submit_many([refused])
        replies = await collect_replies(conn, reply_to, 1, timeout_s=10)
    assert replies[message_id].stage is Stage.REJECTED
    assert await conn.call("HGET", conn.keys.record(message_id), "reply_to") == reply_to.encode()
    record = await store.get_record(message_id)
    assert record is not None and record.reply_to == reply_to


async def test_an_invalid_envelope_never_lends_its_reply_to(conn: Connection) -> None:
    """A rejected envelope's reply_to is stored only when it passed the check (salvaged): one
    outside the reply namespace is never read back out of the stored bytes."""
    outside = msgspec.json.encode(
        {"capability": "NOT VALID", "reply_to": "elsewhere:stream", "id": "m-bad"}
    )
    store = MessageStore(conn)

    async def recorded() -> bool:
        return await store.get_record("m-bad") is not None

    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", outside)
        await eventually(recorded, timeout_s=10)
    record = await store.get_record("m-bad")
    assert record is not None and record.stage is Stage.REJECTED
    assert record.envelope == outside
    assert record.reply_to == ""


async def test_a_waiting_record_writes_no_defaults_and_reads_them_back(conn: Connection) -> None:
    """A message no instance serves waits: its record holds no attempt 0, empty instance or
    error, priority 0, nor an updated_ms equal to accepted_ms; it reads back with them. A
    second, with a priority, keeps that."""
    client = Client(conn)
    plain = Envelope(capability="nobody.yet", payload=msgspec.Raw(b"1"), timeout_s=600)
    urgent = Envelope(capability="nobody.yet", payload=msgspec.Raw(b"2"), priority=5)
    store = MessageStore(conn)

    async def both_waiting() -> bool:
        stages = [await conn.call("HGET", conn.keys.record(i), "stage") for i in ids]
        return stages == [b"WAITING", b"WAITING"]

    async with running_dispatcher(conn):
        ids = await client.submit_many([plain, urgent])
        await eventually(both_waiting, timeout_s=10)
    stored = await conn.call("HGETALL", conn.keys.record(ids[0]))
    names = set(stored[::2])
    assert names.isdisjoint({b"attempt", b"instance", b"error", b"priority", b"updated_ms"})
    record = await store.get_record(ids[0])
    assert record is not None and record.stage is Stage.WAITING
    assert (record.attempt, record.instance, record.error, record.priority) == (0, "", "", 0)
    assert record.updated_ms == record.accepted_ms > 0
    assert await conn.call("HGET", conn.keys.record(ids[1]), "priority") == b"5"
    second = await store.get_record(ids[1])
    assert second is not None and second.priority == 5
