"""The janitor returns a live instance's credits that no attempt and no entry hold any more
(workers/credit_audit.py) — and only those."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from bench.profile import commandstats
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.credits import assign_command, return_command
from broker.errors import RedisReplyError
from broker.keyspace import SIDECAR_GROUP
from broker.notifications import MISSED, Notifications, credit_announcement
from broker.records import InstanceCard
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from tests.support.harness import eventually
from tests.support.repair import record_in
from workers.credit_audit import return_orphaned_credits
from workers.janitor import Janitor

LIVE_CARD = InstanceCard(
    agent_id="live", instance_id="live-1", capabilities=("text.echo",), endpoint="", max_inflight=8
)


async def assigned(conn: Connection, message_id: str, *, read: bool, acknowledged: bool) -> None:
    """``message_id``'s attempt 1 on live-1: its credit, its entry — read by the sidecar
    (pending) or not, then acknowledged or not."""
    queue = conn.keys.queue("live-1")
    await conn.call("SADD", conn.keys.inflight("live-1"), f"{message_id}:1")
    entry = await conn.call("XADD", queue, "*", "id", message_id, "attempt", "1")
    if read:
        await conn.call("XREADGROUP", "GROUP", SIDECAR_GROUP, "live-1", "STREAMS", queue, ">")
    if acknowledged:
        await conn.call("XACK", queue, SIDECAR_GROUP, entry)


async def listening(conn: Connection, notes: Notifications, instance_id: str) -> None:
    """Until ``notes`` hears the instance's credit channel: a probe at a time."""
    channel, sharded = credit_announcement(conn, instance_id)
    probe = f"{instance_id} probe".encode()
    with anyio.fail_after(10):
        while True:
            await conn.call("SPUBLISH" if sharded == "1" else "PUBLISH", channel, probe)
            hint = await notes.next(timeout_s=0.2)
            if hint is not None and hint[1] == probe:
                return
            assert hint is None or hint[1] == MISSED or hint[1].endswith(b" probe"), hint


async def test_a_credit_nobody_will_return_is_returned_on_a_live_instance(
    settings: Settings,
) -> None:
    swept = msgspec.structs.replace(settings, orphan_sweep_s=0.2)
    assert swept.redis_url is not None
    async with open_connection(swept, swept.redis_url) as conn:
        await Registry(conn).register(LIVE_CARD, credits=8)  # alive: it has just beaten
        queue = conn.keys.queue("live-1")
        await conn.call("XGROUP", "CREATE", queue, SIDECAR_GROUP, "0", "MKSTREAM")
        # ended, its entry acknowledged: the process that was to return the credit stopped
        ended = await record_in(conn, Stage.SUCCEEDED, instance="live-1")
        await assigned(conn, ended, read=True, acknowledged=True)
        # ended, but its entry still pending: its sidecar is finishing it, and returns it
        finishing = await record_in(conn, Stage.SUCCEEDED, instance="live-1")
        await assigned(conn, finishing, read=True, acknowledged=False)
        # running: the record holds the credit
        running = await record_in(conn, Stage.PROCESSING, instance="live-1")
        await assigned(conn, running, read=True, acknowledged=False)
        # not yet read, its record gone: stale, and no sidecar holds it
        await assigned(conn, "gone-record", read=False, acknowledged=False)
        janitor = Janitor(conn, MessageStore(conn))

        async def swept_all() -> bool:
            await janitor.step(now_ms())
            return janitor.credits_returned >= 2

        notes = Notifications(conn)
        notes.follow(["live-1"])
        async with anyio.create_task_group() as tg:
            await tg.start(notes.run)
            await listening(conn, notes, "live-1")
            await eventually(swept_all, timeout_s=30)
            # a dispatcher waiting for live-1's credits hears of them: two now in use
            heard: list[bytes] = []
            while b"live-1 2" not in heard:
                hint = await notes.next(timeout_s=10)
                assert hint is not None, f"not announced; heard {heard}"
                heard.append(hint[1])
            tg.cancel_scope.cancel()
        held = await conn.call("SMEMBERS", conn.keys.inflight("live-1"))
    assert sorted(m.decode() for m in held) == sorted([f"{finishing}:1", f"{running}:1"])
    assert janitor.credits_returned == 2


