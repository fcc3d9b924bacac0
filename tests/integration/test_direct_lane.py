"""The direct lane (broker/direct.py, broker/direct_lane.py, workers/direct_publisher.py):
with ``direct_lane`` on, a plain envelope for a capability one instance serves is assigned
by its producer, recorded as the dispatcher would have recorded it; whenever that is not
certain to be right, nothing is written and the envelope goes through the ingress."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest

from adapters.python import Agent
from broker.client import Client
from broker.connection import Connection, ensure_group
from broker.direct import MAX_LANES_KEPT
from broker.direct_lane import Lane, lane_text, read_lane
from broker.envelope import Envelope, complete, encode_envelope
from broker.errors import UnknownMessage
from broker.keyspace import DISPATCH_GROUP, direct_lane, due_for
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.timekeeping import now_ms
from tests.support.agents import recording_agent
from tests.support.harness import connected, eventually, running_dispatcher, running_sidecar

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def one_instance_lane(conn: Connection, agent: Agent) -> AsyncIterator[Connection]:
    """A dispatcher with the lane on, f-1 serving text.echo with ``agent``, and its lane
    published: the connection they run on."""
    async with (
        direct(conn) as lane_conn,
        running_dispatcher(lane_conn),
        running_sidecar(lane_conn, "f-1", ("text.echo",), transport=agent),
    ):
        await published(conn, "text.echo")
        yield lane_conn


def direct(conn: Connection, on: bool = True) -> Any:
    """A connection to the same Redis with the lane on (or off): a dispatcher's setting,
    and a producer's."""
    return connected(msgspec.structs.replace(conn.settings, direct_lane=on))


async def lane_of(conn: Connection, capability: str) -> bytes | None:
    found = await conn.call("GET", direct_lane(conn.keys, capability))
    return found if isinstance(found, bytes) else None


async def published(conn: Connection, capability: str) -> None:
    async def there() -> bool:
        return await lane_of(conn, capability) is not None

    await eventually(there)


async def all_succeeded(client: Client, ids: list[str]) -> None:
    async def done() -> bool:
        try:
            results = [await client.result(i) for i in ids]
        except UnknownMessage:  # sent to the ingress, not yet accepted
            return False
        return all(r is not None and r.stage is Stage.SUCCEEDED for r in results)

    await eventually(done)


def a_lane(instance: str = "f-1") -> Lane:
    return Lane(
        instance=instance,
        route_from='["capability:1"]',
        route_reason="forged",
        max_bytes=1 << 20,
        delivery_ms=30_000,
        down_after_ms=15_000,
        timeline_max=200,
        counters_key="",
        counters_max=0,
        partitions=1,
    )


def envelope(**fields: Any) -> Envelope:
    return Envelope(capability="text.echo", payload=msgspec.Raw(b"{}"), **fields)


async def test_a_plain_envelope_goes_down_the_lane_recorded_as_the_dispatcher_routes(
    conn: Connection,
) -> None:
    agent, calls = recording_agent("f")
    async with one_instance_lane(conn, agent) as lane_conn:
        lane = read_lane(await lane_of(conn, "text.echo") or b"")
        assert lane is not None and lane.instance == "f-1"
        client = Client(lane_conn)
        ids = [await client.submit(envelope()) for _ in range(20)]
        await all_succeeded(client, ids)
        record = await client.store.get_record(ids[0])
        timeline = await client.store.get_timeline(ids[0])
    assert await conn.call("XLEN", conn.keys.ingress) == 0  # none went through the ingress
    assert sorted(calls) == sorted(ids)  # each ran, once
    assert record is not None and record.instance == "f-1" and record.attempt == 1
    stages = [e.stage for e in timeline]
    assert stages == [
        Stage.ACCEPTED,
        Stage.ROUTED,
        Stage.RECEIVED,
        Stage.PROCESSING,
        Stage.SUCCEEDED,
    ]
    fields = await conn.call("HMGET", conn.keys.record(ids[0]), "route_from", "route_reason")
    assert [f.decode() for f in fields] == [lane.fields["route_from"], lane.fields["route_reason"]]
    assert timeline[1].reason == lane.fields["route_reason"]


