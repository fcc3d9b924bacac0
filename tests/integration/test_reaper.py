"""The reaper, branch by branch, against real Redis and real HTTP agents on loopback.

A "ghost" instance is a registered card whose sidecar is not running (or died): its heartbeat
lapses, so it is DOWN after ``down_after_s``. Work is put in the stage a dying sidecar would
have left it in with the same fenced moves the sidecar makes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app
from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, ensure_group, open_connection
from broker.envelope import Envelope
from broker.keyspace import SIDECAR_GROUP, due_for, due_sets
from broker.metric_fields import read_counters
from broker.records import InstanceCard
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore, Move
from broker.timekeeping import now_ms
from tests.support.agents import RunningAgent, http_agent
from tests.support.harness import collect_replies, eventually, running_dispatcher, running_sidecar
from workers.reaper import Reaper

StatusAnswer = Callable[[str], Awaitable[Response]]


@pytest.fixture
async def fast(settings: Settings) -> AsyncIterator[Connection]:
    """Short clocks: an instance is DOWN after 1 s of silence; deliveries are late after 1 s."""
    quick = msgspec.structs.replace(
        settings,
        heartbeat_s=0.2,
        down_after_s=1.0,
        delivery_timeout_s=1.0,
        sync_call_timeout_s=2.0,
        processing_grace_s=0.5,
        retry_backoff_ms=300,
        sweep_interval_s=0.1,
    )
    assert quick.redis_url is not None
    async with open_connection(quick, quick.redis_url) as conn:
        yield conn


def request(reply_to: str, **fields: object) -> Envelope:
    raw = msgspec.json.encode({"capability": "text.echo", "reply_to": reply_to, **fields})
    return msgspec.json.decode(raw, type=Envelope)


async def register_ghost(
    conn: Connection, instance_id: str, *, status_url: str = "", idempotent: bool = False
) -> None:
    card = InstanceCard(
        agent_id=instance_id.split("-")[0],
        instance_id=instance_id,
        capabilities=("text.echo",),
        endpoint="http://127.0.0.1:9/",
        max_inflight=4,
        idempotent=idempotent,
        status_url=status_url,
    )
    await Registry(conn).register(card, credits=4)
    await ensure_group(conn, conn.keys.queue(instance_id), SIDECAR_GROUP)


async def stage_of(conn: Connection, message_id: str) -> Stage | None:
    record = await MessageStore(conn).get_record(message_id)
    return record.stage if record else None


async def routed_to_ghost(conn: Connection, client: Client, reply_to: str, **fields: object) -> str:
    """Submit a message and wait until the dispatcher has routed it (to the only instance)."""
    message_id = await client.submit(request(reply_to, **fields))

    async def routed() -> bool:
        return await stage_of(conn, message_id) is Stage.ROUTED

    await eventually(routed)
    return message_id


async def ghost_takes(conn: Connection, message_id: str, instance_id: str, upto: Stage) -> None:
    """The moves the ghost's sidecar made before it died: RECEIVED, then maybe PROCESSING."""
    store = MessageStore(conn)
    for stage, source in ((Stage.RECEIVED, Stage.ROUTED), (Stage.PROCESSING, Stage.RECEIVED)):
        moved = await store.apply(
            Move(
                message_id,
                stage,
                only_from=source,
                expect_attempt=1,
                expect_instance=instance_id,
                reason="taken by the ghost",
            )
        )
        assert moved.ok
        if stage is upto:
            return


async def processing_on_ghost(
    conn: Connection,
    client: Client,
    reply_to: str,
    *,
    status_url: str = "",
    idempotent: bool = False,
    **fields: object,
) -> str:
    """A message the ghost (registered now) took to PROCESSING before it died."""
    await register_ghost(conn, "ghost-1", status_url=status_url, idempotent=idempotent)
    message_id = await routed_to_ghost(conn, client, reply_to, **fields)
    await ghost_takes(conn, message_id, "ghost-1", Stage.PROCESSING)
    return message_id


