"""Commands that run processes: ``up``, ``sidecar``, ``demo``, ``demo-agent``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import click
import msgspec

from broker import tracing
from broker.config import Settings
from broker.connection import Connection
from broker.keyspace import due_sets, ingress_streams, outboxes
from broker.records import InstanceCard

from ..runtime import connected, stop_on_signals
from .common import FiniteRange, host_option, redis_options, run
from .console import ConsoleAt, console_at, open_console, up_console_options
from .gateway import GatewayAt, open_gateway, up_a2a_options

if TYPE_CHECKING:
    from adapters.transport import Transport

METRICS_OPTIONS = (
    click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0: any port).",
    ),
    host_option("--metrics-host", "The address the metrics endpoint listens on."),
)


def metrics_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(METRICS_OPTIONS):
        command = option(command)
    return command


async def open_metrics(
    stack: AsyncExitStack, conn: Connection | None, host: str, port: int | None, who: str
) -> None:
    """Serve ``/metrics`` for the life of ``stack`` when a port is asked for."""
    if port is not None:
        from ..metrics_page import metrics_endpoint

        url = await stack.enter_async_context(metrics_endpoint(conn, host, port))
        click.echo(f"{who}: metrics at {url}", err=True)


def serve_roles(
    settings: Settings,
    consumer: str | None,
    *,
    dispatch: bool,
    reap: bool,
    notify: bool = False,
    metrics: tuple[str, int | None] = ("127.0.0.1", None),
    console: ConsoleAt | None = None,
    a2a_at: GatewayAt | None = None,
) -> None:
    """Run broker roles in one process until SIGINT / SIGTERM."""
    tracing.setup("agent-reach")

    async def serve() -> None:
        async with connected(settings) as conn, AsyncExitStack() as stack:
            await open_metrics(stack, conn, *metrics, "agent-reach")
            await open_console(stack, conn, console)
            await open_gateway(stack, conn, a2a_at)
            await serve_in(conn)

    async def serve_in(conn: Connection) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope.cancel, tg.cancel_scope)
            # each role's modules only where it runs: a sidecar's process, or a reaper's,
            # does not import the dispatcher's (nor any, ``--help``)
            if dispatch:
                from ..dispatcher import Dispatcher

                await tg.start(Dispatcher(conn, consumer=consumer).run)
                streams = ingress_streams(conn.keys, conn.settings.ingress_partitions)
                click.echo(f"agent-reach: dispatching from {', '.join(streams)}", err=True)
            if reap:
                from ..reaper import Reaper

                await tg.start(Reaper(conn).run)
                click.echo(f"agent-reach: reaping {', '.join(due_sets(conn.keys))}", err=True)
            if notify:
                from ..notifier import Notifier

                await tg.start(Notifier(conn, consumer=consumer).run)
                click.echo(
                    f"agent-reach: notifying from {', '.join(outboxes(conn.keys))}", err=True
                )

    run(serve)


@click.command()
@redis_options
@click.option("--consumer", default=None, help="Consumer name (default: host-pid).")
@metrics_options
@up_console_options
@up_a2a_options
def up(
    settings: Settings,
    a2a_at: GatewayAt | None,
    consumer: str | None,
    metrics_port: int | None,
    metrics_host: str,
    console: bool,
    console_host: str,
    console_port: int,
    console_token: str | None,
) -> None:
    """Run the broker: dispatcher, reaper and notifier in one process (with --console the
    web console, with --a2a the A2A gateway)."""
    at = console_at(console_host, console_port, console_token, "--console-token")
    serve_roles(
        settings,
        consumer,
        dispatch=True,
        reap=True,
        notify=True,
        metrics=(metrics_host, metrics_port),
        console=at if console else None,
        a2a_at=a2a_at,
    )


@click.command()
@redis_options
@click.option("--consumer", default=None, help="Consumer name (default: host-pid).")
def dispatcher(settings: Settings, consumer: str | None) -> None:
    """Run a dispatcher alone (scale out: any number share the ingress consumer group)."""
    serve_roles(settings, consumer, dispatch=True, reap=False)


@click.command()
@redis_options
def reaper(settings: Settings) -> None:
    """Run a reaper alone (any number share the due clock: each due message goes to one)."""
    serve_roles(settings, None, dispatch=False, reap=True)


async def serve_sidecar(
    settings: Settings,
    card: InstanceCard,
    transport: Transport,
    *,
    grace_s: float,
    adaptive_credits: bool,
    callback_host: str,
    callback_port: int,
    callback_public_url: str | None,
    metrics: tuple[str, int | None] = ("127.0.0.1", None),
) -> None:
    """Run the sidecar until it stops (SIGTERM, SIGINT, or DRAINING seen on a heartbeat); its
    transport is closed however the run ends. Its metrics page holds its own histograms."""
    tracing.setup("agent-reach-sidecar")
    try:
        async with AsyncExitStack() as stack:
            await open_metrics(stack, None, *metrics, f"sidecar {card.instance_id}")
            async with connected(settings) as conn, anyio.create_task_group() as tg:
                from adapters.sidecar import Sidecar

                runner = Sidecar(
                    conn,
                    card,
                    transport,
                    grace_s=grace_s,
                    adaptive_credits=adaptive_credits,
                    callback_host=callback_host,
                    callback_port=callback_port,
                    callback_public_url=callback_public_url,
                )
                tg.start_soon(stop_on_signals, runner.stop, tg.cancel_scope)
                await tg.start(runner.run)
                click.echo(
                    f"sidecar {card.instance_id} serving {', '.join(card.capabilities)}", err=True
                )
                if runner.callback_url:
                    click.echo(
                        f"sidecar {card.instance_id} callbacks at {runner.callback_url}", err=True
                    )
                await runner.stopped.wait()
                tg.cancel_scope.cancel()
    finally:
        await transport.aclose()


@click.command()
@redis_options
@click.option("--messages", type=click.IntRange(1, 1_000_000), default=2000, show_default=True)
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteRange(0, 86400, min_open=True),
    default=120.0,
    show_default=True,
    help="How long to wait for the burst to finish.",
)
def demo(settings: Settings, messages: int, timeout_s: float) -> None:
    """Run the whole system on the embedded Redis with three demo agents, and report.

    The demo works under a key prefix of its own (demo-<time>-<random>, never --prefix) and
    removes its keys when it ends, so it leaves any Redis as it found it."""
    import secrets

    from ..demo import run_demo

    # Its own prefix, whatever --prefix or AGENT_REACH_PREFIX say: the demo removes every
    # key of its prefix when it ends, and must never take a user's keys with it.
    prefix = f"demo-{int(time.time())}-{secrets.token_hex(3)}"
    settings = msgspec.structs.replace(settings, prefix=prefix)
    lost = run(run_demo, settings, messages, timeout_s)
    sys.exit(0 if lost == 0 else 1)


@click.command(name="demo-agent")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@host_option("--host", "The address to listen on.")
@click.option("--delay-ms", type=FiniteRange(0, 3_600_000), default=20.0, show_default=True)
@click.option("--fail-rate", type=FiniteRange(0, 1), default=0.0, show_default=True)
def demo_agent(port: int, host: str, delay_ms: float, fail_rate: float) -> None:
    """Serve one demo HTTP agent (echoes its payload after a delay; fails at a rate)."""
    from ..demo import serve_demo_agent

    run(serve_demo_agent, host, port, delay_ms / 1000, fail_rate)
