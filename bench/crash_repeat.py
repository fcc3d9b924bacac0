"""What a SIGKILL of a saturated sidecar costs in repeated work, and why.

The anchors harness's ``kill`` stage, instrumented: one fresh redis-server on loopback,
``agent-reach up`` and one idempotent sidecar (``--python``, ``--max-inflight 100``) as
processes of their own; ``--messages`` tasks whose body marks its start, works ``--work-ms``
and marks its end (one round trip to the same Redis, as the harness's body). When
``--kill-at`` bodies have ended, the sidecar's process group is SIGKILLed and, before it is
restarted, the bench reads what the kill left:

* running: bodies started and not ended — cut short, so they never count as run twice;
* unrecorded: bodies ended whose message is still PROCESSING — finished, outcome not yet on
  the record: the work a restart repeats;
* oldest ms: how long before the kill the oldest of those had ended — the window between a
  call ending and its outcome being on the record, which ``adapters/finisher.py`` keeps to
  about one recording round (the intake reads no new work while more than
  ``UNRECORDED_MAX`` outcomes wait).

Then it restarts the sidecar, waits until every message has SUCCEEDED, and counts the bodies
that ended twice (the harness's figure): the unrecorded count, if the instrument is right.
Last, how many runs repeated at most the calls running at the kill plus one batch (a
dispatcher reads ``ingress_batch`` entries at a time and assigns those that find a credit
together): the issue's yardstick, compared as counts — an observation of how the stages
overlap, not a bound anything enforces.

Usage: ``python -m bench.crash_repeat [--reps 3] [--messages 2000] [--kill-at 800]``. No
threshold: CI never runs it.
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
from typing import Any

import anyio
import msgspec
from redis.asyncio import Redis

from adapters.finisher import UNRECORDED_MAX
from adapters.python import Agent
from bench.servers import discard, throwaway_server
from broker.client import Client
from broker.config import build_settings, load_settings
from broker.connection import open_connection
from broker.envelope import Envelope

CAPABILITY = "bench.crash"
STARTED, ENDED, ENDED_AT, DONE = "crash:started", "crash:ended", "crash:ended_at", "crash:done"
REPO = Path(__file__).resolve().parent.parent

agent = Agent("crash")
_redis: Redis | None = None


@agent.handler(CAPABILITY)
async def body(envelope: Envelope) -> None:
    """Marks its start, works, marks its end: counted per task like the harness's body."""
    global _redis
    if _redis is None:
        _redis = Redis.from_url(os.environ["AGENT_REACH_REDIS_URL"], max_connections=1000)
    task = envelope.payload_json()
    await _redis.hincrby(STARTED, str(task["i"]), 1)
    await anyio.sleep(task["work_ms"] / 1000)
    pipe = _redis.pipeline(transaction=False)
    pipe.hincrby(ENDED, str(task["i"]), 1)
    pipe.hset(ENDED_AT, str(task["i"]), repr(time.time()))
    pipe.incr(DONE)
    await pipe.execute()


def spawn(url: str, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AGENT_REACH_REDIS_URL": url, "PYTHONPATH": str(REPO)}
    command = [str(Path(sys.executable).parent / "agent-reach"), *args]
    return subprocess.Popen(
        command, env=env, cwd=REPO, start_new_session=True, stderr=subprocess.DEVNULL
    )


def sidecar(url: str, inflight: int) -> subprocess.Popen[bytes]:
    return spawn(
        url,
        "sidecar",
        "--agent-id",
        "crash",
        "--instance-id",
        "crash-1",
        "--capability",
        CAPABILITY,
        "--python",
        "bench.crash_repeat:agent",
        "--max-inflight",
        str(inflight),
        "--idempotent",
    )


def kill(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


async def counts(redis: Redis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(key)).items()}  # type: ignore[misc]


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    server = throwaway_server("reach-crash-")
    up = spawn(server.url, "up")
    worker = sidecar(server.url, args.inflight)
    redis = Redis.from_url(server.url)
    try:
        settings = build_settings([{"redis_url": server.url}])
        async with open_connection(settings, server.url) as conn:
            client = Client(conn)
            tasks = [
                Envelope(
                    capability=CAPABILITY,
                    payload=msgspec.Raw(msgspec.json.encode({"i": i, "work_ms": args.work_ms})),
                )
                for i in range(args.messages)
            ]
            ids = await client.submit_many(tasks)
            with anyio.fail_after(120):
                while int(await redis.get(DONE) or 0) < args.kill_at:  # noqa: ASYNC110 - polled
                    await anyio.sleep(0.002)
            killed_at = time.time()
            kill(worker)
            started, ended = await counts(redis, STARTED), await counts(redis, ENDED)
            ended_at = {k.decode(): float(v) for k, v in (await redis.hgetall(ENDED_AT)).items()}  # type: ignore[misc]
            stages = await conn.call_many([("HGET", conn.keys.record(m), "stage") for m in ids])
            waited = [
                (killed_at - ended_at[str(i)]) * 1000
                for i, s in enumerate(stages)
                if s == b"PROCESSING" and str(i) in ended
            ]
            running = sum(1 for i in started if i not in ended)
            done_at_kill = len(ended)
            worker = sidecar(server.url, args.inflight)
            with anyio.fail_after(300):
                while True:
                    stages = await conn.call_many(
                        [("HGET", conn.keys.record(m), "stage") for m in ids]
                    )
                    if all(s == b"SUCCEEDED" for s in stages):
                        break
                    await anyio.sleep(0.25)
            ended = await counts(redis, ENDED)
    finally:
        kill(worker)
        up.terminate()
        up.wait()
        await redis.aclose()
        discard(server)
    return {
        "done at kill": done_at_kill,
        "running": running,
        "unrecorded": len(waited),
        "oldest ms": round(max(waited, default=0.0), 1),
        "ran twice": sum(1 for n in ended.values() if n >= 2),
        "never ran": args.messages - len(ended),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--kill-at", type=int, default=800)
    parser.add_argument("--work-ms", type=float, default=10.0)
    parser.add_argument("--inflight", type=int, default=100)
    args = parser.parse_args()
    print(
        f"{args.messages} tasks of {args.work_ms:g} ms, idempotent sidecar with"
        f" {args.inflight} in flight, SIGKILLed at {args.kill_at} done;"
        f" outcomes waiting before the intake holds back: {UNRECORDED_MAX}"
    )
    rows = []
    for rep in range(args.reps):
        row = anyio.run(one_run, args)
        rows.append(row)
        print(f"  run {rep + 1}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        time.sleep(0.5)
    for key in ("running", "unrecorded", "oldest ms", "ran twice"):
        print(f"  median {key}: {statistics.median(r[key] for r in rows):g}")
    batch = load_settings().ingress_batch  # as the processes it spawns read it
    within = sum(1 for r in rows if r["ran twice"] <= r["running"] + batch)
    print(
        f"  runs whose repeats stayed within the calls running plus one batch"
        f" (ingress_batch {batch}): {within} of {len(rows)}"
    )


if __name__ == "__main__":
    main()
