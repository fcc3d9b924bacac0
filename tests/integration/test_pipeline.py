"""The core pipeline end to end: real redis-server, real HTTP agents on loopback."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import anyio
import msgspec

from broker.client import Client, Result
from broker.cluster_map import ORDER_BARRIER
from broker.config import Settings
from broker.connection import Connection, ensure_group, open_connection
from broker.envelope import Envelope
from broker.governance import RateLimit, RateLimits
from broker.keyspace import DISPATCH_GROUP, ingress_for, ingress_streams
from broker.registry import Registry
from broker.scripts import ScriptName
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import Gate, http_agent
from tests.support.harness import (
    card,
    collect_replies,
    connected,
    dead_letters,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from workers.assignment import Assigned, Assigner, Routed
from workers.dispatcher import Dispatcher
from workers.waiting import WaitingRoom

HAPPY_PATH = [Stage.ACCEPTED, Stage.ROUTED, Stage.RECEIVED, Stage.PROCESSING, Stage.SUCCEEDED]


def echo(n: int, reply_to: str) -> Envelope:
    return Envelope(
        capability="text.echo",
        payload=msgspec.Raw(msgspec.json.encode({"n": n})),
        reply_to=reply_to,
    )


async def test_thousand_envelopes_through_two_http_agents(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a") as agent_a,
        http_agent("b") as agent_b,
        # static credits: this is the happy path with room for every message at once
        running_sidecar(
            conn, "a-1", ("text.echo",), url=agent_a.url, max_inflight=600, adaptive_credits=False
        ),
        running_sidecar(
            conn, "b-1", ("text.echo",), url=agent_b.url, max_inflight=600, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        ids = await client.submit_many([echo(n, reply_to) for n in range(1000)])
        results = await collect_replies(conn, reply_to, 1000, timeout_s=180)

    assert set(results) == set(ids)
    store = MessageStore(conn)
    for n, message_id in enumerate(ids):
        result = results[message_id]
        assert result.stage is Stage.SUCCEEDED, result
        assert result.result["echo"] == {"n": n}
        timeline = await store.get_timeline(message_id)
        assert [e.stage for e in timeline] == HAPPY_PATH
    # both agents served, each message exactly once
    assert agent_a.log.total + agent_b.log.total == 1000
    assert agent_a.log.total > 0 and agent_b.log.total > 0
    assert max((agent_a.log.calls + agent_b.log.calls).values()) == 1


async def test_credit_limit_holds_and_excess_waits_outside_the_stream(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    peaks = {"stream": 0, "credits": 0, "waiting": 0}
    store = MessageStore(conn)

    async def watch() -> None:
        while True:
            (stream,) = await Registry(conn).stream_backlogs(["slow-1"])
            peaks["stream"] = max(peaks["stream"], stream)
            in_use = int(await conn.call("SCARD", conn.keys.inflight("slow-1")))
            peaks["credits"] = max(peaks["credits"], in_use)
            peaks["waiting"] = max(peaks["waiting"], await store.waiting.depth("text.echo"))
            await anyio.sleep(0.005)

    async with (
        http_agent("slow", delay_s=0.01) as agent,
        running_sidecar(
            conn, "slow-1", ("text.echo",), url=agent.url, max_inflight=2, adaptive_credits=False
        ),
        running_dispatcher(conn),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(watch)
        ids = await client.submit_many([echo(n, reply_to) for n in range(200)])
        results = await collect_replies(conn, reply_to, 200)
        tg.cancel_scope.cancel()

    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert set(results) == set(ids)
    assert agent.log.peak_concurrent == 2  # measured at the agent: never more than its credits
    assert agent.log.total == 200
    assert peaks["stream"] <= 2 and peaks["credits"] <= 2
    assert peaks["waiting"] > 100  # the backlog waited in the capability's waiting set
    # a lost race for a credit does not count as a delivery attempt
    assert {(await store.get_record(i)).attempt for i in ids} == {1}  # type: ignore[union-attr]
    waited = [await store.get_timeline(i) for i in ids[-10:]]
    assert all(
        [e.stage for e in t][:3] == [Stage.ACCEPTED, Stage.WAITING, Stage.ROUTED] for t in waited
    )


async def test_same_id_submitted_twice_executes_once(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    first = msgspec.structs.replace(echo(1, reply_to), id="order-42")
    # the same request, written another way: JSON is compared, not its spacing
    spaced = msgspec.structs.replace(first, payload=msgspec.Raw(b'{ "n" : 1 }'))
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        await client.submit(first)
        await client.submit(spaced)  # a producer's retry: the same request
        results = await collect_replies(conn, reply_to, 1)
        # a later retry, from another reply stream: nothing runs, nothing is refused
        elsewhere = client.new_reply_stream()
        await client.submit(msgspec.structs.replace(first, reply_to=elsewhere))
        marker = await client.submit(echo(3, reply_to))
        results = await collect_replies(conn, reply_to, 2)
        told_elsewhere = await conn.call("XLEN", elsewhere)

    assert set(results) == {"order-42", marker}
    assert agent.log.calls["order-42"] == 1
    assert results["order-42"].result["echo"] == {"n": 1}
    assert told_elsewhere == 0  # the answer went where the first submission asked


async def test_another_request_under_a_taken_id_is_refused_and_the_first_untouched(
    conn: Connection,
) -> None:
    """The refusal names the refused request: the producer that sent it takes it as its
    answer; one waiting for the message that holds the id (here on the very same reply
    stream) does not."""
    gate = Gate()  # the first stays in flight meanwhile
    async with (
        http_agent("a", behaviour=gate) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
        Client(conn) as owner,
    ):
        waiting = anyio.Event()
        answers: dict[str, Result] = {}

        async def ask_first() -> None:
            answers["first"] = await owner.request("text.echo", {"n": 1}, timeout=30, id="order-43")
            waiting.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_first)
            await eventually(lambda: _has_record(conn, "order-43"))
            # another producer's different request under the same id, naming the first
            # producer's reply stream: its refusal must not end the first one's wait
            assert owner.reply_stream is not None
            squat = msgspec.structs.replace(echo(2, owner.reply_stream), id="order-43")
            await Client(conn).submit(squat)
            async with Client(conn) as other:
                refused = await other.request("text.echo", {"n": 3}, timeout=30, id="order-43")
            assert not waiting.is_set()
            gate.open()

    assert refused.stage is Stage.REJECTED
    assert (refused.error or "").startswith("id_conflict: id order-43")
    assert answers["first"].ok and answers["first"].result["echo"] == {"n": 1}
    assert agent.log.calls["order-43"] == 1
    letters = [e for e in await dead_letters(conn) if e["id"] == b"order-43"]
    assert len(letters) == 2 and all(e["reason"].startswith(b"id_conflict") for e in letters)


async def _has_record(conn: Connection, message_id: str) -> bool:
    return await MessageStore(conn).get_record(message_id) is not None


async def test_timeline_records_instance_attempt_and_time(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        message_id = await client.submit(echo(7, reply_to))
        await collect_replies(conn, reply_to, 1)
    trace = await client.trace(message_id)
    assert trace.record.stage is Stage.SUCCEEDED
    assert [e.instance for e in trace.timeline[1:]] == ["a-1"] * 4
    assert [e.attempt for e in trace.timeline] == [0, 1, 1, 1, 1]
    times = [e.ts_ms for e in trace.timeline]
    assert times == sorted(times) and times[0] > 0
    headers = agent.log.headers[0]
    assert headers["x-reach-message-id"] == message_id
    assert headers["x-reach-idempotency-key"] == message_id
    assert headers["x-reach-attempt"] == "1"


async def test_instances_stay_routable_under_steady_traffic(settings: Settings) -> None:
    """Regression: under continuous credit notifications the periodic registry refresh never
    ran, so after down_after_s every instance looked dead and messages waited a sweep."""
    # a heartbeat every 0.5 s, a refresh every 0.5 s: a healthy instance's beat, as routing
    # sees it, is at most ~1 s old; 2.5 s leaves room for a stall of the loaded machine
    quick = msgspec.structs.replace(settings, down_after_s=2.5, sweep_interval_s=0.5)
    assert quick.redis_url is not None
    async with open_connection(quick, quick.redis_url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        async with (
            http_agent("a") as agent,
            # static credits: this test is about the registry snapshot, not the credit limit
            running_sidecar(
                conn,
                "a-1",
                ("text.echo",),
                url=agent.url,
                max_inflight=64,
                adaptive_credits=False,
            ),
            running_dispatcher(conn),
        ):
            ids = []
            with anyio.move_on_after(2 * quick.down_after_s):  # never refreshed: dead by half
                while True:  # a steady stream, so credit notifications never pause
                    ids.append(await client.submit(echo(len(ids), reply_to)))
                    await anyio.sleep(0.005)
            await collect_replies(conn, reply_to, len(ids))
        store = MessageStore(conn)
        waited = [i for i in ids if Stage.WAITING in {e.stage for e in await store.get_timeline(i)}]
    assert len(ids) > 300
    assert waited == []


async def test_a_partitioned_ingress_carries_every_message_once(settings: Settings) -> None:
    """``ingress_partitions = 3``: the client spreads envelopes over ``P:in``, ``P:in:{1}``,
    ``P:in:{2}`` by message id (a session's by its session id), a raw producer may write to
    any of them, and one dispatcher consumes them all."""
    partitioned = msgspec.structs.replace(settings, ingress_partitions=3)
    assert partitioned.redis_url is not None
    async with open_connection(partitioned, partitioned.redis_url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        streams = ingress_streams(conn.keys, 3)
        raw = {"capability": "text.echo", "payload": {"n": -1}, "reply_to": reply_to}
        async with (
            http_agent("a") as agent,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=300),
            running_dispatcher(conn),
        ):
            ids = await client.submit_many([echo(n, reply_to) for n in range(600)])
            ids += await client.submit_many(
                [Envelope(capability="text.echo", reply_to=reply_to, session_id="s-7")] * 2
            )
            await conn.call("XADD", streams[2], "*", "envelope", msgspec.json.encode(raw))
            results = await collect_replies(conn, reply_to, 603, timeout_s=180)

    assert set(ids) <= set(results) and len(results) == 603
    assert all(r.stage is Stage.SUCCEEDED for r in results.values())
    assert agent.log.total == 603 and max(agent.log.calls.values()) == 1
    spread = Counter(ingress_for(conn.keys, message_id, 3) for message_id in ids[:600])
    assert set(spread) == set(streams) and min(spread.values()) > 100, spread


@contextmanager
def watching(conn: Connection) -> Iterator[list[list[tuple[object, ...]]]]:
    """Each batch of commands this process sends through ``conn`` while in the block, in
    order, once: at an order barrier a pipeliner calls itself again with the batch split
    (a cluster's) or without the barrier (one server's), and those are not sent twice."""
    rounds: list[list[tuple[object, ...]]] = []
    pipeliner = conn.pipeliner
    inner = pipeliner.call_many
    nested: ContextVar[bool] = ContextVar("nested", default=False)

    async def watched(commands: list[tuple[object, ...]]) -> list[object]:
        if nested.get():
            return await inner(commands)
        rounds.append(list(commands))
        token = nested.set(True)
        try:
            return await inner(commands)
        finally:
            nested.reset(token)

    pipeliner.call_many = watched  # type: ignore[method-assign]
    try:
        yield rounds
    finally:
        pipeliner.call_many = inner  # type: ignore[method-assign]


def scripts_sent(rounds: list[list[tuple[object, ...]]]) -> Counter[object]:
    """How many times each script (by sha) was sent."""
    return Counter(c[1] for r in rounds for c in r if c[0] == "EVALSHA")


async def test_a_routed_message_takes_one_script_on_one_server(conn: Connection) -> None:
    """On one server a record ROUTED is created and assigned by one script
    (``lua/accept_assign.lua``); a cluster, whose record and instance keys live in other
    slots, keeps the two. Either way the message runs once, every stage recorded."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
    ):
        dispatcher = Dispatcher(conn, consumer="d1")
        await ensure_group(conn, conn.keys.ingress, DISPATCH_GROUP)
        await dispatcher.refresh()
        ids = await client.submit_many([echo(n, reply_to) for n in range(3)])  # the ingress
        async with conn.reader() as reader:
            entries = await reader.read_raw(
                conn.keys.ingress, DISPATCH_GROUP, "d1", count=10, block_ms=1000
            )
        with watching(conn) as rounds:
            await dispatcher.handle_batch(entries)
        results = await collect_replies(conn, reply_to, 3)
        store = MessageStore(conn)
        timelines = [[e.stage for e in await store.get_timeline(i)] for i in ids]
    scripts = scripts_sent(rounds)
    fused, accept, assign = (
        conn.sha(name) for name in (ScriptName.ACCEPT_ASSIGN, ScriptName.ACCEPT, ScriptName.ASSIGN)
    )
    if conn.cluster:
        assert (scripts[fused], scripts[accept], scripts[assign]) == (0, 3, 3)
    else:
        assert (scripts[fused], scripts[accept], scripts[assign]) == (3, 0, 0)
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert agent.log.total == 3
    assert timelines == [HAPPY_PATH] * 3


