"""What producers put on the ingress stream: raw XADDs, bad input, rejections."""

from __future__ import annotations

import subprocess
import time

import msgspec

from broker.client import Client
from broker.connection import Connection
from broker.embedded import find_redis_server
from broker.keyspace import due_for
from broker.replies import Result
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import RunningAgent, http_agent
from tests.support.harness import (
    collect_replies,
    dead_letters,
    eventually,
    keys_matching,
    running_dispatcher,
    running_sidecar,
)
from workers.intake import Intake


def redis_cli(conn: Connection, *args: str) -> str:
    """redis-cli against the test's Redis (``-c``: on a cluster it follows ``MOVED``)."""
    cli = find_redis_server().with_name("redis-cli")
    done = subprocess.run(
        [str(cli), "-c", "-u", conn.url, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return done.stdout.strip()


async def test_raw_redis_cli_xadd_without_id_is_processed(
    conn: Connection,
) -> None:
    reply_to = conn.keys.reply("cli")
    envelope = {"capability": "text.echo", "payload": {"x": 1}, "reply_to": reply_to}
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        redis_cli(
            conn,
            "XADD",
            conn.keys.ingress,
            "*",
            "envelope",
            msgspec.json.encode(envelope).decode(),
        )
        results = await collect_replies(conn, reply_to, 1)

    (result,) = results.values()
    assert result.stage is Stage.SUCCEEDED
    assert result.result == {"agent": "a", "echo": {"x": 1}}
    assert len(result.id) == 26  # the dispatcher assigned a ULID
    trace = await Client(conn).trace(result.id)
    assert [e.stage for e in trace.timeline][-1] is Stage.SUCCEEDED


BAD = [
    (b'{"capability": "text.echo", "payload": ', "invalid JSON"),
    (b'{"payload": {"x": 1}}', "a capability (or an intent) is required"),
    (b'{"capability": "TextEcho"}', "capability must be lower-case, dot-separated"),
]


async def test_invalid_envelopes_are_rejected_with_a_reason_and_the_next_one_runs(
    conn: Connection,
) -> None:
    reply_to = conn.keys.reply("after")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        for raw, _ in BAD:
            await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        await conn.call("XADD", conn.keys.ingress, "*", "nothing", "here")  # no envelope field
        good = msgspec.json.encode({"capability": "text.echo", "reply_to": reply_to})
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", good)
        results = await collect_replies(conn, reply_to, 1)

    assert [r.stage for r in results.values()] == [Stage.SUCCEEDED]
    letters = await dead_letters(conn)
    assert len(letters) == 4
    store = MessageStore(conn)
    for (raw, reason), letter in zip(BAD, letters, strict=False):
        assert letter["raw"] == raw  # the original bytes, untouched
        assert letter["stage"] == b"REJECTED"
        assert reason in letter["reason"].decode()
        record = await store.get_record(letter["id"].decode())
        assert record is not None and record.stage is Stage.REJECTED
        assert reason in (record.error or "")
    assert letters[3]["reason"] == b"stream entry has no `envelope` field (its fields: 'nothing')"
    assert letters[3]["raw"] == b'[["nothing","here"]]'  # every field, losslessly
    assert agent.log.total == 1


async def test_rejection_is_reported_to_a_usable_reply_to(conn: Connection) -> None:
    reply_to = conn.keys.reply("bad")
    raw = msgspec.json.encode({"capability": "text.echo", "priority": 12, "reply_to": reply_to})
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        results = await collect_replies(conn, reply_to, 1)
    (result,) = results.values()
    assert result.stage is Stage.REJECTED
    assert "priority" in (result.error or "")


async def test_reply_to_outside_the_reply_namespace_is_rejected(conn: Connection) -> None:
    raw = msgspec.json.encode({"capability": "text.echo", "reply_to": conn.keys.ingress})
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        await _until_dead_letter(conn)
    (letter,) = await dead_letters(conn)
    assert b"must start with" in letter["reason"]
    # nothing was written to the stream it named
    assert int(await conn.call("XLEN", conn.keys.ingress)) == 1


async def test_oversize_envelope_is_rejected(conn: Connection) -> None:
    limit = conn.settings.max_envelope_bytes
    raw = msgspec.json.encode({"capability": "text.echo", "payload": "x" * limit})
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        await _until_dead_letter(conn)
    (letter,) = await dead_letters(conn)
    assert f"over the {limit}-byte limit".encode() in letter["reason"]


async def _until_dead_letter(conn: Connection) -> None:
    async def present() -> bool:
        return bool(await dead_letters(conn))

    await eventually(present, timeout_s=10)


async def test_callback_url_outside_the_allow_list_is_rejected_with_the_reason(
    conn: Connection,
) -> None:
    reply_to = conn.keys.reply("hooks")
    raw = msgspec.json.encode(
        {"capability": "text.echo", "reply_to": reply_to, "callback_url": "http://evil.example/h"}
    )
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        results = await collect_replies(conn, reply_to, 1)
    (result,) = results.values()
    assert result.stage is Stage.REJECTED
    assert "host 'evil.example' is not allowed" in (result.error or "")


async def test_a_producer_cannot_pose_as_a_broadcast_child(conn: Connection) -> None:
    raw = msgspec.json.encode({"capability": "text.echo", "parent": "someone-else"})
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        await _until_dead_letter(conn)
    (letter,) = await dead_letters(conn)
    assert letter["reason"] == b"invalid envelope: `parent` is set by the broker only"


async def test_an_entry_id_far_ahead_of_the_clock_poisons_no_message_id(conn: Connection) -> None:
    reply_to = conn.keys.reply("far")
    far = 1 << 50  # beyond what a ULID's time can hold
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        for n in (1, 2):
            raw = msgspec.json.encode(
                {"capability": "text.echo", "payload": n, "reply_to": reply_to}
            )
            entry_id = f"{far}-0" if n == 1 else "*"  # then Redis's own ids inherit that time
            added = await conn.call("XADD", conn.keys.ingress, entry_id, "envelope", raw)
            assert int(added.split(b"-")[0]) == far
        results = await collect_replies(conn, reply_to, 2)

    assert sorted(r.result["echo"] for r in results.values()) == [1, 2]
    assert all(r.stage is Stage.SUCCEEDED for r in results.values())
    now = time.time()
    for message_id in results:  # minted from the dispatcher's clock, not the entry's
        assert abs(decode_ulid_time(message_id) / 1000 - now) < 120

    async def names_forgotten() -> bool:  # kept only until the entries were acknowledged
        return not await keys_matching(conn, f"{conn.keys.prefix}:e:*")

    await eventually(names_forgotten)


async def test_an_entry_handled_again_names_the_same_message(conn: Connection) -> None:
    """A dispatcher restarted mid-batch handles its pending entries again: each names the
    message it named the first time, whether its id was derived or minted."""
    raw = msgspec.json.encode({"capability": "text.echo"})
    await conn.call("XADD", conn.keys.ingress, f"{1 << 50}-0", "envelope", raw)  # ahead: minted
    entries = await conn.call("XRANGE", conn.keys.ingress, "-", "+")
    await conn.call("DEL", conn.keys.ingress)
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)  # in the past: derived
    entries += await conn.call("XRANGE", conn.keys.ingress, "-", "+")
    batch = [(entry_id.decode(), flat) for entry_id, flat in entries]
    intake = Intake(conn, MessageStore(conn))
    first = await intake.take(batch, recovering=False)
    again = await intake.take(batch, recovering=True)
    assert [e.message_id for e in again.envelopes] == [e.message_id for e in first.envelopes]
    assert len({e.message_id for e in first.envelopes}) == 2
    assert len(first.minted) == 1 and again.minted == first.minted


def decode_ulid_time(text: str) -> int:
    """The milliseconds of a ULID (its first ten Crockford base32 characters)."""
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    value = 0
    for char in text[:10]:
        value = value * 32 + alphabet.index(char)
    return value


async def test_a_producer_is_told_when_its_entry_carries_a_stray_field(conn: Connection) -> None:
    reply_to = conn.keys.reply("stray")
    raw = msgspec.json.encode({"capability": "text.echo", "id": "stray-1", "reply_to": reply_to})
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw, "trace", "x")
        results = await collect_replies(conn, reply_to, 1)
    assert results["stray-1"].stage is Stage.REJECTED
    assert "fields besides `envelope`: 'trace'" in (results["stray-1"].error or "")


