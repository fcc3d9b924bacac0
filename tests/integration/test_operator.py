"""The operator's repairs against a real Redis, real dispatchers and sidecars, real HTTP agents."""

from __future__ import annotations

import msgspec
import pytest

from broker.client import Client
from broker.connection import Connection
from broker.deadletters import Letter
from broker.errors import RedisReplyError, UnknownMessage
from broker.operator import Operator
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from tests.support.agents import http_agent
from tests.support.harness import (
    card,
    collect_replies,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from tests.support.repair import echo, everything, reaches, record_in, saturated, stage_of, unsure

MINUTE_MS = 60_000


async def last_reason(conn: Connection, message_id: str) -> str:
    return (await MessageStore(conn).get_timeline(message_id))[-1].reason


async def test_an_unknown_id_is_named_and_nothing_changes(conn: Connection) -> None:
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reply_to=conn.keys.reply("p"))
    before = await everything(conn)
    operator = Operator(conn)
    with pytest.raises(UnknownMessage, match="unknown message id 'no-such-id'"):
        await operator.plan_replay([parked, "no-such-id"])
    with pytest.raises(UnknownMessage, match="'no-such-id'"):
        await operator.resolve("no-such-id", by="alice", error="gone")
    with pytest.raises(UnknownMessage, match="'no-such-id'"):
        await operator.cancel("no-such-id", by="alice")
    assert await everything(conn) == before
    assert await stage_of(conn, parked) is Stage.NEEDS_CONFIRMATION


async def test_replay_of_a_needs_confirmation_message_runs_it_again_to_success(
    conn: Connection,
) -> None:
    operator = Operator(conn)
    async with unsure(conn) as pair:
        message_id = await pair.parked()
        plan = await operator.plan_replay([message_id])
        assert [r.id for r in plan.records] == [message_id] and not plan.refused
        assert plan.unsafe == {"text.echo": "served by non-idempotent a-1, a-2"}
        (action,) = await operator.replay(plan, by="alice")
        assert action.done and action.stage is Stage.WAITING
        (result,) = (await collect_replies(conn, pair.reply_to, 1)).values()
    assert result.stage is Stage.SUCCEEDED and result.id == message_id
    assert pair.agent.log.calls[message_id] == 2
    first, second = pair.agent.log.headers
    assert first["x-reach-idempotency-key"] == second["x-reach-idempotency-key"] == message_id
    # the replay is attempt 2 (the answer it leads to is a new one); its delivery attempt 3
    assert (first["x-reach-attempt"], second["x-reach-attempt"]) == ("1", "3")
    timeline = await MessageStore(conn).get_timeline(message_id)
    replayed = next(e for e in timeline if e.reason == "replayed by alice")
    assert replayed.stage is Stage.WAITING and replayed.attempt == 2  # the replay is one


async def test_replay_from_the_dead_letter_stream_runs_the_dead_and_notes_the_rejected(
    conn: Connection,
) -> None:
    reply_to = conn.keys.reply("dlq")
    dead = await record_in(conn, Stage.DEAD, reply_to=reply_to, reason="gave up after 3")
    await MessageStore(conn).delivery.dead_letter(
        Letter(id="x", reason="reply_undeliverable: WRONGTYPE", ts_ms=now_ms())
    )
    operator = Operator(conn)
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, idempotent=True),
        running_dispatcher(conn),
    ):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", b'{"capability": "Bad"}')

        async def rejected() -> bool:
            return len((await operator.dead_letters(10)).letters) == 3

        await eventually(rejected)
        plan = await operator.plan_dlq_replay()
        assert [r.id for r in plan.records] == [dead]
        assert plan.unsafe == {}  # the only instance serving it is idempotent: no question
        actions = await operator.replay(plan, by="bob")
        (result,) = (await collect_replies(conn, reply_to, 1)).values()
    assert result.stage is Stage.SUCCEEDED and agent.log.calls[dead] == 1
    done = {a.id: a for a in actions if a.done}
    skipped = [a.detail for a in actions if not a.done]
    assert list(done) == [dead]
    assert any("an invalid envelope cannot be replayed" in s for s in skipped), skipped
    assert "x was dead-lettered for reply_undeliverable: WRONGTYPE: not DEAD" in skipped[0]
    record = await MessageStore(conn).get_record(dead)
    assert record is not None and record.attempt == 3 and record.error in ("", None)
    again = await operator.plan_dlq_replay()
    assert not again.records
    assert f"{dead} is no longer DEAD (now SUCCEEDED), not replayed" in [
        a.detail for a in again.refused
    ]