async def parked_behind_earlier_work(
    conn: Connection, reply_to: str, count: int
) -> tuple[Dispatcher, list[str]]:
    """``count`` echo messages handled by a dispatcher (not running) that believes earlier
    work of their capability waits, so each is parked whatever the free credits."""
    dispatcher = Dispatcher(conn, consumer="d1")
    await ensure_group(conn, conn.keys.ingress, DISPATCH_GROUP)
    await dispatcher.refresh()
    dispatcher.waiting.backlogged.add("text.echo")
    ids = await Client(conn).submit_many([echo(n, reply_to) for n in range(count)])
    async with conn.reader() as reader:
        entries = await reader.read_raw(
            conn.keys.ingress, DISPATCH_GROUP, "d1", count=count, block_ms=1000
        )
    await dispatcher.handle_batch(entries)
    return dispatcher, ids


async def test_many_free_credits_are_handed_out_in_passes_of_a_small_pipeline_each(
    conn: Connection,
) -> None:
    """80 credits free at once, 200 messages waiting: one drain assigns 80, in passes of at
    most ``ingress_batch`` claims, each its own round trip — one pipeline of 80 scripts would
    hold Redis while the sidecars' outcomes wait."""
    held = Gate()
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=held) as agent,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=agent.url, max_inflight=80, adaptive_credits=False
        ),
    ):
        dispatcher, ids = await parked_behind_earlier_work(conn, reply_to, 200)
        parked = await store.waiting.depth("text.echo")
        with watching(conn) as rounds:
            assigned = await dispatcher.waiting.drain(["text.echo"])
        held.open()
        async with running_dispatcher(conn):
            results = await collect_replies(conn, reply_to, 200)
    claim = conn.sha(ScriptName.ASSIGN if conn.cluster else ScriptName.CLAIM_ASSIGN)
    claims = [n for r in rounds if (n := sum(c[:2] == ("EVALSHA", claim) for c in r))]
    assert parked == 200 and assigned == 80
    assert sum(claims) == 80 and max(claims) == conn.settings.ingress_batch == 32, claims
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED} and set(results) == set(ids)
    assert agent.log.total == 200 and max(agent.log.calls.values()) == 1


