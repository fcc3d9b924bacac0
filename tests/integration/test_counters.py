"""The counters the scripts keep in ``P:counters`` (on a cluster, one per slot), on a real
Redis."""

from __future__ import annotations

import msgspec

from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.metric_fields import read_counters, retry
from broker.stages import Stage
from broker.store import Acceptance, MessageStore, Move
from tests.support.harness import an_acceptance


def acceptance(message_id: str, capability: str, stage: Stage = Stage.WAITING) -> Acceptance:
    return an_acceptance(message_id, b"{}", capability=capability, next_stage=stage)


async def counters(conn: Connection) -> dict[str, dict[tuple[str, ...], int]]:
    return read_counters(await conn.read_counters())


async def test_a_move_counts_once_and_a_repeat_counts_nothing(conn: Connection) -> None:
    store = MessageStore(conn)
    await store.accept(acceptance("m1", "text.echo"))
    await store.accept(acceptance("m1", "text.echo"))  # a producer's retry: no new record
    await store.move("m1", Stage.ROUTED, new_attempt="+", new_instance="a-1")
    back = Move("m1", Stage.WAITING, counts=(retry("text.echo", "instance_down"),))
    assert (await store.apply(back)).ok
    assert not (await store.apply(back)).ok  # no longer ROUTED: nothing moves, nothing counts
    await store.move("m1", Stage.EXPIRED)
    seen = await counters(conn)
    assert seen["accepted"] == {("text.echo",): 1}
    assert seen["retries"] == {("text.echo", "instance_down"): 1}
    assert seen["finished"] == {("text.echo", "EXPIRED"): 1}


async def test_needs_confirmation_is_a_level(conn: Connection) -> None:
    store = MessageStore(conn)
    for i in range(3):
        await store.accept(acceptance(f"n{i}", "text.echo", Stage.ROUTED))
        await store.move(f"n{i}", Stage.RECEIVED)
        await store.move(f"n{i}", Stage.PROCESSING)
        await store.move(f"n{i}", Stage.NEEDS_CONFIRMATION)
    await store.move("n0", Stage.SUCCEEDED)  # an operator resolved one
    level = (await conn.read_counters())[b"level\tNEEDS_CONFIRMATION"]
    assert int(level) == 2


async def test_new_series_past_the_cap_count_as_other(settings: Settings) -> None:
    capped = msgspec.structs.replace(settings, metrics_max_series=10)
    assert capped.redis_url is not None
    async with open_connection(capped, capped.redis_url) as conn:
        store = MessageStore(conn)
        for i in range(25):  # a producer naming a new capability each time
            await store.accept(acceptance(f"c{i}", f"cap.n{i}"))
        assert len(await conn.read_counters()) == 11  # the cap, and "~other"
        accepted = (await counters(conn))["accepted"]
        assert sum(accepted.values()) == 25
        assert accepted[("_other",)] == 15


async def test_nothing_is_counted_with_the_counters_off(settings: Settings) -> None:
    off = msgspec.structs.replace(settings, metrics_counters=False)
    assert off.redis_url is not None
    async with open_connection(off, off.redis_url) as conn:
        store = MessageStore(conn)
        await store.accept(acceptance("q1", "text.echo", Stage.ROUTED))
        assert (await store.move("q1", Stage.CANCELLED)).ok  # terminal: would count
        assert await conn.read_counters() == {}