@asynccontextmanager
async def status_agent(answer: StatusAnswer) -> AsyncIterator[str]:
    """An agent that only answers status queries; yields its status URL."""

    async def status(request: Request) -> Response:
        return await answer(request.path_params["message_id"])

    app = Starlette(routes=[Route("/status/{message_id}", status, methods=["GET"])])
    async with serve_app(app) as url:
        yield f"{url}status"


async def credit_returned(conn: Connection, instance_id: str, message_id: str) -> None:
    """Wait until ``instance_id`` holds no credit: returned after the outcome is written (on
    a cluster, on another slot); if it never is, say what holds it."""

    async def none_held() -> bool:
        return int(await conn.call("SCARD", conn.keys.inflight(instance_id))) == 0

    try:
        await eventually(none_held, timeout_s=5)
    except TimeoutError:
        held = await conn.call("SMEMBERS", conn.keys.inflight(instance_id))
        timeline = await MessageStore(conn).get_timeline(message_id)
        moves = [(e.ts_ms, e.stage, e.attempt, e.reason) for e in timeline]
        raise AssertionError(f"credit kept: {held} for {message_id}: {moves}") from None


def stages(timeline: list[object]) -> list[Stage]:
    return [e.stage for e in timeline]  # type: ignore[attr-defined]


# -- the agent was never asked -------------------------------------------------------------


