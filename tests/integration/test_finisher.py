"""The finisher's two stages on a real Redis: outcomes are recorded before their replies and
credits go, and new work waits while more than one batch of outcomes is unrecorded."""

from __future__ import annotations

import anyio
from anyio import wait_all_tasks_blocked

from adapters.finisher import UNRECORDED_MAX, Finisher
from adapters.holdings import Holdings, Taken
from broker.connection import Connection
from broker.store import MessageStore


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
        assert let_through == [0]  # UNRECORDED_MAX waiting: still room
        f.done(taken(UNRECORDED_MAX))
        tg.start_soon(call, 1)
        await wait_all_tasks_blocked()
        assert let_through == [0]  # one more than that: held back
        await f.record_now()
        await wait_all_tasks_blocked()
        assert let_through == [0, 1]  # recorded: the call goes


async def test_an_entry_is_let_go_of_only_once_released(conn: Connection) -> None:
    f = finisher(conn)
    item = taken(1)
    f.holdings.take(item)
    f.done(item)
    await f.record_now()
    assert f.holdings.holding("m-1") == item  # recorded; its credit not returned yet
    await f.release_now()
    assert f.holdings.holding("m-1") is None
