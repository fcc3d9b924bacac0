"""The finisher on a real Redis: outcomes are recorded before their replies and credits go —
in one round trip on one server (``lua/finish.lua``), in two stages where a reply is not a
plain command — and new work waits while more than one batch of outcomes is unrecorded."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest
from anyio import wait_all_tasks_blocked

from adapters.finisher import UNRECORDED_MAX, Finisher
from adapters.holdings import Finished, Holdings, Taken
from broker.connection import Connection
from broker.envelope import Envelope
from broker.errors import RedisUnavailable
from broker.finishing import Ending, finish_answer, finish_command
from broker.keyspace import SIDECAR_GROUP
from broker.stages import Stage
from broker.store import MessageStore, Move
from tests.support.harness import an_acceptance, dead_letters

INSTANCE = "f-1"


def finisher(conn: Connection) -> Finisher:
    return Finisher(conn, MessageStore(conn), "f-1", Holdings())


def taken(n: int) -> Taken:
    return Taken(f"1-{n}", f"m-{n}", 1)


async def test_new_work_waits_while_outcomes_pile_up_unrecorded(conn: Connection) -> None:
    f = finisher(conn)
    for n in range(UNRECORDED_MAX):
        f.done(taken(n))
    let_through: list[int] = []

    async def call(n: int) -> None:
        await f.room()
        let_through.append(n)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        await wait_all_tasks_blocked()
        assert let_through == [0] and not f.crowded  # UNRECORDED_MAX waiting: still room
        f.done(taken(UNRECORDED_MAX))
        tg.start_soon(call, 1)
        await wait_all_tasks_blocked()
        assert let_through == [0] and f.crowded  # one more than that: held back
        await f.record_now()
        await wait_all_tasks_blocked()
        assert let_through == [0, 1] and not f.crowded  # recorded: the call goes


async def test_an_entry_whose_reply_no_script_can_send_is_let_go_of_once_released(
    conn: Connection,
) -> None:
    f = finisher(conn)
    item = taken(1)
    f.holdings.take(item)
    f.done(item, [("ZADD", "{p}:look", 1, "parent")])  # as a broadcast child's (its parent's)
    await f.record_now()
    assert f.holdings.holding("m-1") == item  # recorded; its credit not returned yet
    await f.release_now()
    assert f.holdings.holding("m-1") is None


async def processing(conn: Connection, message_id: str) -> Taken:
    """A message PROCESSING at attempt 1 on ``f-1``: its entry read from the instance's
    stream (pending), its credit in use."""
    store = MessageStore(conn)
    await store.accept(an_acceptance(message_id, b"{}", next_stage=Stage.ROUTED, instance=INSTANCE))
    for target in (Stage.RECEIVED, Stage.PROCESSING):
        fenced = Move(message_id, target, expect_attempt=1, expect_instance=INSTANCE)
        assert (await store.apply(fenced)).ok
    queue = conn.keys.queue(INSTANCE)
    # made once for the instance (a second time answers BUSYGROUP, left in place)
    await conn.call_many([("XGROUP", "CREATE", queue, SIDECAR_GROUP, "$", "MKSTREAM")])
    await conn.call("XADD", queue, "*", "id", message_id, "attempt", 1)
    [[_, [[entry_id, _]]]] = await conn.call(
        "XREADGROUP", "GROUP", SIDECAR_GROUP, "c", "COUNT", 1, "STREAMS", queue, ">"
    )
    await conn.call("SADD", conn.keys.inflight(INSTANCE), f"{message_id}:1")
    return Taken(entry_id.decode(), message_id, 1)


async def credit_and_entry(conn: Connection, message_id: str) -> tuple[bool, int]:
    """Whether the message's credit is in use, and how many entries are unacknowledged."""
    in_use = await conn.call("SISMEMBER", conn.keys.inflight(INSTANCE), f"{message_id}:1")
    pending = await conn.call("XPENDING", conn.keys.queue(INSTANCE), SIDECAR_GROUP)
    return bool(in_use), int(pending[0])


