"""One chaos run: its own redis-server, three agents, seven broker processes, a producer, a
driver that SIGKILLs and restarts processes (and Redis once), then a bounded wait until every
message is terminal or visibly parked, and what was observed, for the report.

Given ``cluster_binary``, the run is on a real three-master Redis Cluster of that
``redis-server`` instead, with ``ingress_partitions = 3``: the processes are SIGKILLed as on
one server; Redis is not (a master's loss is the failover test's, tests/cluster)."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import msgspec

from broker.client import Client, result_from_fields
from broker.config import Settings, build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.envelope import Envelope, complete
from broker.records import MessageRecord, TimelineEntry
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore
from broker.streams import parse_entries
from tests.support.cluster import LocalCluster, start_cluster
from tests.support.processes import process_env

from .agents import ChaosAgent, chaos_agent
from .cluster import Cluster, retrying

CAPABILITY = "chaos.echo"
SETTLED = TERMINAL | {Stage.NEEDS_CONFIRMATION}
BATCH_EVERY_S = 0.25
SETTLE_POLL_S = 0.25
REPLY_WAIT_S = 5.0
DETAILED = 20  # lost or doubly executed messages shown with their timelines

# Short clocks, so crashes are noticed and repaired within seconds.
TIMINGS = {
    "heartbeat_s": 0.3,
    "down_after_s": 1.5,
    "sweep_interval_s": 0.2,
    "registry_refresh_s": 0.5,
    "delivery_timeout_s": 3.0,
    "sync_call_timeout_s": 5.0,
    "processing_grace_s": 1.0,
    "claim_idle_s": 3.0,
}


@dataclass(frozen=True)
class Plan:
    messages: int
    appendfsync: str
    seed: int
    produce_s: float
    settle_timeout_s: float = 120.0
    cluster_binary: Path | None = None  # a Redis Cluster of this redis-server

    @property
    def on_cluster(self) -> bool:
        return self.cluster_binary is not None


@dataclass
class Observed:
    """Everything the report is computed from."""

    plan: Plan
    ids: list[str] = field(default_factory=list)
    submitted_at: dict[str, float] = field(default_factory=dict)  # s since the run began
    redis_killed_at: float | None = None
    before_kill: dict[str, Stage | None] = field(default_factory=dict)
    records: dict[str, MessageRecord | None] = field(default_factory=dict)
    timelines: dict[str, list[TimelineEntry]] = field(default_factory=dict)
    replies: Counter[str] = field(default_factory=Counter)
    agents: list[ChaosAgent] = field(default_factory=list)
    stale_drops: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    fresh_ids: int = 0
    redis_restarts: list[dict[str, float]] = field(default_factory=list)
    settle_s: float = 0.0
    total_s: float = 0.0

    @property
    def non_idempotent(self) -> ChaosAgent:
        (agent,) = [a for a in self.agents if not a.idempotent]
        return agent

    def lost(self) -> list[str]:
        """Submitted ids with no record, or a record neither terminal nor parked."""
        return [i for i in self.ids if (r := self.records.get(i)) is None or r.stage not in SETTLED]

    def executed_twice(self) -> dict[str, int]:
        return self.non_idempotent.executions.twice()


CLUSTER_PARTITIONS = 3


def timings(plan: Plan) -> dict[str, float]:
    if plan.on_cluster:
        return {**TIMINGS, "ingress_partitions": CLUSTER_PARTITIONS}
    return TIMINGS


def chaos_settings(url: str, plan: Plan) -> Settings:
    return build_settings([{"redis_url": url, "prefix": "chaos", **timings(plan)}])


def child_env(settings: Settings, plan: Plan) -> dict[str, str]:
    extra = {f"AGENT_REACH_{k.upper()}": str(v) for k, v in timings(plan).items()}
    return process_env(settings, **extra)


def start_redis(tmp_path: Path, plan: Plan) -> RedisServer | LocalCluster:
    if plan.cluster_binary is not None:
        return start_cluster(tmp_path / "redis", plan.cluster_binary, appendfsync=plan.appendfsync)
    return RedisServer.start(tmp_path / "redis", appendfsync=plan.appendfsync)


@asynccontextmanager
async def chaos_cluster(
    tmp_path: Path, plan: Plan, agents: list[ChaosAgent]
) -> AsyncIterator[tuple[Cluster, Connection]]:
    """Redis, a connection for the test, and every process started; all stopped after."""
    server = await anyio.to_thread.run_sync(start_redis, tmp_path, plan)
    settings = chaos_settings(server.url, plan)
    (tmp_path / "logs").mkdir()
    cluster = Cluster(server, plan.appendfsync, child_env(settings, plan), tmp_path / "logs")
    for n in (1, 2):
        cluster.add_dispatcher(f"d{n}")
        cluster.add_reaper(str(n))
    for agent in agents:
        cluster.add_sidecar(agent, CAPABILITY)
    try:
        async with open_connection(settings, server.url) as conn:
            try:
                await cluster.start_all()
                yield cluster, conn
            finally:
                await cluster.stop_all()
    finally:
        cluster.server.stop()


def envelopes(plan: Plan, reply_to: str) -> list[Envelope]:
    """Ids fixed up front: a submit retried after a Redis failure names the same messages."""
    return [
        complete(
            Envelope(
                capability=CAPABILITY,
                reply_to=reply_to,
                timeout_s=600,
                payload=msgspec.Raw(msgspec.json.encode({"n": n})),
            )
        )
        for n in range(plan.messages)
    ]


class Run:
    def __init__(
        self, plan: Plan, cluster: Cluster, conn: Connection, agents: list[ChaosAgent]
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.conn = conn
        self.store = MessageStore(conn)
        self.client = Client(conn)
        self.reply_to = self.client.new_reply_stream()
        self.rng = random.Random(plan.seed)
        self.began = anyio.current_time()
        self.produced = anyio.Event()
        self.seen = Observed(plan, agents=agents)

    def clock(self) -> float:
        return anyio.current_time() - self.began

    async def go(self) -> Observed:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.produce)
            tg.start_soon(self.drive)
        self.cluster.check_alive()  # all restarted and running: now it must all settle
        settling = anyio.current_time()
        unsettled = await self.settle()
        self.seen.settle_s = anyio.current_time() - settling
        await self.observe(unsettled)
        self.seen.total_s = self.clock()
        return self.seen

    async def produce(self) -> None:
        """Submit the messages in small batches spread over ``produce_s``."""
        todo = envelopes(self.plan, self.reply_to)
        batches = max(1, round(self.plan.produce_s / BATCH_EVERY_S))
        for n in range(batches):
            await anyio.sleep(max(0.0, n * BATCH_EVERY_S - self.clock()))  # the schedule
            chunk = todo[n * len(todo) // batches : (n + 1) * len(todo) // batches]
            await retrying(partial(self.client.submit_many, chunk))
            for envelope in chunk:
                self.seen.ids.append(envelope.message_id)
                self.seen.submitted_at[envelope.message_id] = self.clock()
        self.produced.set()

    async def drive(self) -> None:
        """Every 1-3 s SIGKILL a random process and restart it; Redis once, mid-run."""
        members = self.cluster.members
        while not self.produced.is_set():
            with anyio.move_on_after(self.rng.uniform(1.0, 3.0)):  # the schedule
                await self.produced.wait()
            if self.produced.is_set():
                break
            halfway = self.clock() >= self.plan.produce_s / 2
            if not self.plan.on_cluster and self.seen.redis_killed_at is None and halfway:
                ids = list(self.seen.ids)
                stages = await retrying(partial(self.store.stages, ids))
                self.seen.before_kill = dict(zip(ids, stages, strict=True))
                self.seen.redis_killed_at = self.clock()
                await self.cluster.crash_redis(self.conn, self.rng.uniform(0.5, 1.5))
            else:
                await self.cluster.crash(self.rng.choice(members))

    async def settle(self) -> list[str]:
        """Poll until every message is terminal or parked, or the bound passes; the rest."""
        unsettled = list(self.seen.ids)
        with anyio.move_on_after(self.plan.settle_timeout_s):
            while unsettled:
                self.cluster.check_alive()
                stages = await retrying(partial(self.store.stages, unsettled))
                unsettled = [i for i, s in zip(unsettled, stages, strict=True) if s not in SETTLED]
                if unsettled:
                    await anyio.sleep(SETTLE_POLL_S)
        return unsettled

    async def observe(self, unsettled: list[str]) -> None:
        seen = self.seen
        records = await retrying(partial(self.store.get_records, seen.ids))
        seen.records = dict(zip(seen.ids, records, strict=True))
        ended = [i for i, r in seen.records.items() if r is not None and r.stage in TERMINAL]

        async def answered() -> bool:
            seen.replies = await self.read_replies()
            return all(seen.replies[i] for i in ended)

        with anyio.move_on_after(REPLY_WAIT_S):  # a reply leaves just after its record ends
            while not await answered():  # noqa: ASYNC110 - a condition, with a deadline
                await anyio.sleep(SETTLE_POLL_S)
        detailed = [*unsettled, *seen.lost(), *seen.executed_twice()]
        for message_id in list(dict.fromkeys(detailed))[:DETAILED]:
            seen.timelines[message_id] = await self.store.get_timeline(message_id)
        seen.stale_drops = sum(
            m.log.read_text(errors="replace").count("is stale here: dropped, not executed")
            for m in self.cluster.members
        )
        seen.kills, seen.fresh_ids = self.cluster.kills, self.cluster.fresh_ids
        seen.redis_restarts = self.cluster.redis_restarts

    async def read_replies(self) -> Counter[str]:
        """Terminal replies per message id (notices on the way are not outcomes)."""
        replies: Counter[str] = Counter()
        start = "-"
        while True:
            command = ("XRANGE", self.reply_to, start, "+", "COUNT", 1000)
            entries = parse_entries(await retrying(partial(self.conn.call, *command)))
            if not entries:
                return replies
            for entry_id, fields in entries:
                start = f"({entry_id}"
                if "notice" not in fields:
                    replies[result_from_fields(fields).id] += 1


async def run_chaos(tmp_path: Path, plan: Plan) -> Observed:
    async with AsyncExitStack() as stack:
        agents = [
            await stack.enter_async_context(
                chaos_agent(name, idempotent=idempotent, seed=plan.seed + n)
            )
            for n, (name, idempotent) in enumerate(
                (("alpha", True), ("beta", True), ("gamma", False))
            )
        ]
        cluster, conn = await stack.enter_async_context(chaos_cluster(tmp_path, plan, agents))
        return await Run(plan, cluster, conn, agents).go()
    raise AssertionError("unreachable")  # an exit stack may swallow exceptions, for mypy


def new_seed() -> int:
    return time.time_ns() % 1_000_000