async def test_replay_of_a_whole_stage_parks_each_with_a_fresh_deadline(conn: Connection) -> None:
    parked = [await record_in(conn, Stage.NEEDS_CONFIRMATION) for _ in range(3)]
    busy = await record_in(conn, Stage.PROCESSING)
    operator = Operator(conn)
    plan = await operator.plan_stage_replay(Stage.NEEDS_CONFIRMATION)
    assert sorted(r.id for r in plan.records) == sorted(parked)
    assert plan.unsafe == {"text.echo": "no instance serving it is registered"}
    started = now_ms()
    actions = await operator.replay(plan, by="carol")
    assert all(a.done for a in actions) and len(actions) == 3
    store = MessageStore(conn)
    assert await store.waiting.depth("text.echo") == 3
    assert await store.waiting.capabilities() == ["text.echo"]
    for message_id in parked:
        record = await store.get_record(message_id)
        assert record is not None and record.stage is Stage.WAITING
        assert record.deadline_ms >= started + 300_000  # the envelope's timeout_s, from now
        score = await conn.call("ZSCORE", conn.keys.due, message_id)
        assert int(float(score)) == record.deadline_ms
    assert await stage_of(conn, busy) is Stage.PROCESSING


async def test_replay_brings_an_ended_message_back_without_its_expiry(conn: Connection) -> None:
    failed = await record_in(conn, Stage.FAILED, reason="agent answered 500")
    assert int(await conn.call("TTL", conn.keys.record(failed))) > 0  # ended: it expires
    before = await MessageStore(conn).get_record(failed)
    assert before is not None and before.error == "agent answered 500"
    operator = Operator(conn)
    plan = await operator.plan_replay([failed], include_ended=True)
    (action,) = await operator.replay(plan, by="ida")
    assert action.done and action.detail == f"{failed} (was FAILED)"
    record = await MessageStore(conn).get_record(failed)
    assert record is not None and record.stage is Stage.WAITING and record.error == ""
    assert record.attempt == before.attempt + 1  # a new attempt: another answer
    assert int(await conn.call("TTL", conn.keys.record(failed))) == -1  # lives until it ends
    assert await last_reason(conn, failed) == "replayed by ida"


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("stage", [Stage.FAILED, Stage.EXPIRED, Stage.CANCELLED])
async def test_an_ended_message_is_replayed_only_when_asked_and_its_producer_told(
    conn: Connection, stage: Stage
) -> None:
    reply_to = conn.keys.reply("ended")
    ended = await record_in(conn, stage, reply_to=reply_to, reason="it ended")
    operator = Operator(conn)
    (refused,) = (await operator.plan_replay([ended])).refused
    assert not refused.done and "--include-ended" in refused.detail
    assert await stage_of(conn, ended) is stage  # untouched
    (action,) = await operator.replay(
        await operator.plan_replay([ended], include_ended=True), by="ida"
    )
    assert action.done
    entries = await conn.call("XRANGE", reply_to, "-", "+")
    fields = {k.decode(): v for k, v in zip(entries[-1][1][::2], entries[-1][1][1::2], strict=True)}
    assert fields["notice"] == b"replayed" and fields["id"] == ended.encode()
    assert b"a new answer follows" in fields["error"]


