"""A sidecar's writes whose answers were lost (adapters/holdings.py): a record its own
unanswered round trip left PROCESSING is called — and a write of such a round trip that
lands late never makes a record since called look uncalled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from adapters.holdings import Taken
from adapters.outcome import Succeeded
from adapters.runner import NEVER_CALLED
from adapters.sidecar import Sidecar
from adapters.workpool import WorkPool
from adapters.write_ahead import processing_move
from broker.connection import Connection
from broker.embedded import free_port
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisUnavailable
from broker.records import MessageRecord
from broker.stages import Stage
from broker.store import MessageStore, Move
from broker.streams import GroupReader
from broker.timekeeping import now_ms
from tests.support.agents import recording_agent
from tests.support.harness import eventually, routed_to, running_sidecar
from workers.reaper import Reaper


class HeldAgent:
    """A transport whose calls are noted, and answered only once released."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.called = anyio.Event()
        self.release = anyio.Event()

    async def deliver(self, envelope: Envelope, attempt: int) -> Succeeded:
        self.calls.append(envelope.message_id)
        self.called.set()
        await self.release.wait()
        return Succeeded(b"{}")

    async def aclose(self) -> None:
        pass


async def test_a_late_write_of_an_unanswered_call_cannot_relabel_a_called_record(
    conn: Connection,
) -> None:
    """A take's answer is lost (token T0), and the record is found PROCESSING: CALL. That
    CALL's write (T1) is given up on, but a network still holds its bytes. Found again (T0
    still on the record), the message is called with T2, answered. Then T1's write lands:
    it is fenced on T0, which the record no longer holds, so it is not made — the record
    keeps T2, a call this process made, and is never taken as uncalled (which would call a
    non-idempotent agent twice)."""
    agent = HeldAgent()
    store = MessageStore(conn)
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent) as sidecar:
        runner, holdings = sidecar.runner, sidecar.runner.holdings
        message_id = await routed_to(conn, "f-1")
        taken = Taken("0-1", message_id, 1)  # no stream entry: the intake never meets it
        # 1. the take (T0): RECEIVED and PROCESSING made, the answer lost
        t0 = holdings.call_token()
        received, processing = sidecar.intake._moves(taken, token=t0)
        assert [(await store.apply(m)).ok for m in (received, processing)] == [True, True]
        holdings.unanswered_call(t0)
        # 2. found again: CALL, whose write (T1) is given up on while still on its way
        t1 = holdings.call_token()
        fenced = sidecar.finisher.fenced
        late = processing_move(
            fenced, taken, Stage.PROCESSING, token=t1, reason=NEVER_CALLED, last_call=t0
        )
        holdings.unanswered_call(t1)
        # 3. found again, T0 still on the record: CALL with T2, answered, and the agent called
        record = await store.get_record(message_id)
        assert record is not None and record.take_call == t0
        holdings.take(taken)
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner._resume_at, taken, record, load_envelope(record.envelope))
            with anyio.fail_after(10):
                await agent.called.wait()
            called = await store.get_record(message_id)
            assert called is not None and called.take_call not in (t0, t1)
            # 4. T1's write lands: not made
            landed = await store.apply(late)
            assert not landed.ok and landed.stage is Stage.PROCESSING
            after = await store.get_record(message_id)
            assert after is not None and after.take_call == called.take_call
            assert not holdings.never_called(after.take_call, taken)
            agent.release.set()

        async def succeeded() -> bool:
            return await store.stages([message_id]) == [Stage.SUCCEEDED]

        await eventually(succeeded, timeout_s=10)
    assert agent.calls == [message_id]


