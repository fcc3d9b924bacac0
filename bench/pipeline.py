"""End-to-end pipeline benchmark against a same-run raw Redis Streams baseline.

Prints, on one fresh redis-server:

* baseline: raw ``XADD`` (pipelined) + ``XREADGROUP`` + ``XACK`` of N entries through one
  consumer group, with redis-py — the floor cost of moving a message through a stream;
* throughput: N envelopes through ingress -> dispatcher -> instance stream -> sidecar ->
  in-process no-op handler -> reply stream, every stage recorded;
* the ratio of the two, over several alternating rounds (median reported);
* latency p50/p99 at a fixed offered rate (default 200 messages/s).

Usage: ``python -m bench.pipeline [--messages 20000] [--rate 200] [--rate-seconds 10]``.
No threshold: it prints figures, CI never fails on a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import anyio
import msgspec
from anyio.abc import TaskGroup
from redis.asyncio import Redis

from adapters.python import Agent
from adapters.sidecar import Sidecar
from bench.servers import discard, throwaway_server
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.records import InstanceCard
from workers.dispatcher import Dispatcher

BATCH = 500


async def raw_baseline(url: str, n: int) -> float:
    """Messages/s for raw XADD + XREADGROUP + XACK through one group (producer and consumer
    running concurrently, both batched)."""
    redis = Redis.from_url(url)
    stream, group = f"baseline:{time.monotonic_ns()}", "g"
    await redis.xgroup_create(stream, group, id="0", mkstream=True)
    body = msgspec.json.encode({"capability": "bench.noop", "payload": None})
    done = anyio.Event()

    async def produce() -> None:
        for start in range(0, n, BATCH):
            pipe = redis.pipeline(transaction=False)
            for _ in range(min(BATCH, n - start)):
                pipe.xadd(stream, {"envelope": body})
            await pipe.execute()

    async def consume() -> None:
        seen = 0
        while seen < n:
            reply = await redis.xreadgroup(group, "c", {stream: ">"}, count=BATCH, block=1000)
            for _, entries in reply or []:
                await redis.xack(stream, group, *[entry_id for entry_id, _ in entries])
                seen += len(entries)
        done.set()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        tg.start_soon(consume)
    elapsed = time.perf_counter() - started
    await redis.delete(stream)
    await redis.aclose()
    return n / elapsed


def noop_card(max_inflight: int, instance_id: str = "noop-1") -> InstanceCard:
    """The card of the sidecar that serves ``bench.noop`` with :func:`noop_agent`."""
    return InstanceCard(
        agent_id="noop",
        instance_id=instance_id,
        capabilities=("bench.noop",),
        endpoint="python",
        max_inflight=max_inflight,
    )


def noop_agent() -> Agent:
    agent = Agent("noop")

    @agent.handler("bench.noop")
    async def handle(envelope: Envelope) -> None:
        return None

    return agent


async def wait_replies(conn: Connection, reply_to: str, n: int, arrivals: dict[str, float]) -> None:
    last = "0"
    async with conn.reader() as reader:
        while len(arrivals) < n:
            entries = await reader.read_stream(reply_to, last, count=5000, block_ms=1000)
            now = time.perf_counter()
            for entry_id, fields in entries:
                last = entry_id
                arrivals.setdefault(fields["id"].decode(), now)


async def pipeline_throughput(conn: Connection, n: int) -> float:
    """Messages/s for n envelopes submitted in batches, until every reply has arrived."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    envelopes = [Envelope(capability="bench.noop", reply_to=reply_to) for _ in range(n)]
    arrivals: dict[str, float] = {}
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_replies, conn, reply_to, n, arrivals)
        for start in range(0, n, BATCH):
            await client.submit_many(envelopes[start : start + BATCH])
    return n / (time.perf_counter() - started)


async def in_process_throughput(
    conn: Connection,
    instance_id: str,
    messages: int,
    *,
    alongside: Callable[[TaskGroup], None] | None = None,
) -> float:
    """:func:`pipeline_throughput` through a dispatcher and an in-process sidecar (no-op
    handler) started here on ``conn``; ``alongside`` may start more tasks meanwhile."""
    async with anyio.create_task_group() as tg:
        await tg.start(Sidecar(conn, noop_card(messages, instance_id), noop_agent()).run)
        await tg.start(Dispatcher(conn, consumer="bench").run)
        if alongside is not None:
            alongside(tg)
        throughput = await pipeline_throughput(conn, messages)
        tg.cancel_scope.cancel()
    return throughput


async def fixed_rate_latency(conn: Connection, rate: float, seconds: float) -> list[float]:
    """Submit one message every 1/rate seconds; latency = reply arrival - submission."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    n = int(rate * seconds)
    sent: dict[str, float] = {}
    arrivals: dict[str, float] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_replies, conn, reply_to, n, arrivals)
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            envelope = Envelope(capability="bench.noop", reply_to=reply_to)
            sent_at = time.perf_counter()
            message_id = await client.submit(envelope)
            sent[message_id] = sent_at
    return sorted((arrivals[i] - sent[i]) * 1000 for i in sent)


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


async def main(messages: int, rate: float, rate_seconds: float, rounds: int) -> None:
    """Alternate baseline and pipeline runs on one server; report each round and the median
    ratio (a shared 2-core machine is noisy: the ratio within a round is what compares)."""
    server = throwaway_server("reach-bench-")
    ratios: list[float] = []
    try:
        settings = build_settings([{"redis_url": server.url, "prefix": "bench"}])
        async with open_connection(settings, server.url) as conn:
            sidecar = Sidecar(conn, noop_card(messages), noop_agent())
            async with anyio.create_task_group() as tg:
                await tg.start(sidecar.run)
                await tg.start(Dispatcher(conn, consumer="bench").run)
                for round_no in range(1, rounds + 1):
                    baseline = await raw_baseline(server.url, messages)
                    throughput = await pipeline_throughput(conn, messages)
                    ratios.append(throughput / baseline)
                    print(
                        f"round {round_no}: raw XADD+XREADGROUP+XACK {baseline:8.0f} msg/s | "
                        f"agent-reach end to end {throughput:7.0f} msg/s | "
                        f"ratio {ratios[-1]:6.1%}",
                        flush=True,
                    )
                latencies = await fixed_rate_latency(conn, rate, rate_seconds)
                tg.cancel_scope.cancel()
    finally:
        discard(server)
    print(f"messages per run                   : {messages} (in-process adapter, no-op handler)")
    print(f"median ratio (end to end / raw)    : {statistics.median(ratios):.1%}")
    print(
        f"latency at {rate:.0f} msg/s for {rate_seconds:.0f} s     : "
        f"p50 {percentile(latencies, 0.50):.2f} ms, p99 {percentile(latencies, 0.99):.2f} ms, "
        f"mean {statistics.fmean(latencies):.2f} ms"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--rate-seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main, args.messages, args.rate, args.rate_seconds, args.rounds)


if __name__ == "__main__":
    cli()
