"""What observing costs: ``bench.pipeline``'s throughput with metrics off and on, in one run.

Four configurations, interleaved round by round on one fresh redis-server (emptied after
every run; the order turns each round, so no configuration always follows the same one), each
with its own key prefix, dispatcher and in-process sidecar (no-op handler):

* ``off``: no counters in the scripts (``metrics_counters = false``), no histograms;
* ``on``: the scripts count (``P:counters``), every process measures its histograms;
* ``on + scraped``: as ``on``, with ``/metrics`` rendered every second meanwhile (what a
  Prometheus scrape of ``agent-reach up`` costs the process serving it);
* ``on + traced``: as ``on``, with every span (send, dispatch, process, call) exported over
  OTLP/HTTP to a receiver on loopback that reads and drops them (needs the ``otel`` extra).

Prints each round and, per configuration, the median throughput and its ratio to ``off``.

Usage: ``python -m bench.observability [--messages 10000] [--rounds 3]``.
No threshold: it prints figures, CI never fails on a time.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.asgi import serve_app
from bench.pipeline import in_process_throughput
from bench.servers import discard, throwaway_server
from broker import process_metrics, tracing
from broker.config import build_settings
from broker.connection import open_connection
from workers.metrics_page import render

CONFIGURATIONS = ("off", "on", "on + scraped", "on + traced")


async def scrape_every_second(conn_url: str, prefix: str) -> None:
    settings = build_settings([{"redis_url": conn_url, "prefix": prefix}])
    async with open_connection(settings, conn_url) as conn:
        while True:
            await render(conn)
            await anyio.sleep(1.0)


@asynccontextmanager
async def traced() -> AsyncIterator[None]:
    """Spans exported over OTLP/HTTP to a receiver on loopback that drops them."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    async def receive(request: Request) -> Response:
        await request.body()
        return Response(b"")

    app = Starlette(routes=[Route("/v1/traces", receive, methods=["POST"])])
    async with serve_app(app) as url:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{url}v1/traces")))
        tracing.use_provider(provider)
        try:
            yield
        finally:
            tracing.off()
            await anyio.to_thread.run_sync(provider.shutdown)


async def one_run(url: str, configuration: str, run_no: int, messages: int) -> float:
    if configuration == "on + traced":
        async with traced():
            return await measured_run(url, configuration, run_no, messages)
    return await measured_run(url, configuration, run_no, messages)


async def measured_run(url: str, configuration: str, run_no: int, messages: int) -> float:
    prefix = f"obs{run_no}"
    metrics_on = configuration != "off"
    process_metrics.enable(metrics_on)
    settings = build_settings(
        [{"redis_url": url, "prefix": prefix, "metrics_counters": metrics_on}]
    )
    async with open_connection(settings, url) as conn:

        def scrape(tg: TaskGroup) -> None:
            if configuration == "on + scraped":
                tg.start_soon(scrape_every_second, url, prefix)

        throughput = await in_process_throughput(conn, f"noop-{run_no}", messages, alongside=scrape)
        await conn.call("FLUSHALL")  # every run starts on an empty Redis
    return throughput


async def main(messages: int, rounds: int) -> None:
    server = throwaway_server("reach-bench-")
    results: dict[str, list[float]] = {c: [] for c in CONFIGURATIONS}
    try:
        await one_run(server.url, "off", 0, messages // 5)  # warm-up, not counted
        run_no = 0
        for round_no in range(1, rounds + 1):
            shown = []
            turn = (round_no - 1) % len(CONFIGURATIONS)  # each configuration takes every place
            for configuration in CONFIGURATIONS[turn:] + CONFIGURATIONS[:turn]:
                run_no += 1
                throughput = await one_run(server.url, configuration, run_no, messages)
                results[configuration].append(throughput)
                shown.append(f"{configuration} {throughput:6.0f} msg/s")
            print(f"round {round_no}: " + " | ".join(shown), flush=True)
    finally:
        process_metrics.enable(False)  # the default: no /metrics in this process
        discard(server)
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