async def test_a_move_fenced_on_a_field_is_made_only_where_the_field_holds_the_value(
    conn: Connection,
) -> None:
    """lua/transition_if.lua: the field as expected (absent: ""), the move is made; any
    other value, it is not, and the answer says where the record is."""
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=HeldAgent()) as sidecar:
        store = MessageStore(conn)
        message_id = await routed_to(conn, "f-1")
        taken = Taken("0-1", message_id, 1)
        for move in sidecar.intake._moves(taken, token="a"):
            assert (await store.apply(move)).ok

        def again(taken: Taken, token: str, last_call: str) -> Move:
            fenced = sidecar.finisher.fenced
            return processing_move(
                fenced, taken, Stage.PROCESSING, token=token, last_call=last_call
            )

        wrong = await store.apply(again(taken, "b", "x"))
        assert (wrong.ok, wrong.stage, wrong.attempt, wrong.instance) == (
            False,
            Stage.PROCESSING,
            1,
            "f-1",
        )
        absent = await store.apply(again(taken, "b", ""))
        assert not absent.ok
        right = await store.apply(again(taken, "b", "a"))
        assert right.ok
        record = await store.get_record(message_id)
        assert record is not None and record.take_call == "b"
        await conn.call("HDEL", conn.keys.record(message_id), "take_call")
        assert (await store.apply(again(taken, "c", ""))).ok
        missing = await store.apply(again(Taken("0-2", "no-such-message", 1), "d", ""))
        assert not missing.ok and missing.stage is None


@pytest.mark.one_server  # take_next, the one-wake-up take: a single server's
async def test_a_redis_that_cannot_be_reached_leaves_no_unanswered_call(
    conn: Connection,
) -> None:
    """Only a call that went out may have run: a read that could not even connect keeps no
    token (an outage's retries, one every few seconds, would otherwise fill the list and
    push out the tokens of calls that did go out)."""
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=HeldAgent()) as sidecar:
        holdings = sidecar.runner.holdings
        before = dict(holdings.unanswered)
        nowhere = GroupReader(f"redis://127.0.0.1:{free_port()}")
        async with anyio.create_task_group() as tg:
            pool = WorkPool(tg, 1)
            for _ in range(3):
                with pytest.raises(RedisUnavailable):
                    await sidecar.intake.take_next(pool, nowhere)
        assert holdings.unanswered == before


async def blocked_reading(conn: Connection) -> None:
    """Until a sidecar waits in its blocking read (its start's look at its pending list is
    over then): one client blocked in ``XREAD``."""

    async def blocked() -> bool:
        clients = (await conn.call("CLIENT", "LIST")).decode().splitlines()
        return any(" cmd=xread " in f" {c} " and " flags=b " in f" {c} " for c in clients)

    await eventually(blocked)


async def taken_unanswered(conn: Connection, sidecar: Sidecar) -> tuple[Taken, str]:
    """An assignment read by f-1 and moved to PROCESSING by a round trip whose answer was
    lost (what a take during a partition leaves): the entry, and that round trip's token.
    The sidecar finds it at its next look at its pending list — not at its first, the look
    of its start, which comes after it says it has started: written before that look, the
    entry was taken there, before the moves below."""
    await blocked_reading(conn)
    message_id = await routed_to(conn, "f-1")
    queue = conn.keys.queue("f-1")
    replies = await conn.call_many(
        [
            ("MULTI",),
            ("XADD", queue, "*", "id", message_id, "attempt", "1"),
            ("XREADGROUP", "GROUP", "sidecar", "f-1", "COUNT", "1", "STREAMS", queue, ">"),
            ("EXEC",),
        ]
    )
    taken = Taken(replies[-1][0].decode(), message_id, 1)
    holdings = sidecar.runner.holdings
    token = holdings.call_token()
    for move in sidecar.intake._moves(taken, token=token):
        assert (await MessageStore(conn).apply(move)).ok
    holdings.unanswered_call(token)
    return taken, token


