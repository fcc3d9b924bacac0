"""No poison loop: whatever fails inside our own code ends the message with a reason, once —
it never makes a sidecar run the same message again and again — and what a producer's
headers may say reaches the agent exactly once, after ours."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

import msgspec

from adapters.outcome import Outcome
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.due_clock import due_command
from broker.envelope import Envelope, complete, encode_envelope
from broker.errors import RedisReplyError
from broker.metric_fields import field
from broker.records import MessageRecord
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.timekeeping import now_ms
from tests.support.agents import http_agent, recording_agent
from tests.support.harness import (
    collect_replies,
    dead_letters,
    eventually,
    routed_to,
    running_dispatcher,
    running_sidecar,
)
from tests.support.repair import record_in
from workers.reaper import JUDGE_ERROR_RETRY_MS, MAX_JUDGE_ERRORS, Reaper
from workers.resolver import Verdict

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_producer_headers_reach_the_agent_after_ours_each_once(conn: Connection) -> None:
    reply_to = conn.keys.reply("headers")
    envelope = msgspec.convert(
        {
            "capability": "text.echo",
            "reply_to": reply_to,
            "traceparent": TRACEPARENT,
            "idempotency_key": "order 42",
            "headers": {"X-Tenant": "team-a", "Authorization": "Bearer t0k3n"},
        },
        Envelope,
    )
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        message_id = await Client(conn).submit(envelope)
        await collect_replies(conn, reply_to, 1)
    (raw,) = agent.log.raw_headers
    counts = Counter(name.lower() for name, _ in raw)
    sent = {name.lower(): value.decode() for name, value in raw}
    for ours in (b"x-reach-message-id", b"x-reach-idempotency-key", b"x-reach-attempt"):
        assert counts[ours] == 1
    assert counts[b"traceparent"] == counts[b"content-type"] == 1
    assert sent[b"x-reach-message-id"] == message_id
    assert sent[b"x-reach-idempotency-key"] == "order 42"
    assert sent[b"traceparent"] == TRACEPARENT
    assert sent[b"x-tenant"] == "team-a" and sent[b"authorization"] == "Bearer t0k3n"


async def _routed(
    conn: Connection, envelope: Envelope, instance: str, *, stored: bytes | None = None
) -> str:
    """A message ROUTED to ``instance`` and assigned there, as a dispatcher writes it — for
    envelopes stored before today's checks at acceptance (an older version, say);
    ``stored``: other bytes in the record's envelope field."""
    envelope = complete(envelope)
    store = MessageStore(conn)
    now = now_ms()
    await store.accept(
        Acceptance(
            envelope.message_id,
            encode_envelope(envelope) if stored is None else stored,
            envelope.capability,
            deadline_ms=now + 60_000,
            reply_to=envelope.reply_to or "",
            priority=0,
            next_stage=Stage.ROUTED,
            accepted_ms=now,
            instance=instance,
        )
    )
    await conn.call(*due_command(store.keys, envelope.message_id, now))  # the reaper looks at once
    await store.credits.assign(instance, envelope.message_id, 1)
    return envelope.message_id


async def _ended(conn: Connection, message_id: str) -> Stage:
    store = MessageStore(conn)

    async def terminal() -> bool:
        record = await store.get_record(message_id)
        return record is not None and record.stage in (Stage.FAILED, Stage.DEAD)

    await eventually(terminal, timeout_s=40)
    record = await store.get_record(message_id)
    assert record is not None
    return record.stage


async def test_an_envelope_http_cannot_carry_fails_once_instead_of_looping(
    conn: Connection,
) -> None:
    """A non-ASCII header (let through by an older version) makes the HTTP client raise
    before anything is sent. With an idempotent agent this used to run again about once a
    second, for ever; now it fails with the reason, at its first attempt."""
    reply_to = conn.keys.reply("poison")
    poison = Envelope(capability="text.echo", reply_to=reply_to, headers={"X-Name": "café"})
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, idempotent=True),
    ):
        message_id = await _routed(conn, poison, "a-1")
        results = await collect_replies(conn, reply_to, 1)
    assert await _ended(conn, message_id) is Stage.FAILED
    answer = results[message_id]
    assert answer.stage is Stage.FAILED
    assert "cannot build the request" in (answer.error or "")
    assert agent.log.total == 0  # the agent never saw it
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None and record.attempt == 1
    timeline = await MessageStore(conn).get_timeline(message_id)
    assert [e.stage for e in timeline].count(Stage.PROCESSING) == 1