async def test_work_routed_to_a_dead_instance_is_rerouted_at_once_and_the_stale_entry_dropped(
    fast: Connection,
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    await register_ghost(conn, "ghost-1")
    async with running_dispatcher(conn):
        message_id = await routed_to_ghost(conn, client, reply_to)
        async with (
            http_agent("a") as agent,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        ):
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
        async with (
            http_agent("ghost") as ghost,
            running_sidecar(conn, "ghost-1", ("text.echo",), url=ghost.url) as revived,
        ):

            async def stale_dropped() -> bool:
                return int(await conn.call("SCARD", conn.keys.inflight("ghost-1"))) == 0

            await eventually(stale_dropped)
            del revived
    assert result.stage is Stage.SUCCEEDED and agent.log.calls[message_id] == 1
    assert ghost.log.total == 0  # the revived ghost read its old entry and did not run it
    timeline = await MessageStore(conn).get_timeline(message_id)
    rerouted = timeline[stages(timeline).index(Stage.WAITING)]
    assert "ghost-1 is down: rerouted" in rerouted.reason
    assert stages(timeline)[-1] is Stage.SUCCEEDED


async def test_a_late_delivery_is_rerouted_after_the_delivery_timeout(fast: Connection) -> None:
    """The instance heartbeats (its sidecar is alive) but never takes the work."""
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    await register_ghost(conn, "stuck-1")

    async def keep_alive() -> None:
        registry = Registry(conn)
        while True:
            view = next(v for v in await registry.snapshot() if v.instance_id == "stuck-1")
            await registry.heartbeat("stuck-1", view.state, view.stats, hb_ms=now_ms())
            await anyio.sleep(0.1)

    async with anyio.create_task_group() as tg, running_dispatcher(conn):
        tg.start_soon(keep_alive)
        message_id = await routed_to_ghost(conn, client, reply_to)
        async with (
            http_agent("a") as agent,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        ):
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
        tg.cancel_scope.cancel()
    assert result.stage is Stage.SUCCEEDED and agent.log.calls[message_id] == 1
    timeline = await MessageStore(conn).get_timeline(message_id)
    waited = timeline[stages(timeline).index(Stage.WAITING)]
    assert "delivery timeout: stuck-1 did not take it within 1 s" in waited.reason


async def test_received_but_not_processing_is_rerouted_even_for_a_non_idempotent_agent(
    fast: Connection,
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    await register_ghost(conn, "ghost-1", idempotent=False)
    async with running_dispatcher(conn):
        message_id = await routed_to_ghost(conn, client, reply_to)
        await ghost_takes(conn, message_id, "ghost-1", Stage.RECEIVED)
        async with (
            http_agent("a") as agent,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, idempotent=False),
        ):
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
    assert result.stage is Stage.SUCCEEDED and agent.log.calls[message_id] == 1
    timeline = await MessageStore(conn).get_timeline(message_id)
    assert stages(timeline)[:5] == [
        Stage.ACCEPTED,
        Stage.ROUTED,
        Stage.RECEIVED,
        Stage.WAITING,
        Stage.ROUTED,
    ]


async def test_work_the_agent_was_never_asked_about_expires_at_its_deadline(
    fast: Connection,
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    await register_ghost(conn, "ghost-1")
    async with running_dispatcher(conn):
        message_id = await routed_to_ghost(conn, client, reply_to, timeout_s=0.5)
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
    assert result.id == message_id and result.stage is Stage.EXPIRED
    assert result.error == "deadline passed before the agent was asked"

    async def credit_returned() -> bool:  # once the ghost counts as dead
        return int(await conn.call("SCARD", conn.keys.inflight("ghost-1"))) == 0

    async with running_dispatcher(conn):
        await eventually(credit_returned)


# -- the agent may be working on it --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answered", "expected", "detail"),
    [
        ("done", Stage.SUCCEEDED, "status endpoint: done"),
        ("failed", Stage.FAILED, "status endpoint: failed"),
        ("unknown", Stage.NEEDS_CONFIRMATION, "not idempotent: parked for an operator"),
        ("404", Stage.NEEDS_CONFIRMATION, "404, message not known"),
    ],
)
async def test_processing_on_a_dead_instance_asks_the_agent_first(
    fast: Connection, answered: str, expected: Stage, detail: str
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    asked: list[str] = []

    async def answer(message_id: str) -> Response:
        asked.append(message_id)
        if answered == "404":
            return Response(status_code=404)
        body: dict[str, object] = {"state": answered}
        if answered == "done":
            body["result"] = {"answer": 42}
        if answered == "failed":
            body["error"] = "model refused"
        return JSONResponse(body)

    async with status_agent(answer) as status_url, running_dispatcher(conn):
        message_id = await processing_on_ghost(
            conn, client, reply_to, status_url=status_url, idempotent=False
        )

        async def settled() -> bool:
            return await stage_of(conn, message_id) is expected

        try:
            await eventually(settled, timeout_s=8)
        except TimeoutError:
            print(
                "DEBUG",
                [
                    (e.stage, e.instance, e.reason)
                    for e in await MessageStore(conn).get_timeline(message_id)
                ],
                asked,
                await conn.call("ZSCORE", conn.keys.due, message_id),
                now_ms(),
            )
            raise
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None and asked and set(asked) == {message_id}
    timeline = await MessageStore(conn).get_timeline(message_id)
    assert detail in timeline[-1].reason and "instance down" in timeline[-1].reason
    if expected is Stage.SUCCEEDED:
        assert msgspec.json.decode(record.result or b"") == {"answer": 42}
        (result,) = (await collect_replies(conn, reply_to, 1)).values()
        assert result.stage is Stage.SUCCEEDED
    if expected is Stage.FAILED:
        assert record.error == "model refused"

    await credit_returned(conn, "ghost-1", message_id)


async def test_a_running_answer_extends_then_done_records_the_result(fast: Connection) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    answers = iter(["running", "running", "done"])

    async def answer(message_id: str) -> Response:
        state = next(answers, "done")
        return JSONResponse({"state": state, "result": {"ok": True}})

    async with status_agent(answer) as status_url, running_dispatcher(conn):
        message_id = await processing_on_ghost(conn, client, reply_to, status_url=status_url)
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=30)).values()
    record = await MessageStore(conn).get_record(message_id)
    assert result.stage is Stage.SUCCEEDED and record is not None and record.extensions == 2


async def test_unknown_on_an_idempotent_agent_retries_with_the_same_key_elsewhere(
    fast: Connection,
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()

    async def answer(message_id: str) -> Response:
        return JSONResponse({"state": "unknown"})

    async with status_agent(answer) as status_url, running_dispatcher(conn):
        message_id = await processing_on_ghost(
            conn, client, reply_to, status_url=status_url, idempotent=True
        )
        async with (
            http_agent("a") as agent,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, idempotent=True),
        ):
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
    assert result.stage is Stage.SUCCEEDED
    (headers,) = agent.log.headers
    assert headers["x-reach-idempotency-key"] == message_id  # the same key as the first try
    assert headers["x-reach-attempt"] == "2"
    timeline = await MessageStore(conn).get_timeline(message_id)
    assert any("retry in" in e.reason for e in timeline)