async def test_a_record_given_back_older_is_not_called_again(conn: Connection) -> None:
    """Called once found never called; then Redis loses writes it had acknowledged (a
    restart from an AOF without its last second, a failover to a replica behind) and gives
    back the record and the stream as they were: PROCESSING, the unanswered token. The
    sidecar, finding it again, does not call the (non-idempotent) agent a second time."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    queue = conn.keys.queue("f-1")
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent) as sidecar:
        taken, _ = await taken_unanswered(conn, sidecar)
        record_key = conn.keys.record(taken.message_id)
        before = [await conn.call("DUMP", key) for key in (record_key, queue)]
        sidecar.runner.holdings.recheck_pending = True  # the read after the partition

        async def settled() -> bool:
            stage = (await store.stages([taken.message_id]))[0]
            pending = (await conn.call("XPENDING", queue, "sidecar"))[0]
            return stage in (Stage.SUCCEEDED, Stage.NEEDS_CONFIRMATION) and pending == 0

        await eventually(settled, timeout_s=10)
        assert calls == [taken.message_id]
        for key, dumped in zip((record_key, queue), before, strict=True):
            await conn.call("RESTORE", key, 0, dumped, "REPLACE")
        sidecar.runner.holdings.recheck_pending = True  # the read after Redis came back
        await eventually(settled, timeout_s=10)
    assert calls == [taken.message_id]
    assert await store.stages([taken.message_id]) == [Stage.NEEDS_CONFIRMATION]


async def test_a_call_refused_for_a_token_landed_meanwhile_is_decided_again(
    conn: Connection,
) -> None:
    """The sidecar reads the record (token T0, unanswered) and decides CALL; before its
    write, an earlier CALL's write given up on (T1, fenced on T0) lands. Its own write,
    fenced on T0, is refused — and the message, still PROCESSING here, is found and decided
    again (T1 is unanswered too: CALL), not let go of uncalled."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent) as sidecar:
        holdings = sidecar.runner.holdings
        taken, t0 = await taken_unanswered(conn, sidecar)
        t1 = holdings.call_token()
        fenced = sidecar.finisher.fenced
        late = processing_move(
            fenced, taken, Stage.PROCESSING, token=t1, reason=NEVER_CALLED, last_call=t0
        )
        holdings.unanswered_call(t1)
        read_record = sidecar.runner.store.get_record
        landed: list[bool] = []

        async def read_then_late_write(message_id: str) -> MessageRecord | None:
            record = await read_record(message_id)
            if message_id == taken.message_id and not landed:
                landed.append((await store.apply(late)).ok)  # T1's bytes land now
            return record

        sidecar.runner.store.get_record = read_then_late_write  # type: ignore[method-assign]
        holdings.recheck_pending = True

        async def succeeded() -> bool:
            return await store.stages([taken.message_id]) == [Stage.SUCCEEDED]

        await eventually(succeeded, timeout_s=10)
    assert landed == [True]
    assert calls == [taken.message_id]


async def called_since_looked(conn: Connection) -> tuple[MessageStore, MessageRecord]:
    """A PROCESSING message as the reaper read it (token T0), then called by its sidecar,
    which knows it never called it (T2): the store, and the record the reaper read."""
    store = MessageStore(conn)
    message_id = await routed_to(conn, "f-1")
    taken = Taken("1-0", message_id, 1)

    def fenced(t: Taken, target: Stage, source: Stage, **options: Any) -> Move:
        return Move(
            t.message_id,
            target,
            only_from=source,
            expect_attempt=t.attempt,
            expect_instance="f-1",
            **options,
        )

    assert (await store.apply(fenced(taken, Stage.RECEIVED, Stage.ROUTED))).ok
    assert (await store.apply(processing_move(fenced, taken, Stage.RECEIVED, token="t0"))).ok
    looked = await store.get_record(message_id)  # what the reaper read
    assert looked is not None
    called = processing_move(fenced, taken, Stage.PROCESSING, token="t2", last_call="t0")
    assert (await store.apply(called)).ok  # the sidecar's CALL, while the reaper asks
    return store, looked


async def still_called(store: MessageStore, message_id: str) -> None:
    record = await store.get_record(message_id)
    assert record is not None
    assert (record.stage, record.take_call) == (Stage.PROCESSING, "t2")


async def test_the_reaper_does_not_park_what_the_sidecar_called_since_it_looked(
    conn: Connection,
) -> None:
    """The reaper looks at a PROCESSING message past its time (token T0) and asks after
    it; meanwhile its sidecar calls it (T2). The reaper's park is fenced on T0: refused, it
    looks again soon, and the message runs on — rather than parked under a running call
    whose answer would then be refused."""
    store, looked = await called_since_looked(conn)
    verdict = await Reaper(conn).resolve(looked.id, looked, now_ms() + 3_600_000)
    assert verdict.action == "raced"
    await still_called(store, looked.id)


async def test_the_reaper_does_not_end_dead_what_the_sidecar_called_since_it_looked(
    conn: Connection,
) -> None:
    """Nor is it ended DEAD as a message the reaper could not resolve (its envelope
    unreadable, say) under a call its sidecar made since the reaper read it."""
    store, looked = await called_since_looked(conn)
    unreadable = ValueError("the envelope does not decode")
    verdict = await Reaper(conn).resolver.unresolvable(looked, unreadable)
    assert verdict.action == "raced"
    await still_called(store, looked.id)


