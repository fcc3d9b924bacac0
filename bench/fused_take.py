"""A probe of a lever for latency (issue 17, goal 2), not of Agent-Reach's code: what one
sidecar wake-up instead of two would save.

Today a sidecar waits for two answers before it calls its agent: its blocking
``XREADGROUP`` (the new entries), then its RECEIVED+PROCESSING script. Redis runs a client's
commands in order, so a blocking ``XREAD`` (after the last id read) sent in one write with a
script that reads the group itself (``XREADGROUP`` without ``BLOCK`` is allowed in a
script) and writes the stages answers both at once, when an entry arrives: one wake-up.

Both ways run here on bare redis-py, with stand-in work (an ``HSET`` per entry for the
stages), in a consumer process of their own, while a producer process adds 200 entries a
second carrying their time; the latency is from that time to the stages written and their
answer back in the consumer. One fresh redis-server (no persistence) per run, the two ways
interleaved.

Usage: ``python -m bench.fused_take [--entries 2200] [--reps 3]``. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as redis

from broker.embedded import RedisServer

RATE = 200
WARM_UP = 200
STAGES = """
for _, id in ipairs(ARGV) do redis.call('HSET', 'rec:' .. id, 'stage', 'PROCESSING') end
return #ARGV
"""
TAKE = """
local read = redis.call('XREADGROUP', 'GROUP', 'g', 'c', 'COUNT', 32, 'STREAMS', KEYS[1], '>')
if not read then return {} end
local taken = {}
for i, entry in ipairs(read[1][2]) do
  redis.call('HSET', 'rec:' .. entry[1], 'stage', 'PROCESSING')
  taken[i] = entry
end
return taken
"""


def sent_ms(fields: Any) -> float:
    """Milliseconds since the producer added the entry (its ``t``: ns; one machine)."""
    if isinstance(fields, list):
        fields = dict(zip(fields[::2], fields[1::2], strict=False))
    return (time.time_ns() - int(fields[b"t"])) / 1e6


async def two_waits(r: redis.Redis, stages: str, count: int) -> list[float]:
    """Today's way: the entries, then the stages' script."""
    latencies: list[float] = []
    while len(latencies) < count:
        got = await r.xreadgroup("g", "c", {"s": ">"}, count=32, block=1000)
        if got:
            entries = got[0][1]
            await r.evalsha(stages, 0, *[entry_id for entry_id, _ in entries])
            latencies += [sent_ms(fields) for _, fields in entries]
    return latencies


async def one_wait(r: redis.Redis, take: str, count: int) -> list[float]:
    """The blocking read and the script in one write: both answers come together."""
    latencies: list[float] = []
    last = "0-0"
    while len(latencies) < count:
        async with r.pipeline(transaction=False) as pipe:
            pipe.xread({"s": last}, count=1, block=1000)
            pipe.evalsha(take, 1, "s")
            _, taken = await pipe.execute()
        for entry_id, fields in taken:
            latencies.append(sent_ms(fields))
            last = entry_id
    return latencies


async def consume(port: int, way: str, count: int) -> None:
    r = redis.Redis(port=port)
    await r.xgroup_create("s", "g", id="$", mkstream=True)
    stages, take = await r.script_load(STAGES), await r.script_load(TAKE)
    print("ready", flush=True)
    if way == "two":
        latencies = await two_waits(r, stages, count)
    else:
        latencies = await one_wait(r, take, count)
    print(" ".join(f"{x:.4f}" for x in latencies[WARM_UP:]), flush=True)


async def produce(port: int, count: int) -> None:
    r = redis.Redis(port=port)
    start = time.perf_counter()
    for i in range(count):
        await asyncio.sleep(max(0.0, start + i / RATE - time.perf_counter()))
        await r.xadd("s", {"t": time.time_ns()})


def child(role: str, port: int, way: str, count: int) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "bench.fused_take", "--role", role, "--port", str(port)]
    argv += ["--way", way, "--entries", str(count)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def run(way: str, count: int) -> list[float]:
    with tempfile.TemporaryDirectory() as data:
        server = RedisServer.start(Path(data), extra_args=("--appendonly", "no"))
        try:
            consumer = child("consume", server.port, way, count)
            assert consumer.stdout is not None
            assert consumer.stdout.readline().strip() == "ready"
            child("produce", server.port, way, count).wait()
            out, _ = consumer.communicate(timeout=120)
        finally:
            server.stop()
    return sorted(float(x) for x in out.split())


def quantile(ordered: list[float], q: float) -> float:
    return ordered[int(q * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=2200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--role", choices=("consume", "produce"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=("two", "one"), default="two", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "consume":
        asyncio.run(consume(args.port, args.way, args.entries))
        return
    if args.role == "produce":
        asyncio.run(produce(args.port, args.entries))
        return
    print(f"{args.entries - WARM_UP} entries a run at {RATE}/s, ms from the add to the stages")
    print(f"{'rep':>3}  {'way':<24} {'p50':>6} {'p90':>6} {'p99':>6}")
    for rep in range(1, args.reps + 1):
        for way, name in (("two", "two waits (today)"), ("one", "one wait (fused take)")):
            ordered = run(way, args.entries)
            figures = " ".join(f"{quantile(ordered, q):6.3f}" for q in (0.5, 0.9, 0.99))
            print(f"{rep:>3}  {name:<24} {figures}", flush=True)


if __name__ == "__main__":
    main()
