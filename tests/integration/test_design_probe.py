"""The design probe (bench/design_probe.py) is a fair floor only if it does the design's work:
every message recorded to SUCCEEDED once, never more in flight than its credits."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest

from bench.design_probe import (
    CREDITS,
    INFLIGHT,
    RECORD,
    WAITING,
    dispatcher,
    producer,
    sidecar,
)
from broker.resp import RespConnection

MESSAGES = 3 * CREDITS  # more than the credits: some wait, and are assigned as credits free


@pytest.mark.one_server  # the probe names its keys without hash tags
async def test_every_message_runs_once_and_ends_succeeded_within_its_credits(
    redis_url: str,
) -> None:
    runs: Counter[int] = Counter()
    running = most = 0

    async def body(payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await anyio.sleep(0.05)  # long enough for every credit to be taken
        running -= 1
        runs[payload["i"]] += 1
        return {"i": payload["i"]}

    conn = await RespConnection.open(redis_url)
    try:
        (stale,) = await conn.execute([("KEYS", "probe:*")])  # a run before this one's
        if stale:
            await conn.execute([("DEL", *stale)])
        async with anyio.create_task_group() as tg:
            tg.start_soon(dispatcher, redis_url)
            tg.start_soon(sidecar, redis_url, body)
            async with producer(redis_url) as sending, anyio.create_task_group() as sends:
                for i in range(MESSAGES):
                    sends.start_soon(sending.enqueue, {"i": i})
            with anyio.fail_after(30):
                while True:
                    keys = await conn.execute([("KEYS", f"{RECORD}*")])
                    stages = await conn.execute([("HGET", k, "stage") for k in keys[0]])
                    if len(stages) == MESSAGES and set(stages) == {b"SUCCEEDED"}:
                        break
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        left = await conn.execute([("GET", INFLIGHT), ("LLEN", WAITING)])
    finally:
        await conn.close()
    assert runs == dict.fromkeys(range(MESSAGES), 1)
    assert 1 < most <= CREDITS
    assert left == [b"0", 0]  # every credit returned, nothing left waiting