def round_trips(conn: Connection, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of commands in each call ``conn`` sends from now on (a single call is a
    call of one)."""
    sent: list[int] = []
    send = conn.pipeliner.call_many

    async def spy(commands: list[Any]) -> list[Any]:
        sent.append(len(commands))
        return await send(commands)

    monkeypatch.setattr(conn.pipeliner, "call_many", spy)
    return sent


@pytest.mark.one_server
async def test_one_round_trip_records_tells_and_frees_the_credit(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = await processing(conn, "m-1")
    reply_to = conn.keys.reply("one-trip")
    f = finisher(conn)
    f.holdings.take(item)
    sent = round_trips(conn, monkeypatch)
    envelope = Envelope(capability="text.echo", id="m-1", reply_to=reply_to)
    f.settle(item, envelope, Stage.SUCCEEDED, "done", result=b'{"ok": 1}')
    await f.record_now()
    assert sent == [2]  # the move, then finish.lua: one round trip
    assert f.holdings.holding("m-1") is None
    assert (await MessageStore(conn).get_record("m-1")).stage is Stage.SUCCEEDED  # type: ignore[union-attr]
    [(_, fields)] = await conn.call("XRANGE", reply_to, "-", "+")
    told = dict(zip(fields[::2], fields[1::2], strict=True))
    assert told[b"stage"] == b"SUCCEEDED" and msgspec.json.decode(told[b"result"]) == {"ok": 1}
    assert await credit_and_entry(conn, "m-1") == (False, 0)


@pytest.mark.one_server
async def test_a_reply_redis_refuses_is_dead_lettered_before_its_credit_goes(
    conn: Connection,
) -> None:
    item = await processing(conn, "m-2")
    reply_to = conn.keys.reply("not-a-stream")
    await conn.call("SET", reply_to, "a string, not a stream")
    f = finisher(conn)
    f.holdings.take(item)
    envelope = Envelope(capability="text.echo", id="m-2", reply_to=reply_to)
    f.settle(item, envelope, Stage.SUCCEEDED, "done", result=b"1")
    await f.record_now()
    letters = [e for e in await dead_letters(conn) if e["id"] == b"m-2"]
    assert len(letters) == 1 and letters[0]["reason"].startswith(b"reply_undeliverable: WRONGTYPE")
    assert (await MessageStore(conn).get_record("m-2")).stage is Stage.SUCCEEDED  # type: ignore[union-attr]
    assert await credit_and_entry(conn, "m-2") == (False, 0)
    assert f.holdings.holding("m-2") is None


@pytest.mark.one_server
async def test_an_outcome_fenced_out_is_released_untold(conn: Connection) -> None:
    item = await processing(conn, "m-3")
    store = MessageStore(conn)
    # the reaper took the message back for another attempt while the agent ran
    back = Move("m-3", Stage.WAITING, expect_attempt=1, new_attempt="+", new_instance="")
    assert (await store.apply(back)).ok
    reply_to = conn.keys.reply("fenced")
    f = finisher(conn)
    f.settle(
        item,
        Envelope(capability="text.echo", id="m-3", reply_to=reply_to),
        Stage.SUCCEEDED,
        "done",
        result=b"1",
    )
    await f.record_now()
    assert (await store.get_record("m-3")).stage is Stage.WAITING  # type: ignore[union-attr]
    assert await conn.call("EXISTS", reply_to) == 0
    assert await credit_and_entry(conn, "m-3") == (False, 0)


async def test_an_outcome_whose_move_did_not_run_keeps_its_credit(conn: Connection) -> None:
    item = await processing(conn, "m-4")
    settle = Move("m-4", Stage.SUCCEEDED, expect_attempt=1, expect_instance=INSTANCE)
    ending = Ending("m-4:1", item.entry_id, settle, [("XADD", "{p}:r", "*", "a", "b")])
    # finish.lua alone, as if the move before it in the pipeline had failed
    answer = finish_answer(
        await conn.call(*finish_command(conn, INSTANCE, SIDECAR_GROUP, [ending]))
    )
    assert answer.unmoved == {0} and answer.freed == 0
    assert await conn.call("EXISTS", "{p}:r") == 0  # nobody told of an outcome not on record
    assert await credit_and_entry(conn, "m-4") == (True, 1)


async def test_an_outcome_recorded_while_a_release_is_out_is_released_next(
    conn: Connection,
) -> None:
    """In three round trips (a reply no script can send), the releasing stage takes what was
    recorded while the next outcomes are being recorded: those still reach the next release."""
    f = finisher(conn)
    first, second = taken(1), taken(2)
    look = [("ZADD", "{p}:look", 1, "parent")]
    for item in (first, second):
        f.holdings.take(item)
    f.done(first, look)
    await f.record_now()
    # a move to record (a round trip), for a message with no record here: refused, released
    settle = Move("m-2", Stage.SUCCEEDED, expect_attempt=1, expect_instance=INSTANCE)
    f.queue(Finished(second, look, settle, "text.echo"))
    await conn.call("CLIENT", "PAUSE", 300, "WRITE")  # Redis holds writes back a moment
    async with anyio.create_task_group() as tg:
        tg.start_soon(f.record_now)
        await wait_all_tasks_blocked()  # the second round is out, its answer held back
        await f.release_now()  # the first round's replies and credit
    assert f.holdings.holding("m-1") is None
    await f.release_now()
    assert f.holdings.holding("m-2") is None


@pytest.mark.one_server
async def test_a_refused_reply_stops_the_round_the_rest_go_in_the_next(conn: Connection) -> None:
    first, second = await processing(conn, "m-5"), await processing(conn, "m-6")
    bad, good = conn.keys.reply("bad"), conn.keys.reply("good")
    await conn.call("SET", bad, "a string, not a stream")
    endings = [
        Ending(f"{t.message_id}:1", t.entry_id, None, [("XADD", key, "*", "id", t.message_id)])
        for t, key in ((first, bad), (second, good))
    ]
    answer = finish_answer(await conn.call(*finish_command(conn, INSTANCE, SIDECAR_GROUP, endings)))
    assert set(answer.refused) == {0} and answer.refused[0][1].code == "WRONGTYPE"
    assert answer.unreached == {1} and answer.freed == 0
    assert await conn.call("EXISTS", good) == 0  # not reached: untold, its credit kept
    assert await credit_and_entry(conn, "m-6") == (True, 2)
    f = finisher(conn)
    for t, key in ((first, bad), (second, good)):
        f.holdings.take(t)
        f.done(t, [("XADD", key, "*", "id", t.message_id)])
    await f.finish_now()  # the bad one dead-lettered and released, the good one told
    assert [e["id"] for e in await dead_letters(conn)] == [b"m-5"]
    assert await conn.call("XLEN", good) == 1
    assert await credit_and_entry(conn, "m-6") == (False, 0)
    assert f.holdings.holding("m-5") is None and f.holdings.holding("m-6") is None


@pytest.mark.one_server
async def test_a_reply_refused_for_now_is_told_later_not_dead_lettered(conn: Connection) -> None:
    item = await processing(conn, "m-7")
    reply_to = conn.keys.reply("later")
    f = finisher(conn)
    f.holdings.take(item)
    f.done(item, [("XADD", reply_to, "*", "id", "m-7")])  # as after a dead letter, say
    (limit,) = (await conn.call("CONFIG", "GET", "maxmemory"))[1:]
    ending = Ending("m-7:1", item.entry_id, None, [("XADD", reply_to, "*", "id", "m-7")])
    await conn.call("CONFIG", "SET", "maxmemory", 1)  # every write that adds memory: OOM
    try:
        command = finish_command(conn, INSTANCE, SIDECAR_GROUP, [ending])
        answer = finish_answer(await conn.call(*command))
        with pytest.raises(RedisUnavailable) as refused:
            await f.record_now()
    finally:
        await conn.call("CONFIG", "SET", "maxmemory", limit)
    (_, for_now) = answer.refused[0]  # "not now", as Redis says it to a client: not for good
    assert isinstance(for_now, RedisUnavailable) and for_now.code == "OOM"
    assert refused.value.code == "OOM"
    assert await dead_letters(conn) == []
    assert await credit_and_entry(conn, "m-7") == (True, 1)
    assert f.holdings.holding("m-7") == item
    await f.record_now()  # memory back: told, then released
    assert await conn.call("XLEN", reply_to) == 1
    assert await credit_and_entry(conn, "m-7") == (False, 0)
    assert f.holdings.holding("m-7") is None


async def test_a_round_of_several_outcomes_takes_the_overlapping_stages(conn: Connection) -> None:
    """Under load (rounds of more than ``ONE_TRIP_MAX``) outcomes are recorded in a round of
    their own, their replies and credits in the next, while the following outcomes are
    recorded: the recording rounds stay short (what a crash repeats)."""
    items = [await processing(conn, f"m-{n}") for n in (8, 9)]
    f = finisher(conn)
    for item in items:
        f.holdings.take(item)
        envelope = Envelope(capability="text.echo", id=item.message_id)
        f.settle(item, envelope, Stage.SUCCEEDED, "done", result=b"1")
    await f.record_now()
    assert all(f.holdings.holding(i.message_id) == i for i in items)  # recorded, not released
    assert await credit_and_entry(conn, "m-8") == (True, 2)
    await f.release_now()
    assert await credit_and_entry(conn, "m-8") == (False, 0)
    assert all(f.holdings.holding(i.message_id) is None for i in items)
