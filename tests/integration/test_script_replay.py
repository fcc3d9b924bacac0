"""The replay bench reads back exactly the commands Redis ran (bench/script_replay.py)."""

from __future__ import annotations

import anyio
import pytest

from bench.latency_path import monitor
from bench.script_replay import parse_line, replayable
from broker.resp import RespConnection

AWKWARD = bytes(range(256)) + b'"quoted" \\ back\\slash \n\r\t\a\b \xff\xfe'


# MONITOR is one node's: a cluster's node shows only the keys of its own slots
@pytest.mark.one_server
async def test_a_command_with_every_byte_reads_back_from_monitor_as_sent(redis_url: str) -> None:
    lines: list[str] = []
    sent = ("SET", "replay:awkward", AWKWARD)
    conn = await RespConnection.open(redis_url)
    try:
        async with anyio.create_task_group() as tg:
            started = anyio.Event()
            tg.start_soon(monitor, redis_url, lines, started)
            await started.wait()
            await conn.execute(
                [sent, ("XREADGROUP", "GROUP", "g", "c", "BLOCK", "5", "STREAMS", "s", ">")]
            )
            with anyio.fail_after(5):
                while len(lines) < 2:  # noqa: ASYNC110 - polled, with a deadline
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        await conn.close()
    assert parse_line(lines[0]) == (b"SET", b"replay:awkward", AWKWARD)
    # a blocking read is replayed without its block; the script's own commands not at all
    assert replayable(lines[1:]) == [(b"XREADGROUP", b"GROUP", b"g", b"c", b"STREAMS", b"s", b">")]
    assert parse_line('1796652082.09 [0 lua] "HSET" "k" "f" "v"') is None
