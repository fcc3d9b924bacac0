"""Routing with real sidecars, real HTTP agents and a real Redis: decisions recorded on the
record, session affinity, draining, no-match answers, weights at run time."""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from pathlib import Path

import anyio
import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.envelope import Envelope
from broker.errors import RedisUnavailable, first_leaf
from broker.records import InstanceCard, InstanceState
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.wire import route_steps
from tests.conftest import suite_redis_binary
from tests.support.agents import Gate, http_agent
from tests.support.harness import card as harness_card
from tests.support.harness import (
    collect_replies,
    eventually,
    running_dispatcher,
    running_sidecar,
)


def request(capability: str, reply_to: str, n: int = 0, **fields: object) -> Envelope:
    raw = msgspec.json.encode(
        {"capability": capability, "reply_to": reply_to, "payload": {"n": n}, **fields}
    )
    return msgspec.json.decode(raw, type=Envelope)


async def test_the_decision_is_recorded_and_traced(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("logistics") as logistics,
        http_agent("order") as order,
        running_sidecar(conn, "logistics-1", ("logistics.track",), url=logistics.url),
        running_sidecar(conn, "order-1", ("order.query",), url=order.url),
        running_dispatcher(conn),
    ):
        message_id = await client.submit(request("logistics.track", reply_to, tags={}))
        await collect_replies(conn, reply_to, 1)
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None and record.instance == "logistics-1"
    assert record.route_reason is not None and "weighted random" in record.route_reason
    steps = route_steps(record.route_from)
    assert [s["step"] for s in steps] == [
        "capability",
        "selectors",
        "state",
        "load",
        "score",
        "choose",
    ]
    assert steps[0] == {"step": "capability", "kept": 1, "more_excluded": 1}


async def test_no_capability_match_waits_then_expires_naming_the_nearest(
    conn: Connection,
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("order") as order,
        running_sidecar(conn, "order-1", ("order.create",), url=order.url),
        running_dispatcher(conn),
    ):
        message_id = await client.submit(request("order.creat", reply_to, timeout_s=0.5))
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=15)).values()
    assert result.id == message_id and result.stage is Stage.EXPIRED
    assert result.error is not None
    assert result.error.startswith("no_capability_match") and "order.create" in result.error
    trace = await client.trace(message_id)
    assert [e.stage for e in trace.timeline] == [Stage.ACCEPTED, Stage.WAITING, Stage.EXPIRED]
    assert order.log.total == 0


async def test_all_candidates_down_is_the_reason_when_every_instance_is_down(
    conn: Connection,
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    registry = Registry(conn)
    for inst in ("order-1", "order-2"):
        card = InstanceCard(
            agent_id="order",
            instance_id=inst,
            capabilities=("order.create",),
            endpoint="http://127.0.0.1:9/",
            max_inflight=4,
        )
        await registry.register(card, credits=4)
        await registry.set_state(inst, InstanceState.DOWN)
    async with running_dispatcher(conn):
        message_id = await client.submit(request("order.create", reply_to, timeout_s=0.5))
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=15)).values()
    assert result.stage is Stage.EXPIRED and result.error == "all_candidates_down"
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None and record.route_reason == "all_candidates_down"


