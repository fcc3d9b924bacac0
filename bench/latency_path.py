"""Where a message's latency goes at a light load: the time between the stages that reach
Redis, read off Redis's own clock.

One fresh redis-server on loopback, ``agent-reach up`` and one sidecar (``--python``, an
agent whose body sends one ``ECHO`` of its message id on a connection of its own) as
processes of their own, as the anchors harness runs them. After a warm-up, ``--messages``
envelopes are submitted one at a time at ``--rate`` per second while a ``MONITOR``
connection reads every command Redis runs, with the time it ran it. For each message:

- ``enqueue → XADD``: the producer's ``Client.submit`` until its ``XADD`` runs (this
  process's clock against Redis's: one machine, one clock);
- ``XADD → acceptance``: the dispatcher's wake-up on its blocking read, its intake and
  routing, until its acceptance script runs;
- ``acceptance → RECEIVED+PROCESSING``: the script, the sidecar's wake-up on its blocking
  read, until the script that writes RECEIVED and PROCESSING runs (its first ``HSET`` of
  either stage — one write of both since they share it — which ``MONITOR`` shows from
  ``lua``: the sidecar's take script names no message);
- ``RECEIVED+PROCESSING → body``: that script's answer back in the sidecar, the job's
  start, the agent call, until the body's ``ECHO`` runs;

and the sum, enqueue to body. ``MONITOR`` costs Redis a write per command to the monitor
connection, so every figure is a little higher than without it; compare runs of this bench
with each other (two commits: run it in each, interleaved), not with the anchors harness.

Same-run baseline, before ``MONITOR`` starts: a ``PING`` round trip to the same Redis, back
to back and after the pause between two messages (``1 / --rate``). The second is what a hop
costs when the processes on both ends were idle (a wake-up on each end: the path's floor per
process it crosses); the first, the same round trip with both ends awake.

Usage: ``python -m bench.latency_path [--messages 2000] [--rate 200] [--reps 1]
[--no-direct-lane]``. Figures only, no threshold: CI never runs it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import time

import anyio
import msgspec

from adapters.python import Agent
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.keyspace import direct_lane
from broker.resp import RespConnection

from .cpu_cost import spawn, stop, succeeded
from .servers import discard, throwaway_server

CAPABILITY = "bench.path"
HOPS = (
    "enqueue → XADD",
    "XADD → acceptance",
    "acceptance → RECEIVED+PROCESSING",
    "RECEIVED+PROCESSING → body",
)
Figures = dict[str, list[float]]  # milliseconds by hop (or by baseline)
# `<time> [<db> <client>] "<COMMAND>" ...`: the commands a script runs say `lua`
_LINE = re.compile(r'([\d.]+) \[\d+ ([^\]]+)\] "(\w+)"(.*)')
_ID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
_SIDECAR_STAGE = re.compile(r"\"stage\" \"(?:RECEIVED|PROCESSING)\"")

agent = Agent("path")
_body_conn: list[RespConnection] = []
_body_lock = anyio.Lock()  # one connection, one command on it at a time


@agent.handler(CAPABILITY)
async def body(envelope: Envelope) -> None:
    """One command that names the message: when the body started, on Redis's clock."""
    async with _body_lock:
        if not _body_conn:
            _body_conn.append(await RespConnection.open(os.environ["AGENT_REACH_REDIS_URL"]))
        await _body_conn[0].execute([("ECHO", f"body {envelope.id}")])


path_agent = agent


async def monitor(url: str, lines: list[str], started: anyio.Event) -> None:
    """Every command Redis runs, as ``MONITOR`` prints it, until cancelled."""
    conn = await RespConnection.open(url)
    try:
        await conn.execute([("MONITOR",)])
        started.set()
        while True:
            reply = await conn.read_one()
            lines.append(reply.decode(errors="replace") if isinstance(reply, bytes) else reply)
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()


async def paced(client: Client, count: int, rate: float, sent: dict[str, float]) -> str:
    """Submit ``count`` envelopes at ``rate`` a second, noting when each enqueue began."""
    start = time.perf_counter()
    last = ""
    for i in range(count):
        if (pause := start + i / rate - time.perf_counter()) > 0:
            await anyio.sleep(pause)
        began = time.time()
        last = await client.submit(Envelope(capability=CAPABILITY, payload=msgspec.Raw(b"{}")))
        sent[last] = began
    return last


def stage_times(lines: list[str], sent: dict[str, float]) -> dict[str, list[float]]:
    """Each message's first XADD, its first script (the acceptance), the write of RECEIVED
    (with PROCESSING, or before it) and its body's ECHO, as gaps in milliseconds."""
    seen: dict[str, list[tuple[float, str, str]]] = {}
    for line in lines:
        if not (m := _LINE.match(line)):
            continue
        command = m[3].upper()
        if m[2] == "lua":  # of the commands scripts run, only the sidecar's stage write counts
            if command != "HSET" or not _SIDECAR_STAGE.search(m[4]):
                continue
            command = "RECEIVED"
        for message_id in set(_ID.findall(m[4])):
            if message_id in sent:
                seen.setdefault(message_id, []).append((float(m[1]), m[2], command))
    gaps: dict[str, list[float]] = {hop: [] for hop in (*HOPS, "enqueue → body")}
    for message_id, events in seen.items():
        times = _stages(events)
        if times is None:
            continue
        points = [sent[message_id], *times]
        for hop, (a, b) in zip(HOPS, itertools.pairwise(points), strict=True):
            gaps[hop].append((b - a) * 1000)
        gaps["enqueue → body"].append((points[-1] - points[0]) * 1000)
    return gaps