async def test_with_the_lane_off_none_is_published_and_the_ingress_carries_all(
    conn: Connection,
) -> None:
    agent, calls = recording_agent("f")
    async with (
        direct(conn, on=False) as off,
        running_dispatcher(off),
        running_sidecar(off, "f-1", ("text.echo",), transport=agent),
    ):
        client = Client(conn)
        ids = [await client.submit(envelope()) for _ in range(5)]
        await all_succeeded(client, ids)
        assert await lane_of(conn, "text.echo") is None
    assert await conn.call("XLEN", conn.keys.ingress) == 5
    assert sorted(calls) == sorted(ids)


async def test_no_credit_or_work_waiting_sends_the_envelope_to_the_ingress_in_order(
    conn: Connection,
) -> None:
    """One credit: the first takes it down the lane; the second finds none and waits (via
    the ingress). With the credit free again but the second still waiting (no dispatcher
    to drain it), the third is not let past it down the lane: it goes to the ingress."""
    held = anyio.Event()
    order: list[str] = []
    agent = Agent("f")

    @agent.handler("text.echo")
    async def slow(e: Envelope) -> dict[str, Any]:
        order.append(e.message_id)
        await held.wait()
        return {}

    async with (
        direct(conn) as lane_conn,
        running_sidecar(
            lane_conn,
            "f-1",
            ("text.echo",),
            transport=agent,
            max_inflight=1,
            adaptive_credits=False,
        ),
    ):
        client = Client(lane_conn)
        async with running_dispatcher(lane_conn):
            await published(conn, "text.echo")
            first = await client.submit(envelope())
            second = await client.submit(envelope())

            async def waits() -> bool:
                record = await client.store.get_record(second)
                return record is not None and record.stage is Stage.WAITING

            await eventually(waits)
        held.set()  # the first ends and frees the credit; no dispatcher drains the second
        await all_succeeded(client, [first])
        third = await client.submit(envelope())
        with pytest.raises(UnknownMessage):  # not taken down the lane: in the ingress
            await client.result(third)
        assert await conn.call("XLEN", conn.keys.ingress) == 2  # the second and the third
        async with running_dispatcher(lane_conn):  # (a new one: it may take either first)
            await all_succeeded(client, [first, second, third])
    assert order[0] == first and sorted(order[1:]) == sorted([second, third])


async def test_a_second_instance_withdraws_the_lane(conn: Connection) -> None:
    one, _ = recording_agent("f")
    two, _ = recording_agent("g")
    async with one_instance_lane(conn, one) as lane_conn:
        async with running_sidecar(lane_conn, "g-1", ("text.echo",), transport=two):

            async def withdrawn() -> bool:
                return await lane_of(conn, "text.echo") is None

            await eventually(withdrawn)


async def test_an_id_sent_again_is_judged_by_the_ingress_and_runs_once(conn: Connection) -> None:
    agent, calls = recording_agent("f")
    async with one_instance_lane(conn, agent) as lane_conn:
        client = Client(lane_conn)
        first = await client.submit(envelope(id="same-request-1"))
        await all_succeeded(client, [first])
        again = await client.submit(envelope(id="same-request-1"))

        async def handled() -> bool:  # the dispatcher acknowledged the entry sent again
            pending = await conn.call("XPENDING", conn.keys.ingress, "dispatch")
            return await conn.call("XLEN", conn.keys.ingress) == 1 and pending[0] == 0

        await eventually(handled)
    assert again == first and calls == [first]


