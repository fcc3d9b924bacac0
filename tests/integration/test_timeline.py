"""A message's timeline lives in its record (``lua/timeline.lua``): capped to the newest
``timeline_max`` entries, any text kept intact, an older record's list read first, and the
record a compact listpack on the server agent-reach starts."""

from __future__ import annotations

import msgspec

from broker.connection import Connection, open_connection
from broker.record_codec import timeline_entries
from broker.stages import Stage
from broker.store import Acceptance, MessageStore, Move
from broker.timekeeping import now_ms
from broker.timeline import note_event
from tests.support.harness import an_acceptance, eventually
from workers.janitor import Janitor


def acceptance(message_id: str, *, reason: str = "no_capability_match: none") -> Acceptance:
    envelope = msgspec.json.encode({"capability": "t.cap", "payload": "x" * 300})
    return an_acceptance(message_id, envelope, capability="t.cap", reason=reason)


async def test_the_timeline_keeps_the_newest_entries_up_to_its_cap(conn: Connection) -> None:
    settings = msgspec.structs.replace(conn.settings, timeline_max=10)
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as capped:
        await MessageStore(capped).accept(acceptance("m-cap"))
        for n in range(30):
            assert await note_event(capped, "m-cap", "EVENT", f"event {n}", now_ms=now_ms())
        timeline = await MessageStore(capped).get_timeline("m-cap")
    assert [e.reason for e in timeline] == [f"event {n}" for n in range(20, 30)]


async def test_moves_keep_the_cap_as_they_write_the_timeline_with_the_stage(
    conn: Connection,
) -> None:
    """A move reads the timeline with the stage and writes it with the stage, in one
    command each (``lua/move_record.lua``): the cap holds there too, and a move refused by
    its fence writes nothing."""
    settings = msgspec.structs.replace(conn.settings, timeline_max=10)
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as capped:
        store = MessageStore(capped)
        await store.accept(acceptance("m-moves"))  # ACCEPTED, WAITING
        stages = [Stage.ROUTED, Stage.WAITING] * 6
        for n, (source, target) in enumerate(
            zip([Stage.WAITING, *stages[:-1]], stages, strict=True)
        ):
            moved = await store.move("m-moves", target, only_from=source, reason=f"move {n}")
            assert moved.ok, moved
        refused = await store.move("m-moves", Stage.ROUTED, only_from=Stage.ROUTED)
        timeline = await store.get_timeline("m-moves")
    assert not refused.ok
    assert [e.reason for e in timeline] == [f"move {n}" for n in range(2, 12)]
    assert [e.stage for e in timeline] == stages[2:]


async def persists(conn: Connection) -> int:
    """``PERSIST`` calls the server has run (scripts' included)."""
    info = (await conn.call("INFO", "commandstats")).decode()
    line = next((x for x in info.splitlines() if x.startswith("cmdstat_persist:")), "")
    return int(line.split("calls=")[1].split(",")[0]) if line else 0


async def test_only_a_move_out_of_a_terminal_stage_removes_an_expiry(conn: Connection) -> None:
    """Only a terminal record has an expiry: a move from stages none of which is terminal
    sends no ``PERSIST``; one out of a terminal stage (an operator's replay) removes it."""
    store = MessageStore(conn)
    await store.accept(acceptance("m-keep"))  # WAITING
    before = await persists(conn)
    assert (await store.move("m-keep", Stage.ROUTED, only_from=Stage.WAITING)).ok
    assert (await store.move("m-keep", Stage.WAITING, only_from=Stage.ROUTED)).ok
    assert await persists(conn) == before
    assert (await store.move("m-keep", Stage.EXPIRED, only_from=Stage.WAITING)).ok
    assert int(await conn.call("TTL", conn.keys.record("m-keep"))) > 0
    assert (await store.move("m-keep", Stage.WAITING, any_of=frozenset({Stage.EXPIRED}))).ok
    assert int(await conn.call("TTL", conn.keys.record("m-keep"))) == -1
    assert await persists(conn) == before + 1


async def test_any_text_reads_back_as_written(conn: Connection) -> None:
    reason = 'line one\nline two, "quoted", tab\t, é, 🙂, \\n literally'
    store = MessageStore(conn)
    await store.accept(acceptance("m-text", reason=reason))
    assert await note_event(conn, "m-text", "EVENT", "\n", now_ms=now_ms())
    timeline = await store.get_timeline("m-text")
    assert [str(e.stage) for e in timeline] == ["ACCEPTED", "WAITING", "EVENT"]
    assert [e.reason for e in timeline] == ["", reason, "\n"]