def answer_lost_once(store: MessageStore, name: str, lose: Callable[[Any], bool]) -> list[bool]:
    """``store``'s method ``name`` made as ever, and for the first call ``lose`` picks, its
    answer lost after Redis made it (:class:`RedisUnavailable`, as a connection that went
    silent gives): the list says whether that happened."""
    real = getattr(store, name)
    lost: list[bool] = []

    async def made_then_lost(arg: Any) -> Any:
        answer = await real(arg)
        if not lost and lose(arg):
            lost.append(True)
            raise RedisUnavailable("redis did not answer within 0.1 s")
        return answer

    setattr(store, name, made_then_lost)
    return lost


async def test_a_call_whose_write_went_unanswered_is_called_once_found_again(
    conn: Connection,
) -> None:
    """Found never called (T0), the message's CALL writes PROCESSING again (T1), and that
    answer is lost: T1 is kept too, so found again the message is still known uncalled, and
    the (non-idempotent) agent is called once — not parked."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent) as sidecar:
        taken, _ = await taken_unanswered(conn, sidecar)
        lost = answer_lost_once(sidecar.runner.store, "apply", lambda m: m.expect_field is not None)
        sidecar.runner.holdings.recheck_pending = True
        await succeeds_unparked(store, taken.message_id)
    assert lost == [True]
    assert calls == [taken.message_id]


async def test_a_pending_entry_whose_processing_went_unanswered_is_called(
    conn: Connection,
) -> None:
    """An entry of the pending list (a restart, a recheck) is taken the plain way: RECEIVED,
    then PROCESSING in a second round trip, whose answer is lost. Found again, PROCESSING
    with that round trip's token: called once, not parked."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    queue = conn.keys.queue("f-1")
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent) as sidecar:
        message_id = await routed_to(conn, "f-1")
        lost = answer_lost_once(
            sidecar.intake.store,
            "try_moves",
            lambda moves: any(m.target is Stage.PROCESSING for m in moves),
        )
        await conn.call_many(  # read by f-1 and not taken: what a crash leaves pending
            [
                ("MULTI",),
                ("XADD", queue, "*", "id", message_id, "attempt", "1"),
                ("XREADGROUP", "GROUP", "sidecar", "f-1", "COUNT", "1", "STREAMS", queue, ">"),
                ("EXEC",),
            ]
        )
        sidecar.runner.holdings.recheck_pending = True
        await succeeds_unparked(store, message_id)
    assert lost == [True]
    assert calls == [message_id]


async def test_a_round_trip_lost_while_the_pending_list_is_taken_at_start_is_waited_out(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar starting after a crash takes its pending list first; a Redis that fails it
    then (here: PROCESSING's answer lost) stopped the sidecar with the error. Now that take
    is the read loop's first, which waits a failure out: the message runs, once."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    queue = conn.keys.queue("f-1")
    message_id = await routed_to(conn, "f-1")
    await conn.call("XGROUP", "CREATE", queue, "sidecar", "0", "MKSTREAM")
    await conn.call("XADD", queue, "*", "id", message_id, "attempt", "1")
    await conn.call("XREADGROUP", "GROUP", "sidecar", "f-1", "STREAMS", queue, ">")  # the crash
    real = MessageStore.try_moves
    lost: list[bool] = []

    async def made_then_lost(self: MessageStore, moves: list[Move]) -> Any:
        answer = await real(self, moves)
        if not lost and any(m.target is Stage.PROCESSING for m in moves):
            lost.append(True)
            raise RedisUnavailable("redis did not answer within 0.1 s")
        return answer

    monkeypatch.setattr(MessageStore, "try_moves", made_then_lost)
    async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent):
        await succeeds_unparked(store, message_id)
    assert lost == [True]
    assert calls == [message_id]


async def succeeds_unparked(store: MessageStore, message_id: str) -> None:
    """Until the message has SUCCEEDED; it must not be parked on the way."""

    async def succeeded() -> bool:
        stage = (await store.stages([message_id]))[0]
        assert stage is not Stage.NEEDS_CONFIRMATION
        return stage is Stage.SUCCEEDED

    await eventually(succeeded, timeout_s=15)