@pytest.mark.parametrize(
    "lane",
    [
        lane_text(a_lane("other-1")),  # an instance that serves something else
        b"no line break at all",
        lane_text(a_lane())[:-5],  # not JSON
        # a field of the record besides the decision's: the payload, say
        lane_text(a_lane())[:-1] + b',"envelope":"{}"}',
    ],
)
async def test_a_lane_that_cannot_be_right_is_not_taken(conn: Connection, lane: bytes) -> None:
    """Whoever may write the key may write anything there: the producer takes only a lane
    whose instance's card lists the capability, and goes to the ingress otherwise."""
    agent, calls = recording_agent("f")
    other, other_calls = recording_agent("other", "text.other")
    async with (
        direct(conn, on=False) as off,
        running_dispatcher(off),  # publishing no lane of its own
        running_sidecar(conn, "f-1", ("text.echo",), transport=agent),
        running_sidecar(conn, "other-1", ("text.other",), transport=other),
    ):
        await conn.call("SET", direct_lane(conn.keys, "text.echo"), lane)
        client = Client(conn)
        sent = await client.submit(envelope())
        await all_succeeded(client, [sent])
    assert calls == [sent] and other_calls == []
    assert await conn.call("XLEN", conn.keys.ingress) == 1


async def test_a_producer_with_the_lane_off_sends_everything_to_the_ingress(
    conn: Connection,
) -> None:
    """``direct_lane = false`` is the producer's choice too: where a dispatcher publishes a
    lane, its messages still pass a dispatcher (its spans, its routing figures)."""
    agent, calls = recording_agent("f")
    async with one_instance_lane(conn, agent), direct(conn, on=False) as producer:
        client = Client(producer)
        ids = [await client.submit(envelope()) for _ in range(3)]
        await all_succeeded(client, ids)
    assert await conn.call("XLEN", conn.keys.ingress) == 3
    assert sorted(calls) == sorted(ids)


async def hand_laid_lane(conn: Connection) -> None:
    """A lane as a dispatcher that has stopped left it (it lives on for seconds), and the
    dispatchers' group on an ingress no dispatcher reads now."""
    await conn.call("SET", direct_lane(conn.keys, "text.echo"), lane_text(a_lane()))
    await ensure_group(conn, conn.keys.ingress, DISPATCH_GROUP)


async def recorded(conn: Connection, message_id: str) -> bool:
    return bool(await conn.call("EXISTS", conn.keys.record(message_id)))


async def test_what_is_unread_in_the_ingress_is_not_overtaken_down_the_lane(
    conn: Connection,
) -> None:
    """Whatever went to the ingress (an envelope that is not plain, a batch, another
    producer's XADD, one sent while no lane was seen) runs before a plain envelope sent after
    it: while the ingress holds an entry the dispatchers have not read, the lane is not taken."""
    agent, calls = recording_agent("f")
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent):
        await hand_laid_lane(conn)
        client = Client(conn)
        (first,) = await client.submit_many([envelope(priority=9)])  # the ingress, unread
        second = await client.submit(envelope())
        assert await conn.call("XLEN", conn.keys.ingress) == 2  # behind it
        assert not await recorded(conn, second)
        assert await lane_of(conn, "text.echo") is not None  # kept: the check holds the order
        async with running_dispatcher(conn):
            await all_succeeded(client, [first, second])
    assert calls == [first, second]


async def test_an_ingress_entry_being_handled_holds_the_lane_until_acknowledged(
    conn: Connection,
) -> None:
    """An entry a dispatcher has read but not yet acknowledged (its record not yet written,
    or a dispatcher stopped mid-batch) counts as unfinished; once acknowledged, the lane is
    open again."""
    agent, _ = recording_agent("f")
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent):
        await hand_laid_lane(conn)
        client = Client(conn)
        await client.submit_many([envelope()])
        read = await conn.call(
            "XREADGROUP", "GROUP", DISPATCH_GROUP, "d-x", "STREAMS", conn.keys.ingress, ">"
        )
        (entry_id,) = [entry[0] for entry in read[0][1]]
        held = await client.submit(envelope())
        assert not await recorded(conn, held)
        assert await conn.call("XLEN", conn.keys.ingress) == 2
        await conn.call(
            "XREADGROUP", "GROUP", DISPATCH_GROUP, "d-x", "STREAMS", conn.keys.ingress, ">"
        )
        stream_ids = [e[0] for e in await conn.call("XRANGE", conn.keys.ingress, "-", "+")]
        await conn.call("XACK", conn.keys.ingress, DISPATCH_GROUP, *stream_ids)
        assert entry_id in stream_ids
        passed = await client.submit(envelope())
        assert await recorded(conn, passed)  # down the lane: recorded at once
        assert await conn.call("XLEN", conn.keys.ingress) == 2


