"""Fair, ordered, bounded waiting: saturation, priority, capabilities sharing an instance,
several dispatchers draining at once. Real Redis, real HTTP agents on loopback."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import anyio
import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import Response

from adapters.python import Agent
from bench.profile import commandstats
from broker.client import Client
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.operator import Operator
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore, Move
from tests.integration.test_pipeline import watching
from tests.support.agents import Gate, http_agent
from tests.support.harness import (
    card,
    collect_replies,
    connected,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from tests.support.repair import record_in
from workers.dispatcher import Dispatcher


def request(capability: str, reply_to: str, **fields: object) -> Envelope:
    raw = msgspec.json.encode({"capability": capability, "reply_to": reply_to, **fields})
    return msgspec.json.decode(raw, type=Envelope)


async def used_memory(conn: Connection) -> int:
    info = (await conn.call("INFO", "memory")).decode()
    return int(next(line for line in info.splitlines() if line.startswith("used_memory:"))[12:])


async def submit_in_chunks(client: Client, envelopes: list[Envelope]) -> list[str]:
    ids: list[str] = []
    for start in range(0, len(envelopes), 500):
        ids += await client.submit_many(envelopes[start : start + 500])
    return ids


async def test_saturated_work_waits_bounded_and_completes_in_priority_order(
    conn: Connection,
) -> None:
    """5,000 requests on two saturated instances wait in the waiting set (bounded memory per
    message), then all complete once capacity returns; a priority-9 request submitted last is
    served before the priority-0 backlog."""
    held = Gate()
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    n = 5_000
    async with (
        http_agent("a", behaviour=held) as agent_a,
        http_agent("b", behaviour=held) as agent_b,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent_a.url, max_inflight=2),
        running_sidecar(conn, "b-1", ("text.echo",), url=agent_b.url, max_inflight=2),
        running_dispatcher(conn),
    ):
        baseline = await used_memory(conn)
        backlog = await submit_in_chunks(
            client, [request("text.echo", reply_to, payload=i) for i in range(n)]
        )

        async def all_waiting() -> bool:
            return await store.waiting.depth("text.echo") == n - 4

        await eventually(all_waiting, timeout_s=60)
        per_message = (await used_memory(conn) - baseline) / n
        (urgent,) = await client.submit_many([request("text.echo", reply_to, priority=9)])

        async def urgent_waits() -> bool:
            return await store.waiting.depth("text.echo") == n - 3

        await eventually(urgent_waits)
        held.open()
        results = await collect_replies(conn, reply_to, n + 1, timeout_s=240)

    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert max((agent_a.log.calls + agent_b.log.calls).values()) == 1
    # Each waiting message costs its record (a listpack, its timeline inside), its waiting-set
    # and deadline entries and, until the dispatcher trims it, its ingress entry: ~1.1 KB
    # here; a hashtable record or a timeline key of its own would pass 2 KB.
    assert per_message < 1536, per_message
    offered: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for message_id, record in zip(
        ids := [urgent, *backlog], await store.get_records(ids), strict=True
    ):
        assert record is not None
        timeline = await store.get_timeline(message_id)
        stages = [e.stage for e in timeline]
        if Stage.WAITING in stages:
            # when the drain first offered it a credit: its first ROUTED after it first
            # waited. (A message the dispatcher routed on arrival, to an instance whose credits
            # were all taken meanwhile, was refused and sent to WAITING: that ROUTED came
            # before it waited, before the urgent one existed, and is not the drain's.) The
            # drain's offer may be refused too (its view of a credit is a hint a late
            # notification can outdate): it waits again at the head, and a younger message
            # offered in the same pass to another instance may go first. Its delivery follows
            # a ROUTED all the same.
            first_wait = stages.index(Stage.WAITING)
            offered[message_id] = timeline[stages.index(Stage.ROUTED, first_wait)].ts_ms
            assert stages[stages.index(Stage.RECEIVED) - 1] is Stage.ROUTED
            accepted[message_id] = record.accepted_ms
    assert len(offered) == n - 3  # the four that never waited are not part of the order
    assert offered[urgent] <= min(t for i, t in offered.items() if i != urgent)
    # ... and the backlog was offered oldest first (age is kept to the millisecond)
    waited = sorted((accepted[i], offered[i]) for i in offered if i != urgent)
    assert [t for _, t in waited] == sorted(t for _, t in waited)


async def test_a_flooded_capability_does_not_starve_another_on_the_same_instance(
    conn: Connection,
) -> None:
    """``bulk.summarize`` floods the instance it shares with ``chat.reply``; each chat message
    takes one of the next credits that free, not a place behind the flood: between its
    acceptance and its assignment, at most two rounds of the instance's credits go to bulk
    work (behind the flood it would be hundreds). Counted in assignment order, not timed."""

    async def sleep_as_asked(envelope: dict[str, object], request: Request) -> Response | None:
        payload = envelope.get("payload")
        assert isinstance(payload, dict)
        await anyio.sleep(payload["sleep_ms"] / 1000)
        return None

    client = Client(conn)
    store = MessageStore(conn)
    rng = random.Random(7)
    credits = 8

    async def chat_requests(count: int) -> list[str]:
        ids = []
        reply_to = client.new_reply_stream()
        for _ in range(count):
            message_id = await client.submit(
                request("chat.reply", reply_to, payload={"sleep_ms": 100})
            )
            result = await client.wait_reply(reply_to, message_id, timeout_s=30)
            assert result is not None and result.stage is Stage.SUCCEEDED
            ids.append(message_id)
        return ids

    async with (
        http_agent("shared", behaviour=sleep_as_asked) as agent,
        running_sidecar(
            conn,
            "shared-1",
            ("bulk.summarize", "chat.reply"),
            url=agent.url,
            max_inflight=credits,
            adaptive_credits=False,
        ),
        running_dispatcher(conn),
    ):
        bulk_reply = client.new_reply_stream()
        flood = [
            request("bulk.summarize", bulk_reply, payload={"sleep_ms": rng.randint(50, 150)})
            for _ in range(1_000)
        ]
        bulk = await submit_in_chunks(client, flood)

        async def flooded() -> bool:
            return await store.waiting.depth("bulk.summarize") > 500

        await eventually(flooded)
        chats = await chat_requests(30)
        still_flooded = await store.waiting.depth("bulk.summarize")
    assert still_flooded > 0  # the flood lasted the whole measurement
    bulk_routed = sorted(await first_routed_ms(store, bulk))
    for chat in chats:
        timeline = await store.get_timeline(chat)
        accepted = timeline[0].ts_ms
        routed = next(e.ts_ms for e in timeline if e.stage is Stage.ROUTED)
        ahead = [ts for ts in bulk_routed if accepted < ts < routed]
        assert len(ahead) <= 2 * credits, (chat, len(ahead))


async def first_routed_ms(store: MessageStore, message_ids: list[str]) -> list[int]:
    """When each message was first assigned (ms), for those that were."""
    routed = []
    for message_id in message_ids:
        timeline = await store.get_timeline(message_id)
        routed += [e.ts_ms for e in timeline if e.stage is Stage.ROUTED][:1]
    return routed


async def test_three_dispatchers_draining_one_waiting_set_assign_each_message_once(
    conn: Connection,
) -> None:
    held = Gate()
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    n = 600
    async with AsyncExitStack() as stack:
        agent = await stack.enter_async_context(http_agent("a", behaviour=held))
        await stack.enter_async_context(
            running_sidecar(
                conn, "a-1", ("text.echo",), url=agent.url, max_inflight=4, adaptive_credits=False
            )
        )
        dispatchers = [
            await stack.enter_async_context(running_dispatcher(conn, f"d{k}")) for k in (1, 2, 3)
        ]
        ids = await submit_in_chunks(client, [request("text.echo", reply_to) for _ in range(n)])

        async def saturated() -> bool:
            return await store.waiting.depth("text.echo") == n - 4

        await eventually(saturated)
        held.open()  # credits free in a rush: every dispatcher is told, all drain at once
        results = await collect_replies(conn, reply_to, n)
        drained = [d.waiting.assigned for d in dispatchers]

    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert set(agent.log.calls) == set(ids) and set(agent.log.calls.values()) == {1}
    assert sum(drained) == n - 4, drained  # each waiting message was won by one drain
    assert sorted(drained)[1] > 0, drained  # at least two dispatchers really did drain
    for message_id in ids:
        stages = [e.stage for e in await store.get_timeline(message_id)]
        assert stages.count(Stage.RECEIVED) == 1 and stages[-1] is Stage.SUCCEEDED


async def test_work_still_waiting_at_its_deadline_expires_and_is_never_dispatched(
    conn: Connection,
) -> None:
    held = Gate()
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=held) as agent,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=agent.url, max_inflight=1, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        (busy,) = await client.submit_many([request("text.echo", reply_to)])

        async def agent_holds_it() -> bool:
            return agent.log.calls[busy] == 1

        await eventually(agent_holds_it)
        (late,) = await client.submit_many([request("text.echo", reply_to, timeout_s=1)])
        expired = await client.wait_reply(reply_to, late, timeout_s=20)
        held.open()
        done = await client.wait_reply(reply_to, busy, timeout_s=20)
    assert expired is not None and expired.stage is Stage.EXPIRED
    assert expired.error == "waited_past_deadline"
    assert done is not None and done.stage is Stage.SUCCEEDED
    assert late not in agent.log.calls and agent.log.calls[busy] == 1
    stages = [e.stage for e in await MessageStore(conn).get_timeline(late)]
    assert stages[0] is Stage.ACCEPTED and stages[-2:] == [Stage.WAITING, Stage.EXPIRED]
    assert Stage.RECEIVED not in stages  # never handed to the agent's sidecar


async def test_arrivals_do_not_queue_behind_waiting_work_no_instance_can_take(
    conn: Connection,
) -> None:
    """Hundreds wait for an instance that is not there: they are set aside, so new work for
    the one that is is served at once; when the missing instance registers, they run."""
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a") as agent,
        http_agent("ghost") as ghost,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=4),
        running_dispatcher(conn),
    ):
        stranded = await submit_in_chunks(
            client, [request("text.echo", reply_to, target="ghost-1") for _ in range(300)]
        )

        async def all_waiting() -> bool:
            return await store.waiting.depth("text.echo") == 300

        await eventually(all_waiting)
        served = await client.submit_many([request("text.echo", reply_to) for _ in range(20)])
        results = await collect_replies(conn, reply_to, 20, timeout_s=20)
        still_waiting = await store.waiting.depth("text.echo")
        set_aside = int(await conn.call("ZCARD", conn.keys.unmatched("text.echo")))
        async with running_sidecar(conn, "ghost-1", ("text.echo",), url=ghost.url):
            everything = await collect_replies(conn, reply_to, 320, timeout_s=60)
    assert set(results) == set(served)
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert still_waiting == 300 and not set(stranded) & set(agent.log.calls)
    assert set_aside == 300  # out of the way of work that can be served
    assert {r.stage for r in everything.values()} == {Stage.SUCCEEDED}
    assert set(ghost.log.calls) == set(stranded)  # each went to the instance it named


async def test_one_drain_sets_aside_a_batch_of_work_no_instance_can_take_not_a_window(
    conn: Connection,
) -> None:
    """Work that names a missing instance leaves the line a batch per drain (wider and wider
    passes), not one window of free credits per sweep: what waits behind it is reached in
    the same drain, not a sweep interval per four messages."""
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    registry = Registry(conn)
    await registry.register(card("a-1", ("text.echo",), max_inflight=4), credits=0)
    async with running_dispatcher(conn):  # no free credit: nothing is drained yet
        await submit_in_chunks(
            client, [request("text.echo", reply_to, target="ghost-1") for _ in range(300)]
        )

        async def all_waiting() -> bool:
            return await store.waiting.depth("text.echo") == 300

        await eventually(all_waiting)
    await registry.register(card("a-1", ("text.echo",), max_inflight=4), credits=4)
    dispatcher = Dispatcher(conn, consumer="d2")
    await dispatcher.refresh()
    assert await dispatcher.drain({"text.echo"}) == 0
    set_aside = int(await conn.call("ZCARD", conn.keys.unmatched("text.echo")))
    assert set_aside >= conn.settings.dispatch_batch, set_aside  # 4 before: the credits
    in_line = int(await conn.call("ZCARD", conn.keys.waiting("text.echo")))
    assert in_line == 300 - set_aside and await store.waiting.depth("text.echo") == 300


async def test_arrivals_take_free_credits_past_work_waiting_for_a_busy_instance(
    conn: Connection,
) -> None:
    """Hundreds wait for the one instance they name, and it is busy; another has free
    credits. New work any instance can take goes to it at once instead of queueing behind
    them, and they run when their instance frees."""
    held = Gate()
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=held) as a,
        http_agent("b") as b,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=a.url, max_inflight=1, adaptive_credits=False
        ),
        running_sidecar(
            conn, "b-1", ("text.echo",), url=b.url, max_inflight=2, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        pinned = await submit_in_chunks(
            client, [request("text.echo", reply_to, target="a-1") for _ in range(200)]
        )

        async def all_but_one_waiting() -> bool:
            return await store.waiting.depth("text.echo") == 199

        await eventually(all_but_one_waiting)
        served = await client.submit_many([request("text.echo", reply_to) for _ in range(20)])
        results = await collect_replies(conn, reply_to, 20, timeout_s=20)
        still_waiting = await store.waiting.depth("text.echo")
        held.open()
        everything = await collect_replies(conn, reply_to, 220, timeout_s=60)
    assert set(results) == set(served) and set(b.log.calls) == set(served)
    assert still_waiting == 199  # they waited: none of them went anywhere but their instance
    assert {r.stage for r in everything.values()} == {Stage.SUCCEEDED}
    assert set(a.log.calls) == set(pinned)


async def test_entries_a_crash_left_claimed_do_not_hold_the_line_behind_them(
    conn: Connection,
) -> None:
    """A dispatcher that stopped between claiming waiting messages (WAITING -> ROUTED) and
    removing their waiting-set entries leaves those entries at the head of the line. They
    must not hold the free credits: the work behind them, and new arrivals, are served."""
    held = Gate()
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=held) as a,
        http_agent("b") as b,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=a.url, max_inflight=1, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        first = await client.submit_many([request("text.echo", reply_to) for _ in range(12)])

        async def all_but_one_waiting() -> bool:
            return await store.waiting.depth("text.echo") == 11

        await eventually(all_but_one_waiting)
        head = (await store.waiting.heads({"text.echo": (0, 4)}))["text.echo"]
        claimed = [message_id for message_id, _ in head]
        for message_id in claimed:  # claimed, and the claimer gone before it went on
            moved = await store.apply(Move(message_id, Stage.ROUTED, only_from=Stage.WAITING))
            assert moved.ok
        async with running_sidecar(
            conn, "b-1", ("text.echo",), url=b.url, max_inflight=2, adaptive_credits=False
        ):
            served = await client.submit_many([request("text.echo", reply_to) for _ in range(2)])
            results = await collect_replies(conn, reply_to, 9, timeout_s=20)
        held.open()
    behind = set(first) - set(claimed) - set(a.log.calls)
    assert len(behind) == 7
    assert set(results) == behind | set(served) == set(b.log.calls)
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    stages = await store.stages(claimed)
    assert stages == [Stage.ROUTED] * 4  # left for the reaper: nothing else touched them


async def test_work_behind_a_pinned_line_is_offered_in_the_order_it_arrived(
    conn: Connection,
) -> None:
    """A long line of messages for a busy instance, and behind it messages any instance may
    take, and one free credit at a time: each drain reads past the line (wider and wider),
    and the messages behind it still go in the order they arrived, not from wherever the
    last wide pass stopped."""
    held = Gate()
    client = Client(conn)
    store = MessageStore(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=held) as a,
        http_agent("b") as b,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=a.url, max_inflight=1, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        pinned = await submit_in_chunks(
            client, [request("text.echo", reply_to, target="a-1") for _ in range(100)]
        )
        free = await submit_in_chunks(client, [request("text.echo", reply_to) for _ in range(100)])

        async def all_but_one_waiting() -> bool:
            return await store.waiting.depth("text.echo") == 199

        await eventually(all_but_one_waiting)
        line = (await store.waiting.heads({"text.echo": (0, 199)}))["text.echo"]
        arrived = [message_id for message_id, _ in line if message_id in set(free)]
        async with running_sidecar(
            conn, "b-1", ("text.echo",), url=b.url, max_inflight=1, adaptive_credits=False
        ):
            results = await collect_replies(conn, reply_to, 100, timeout_s=60)
        held.open()
    assert set(results) == set(free) and {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    # one credit, one call at a time: in the order they came (to the millisecond; the
    # waiting set orders messages accepted in the same one by id)
    assert len(arrived) == 100 and list(b.log.calls) == arrived
    assert set(a.log.calls) <= set(pinned)


def waiting_set_reads(conn: Connection, rounds: list[list[tuple[object, ...]]]) -> int:
    """How many times ``rounds`` read the head of ``text.echo``'s waiting set (a drain's
    ``ZRANGE``). Counted by key: the registry's snapshot, once a second, reads with a
    ``ZRANGE`` too, and a slow run takes more of them."""
    waiting = conn.keys.waiting("text.echo")
    return sum(c[:2] == ("ZRANGE", waiting) for r in rounds for c in r)


async def test_a_credit_release_reads_no_waiting_set_when_nothing_waits(conn: Connection) -> None:
    """At a light load each answer frees a credit. With nothing waiting, the dispatcher does
    not read a waiting set for it: a round trip, and a turn of its loop, for nothing."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        with watching(conn) as rounds:
            for n in range(1, 31):  # one at a time: every answer frees the only credit in use
                await client.submit_many([request("text.echo", reply_to)])
                await collect_replies(conn, reply_to, n, timeout_s=20)
    assert sum(agent.log.calls.values()) == 30
    assert waiting_set_reads(conn, rounds) < 5  # one a release before