class ComingBack(Assigner):
    """Assigns, then at once does what a sidecar that could not reach its agent does with
    each attempt: back to WAITING, parked again — before the drain that assigned it has
    removed the waiting entry it was claimed from."""

    async def assign(self, routed: list[Routed], **options: Any) -> Assigned:
        assigned = await super().assign(routed, **options)
        for r in assigned.routed:
            moved = await self.store.move(
                r.message_id, Stage.WAITING, only_from=Stage.ROUTED, reason="agent not reached"
            )
            assert moved.ok, moved
            await self.store.waiting.park(r.capability, r.message_id, r.priority, r.accepted_ms)
        return assigned


async def drained_coming_back(conn: Connection) -> tuple[MessageStore, list[str], list[Any]]:
    """Two parked messages drained by a room whose assigner sends each straight back to
    WAITING, parked again (:class:`ComingBack`). Returns their ids and the rounds sent."""
    store = MessageStore(conn)
    reply_to = Client(conn).new_reply_stream()
    await Registry(conn).register(card("a-1", ("text.echo",), max_inflight=4), credits=4)
    dispatcher, ids = await parked_behind_earlier_work(conn, reply_to, 2)
    assert await store.waiting.depth("text.echo") == 2
    room = WaitingRoom(
        store, dispatcher.table, batch=32, assigner=ComingBack(store, dispatcher.table)
    )
    with watching(conn) as rounds:
        assert await room.drain(["text.echo"]) == 2
    assert await store.stages(ids) == [Stage.WAITING] * 2
    scores = [await conn.call("ZSCORE", conn.keys.waiting("text.echo"), i) for i in ids]
    assert None not in scores, scores  # never WAITING and in no set
    return store, ids, rounds