def _stages(events: list[tuple[float, str, str]]) -> list[float] | None:
    accept_at = next((t for t, _, c in events if c == "EVALSHA"), None)
    # down the direct lane the producer's script is both its write and the acceptance
    xadd = next((t for t, _, c in events if c == "XADD"), accept_at)
    receive_at = next((t for t, _, c in events if c == "RECEIVED"), None)
    echo = next((t for t, _, c in events if c == "ECHO"), None)
    if xadd is None or accept_at is None or receive_at is None or echo is None:
        return None
    return [xadd, accept_at, receive_at, echo]


async def published(conn: Connection) -> None:
    """Until ``up`` has published the capability's direct lane (at most 30 s)."""
    with anyio.fail_after(30):
        while await conn.call("GET", direct_lane(conn.keys, CAPABILITY)) is None:  # noqa: ASYNC110 - a key another process writes
            await anyio.sleep(0.05)


async def round_trips(url: str, count: int, pause_s: float) -> list[float]:
    """``count`` ``PING`` round trips (ms), each after ``pause_s`` of quiet (none: at once)."""
    conn = await RespConnection.open(url)
    times = []
    try:
        for _ in range(count):
            if pause_s:
                await anyio.sleep(pause_s)  # what is measured: a round trip after quiet
            began = time.perf_counter()
            await conn.execute([("PING",)])
            times.append((time.perf_counter() - began) * 1000)
    finally:
        await conn.close()
    return times


async def one_run(args: argparse.Namespace) -> tuple[Figures, Figures]:
    server = throwaway_server("reach-path-")
    up = spawn(server.url, "up")
    sidecar = spawn(
        server.url,
        *("sidecar", "--agent-id", "path", "--instance-id", "path-1"),
        *("--capability", CAPABILITY, "--python", "bench.latency_path:path_agent"),
        "--max-inflight",
        "100",
    )
    lines: list[str] = []
    sent: dict[str, float] = {}
    try:
        settings = build_settings([{"redis_url": server.url}])
        async with open_connection(settings, server.url) as conn:
            if args.direct_lane:  # the producer's first look finds it, not a missing one
                await published(conn)
            client = Client(conn)
            await succeeded(conn, await paced(client, int(args.rate), args.rate, {}))  # warm-up
            count = max(200, int(args.rate))
            baseline = {
                "back to back": await round_trips(server.url, count, 0.0),
                "after the pause between messages": await round_trips(
                    server.url, count, 1 / args.rate
                ),
            }
            async with anyio.create_task_group() as tg:
                started = anyio.Event()
                tg.start_soon(monitor, server.url, lines, started)
                await started.wait()
                await succeeded(conn, await paced(client, args.messages, args.rate, sent))
                tg.cancel_scope.cancel()
    finally:
        stop(sidecar)
        stop(up)
        discard(server)
    return stage_times(lines, sent), baseline


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--direct-lane",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run `up` with direct_lane on (the default: the producer assigns down the lane "
        "itself, its script both its write and the acceptance: the second hop reads 0) or off",
    )
    args = parser.parse_args()
    # for `up`; the producer finds lanes
    os.environ["AGENT_REACH_DIRECT_LANE"] = str(args.direct_lane).lower()
    if args.messages < 1 or args.rate <= 0:
        parser.error("--messages must be at least 1 and --rate above 0")
    print(f"{args.messages} messages one at a time at {args.rate:g}/s, ms on Redis's clock")
    for rep in range(args.reps):
        gaps, baseline = anyio.run(one_run, args)
        counted = len(gaps["enqueue → body"])
        print(f"  run {rep + 1} ({counted} of {args.messages} messages seen at every stage):")
        for hop, values in gaps.items():
            print(f"    {hop:>34}  {spread(values)}")
        print("    baseline: a PING round trip to the same Redis, before MONITOR")
        for when, values in baseline.items():
            print(f"    {when:>34}  {spread(values)}")
        idle = percentile(baseline["after the pause between messages"], 0.5)
        whole = percentile(gaps["enqueue → body"], 0.5)
        print(f"    {'enqueue → body, p50':>34}  {whole / idle:.1f} idle round trips")


def spread(values: list[float]) -> str:
    p50, p90, p99 = (percentile(values, q) for q in (0.5, 0.9, 0.99))
    mean = statistics.fmean(values) if values else float("nan")
    return f"p50 {p50:6.3f}  p90 {p90:6.3f}  p99 {p99:6.3f}  mean {mean:6.3f}"


if __name__ == "__main__":
    main()
