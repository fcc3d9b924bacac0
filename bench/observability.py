"""What observing costs: ``bench.pipeline``'s throughput with metrics off and on, in one run.

Three configurations, interleaved round by round on one fresh redis-server, each with its own
key prefix, dispatcher and in-process sidecar (no-op handler):

* ``off``: no counters in the scripts (``metrics_counters = false``), no histograms;
* ``on``: the scripts count (``P:counters``), every process measures its histograms;
* ``on + scraped``: as ``on``, with ``/metrics`` rendered every second meanwhile (what a
  Prometheus scrape of ``agent-reach up`` costs the process serving it).

Prints each round and, per configuration, the median throughput and its ratio to ``off``.
Tracing is not part of it yet: there is no tracing to measure.

Usage: ``python -m bench.observability [--messages 10000] [--rounds 3]``.
No threshold: it prints figures, CI never fails on a time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import anyio

from adapters.sidecar import Sidecar
from bench.pipeline import noop_agent, pipeline_throughput
from broker import process_metrics
from broker.config import build_settings
from broker.connection import open_connection
from broker.embedded import RedisServer
from broker.records import InstanceCard
from workers.dispatcher import Dispatcher
from workers.metrics_page import render

CONFIGURATIONS = ("off", "on", "on + scraped")


async def scrape_every_second(conn_url: str, prefix: str) -> None:
    settings = build_settings([{"redis_url": conn_url, "prefix": prefix}])
    async with open_connection(settings, conn_url) as conn:
        while True:
            await render(conn)
            await anyio.sleep(1.0)


async def one_run(url: str, configuration: str, run_no: int, messages: int) -> float:
    prefix = f"obs{run_no}"
    metrics_on = configuration != "off"
    process_metrics.enable(metrics_on)
    settings = build_settings(
        [{"redis_url": url, "prefix": prefix, "metrics_counters": metrics_on}]
    )
    async with open_connection(settings, url) as conn:
        card = InstanceCard(
            agent_id="noop",
            instance_id=f"noop-{run_no}",
            capabilities=("bench.noop",),
            endpoint="python",
            max_inflight=messages,
        )
        async with anyio.create_task_group() as tg:
            await tg.start(Sidecar(conn, card, noop_agent()).run)
            await tg.start(Dispatcher(conn, consumer="bench").run)
            if configuration == "on + scraped":
                tg.start_soon(scrape_every_second, url, prefix)
            throughput = await pipeline_throughput(conn, messages)
            tg.cancel_scope.cancel()
    return throughput


async def main(messages: int, rounds: int) -> None:
    server = RedisServer.start(Path(tempfile.mkdtemp(prefix="reach-bench-")))
    results: dict[str, list[float]] = {c: [] for c in CONFIGURATIONS}
    try:
        run_no = 0
        for round_no in range(1, rounds + 1):
            shown = []
            for configuration in CONFIGURATIONS:
                run_no += 1
                throughput = await one_run(server.url, configuration, run_no, messages)
                results[configuration].append(throughput)
                shown.append(f"{configuration} {throughput:6.0f} msg/s")
            print(f"round {round_no}: " + " | ".join(shown), flush=True)
    finally:
        process_metrics.enable(True)
        server.stop()
    baseline = statistics.median(results["off"])
    print(f"messages per run: {messages} (in-process adapter, no-op handler)")
    for configuration in CONFIGURATIONS:
        median = statistics.median(results[configuration])
        print(f"{configuration:<14} median {median:6.0f} msg/s, {median / baseline:6.1%} of off")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main, args.messages, args.rounds)


if __name__ == "__main__":
    cli()
