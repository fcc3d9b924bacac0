"""A sidecar reads and takes its new work in one wake-up (``lua/take.lua`` behind a blocking
``XREAD``, :meth:`adapters.intake.SidecarIntake.take_next`), on a real server.

The script takes an entry only when Python's own reading of it (``parse_assignment``) would
take the same one: it may leave more to Python, never less. Whatever it leaves, and whatever
stops it (a Redis that forgot its scripts, a group that is gone), the work still runs."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from adapters.python import Agent
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.entries import parse_assignment
from broker.envelope import Envelope, complete
from broker.errors import RedisReplyError
from broker.ids import new_message_id
from broker.keyspace import SIDECAR_GROUP
from broker.stages import Stage
from broker.store import TAKE_BYTES, MessageStore, Move, Took, take_command, took
from broker.streams import GroupReader, fields_of
from tests.support.agents import recording_agent
from tests.support.harness import (
    an_acceptance,
    dead_letters,
    eventually,
    routed_to,
    running_sidecar,
)

pytestmark = pytest.mark.one_server  # the script is the single server's way

_prefixes = itertools.count()

# The moves a sidecar makes (adapters/intake.py), of any one message: the script sets the
# entry's attempt in them; RECEIVED answers the envelope.
MOVES = (
    Move(
        "",
        Stage.RECEIVED,
        only_from=Stage.ROUTED,
        expect_attempt=1,
        expect_instance="f-1",
        return_field="envelope",
    ),
    Move("", Stage.PROCESSING, only_from=Stage.RECEIVED, expect_attempt=1, expect_instance="f-1"),
    Move("", Stage.PROCESSING, only_from=Stage.RECEIVED, expect_attempt=2, expect_instance="f-1"),
)


def command(conn: Connection, stream: str) -> tuple[Any, ...]:
    return take_command(conn, stream, SIDECAR_GROUP, "f-1", 1000, MOVES)


# -- what the script takes: never what Python would not --------------------------------------

ODD_VALUES = (
    *(b"0", b"01", b"1", b"7", b"1000000", b"1000001", b"1\n", b"a\n", b" 1", b"+1", b"1.0"),
    # digits that are not ASCII, bytes that are not UTF-8
    *(b"\xd9\xa1", b"\xef\xbc\x91", b"", b"a b", b"{x}", b"\xff"),
)
NAMES = st.one_of(
    st.sampled_from([b"id", b"attempt", b"ID", b"id ", b"attempt\x00", b"envelope"]),
    st.binary(max_size=8),
)
VALUES = st.one_of(
    st.from_regex(rb"\A[0-9A-Za-z_.:-]{1,130}\Z"),
    st.from_regex(rb"\A[0-9]{1,9}\Z"),
    st.sampled_from(ODD_VALUES),
    st.binary(max_size=140),
)
ENTRY = st.one_of(
    st.lists(st.tuples(NAMES, VALUES), min_size=1, max_size=3),
    st.tuples(VALUES, VALUES).map(lambda v: [(b"id", v[0]), (b"attempt", v[1])]),
    st.tuples(VALUES, VALUES).map(lambda v: [(b"attempt", v[1]), (b"id", v[0])]),
)


def canonical(flat: list[bytes]) -> bool:
    """An entry the script must take: exactly ``id`` and ``attempt``, which Python takes, the
    attempt written without a leading zero."""
    if len(flat) != 4 or {flat[0], flat[2]} != {b"id", b"attempt"}:
        return False
    attempt = flat[1] if flat[0] == b"attempt" else flat[3]
    return not isinstance(parse_assignment("", fields_of(flat)), str) and attempt[:1] != b"0"


async def taken_by_script(url: str, entries: list[list[tuple[bytes, bytes]]]) -> None:
    settings = build_settings([{"redis_url": url, "prefix": f"fz{next(_prefixes)}"}])
    async with open_connection(settings, url) as conn:
        stream = conn.keys.queue("f-1")
        await conn.call("XGROUP", "CREATE", stream, SIDECAR_GROUP, "0", "MKSTREAM")
        for pairs in entries:
            await conn.call("XADD", stream, "*", *(item for pair in pairs for item in pair))
        read = took(await conn.call(*command(conn, stream)))
        assert read.error is None and len(read.entries) == len(entries)
        for entry_id, flat in read.entries:
            python = parse_assignment(entry_id, fields_of(flat))
            if entry_id in read.moves:  # the script took it: so would Python
                assert not isinstance(python, str), (flat, python)
            assert entry_id in read.moves or not canonical(flat), flat
        await conn.call("DEL", stream)


@hypothesis_settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(ENTRY, min_size=1, max_size=12))
def test_the_script_takes_only_what_python_takes_and_every_plain_assignment(
    redis_server: RedisServer, entries: list[list[tuple[bytes, bytes]]]
) -> None:
    anyio.run(taken_by_script, redis_server.url, entries)


# -- the read it waits behind -----------------------------------------------------------------


async def assigned(conn: Connection, stream: str) -> tuple[str, str]:
    """The sidecar's group on ``stream`` (of instance f-1), and a message ROUTED there with
    its assignment written: its id, and the entry's."""
    await conn.call("XGROUP", "CREATE", stream, SIDECAR_GROUP, "0", "MKSTREAM")
    message_id = await routed_to(conn, "f-1")
    entry = await conn.call("XADD", stream, "*", "id", message_id, "attempt", "1")
    return message_id, entry.decode()


