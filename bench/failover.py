"""A master of a Redis Cluster SIGKILLed mid-run, its replica promoted: what is lost?

Three masters with a replica each (``bench/local_cluster.py``), AOF ``appendfsync always``, on
loopback. One process runs a dispatcher (with the reaper) and a sidecar whose in-process
agent is **not idempotent** and counts what it executes; a producer submits messages at a
fixed rate (a submit that fails is retried with the same ids until it is answered). Halfway,
the master serving most of the run's records is SIGKILLed; once its replica has taken its
slots, the old master is started again on its data (it rejoins as the new master's replica).
Then every message the producer was answered for must settle: terminal, or parked for an
operator (NEEDS_CONFIRMATION).

Reported per run: messages lost (acknowledged to the producer, then no record, or a record
that never settles), executed twice by the non-idempotent agent, how long the failed slots
were unavailable, and throughput — with ``replica_acks = 0`` (asynchronous replication) and
``replica_acks = 1`` (``WAIT``: a round trip that writes is answered once a replica has it).

With ``--stall S`` the victim's replica is stopped (SIGSTOP) and its link dropped S seconds
before the kill, and resumed after it: a replica that is behind, as under load or over a slow
link — there asynchronous replication loses what the master acknowledged meanwhile. Last,
the pipeline's throughput on the cluster with ``replica_acks`` 0 and 1, without failures.

Usage: ``python -m bench.failover [--messages 3000] [--rate 300] [--rounds 2] [--stall 1]
[--throughput 5000]``.
No threshold: it prints figures; ``tests/cluster/test_failover.py`` runs it once each way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from adapters.python import Agent
from adapters.sidecar import Sidecar
from bench.local_cluster import LocalCluster, start_cluster, start_node
from bench.pipeline import in_process_throughput
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope, complete
from broker.errors import RedisUnavailable
from broker.records import InstanceCard
from broker.slots import key_slot
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore
from workers.dispatcher import Dispatcher
from workers.reaper import Reaper

CAPABILITY = "failover.work"
SETTLED = TERMINAL | {Stage.NEEDS_CONFIRMATION}
BATCH_EVERY_S = 0.05
SETTLE_S = 120.0
QUIET_S = 20.0  # several delivery timeouts and reaper passes
POLL_S = 0.05
TIMINGS = {
    "heartbeat_s": 0.3,
    "down_after_s": 3.0,
    "sweep_interval_s": 0.2,
    "registry_refresh_s": 0.5,
    "delivery_timeout_s": 4.0,
    "processing_grace_s": 1.0,
    "claim_idle_s": 3.0,
}


@dataclass
class FailoverResult:
    replica_acks: int
    submitted: int = 0
    lost: list[str] = field(default_factory=list)
    twice: dict[str, int] = field(default_factory=dict)
    stages: Counter[str] = field(default_factory=Counter)
    unavailable_s: float = 0.0  # from the SIGKILL until the replica served the slots
    elapsed_s: float = 0.0  # first submit until every message settled
    submit_retries: int = 0
    stall_s: float = 0.0  # the replica held back and its link dropped this long before
    lag_bytes: int = 0  # written on the master, not yet on its replica, just before the kill
    waits: int = 0  # WAIT commands the masters ran

    @property
    def throughput(self) -> float:
        return self.submitted / self.elapsed_s if self.elapsed_s else 0.0


def counting_agent(executions: Counter[str]) -> Agent:
    agent = Agent("work")

    @agent.handler(CAPABILITY)
    async def handle(envelope: Envelope) -> dict[str, int]:
        executions[envelope.message_id] += 1
        await anyio.sleep(0.002)
        return {"n": executions[envelope.message_id]}

    return agent


def replication_lag(cluster: LocalCluster, master: int) -> int:
    """Bytes of the replication stream ``master`` has written that its replica has not
    processed (``INFO replication`` of each, read one after the other): what a SIGKILL now
    takes along."""
    written = int(cluster.client(master).info("replication")["master_repl_offset"])
    replica = cluster.client(len(cluster.masters) + master).info("replication")
    return max(0, written - int(replica.get("slave_repl_offset", 0)))


def waits_run(cluster: LocalCluster) -> int:
    total = 0
    for n in range(len(cluster.nodes)):
        try:
            stats = cluster.client(n).info("commandstats")
        except Exception:  # a node killed and not yet back: counted as none
            continue
        total += int(stats.get("cmdstat_wait", {}).get("calls", 0))
    return total


def busiest_master(cluster: LocalCluster, ids: list[str], conn: Connection) -> int:
    owners = cluster.owners()
    counts = Counter(owners[key_slot(conn.keys.record(i))] for i in ids)
    return counts.most_common(1)[0][0]


async def promoted(cluster: LocalCluster, killed: int, asked: int) -> bool:
    """Whether node ``asked`` says the killed master's slots are served by another node."""
    try:
        owners = await anyio.to_thread.run_sync(cluster.owners, asked)
    except Exception:  # the node asked is busy electing: not yet
        return False
    return killed not in owners and -1 not in owners


