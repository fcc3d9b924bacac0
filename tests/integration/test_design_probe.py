"""The design probe (bench/design_probe.py) is a fair floor only if it does the design's work:
every message recorded to SUCCEEDED once, never more in flight than its credits, work that
waited assigned in order, and a copy of an entry run never."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest

from bench.design_probe import (
    ACCEPT_ASSIGN,
    CREDITS,
    DUE,
    GROUP,
    INFLIGHT,
    QUEUE,
    RECORD,
    WAITING,
    dispatcher,
    producer,
    sidecar,
)
from broker.resp import RespConnection

MESSAGES = 3 * CREDITS  # more than the credits: some wait, and are assigned as credits free


async def until(conn: RespConnection, done: Any) -> Any:
    """Poll Redis (with a deadline) until ``done(conn)`` answers something true."""
    with anyio.fail_after(30):
        while not (answer := await done(conn)):  # noqa: ASYNC110 - Redis polled
            await anyio.sleep(0.02)
    return answer


async def stages(conn: RespConnection) -> dict[bytes, dict[bytes, bytes]] | None:
    """Every record's fields once all have SUCCEEDED, else None."""
    (keys,) = await conn.execute([("KEYS", f"{RECORD}*")])
    records = await conn.execute([("HGETALL", k) for k in keys])
    fields = {
        k: dict(zip(r[::2], r[1::2], strict=True)) for k, r in zip(keys, records, strict=True)
    }
    if len(fields) == MESSAGES and {f[b"stage"] for f in fields.values()} == {b"SUCCEEDED"}:
        return fields
    return None


async def settled(conn: RespConnection) -> bool:
    """Nothing pending in the sidecar's group."""
    (pending,) = await conn.execute([("XPENDING", QUEUE, GROUP)])
    return pending[0] == 0


@pytest.mark.one_server  # the probe names its keys without hash tags
async def test_every_message_runs_once_in_order_within_its_credits(redis_url: str) -> None:
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
            records = await until(conn, stages)
            # a copy of a finished message's assignment: let go, run never, frees nothing
            first = next(iter(records))[len(RECORD) :]
            await conn.execute([("XADD", QUEUE, "*", "id", first, "attempt", "1")])
            await until(conn, settled)
            tg.cancel_scope.cancel()
        left = await conn.execute([("SCARD", INFLIGHT), ("ZCARD", WAITING), ("ZCARD", DUE)])
    finally:
        await conn.close()
    assert runs == dict.fromkeys(range(MESSAGES), 1)
    assert 1 < most <= CREDITS
    assert left == [0, 0, 0]  # every credit returned, nothing waiting, no deadline left
    waited = sorted(
        (int(f[b"t_accepted"]), int(f[b"t_routed"]))
        for f in records.values()
        if f[b"t_routed"] != f[b"t_accepted"]
    )
    assert len(waited) >= MESSAGES - 2 * CREDITS  # at least those past two rounds of credits
    routed = [r for _, r in waited]
    assert routed == sorted(routed)  # drained oldest first
    times = [(int(f[b"t_accepted"]), int(f[b"t_routed"])) for f in records.values()]
    overtaken = [
        (w, m) for w in waited for m in times if m[0] > w[0] and m[1] < w[1]
    ]  # one accepted later but routed sooner, while the other waited
    assert overtaken == []


@pytest.mark.one_server
async def test_a_new_message_waits_behind_work_waiting_though_a_credit_is_free(
    redis_url: str,
) -> None:
    conn = await RespConnection.open(redis_url)
    try:
        (stale,) = await conn.execute([("KEYS", "probe:*")])
        if stale:
            await conn.execute([("DEL", *stale)])
        keys = (f"{RECORD}new", INFLIGHT, QUEUE, WAITING, DUE)
        answers = await conn.execute(
            [
                ("ZADD", WAITING, 1000, "old"),
                ("EVAL", ACCEPT_ASSIGN, len(keys), *keys, "new", b"{}", 2000, CREDITS, 30_000),
                ("ZRANGE", WAITING, 0, -1),
                ("SCARD", INFLIGHT),
                ("XLEN", QUEUE),
            ]
        )
    finally:
        await conn.close()
    assert answers[1:] == [0, [b"old", b"new"], 0, 0]  # parked behind, no credit taken
