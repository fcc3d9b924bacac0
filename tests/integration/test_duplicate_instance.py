"""Two sidecars under one instance id, against a real Redis: each process writes its own
incarnation on the card, so a heartbeat that finds another one there has met a live
duplicate — and a sidecar restarted in place of a dead one never does."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import msgspec
import pytest

from adapters.lifecycle import DUPLICATE_TOLD_EVERY_S
from broker.connection import Connection
from broker.event_log import recent_events
from broker.records import InstanceCard, InstanceState, InstanceStats
from broker.registry import Registry
from tests.support.agents import recording_agent
from tests.support.harness import eventually, running_sidecar


def card(instance_id: str) -> InstanceCard:
    return InstanceCard(
        agent_id="dup",
        instance_id=instance_id,
        capabilities=("text.echo",),
        endpoint="python",
        max_inflight=4,
    )


async def duplicates(conn: Connection, instance_id: str) -> list[dict[str, Any]]:
    """The details of the ``instance.duplicate`` events about ``instance_id``."""
    found, _ = await recent_events(conn, 1000, ["instance.duplicate"])
    return [msgspec.json.decode(e.detail) for e in found if e.subject == instance_id]


async def beats_seen(conn: Connection, instance_id: str, count: int) -> None:
    """Until the card's heartbeat time has changed ``count`` times."""
    seen: list[bytes] = []

    async def moved() -> bool:
        hb = await conn.call("HGET", conn.keys.card(instance_id), "hb_ms")
        if hb is not None and (not seen or seen[-1] != hb):
            seen.append(hb)
        return len(seen) > count

    await eventually(moved, timeout_s=20)


async def test_a_beat_names_another_incarnation_that_wrote_the_card_since_the_last_one(
    conn: Connection,
) -> None:
    registry = Registry(conn)
    await registry.register(card("dup-1"), credits=4, incarnation="host/1/a")
    beat = await registry.heartbeat(
        "dup-1", InstanceState.UP, InstanceStats(), incarnation="host/1/a"
    )
    assert beat is not None and beat.other_writer == ""
    # a second process registers under the same id: the first one's next beat meets it
    await registry.register(card("dup-1"), credits=4, incarnation="host/2/b")
    beat = await registry.heartbeat(
        "dup-1", InstanceState.UP, InstanceStats(), incarnation="host/1/a"
    )
    assert beat is not None and beat.other_writer == "host/2/b"
    assert beat.state is InstanceState.UP
    # ... and the second one's beat meets the first, which wrote the card last
    beat = await registry.heartbeat(
        "dup-1", InstanceState.UP, InstanceStats(), incarnation="host/2/b"
    )
    assert beat is not None and beat.other_writer == "host/1/a"
    assert await conn.call("HGET", conn.keys.card("dup-1"), "incarnation") == b"host/2/b"
    # whatever another writes there comes back cut: a beat's answer stays small
    await conn.call("HSET", conn.keys.card("dup-1"), "incarnation", "x" * 100_000)
    beat = await registry.heartbeat(
        "dup-1", InstanceState.UP, InstanceStats(), incarnation="host/2/b"
    )
    assert beat is not None and beat.other_writer == "x" * 200
    # a beat that names no incarnation neither writes nor judges one
    beat = await registry.heartbeat("dup-1", InstanceState.UP, InstanceStats())
    assert beat is not None and beat.other_writer == ""
    assert await conn.call("HGET", conn.keys.card("dup-1"), "incarnation") == b"host/2/b"


async def test_two_sidecars_under_one_instance_id_each_say_so_once(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="agent_reach.sidecar")
    agent, _ = recording_agent("dup")
    async with (
        running_sidecar(conn, "dup-2", ("text.echo",), transport=agent) as first,
        running_sidecar(conn, "dup-2", ("text.echo",), transport=agent) as second,
    ):
        incarnations = {first.lifecycle.incarnation, second.lifecycle.incarnation}
        assert len(incarnations) == 2

        async def both_told() -> bool:
            return {d["this"] for d in await duplicates(conn, "dup-2")} == incarnations

        # within the minute the rule counts in (DUPLICATE_TOLD_EVERY_S), or the count below
        # could not tell a repeat from a second minute's telling
        with anyio.fail_after(DUPLICATE_TOLD_EVERY_S * 0.75):
            await eventually(both_told, timeout_s=20)
            await beats_seen(conn, "dup-2", 4)  # beats go on meeting: said once a minute
            told = await duplicates(conn, "dup-2")
    assert sorted((d["this"], d["other"]) for d in told) == sorted(
        [(a, b) for a in incarnations for b in incarnations if a != b]
    )
    errors = [r.getMessage() for r in caplog.records if "--instance-id" in r.getMessage()]
    assert len(errors) == 2
    assert all("dup-2" in e and "beside this one" in e for e in errors)


async def test_a_sidecar_restarted_in_place_of_a_dead_one_says_nothing(conn: Connection) -> None:
    agent, _ = recording_agent("dup")
    # the first one ends without deregistering (cancelled, as a crash leaves it): its card stays
    async with running_sidecar(conn, "dup-3", ("text.echo",), transport=agent) as first:
        await beats_seen(conn, "dup-3", 1)
        gone = first.lifecycle.incarnation
    assert await conn.call("HGET", conn.keys.card("dup-3"), "incarnation") == gone.encode()
    async with running_sidecar(conn, "dup-3", ("text.echo",), transport=agent) as second:
        await beats_seen(conn, "dup-3", 3)
        on_card = await conn.call("HGET", conn.keys.card("dup-3"), "incarnation")
        assert on_card == second.lifecycle.incarnation.encode()
    assert await duplicates(conn, "dup-3") == []