async def test_a_lane_key_of_another_type_sends_to_the_ingress(conn: Connection) -> None:
    agent, calls = recording_agent("f")
    async with (
        running_dispatcher(conn),
        running_sidecar(conn, "f-1", ("text.echo",), transport=agent),
    ):
        # the dispatcher may have published the lane already: replaced by a list at once
        spoil = "redis.call('DEL', KEYS[1]) return redis.call('RPUSH', KEYS[1], 'x')"
        await conn.call("EVAL", spoil, 1, direct_lane(conn.keys, "text.echo"))
        client = Client(conn)
        sent = await client.submit(envelope())
        await all_succeeded(client, [sent])
    assert calls == [sent]


async def test_what_the_dispatcher_would_refuse_is_not_taken_down_its_lane(
    conn: Connection,
) -> None:
    """The lane carries the largest envelope its dispatcher takes: a producer configured to
    allow larger ones sends a larger one to the ingress, where it is refused."""
    agent, calls = recording_agent("f")
    small = msgspec.structs.replace(conn.settings, direct_lane=True, max_envelope_bytes=512)
    async with (
        connected(small) as dispatcher_conn,
        running_dispatcher(dispatcher_conn),
        running_sidecar(dispatcher_conn, "f-1", ("text.echo",), transport=agent),
    ):
        await published(conn, "text.echo")
        client = Client(conn)  # the producer's own limit: 1 MiB
        sent = await client.submit(envelope(headers={"pad": "x" * 600}))

        async def refused() -> bool:
            try:
                result = await client.result(sent)
            except UnknownMessage:
                return False
            return result is not None and result.stage is Stage.REJECTED

        await eventually(refused)
    assert calls == []


async def test_a_direct_record_follows_the_dispatcher_s_settings_not_the_producer_s(
    conn: Connection,
) -> None:
    """The producer runs on its own settings (here the defaults: a 30 s delivery timeout);
    the record follows the lane's, its dispatcher's (2 s), and Redis's clock."""
    agent, _ = recording_agent("f")
    broker_settings = msgspec.structs.replace(
        conn.settings, direct_lane=True, delivery_timeout_s=2.0, timeline_max=10
    )
    async with (
        connected(broker_settings) as broker,
        running_dispatcher(broker),
        running_sidecar(broker, "f-1", ("text.echo",), transport=agent),
    ):
        await published(conn, "text.echo")
        producer = msgspec.structs.replace(conn.settings, delivery_timeout_s=30.0)
        async with connected(producer) as producer_conn:
            client = Client(producer_conn)
            held = await client.submit(envelope(id="direct-1", timeout_s=60.0))
            fields = await conn.call("HMGET", conn.keys.record(held), "accepted_ms", "deadline_ms")
            accepted_ms, deadline_ms = (int(f) for f in fields)
            look = await conn.call("ZSCORE", conn.keys.due, held)
    assert deadline_ms - accepted_ms == 60_000
    assert look is not None and int(float(look)) - accepted_ms == 2_000  # the broker's look


async def test_lanes_left_by_a_dispatcher_before_a_restart_with_them_off_are_deleted(
    conn: Connection,
) -> None:
    agent, _ = recording_agent("f")
    async with (
        direct(conn) as lane_conn,
        running_sidecar(lane_conn, "f-1", ("text.echo",), transport=agent),
    ):
        async with running_dispatcher(lane_conn):
            await published(conn, "text.echo")
        async with (
            direct(conn, on=False) as off,
            running_dispatcher(off),  # the lane off now: at its start, not 5 s later
        ):

            async def deleted() -> bool:
                return await lane_of(conn, "text.echo") is None

            await eventually(deleted, timeout_s=3.0)