async def test_a_credit_is_kept_where_its_pending_entry_cannot_be_read(
    settings: Settings,
) -> None:
    """A stale credit whose entry is pending but deleted (anyone who may write the stream
    can trim it): the audit cannot tell whose it is, and keeps every stale credit of that
    instance. A credit stored in bytes that are no UTF-8, nobody's, is returned as stored."""
    swept = msgspec.structs.replace(settings, orphan_sweep_s=0.2)
    assert swept.redis_url is not None
    async with open_connection(swept, swept.redis_url) as conn:
        queue = conn.keys.queue("live-1")
        await conn.call("XGROUP", "CREATE", queue, SIDECAR_GROUP, "0", "MKSTREAM")
        ended = await record_in(conn, Stage.SUCCEEDED, instance="live-1")
        await assigned(conn, ended, read=True, acknowledged=False)
        await conn.call("XTRIM", queue, "MAXLEN", 0)  # pending still, its body gone
        await conn.call("SADD", conn.keys.inflight("live-1"), b"\xff\xfe:1")
        janitor = Janitor(conn, MessageStore(conn))
        for _ in range(3):  # whole passes
            janitor._next_pass_ms = 0
            janitor._pass = None
            await janitor.step(now_ms())
        kept = await conn.call("SMEMBERS", conn.keys.inflight("live-1"))
        await conn.call("XGROUP", "DESTROY", queue, SIDECAR_GROUP)
        await conn.call("XGROUP", "CREATE", queue, SIDECAR_GROUP, "0")  # nothing pending now

        async def returned() -> bool:
            janitor._next_pass_ms = 0
            await janitor.step(now_ms())
            return int(await conn.call("SCARD", conn.keys.inflight("live-1"))) == 0

        await eventually(returned, timeout_s=30)
    assert sorted(kept) == sorted([f"{ended}:1".encode(), b"\xff\xfe:1"])
    assert janitor.credits_returned == 2


async def test_returning_credits_announces_what_was_returned_and_nothing_else(
    settings: Settings,
) -> None:
    """``return_command``, the reaper's and the janitor's way to give a credit back: a
    dispatcher hears the credits now in use, as from a sidecar's release; a return that
    found nothing to return says nothing."""
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as conn:
        await conn.call("SADD", conn.keys.inflight("live-1"), "a:1", "b:1")
        notes = Notifications(conn)
        notes.follow(["live-1"])
        async with anyio.create_task_group() as tg:
            await tg.start(notes.run)
            await listening(conn, notes, "live-1")
            returned = await conn.call(*return_command(conn, "live-1", ["a:1", "c:1"]))
            first = await notes.next(timeout_s=10)
            again = await conn.call(*return_command(conn, "live-1", ["a:1", b"\xff:1"]))
            await listening(conn, notes, "live-1")  # nothing heard before the probe
            tg.cancel_scope.cancel()
        held = await conn.call("SMEMBERS", conn.keys.inflight("live-1"))
    assert (returned, again) == (1, 0)
    assert first is not None and first[1] == b"live-1 1"
    assert held == [b"b:1"]


async def test_a_flooded_in_flight_set_is_audited_in_chunks(conn: Connection) -> None:
    """Whoever may write an instance's in-flight set (a sidecar's user) may fill it with
    members no attempt holds: 25,000 of them were read in one SMEMBERS and their records in
    one round trip. They are read, judged and returned a thousand at a time; a credit a
    running attempt holds is kept."""
    key = conn.keys.inflight("live-1")
    queue = conn.keys.queue("live-1")
    await conn.call("XGROUP", "CREATE", queue, SIDECAR_GROUP, "0", "MKSTREAM")
    running = await record_in(conn, Stage.PROCESSING, instance="live-1")
    await assigned(conn, running, read=True, acknowledged=False)
    for start in range(0, 25_000, 5_000):
        await conn.call("SADD", key, *(f"junk-{i}:1" for i in range(start, start + 5_000)))
    before = commandstats((await conn.call("INFO", "commandstats")).decode())

    returned = await return_orphaned_credits(conn, MessageStore(conn), ["live-1"])

    after = commandstats((await conn.call("INFO", "commandstats")).decode())
    assert returned == 25_000
    assert await conn.call("SMEMBERS", key) == [f"{running}:1".encode()]
    calls = {name: after[name][0] - before.get(name, (0, 0))[0] for name in after}
    assert calls.get("smembers", 0) == 0 and calls["sscan"] >= 25
    assert calls["evalsha"] >= 25  # returned in chunks too


async def test_an_assignment_a_spoiled_stream_refuses_takes_no_credit(conn: Connection) -> None:
    """The instance's stream made another type: the assignment's XADD is refused. The
    credit was taken before it and stayed held, for no entry, until the hourly audit (a
    script is not rolled back); the stream is now written first."""
    await Registry(conn).register(LIVE_CARD, credits=8)
    await conn.call("SET", conn.keys.queue("live-1"), "not a stream")
    with pytest.raises(RedisReplyError) as refused:
        await conn.call(*assign_command(conn, "live-1", "m-1", 1))

    assert "WRONGTYPE" in str(refused.value)
    assert await conn.call("SCARD", conn.keys.inflight("live-1")) == 0