async def test_the_read_wakes_for_an_entry_past_the_last_and_the_script_takes_it(
    conn: Connection,
) -> None:
    store = MessageStore(conn)
    stream = conn.keys.queue("f-1")
    first, entry = await assigned(conn, stream)
    reader = GroupReader(conn.url)
    try:
        with anyio.fail_after(20):  # an entry there already: at once, not after the block
            _, reply = await reader.read_then_run(stream, "0-0", 60_000, command(conn, stream))
        read = took(reply)
        assert (read.after, list(read.moves)) == (entry, [entry])
        received, processing = read.moves[entry]
        assert received.ok and processing.ok and processing.stage is Stage.PROCESSING
        record = await store.get_record(first)
        assert record is not None and (record.stage, record.instance) == (Stage.PROCESSING, "f-1")
        timeline = await store.get_timeline(first)
        assert [e.stage for e in timeline][-2:] == [Stage.RECEIVED, Stage.PROCESSING]
        assert timeline[-1].ts_ms >= timeline[-3].ts_ms  # the server's clock, not before ROUTED

        # nothing past the last entry: the block runs out, and nothing is taken
        _, reply = await reader.read_then_run(stream, read.after, 50, command(conn, stream))
        read = took(reply)
        assert (read.after, read.moves) == (entry, {})

        # an entry that comes during the block wakes it (the block itself is a minute)
        second = await routed_to(conn, "f-1")
        async with anyio.create_task_group() as tg:

            async def add() -> None:
                await conn.call("XADD", stream, "*", "attempt", "1", "id", second)

            tg.start_soon(add)
            with anyio.fail_after(20):
                _, reply = await reader.read_then_run(stream, entry, 60_000, command(conn, stream))
        read = took(reply)
        assert len(read.moves) == 1 and read.after != entry
        assert (await store.stages([second])) == [Stage.PROCESSING]
    finally:
        await reader.close()


async def test_a_group_already_past_the_last_read_makes_the_read_wait_past_the_stream(
    conn: Connection,
) -> None:
    """Entries the group gave already (its last id moved by hand) wake the read once; the
    script then says to wait past the stream's last entry, so it does not spin."""
    stream = conn.keys.queue("f-1")
    await conn.call("XGROUP", "CREATE", stream, SIDECAR_GROUP, "0", "MKSTREAM")
    last = (await conn.call("XADD", stream, "*", "id", "m1", "attempt", "1")).decode()
    await conn.call("XGROUP", "SETID", stream, SIDECAR_GROUP, "$")
    reader = GroupReader(conn.url)
    try:
        for after in ("0-0", last):
            _, reply = await reader.read_then_run(stream, after, 50, command(conn, stream))
            read = took(reply)
            assert (read.after, read.entries) == (last, [])
    finally:
        await reader.close()


