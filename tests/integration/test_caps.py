"""Nothing grows without bound: each cap, flooded (README, "Caps")."""

from __future__ import annotations

import secrets

import msgspec

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.records import InstanceCard
from broker.registry import Registry
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.timekeeping import now_ms
from broker.wire import route_steps
from tests.support.agents import http_agent
from tests.support.harness import (
    collect_replies,
    dead_letters,
    eventually,
    keys_matching,
    running_dispatcher,
    running_sidecar,
)
from tests.support.repair import record_in
from workers.janitor import Janitor
from workers.reaper import Reaper


def tuned(settings: Settings, **values: object) -> Settings:
    return msgspec.structs.replace(settings, **values)


async def test_the_dead_letter_stream_keeps_about_its_cap(settings: Settings) -> None:
    capped = tuned(settings, dlq_max_entries=100)
    assert capped.redis_url is not None
    async with open_connection(capped, capped.redis_url) as conn, running_dispatcher(conn):
        await conn.call_many(
            [("XADD", conn.keys.ingress, "*", "envelope", b"not json") for _ in range(1000)]
        )

        async def all_handled() -> bool:
            groups = await conn.call("XINFO", "GROUPS", conn.keys.ingress)
            info = dict(zip(groups[0][::2], groups[0][1::2], strict=True))
            return info[b"pending"] == 0 and info[b"last-delivered-id"] != b"0-0"

        await eventually(all_handled, timeout_s=60)
        length = int(await conn.call("XLEN", conn.keys.dlq))
    # MAXLEN ~ trims whole stream nodes (100 entries each by default): about the cap
    assert 100 <= length < 300, length


async def test_a_ten_megabyte_envelope_keeps_a_prefix_and_its_size(settings: Settings) -> None:
    capped = tuned(settings, dlq_entry_max_bytes=4096)
    assert capped.redis_url is not None
    huge = msgspec.json.encode({"capability": "text.echo", "payload": "x" * 10_000_000})
    async with open_connection(capped, capped.redis_url) as conn, running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", huge)

        async def lettered() -> bool:
            return bool(await dead_letters(conn))

        await eventually(lettered, timeout_s=30)
        (letter,) = await dead_letters(conn)
        record = await MessageStore(conn).get_record(letter["id"].decode())
        memory = int(await conn.call("MEMORY", "USAGE", conn.keys.record(letter["id"].decode())))
    assert b"over the" in letter["reason"]
    assert letter["raw"] == huge[:4096] and int(letter["raw_size"]) == len(huge)
    assert record is not None and record.stage is Stage.REJECTED
    assert record.envelope == huge[:4096]
    assert memory < 20_000  # not 10 MB twice: the record keeps the same prefix


async def test_route_from_lists_at_most_its_cap_of_exclusions(settings: Settings) -> None:
    capped = tuned(settings, route_from_max_listed=5)
    assert capped.redis_url is not None
    async with open_connection(capped, capped.redis_url) as conn:
        registry = Registry(conn)
        for n in range(200):
            card = InstanceCard(
                agent_id="a",
                instance_id=f"a-{n}",
                capabilities=("text.echo",),
                endpoint="",
                max_inflight=1,
                tags={"region": "eu"},
            )
            await registry.register(card, credits=1)
        async with running_dispatcher(conn, reaper=False):
            envelope = Envelope(capability="text.echo", tags={"region": "us"})
            message_id = await Client(conn).submit(envelope)

            async def parked() -> bool:
                record = await MessageStore(conn).get_record(message_id)
                return record is not None and record.stage is Stage.WAITING

            await eventually(parked)
        record = await MessageStore(conn).get_record(message_id)
    assert record is not None and record.route_from is not None
    steps = route_steps(record.route_from)
    selectors = next(step for step in steps if step.get("excluded"))
    assert len(selectors["excluded"]) == 5 and selectors["more_excluded"] == 195
    assert len(record.route_from) < 2_000


async def test_the_capability_index_forgets_capabilities_with_nothing_waiting(
    conn: Connection,
) -> None:
    client = Client(conn)
    # pruned every second here, not every 10 s: the test waits for a prune after the expiries
    async with running_dispatcher(conn, prune_every_s=1.0):
        # 300 names no agent serves, each waiting half a second before it expires
        await client.submit_many(
            [
                Envelope(capability=f"flood.c{secrets.token_hex(4)}", timeout_s=0.5)
                for _ in range(300)
            ]
        )

        async def flooded() -> bool:
            return int(await conn.call("SCARD", conn.keys.waiting_index)) >= 250

        await eventually(flooded, timeout_s=30)

        async def pruned() -> bool:
            return int(await conn.call("SCARD", conn.keys.waiting_index)) == 0

        await eventually(pruned, timeout_s=60)
        left = await keys_matching(conn, f"{conn.keys.prefix}:[wx]:*")
    assert left == []  # and no waiting set of them is left either


async def test_a_reply_stream_expires_after_its_latest_answer(conn: Connection) -> None:
    reply_to = conn.keys.reply("abandoned")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        await Client(conn).submit(Envelope(capability="text.echo", reply_to=reply_to))
        await collect_replies(conn, reply_to, 1)
        ttl_ms = int(await conn.call("PTTL", reply_to))
    assert 0 < ttl_ms <= conn.settings.reply_ttl_s * 1000


