"""``agent-reach demo``: the whole system on the embedded Redis, with a report.

Three demo HTTP agents of different speed and failure rate, each behind a sidecar, a broker
in the same process, a burst of requests with live progress, and a report computed from the
message records: delivered, failed, waiting, latency percentiles, each agent's share, and
"lost", counted — never assumed — as submitted ids whose record is missing or neither
terminal nor visibly parked.

The demo works under a key prefix of its own and removes every key of it when it ends —
normally, on an error, on Ctrl-C — so running it leaves the user's Redis as it found it.
"""

from __future__ import annotations

import logging
import random
import signal
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app
from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.errors import ReachError
from broker.records import InstanceCard, MessageRecord
from broker.replies import answer_in
from broker.stages import PARKED, TERMINAL, Stage
from broker.store import MessageStore

from .dispatcher import Dispatcher
from .runtime import connected

CAPABILITY = "demo.echo"
T = TypeVar("T")
# Keys removed per round trip, and how long the removal may take however the demo ended.
REMOVE_BATCH = 1000
REMOVE_TIMEOUT_S = 60.0

log = logging.getLogger("agent_reach.demo")


@dataclass(frozen=True)
class DemoAgent:
    name: str
    delay_s: float
    fail_rate: float
    max_inflight: int


DEMO_AGENTS = (
    DemoAgent("swift", 0.005, 0.0, 16),
    DemoAgent("steady", 0.020, 0.01, 16),
    DemoAgent("sluggish", 0.080, 0.05, 8),
)


def demo_agent_app(delay_s: float, fail_rate: float, *, seed: int = 7) -> Starlette:
    """An agent that echoes its payload after ``delay_s``; answers 500 at ``fail_rate``."""
    rng = random.Random(seed)

    async def handle(request: Request) -> Response:
        envelope = await request.json()
        await anyio.sleep(delay_s)
        if rng.random() < fail_rate:
            return JSONResponse({"error": "simulated failure"}, status_code=500)
        return JSONResponse({"echo": envelope.get("payload")})

    return Starlette(routes=[Route("/", handle, methods=["POST"])])


async def serve_demo_agent(host: str, port: int, delay_s: float, fail_rate: float) -> None:
    async with serve_app(demo_agent_app(delay_s, fail_rate), host, port) as url:
        print(f"demo agent listening on {url}", flush=True)
        await anyio.sleep_forever()


async def run_demo(settings: Settings, messages: int, timeout_s: float) -> int:
    """Run the demo and print its report; returns the number of lost messages. Every key
    under ``settings.prefix`` is removed when it ends, however it ends: give it a prefix of
    its own."""
    console = Console()
    async with connected(settings) as conn:
        try:
            ids, records = await _until_stopped(_run(conn, messages, timeout_s, console))
        finally:
            await remove_demo_keys(conn)
    return print_report(console, ids, records)


async def _until_stopped(work: Awaitable[T]) -> T:
    """``work``, cancelled by SIGTERM or SIGHUP as by Ctrl-C (``timeout``, ``docker stop``
    and a closed terminal send those): the demo's keys are removed however it is stopped."""
    outcome: list[T] = []

    async def run_it(scope: anyio.CancelScope) -> None:
        outcome.append(await work)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_it, tg.cancel_scope)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            async for _ in signals:
                raise KeyboardInterrupt  # stopped: as Ctrl-C is, with the same cleanup
    return outcome[0]


async def _run(
    conn: Connection, messages: int, timeout_s: float, console: Console
) -> tuple[list[str], dict[str, MessageRecord | None]]:
    async with anyio.create_task_group() as tg:
        for agent in DEMO_AGENTS:
            await tg.start(_run_agent, conn, agent)
        await tg.start(Dispatcher(conn, consumer="demo").run)
        client = Client(conn)
        reply_to = client.new_reply_stream()
        ids = await _burst(client, reply_to, messages)
        await _follow(conn, reply_to, ids, timeout_s, console)
        records = await _records(conn, ids)
        tg.cancel_scope.cancel()
    return ids, records