async def test_a_failed_read_still_answers_what_the_script_did(conn: Connection) -> None:
    """The script runs whether the read before it failed or not, so its answer comes back
    with the read's error: what it moved is not lost."""
    stream = conn.keys.queue("f-1")
    _, entry = await assigned(conn, stream)
    reader = GroupReader(conn.url)
    try:
        failed, reply = await reader.read_then_run(stream, "not-an-id", 50, command(conn, stream))
    finally:
        await reader.close()
    assert isinstance(failed, RedisReplyError)
    assert list(took(reply).moves) == [entry]


async def taken_at_once(conn: Connection, stream: str) -> Took:
    """What the script answers behind a read that does not wait (past ``0-0``)."""
    reader = GroupReader(conn.url)
    try:
        _, reply = await reader.read_then_run(stream, "0-0", 50, command(conn, stream))
    finally:
        await reader.close()
    return took(reply)


async def test_a_group_that_is_gone_is_said_and_nothing_is_read(conn: Connection) -> None:
    stream = conn.keys.queue("f-1")
    await conn.call("XADD", stream, "*", "id", "m1", "attempt", "1")  # a stream, no group
    read = await taken_at_once(conn, stream)
    assert read.error is not None and "NOGROUP" in str(read.error)
    assert read.entries == [] and read.after == ""


