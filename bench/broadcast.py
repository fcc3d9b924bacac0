"""Does a broadcast stall other traffic? Unicast latency with and without one in flight.

Issue 6's acceptance: "a broadcast to 20 instances while 1,000 unicast requests flow: all 20
children complete, the unicast p99 stays within 2x its value without the broadcast".

For each instance count (20 and 50 by default), on one fresh redis-server with the dispatcher
and one sidecar per instance (in-process agents that take ``--work-ms``): 1,000 unicast
requests offered at a fixed rate, latency = reply arrival - submission; once alone, once with
a broadcast to every instance submitted when half of them have been sent. Rounds alternate
the two (a shared machine drifts); it prints p50/p99 of each run, how long the broadcast took
to end (all children terminal, the parent's reply received), and the median ratio of p99
with to p99 without. A control run adds, instead of the broadcast, a burst of as many plain
unicast requests as there are instances: the same work, without the broadcast machinery.

Usage: ``python -m bench.broadcast [--instances 20] [--requests 1000] [--rate 200]
[--rounds 3] [--work-ms 5]``. No threshold: it prints figures, CI never fails on a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import TaskGroup

from adapters.python import Agent
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.records import InstanceCard
from workers.dispatcher import Dispatcher

from .pipeline import percentile
from .servers import discard, throwaway_server

CAPABILITY = "bench.echo"
SCENARIOS = [20, 50]


def echo_agent(work_s: float) -> Agent:
    agent = Agent("echo")

    @agent.handler(CAPABILITY)
    async def handle(envelope: Envelope) -> dict[str, float]:
        await anyio.sleep(work_s)
        return {"done": time.time()}

    return agent


@dataclass
class Run:
    latencies_ms: list[float]
    extra_ms: float | None = None  # the broadcast's (or the burst's last) reply latency
    children: int = 0
    children_ok: int = 0

    def line(self, name: str) -> str:
        where = f"{name:<16} p50 {percentile(self.latencies_ms, 0.50):6.1f} ms  "
        where += f"p99 {percentile(self.latencies_ms, 0.99):6.1f} ms"
        if self.children:
            where += (
                f"  | broadcast ended in {self.extra_ms:6.1f} ms, "
                f"{self.children_ok}/{self.children} children SUCCEEDED"
            )
        elif self.extra_ms is not None:
            where += f"  | burst all answered in {self.extra_ms:6.1f} ms"
        return where


@dataclass
class Replies:
    """One reader for a run's reply stream: each id's arrival time and fields."""

    arrivals: dict[str, float] = field(default_factory=dict)
    results: dict[str, dict[str, bytes]] = field(default_factory=dict)

    async def read(self, conn: Connection, reply_to: str, expected: int) -> None:
        last = "0"
        async with conn.reader() as reader:
            while len(self.arrivals) < expected:
                entries = await reader.read_stream(reply_to, last, count=5000, block_ms=1000)
                now = time.perf_counter()
                for entry_id, fields in entries:
                    last = entry_id
                    self.arrivals.setdefault(fields["id"].decode(), now)
                    self.results.setdefault(fields["id"].decode(), fields)


async def one_run(
    conn: Connection, requests: int, rate: float, *, extra: str = "", instances: int
) -> Run:
    """``requests`` unicast requests at ``rate``; halfway, ``extra``: "broadcast" (one, to
    every instance) or "burst" (as many unicast requests as there are instances, at once)."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    replies = Replies()
    sent: dict[str, float] = {}
    extras: list[str] = []
    expected = requests + {"": 0, "broadcast": 1, "burst": instances}[extra]
    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            tg.start_soon(replies.read, conn, reply_to, expected)
            start = time.perf_counter()
            for i in range(requests):
                if extra and i == requests // 2:
                    extras = await submit_extra(client, reply_to, extra, instances, sent)
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                sent_at = time.perf_counter()
                envelope = Envelope(capability=CAPABILITY, reply_to=reply_to)
                sent[await client.submit(envelope)] = sent_at
    await conn.call("DEL", reply_to)
    skip = set(extras)
    run = Run(sorted((replies.arrivals[i] - t) * 1000 for i, t in sent.items() if i not in skip))
    if extras:
        run.extra_ms = max((replies.arrivals[i] - sent[i]) * 1000 for i in extras)
    if extra == "broadcast":
        outcomes = msgspec.json.decode(replies.results[extras[0]].get("result", b"{}"))
        run.children = len(outcomes)
        run.children_ok = sum(1 for o in outcomes.values() if o.get("stage") == "SUCCEEDED")
        assert run.children == instances, (run.children, instances)
    return run