@pytest.mark.one_server
async def test_work_parked_by_another_process_is_assigned_at_once(conn: Connection) -> None:
    """An operator's replay parks a message from outside the dispatcher. On one server the
    park tells the dispatchers, so it runs at once on the idle instance: not at the next
    sweep, and not only once some other answer frees a credit. (On a cluster a park tells no
    one and the sweep finds the work: :func:`broker.waiting_sets.parks_hint`.)"""
    slow_sweeps = msgspec.structs.replace(conn.settings, sweep_interval_s=60.0)
    assert slow_sweeps.redis_url is not None
    reply_to = conn.keys.reply("replayed")
    dead = await record_in(conn, Stage.DEAD, reply_to=reply_to, reason="gave up after 3")
    async with (
        open_connection(slow_sweeps, slow_sweeps.redis_url) as slow,
        http_agent("a") as agent,
        running_sidecar(slow, "a-1", ("text.echo",), url=agent.url, idempotent=True),
        running_dispatcher(slow),
    ):
        operator = Operator(slow)
        await operator.replay(await operator.plan_replay([dead]), by="alice")
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=10)).values()
    assert result.stage is Stage.SUCCEEDED and agent.log.calls[dead] == 1


async def sweeps_and_set_reads(conn: Connection) -> tuple[int, int]:
    """(SMEMBERS run: one a sweep, the index read; ZRANGE run: the sets' heads read)."""
    stats = commandstats((await conn.call("INFO", "commandstats")).decode())
    return stats.get("smembers", (0, 0))[0], stats.get("zrange", (0, 0))[0]