async def test_resolve_closes_by_hand_tells_the_producer_and_records_who(
    conn: Connection,
) -> None:
    reply_to = conn.keys.reply("resolve")
    good = await record_in(conn, Stage.NEEDS_CONFIRMATION, reply_to=reply_to)
    bad = await record_in(conn, Stage.NEEDS_CONFIRMATION, reply_to=reply_to)
    operator = Operator(conn)
    with pytest.raises(msgspec.DecodeError):
        await operator.resolve(good, by="dan", result=b'{"refund": ')
    assert await stage_of(conn, good) is Stage.NEEDS_CONFIRMATION

    ok = await operator.resolve(good, by="dan", result=b'{"refund": 12}')
    failed = await operator.resolve(bad, by="dan", error="refunded by phone")
    assert ok.done and ok.stage is Stage.SUCCEEDED
    assert failed.done and failed.stage is Stage.FAILED
    replies = await collect_replies(conn, reply_to, 2)
    assert replies[good].stage is Stage.SUCCEEDED and replies[good].result == {"refund": 12}
    assert replies[bad].stage is Stage.FAILED and replies[bad].error == "refunded by phone"
    assert await last_reason(conn, good) == "resolved by dan: succeeded"
    assert await last_reason(conn, bad) == "resolved by dan: failed: refunded by phone"
    assert await conn.call("ZSCORE", conn.keys.due, good) is None
    assert await conn.call("ZSCORE", conn.keys.due, bad) is None

    again = await operator.resolve(good, by="eve", error="too late")
    assert not again.done and again.stage is Stage.SUCCEEDED
    assert again.detail == f"{good} is SUCCEEDED: only a NEEDS_CONFIRMATION message can be resolved"
    assert await last_reason(conn, good) == "resolved by dan: succeeded"


async def test_a_message_in_flight_is_refused_precisely_and_left_alone(conn: Connection) -> None:
    operator = Operator(conn)
    async with saturated(conn) as held:
        reply_to = held.client.new_reply_stream()
        busy = await held.busy(reply_to)
        timeline = await MessageStore(conn).get_timeline(busy)
        cancelled = await operator.cancel(busy, by="fay")
        resolved = await operator.resolve(busy, by="fay", result=b"{}")
        plan = await operator.plan_replay([busy])
        assert not plan.records
        (replayed,) = await operator.replay(plan, by="fay")
        assert await MessageStore(conn).get_timeline(busy) == timeline  # nothing written
        held.gate.open()
        (result,) = (await collect_replies(conn, reply_to, 1)).values()
    assert cancelled.detail == (
        f"{busy} is PROCESSING: the agent may be working on it; it cannot be cancelled"
    )
    assert resolved.detail == (
        f"{busy} is PROCESSING: only a NEEDS_CONFIRMATION message can be resolved"
    )
    assert replayed.detail == f"{busy} is PROCESSING: still in flight, not replayed"
    assert not (cancelled.done or resolved.done or replayed.done)
    assert result.stage is Stage.SUCCEEDED and held.agent.log.calls[busy] == 1


async def test_cancel_of_a_waiting_message_means_the_agent_never_sees_it(
    conn: Connection,
) -> None:
    store = MessageStore(conn)
    async with saturated(conn) as held:
        reply_to = held.client.new_reply_stream()
        first = await held.busy(reply_to)
        queued = await held.queued(reply_to)
        action = await Operator(conn).cancel(queued, by="gus")
        assert action.done and action.stage is Stage.CANCELLED
        assert await store.waiting.depth("text.echo") == 0
        later = await held.client.submit(echo(reply_to))  # behind `queued` had it stayed
        held.gate.open()
        results = await collect_replies(conn, reply_to, 3)
    assert results[queued].stage is Stage.CANCELLED
    assert results[queued].error == "cancelled by gus"
    assert results[first].stage is results[later].stage is Stage.SUCCEEDED
    assert held.agent.log.calls[queued] == 0 and held.agent.log.total == 2
    assert await last_reason(conn, queued) == "cancelled by gus"
    assert await conn.call("ZSCORE", conn.keys.due, queued) is None