class RaisingTransport:
    """A transport with a defect: it raises instead of answering."""

    def __init__(self) -> None:
        self.calls = 0

    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        self.calls += 1
        raise RuntimeError("transport defect")

    async def aclose(self) -> None:
        return None


async def test_a_transport_that_raises_fails_the_message_with_the_reason(
    conn: Connection,
) -> None:
    transport = RaisingTransport()
    reply_to = conn.keys.reply("raises")
    async with (
        running_sidecar(conn, "p-1", ("text.echo",), transport=transport, idempotent=True),
        running_dispatcher(conn),
    ):
        message_id = await Client(conn).submit(Envelope(capability="text.echo", reply_to=reply_to))
        results = await collect_replies(conn, reply_to, 1)
    assert results[message_id].stage is Stage.FAILED
    assert "transport raised RuntimeError: transport defect" in (results[message_id].error or "")
    assert transport.calls == 1


async def test_a_message_that_keeps_failing_inside_the_sidecar_is_let_go_of(
    settings: Settings,
) -> None:
    """A record the sidecar cannot read (its envelope overwritten with bytes that are not
    an envelope) fails every time it is taken: after a few tries the sidecar lets go of it
    — credit returned, entry acknowledged, the error on its timeline and in the dead
    letters — and the reaper ends it DEAD; the sidecar goes on serving."""
    # the reaper looks at a PROCESSING message soon after its call timeout
    fast = msgspec.structs.replace(settings, sync_call_timeout_s=1.0, processing_grace_s=0.5)
    assert fast.redis_url is not None
    async with (
        open_connection(fast, fast.redis_url) as conn,
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=4),
    ):
        reply_to = conn.keys.reply("after")
        unreadable = b"not an envelope"
        bad = await _routed(conn, Envelope(capability="text.echo"), "a-1", stored=unreadable)

        async def let_go() -> bool:
            return not await conn.call("SMEMBERS", conn.keys.inflight("a-1"))

        await eventually(let_go, timeout_s=20)
        async with running_dispatcher(conn):
            assert await _ended(conn, bad) is Stage.DEAD
            good = await Client(conn).submit(Envelope(capability="text.echo", reply_to=reply_to))
            results = await collect_replies(conn, reply_to, 1)
        events = [e.stage for e in await MessageStore(conn).get_timeline(bad)]
        letters = await dead_letters(conn)
        pending = await conn.call("XPENDING", conn.keys.queue("a-1"), "sidecar")
    assert results[good].stage is Stage.SUCCEEDED
    assert "SIDECAR_ERROR" in events
    reasons = [e["reason"] for e in letters if e["id"] == bad.encode()]
    assert b"sidecar_error" in reasons and any(r.startswith(b"the reaper could") for r in reasons)
    assert pending[0] == 0
    assert agent.log.calls[bad] == 0