async def test_an_idempotent_agent_out_of_attempts_is_dead_lettered_with_its_reasons(
    fast: Connection,
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with running_dispatcher(conn):
        message_id = await processing_on_ghost(
            conn, client, reply_to, idempotent=True, max_attempts=1
        )
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
    assert result.stage is Stage.DEAD
    assert result.error is not None and result.error.startswith("gave up after 1 attempts")
    (letter,) = [
        dict(zip(flat[::2], flat[1::2], strict=True))
        for _, flat in await conn.call("XRANGE", conn.keys.dlq, "-", "+")
    ]
    assert letter[b"id"].decode() == message_id and letter[b"stage"] == b"DEAD"
    chain = msgspec.json.decode(letter[b"chain"])
    assert chain[-1][0] == "DEAD" and "no status endpoint" in chain[-1][3]
    assert msgspec.json.decode(letter[b"raw"])["id"] == message_id


async def test_processing_past_the_deadline_is_never_expired_and_the_producer_is_told(
    fast: Connection,
) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()

    async def answer(message_id: str) -> Response:
        return JSONResponse({"state": "running"})

    async with status_agent(answer) as status_url, running_dispatcher(conn):
        message_id = await processing_on_ghost(
            conn, client, reply_to, status_url=status_url, timeout_s=1
        )
        notice = await first_notice(conn, reply_to)

        async def extended() -> bool:
            record = await MessageStore(conn).get_record(message_id)
            return record is not None and record.extensions >= 1

        await eventually(extended, timeout_s=20)
        still = await stage_of(conn, message_id)
    assert notice["stage"] == b"PROCESSING" and notice["notice"] == b"deadline_passed"
    assert b"deadline passed" in notice["error"]
    # a producer waiting for the outcome is not handed the notice as if it were one
    assert await client.wait_reply(reply_to, message_id, timeout_s=0.3) is None
    assert still is Stage.PROCESSING  # the agent may still be working: not EXPIRED


# -- retries -------------------------------------------------------------------------------


async def test_an_unreachable_agent_is_retried_elsewhere_after_a_back_off(fast: Connection) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("b") as agent_b,
        running_sidecar(conn, "down-1", ("text.echo",), url="http://127.0.0.1:9/"),
        running_dispatcher(conn),
    ):
        message_id = await client.submit(request(reply_to))

        async def failed_once() -> bool:
            record = await MessageStore(conn).get_record(message_id)
            return record is not None and record.retry_at_ms > 0

        await eventually(failed_once)
        async with running_sidecar(conn, "b-1", ("text.echo",), url=agent_b.url):
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
    assert result.stage is Stage.SUCCEEDED and agent_b.log.calls[message_id] == 1
    timeline = await MessageStore(conn).get_timeline(message_id)
    waited = timeline[stages(timeline).index(Stage.WAITING)]
    assert "retry in" in waited.reason and waited.instance == "down-1"
    second = [e for e in timeline if e.stage is Stage.ROUTED][-1]
    assert second.instance == "b-1"  # the retry avoided the instance that failed it
    assert second.ts_ms - waited.ts_ms >= 300 * 0.8  # and waited out its back-off
    retries = read_counters(await conn.read_counters())["retries"]
    assert retries == {("text.echo", "not_reached"): 1}  # the sidecar counts the retry it sent


# -- several reapers -----------------------------------------------------------------------


