"""What a sidecar's user may write into the registry (its own instances' keys, and the
list of instances) cannot stop anyone reading it, nor pose as another instance."""

from __future__ import annotations

import msgspec
import pytest

from broker.connection import Connection
from broker.records import InstanceState
from broker.registry import Registry, card_fields
from broker.stages import Stage
from broker.timekeeping import now_ms
from tests.support.agents import http_agent
from tests.support.harness import card, collect_replies, running_dispatcher, running_sidecar


def flat(fields: dict[str, object]) -> list[object]:
    return [x for pair in fields.items() for x in pair]


async def test_an_instance_whose_keys_are_of_another_type_is_left_out_not_raised(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A listed instance whose credit set (or card) is a key of another type failed every
    read of the registry with WRONGTYPE: no dispatcher could refresh its routing, and the
    console and /metrics answered 500. Now that instance alone is left out, and named."""
    registry = Registry(conn)
    await registry.register(card("good-1", ("text.echo",)), credits=16)
    await conn.call("ZADD", conn.keys.agents, 0, "evil-1", 0, "evil-2")
    fields = card_fields(card("evil-1", ("text.echo",)), credits=1, state=InstanceState.UP, hb_ms=1)
    await conn.call("HSET", conn.keys.card("evil-1"), *flat(fields))
    await conn.call("SET", conn.keys.inflight("evil-1"), "x")
    await conn.call("SET", conn.keys.card("evil-2"), "x")

    views = await registry.snapshot()
    again = await registry.snapshot()

    assert [v.instance_id for v in views] == [v.instance_id for v in again] == ["good-1"]
    said = [r.getMessage() for r in caplog.records if "left out of routing" in r.getMessage()]
    assert len(said) == 2 and all("WRONGTYPE" in s for s in said)  # once each, not per read


async def test_a_card_naming_another_instance_is_left_out(conn: Connection) -> None:
    """A sidecar's user may write the cards of its own agent's instances only. A card under
    its own key that named another agent's instance showed twice in the registry, with the
    poser's limits, and the console's drain of it drained the real one."""
    registry = Registry(conn)
    await registry.register(card("good-1", ("text.echo",), max_inflight=4), credits=4)
    posing = card("good-1", ("text.echo",), max_inflight=99)
    fields = card_fields(posing, credits=99, state=InstanceState.UP, hb_ms=now_ms())
    await conn.call("HSET", conn.keys.card("evil-1"), *flat(fields))
    await conn.call("ZADD", conn.keys.agents, now_ms(), "evil-1")

    views = await registry.snapshot()

    assert [(v.instance_id, v.card.max_inflight) for v in views] == [("good-1", 4)]


async def test_work_is_routed_while_a_listed_instance_is_spoiled(conn: Connection) -> None:
    reply_to = conn.keys.reply("routed")
    await conn.call("ZADD", conn.keys.agents, now_ms(), "evil-1")
    await conn.call("SET", conn.keys.card("evil-1"), "x")
    async with (
        http_agent("a") as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
    ):
        envelope = {"id": "r-1", "capability": "text.echo", "reply_to": reply_to}
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", msgspec.json.encode(envelope))
        results = await collect_replies(conn, reply_to, 1, timeout_s=20)
    assert results["r-1"].stage is Stage.SUCCEEDED