async def test_an_older_records_list_is_read_first(conn: Connection) -> None:
    """A record written before the timeline moved into it keeps its entries in the list;
    what happens to it now is appended to the field, and both read as one timeline."""
    store = MessageStore(conn)
    await store.accept(acceptance("m-old"))
    await conn.call("HDEL", conn.keys.record("m-old"), "timeline")
    old = [b'["1","ACCEPTED","","0",""]', b'["2","WAITING","","0","from before"]']
    await conn.call("RPUSH", conn.keys.timeline("m-old"), *old)
    assert await note_event(conn, "m-old", "EVENT", "after", now_ms=3)
    timeline = await store.get_timeline("m-old")
    assert [(e.ts_ms, e.reason) for e in timeline] == [(1, ""), (2, "from before"), (3, "after")]
    assert timeline == timeline_entries(
        await conn.call("HGET", conn.keys.record("m-old"), "timeline"), old
    )


async def test_a_waiting_record_is_one_compact_key(conn: Connection) -> None:
    store = MessageStore(conn)
    await store.accept(acceptance("m-size"))
    assert await conn.call("EXISTS", conn.keys.timeline("m-size")) == 0
    encoding = await conn.call("OBJECT", "ENCODING", conn.keys.record("m-size"))
    assert encoding in (b"listpack", b"ziplist")  # Redis 7, Redis 6.2
    moved = await store.move("m-size", Stage.EXPIRED, reason="waited past its deadline")
    assert moved.ok
    ttl = int(await conn.call("TTL", conn.keys.record("m-size")))
    assert 0 < ttl <= conn.settings.record_ttl_s
    timeline = await store.get_timeline("m-size")
    assert [str(e.stage) for e in timeline] == ["ACCEPTED", "WAITING", "EXPIRED"]


async def test_the_janitor_lets_an_older_timeline_list_go_with_its_record(
    conn: Connection,
) -> None:
    """An older version gave a timeline list its expiry only when its message ended: the
    list of one still live at the upgrade would stay. The janitor gives it its record's
    expiry once the record has ended, deletes it when the record is gone, and leaves it
    while the record lives."""
    store = MessageStore(conn)
    for message_id in ("m-ended", "m-live"):
        await store.accept(acceptance(message_id))
        await conn.call("HDEL", conn.keys.record(message_id), "timeline")
        await conn.call("RPUSH", conn.keys.timeline(message_id), b'["1","ACCEPTED","","0",""]')
    assert (await store.move("m-ended", Stage.EXPIRED, reason="deadline")).ok
    await conn.call("RPUSH", conn.keys.timeline("m-gone"), b'["1","ACCEPTED","","0",""]')
    janitor = Janitor(conn, store)

    async def swept() -> bool:  # a page of the key space a step
        await janitor.step(now_ms())
        gone = await conn.call("EXISTS", conn.keys.timeline("m-gone"))
        return gone == 0 and int(await conn.call("TTL", conn.keys.timeline("m-ended"))) > 0

    await eventually(swept, timeout_s=30)
    ended_ttl = int(await conn.call("TTL", conn.keys.timeline("m-ended")))
    record_ttl = int(await conn.call("TTL", conn.keys.record("m-ended")))
    assert 0 < ended_ttl <= record_ttl
    assert int(await conn.call("TTL", conn.keys.timeline("m-live"))) == -1
    assert int(await conn.call("EXISTS", conn.keys.timeline("m-gone"))) == 0
    assert [e.reason for e in await store.get_timeline("m-ended")] == ["", "deadline"]


def first_moves(message_id: str, instance: str) -> tuple[Move, Move]:
    """A sidecar's RECEIVED and PROCESSING of attempt 1 on ``instance`` (adapters/intake.py)."""
    fenced = {"expect_attempt": 1, "expect_instance": instance}
    return (
        Move(message_id, Stage.RECEIVED, only_from=Stage.ROUTED, return_field="envelope", **fenced),
        Move(message_id, Stage.PROCESSING, only_from=Stage.RECEIVED, **fenced),
    )


async def test_received_and_processing_in_one_script(conn: Connection) -> None:
    """Made together (``lua/receive_process.lua``); and where RECEIVED is not made — the
    record was RECEIVED already — neither is, though PROCESSING's own fence would pass."""
    store = MessageStore(conn)
    envelope = msgspec.json.encode({"capability": "t.cap", "payload": 1})
    for message_id in ("m-fresh", "m-taken"):
        routed = an_acceptance(
            message_id, envelope, capability="t.cap", next_stage=Stage.ROUTED, instance="i-1"
        )
        await store.accept(routed)
    assert (await store.move_many([first_moves("m-taken", "i-1")[0]]))[0].ok

    (fresh, taken) = await store.receive_and_process(
        [first_moves("m-fresh", "i-1"), first_moves("m-taken", "i-1")]
    )

    assert fresh[0].ok and fresh[0].value == envelope and fresh[1].ok
    assert [str(e.stage) for e in await store.get_timeline("m-fresh")][-2:] == [
        "RECEIVED",
        "PROCESSING",
    ]
    assert not taken[0].ok and not taken[1].ok and taken[1].stage is Stage.RECEIVED
    assert await store.stages(["m-fresh", "m-taken"]) == [Stage.PROCESSING, Stage.RECEIVED]