async def test_a_drained_message_back_in_waiting_keeps_its_new_entry(conn: Connection) -> None:
    """On one server the claim's script removes the waiting entries of what it assigned
    (``lua/claim_assign.lua``): a message back in WAITING after that has parked itself
    again, and the drain neither removes entries nor reads stages back."""
    _, _, rounds = await drained_coming_back(conn)
    sent = [c for r in rounds for c in r]
    assert not [c for c in sent if c[0] in ("ZREM", "HGET")], sent


async def test_a_drained_message_back_in_waiting_before_its_entry_goes_is_parked_again(
    settings: Settings,
) -> None:
    """Where the claim and the assignment are two steps (a cluster; on one server, with a
    rate limit to check between them), the drain removes the waiting entries of what it
    assigned, then reads their stages after the removal, in the same batch (one round
    trip on one server; on a cluster a second, behind an order barrier): one back in
    WAITING by then had its own entry removed too, and is parked again — never WAITING
    and in no set, which only the sweep's repair would find."""
    limits = RateLimits(capability={"text.echo": RateLimit("1000/s", burst=100)})
    async with connected(msgspec.structs.replace(settings, rate_limits=limits)) as conn:
        _, _, rounds = await drained_coming_back(conn)
    removals = next(r for r in rounds if {"ZREM", "HGET"} <= {c[0] for c in r})
    removed = [n for n, c in enumerate(removals) if c[0] == "ZREM"]
    read = [n for n, c in enumerate(removals) if c[0] == "HGET"]
    assert len(read) == 2 and min(read) > max(removed), removals
    assert ORDER_BARRIER in removals[max(removed) + 1 : min(read)], removals