async def test_an_agent_answer_nested_too_deeply_fails_the_message_not_the_sidecar(
    conn: Connection,
) -> None:
    from starlette.requests import Request
    from starlette.responses import Response

    async def deep(envelope: dict[str, object], request: Request) -> Response:
        return Response(b"[" * 100_000 + b"]" * 100_000, media_type="application/json")

    reply_to = conn.keys.reply("deep")
    async with (
        http_agent("a", behaviour=deep) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        client = Client(conn)
        first = await client.submit(Envelope(capability="text.echo", reply_to=reply_to))
        results = await collect_replies(conn, reply_to, 1)
    assert results[first].stage is Stage.FAILED
    assert "nested too deeply" in (results[first].error or "")


async def test_garbage_on_an_instance_stream_is_dead_lettered_and_work_goes_on(
    conn: Connection,
) -> None:
    reply_to = conn.keys.reply("after-garbage")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        queue = conn.keys.queue("a-1")
        garbage = [
            [b"\xff\xfe", b"x"],
            [b"id", b"m1"],
            [b"id", b"m1", b"attempt", b"zero"],
            [b"id", b"a{b}", b"attempt", b"1"],
            [b"id", b"m1", b"attempt", b"1", b"evil", b"1"],
        ]
        for fields in garbage:
            await conn.call("XADD", queue, "*", *fields)

        async def all_lettered() -> bool:
            letters = await dead_letters(conn)
            return sum(e["reason"].startswith(b"malformed_entry") for e in letters) == 5

        await eventually(all_lettered, timeout_s=20)
        good = await Client(conn).submit(Envelope(capability="text.echo", reply_to=reply_to))
        results = await collect_replies(conn, reply_to, 1)

        async def all_acknowledged() -> bool:  # the garbage, and the good one once released
            return (await conn.call("XPENDING", queue, "sidecar"))[0] == 0

        await eventually(all_acknowledged)
    assert results[good].stage is Stage.SUCCEEDED
    assert agent.log.total == 1  # none of it ran


async def test_garbage_on_a_reply_stream_does_not_stop_a_client(conn: Connection) -> None:
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        first = await client.request("text.echo", 1, timeout=10)
        stream = client.reply_stream
        assert stream is not None
        for fields in (
            [b"\xff", b"x"],
            [b"id", b"\xff\xfe"],
            [b"id", b"x", b"stage", b"NOT-A-STAGE"],
            [b"id", b"y", b"stage", b"SUCCEEDED", b"result", b"[" * 100_000],
        ):
            await conn.call("XADD", stream, "*", *fields)
        second = await client.request("text.echo", 2, timeout=10)
        reply_to = client.new_reply_stream()
        envelope = Envelope(capability="text.echo", reply_to=reply_to, id="waited-1")
        await conn.call("XADD", reply_to, "*", b"id", b"waited-1", b"stage", b"BOGUS")
        await client.submit(envelope)
        waited = await client.wait_reply(reply_to, "waited-1", timeout_s=10)
    assert first.ok and second.ok and second.result["echo"] == 2
    assert waited is not None and waited.ok
    assert agent.log.total == 3


async def test_what_a_sidecar_role_could_write_wrongly_stops_no_broker_process(
    conn: Connection,
) -> None:
    """A garbage credit notification, a card that does not read, a record that does not:
    each is passed over (said in the log), and a message still runs end to end."""
    reply_to = conn.keys.reply("after-junk")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        await conn.call("PUBLISH", conn.keys.credit_channel, "a-1 notanumber")
        await conn.call("PUBLISH", conn.keys.credit_channel, b"\xff\xfe 1")
        await conn.call("HSET", conn.keys.card("junk-1"), "instance_id", "junk-1", "credits", "x")
        await conn.call("ZADD", conn.keys.agents, now_ms(), "junk-1")
        await conn.call("HSET", conn.keys.record("junk-m"), "stage", "NOT-A-STAGE", "attempt", "x")
        await conn.call("ZADD", conn.keys.due, 0, "junk-m")
        good = await Client(conn).submit(Envelope(capability="text.echo", reply_to=reply_to))
        results = await collect_replies(conn, reply_to, 1)
    assert results[good].stage is Stage.SUCCEEDED
    assert agent.log.total == 1


async def test_a_waiting_message_the_reaper_cannot_read_ends_dead_not_in_a_loop(
    settings: Settings,
) -> None:
    """The reaper's last resort works from any stage: an unreadable waiting message ends
    DEAD with the reason, dead-lettered, its producer told."""
    fast = msgspec.structs.replace(settings, sweep_interval_s=0.05)
    assert fast.redis_url is not None
    async with open_connection(fast, fast.redis_url) as conn, running_dispatcher(conn):
        reply_to = conn.keys.reply("unreadable")
        store = MessageStore(conn)
        now = now_ms()
        await store.accept(
            Acceptance(
                "unreadable-1",
                b"not an envelope",
                "text.echo",
                deadline_ms=now - 1,  # due: the reaper expires it, and must read it to
                reply_to=reply_to,
                priority=0,
                next_stage=Stage.WAITING,
                accepted_ms=now,
            )
        )
        await conn.call(*due_command(store.keys, "unreadable-1", now))
        (answer,) = (await collect_replies(conn, reply_to, 1, timeout_s=30)).values()
        letters = [e for e in await dead_letters(conn) if e["id"] == b"unreadable-1"]
    assert answer.stage is Stage.DEAD and "could not resolve it" in (answer.error or "")
    assert letters and letters[0]["raw"] == b"not an envelope"


async def test_an_invalid_envelope_holds_no_id_a_valid_one_takes_it(conn: Connection) -> None:
    reply_to = conn.keys.reply("fixed")
    bad = msgspec.json.encode({"capability": "Text", "id": "fix-1", "reply_to": reply_to})
    good = msgspec.json.encode({"capability": "text.echo", "id": "fix-1", "reply_to": reply_to})
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        # in one batch, the invalid one first: the valid one still gets the id
        await conn.call_many(
            [
                ("XADD", conn.keys.ingress, "*", "envelope", bad),
                ("XADD", conn.keys.ingress, "*", "envelope", good),
            ]
        )

        async def succeeded() -> bool:
            record = await MessageStore(conn).get_record("fix-1")
            return record is not None and record.stage is Stage.SUCCEEDED

        await eventually(succeeded)
    assert agent.log.calls["fix-1"] == 1


class _Unendable:
    """A resolver whose every look at a message fails, and whose ending of it DEAD is
    refused by Redis too (an ACL without the script, say)."""

    async def resolve(self, message_id: str, record: MessageRecord | None, now: int) -> Verdict:
        raise ValueError(f"{message_id} cannot be read")

    async def unresolvable(self, record: MessageRecord, error: Exception) -> Verdict:
        raise RedisReplyError("NOPERM this user has no permissions to run the 'evalsha' command")


async def test_a_message_that_cannot_be_ended_dead_either_is_looked_at_again_alone(
    conn: Connection,
) -> None:
    """Its refusal stays with it: a retry verdict, never an error that fails its batch."""
    message_id = await record_in(conn, Stage.PROCESSING)
    record = await MessageStore(conn).get_record(message_id)
    reaper = Reaper(conn)
    reaper.resolver = _Unendable()  # type: ignore[assignment]
    now = now_ms()
    verdicts = [
        await reaper.resolve_guarded(message_id, record, now) for _ in range(MAX_JUDGE_ERRORS + 1)
    ]
    assert [v.action for v in verdicts] == ["error"] * (MAX_JUDGE_ERRORS + 1)
    assert all(v.next_due_ms == now + JUDGE_ERROR_RETRY_MS for v in verdicts)


async def test_an_assignment_of_a_record_that_does_not_read_is_dropped_not_a_crash(
    conn: Connection,
) -> None:
    """A record whose stage or attempt no version wrote (a hand, or a role that may write
    records), and its assignment on a sidecar's stream: the delivery is dropped as one that
    is not this instance's to run (said in the log, acknowledged), the record left alone; the
    sidecar goes on, and a message after it runs."""
    queue = conn.keys.queue("a-1")
    junk = {  # stage, attempt, instance, accepted_ms
        "junk-s": ("NOT-A-STAGE", "1", "a-1", "1"),
        "junk-a": ("ROUTED", "x", "a-1", "1"),
        "junk-i": ("PROCESSING", "1", b"\xff\xfe", "1"),
        "junk-t": ("ROUTED", "1", "a-1", "abc"),  # moved, then found to hold no envelope
    }

    async def write() -> None:
        for message_id, (stage, attempt, instance, accepted) in junk.items():
            fields = ("stage", stage, "attempt", attempt, "instance", instance)
            await conn.call("HSET", conn.keys.record(message_id), *fields, "accepted_ms", accepted)
            await conn.call("XADD", queue, "*", "id", message_id, "attempt", "1")

    assert await served_after(conn, write) == (Stage.SUCCEEDED, 1)
    assert await conn.call("HGET", conn.keys.record("junk-s"), "stage") == b"NOT-A-STAGE"


async def test_an_assignment_whose_record_is_another_type_is_dead_lettered_not_a_stall(
    conn: Connection,
) -> None:
    """A key of another type where an assigned message's record should be (anyone allowed to
    write records can make one): Redis answers its move with an error, for that entry alone.
    The entry is dead-lettered with the error and acknowledged; the sidecar reads on, and a
    message after it runs — where one such entry used to fail every batch, and every read."""

    async def write() -> None:
        await conn.call("SET", conn.keys.record("not-a-hash"), "x")
        await conn.call("XADD", conn.keys.queue("a-1"), "*", "id", "not-a-hash", "attempt", "1")

    assert await served_after(conn, write) == (Stage.SUCCEEDED, 1)
    (letter,) = await dead_letters(conn)
    reason = letter["reason"].decode()
    assert reason.startswith("unusable_record: ") and "WRONGTYPE" in reason
    assert b"not-a-hash" in letter["raw"]
    assert await conn.call("GET", conn.keys.record("not-a-hash")) == b"x"


async def test_an_unusable_record_in_the_pending_list_is_dead_lettered_at_start(
    conn: Connection,
) -> None:
    """A restarted sidecar takes its pending list first, the plain way (RECEIVED, then
    PROCESSING where RECEIVED was made). An entry there whose record is a key of another
    type is dead-lettered with the error and acknowledged, its credit returned, and the
    message pending beside it runs — where the error used to fail the whole list, at every
    start and every recheck."""
    queue = conn.keys.queue("a-1")
    await conn.call("XGROUP", "CREATE", queue, "sidecar", "0", "MKSTREAM")
    await conn.call("SET", conn.keys.record("not-a-hash"), "x")
    # assigned against a credit before its record was spoiled: the credit comes back
    await conn.call("SADD", conn.keys.inflight("a-1"), "not-a-hash:1")
    good = await routed_to(conn, "a-1")
    await conn.call("XADD", queue, "*", "id", "not-a-hash", "attempt", "1")
    await conn.call("XADD", queue, "*", "id", good, "attempt", "1")
    # both delivered to a-1 and never acknowledged: what a sidecar killed at once leaves
    await conn.call("XREADGROUP", "GROUP", "sidecar", "a-1", "STREAMS", queue, ">")
    agent, calls = recording_agent("a")
    store = MessageStore(conn)

    async def acknowledged() -> bool:
        return (await conn.call("XPENDING", queue, "sidecar"))[0] == 0

    async def served() -> bool:
        return await store.stages([good]) == [Stage.SUCCEEDED]

    async with running_sidecar(conn, "a-1", ("text.echo",), transport=agent) as sidecar:
        await eventually(served)
        await eventually(acknowledged)
        assert not sidecar.stopped.is_set()
    assert calls == [good]
    assert await conn.call("SISMEMBER", conn.keys.inflight("a-1"), "not-a-hash:1") == 0
    (letter,) = await dead_letters(conn)
    reason = letter["reason"].decode()
    assert reason.startswith("unusable_record: ") and "WRONGTYPE" in reason
    assert b"not-a-hash" in letter["raw"]


async def test_a_malformed_entry_whose_dead_letter_count_is_spoiled_still_goes(
    conn: Connection,
) -> None:
    """The dead letters' counter made no number (any sidecar's Redis user may write the
    counters): the entry is dead-lettered once and acknowledged, its count lost and said in
    the log, and the sidecar reads on — where the refused count held the entry pending, and
    wrote its letter again at every look, and no new work was read."""
    spoiled = field("dead_letters", "malformed_entry")

    async def write() -> None:
        await conn.call("HSET", conn.keys.counters, spoiled, "x")
        await conn.call("XADD", conn.keys.queue("a-1"), "*", "junk", "1")

    assert await served_after(conn, write) == (Stage.SUCCEEDED, 1)
    letters = [x for x in await dead_letters(conn) if b"malformed_entry" in x["reason"]]
    assert len(letters) == 1


async def served_after(conn: Connection, write: Callable[[], Awaitable[None]]) -> tuple[Stage, int]:
    """Sidecar a-1 (an HTTP agent) and a dispatcher; ``write`` puts what it puts on a-1's
    stream, then one message is sent: its outcome and the agent's calls, once every entry on
    the stream is acknowledged with the sidecar still running."""
    reply_to = conn.keys.reply("after-junk")
    queue = conn.keys.queue("a-1")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url) as sidecar,
        running_dispatcher(conn),
    ):
        await write()
        good = await Client(conn).submit(Envelope(capability="text.echo", reply_to=reply_to))
        results = await collect_replies(conn, reply_to, 1, timeout_s=20)

        async def acknowledged() -> bool:
            return (await conn.call("XPENDING", queue, "sidecar"))[0] == 0

        await eventually(acknowledged)
        assert not sidecar.stopped.is_set()
    return results[good].stage, agent.log.total