async def test_reapers_working_at_once_handle_each_due_message_once(fast: Connection) -> None:
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    n = 300
    async with running_dispatcher(conn, reaper=False):
        ids = await client.submit_many([request(reply_to, timeout_s=0.3) for _ in range(n)])

        async def all_waiting() -> bool:
            return await MessageStore(conn).waiting.depth("text.echo") == n

        await eventually(all_waiting)

    async def all_past_deadline() -> bool:
        records = await MessageStore(conn).get_records(ids)
        return max(r.deadline_ms for r in records if r) < now_ms()

    await eventually(all_past_deadline)
    reapers = [Reaper(conn) for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for reaper in reapers:
            tg.start_soon(reaper.tick)
    results = await collect_replies(conn, reply_to, n)
    assert {r.stage for r in results.values()} == {Stage.EXPIRED}
    assert sum(r.handled.get("expired", 0) for r in reapers) == n
    replies = int(await conn.call("XLEN", reply_to))
    assert replies == n  # one reply each: no message was expired by two reapers


async def test_a_due_member_that_is_no_message_id_is_removed_and_the_rest_reaped(
    fast: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar's user may add to the due index. A member not UTF-8, due first, failed
    every claim after the lease was taken: the reaper handled nothing, ever again. An id
    whose record key is a list failed the look at its whole batch, again at every lease."""
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    junk = b"\xff\xfe-not-an-id"
    async with running_dispatcher(conn, reaper=False):
        ids = await client.submit_many([request(reply_to, timeout_s=0.3) for _ in range(5)])

        async def all_past_deadline() -> bool:
            records = await MessageStore(conn).get_records(ids)
            return all(r is not None and r.deadline_ms < now_ms() for r in records)

        await eventually(all_past_deadline)
    await conn.call("ZADD", conn.keys.due, 0, junk, 0, "evil-1")  # in the same claim as they
    await conn.call("RPUSH", conn.keys.record("evil-1"), "x")  # an id, its record a list
    async with anyio.create_task_group() as tg:
        await tg.start(Reaper(conn).run)
        results = await collect_replies(conn, reply_to, 5, timeout_s=20)
        tg.cancel_scope.cancel()
    assert {r.stage for r in results.values()} == {Stage.EXPIRED} and set(results) == set(ids)
    assert await conn.call("ZSCORE", conn.keys.due, junk) is None
    assert any("no message id" in r.getMessage() for r in caplog.records)


async def test_every_partition_of_the_due_set_is_claimed(settings: Settings) -> None:
    """``ingress_partitions = 3``: deadlines spread over ``P:due``, ``P:due:{1}``,
    ``P:due:{2}`` by message id, and a reaper claims and resolves them all."""
    partitioned = msgspec.structs.replace(settings, ingress_partitions=3, sweep_interval_s=0.1)
    assert partitioned.redis_url is not None
    async with open_connection(partitioned, partitioned.redis_url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        async with running_dispatcher(conn):  # and its reaper
            ids = await client.submit_many([request(reply_to, timeout_s=0.3) for _ in range(150)])
            results = await collect_replies(conn, reply_to, 150)
        sets = due_sets(conn.keys)

    assert {r.stage for r in results.values()} == {Stage.EXPIRED} and set(results) == set(ids)
    # deadlines in all three: a partition no reaper claimed would leave its messages waiting
    assert {due_for(conn.keys, i) for i in ids} == set(sets) and len(sets) == 3


async def test_an_id_in_a_partition_not_its_own_is_moved_to_its_own(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar's user may add to the due index. An id in another partition than its own
    was leased there and, every reschedule writing to the id's own partition, leased again
    at every lease's end, for good. It goes home, and is handled there like any other."""
    partitioned = msgspec.structs.replace(settings, ingress_partitions=2, sweep_interval_s=0.1)
    assert partitioned.redis_url is not None
    async with open_connection(partitioned, partitioned.redis_url) as conn:
        home, other = due_sets(conn.keys)
        stray = next(f"m-{n}" for n in range(100) if due_for(conn.keys, f"m-{n}") == home)
        await conn.call("ZADD", other, 0, stray)

        async def gone_from_both() -> bool:
            scores = [await conn.call("ZSCORE", key, stray) for key in (home, other)]
            return scores == [None, None]  # home, then forgotten there: it has no record

        async with anyio.create_task_group() as tg:
            await tg.start(Reaper(conn).run)
            await eventually(gone_from_both, timeout_s=10)
            tg.cancel_scope.cancel()
    assert any("ids of other partitions: moved" in r.getMessage() for r in caplog.records)


# -- dead processes ------------------------------------------------------------------------


async def test_a_dead_instance_s_work_is_taken_over_at_once_and_its_pending_entries_claimed(
    fast: Connection,
) -> None:
    """Delivery timeout a minute; the ghost read its entry (pending) and died. Its work is
    rerouted as soon as it is DOWN, and the reaper claims and acknowledges its entry."""
    slow_clock = msgspec.structs.replace(fast.settings, delivery_timeout_s=60.0)
    assert slow_clock.redis_url is not None
    async with open_connection(slow_clock, slow_clock.redis_url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        await register_ghost(conn, "ghost-1")
        queue = conn.keys.queue("ghost-1")
        async with running_dispatcher(conn):
            message_id = await routed_to_ghost(conn, client, reply_to)

            async def assigned() -> bool:
                return int(await conn.call("XLEN", queue)) == 1

            await eventually(assigned)
            read = await conn.call(
                "XREADGROUP", "GROUP", SIDECAR_GROUP, "ghost-1", "STREAMS", queue, ">"
            )
            assert read  # the ghost's sidecar took the entry, then died
            started = anyio.current_time()
            async with (
                http_agent("a") as agent,
                running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
            ):
                (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
            took = anyio.current_time() - started

            async def claimed() -> bool:
                summary = await conn.call("XPENDING", queue, SIDECAR_GROUP)
                return int(summary[0]) == 0

            await eventually(claimed)
    assert result.stage is Stage.SUCCEEDED and agent.log.calls[message_id] == 1
    assert took < 15  # at DOWN (1 s of silence), not at the 60 s delivery timeout


async def test_a_reaper_stopped_in_the_middle_of_a_look_hands_its_lease_back(
    fast: Connection,
) -> None:
    """A reaper leases what is due (30 s) and asks the agent about it. Stopped while the
    agent has not answered, it used to keep the lease, and the next reaper waited out the
    30 s: a restarted `up` left late work alone for half a minute. The message is now due
    again at once."""
    client = Client(fast)
    asked, answered = anyio.Event(), anyio.Event()

    async def answer(message_id: str) -> Response:
        asked.set()
        await answered.wait()  # the reaper is stopped while it waits
        return JSONResponse({"state": "running"})

    async with status_agent(answer) as status_url:
        async with running_dispatcher(fast, reaper=False):
            message_id = await processing_on_ghost(
                fast, client, client.new_reply_stream(), status_url=status_url
            )
        async with anyio.create_task_group() as tg:
            await tg.start(Reaper(fast).run)
            with anyio.fail_after(10):
                await asked.wait()
            due = due_for(fast.keys, message_id)
            leased = float(await fast.call("ZSCORE", due, message_id))
            tg.cancel_scope.cancel()
        stopped_at = now_ms()
        answered.set()
    assert leased > stopped_at + 20_000  # leased while it was asked about
    assert float(await fast.call("ZSCORE", due, message_id)) <= stopped_at  # due again now


@asynccontextmanager
async def ghost_back(
    conn: Connection, client: Client, reply_to: str, answer: StatusAnswer
) -> AsyncIterator[tuple[str, RunningAgent]]:
    """A message the ghost read, made PROCESSING and died with; the reaper claims and
    acknowledges its entry and asks the agent (``answer``: its status, which says running
    first). Then the sidecar comes back under the same instance id, beside a dispatcher and
    a reaper. Yields the message's id and the agent behind the sidecar."""
    queue = conn.keys.queue("ghost-1")
    async with status_agent(answer) as status_url, http_agent("g") as agent:
        await register_ghost(conn, "ghost-1", status_url=status_url)
        async with running_dispatcher(conn):
            message_id = await routed_to_ghost(conn, client, reply_to)

            async def assigned() -> bool:
                return int(await conn.call("XLEN", queue)) == 1

            await eventually(assigned)
            await conn.call("XREADGROUP", "GROUP", SIDECAR_GROUP, "ghost-1", "STREAMS", queue, ">")
            await ghost_takes(conn, message_id, "ghost-1", Stage.PROCESSING)

            async def taken_over() -> bool:
                pending = int((await conn.call("XPENDING", queue, SIDECAR_GROUP))[0])
                record = await MessageStore(conn).get_record(message_id)
                return pending == 0 and record is not None and record.extensions >= 1

            await eventually(taken_over, timeout_s=15)
        async with (
            running_dispatcher(conn),
            running_sidecar(conn, "ghost-1", ("text.echo",), url=agent.url, status_url=status_url),
        ):
            yield message_id, agent


async def test_a_credit_the_reaper_took_over_is_returned_after_its_sidecar_came_back(
    fast: Connection,
) -> None:
    """The ghost read its entry, made it PROCESSING and died; the reaper claims and
    acknowledges the entry and asks the agent, which is still running it. The sidecar comes
    back under the same instance id — its pending list no longer names the message — and
    then the agent says done: the reaper ends it, and returns its credit although the
    instance is alive, where it used to keep it for good (an instance one credit short)."""
    client = Client(fast)
    reply_to = client.new_reply_stream()
    state = {"answer": "running"}

    async def answer(message_id: str) -> Response:
        return JSONResponse({"state": state["answer"], "result": {"ok": True}})

    async with ghost_back(fast, client, reply_to, answer) as (message_id, agent):
        state["answer"] = "done"
        (result,) = (await collect_replies(fast, reply_to, 1, timeout_s=20)).values()
        await credit_returned(fast, "ghost-1", message_id)
    assert result.stage is Stage.SUCCEEDED
    assert agent.log.calls[message_id] == 0  # the ghost's call: never made again


async def test_a_credit_the_reaper_took_over_is_returned_when_a_callback_ends_the_message(
    fast: Connection,
) -> None:
    """As above, but the restarted sidecar's callback desk ends the message (an async
    agent's callback, for an entry it does not hold): the reaper, at its next look, finds it
    ended and returns the credit it had taken over."""
    client = Client(fast)
    store = MessageStore(fast)

    async def answer(message_id: str) -> Response:
        return JSONResponse({"state": "running"})

    async with ghost_back(fast, client, client.new_reply_stream(), answer) as (message_id, _):
        # what the callback desk writes for a callback whose entry no one holds
        for stage, source in (
            (Stage.CALLBACK_RECEIVED, Stage.PROCESSING),
            (Stage.SUCCEEDED, Stage.CALLBACK_RECEIVED),
        ):
            move = Move(
                message_id,
                stage,
                only_from=source,
                expect_attempt=1,
                expect_instance="ghost-1",
                reason="the agent's callback",
            )
            assert (await store.apply(move)).ok
        await credit_returned(fast, "ghost-1", message_id)


async def test_ingress_a_dead_dispatcher_read_is_claimed_by_another(fast: Connection) -> None:
    quick_claim = msgspec.structs.replace(fast.settings, claim_idle_s=0.5)
    assert quick_claim.redis_url is not None
    async with open_connection(quick_claim, quick_claim.redis_url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        await ensure_group(conn, conn.keys.ingress, "dispatch")
        message_id = await client.submit(request(reply_to))
        taken = await conn.call(
            "XREADGROUP", "GROUP", "dispatch", "gone-1", "STREAMS", conn.keys.ingress, ">"
        )
        assert taken  # read by a dispatcher that then died, never to return under its name
        async with (
            http_agent("a") as agent,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
            running_dispatcher(conn, "d2"),
        ):
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
        pending = await conn.call("XPENDING", conn.keys.ingress, "dispatch")
    assert result.id == message_id and result.stage is Stage.SUCCEEDED
    assert agent.log.calls[message_id] == 1 and int(pending[0]) == 0


async def test_a_hanging_agent_is_asked_for_its_status_before_anything_is_guessed(
    fast: Connection,
) -> None:
    """The call times out (2 s); the live sidecar asks the status endpoint, which says done:
    the result is recorded, the non-idempotent agent ran it once, nothing was parked."""
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    calls: list[str] = []
    never = anyio.Event()

    async def execute(request: Request) -> Response:
        calls.append(request.headers["x-reach-message-id"])
        await never.wait()  # hangs: the answer never comes back
        return JSONResponse({})

    async def status(request: Request) -> Response:
        if request.path_params["message_id"] in calls:
            return JSONResponse({"state": "done", "result": {"made": "it"}})
        return Response(status_code=404)

    app = Starlette(
        routes=[
            Route("/", execute, methods=["POST"]),
            Route("/status/{message_id}", status, methods=["GET"]),
        ]
    )
    async with serve_app(app) as url:
        card = InstanceCard(
            agent_id="hang",
            instance_id="hang-1",
            capabilities=("text.echo",),
            endpoint=url,
            max_inflight=2,
            status_url=f"{url}status",
        )
        transport = HttpTransport(
            url, timeout_s=conn.settings.sync_call_timeout_s, max_connections=2
        )
        sidecar = Sidecar(conn, card, transport, grace_s=1.0)
        async with anyio.create_task_group() as tg, running_dispatcher(conn):
            await tg.start(sidecar.run)
            message_id = await client.submit(request(reply_to))
            (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
            never.set()
            tg.cancel_scope.cancel()
        await transport.aclose()
    assert result.id == message_id and result.stage is Stage.SUCCEEDED
    assert result.result == {"made": "it"} and calls == [message_id]


async def first_notice(conn: Connection, reply_to: str) -> dict[str, bytes]:
    """The first notice on a reply stream (``collect_replies`` passes notices over)."""
    found: list[dict[str, bytes]] = []

    async def noticed() -> bool:
        for _, flat in await conn.call("XRANGE", reply_to, "-", "+"):
            fields = {k.decode(): v for k, v in zip(flat[::2], flat[1::2], strict=True)}
            if "notice" in fields:
                found.append(fields)
                return True
        return False

    await eventually(noticed, timeout_s=20)
    return found[0]


@pytest.mark.one_server  # the connections killed are found with one server's CLIENT LIST
async def test_a_connection_lost_while_a_batch_is_judged_fails_the_tick_not_the_reaper(
    fast: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis drops the reaper's connection while it waits for an agent's status: the write
    after the answer fails, the tick is retried, and the batch comes back when its lease
    ends (brought forward here) and is resolved by the same reaper."""
    conn = fast
    client = Client(conn)
    reply_to = client.new_reply_stream()
    asked: list[str] = []
    waiting = anyio.Event()
    release = anyio.Event()

    async def answer(message_id: str) -> Response:
        asked.append(message_id)
        waiting.set()
        await release.wait()
        return JSONResponse({"state": "done", "result": {"answer": 42}})

    async def client_ids() -> set[bytes]:
        listed = await conn.call("CLIENT", "LIST", "TYPE", "normal")
        return {f.split(b"=")[1] for f in listed.split() if f.startswith(b"id=")}

    async with status_agent(answer) as status_url:
        async with running_dispatcher(conn, reaper=False):
            message_id = await processing_on_ghost(conn, client, reply_to, status_url=status_url)
        others = await client_ids()
        async with (
            open_connection(conn.settings, conn.url) as own,
            anyio.create_task_group() as tg,
        ):
            with caplog.at_level(logging.WARNING, logger="agent_reach.reaper"):
                await tg.start(Reaper(own).run)
                with anyio.fail_after(10):
                    await waiting.wait()
                for client_id in await client_ids() - others:  # the reaper's
                    await conn.call("CLIENT", "KILL", "ID", client_id)
                release.set()

                async def tick_failed() -> bool:  # the close, or the reset a write met
                    lost = ("closed the connection", "Connection reset by peer")
                    return any(w in r.getMessage() for r in caplog.records for w in lost)

                await eventually(tick_failed, timeout_s=10)
            assert await stage_of(conn, message_id) is Stage.PROCESSING
            await conn.call("ZADD", due_for(conn.keys, message_id), "XX", now_ms(), message_id)

            async def resolved() -> bool:
                return await stage_of(conn, message_id) is Stage.SUCCEEDED

            await eventually(resolved, timeout_s=10)
            tg.cancel_scope.cancel()
    assert asked == [message_id, message_id]