async def served(
    conn: Connection, reply_to: str, count: int
) -> tuple[dict[str, Result], RunningAgent]:
    """What is in the ingress served (an echo agent, its sidecar, a dispatcher) until
    ``count`` outcomes are on ``reply_to`` and no entry is left pending; those and the
    agent."""
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        results = await collect_replies(conn, reply_to, count)

        async def none_pending() -> bool:
            return (await conn.call("XPENDING", conn.keys.ingress, "dispatch"))[0] == 0

        await eventually(none_pending)
    return results, agent


async def test_dead_letters_and_events_redis_refuses_for_good_do_not_stop_the_ingress(
    conn: Connection,
) -> None:
    """Whoever may write ``P:dlq`` or ``P:events`` (a sidecar's user may) can give them an
    entry with the last possible id: every later ``XADD *`` there is refused. A rejection
    raised that refusal, its entry was handled again, and refused again, for good: no entry
    behind it was read. Now the rejection's record and answer stand, the refusal is logged,
    and the entries behind it run."""
    last_id = "18446744073709551615-18446744073709551615"
    await conn.call("XADD", conn.keys.dlq, last_id, "x", "y")
    await conn.call("XADD", conn.fleet.events, last_id, "x", "y")
    reply_to = conn.keys.reply("behind")
    bad = msgspec.json.encode({"capability": "NOT A CAPABILITY", "reply_to": reply_to})
    good = msgspec.json.encode({"capability": "text.echo", "reply_to": reply_to})
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", bad)
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", b"not json")
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", good)
    results, agent = await served(conn, reply_to, 2)
    assert sorted(r.stage for r in results.values()) == [Stage.REJECTED, Stage.SUCCEEDED]
    assert agent.log.total == 1