async def test_an_alias_gets_no_lane_of_its_own(conn: Connection) -> None:
    """Routing reads an alias as its capability, whose pool may be larger than the cards
    that list the alias: the lane is published under the capability's own name only."""
    agent, _ = recording_agent("f", "text.say")
    loose = msgspec.structs.replace(
        conn.settings,
        direct_lane=True,
        capability_mode="loose",
        capability_aliases={"text.echo": "text.say"},
    )
    async with (
        connected(loose) as lane_conn,
        running_dispatcher(lane_conn),
        running_sidecar(lane_conn, "f-1", ("text.say", "text.echo"), transport=agent),
    ):
        await published(conn, "text.say")
        assert await lane_of(conn, "text.echo") is None


async def test_a_client_remembers_a_bounded_number_of_lanes(conn: Connection) -> None:
    """A gateway's callers may name any number of capabilities: what the client keeps of
    their lanes (here: that there are none) stays bounded."""
    client = Client(conn)
    for n in range(MAX_LANES_KEPT + 20):
        await client.submit(Envelope(capability=f"cap.n{n}", payload=msgspec.Raw(b"{}")))
    assert len(client.direct._read) == MAX_LANES_KEPT
    assert await conn.call("XLEN", conn.keys.ingress) == MAX_LANES_KEPT + 20


async def test_a_direct_deadline_goes_to_a_due_set_the_fleet_s_reapers_scan(
    conn: Connection,
) -> None:
    """A producer configured with more ``ingress_partitions`` than the fleet would put the
    deadline entry in a due partition no reaper scans: it follows the lane's count."""
    producer_settings = msgspec.structs.replace(conn.settings, ingress_partitions=4)
    own_count = dataclasses.replace(conn.keys, partitions=4)
    message_id = next(f"p-{n}" for n in range(100) if due_for(own_count, f"p-{n}") != conn.keys.due)
    agent, _ = recording_agent("f")
    async with one_instance_lane(conn, agent), connected(producer_settings) as producer:
        client = Client(producer)
        sent = await client.submit(envelope(id=message_id))
        assert await recorded(conn, sent)  # down the lane: the record is there at once
        look = await conn.call("ZSCORE", conn.keys.due, sent)
        stray = await conn.call("ZSCORE", due_for(own_count, sent), sent)
        await all_succeeded(client, [sent])
    assert look is not None and stray is None
    assert await conn.call("XLEN", conn.keys.ingress) == 0


async def test_no_lane_is_published_over_work_a_stopped_dispatcher_left_waiting(
    conn: Connection,
) -> None:
    """What waits goes first: a dispatcher that starts publishes no lane for a capability
    the waiting index lists until a drain has met it (here not before the next sweep, a
    minute away), and the waiting message runs."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    left = complete(envelope())
    now = now_ms()
    await store.accept(
        Acceptance(
            left.message_id,
            encode_envelope(left),
            "text.echo",
            deadline_ms=now + 60_000,
            reply_to=left.reply_to or "",
            priority=0,
            next_stage=Stage.WAITING,
            accepted_ms=now,
            reply_to_in_envelope=True,
        )
    )
    await store.waiting.park("text.echo", left.message_id, 0, now)
    slow_sweeps = msgspec.structs.replace(conn.settings, direct_lane=True, sweep_interval_s=60.0)
    async with (
        connected(slow_sweeps) as broker,
        running_sidecar(broker, "f-1", ("text.echo",), transport=agent),
        running_dispatcher(broker),
    ):
        assert await lane_of(conn, "text.echo") is None
        await all_succeeded(Client(conn), [left.message_id])
        assert await lane_of(conn, "text.echo") is None  # still: the next sweep publishes
    assert calls == [left.message_id]