@pytest.mark.one_server
async def test_a_sweep_reads_no_set_of_a_capability_no_instance_serves(conn: Connection) -> None:
    """A producer may name any number of capabilities. Each sweep read the set-aside work of
    every one of them again, though no instance could take it: 20,000 made-up names kept a
    fifth of a core busy while nothing happened. A sweep now looks only at those served."""
    fast = msgspec.structs.replace(conn.settings, sweep_interval_s=0.02)
    assert fast.redis_url is not None
    client = Client(conn)
    reply_to = client.new_reply_stream()
    made_up = [request(f"made.up{n}", reply_to) for n in range(300)]
    async with (
        open_connection(fast, fast.redis_url) as swept,
        http_agent("a") as agent,
        running_sidecar(swept, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(swept),
    ):
        await client.submit_many([*made_up, request("text.echo", reply_to)])
        await collect_replies(conn, reply_to, 1, timeout_s=20)  # the served one ran
        sweeps_before, reads_before = await sweeps_and_set_reads(conn)

        async def twenty_sweeps() -> bool:
            return (await sweeps_and_set_reads(conn))[0] >= sweeps_before + 20

        await eventually(twenty_sweeps)
        sweeps_after, reads_after = await sweeps_and_set_reads(conn)
    assert reads_after - reads_before < 300, (
        sweeps_after - sweeps_before,
        reads_after - reads_before,
    )


async def test_a_restarted_dispatcher_serves_what_waits_before_new_arrivals(
    conn: Connection,
) -> None:
    """Work left waiting by a dispatcher that stopped goes before what arrived meanwhile,
    once a credit is free: the next dispatcher knows from its start that the capability has
    a backlog, not only once its first drain has met it."""
    calls: list[str] = []
    held = anyio.Event()
    agent = Agent("f")

    @agent.handler("text.echo")
    async def record(envelope: Envelope) -> dict[str, str]:
        calls.append(envelope.id)
        if len(calls) == 1:
            await held.wait()
        return {}

    store = MessageStore(conn)
    through_ingress = msgspec.structs.replace(conn.settings, direct_lane=False)
    async with (
        connected(through_ingress) as plain_conn,
        running_sidecar(
            plain_conn,
            "f-1",
            ("text.echo",),
            transport=agent,
            max_inflight=1,
            adaptive_credits=False,
        ),
    ):
        client = Client(plain_conn)
        async with running_dispatcher(plain_conn):
            first = await client.submit(Envelope(capability="text.echo", id="first"))

            async def started() -> bool:
                return calls == [first]

            await eventually(started)
            waiting = await client.submit(Envelope(capability="text.echo", id="waiting"))

            async def parked() -> bool:
                record = await store.get_record(waiting)
                return record is not None and record.stage is Stage.WAITING

            await eventually(parked)
        arrived = await client.submit(Envelope(capability="text.echo", id="arrived"))
        held.set()  # the credit frees with no dispatcher to hear it

        async def first_done() -> bool:
            record = await store.get_record(first)
            return record is not None and record.stage is Stage.SUCCEEDED

        await eventually(first_done)
        async with running_dispatcher(plain_conn):

            async def all_done() -> bool:
                records = [await store.get_record(i) for i in (waiting, arrived)]
                return all(r is not None and r.stage is Stage.SUCCEEDED for r in records)

            await eventually(all_done)
    assert calls == [first, waiting, arrived]