async def test_a_refused_entry_naming_a_message_of_its_own_batch_does_not_answer_for_it(
    conn: Connection,
) -> None:
    """An invalid entry that names the id (and the reply stream) of a valid one read in the
    same batch was refused first: its REJECTED record, and an outcome on the valid one's
    reply stream, came before the valid one was accepted — and that producer was told
    REJECTED of a message that then ran. Now the refusal is a notice, as for any id that
    names another message."""
    reply_to = conn.keys.reply("victim")
    valid = msgspec.json.encode({"id": "twin-1", "capability": "text.echo", "reply_to": reply_to})
    twin = msgspec.json.encode({"id": "twin-1", "capability": "NOT A CAP", "reply_to": reply_to})
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", valid)
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", twin)
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        results = await collect_replies(conn, reply_to, 1)
    told = await conn.call("XRANGE", reply_to, "-", "+")
    letters = await dead_letters(conn)
    assert [(i, r.stage) for i, r in results.items()] == [("twin-1", Stage.SUCCEEDED)]
    assert len(told) == 2  # the refusal's notice, and the outcome
    assert b"notice" in told[0][1] and b"REJECTED" not in told[1][1]
    [letter] = letters
    assert b"id twin-1 already names another message" in letter["reason"]
    assert agent.log.total == 1


async def test_an_entry_whose_record_key_was_spoiled_is_refused_and_the_rest_run(
    conn: Connection,
) -> None:
    """Anyone who may write records (a sidecar's user may) can make the record key of an id
    a producer will choose a key of another type. Its acceptance failed the whole batch with
    WRONGTYPE, again at every try: the lane read nothing more. Now the batch goes one entry
    at a time, that entry is refused with the reason, and the rest run."""
    reply_to = conn.keys.reply("spoiled")
    await conn.call("RPUSH", conn.keys.record("order-42"), "x")
    for message_id in ("order-42", "next-1"):
        envelope = {"id": message_id, "capability": "text.echo", "reply_to": reply_to}
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", msgspec.json.encode(envelope))
    results, agent = await served(conn, reply_to, 2)
    [letter] = await dead_letters(conn)
    assert results["next-1"].stage is Stage.SUCCEEDED
    refused = results["order-42"]
    assert refused.stage is Stage.REJECTED and refused.error is not None
    assert "WRONGTYPE" in refused.error and "its record could not be written" in refused.error
    assert letter["id"] == b"order-42" and agent.log.total == 1


async def test_an_entry_failing_after_its_message_was_accepted_is_not_refused(
    conn: Connection,
) -> None:
    """A key every message of a capability shares (its waiting set: a sidecar's user may
    write there) made of another type fails each batch after the acceptance. The entry,
    failing on its own every time, is set aside — but its message was accepted and lives,
    indexed for the reaper: it is not refused, nor told it names another message."""
    reply_to = conn.keys.reply("shared")
    await conn.call("SADD", conn.keys.waiting("text.echo"), "junk")
    waiting = {"id": "valid-1", "capability": "text.echo", "reply_to": reply_to}
    other = {"id": "other-1", "capability": "text.other", "reply_to": reply_to}
    for envelope in (waiting, other):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", msgspec.json.encode(envelope))
    async with running_dispatcher(conn):

        async def none_pending() -> bool:
            return (await conn.call("XPENDING", conn.keys.ingress, "dispatch"))[0] == 0

        await eventually(none_pending)
    store = MessageStore(conn)
    accepted = [await store.get_record(i) for i in ("valid-1", "other-1")]
    told = await conn.call("XRANGE", reply_to, "-", "+")
    due = await conn.call("ZSCORE", due_for(conn.keys, "valid-1"), "valid-1")
    assert [r.stage if r else None for r in accepted] == [Stage.WAITING, Stage.WAITING]
    assert await dead_letters(conn) == [] and told == []
    assert due is not None  # the reaper looks at it