async def submit_extra(
    client: Client, reply_to: str, extra: str, instances: int, sent: dict[str, float]
) -> list[str]:
    sent_at = time.perf_counter()
    if extra == "broadcast":
        ids = [await client.submit(Envelope(CAPABILITY, reply_to=reply_to, mode="broadcast"))]
    else:
        burst = [Envelope(CAPABILITY, reply_to=reply_to) for _ in range(instances)]
        ids = await client.submit_many(burst)
    sent.update(dict.fromkeys(ids, sent_at))
    return ids


async def start_instances(conn: Connection, tg: TaskGroup, count: int, work_s: float) -> None:
    for n in range(count):
        card = InstanceCard(
            agent_id="echo",
            instance_id=f"echo-{n:02d}",
            capabilities=(CAPABILITY,),
            endpoint="python",
            max_inflight=16,
        )
        await tg.start(Sidecar(conn, card, echo_agent(work_s)).run)


async def scenario(url: str, args: argparse.Namespace, instances: int) -> None:
    settings = build_settings(
        [
            {
                "redis_url": url,
                "prefix": f"bench-broadcast-{instances}",
                "heartbeat_s": 0.5,
                "down_after_s": 5.0,
                "sweep_interval_s": 0.2,
                "registry_refresh_s": 0.5,
            }
        ]
    )
    ratios: list[float] = []
    controls: list[float] = []
    print(f"-- {instances} instances, {args.requests} unicast requests at {args.rate:.0f}/s")
    async with open_connection(settings, url) as conn, anyio.create_task_group() as tg:
        await start_instances(conn, tg, instances, args.work_ms / 1000)
        await tg.start(Dispatcher(conn, consumer="bench").run)
        # warm up: connections, scripts, the routing table's view of every instance
        await one_run(conn, 200, args.rate, instances=instances)
        for round_no in range(1, args.rounds + 1):
            alone = await one_run(conn, args.requests, args.rate, instances=instances)
            mixed = await one_run(
                conn, args.requests, args.rate, extra="broadcast", instances=instances
            )
            burst = await one_run(
                conn, args.requests, args.rate, extra="burst", instances=instances
            )
            p99 = percentile(alone.latencies_ms, 0.99)
            ratio = percentile(mixed.latencies_ms, 0.99) / p99
            control = percentile(burst.latencies_ms, 0.99) / p99
            ratios.append(ratio)
            controls.append(control)
            print(alone.line(f"round {round_no} alone"), flush=True)
            print(mixed.line(f"round {round_no} + bcast"), flush=True)
            print(burst.line(f"round {round_no} + burst"), flush=True)
            print(
                f"{'':<16} p99 / p99 alone: with the broadcast {ratio:.2f}, "
                f"with a burst of {instances} unicast {control:.2f}",
                flush=True,
            )
        tg.cancel_scope.cancel()
    print(
        f"median p99 ratio: with a {instances}-instance broadcast {statistics.median(ratios):.2f}"
        f" | with a burst of {instances} unicast requests {statistics.median(controls):.2f}"
    )


async def main(args: argparse.Namespace) -> None:
    server = throwaway_server("reach-bench-")
    try:
        for instances in [args.instances] if args.instances else SCENARIOS:
            await scenario(server.url, args, instances)
    finally:
        discard(server)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=None, help="one scenario (20, 50)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=5.0)
    anyio.run(main, parser.parse_args())


if __name__ == "__main__":
    cli()
