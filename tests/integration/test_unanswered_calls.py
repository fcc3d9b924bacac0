"""A sidecar's writes whose answers were lost (adapters/holdings.py): a record its own
unanswered round trip left PROCESSING is called — and a write of such a round trip that
lands late never makes a record since called look uncalled."""

from __future__ import annotations

import anyio
import pytest

from adapters.holdings import Taken
from adapters.outcome import Succeeded
from adapters.runner import NEVER_CALLED
from adapters.workpool import WorkPool
from adapters.write_ahead import processing_move
from broker.connection import Connection
from broker.embedded import free_port
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisUnavailable
from broker.stages import Stage
from broker.store import MessageStore, Move
from broker.streams import GroupReader
from tests.support.harness import eventually, routed_to, running_sidecar


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
            assert not holdings.never_called(after.take_call)
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