async def remove_demo_keys(conn: Connection) -> None:
    """Remove every key of the demo's prefix. Shielded, so a Ctrl-C that cancelled the demo
    does not cancel its cleaning up; bounded in time; a failure is said, not raised, so it
    cannot hide the error that ended the demo."""
    pattern = f"{conn.keys.prefix}:*"  # prefixes hold no glob characters (config checks)
    with anyio.move_on_after(REMOVE_TIMEOUT_S, shield=True) as scope:
        try:
            await _unlink_matching(conn, pattern)
        except ReachError as exc:
            log.warning("could not remove the demo's keys (%s): %s", pattern, exc)
    if scope.cancelled_caught:
        log.warning("removing the demo's keys (%s) took over %g s", pattern, REMOVE_TIMEOUT_S)


async def _unlink_matching(conn: Connection, pattern: str) -> None:
    cursor = b"0"
    while True:
        cursor, keys = await conn.call("SCAN", cursor, "MATCH", pattern, "COUNT", REMOVE_BATCH)
        if keys:
            await conn.call("UNLINK", *keys)
        if cursor == b"0":
            return


async def _run_agent(
    conn: Connection, agent: DemoAgent, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    async with serve_app(demo_agent_app(agent.delay_s, agent.fail_rate)) as url:
        transport = HttpTransport(url, timeout_s=5.0, max_connections=agent.max_inflight)
        card = InstanceCard(
            agent_id=agent.name,
            instance_id=f"{agent.name}-1",
            capabilities=(CAPABILITY,),
            endpoint=url,
            max_inflight=agent.max_inflight,
        )
        try:
            await Sidecar(conn, card, transport, grace_s=5.0).run(task_status=task_status)
        finally:
            await transport.aclose()


async def _burst(client: Client, reply_to: str, messages: int) -> list[str]:
    envelopes = [
        Envelope(
            capability=CAPABILITY,
            reply_to=reply_to,
            timeout_s=600,
            payload=msgspec.Raw(msgspec.json.encode({"n": n})),
        )
        for n in range(messages)
    ]
    ids: list[str] = []
    for start in range(0, messages, 500):
        ids += await client.submit_many(envelopes[start : start + 500])
    return ids


async def _follow(
    conn: Connection, reply_to: str, ids: list[str], timeout_s: float, console: Console
) -> None:
    """Live progress from the reply stream until every message has answered (or timeout)."""
    wanted = set(ids)
    answered: set[str] = set()
    columns = (TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("requests", total=len(ids))
        last = "0"
        async with conn.reader() as reader:
            with anyio.move_on_after(timeout_s):
                while answered < wanted:
                    for entry_id, fields in await reader.read_stream(reply_to, last, block_ms=500):
                        last = entry_id
                        answer = answer_in(fields)
                        if answer is not None:
                            answered.add(answer.id)
                    progress.update(task, completed=len(answered & wanted))
    await conn.call("DEL", reply_to)


async def _records(conn: Connection, ids: list[str]) -> dict[str, MessageRecord | None]:
    store = MessageStore(conn)
    return {message_id: await store.get_record(message_id) for message_id in ids}


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def print_report(console: Console, ids: list[str], records: dict[str, MessageRecord | None]) -> int:
    stages = Counter(r.stage if r else None for r in records.values())
    lost = sum(
        1 for r in records.values() if r is None or not (r.stage in TERMINAL or r.stage in PARKED)
    )
    finished = [r for r in records.values() if r and r.stage in TERMINAL]
    latencies = sorted(float(r.updated_ms - r.accepted_ms) for r in finished)
    share = Counter(r.instance for r in finished)
    retried = sum(1 for r in finished if r.attempt > 1)

    table = Table(title="agent-reach demo report", show_header=False)
    table.add_row("submitted", str(len(ids)))
    table.add_row("delivered (SUCCEEDED)", str(stages[Stage.SUCCEEDED]))
    table.add_row("failed by the agent (FAILED)", str(stages[Stage.FAILED]))
    table.add_row("waiting / parked", str(sum(stages[s] for s in PARKED)))
    table.add_row("retried", str(retried))
    table.add_row(
        "latency p50 / p95 / p99",
        " / ".join(f"{percentile(latencies, q):.0f} ms" for q in (0.5, 0.95, 0.99)),
    )
    for instance, count in sorted(share.items()):
        table.add_row(f"share {instance}", f"{count} ({count / max(len(finished), 1):.0%})")
    table.add_row("lost", f"[bold]{lost}[/bold]")
    console.print(table)
    return lost
