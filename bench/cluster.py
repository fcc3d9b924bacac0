"""One Redis against a three-master Redis Cluster, on this machine: ``bench.pipeline``'s load
(a dispatcher and an in-process sidecar with a no-op handler, one process) on each, and on
the cluster again with ``ingress_partitions = 3``, rounds interleaved. Because one machine
with two cores cannot show three nodes' speed, it also prints what each message costs every
node: Redis commands and Redis CPU time per message, read from
``INFO commandstats`` and ``INFO cpu`` before and after each run, and the commands that cost
the most. ``docs/scaling.md`` builds its model on these figures.

Usage: ``python -m bench.cluster [--messages 5000] [--rounds 3]``.
No threshold: it prints figures, CI never fails on a time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio
import redis

from bench.local_cluster import LocalCluster, start_cluster
from bench.pipeline import in_process_throughput
from broker.config import build_settings
from broker.connection import open_connection
from broker.embedded import RedisServer, find_redis_server


@dataclass
class NodeReading:
    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float


def read_node(client: redis.Redis) -> NodeReading:
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    usec = {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()}
    return NodeReading(calls, usec, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]))


@dataclass
class NodeCost:
    commands: float  # per message
    cpu_us: float  # per message, the node's whole CPU (user + sys)
    top: list[tuple[str, float]]  # command -> calls per message, the largest


def cost(before: NodeReading, after: NodeReading, messages: int) -> NodeCost:
    calls = {k: n - before.calls.get(k, 0) for k, n in after.calls.items()}
    calls = {k: n for k, n in calls.items() if n > 0 and k not in ("info",)}
    top = sorted(((k, n / messages) for k, n in calls.items()), key=lambda kv: -kv[1])[:5]
    return NodeCost(
        sum(calls.values()) / messages, (after.cpu_s - before.cpu_s) * 1e6 / messages, top
    )


async def one_run(
    url: str, clients: list[redis.Redis], run_no: int, messages: int, partitions: int = 1
) -> tuple[float, list[NodeCost]]:
    settings = build_settings(
        [{"redis_url": url, "prefix": f"bc{run_no}", "ingress_partitions": partitions}]
    )
    before = [read_node(c) for c in clients]
    async with open_connection(settings, url) as conn:
        throughput = await in_process_throughput(conn, f"noop-{run_no}", messages)
    after = [read_node(c) for c in clients]
    for client in clients:
        client.flushall()
    return throughput, [cost(b, a, messages) for b, a in zip(before, after, strict=True)]


def show(name: str, throughput: list[float], costs: list[list[NodeCost]]) -> None:
    """Nodes ranked by their cost in each run (which node holds the single keys depends on
    the run's key prefix), then the median of each rank."""
    print(f"{name}: median {statistics.median(throughput):6.0f} msg/s over {len(throughput)}")
    ranked = [sorted(run, key=lambda c: -c.cpu_us) for run in costs]
    total = statistics.median(sum(c.commands for c in run) for run in costs)
    print(f"  all nodes: {total:5.1f} commands/msg")
    for rank, node_costs in enumerate(zip(*ranked, strict=True)):
        commands = statistics.median(c.commands for c in node_costs)
        cpu = statistics.median(c.cpu_us for c in node_costs)
        top = ", ".join(f"{k} {v:.2f}" for k, v in node_costs[-1].top)
        label = "busiest" if rank == 0 else f"#{rank + 1}"
        print(f"  {label:>7} node: {commands:5.1f} commands/msg, {cpu:5.0f} µs CPU/msg ({top})")


async def main(messages: int, rounds: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="reach-bench-cluster-"))
    binary = find_redis_server()
    single = RedisServer.start(base / "single", binary=binary)
    cluster: LocalCluster = start_cluster(base / "cluster", binary)
    single_clients = [redis.Redis(port=single.port)]
    cluster_clients = [cluster.client(n) for n in range(len(cluster.masters))]
    configurations = (
        ("one redis", single.url, single_clients, 1),
        ("3-master cluster", cluster.url, cluster_clients, 1),
        ("3-master cluster, 3 ingress partitions", cluster.url, cluster_clients, 3),
    )
    results: dict[str, tuple[list[float], list[list[NodeCost]]]] = {
        name: ([], []) for name, *_ in configurations
    }
    try:
        await one_run(single.url, single_clients, 0, messages // 5)  # warm-ups
        await one_run(cluster.url, cluster_clients, 0, messages // 5)
        run_no = 0
        for round_no in range(1, rounds + 1):
            shown = []
            for name, url, clients, partitions in configurations:
                run_no += 1
                throughput, costs = await one_run(url, clients, run_no, messages, partitions)
                results[name][0].append(throughput)
                results[name][1].append(costs)
                shown.append(f"{name} {throughput:6.0f} msg/s")
            print(f"round {round_no}: " + " | ".join(shown), flush=True)
    finally:
        single.stop()
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(f"messages per run: {messages} (in-process adapter, no-op handler, one process)")
    for name, (throughput, costs) in results.items():
        show(name, throughput, costs)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main, args.messages, args.rounds)


if __name__ == "__main__":
    cli()