async def large_assignments(conn: Connection, stream: str, count: int) -> list[str]:
    """``count`` messages ROUTED to f-1 whose envelopes are each over half the envelope bytes
    one script answers, their assignments written; their ids."""
    payload = msgspec.Raw(msgspec.json.encode("x" * (TAKE_BYTES // 2)))
    ids = []
    for _ in range(count):
        envelope = complete(Envelope(id=new_message_id(), capability="text.echo", payload=payload))
        acceptance = an_acceptance(
            envelope.message_id,
            msgspec.json.encode(envelope),
            next_stage=Stage.ROUTED,
            instance="f-1",
        )
        assert (await MessageStore(conn).accept(acceptance)).created
        await conn.call("XADD", stream, "*", "id", envelope.message_id, "attempt", "1")
        ids.append(envelope.message_id)
    return ids


async def test_a_batch_of_large_envelopes_is_taken_in_part_and_the_rest_left(
    conn: Connection,
) -> None:
    """The script stops taking once the envelopes it answers reach ``TAKE_BYTES`` (a script
    holds Redis while it runs): the rest of the batch is read, left unmoved for Python's way."""
    stream = conn.keys.queue("f-1")
    await conn.call("XGROUP", "CREATE", stream, SIDECAR_GROUP, "0", "MKSTREAM")
    ids = await large_assignments(conn, stream, 3)
    read = await taken_at_once(conn, stream)
    assert len(read.entries) == 3 and len(read.moves) == 2
    left = next(e for e, _ in read.entries if e not in read.moves)
    assert [e for e, _ in read.entries].index(left) == 2  # the last, past the bytes
    stages = await MessageStore(conn).stages(ids)
    assert stages == [Stage.PROCESSING, Stage.PROCESSING, Stage.ROUTED]


async def test_a_sidecar_runs_each_of_a_batch_of_large_envelopes_once(conn: Connection) -> None:
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent):
        ids = await large_assignments(conn, conn.keys.queue("f-1"), 4)

        async def settled() -> bool:
            return await store.stages(ids) == [Stage.SUCCEEDED] * 4

        await eventually(settled, timeout_s=20)
    assert sorted(calls) == sorted(ids)


# -- a sidecar on it ---------------------------------------------------------------------------


async def served(conn: Connection, caplog: pytest.LogCaptureFixture, meanwhile: Any) -> None:
    """A sidecar takes the message ``meanwhile`` assigns to it (writing its entry by hand,
    after doing to Redis what the test is about) with no failed read: no back-off."""
    agent, _ = recording_agent("f")
    store = MessageStore(conn)
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent):
        message_id = await routed_to(conn, "f-1")
        await meanwhile(message_id)

        async def succeeded() -> bool:
            return await store.stages([message_id]) == [Stage.SUCCEEDED]

        await eventually(succeeded)
    failed = [r.getMessage() for r in caplog.records if "read failed" in r.getMessage()]
    assert failed == []


def assignment(conn: Connection, message_id: str) -> tuple[str, ...]:
    return ("XADD", conn.keys.queue("f-1"), "*", "id", message_id, "attempt", "1")


async def test_a_redis_that_forgot_its_scripts_has_the_take_script_loaded_again(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    async def flush_then_assign(message_id: str) -> None:
        flushed, _ = await conn.call_many([("SCRIPT", "FLUSH"), assignment(conn, message_id)])
        assert flushed == b"OK"

    await served(conn, caplog, flush_then_assign)


async def test_a_work_stream_deleted_under_the_sidecar_is_read_again_from_its_start(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The script meets no group (the stream made again without one, as a dispatcher's
    assignment makes it); the plain read creates the group at the start and takes it."""

    async def delete_then_assign(message_id: str) -> None:
        deleted, _ = await conn.call_many(
            [("DEL", conn.keys.queue("f-1")), assignment(conn, message_id)]
        )
        assert deleted == 1

    await served(conn, caplog, delete_then_assign)


async def test_an_assignment_written_again_ahead_of_itself_runs_once_and_the_copy_is_refused(
    conn: Connection,
) -> None:
    """A copy the script leaves (``attempt`` ``01``) written just before the assignment: the
    script moves the assignment, so it is the one taken — not the copy, which would find its
    message PROCESSING and, for an agent that is not idempotent, park it as may have run."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    queue = conn.keys.queue("f-1")
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent, idempotent=False):
        message_id = await routed_to(conn, "f-1")
        ahead = "redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'attempt', '01') "
        ahead += "redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'attempt', '1')"
        await conn.call("EVAL", ahead, 1, queue, message_id)

        async def settled() -> bool:
            pending = (await conn.call("XPENDING", queue, SIDECAR_GROUP))[0]
            return await store.stages([message_id]) == [Stage.SUCCEEDED] and pending == 0

        await eventually(settled, timeout_s=20)
    assert calls == [message_id]
    (letter,) = await dead_letters(conn)
    assert f"{message_id} attempt 1 is taken" in letter["reason"].decode()


async def test_a_copy_of_an_assignment_being_run_is_refused_not_taken(conn: Connection) -> None:
    """A copy in plain form, written while its message runs here: the script tries its
    RECEIVED, which finds the record PROCESSING — so it is a copy, dead-lettered, and the
    message runs once, not taken again as a crash's leftover while it runs."""
    calls: list[str] = []
    copied = anyio.Event()
    agent = Agent("f")

    @agent.handler("text.echo")
    async def echo(envelope: Envelope) -> dict[str, Any]:
        calls.append(envelope.id)
        await copied.wait()
        return {}

    store = MessageStore(conn)
    queue = conn.keys.queue("f-1")
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent, idempotent=False):
        message_id = await routed_to(conn, "f-1")
        await conn.call("XADD", queue, "*", "id", message_id, "attempt", "1")

        async def running() -> bool:
            return calls == [message_id]

        await eventually(running)
        await conn.call("XADD", queue, "*", "id", message_id, "attempt", "1")

        async def refused() -> bool:
            return len(await dead_letters(conn)) == 1

        await eventually(refused)
        copied.set()

        async def settled() -> bool:
            return await store.stages([message_id]) == [Stage.SUCCEEDED]

        await eventually(settled, timeout_s=20)
    assert calls == [message_id]
    (letter,) = await dead_letters(conn)
    assert f"{message_id} attempt 1 is taken" in letter["reason"].decode()