async def test_a_session_keeps_its_instance_and_moves_when_it_goes_down(
    settings: Settings,
) -> None:
    """100 requests of one session land on one instance; when it goes DOWN (its agent fails
    every call, its sidecar reports DOWN and announces it), the session moves, and nothing is
    assigned to it once the notification had a second to arrive."""
    quick = msgspec.structs.replace(settings, heartbeat_s=0.2, down_after_s=1.0)
    assert quick.redis_url is not None
    failing: set[str] = set()

    async def maybe_fail(envelope: dict[str, object], req: Request) -> Response | None:
        return JSONResponse({"error": "down"}, status_code=500) if req.url.port in failing else None

    async with open_connection(quick, quick.redis_url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        store = MessageStore(conn)
        async with (
            http_agent("a", behaviour=maybe_fail) as a,
            http_agent("b", behaviour=maybe_fail) as b,
            http_agent("c", behaviour=maybe_fail) as c,
            running_sidecar(conn, "a-1", ("chat.reply",), url=a.url, max_inflight=64),
            running_sidecar(conn, "b-1", ("chat.reply",), url=b.url, max_inflight=64),
            running_sidecar(conn, "c-1", ("chat.reply",), url=c.url, max_inflight=64),
            running_dispatcher(conn) as dispatcher,
        ):
            conversation = client.new_reply_stream()

            async def converse(turns: int) -> list[str]:
                """One request after another's answer, as a chat session would."""
                sent = []
                for n in range(turns):
                    envelope = request("chat.reply", conversation, n, session_id="s-42")
                    sent.append(await client.submit(envelope))
                    with anyio.fail_after(10):
                        assert await client.wait_reply(conversation, sent[-1], timeout_s=10)
                return sent

            first = await converse(100)
            homes = {(await store.get_record(i)).instance for i in first}  # type: ignore[union-attr]
            assert len(homes) == 1
            (home,) = homes
            agents = {"a-1": a, "b-1": b, "c-1": c}
            failing.add(int(agents[home].url.rsplit(":", 1)[1].strip("/")))
            # drive its error rate over 50 %: its sidecar reports DOWN on the next heartbeat
            # (once it reports DOWN the rest of these wait, and expire after their 5 s)
            await client.submit_many(
                [request("chat.reply", reply_to, target=home, timeout_s=5) for _ in range(120)]
            )

            async def reported_down() -> bool:
                return await conn.call("HGET", conn.keys.card(home), "state") == b"DOWN"

            await eventually(reported_down, timeout_s=10)

            async def dispatcher_knows() -> bool:
                views = {v.instance_id: v for v in dispatcher.table.instances}
                return views[home].state is InstanceState.DOWN

            # the notification bound under test: the dispatcher's view within a second
            await eventually(dispatcher_knows, timeout_s=1.0)
            after = await converse(30)
            results = {i: await client.result(i) for i in after}
        moved = {(await store.get_record(i)).instance for i in after}  # type: ignore[union-attr]
    assert home not in moved and len(moved) == 1  # the session moved, and stayed together
    assert all(r is not None and r.stage is Stage.SUCCEEDED for r in results.values())


async def test_weight_zero_at_run_time_takes_an_instance_out_of_rotation(
    conn: Connection,
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a") as a,
        http_agent("b") as b,
        running_sidecar(conn, "a-1", ("text.echo",), url=a.url, max_inflight=64),
        running_sidecar(conn, "b-1", ("text.echo",), url=b.url, max_inflight=64),
        running_dispatcher(conn) as dispatcher,
    ):
        assert await Registry(conn).set_weight("b-1", 0.0)

        async def dispatcher_knows() -> bool:  # the registry notification reached it
            views = {v.instance_id: v for v in dispatcher.table.instances}
            return views["b-1"].card.weight == 0.0

        await eventually(dispatcher_knows)
        for n in range(60):
            await client.submit(request("text.echo", reply_to, n))
        await collect_replies(conn, reply_to, 60)
    assert a.log.total == 60 and b.log.total == 0
    assert not await Registry(conn).set_weight("nobody-1", 1.0)


async def test_a_state_or_weight_for_an_instance_without_a_card_writes_nothing(
    conn: Connection,
) -> None:
    """An operator's drain or weight, or a sidecar's own drain, meeting a card already gone
    (deregistered meanwhile, or lost with a Redis that restarted empty) leaves no card of one
    field behind: a key with no TTL and no instance, that nothing would ever remove."""
    registry = Registry(conn)
    assert not await registry.drain("gone-1")
    assert not await registry.set_state("gone-1", InstanceState.DRAINING)
    assert not await registry.set_weight("gone-1", 0.5)
    assert await conn.call("EXISTS", conn.keys.card("gone-1")) == 0
    await registry.register(harness_card("here-1", ("text.echo",)), credits=1)
    assert await registry.set_state("here-1", InstanceState.DRAINING)
    assert await conn.call("HGET", conn.keys.card("here-1"), "state") == b"DRAINING"


async def test_draining_under_load_loses_nothing_and_runs_nothing_twice(
    conn: Connection,
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", delay_s=0.02) as a,
        http_agent("b", delay_s=0.02) as b,
        http_agent("c", delay_s=0.02) as c,
        running_sidecar(conn, "a-1", ("text.echo",), url=a.url, max_inflight=32),
        running_sidecar(conn, "b-1", ("text.echo",), url=b.url, max_inflight=32),
        running_sidecar(conn, "c-1", ("text.echo",), url=c.url, max_inflight=32) as drained,
        running_dispatcher(conn),
    ):
        ids = await client.submit_many([request("text.echo", reply_to, n) for n in range(500)])

        async def busy() -> bool:
            return c.log.concurrent > 0

        await eventually(busy)
        assert await Registry(conn).drain("c-1")  # what `agent-reach drain c-1` does
        results = await collect_replies(conn, reply_to, 500)
        with anyio.fail_after(20):
            await drained.stopped.wait()
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert set(results) == set(ids)
    calls = a.log.calls + b.log.calls + c.log.calls
    assert sum(calls.values()) == 500 and max(calls.values()) == 1  # none ran twice
    assert c.log.total > 0  # it was serving when drained
    assert await conn.call("EXISTS", conn.keys.card("c-1")) == 0  # deregistered
    snapshot = json.dumps([v.instance_id for v in await Registry(conn).snapshot()])
    assert "c-1" not in snapshot


@pytest.mark.timeout(90)
async def test_a_sidecar_stopped_while_redis_restarts_records_its_outcomes_and_leaves(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped while Redis is away (a fleet is often stopped because of a failover): the calls
    in flight still get their grace, and Redis back within it, the drain is told, their
    outcomes recorded and the instance deregistered. Nothing runs twice, and a
    non-idempotent agent's finished work is not left NEEDS_CONFIRMATION."""
    binary = suite_redis_binary()
    server = RedisServer.start(tmp_path / "redis", binary=binary)
    own = msgspec.structs.replace(settings, redis_url=server.url)
    gate = Gate()
    try:
        async with (
            open_connection(own, server.url) as conn,
            http_agent("held", behaviour=gate) as agent,
            aclosing(HttpTransport(agent.url, timeout_s=30, max_connections=4)) as transport,
            anyio.create_task_group() as tg,
        ):
            client = Client(conn)
            reply_to = client.new_reply_stream()
            card = harness_card("held-1", ("text.echo",), max_inflight=4)
            sidecar = Sidecar(conn, card, transport, grace_s=30)
            await tg.start(sidecar.run)
            async with running_dispatcher(conn, reaper=False):
                ids = await client.submit_many(
                    [request("text.echo", reply_to, n) for n in range(3)]
                )

                async def all_called() -> bool:
                    return agent.log.concurrent == 3

                await eventually(all_called)
            with caplog.at_level(logging.WARNING, logger="agent_reach.sidecar"):
                server.stop()
                sidecar.stop()  # Redis is gone: the drain cannot tell anyone

                async def drain_untold() -> bool:
                    said = [r.getMessage() for r in caplog.records]
                    return any("draining: Redis is unavailable" in m for m in said)

                await eventually(drain_untold)
                gate.open()  # the calls end while Redis is away

                async def all_ended() -> bool:
                    return agent.log.concurrent == 0

                await eventually(all_ended)
                server = RedisServer.start(tmp_path / "redis", binary=binary, port=server.port)
                with anyio.fail_after(30):
                    await sidecar.stopped.wait()
            results = await collect_replies(conn, reply_to, 3)
            gone = await conn.call("EXISTS", conn.keys.card("held-1"))
    finally:
        server.stop()
    assert {m: r.stage for m, r in results.items()} == dict.fromkeys(ids, Stage.SUCCEEDED)
    assert sorted(agent.log.calls.values()) == [1, 1, 1]  # none ran twice
    assert gone == 0  # deregistered


@pytest.mark.timeout(60)
async def test_a_sidecar_stopped_while_redis_stays_away_ends_with_the_error_after_its_grace(
    settings: Settings, tmp_path: Path
) -> None:
    """Redis not back within the grace period: the stop ends with the error (the CLI's exit
    code and message), after the grace and not forever; the reaper recovers what is left."""
    server = RedisServer.start(tmp_path / "redis", binary=suite_redis_binary())
    own = msgspec.structs.replace(settings, redis_url=server.url)
    try:
        async with (
            open_connection(own, server.url) as conn,
            aclosing(HttpTransport("http://127.0.0.1:9/", timeout_s=1, max_connections=1)) as t,
        ):
            sidecar = Sidecar(conn, harness_card("left-1", ("text.echo",)), t, grace_s=1.0)
            ended = anyio.Event()
            with pytest.raises(BaseExceptionGroup) as raised:
                async with anyio.create_task_group() as tg:

                    async def run() -> None:
                        try:
                            await sidecar.run()
                        finally:
                            ended.set()

                    tg.start_soon(run)
                    await eventually(lambda: conn.call("EXISTS", conn.keys.card("left-1")))
                    server.stop()
                    began = anyio.current_time()
                    sidecar.stop()
                    with anyio.fail_after(15):
                        await ended.wait()
                    took_s = anyio.current_time() - began
    finally:
        server.stop()
    assert isinstance(first_leaf(raised.value), RedisUnavailable)
    assert 1.0 <= took_s < 15  # it waited out the grace, and no longer than a pause more
    assert not sidecar.stopped.is_set()


async def test_draining_reroutes_work_assigned_but_never_read(conn: Connection) -> None:
    """Entries already in a draining instance's stream, never read, go back to WAITING and
    are served elsewhere; their credits are returned."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    registry = Registry(conn)
    card = InstanceCard(
        agent_id="idle",
        instance_id="idle-1",
        capabilities=("text.echo",),
        endpoint="http://127.0.0.1:9/",
        max_inflight=5,
    )
    await registry.register(card, credits=5)
    async with http_agent("live") as live:
        async with running_dispatcher(conn):
            ids = await client.submit_many([request("text.echo", reply_to, n) for n in range(5)])

            async def assigned() -> bool:
                return int(await conn.call("XLEN", conn.keys.queue("idle-1"))) == 5

            await eventually(assigned)
            transport = HttpTransport(live.url, timeout_s=5, max_connections=5)
            sidecar = Sidecar(conn, card, transport, grace_s=5)
            sidecar.stop()  # drained before it reads anything
            await sidecar.run()
            await transport.aclose()
            async with running_sidecar(conn, "live-1", ("text.echo",), url=live.url):
                results = await collect_replies(conn, reply_to, 5)
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    store = MessageStore(conn)
    for message_id in ids:
        trace = [e.stage for e in await store.get_timeline(message_id)]
        assert trace == [
            Stage.ACCEPTED,
            Stage.ROUTED,
            Stage.WAITING,
            Stage.ROUTED,
            Stage.RECEIVED,
            Stage.PROCESSING,
            Stage.SUCCEEDED,
        ]
    assert live.log.total == 5
    assert int(await conn.call("SCARD", conn.keys.inflight("idle-1"))) == 0


async def test_a_stop_finds_nothing_unread_in_a_work_stream_that_is_gone(conn: Connection) -> None:
    """The instance's work stream is gone when its stop looks for work never read (a Redis
    that came back without its data, before the intake made it again): nothing to send back,
    and the stop goes on instead of failing on the missing stream."""
    async with aclosing(HttpTransport("http://127.0.0.1:9/", timeout_s=1, max_connections=1)) as t:
        sidecar = Sidecar(conn, harness_card("gone-1", ("text.echo",)), t, grace_s=1.0)
        sidecar.stop()
        finished = anyio.Event()

        async def finish() -> None:
            finished.set()

        await sidecar.lifecycle.settle(finish)
    assert finished.is_set()
    assert await conn.call("EXISTS", conn.keys.queue("gone-1")) == 0
