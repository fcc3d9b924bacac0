"""CPU time per message in each process, at a steady light load: what a message costs the
dispatcher, the sidecar and Redis when nothing batches it.

One fresh redis-server on loopback, ``agent-reach up`` and one sidecar (``--python``, a
no-op handler) as processes of their own, as the anchors harness runs them. After a warm-up,
``--messages`` envelopes are submitted one at a time at ``--rate`` per second; the bench
waits until the last has SUCCEEDED and reads each process's user + system CPU time
(``/proc/<pid>/stat``) before and after. At 200 messages a second each message is handled
alone, so this is the fixed cost of a message: round trips, wake-ups, Python objects — what
the latency stage's p50 and p99 are made of, and what batching hides at saturation.

Also prints Redis's commands per message (``INFO commandstats``, scripts counted as
``evalsha`` and the commands they run under their own names), and Redis's own time in the
scripts a message (``server µs in scripts``: ``evalsha``'s ``usec``, the commands they run
included).

With ``--burst`` the envelopes are submitted all at once instead, 100 concurrent submits at a
time (as the harness's throughput stage does): the cost of a message at saturation, where
batches are as large as the load makes them, and the rate the three processes reach
(``messages/s``; this process, the producer, shares the two cores with them).
``--inflight`` sets the sidecar's credits (default 8, the sidecar's own default; the anchors
harness runs 100): with fewer credits than the burst, the work beyond them waits in the
waiting set and is claimed as credits free, and ``calls zadd`` shows how much of it did.

With ``--by-script`` Redis logs every call while the messages run (``SLOWLOG`` at 0 µs), and
the bench prints each script's calls and Redis's time in it (its commands included) per
message. The log costs Redis time of its own on every call, so those figures read higher
than ``server µs in scripts`` without it: read them as shares. Redis keeps each call's entry
(about 26 a message) until the end: a few thousand messages are enough.

Usage: ``python -m bench.cpu_cost [--messages 3000] [--rate 200] [--reps 1] [--burst]
[--inflight 8] [--by-script]``.
Figures only, no threshold: CI never runs it. Compare two commits by running it in each,
interleaved.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec

from adapters.python import Agent
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope

from .profile import commandstats, log_every_call, logged_script_times
from .servers import discard, throwaway_server

CAPABILITY = "bench.cost"
REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
# Redis's log entries kept a message with --by-script: every call, the scripts' own commands
# included, is about 26 at saturation; more room than that, so none is pushed out (a log
# that fills anyway is refused: bench.profile.logged_script_times)
LOGGED_PER_MESSAGE = 40

agent = Agent("cost")


@agent.handler(CAPABILITY)
async def noop(envelope: Envelope) -> None:
    """Nothing: the cost measured is the broker's."""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def spawn(url: str, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AGENT_REACH_REDIS_URL": url, "PYTHONPATH": str(REPO)}
    command = [str(Path(sys.executable).parent / "agent-reach"), *args]
    return subprocess.Popen(
        command, env=env, cwd=REPO, start_new_session=True, stderr=subprocess.DEVNULL
    )


def spawn_both(url: str, inflight: int) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """``agent-reach up``, then one sidecar of the no-op agent with ``inflight`` credits."""
    up = spawn(url, "up")
    sidecar = spawn(
        url,
        *("sidecar", "--agent-id", "cost", "--instance-id", "cost-1"),
        *("--capability", CAPABILITY, "--python", "bench.cpu_cost:noop_agent"),
        *("--max-inflight", str(inflight)),
    )
    return up, sidecar


