"""The slow-agent incident, as a reusable scenario: two HTTP agent instances of one capability
on loopback; mid-run one agent's latency goes from 20 ms to 2 s while producers keep a steady
rate. Used by ``bench/backpressure.py`` (static and adaptive credits side by side) and by the
acceptance test in ``tests/integration/test_slowdown.py``.

What is recorded: for each request, the instance that served it and its latency as the
producer sees it (submit to reply); every 20 ms, the slow instance's stream (entries not yet
finished), its effective credit limit and its credits in use.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app
from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from broker.client import Client, result_from_fields
from broker.connection import Connection
from broker.envelope import Envelope
from broker.records import InstanceCard
from broker.registry import Registry
from broker.store import MessageStore
from workers.dispatcher import Dispatcher

CAPABILITY = "incident.answer"
FAST, SLOW = "fast-1", "slow-1"
SAMPLE_EVERY_S = 0.02


@dataclass(frozen=True)
class IncidentPlan:
    adaptive: bool = True
    max_inflight: int = 8
    rate_per_s: float = 40.0
    before_s: float = 5.0
    after_s: float = 8.0
    normal_ms: float = 20.0
    slow_ms: float = 2000.0
    warmup_s: float = 1.0  # requests submitted before this are left out of latency figures


@dataclass(frozen=True)
class Sample:
    t_s: float
    stream: int
    effective: int
    in_use: int


@dataclass(frozen=True)
class Served:
    message_id: str
    instance: str
    submitted_s: float
    latency_ms: float


@dataclass
class IncidentRun:
    plan: IncidentPlan
    switch_s: float
    samples: list[Sample] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)

    def limit_fell_after_s(self) -> float | None:
        """Seconds from the slowdown to the first sample with a lower effective limit."""
        for s in self.samples:
            if s.t_s >= self.switch_s and s.effective < self.plan.max_inflight:
                return s.t_s - self.switch_s
        return None

    def peak_stream(self) -> int:
        return max((s.stream for s in self.samples), default=0)

    def latencies(self, *, instance: str | None = None, after: bool | None = None) -> list[float]:
        return [
            s.latency_ms
            for s in self.served
            if s.submitted_s >= self.plan.warmup_s
            and (instance is None or s.instance == instance)
            and (after is None or (s.submitted_s >= self.switch_s) == after)
        ]

    def share_after(self) -> dict[str, float]:
        """Share of the requests submitted after the slowdown, per instance."""
        after = [s for s in self.served if s.submitted_s >= self.switch_s]
        return {i: sum(s.instance == i for s in after) / max(1, len(after)) for i in (FAST, SLOW)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def agent_app(delays: dict[str, float], name: str) -> Starlette:
    async def handle(request: Request) -> Response:
        await request.body()
        await anyio.sleep(delays[name])
        return JSONResponse({"agent": name})

    return Starlette(routes=[Route("/", handle, methods=["POST"])])


class Incident:
    """One run: agents, sidecars and a dispatcher; a producer at a steady rate; a watcher."""

    def __init__(self, conn: Connection, plan: IncidentPlan) -> None:
        self.conn = conn
        self.plan = plan
        self.client = Client(conn)
        self.reply_to = self.client.new_reply_stream()
        self.delays = {FAST: plan.normal_ms / 1000, SLOW: plan.normal_ms / 1000}
        self.total = int(plan.rate_per_s * (plan.before_s + plan.after_s))
        self.run = IncidentRun(plan, switch_s=plan.before_s)
        self.submitted: dict[str, float] = {}
        self.answered: dict[str, float] = {}
        self.started = 0.0

    def clock(self) -> float:
        return anyio.current_time() - self.started

    async def produce(self) -> None:
        plan = self.plan
        for n in range(self.total):
            due = n / plan.rate_per_s
            await anyio.sleep(max(0.0, due - self.clock()))
            if due >= plan.before_s:
                self.delays[SLOW] = plan.slow_ms / 1000  # the model behind one agent slows
            raw = msgspec.json.encode(
                {"capability": CAPABILITY, "reply_to": self.reply_to, "payload": {"n": n}}
            )
            envelope = msgspec.json.decode(raw, type=Envelope)
            self.submitted[await self.client.submit(envelope)] = self.clock()

    async def collect(self) -> None:
        last = "0"
        async with self.conn.reader() as reader:
            while len(self.answered) < self.total:
                for entry_id, fields in await reader.read_stream(self.reply_to, last, block_ms=500):
                    last = entry_id
                    self.answered.setdefault(result_from_fields(fields).id, self.clock())

    async def watch(self) -> None:
        registry = Registry(self.conn)
        while True:
            credits = await self.conn.call("HGET", self.conn.keys.card(SLOW), "credits")
            in_use = await self.conn.call("SCARD", self.conn.keys.inflight(SLOW))
            (stream,) = await registry.stream_backlogs([SLOW])
            self.run.samples.append(Sample(self.clock(), stream, int(credits or 0), int(in_use)))
            await anyio.sleep(SAMPLE_EVERY_S)

    async def start_instance(self, tg: TaskGroup, instance_id: str, url: str) -> HttpTransport:
        transport = HttpTransport(url, timeout_s=30.0, max_connections=self.plan.max_inflight)
        card = InstanceCard(
            agent_id=instance_id.split("-")[0],
            instance_id=instance_id,
            capabilities=(CAPABILITY,),
            endpoint=url,
            max_inflight=self.plan.max_inflight,
        )
        sidecar = Sidecar(
            self.conn, card, transport, grace_s=5.0, adaptive_credits=self.plan.adaptive
        )
        await tg.start(sidecar.run)
        return transport

    async def __call__(self) -> IncidentRun:
        async with (
            serve_app(agent_app(self.delays, FAST)) as fast_url,
            serve_app(agent_app(self.delays, SLOW)) as slow_url,
            anyio.create_task_group() as tg,
        ):
            transports = [
                await self.start_instance(tg, FAST, fast_url),
                await self.start_instance(tg, SLOW, slow_url),
            ]
            await tg.start(Dispatcher(self.conn, consumer="incident").run)
            self.started = anyio.current_time()
            tg.start_soon(self.watch)
            async with anyio.create_task_group() as load:
                load.start_soon(self.produce)
                load.start_soon(self.collect)
            tg.cancel_scope.cancel()
        for transport in transports:
            await transport.aclose()
        ids = list(self.submitted)
        for message_id, record in zip(
            ids, await MessageStore(self.conn).get_records(ids), strict=True
        ):
            assert record is not None
            sent, answered = self.submitted[message_id], self.answered[message_id]
            self.run.served.append(
                Served(message_id, record.instance, sent, (answered - sent) * 1000)
            )
        return self.run


async def run_incident(conn: Connection, plan: IncidentPlan) -> IncidentRun:
    return await Incident(conn, plan)()
