"""Where the time per message goes: Redis commands and round trips, and Python functions.

One fresh redis-server; ``--messages`` envelopes through ingress -> dispatcher -> instance
stream -> sidecar -> in-process no-op handler -> reply stream, all in this process (as
``bench.pipeline``), after a warm-up of a tenth as many. Prints:

* Redis, from ``INFO commandstats`` reset before the run: calls and server µs per message,
  by command (``EVALSHA`` is every script call), and in total;
* this process, from ``cProfile`` over the run: the functions with the most time of their own
  per message, and the process's CPU time per message.

Usage: ``python -m bench.profile [--messages 10000] [--top 25]``. Figures only; CI never runs
it. cProfile slows Python several-fold: read its figures as shares, not as speeds.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from adapters.sidecar import Sidecar
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.gc_tuning import tune_gc
from broker.scripts import load_scripts
from workers.dispatcher import Dispatcher

from .pipeline import noop_agent, noop_card, pipeline_throughput
from .servers import discard, throwaway_server


def commandstats(info: str) -> dict[str, tuple[int, int]]:
    """``cmdstat_<name>:calls=..,usec=..`` lines as name -> (calls, usec)."""
    stats: dict[str, tuple[int, int]] = {}
    for line in info.splitlines():
        if line.startswith("cmdstat_"):
            name, _, rest = line.partition(":")
            fields = dict(part.split("=", 1) for part in rest.split(","))
            stats[name.removeprefix("cmdstat_")] = (int(fields["calls"]), int(fields["usec"]))
    return stats


def script_times(entries: Sequence[Any]) -> dict[str, tuple[int, int]]:
    """``SLOWLOG GET`` entries (id, time, µs, arguments, ...) as script name -> (calls, µs):
    each ``EVALSHA``'s time, the commands it ran included, under its script's name (a SHA1
    that names no script of ``broker/lua`` under its first eight digits)."""
    names = {script.sha: str(name) for name, script in load_scripts().items()}
    times: dict[str, tuple[int, int]] = {}
    for entry in entries:
        arguments = entry[3]
        if len(arguments) < 2 or bytes(arguments[0]).lower() != b"evalsha":
            continue
        sha = bytes(arguments[1]).decode(errors="replace").lower()
        name = names.get(sha, sha[:8])
        calls, usec = times.get(name, (0, 0))
        times[name] = (calls + 1, usec + int(entry[2]))
    return times


async def log_every_call(conn: Connection, most: int) -> None:
    """Have Redis log every call it runs, up to the last ``most`` (``SLOWLOG`` at 0 µs)."""
    await conn.call("CONFIG", "SET", "slowlog-max-len", str(most))
    await conn.call("CONFIG", "SET", "slowlog-log-slower-than", "0")
    await conn.call("SLOWLOG", "RESET")


async def logged_script_times(conn: Connection, most: int) -> dict[str, tuple[int, int]]:
    """Stop logging every call; each script's calls and time since :func:`log_every_call`
    (``most``: its log's length). A log that filled has lost its oldest calls, so its sums
    would read low: refused."""
    await conn.call("CONFIG", "SET", "slowlog-log-slower-than", "10000")
    if int(await conn.call("SLOWLOG", "LEN")) >= most:
        raise RuntimeError(f"Redis's log of calls filled ({most} entries): run fewer messages")
    return script_times(await conn.call("SLOWLOG", "GET", "-1"))


async def run(conn: Connection, messages: int) -> tuple[dict[str, tuple[int, int]], float]:
    await conn.call("CONFIG", "RESETSTAT")
    started_cpu = time.process_time()
    await pipeline_throughput(conn, messages)
    cpu = time.process_time() - started_cpu
    return commandstats((await conn.call("INFO", "commandstats")).decode()), cpu


async def main(messages: int, top: int) -> None:
    tune_gc()
    server = throwaway_server("reach-profile-")
    profiler = cProfile.Profile()
    try:
        settings = build_settings([{"redis_url": server.url, "prefix": "bench"}])
        async with open_connection(settings, server.url) as conn:
            async with anyio.create_task_group() as tg:
                await tg.start(Sidecar(conn, noop_card(100), noop_agent()).run)
                await tg.start(Dispatcher(conn, consumer="bench").run)
                await pipeline_throughput(conn, max(100, messages // 10))  # warm-up
                profiler.enable()
                stats, cpu = await run(conn, messages)
                profiler.disable()
                tg.cancel_scope.cancel()
    finally:
        discard(server)
    print(f"{messages} messages, in-process dispatcher and sidecar (100 in flight), no-op handler")
    print("Redis: per message, by command (server time; EVALSHA = every script call)")
    total_calls = sum(c for c, _ in stats.values())
    total_usec = sum(u for _, u in stats.values())
    for name, (calls, usec) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<14} {calls / messages:6.2f} calls  {usec / messages:7.1f} µs")
    print(f"  {'total':<14} {total_calls / messages:6.2f} calls  {total_usec / messages:7.1f} µs")
    print(f"Python: {cpu / messages * 1e6:.0f} µs of CPU per message (under cProfile)")
    listing = pstats.Stats(profiler)
    rows = sorted(listing.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    total = sum(v[2] for v in listing.stats.values())  # type: ignore[attr-defined]
    for (path, line, name), (_, calls, own, _, _) in rows:
        where = f"{Path(path).name}:{line}({name})" if line else name
        print(f"  {own / total:5.1%}  {calls / messages:6.2f} calls/msg  {where}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    anyio.run(main, args.messages, args.top)


if __name__ == "__main__":
    cli()
