"""A waiting set someone made a key of another type (a sidecar's user may write there)."""

from __future__ import annotations

import msgspec
import pytest

from broker.connection import Connection
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import (
    collect_replies,
    eventually,
    running_dispatcher,
    running_sidecar,
)


async def send_to(
    conn: Connection, reply_to: str, message_id: str, capability: str, **fields: str
) -> None:
    envelope = {"id": message_id, "capability": capability, "reply_to": reply_to, **fields}
    await conn.call("XADD", conn.keys.ingress, "*", "envelope", msgspec.json.encode(envelope))


async def test_a_spoiled_waiting_set_does_not_stop_other_capabilities_draining(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Every sidecar's user may write every waiting set and the index of them. One made a
    set, with its capability listed as having work and a free instance, failed every drain
    with WRONGTYPE; a listed name not UTF-8 failed every sweep. Work waiting for any other
    capability was never assigned. Now only that capability's drain
    is held back, and the log names the key and how to mend it."""
    reply_to = conn.keys.reply("drained")
    spoiled = conn.keys.waiting("text.spoiled")
    await conn.call("SADD", spoiled, "junk")
    await conn.call("SADD", conn.keys.waiting_index, "text.spoiled", b"\xff\xfe.bad")
    async with (
        http_agent("s") as spoiled_agent,
        running_sidecar(conn, "s-1", ("text.spoiled",), url=spoiled_agent.url),
        running_dispatcher(conn),
        http_agent("a") as agent,
    ):
        for n in range(3):  # no instance serves them yet: they wait
            envelope = {"id": f"w-{n}", "capability": "text.echo", "reply_to": reply_to}
            raw = msgspec.json.encode(envelope)
            await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        async with running_sidecar(conn, "a-1", ("text.echo",), url=agent.url):
            results = await collect_replies(conn, reply_to, 3, timeout_s=20)
    assert [results[f"w-{n}"].stage for n in range(3)] == [Stage.SUCCEEDED] * 3
    named = [r.getMessage() for r in caplog.records if spoiled in r.getMessage()]
    assert named and f"DEL {spoiled}" in named[0] and "WRONGTYPE" in named[0]
    assert len(named) == 1  # once a minute, not at every drain


async def test_the_index_prune_keeps_a_spoiled_set_listed_and_drops_the_empty(
    conn: Connection,
) -> None:
    """The prune counted members with ZCARD and raised on a set of another type: the sweep
    that pruned drained nothing. A set that cannot be read is not known to be empty."""
    waiting = MessageStore(conn).waiting
    await conn.call("SET", conn.keys.waiting("text.spoiled"), "junk")
    await conn.call("ZADD", conn.keys.waiting("text.busy"), 1, "m-1")
    names = ["text.spoiled", "text.busy", "text.gone"]
    await conn.call("SADD", conn.keys.waiting_index, *names)

    dropped = await waiting.prune_index(names)

    assert dropped == ["text.gone"]
    assert sorted(await waiting.capabilities()) == ["text.busy", "text.spoiled"]


async def test_work_set_aside_for_a_spoiled_capability_holds_up_no_other(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Work set aside (no instance took it) goes back to its waiting set once an instance
    can take it. That write, to a spoiled set, raised out of the sweep before its drain."""
    reply_to = conn.keys.reply("restored")

    async def send(message_id: str, capability: str, **fields: str) -> None:
        await send_to(conn, reply_to, message_id, capability, **fields)

    async def set_aside() -> bool:
        return await conn.call("ZCARD", conn.keys.unmatched("text.spoiled")) == 1

    async with (
        running_dispatcher(conn),
        http_agent("a") as agent,
        running_sidecar(conn, "s-1", ("text.spoiled",), url=agent.url),
    ):
        await send("u-0", "text.spoiled", target="s-2")  # no such instance, yet
        await eventually(set_aside)
        await conn.call("SADD", conn.keys.waiting("text.spoiled"), "junk")
        for n in (1, 2):
            await send(f"u-{n}", "text.echo")
        async with (
            running_sidecar(conn, "s-2", ("text.spoiled",), url=agent.url),
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        ):
            results = await collect_replies(conn, reply_to, 2, timeout_s=20)
    assert [results[f"u-{n}"].stage for n in (1, 2)] == [Stage.SUCCEEDED] * 2
    assert not [r for r in caplog.records if "drain failed" in r.getMessage()]


async def test_the_index_lists_only_capability_names(conn: Connection) -> None:
    junk = [b"\xff\xfe.bad", b"Not A Capability", b"text.echo\n"]
    await conn.call("SADD", conn.keys.waiting_index, "text.echo", "a.b", *junk)

    assert await MessageStore(conn).waiting.capabilities() == ["a.b", "text.echo"]


LISTED = ("SADD", "index", "text.spoiled")  # the capability has work: every sweep drains it
SPOILS = {
    "a member not UTF-8": [("ZADD", "w:text.spoiled", 1, b"\xff"), LISTED],
    "a score of infinity": [("ZADD", "w:text.spoiled", "+inf", "x-1"), LISTED],
    "an id whose record is a list": [
        ("RPUSH", "m:evil-1", "x"),
        ("ZADD", "w:text.spoiled", 1, "evil-1"),
        LISTED,
    ],
    "the index made a sorted set": [("DEL", "index"), ("ZADD", "index", 1, "text.spoiled")],
}


def spoil_command(conn: Connection, command: tuple[object, ...]) -> tuple[object, ...]:
    name, where, *rest = command
    assert isinstance(where, str)
    kind, _, of = where.partition(":")
    key = {"w": conn.keys.waiting, "m": conn.keys.record}.get(kind)
    return (name, key(of) if key else conn.keys.waiting_index, *rest)


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("spoiled_by", list(SPOILS))
async def test_members_no_park_writes_hold_up_no_other_capability(
    conn: Connection, caplog: pytest.LogCaptureFixture, spoiled_by: str
) -> None:
    """A sidecar's user may add anything to a waiting set and the index. A member not
    UTF-8, a score of infinity, an id whose record key is another type, or an index of
    another type failed every drain and every sweep: work set aside for any capability was
    never put back. Now the members are removed, and an unreadable index is passed over."""
    reply_to = conn.keys.reply("held")

    async def set_aside() -> bool:
        return await conn.call("ZCARD", conn.keys.unmatched("text.echo")) == 2

    async with (
        running_dispatcher(conn),
        http_agent("a") as agent,
        running_sidecar(conn, "s-1", ("text.spoiled",), url=agent.url),
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
    ):
        for n in range(2):
            await send_to(conn, reply_to, f"t-{n}", "text.echo", target="a-2")  # none, yet
        await eventually(set_aside)
        for command in SPOILS[spoiled_by]:
            await conn.call(*spoil_command(conn, command))
        async with running_sidecar(conn, "a-2", ("text.echo",), url=agent.url):
            results = await collect_replies(conn, reply_to, 2, timeout_s=20)
        index_type = await conn.call("TYPE", conn.keys.waiting_index)
    assert [results[f"t-{n}"].stage for n in range(2)] == [Stage.SUCCEEDED] * 2
    assert not [r for r in caplog.records if "drain failed" in r.getMessage()]
    assert index_type in (b"set", b"none")  # one of another type is deleted: parks need it
