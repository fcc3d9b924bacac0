"""Broadcast with real sidecars, real HTTP agents and a real Redis: one child per healthy
instance, each a normal message with its own credit; the parent ends when every child has,
with the map instance -> outcome, and its producer is told once; nobody to send to is a
precise REJECTED; a dispatcher stopped mid-fan-out creates each child once."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.broadcast import decode_children
from broker.client import Client, Result
from broker.config import Settings
from broker.connection import Connection, ensure_group
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisUnavailable
from broker.keyspace import DISPATCH_GROUP
from broker.records import InstanceCard, InstanceState, MessageRecord
from broker.registry import Registry
from broker.stages import Stage
from broker.store import Acceptance, MessageStore, Move
from broker.timekeeping import now_ms
from tests.support.agents import Gate, RunningAgent, http_agent
from tests.support.harness import collect_replies, eventually, running_dispatcher, running_sidecar
from tests.support.processes import AGENT_REACH, process_env, start, stop
from workers.dispatcher import Dispatcher
from workers.reaper import Reaper


def message(capability: str, reply_to: str | None, **fields: Any) -> Envelope:
    body = {"capability": capability, "payload": {"hello": "all"}, **fields}
    if reply_to is not None:
        body["reply_to"] = reply_to
    return msgspec.json.decode(msgspec.json.encode(body), type=Envelope)


def broadcast(capability: str, reply_to: str | None, **fields: Any) -> Envelope:
    return message(capability, reply_to, mode="broadcast", **fields)


async def record_of(conn: Connection, message_id: str) -> MessageRecord:
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None, message_id
    return record


async def children_of(conn: Connection, parent_id: str) -> list[tuple[str, str]]:
    raw = await conn.call("HGET", conn.keys.record(parent_id), "children")
    return decode_children(raw) if raw else []


async def register_idle(conn: Connection, instance_id: str, capability: str) -> None:
    """A card with no sidecar behind it (never heartbeats again)."""
    card = InstanceCard(
        agent_id=instance_id.split("-")[0],
        instance_id=instance_id,
        capabilities=(capability,),
        endpoint="http://127.0.0.1:9/",
        max_inflight=4,
    )
    await Registry(conn).register(card, credits=4)


@asynccontextmanager
async def sidecars(
    conn: Connection, agent: RunningAgent, ids: list[str], capability: str, **options: Any
) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        for instance_id in ids:
            await stack.enter_async_context(
                running_sidecar(conn, instance_id, (capability,), url=agent.url, **options)
            )
        yield


async def test_one_child_per_healthy_instance_and_one_reply_with_the_map(
    conn: Connection,
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    healthy = ["a-1", "a-2", "b-1"]
    await register_idle(conn, "c-1", "cache.flush")
    await Registry(conn).set_state("c-1", InstanceState.DOWN)
    await register_idle(conn, "d-1", "cache.flush")
    await Registry(conn).set_state("d-1", InstanceState.DRAINING)
    async with (
        http_agent("cache") as agent,
        sidecars(conn, agent, healthy, "cache.flush"),
        running_dispatcher(conn),
    ):
        parent = await client.submit(broadcast("cache.flush", reply_to))
        (result,) = (await collect_replies(conn, reply_to, 1)).values()

        async def told() -> bool:
            return not (await record_of(conn, parent)).reply_pending

        await eventually(told)
        due_after_telling = await conn.call("ZSCORE", conn.keys.due, parent)
        # A producer's retry of the same broadcast: handled (acknowledged), not run again.
        await client.submit(broadcast("cache.flush", reply_to, id=parent))

        async def handled() -> bool:
            summary = await conn.call("XPENDING", conn.keys.ingress, DISPATCH_GROUP)
            entries = int(await conn.call("XLEN", conn.keys.ingress))
            return entries == 2 and int(summary[0]) == 0

        await eventually(handled)
        replies = await conn.call("XLEN", reply_to)

    assert result.id == parent and result.stage is Stage.SUCCEEDED
    assert sorted(result.result) == healthy  # not the DOWN one, not the DRAINING one
    children = await children_of(conn, parent)
    assert [inst for _, inst in children] == healthy
    assert [child for child, _ in children] == [f"{parent}.{n}" for n in (1, 2, 3)]
    for child, inst in children:
        outcome = result.result[inst]
        assert outcome == {
            "stage": "SUCCEEDED",
            "id": child,
            "result": {"agent": "cache", "echo": {"hello": "all"}},
        }
        record = await record_of(conn, child)
        assert record.stage is Stage.SUCCEEDED and record.instance == inst
        envelope = load_envelope(record.envelope)
        assert envelope.parent == parent and envelope.target == inst
        assert envelope.reply_to is None and envelope.idempotency_key == f"{parent}.{inst}"
    assert agent.log.calls == {child: 1 for child, _ in children}
    assert replies == 1  # told once, and the retry told nobody again
    stages = [e.stage for e in (await client.trace(parent)).timeline]
    assert stages == [Stage.ACCEPTED, Stage.FANNED_OUT, Stage.SUCCEEDED]
    assert due_after_telling is None  # ended and told: nothing left for the reaper


async def test_a_failing_child_is_failed_in_the_map_and_the_parent_still_succeeds(
    conn: Connection,
) -> None:
    async def refuse(envelope: dict[str, Any], request: Request) -> Response | None:
        return JSONResponse({"error": "not here"}, status_code=400)

    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("good") as good,
        http_agent("bad", behaviour=refuse) as bad,
        running_sidecar(conn, "good-1", ("cache.flush",), url=good.url),
        running_sidecar(conn, "bad-1", ("cache.flush",), url=bad.url),
        running_dispatcher(conn),
    ):
        parent = await client.submit(broadcast("cache.flush", reply_to))
        (result,) = (await collect_replies(conn, reply_to, 1)).values()
    assert result.stage is Stage.SUCCEEDED
    assert result.result["good-1"]["stage"] == "SUCCEEDED"
    failed = result.result["bad-1"]
    assert failed["stage"] == "FAILED" and "400" in failed["error"] and "result" not in failed
    timeline = (await client.trace(parent)).timeline
    assert timeline[-1].reason == "all 2 children ended: 1 FAILED, 1 SUCCEEDED"
    assert bad.log.total == 1  # a 4xx is final: not retried


async def test_each_child_waits_for_a_credit_of_its_own_instance(conn: Connection) -> None:
    held = Gate()
    client = Client(conn)
    reply_to = client.new_reply_stream()
    store = MessageStore(conn)
    async with (
        http_agent("slow", behaviour=held) as slow,
        http_agent("quick") as quick,
        running_sidecar(
            conn, "slow-1", ("cache.flush",), url=slow.url, max_inflight=1, adaptive_credits=False
        ),
        running_sidecar(conn, "quick-1", ("cache.flush",), url=quick.url),
        running_dispatcher(conn),
    ):
        busy = await client.submit(message("cache.flush", reply_to, target="slow-1"))

        async def slow_is_busy() -> bool:
            return slow.log.calls[busy] == 1

        await eventually(slow_is_busy)
        parent = await client.submit(broadcast("cache.flush", reply_to))

        async def quick_done_slow_waiting() -> bool:
            children = {inst: child for child, inst in await children_of(conn, parent)}
            if len(children) < 2:
                return False
            stages = await store.stages([children["quick-1"], children["slow-1"]])
            return stages == [Stage.SUCCEEDED, Stage.WAITING]

        await eventually(quick_done_slow_waiting)
        assert (await record_of(conn, parent)).stage is Stage.FANNED_OUT
        assert slow.log.total == 1  # only the busy one: the child waits outside the stream
        held.open()
        results = await collect_replies(conn, reply_to, 2)
    assert results[busy].stage is Stage.SUCCEEDED
    assert results[parent].stage is Stage.SUCCEEDED
    assert {i: o["stage"] for i, o in results[parent].result.items()} == {
        "slow-1": "SUCCEEDED",
        "quick-1": "SUCCEEDED",
    }
    assert slow.log.peak_concurrent == 1  # never more than its one credit
    slow_child = f"{parent}.2"  # instances in id order: quick-1, slow-1
    stages = [e.stage for e in await store.get_timeline(slow_child)]
    # It waited before it was received. (A dispatcher whose view of the credits is a beat
    # old may route it first and have the assignment refused: ROUTED -> WAITING.)
    assert stages[0] is Stage.ACCEPTED
    assert Stage.WAITING in stages
    assert stages.index(Stage.WAITING) < stages.index(Stage.RECEIVED)


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    ("registered", "why"),
    [
        ("none", "no_capability_match: no instance serves 'cache.flush'"),
        ("down", "all_candidates_down"),
    ],
)
async def test_nobody_to_send_to_is_rejected_with_the_reason_and_told(
    conn: Connection, registered: str, why: str
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    if registered == "down":
        await register_idle(conn, "c-1", "cache.flush")
        await Registry(conn).set_state("c-1", InstanceState.DOWN)
    async with running_dispatcher(conn):
        parent = await client.submit(broadcast("cache.flush", reply_to))
        (result,) = (await collect_replies(conn, reply_to, 1)).values()

        async def told() -> bool:
            return not (await record_of(conn, parent)).reply_pending

        await eventually(told)
    reason = f"broadcast: no healthy instance to send it to ({why})"
    assert result == Result(parent, Stage.REJECTED, None, reason)
    record = await record_of(conn, parent)
    assert record.stage is Stage.REJECTED and record.error == reason
    assert await children_of(conn, parent) == []
    letters = await conn.call("XRANGE", conn.keys.dlq, "-", "+")
    assert len(letters) == 1
    fields = dict(zip(letters[0][1][::2], letters[0][1][1::2], strict=True))
    assert fields[b"id"].decode() == parent and fields[b"reason"].decode() == reason
    assert load_envelope(fields[b"raw"]).mode == "broadcast"


async def test_a_broadcast_id_too_long_for_its_children_is_rejected(conn: Connection) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    long_id = "x" * 121
    async with running_dispatcher(conn):
        await client.submit(broadcast("cache.flush", reply_to, id=long_id))
        (result,) = (await collect_replies(conn, reply_to, 1)).values()
    assert result.id == long_id and result.stage is Stage.REJECTED
    assert result.error is not None and "at most 120 characters" in result.error


async def test_a_dispatcher_stopped_mid_fan_out_creates_each_child_once(
    conn: Connection,
) -> None:
    """The first handling stops after the parent and one child were written; the ingress
    entry stays pending, the restarted dispatcher handles it again and creates the rest."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    instances = ["a-1", "a-2", "a-3"]
    async with http_agent("cache") as agent, sidecars(conn, agent, instances, "cache.flush"):
        first = Dispatcher(conn, consumer="d1")
        await ensure_group(conn, conn.keys.ingress, DISPATCH_GROUP)
        await first.refresh()
        parent = await client.submit(broadcast("cache.flush", reply_to))
        async with conn.reader() as reader:
            entries = await reader.read_raw(
                conn.keys.ingress, DISPATCH_GROUP, "d1", count=10, block_ms=1000
            )
        accept_many = first.store.accept_many
        calls = 0

        async def stops_after_one_child(acceptances: list[Acceptance]) -> list[Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return await accept_many(acceptances)  # the parent
            await accept_many(acceptances[:1])
            raise RedisUnavailable("stopped mid-fan-out")

        first.store.accept_many = stops_after_one_child  # type: ignore[method-assign]
        with pytest.raises(RedisUnavailable):
            await first.handle_batch(entries)
        assert (await record_of(conn, parent)).stage is Stage.FANNED_OUT
        store = MessageStore(conn)
        first_child, *rest = await store.stages([f"{parent}.{n}" for n in (1, 2, 3)])
        # created (on one server assigned with it, so its sidecar may have it already)
        assert first_child in (Stage.ROUTED, Stage.RECEIVED, Stage.PROCESSING, Stage.SUCCEEDED)
        assert rest == [None, None]
        assert (await conn.call("XPENDING", conn.keys.ingress, DISPATCH_GROUP))[0] == 1
        async with running_dispatcher(conn, "d1"):  # the same consumer: its pending entries
            (result,) = (await collect_replies(conn, reply_to, 1)).values()
        pending = (await conn.call("XPENDING", conn.keys.ingress, DISPATCH_GROUP))[0]
    assert result.stage is Stage.SUCCEEDED and sorted(result.result) == instances
    assert agent.log.calls == {f"{parent}.{n}": 1 for n in (1, 2, 3)}
    assert pending == 0
    for n in (1, 2, 3):
        stages = [e.stage for e in await store.get_timeline(f"{parent}.{n}")]
        assert stages.count(Stage.ACCEPTED) == 1 and stages.count(Stage.RECEIVED) == 1


async def test_first_outcome_wins_and_an_untold_parent_is_told_by_a_resend_or_the_reaper(
    conn: Connection,
) -> None:
    """Children ended by hand (no sidecar): a repeated outcome changes nothing; an ender
    that stops between ending the parent and telling its producer leaves ``reply_pending``,
    which the re-sent child outcome, or else the reaper, finishes."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    store = MessageStore(conn)
    for inst in ("a-1", "a-2"):
        await register_idle(conn, inst, "cache.flush")
    async with running_dispatcher(conn, reaper=False):
        first = await client.submit(broadcast("cache.flush", reply_to))
        second = await client.submit(broadcast("cache.flush", reply_to))

        async def fanned_out() -> bool:
            stages = await store.stages([f"{p}.{n}" for p in (first, second) for n in (1, 2)])
            return stages == [Stage.ROUTED] * 4

        await eventually(fanned_out)

    async def end(child: str, stage: Stage, result: bytes | None, error: str | None) -> None:
        fields: dict[str, str | bytes | int] = (
            {"result": result} if result else {"error": error or ""}
        )
        moved = await store.apply(
            Move(child, stage, any_of=frozenset({Stage.ROUTED}), fields=fields)
        )
        assert moved.ok
        record = await record_of(conn, child)
        await store.delivery.deliver(record.envelope, stage, result, error, attempt=record.attempt)

    async def stop_before_telling(parent: Envelope, result: bytes) -> None:
        raise RedisUnavailable("stopped before telling the parent's producer")

    for parent in (first, second):
        await end(f"{parent}.1", Stage.SUCCEEDED, b'{"n": 1}', None)
        record = await record_of(conn, f"{parent}.1")
        await store.delivery.deliver(  # ignored
            record.envelope, Stage.FAILED, None, "late repeat", attempt=record.attempt
        )
        assert (await record_of(conn, parent)).stage is Stage.FANNED_OUT
        store.delivery._tell_parent = stop_before_telling  # type: ignore[method-assign]
        with pytest.raises(RedisUnavailable):
            await end(f"{parent}.2", Stage.FAILED, None, "boom")
        del store.delivery._tell_parent
        ended = await record_of(conn, parent)
        assert ended.stage is Stage.SUCCEEDED and ended.reply_pending
        due = await conn.call("ZSCORE", conn.keys.due, parent)
        assert due is not None and int(due) <= now_ms() + 30_000
    assert await conn.call("XLEN", reply_to) == 0

    # the first: its last child's outcome is sent again (its ender restarted)
    record = await record_of(conn, f"{first}.2")
    await store.delivery.deliver(
        record.envelope, Stage.FAILED, None, "boom", attempt=record.attempt
    )
    # the second: nobody re-sends; the reaper finds reply_pending
    reaper = Reaper(conn)
    verdict = await reaper.resolve(second, await record_of(conn, second), now_ms())
    assert verdict.next_due_ms is None
    results = await collect_replies(conn, reply_to, 2)
    for parent in (first, second):
        assert results[parent].stage is Stage.SUCCEEDED
        assert results[parent].result == {
            "a-1": {"stage": "SUCCEEDED", "id": f"{parent}.1", "result": {"n": 1}},
            "a-2": {"stage": "FAILED", "id": f"{parent}.2", "error": "boom"},
        }
        assert not (await record_of(conn, parent)).reply_pending
    assert await conn.call("XLEN", reply_to) == 2
    ttl = await conn.call("TTL", conn.keys.outcomes(first))
    assert 0 < ttl <= conn.settings.record_ttl_s


async def test_a_broadcast_to_twenty_while_a_thousand_unicast_requests_flow(
    conn: Connection,
) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    instances = [f"echo-{n:02d}" for n in range(20)]
    unicast = [message("text.echo", reply_to, payload={"n": n}) for n in range(1000)]
    async with (
        http_agent("echo") as agent,
        sidecars(conn, agent, instances, "text.echo"),
        running_dispatcher(conn),
    ):
        ids = []
        for chunk in range(0, 500, 100):
            ids += await client.submit_many(unicast[chunk : chunk + 100])
        parent = await client.submit(broadcast("text.echo", reply_to))
        for chunk in range(500, 1000, 100):
            ids += await client.submit_many(unicast[chunk : chunk + 100])
        results = await collect_replies(conn, reply_to, 1001, timeout_s=120)
    assert {results[i].stage for i in ids} == {Stage.SUCCEEDED}
    assert results[parent].stage is Stage.SUCCEEDED
    outcomes = results[parent].result
    assert sorted(outcomes) == instances
    assert {o["stage"] for o in outcomes.values()} == {"SUCCEEDED"}
    for child, inst in await children_of(conn, parent):
        assert agent.log.calls[child] == 1
        assert (await record_of(conn, child)).instance == inst


async def test_send_broadcast_and_trace_its_children_through_the_cli(
    conn: Connection, settings: Settings
) -> None:
    async def cli(*argv: str) -> tuple[int, str]:
        with anyio.fail_after(60):
            done = await anyio.run_process(
                [AGENT_REACH, *argv], env=process_env(settings), check=False
            )
        return done.returncode, (done.stdout + done.stderr).decode()

    async with (
        http_agent("cache") as agent,
        sidecars(conn, agent, ["a-1", "b-1"], "cache.flush"),
        running_dispatcher(conn),
    ):
        code, out = await cli("send", "cache.flush", "--broadcast", "--wait", "--payload", "1")
        assert code == 0, out
        result = json.loads(out)
        assert result["stage"] == "SUCCEEDED" and sorted(result["result"]) == ["a-1", "b-1"]
        parent = result["id"]
        code, out = await cli("trace", parent)
        assert code == 0, out
        assert f"child {parent}.1" in out and f"child {parent}.2" in out
        assert "FANNED_OUT" in out and "all 2 children ended: 2 SUCCEEDED" in out
        code, out = await cli("trace", parent, "--json")
        assert json.loads(out)["children"] == [
            {"id": f"{parent}.1", "instance": "a-1", "stage": "SUCCEEDED"},
            {"id": f"{parent}.2", "instance": "b-1", "stage": "SUCCEEDED"},
        ]
        code, out = await cli("trace", f"{parent}.1", "--json")
        assert "children" not in json.loads(out)  # a child is a plain message


async def test_a_dispatcher_killed_between_parent_and_children_leaves_them_to_its_restart(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    """A real dispatcher process SIGKILLs itself at the failpoint between the parent's record
    and its children's; restarted under its name, it creates every child, each run once."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    store = MessageStore(conn)
    async with http_agent("cache") as agent, sidecars(conn, agent, ["a-1", "a-2"], "cache.flush"):
        env = process_env(settings, AGENT_REACH_FAILPOINTS="dispatcher.after_fan_out=kill")
        process = start(["dispatcher", "--consumer", "d1"], env, tmp_path / "dispatcher.log")
        try:
            parent = await client.submit(broadcast("cache.flush", reply_to))

            async def killed() -> bool:
                return process.poll() is not None

            await eventually(killed)
        finally:
            stop(process)
        assert process.returncode == -signal.SIGKILL, (tmp_path / "dispatcher.log").read_text()
        assert (await record_of(conn, parent)).stage is Stage.FANNED_OUT
        assert await store.stages([f"{parent}.1", f"{parent}.2"]) == [None, None]
        async with running_dispatcher(conn, "d1"):
            (result,) = (await collect_replies(conn, reply_to, 1)).values()
    assert result.stage is Stage.SUCCEEDED and sorted(result.result) == ["a-1", "a-2"]
    assert agent.log.calls == {f"{parent}.1": 1, f"{parent}.2": 1}


async def test_a_child_ended_without_telling_its_parent_is_told_by_the_reaper(
    conn: Connection,
) -> None:
    """An ender that stopped after the child's terminal write and before any telling (an
    operator's command killed midway): the reaper's look at the FANNED_OUT parent tells it."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    store = MessageStore(conn)
    await register_idle(conn, "a-1", "cache.flush")
    async with running_dispatcher(conn, reaper=False):
        parent = await client.submit(broadcast("cache.flush", reply_to))

        async def fanned_out() -> bool:
            return await store.stages([f"{parent}.1"]) == [Stage.ROUTED]

        await eventually(fanned_out)
    moved = await store.apply(
        Move(f"{parent}.1", Stage.CANCELLED, any_of=frozenset({Stage.ROUTED}), fields={})
    )
    assert moved.ok  # ended, and nobody told the parent
    reaper = Reaper(conn)
    before = await record_of(conn, parent)
    assert before.stage is Stage.FANNED_OUT

    verdict = await reaper.resolve(parent, before, now_ms())

    assert verdict.next_due_ms is not None  # it looks again until the parent has ended
    results = await collect_replies(conn, reply_to, 1)
    assert results[parent].stage is Stage.SUCCEEDED
    assert results[parent].result["a-1"]["stage"] == "CANCELLED"


async def test_a_child_id_a_producer_already_used_is_left_alone_and_ends_rejected(
    conn: Connection,
) -> None:
    """A producer's own ``X.1`` before broadcast ``X``: its message is not touched, and the
    broadcast's first child slot ends REJECTED with the reason, not waited for forever."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("cache") as agent,
        sidecars(conn, agent, ["a-1", "a-2"], "cache.flush"),
        running_dispatcher(conn),
    ):
        squatter = await client.submit(message("cache.flush", reply_to, id="bcast-x.1"))
        parent = await client.submit(broadcast("cache.flush", reply_to, id="bcast-x"))
        results = await collect_replies(conn, reply_to, 2)

    assert results[squatter].stage is Stage.SUCCEEDED
    assert load_envelope((await record_of(conn, squatter)).envelope).parent is None
    assert results[parent].stage is Stage.SUCCEEDED
    assert results[parent].result["a-1"] == {
        "stage": "REJECTED",
        "id": "bcast-x.1",
        "error": "child id bcast-x.1 already names another message",
    }
    assert results[parent].result["a-2"]["stage"] == "SUCCEEDED"