async def _register_silent(conn: Connection, instance_id: str, *, silent_ms: int) -> None:
    registry = Registry(conn)
    card = InstanceCard(
        agent_id="gone",
        instance_id=instance_id,
        capabilities=("text.echo",),
        endpoint="",
        max_inflight=2,
    )
    await registry.register(card, credits=2)
    hb = now_ms() - silent_ms
    await conn.call("HSET", conn.keys.card(instance_id), "hb_ms", hb)
    await conn.call("ZADD", conn.keys.agents, hb, instance_id)
    await conn.call("XGROUP", "CREATE", conn.keys.queue(instance_id), "sidecar", "0", "MKSTREAM")
    await conn.call("SET", conn.keys.callback_key(instance_id), "k")


def _instance_keys(conn: Connection, instance_id: str) -> list[str]:
    k = conn.keys
    return [
        k.card(instance_id),
        k.queue(instance_id),
        k.callback_key(instance_id),
        k.inflight(instance_id),
    ]


async def test_instances_gone_for_good_are_forgotten_and_live_work_is_kept(
    settings: Settings,
) -> None:
    swept = tuned(settings, instance_gone_after_s=60.0, orphan_sweep_s=0.2)
    assert swept.redis_url is not None
    async with open_connection(swept, swept.redis_url) as conn:
        await _register_silent(conn, "gone-1", silent_ms=120_000)  # gone, holds nothing
        await _register_silent(conn, "gone-2", silent_ms=120_000)  # gone, but holds a credit
        # ... that a running attempt holds: the janitor's own credit audit keeps it (one no
        # attempt held, it returned, and then forgot gone-2 too if its stream came later in
        # the pass: the order of a SCAN)
        running = await record_in(conn, Stage.PROCESSING, instance="gone-2")
        await conn.call("SADD", conn.keys.inflight("gone-2"), f"{running}:1")
        await _register_silent(conn, "fresh-1", silent_ms=0)  # alive
        # a sidecar that deregistered (card and registry entry gone) left its stream
        await conn.call("XGROUP", "CREATE", conn.keys.queue("left-1"), "sidecar", "0", "MKSTREAM")
        # the janitor alone: a reaper would first take gone-2's credit back (it names no
        # live attempt) and then forget gone-2 as well
        janitor = Janitor(conn, MessageStore(conn))

        async def swept_all() -> bool:
            await janitor.step(now_ms())
            return janitor.forgotten >= 2

        await eventually(swept_all, timeout_s=30)
        gone = [int(await conn.call("EXISTS", k)) for k in _instance_keys(conn, "gone-1")]
        held = int(await conn.call("EXISTS", conn.keys.card("gone-2")))
        fresh = int(await conn.call("EXISTS", conn.keys.card("fresh-1")))
        left = int(await conn.call("EXISTS", conn.keys.queue("left-1")))
        registered = await conn.call("ZRANGE", conn.keys.agents, 0, -1)
    assert gone == [0, 0, 0, 0] and left == 0
    assert held == 1 and fresh == 1
    assert sorted(registered) == [b"fresh-1", b"gone-2"]


async def test_an_instance_registered_again_while_it_was_forgotten_stays_listed(
    settings: Settings,
) -> None:
    """The janitor removes a gone instance's keys (its slot), then takes it off the list
    (another slot on a cluster). A sidecar that registers under the same id between the two
    steps keeps its place on the list: a beat never adds one, and a live instance off the
    list is never routed to."""
    swept = tuned(settings, instance_gone_after_s=60.0, orphan_sweep_s=0.2)
    assert swept.redis_url is not None
    async with open_connection(swept, swept.redis_url) as conn:
        await _register_silent(conn, "back-1", silent_ms=120_000)
        await _register_silent(conn, "gone-1", silent_ms=120_000)
        janitor = Janitor(conn, MessageStore(conn))
        now = now_ms()
        await _register_silent(conn, "edge-1", silent_ms=janitor.gone_after_ms)
        edge = now - janitor.gone_after_ms  # silent exactly that long: gone, by both steps
        await conn.call("HSET", conn.keys.card("edge-1"), "hb_ms", edge)
        await conn.call("ZADD", conn.keys.agents, edge, "edge-1")
        removed = await janitor._remove_keys(["back-1", "gone-1", "edge-1"], now)
        await _register_silent(conn, "back-1", silent_ms=0)  # its sidecar starts again
        await janitor._unlist(removed, now)
        listed = await conn.call("ZRANGE", conn.keys.agents, 0, -1)
        card = int(await conn.call("EXISTS", conn.keys.card("back-1")))
        events = await conn.call("XRANGE", conn.fleet.events, "-", "+")
    assert sorted(removed) == ["back-1", "edge-1", "gone-1"]
    assert listed == [b"back-1"] and card == 1
    gone = [flat[flat.index(b"subject") + 1] for _, flat in events if b"instance.gone" in flat]
    assert sorted(gone) == [b"edge-1", b"gone-1"] and janitor.forgotten == 2


async def test_a_live_record_the_due_index_lost_is_found_and_resolved(
    settings: Settings,
) -> None:
    swept = tuned(settings, orphan_sweep_s=0.2)
    assert swept.redis_url is not None
    async with open_connection(swept, swept.redis_url) as conn:
        store = MessageStore(conn)
        now = now_ms()
        # accepted and parked as WAITING, its deadline passed, never indexed in P:due
        await store.accept(
            Acceptance(
                "orphan-1",
                msgspec.json.encode({"capability": "text.echo", "id": "orphan-1"}),
                "text.echo",
                deadline_ms=now - 1,
                reply_to="",
                priority=0,
                next_stage=Stage.WAITING,
                accepted_ms=now - 10_000,
            )
        )
        reaper = Reaper(conn)

        async def expired() -> bool:
            await reaper.tick()
            record = await store.get_record("orphan-1")
            return record is not None and record.stage is Stage.EXPIRED

        await eventually(expired, timeout_s=30)
    assert reaper.janitor.reindexed == 1
