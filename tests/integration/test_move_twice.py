"""RECEIVED then PROCESSING in one read and one write of the record (``move_record_twice``,
``lua/move_record.lua``) answer and leave exactly what two ``transition.lua`` calls in a row
do: the same answers, the same record, the same counts. Real Redis, any record state and any
pair of moves a sidecar could send."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.scripts import ScriptName
from broker.stages import Stage
from broker.store import Move, receive_process_command

_prefixes = itertools.count()
# ROUTED (where RECEIVED goes from) most often, and every other kind of stage
STAGES = ["ROUTED", "ROUTED", "ROUTED", "RECEIVED", "NEEDS_CONFIRMATION", "WAITING", "SUCCEEDED"]
ATTEMPTS = st.sampled_from(["", "1", "2"])
INSTANCES = st.sampled_from(["", "i-1", "i-2"])
FIELDS = st.dictionaries(
    st.sampled_from(["take_call", "note", "error", "agent_task"]),
    st.sampled_from(["a", "b", ""]),
    max_size=2,
)
COUNTS = st.lists(st.sampled_from(["calls\tx\tok", "retries\tx\tdown"]), max_size=2)


@st.composite
def moves(draw: st.DrawFn) -> tuple[Move, Move]:
    def one(target: Stage, **fixed: Any) -> Move:
        sources = draw(st.sampled_from([None, "QUEUED", "PARKED", "ALL"]))
        return Move(
            "m",
            target,
            reason=draw(st.sampled_from(["", "why"])),
            expect_attempt=draw(st.sampled_from([None, 1, 2])),
            expect_instance=draw(st.sampled_from([None, "i-1", "i-2"])),
            new_attempt=draw(st.sampled_from([None, "+", 3])),
            new_instance=draw(st.sampled_from([None, "i-1", "i-2"])),
            fields=draw(FIELDS) or None,
            counts=tuple(draw(COUNTS)),
            any_of=(
                None
                if sources is None
                else frozenset({Stage.ROUTED, Stage.RECEIVED, Stage.WAITING})
                if sources == "QUEUED"
                else frozenset({Stage.ROUTED, Stage.NEEDS_CONFIRMATION})  # counted as a level
                if sources == "PARKED"
                else frozenset(Stage)  # a terminal source: move_record runs twice
            ),
            **fixed,
        )

    received = one(Stage.RECEIVED, return_field=draw(st.sampled_from(["", "envelope"])))
    processing = one(Stage.PROCESSING, return_field=draw(st.sampled_from(["", "attempt"])))
    return received, processing


RECORDS = st.fixed_dictionaries(
    {"stage": st.sampled_from(STAGES), "envelope": st.just("{}"), "capability": st.just("x")},
    optional={
        "attempt": st.sampled_from(["1", "2"]),
        "instance": st.sampled_from(["i-1", "i-2"]),
        "accepted_ms": st.just("5"),
        "timeline": st.sampled_from(['[1,"ACCEPTED","",0,""]', "\n".join(["[1]"] * 60)]),
        "note": st.just("old"),
    },
)


async def both_ways(url: str, record: dict[str, str], pair: tuple[Move, Move]) -> None:
    settings = build_settings([{"redis_url": url, "prefix": f"mt{next(_prefixes)}"}])
    async with open_connection(settings, url) as conn:
        fused = receive_process_command(conn, *pair)
        keys = fused[3 : 3 + fused[2]]
        argv = fused[3 + fused[2] :]
        n = int(argv[0])
        first, second = argv[1 : n + 1], argv[n + 1 :]
        fields = [item for pair_ in record.items() for item in pair_]
        await conn.call("HSET", keys[0], *fields)
        answer = await conn.call(*fused)
        after_fused = await state(conn, keys)
        await conn.call("DEL", *keys)
        await conn.call("HSET", keys[0], *fields)
        transition = conn.sha(ScriptName.TRANSITION)
        received = await conn.call("EVALSHA", transition, len(keys), *keys, *first)
        processing = received
        if received[0] == 1:
            processing = await conn.call("EVALSHA", transition, len(keys), *keys, *second)
        assert answer == [received, processing], (record, pair)
        assert after_fused == await state(conn, keys), (record, pair)


async def state(conn: Connection, keys: tuple[Any, ...]) -> list[Any]:
    """The record and the counters, and the record's expiry."""
    return [
        *[await conn.call("HGETALL", key) for key in keys],
        await conn.call("TTL", keys[0]),
    ]


@example(
    {"stage": "ROUTED", "envelope": "{}", "capability": "x", "attempt": "1", "instance": "i-1"},
    (
        Move("m", Stage.RECEIVED, expect_attempt=1, counts=("calls\tx\tok",), fields={"a": "1"}),
        Move("m", Stage.PROCESSING, expect_attempt=1, counts=("retries\tx\tdown",)),
    ),
)
@example(  # out of the stage counted as a level
    {"stage": "NEEDS_CONFIRMATION", "envelope": "{}", "capability": "x"},
    (
        Move("m", Stage.RECEIVED, any_of=frozenset({Stage.ROUTED, Stage.NEEDS_CONFIRMATION})),
        Move("m", Stage.PROCESSING, fields={"take_call": "t"}),
    ),
)
@hypothesis_settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(RECORDS, moves())
def test_received_and_processing_in_one_write_as_two_moves_in_a_row(
    redis_server: RedisServer, record: dict[str, str], pair: tuple[Move, Move]
) -> None:
    anyio.run(both_ways, redis_server.url, record, pair)