def stop(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


async def calls(conn: Connection) -> dict[str, tuple[int, int]]:
    """Redis's calls so far and its time in them (µs), by command (``INFO commandstats``)."""
    return commandstats((await conn.call("INFO", "commandstats")).decode())


async def paced(client: Client, count: int, rate: float) -> str:
    """Submit ``count`` envelopes one at a time at ``rate`` a second; the last one's id."""
    start = time.perf_counter()
    last = ""
    for i in range(count):
        if (pause := start + i / rate - time.perf_counter()) > 0:
            await anyio.sleep(pause)
        last = await client.submit(Envelope(capability=CAPABILITY, payload=msgspec.Raw(b"{}")))
    return last


async def burst(client: Client, count: int, batch: int = 100) -> None:
    """Submit ``count`` envelopes as fast as ``batch`` concurrent submits go (as the anchors
    harness's throughput stage does)."""

    async def submit() -> None:
        await client.submit(Envelope(capability=CAPABILITY, payload=msgspec.Raw(b"{}")))

    for start in range(0, count, batch):
        async with anyio.create_task_group() as tg:
            for _ in range(min(batch, count - start)):
                tg.start_soon(submit)


async def succeeded(conn: Connection, message_id: str) -> None:
    with anyio.fail_after(60):
        while await conn.call("HGET", conn.keys.record(message_id), "stage") != b"SUCCEEDED":  # noqa: ASYNC110 - polled
            await anyio.sleep(0.01)


async def finished(conn: Connection) -> int:
    """How many messages of the bench's capability have SUCCEEDED (the counters)."""
    field = f"finished\t{CAPABILITY}\tSUCCEEDED"
    return int(await conn.call("HGET", conn.counting().key or "", field) or 0)


async def all_succeeded(conn: Connection, count: int) -> None:
    with anyio.fail_after(120):
        while await finished(conn) < count:  # noqa: ASYNC110 - polled, with a deadline
            await anyio.sleep(0.01)


async def one_run(args: argparse.Namespace) -> dict[str, float]:
    server = throwaway_server("reach-cost-")
    up, sidecar = spawn_both(server.url, args.inflight)
    try:
        settings = build_settings([{"redis_url": server.url}])
        async with open_connection(settings, server.url) as conn:
            client = Client(conn)
            await succeeded(conn, await paced(client, int(args.rate), args.rate))  # 1 s warm-up
            pids = {"dispatcher (up)": up.pid, "sidecar": sidecar.pid, "redis": server.process.pid}
            before = {name: cpu_s(pid) for name, pid in pids.items()}
            stats_before = await calls(conn)
            logged_most = LOGGED_PER_MESSAGE * args.messages
            if args.by_script:
                await log_every_call(conn, logged_most)
            began, done = time.perf_counter(), await finished(conn)
            if args.burst:
                await burst(client, args.messages)
                await all_succeeded(conn, done + args.messages)
            else:
                await succeeded(conn, await paced(client, args.messages, args.rate))
            took_s = time.perf_counter() - began
            after = {name: cpu_s(pid) for name, pid in pids.items()}
            stats = await calls(conn)
            by_script = await logged_script_times(conn, logged_most) if args.by_script else {}
    finally:
        stop(sidecar)
        stop(up)
        discard(server)
    row = {name: (after[name] - before[name]) * 1e6 / args.messages for name in pids}
    row["messages/s"] = args.messages / took_s
    per = {k: (n - stats_before.get(k, (0, 0))[0]) / args.messages for k, (n, _) in stats.items()}
    row.update({f"calls {k}": v for k, v in per.items() if v >= 0.05})
    in_scripts = stats.get("evalsha", (0, 0))[1] - stats_before.get("evalsha", (0, 0))[1]
    row["server µs in scripts"] = in_scripts / args.messages
    for script, (count, usec) in by_script.items():
        row[f"calls {script} (script)"] = count / args.messages
        row[f"server µs in {script} (logged)"] = usec / args.messages
    return row


noop_agent = agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--burst",
        action="store_true",
        help="submit all at once (100 concurrent submits at a time): saturation, not --rate",
    )
    parser.add_argument(
        "--inflight", type=int, default=8, help="the sidecar's credits (its --max-inflight)"
    )
    parser.add_argument(
        "--by-script",
        action="store_true",
        help="log every Redis call (SLOWLOG at 0 µs): each script's share of Redis's time",
    )
    args = parser.parse_args()
    if args.inflight < 1:
        parser.error("--inflight must be at least 1")
    if args.messages < 1:
        parser.error("--messages must be at least 1")
    how = "in a burst" if args.burst else f"one at a time at {args.rate:g}/s"
    print(f"{args.messages} messages {how}, no-op python agent, {args.inflight} credits")
    rows = []
    for rep in range(args.reps):
        rows.append(row := anyio.run(one_run, args))
        cpu = ", ".join(
            f"{k} {v:.0f}" for k, v in row.items() if not k.startswith(("calls", "server"))
        )
        print(f"  run {rep + 1}: CPU per message: {cpu}", flush=True)
    keys = sorted({k for r in rows for k in r})
    print("median per message:")
    for key in keys:
        value = statistics.median(r.get(key, 0.0) for r in rows)
        unit = "" if key.startswith(("calls", "server")) or key == "messages/s" else " µs CPU"
        print(f"  {key:>36} {value:8.2f}{unit}")


if __name__ == "__main__":
    main()