async def test_a_drained_message_is_claimed_and_assigned_in_one_script_on_one_server(
    conn: Connection,
) -> None:
    """Work that waited for an instance: on one server the drain's claim and assignment are
    one script (``lua/claim_assign.lua``); a cluster keeps the two."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with http_agent("a") as agent, running_dispatcher(conn):
        ids = [await client.submit(echo(n, reply_to)) for n in range(3)]
        store = MessageStore(conn)

        async def all_wait() -> bool:
            return await store.stages(ids) == [Stage.WAITING] * 3

        await eventually(all_wait)
        with watching(conn) as rounds:
            async with running_sidecar(conn, "a-1", ("text.echo",), url=agent.url):
                results = await collect_replies(conn, reply_to, 3)
        timelines = [[e.stage for e in await store.get_timeline(i)] for i in ids]
    scripts = scripts_sent(rounds)
    fused, assign = (conn.sha(name) for name in (ScriptName.CLAIM_ASSIGN, ScriptName.ASSIGN))
    assert (scripts[fused], scripts[assign]) == ((0, 3) if conn.cluster else (3, 0))
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED} and agent.log.total == 3
    waited = [Stage.ACCEPTED, Stage.WAITING, *HAPPY_PATH[1:]]
    assert timelines == [waited] * 3