async def failover_run(
    cluster: LocalCluster,
    binary: Path,
    *,
    replica_acks: int,
    messages: int,
    rate: float,
    prefix: str,
    stall_s: float = 0.0,
    quiet_s: float = QUIET_S,
) -> FailoverResult:
    """One run as the module says; ``cluster`` must have a replica per master. With
    ``stall_s`` the victim's replica is stopped (SIGSTOP) that long before the kill and
    resumed after it, its link dropped meanwhile: a replica behind, as under load or a slow
    link."""
    settings = build_settings(
        [
            {
                "redis_url": cluster.url,
                "prefix": prefix,
                "replica_acks": replica_acks,
                "replica_ack_timeout_s": 1.0,
                **TIMINGS,
            }
        ]
    )
    result = FailoverResult(replica_acks, stall_s=stall_s)
    executions: Counter[str] = Counter()
    card = InstanceCard(
        agent_id="work",
        instance_id=f"{prefix}-work-1",
        capabilities=(CAPABILITY,),
        endpoint="python",
        max_inflight=64,
        idempotent=False,
    )
    envelopes = [
        complete(
            Envelope(
                capability=CAPABILITY,
                timeout_s=600,
                payload=msgspec.Raw(msgspec.json.encode({"n": n})),
            )
        )
        for n in range(messages)
    ]
    ids = [e.message_id for e in envelopes]
    async with open_connection(settings, cluster.url) as conn:
        victim = busiest_master(cluster, ids, conn)
        asked = next(i for i in range(len(cluster.masters)) if i != victim)
        async with anyio.create_task_group() as tg:
            await tg.start(Sidecar(conn, card, counting_agent(executions)).run)
            await tg.start(Dispatcher(conn, consumer=f"{prefix}-d").run)
            await tg.start(Reaper(conn).run)
            started = time.perf_counter()
            client = Client(conn)
            batches = max(1, round(messages / rate / BATCH_EVERY_S))
            for n in range(batches):
                await anyio.sleep(max(0.0, n * BATCH_EVERY_S - (time.perf_counter() - started)))
                chunk = envelopes[n * messages // batches : (n + 1) * messages // batches]
                if n == batches // 2:
                    tg.start_soon(_fail_over, cluster, binary, (victim, asked, stall_s), result)
                while True:
                    try:
                        await client.submit_many(chunk)
                        break
                    except RedisUnavailable:
                        result.submit_retries += 1
                        await anyio.sleep(POLL_S)
                result.submitted += len(chunk)
            await _settle(MessageStore(conn), ids, quiet_s)
            store = MessageStore(conn)
            result.elapsed_s = time.perf_counter() - started
            stages = await _stages(store, ids)
            tg.cancel_scope.cancel()
    result.waits = waits_run(cluster)
    result.stages = Counter(str(s) if s else "no record" for s in stages)
    result.lost = [i for i, s in zip(ids, stages, strict=True) if s not in SETTLED]
    result.twice = {i: n for i, n in executions.items() if n > 1}
    return result


async def _fail_over(
    cluster: LocalCluster, binary: Path, how: tuple[int, int, float], result: FailoverResult
) -> None:
    """SIGKILL master ``victim`` (after stalling its replica ``stall_s``); once its replica
    serves its slots, start it again."""
    victim, asked, stall_s = how
    server, replica = cluster.nodes[victim], cluster.replicas[victim]
    if stall_s:
        # the replica stops, and the master drops the link, so that what it writes from now
        # on stays on it (else the kernel's socket buffers would carry megabytes across)
        os.kill(replica.process.pid, signal.SIGSTOP)
        cluster.client(victim).client_kill_filter(_type="replica")
        await anyio.sleep(stall_s)  # the stall itself: the schedule, not a synchronisation
    else:
        result.lag_bytes = await anyio.to_thread.run_sync(replication_lag, cluster, victim)
    killed_at = time.perf_counter()
    server.kill()
    if stall_s:
        os.kill(replica.process.pid, signal.SIGCONT)
    with anyio.fail_after(60):
        while not await promoted(cluster, victim, asked):  # noqa: ASYNC110 - polled, bounded
            await anyio.sleep(POLL_S)
    result.unavailable_s = time.perf_counter() - killed_at
    data = server.data_dir
    back = await anyio.to_thread.run_sync(
        lambda: start_node(data, binary, appendfsync="always", port=server.port)
    )
    index = cluster.masters.index(server) if server in cluster.masters else None
    if index is not None:
        cluster.masters[index] = back
    else:
        cluster.replicas[cluster.replicas.index(server)] = back


async def _stages(store: MessageStore, ids: list[str]) -> list[Stage | None]:
    while True:
        try:
            return await store.stages(ids)
        except RedisUnavailable:
            await anyio.sleep(POLL_S)


async def _settle(store: MessageStore, ids: list[str], quiet_s: float) -> None:
    """Until every message settled, or none did for ``quiet_s`` (what is left then is lost:
    the reaper would have moved it by now), within :data:`SETTLE_S`."""
    left, moved_at = len(ids), time.perf_counter()
    with anyio.move_on_after(SETTLE_S):
        while left and time.perf_counter() - moved_at < quiet_s:
            now = sum(1 for s in await _stages(store, ids) if s not in SETTLED)
            if now < left:
                left, moved_at = now, time.perf_counter()
            await anyio.sleep(POLL_S * 4)


def report(result: FailoverResult) -> str:
    stages = ", ".join(f"{k} {n}" for k, n in sorted(result.stages.items()))
    lag = f"replication lag at the kill {result.lag_bytes} bytes"
    if result.stall_s:
        lag = f"replica held back {result.stall_s:g} s before the kill"
    return (
        f"replica_acks = {result.replica_acks}: {result.submitted} messages, "
        f"lost {len(result.lost)}, executed twice {len(result.twice)}; slots unavailable "
        f"{result.unavailable_s:.1f} s; {result.throughput:.0f} msg/s over the run; "
        f"submits retried {result.submit_retries}; {lag}; WAITs {result.waits}; stages: {stages}"
    )


async def main(messages: int, rate: float, rounds: int, stall_s: float, tp: int) -> None:
    binary = Path(shutil.which("redis-server") or "redis-server")
    for round_no in range(rounds):
        for acks in (0, 1):
            with tempfile.TemporaryDirectory() as tmp:
                cluster = start_cluster(Path(tmp), binary, replicas=True, appendfsync="always")
                try:
                    result = await failover_run(
                        cluster,
                        binary,
                        replica_acks=acks,
                        messages=messages,
                        rate=rate,
                        prefix=f"fo{round_no}{acks}",
                        stall_s=stall_s,
                    )
                finally:
                    cluster.stop()
            print(f"round {round_no + 1}: {report(result)}", flush=True)
    if tp:
        await throughput_cost(binary, tp, rounds)


async def throughput_cost(binary: Path, messages: int, rounds: int) -> None:
    """``bench.pipeline``'s load on the cluster with replicas, ``replica_acks`` 0 and 1
    interleaved: what waiting for a replica costs when nothing fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_cluster(Path(tmp), binary, replicas=True, appendfsync="always")
        try:
            figures: dict[int, list[float]] = {0: [], 1: []}
            for round_no in range(rounds):
                for acks in (0, 1):
                    settings = build_settings(
                        [
                            {
                                "redis_url": cluster.url,
                                "prefix": f"tp{round_no}{acks}",
                                "replica_acks": acks,
                            }
                        ]
                    )
                    async with open_connection(settings, cluster.url) as conn:
                        figures[acks].append(
                            await in_process_throughput(conn, f"noop-{round_no}{acks}", messages)
                        )
        finally:
            cluster.stop()
    base, held = statistics.median(figures[0]), statistics.median(figures[1])
    print(
        f"throughput without failures ({messages} messages, {rounds} rounds, medians): "
        f"replica_acks = 0 {base:.0f} msg/s, replica_acks = 1 {held:.0f} msg/s "
        f"({held / base:.0%})",
        flush=True,
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stall", type=float, default=0.0, help="s the replica lags (SIGSTOP)")
    parser.add_argument("--throughput", type=int, default=5000, help="messages; 0: skip")
    args = parser.parse_args()
    anyio.run(main, args.messages, args.rate, args.rounds, args.stall, args.throughput)


if __name__ == "__main__":
    cli()