async def test_cancel_of_a_routed_message_is_dropped_by_fencing_and_its_credit_returns(
    conn: Connection,
) -> None:
    """Routed to an instance whose sidecar has not started yet: when it starts, it reads the
    entry, finds the record CANCELLED, drops it unexecuted and returns the credit."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    await Registry(conn).register(card("a-1", ("text.echo",), max_inflight=1), credits=1)
    async with http_agent("a") as agent:
        async with running_dispatcher(conn):
            routed = await client.submit(echo(reply_to))
            await reaches(conn, routed, Stage.ROUTED)

            async def credit_taken() -> bool:  # the assignment follows the record's move
                return int(await conn.call("SCARD", conn.keys.inflight("a-1"))) == 1

            await eventually(credit_taken)
            action = await Operator(conn).cancel(routed, by="hal")
        assert action.done and action.detail == f"{routed} cancelled by hal (was ROUTED)"
        (told,) = (await collect_replies(conn, reply_to, 1)).values()
        assert told.stage is Stage.CANCELLED
        async with running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=1):

            async def credit_returned() -> bool:
                return int(await conn.call("SCARD", conn.keys.inflight("a-1"))) == 0

            await eventually(credit_returned)
            async with running_dispatcher(conn):
                after = await client.submit(echo(reply_to))
                await reaches(conn, after, Stage.SUCCEEDED)
    assert agent.log.calls[routed] == 0 and agent.log.total == 1
    assert await stage_of(conn, routed) is Stage.CANCELLED


async def test_stuck_lists_work_in_flight_with_its_age_stage_and_last_reason(
    conn: Connection,
) -> None:
    operator = Operator(conn)
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reason="no answer")
    await record_in(conn, Stage.SUCCEEDED)  # ended: never listed
    async with saturated(conn) as held:
        busy = await held.busy()
        queued = [await held.queued() for _ in range(3)]
        found = await operator.stuck(older_than_s=0)
        paged = await operator.stuck(older_than_s=0, page=2)
        waiting = await operator.stuck(older_than_s=0, stage=Stage.WAITING)
        recent = await operator.stuck(older_than_s=300)
        later = await operator.stuck(older_than_s=300, now=now_ms() + 6 * MINUTE_MS)
    assert {m.id for m in found} == {parked, busy, *queued}
    assert [m.id for m in paged] == [m.id for m in found]
    assert {m.id for m in waiting} == set(queued)
    assert recent == [] and {m.id for m in later} == {m.id for m in found}
    assert found[0].id == parked  # the oldest first
    by_id = {m.id: m for m in found}
    assert by_id[parked].last_reason == "no answer"
    assert (by_id[busy].stage, by_id[busy].instance, by_id[busy].attempt) == (
        Stage.PROCESSING,
        "a-1",
        1,
    )
    for message_id in queued:
        assert by_id[message_id].last_reason == await last_reason(conn, message_id)
        assert by_id[message_id].last_reason  # why it waits
    assert all(0 <= m.age_s <= m.accepted_age_s for m in found)


async def test_stuck_passes_over_due_members_that_are_no_message_id(conn: Connection) -> None:
    """A sidecar's user may add to the due index: a member not UTF-8 made `stuck` and the
    console's messages page fail."""
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reason="no answer")
    await conn.call("ZADD", conn.keys.due, 0, b"\xff\xfe", 1, "not an id")

    found = await Operator(conn).stuck(older_than_s=0, page=2)

    assert [m.id for m in found] == [parked]


async def test_a_dead_letter_key_of_another_type_is_said_in_redis_words(conn: Connection) -> None:
    """On Redis 6.2 a sidecar's user may make P:dlq a set: the count of it failed `int()`
    with a TypeError, a 500 from the console, where Redis's own refusal belongs."""
    await conn.call("SADD", conn.keys.dlq, "junk")

    with pytest.raises(RedisReplyError, match="WRONGTYPE"):
        await Operator(conn).dead_letters(10)


async def test_dead_letters_come_newest_last_with_their_raw_bytes(conn: Connection) -> None:
    operator = Operator(conn)
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", b'{"capability": "Bad"}')
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", b"\xff\xfe not utf-8")

        async def both() -> bool:
            return (await operator.dead_letters(10)).total == 2

        await eventually(both)
    dead = await record_in(conn, Stage.DEAD, reason="gave up")
    found = await operator.dead_letters(10)
    assert found.total == 3
    bad, binary, last = found.letters
    assert bad.stage == binary.stage == "REJECTED" and "capability" in bad.reason
    assert bad.raw == '{"capability": "Bad"}' and bad.raw_base64 is None
    assert binary.raw is None and binary.raw_base64 == b"\xff\xfe not utf-8"
    assert (last.id, last.stage, last.reason) == (dead, "DEAD", "gave up")
    assert bad.ts_ms <= binary.ts_ms <= last.ts_ms
    newest = await operator.dead_letters(2)
    assert newest.total == 3 and newest.letters == [binary, last]
