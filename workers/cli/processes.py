"""Commands that run processes: ``up``, ``sidecar``, ``demo``, ``demo-agent``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import click
import msgspec

from adapters.factory import (
    ADAPTERS,
    AgentAddress,
    SidecarOptionError,
    agent_address,
    callback_warning,
    make_card,
    make_transport,
)
from adapters.sidecar import Sidecar
from adapters.transport import Transport
from broker import tracing
from broker.config import Settings
from broker.connection import Connection
from broker.keyspace import due_sets, ingress_streams, outboxes
from broker.records import InstanceCard

from ..dispatcher import Dispatcher
from ..metrics_page import metrics_endpoint
from ..notifier import Notifier
from ..reaper import Reaper
from ..runtime import connected, stop_on_signals
from .common import FiniteRange, parse_tags, redis_options, run
from .console import ConsoleAt, console_at, open_console, up_console_options

METRICS_OPTIONS = (
    click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0: any port).",
    ),
    click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        help="The address the metrics endpoint listens on.",
    ),
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
) -> None:
    """Run broker roles in one process until SIGINT / SIGTERM."""
    tracing.setup("agent-reach")

    async def serve() -> None:
        async with connected(settings) as conn, AsyncExitStack() as stack:
            await open_metrics(stack, conn, *metrics, "agent-reach")
            await open_console(stack, conn, console)
            await serve_in(conn)

    async def serve_in(conn: Connection) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope.cancel, tg.cancel_scope)
            if dispatch:
                await tg.start(Dispatcher(conn, consumer=consumer).run)
                streams = ingress_streams(conn.keys, conn.settings.ingress_partitions)
                click.echo(f"agent-reach: dispatching from {', '.join(streams)}", err=True)
            if reap:
                await tg.start(Reaper(conn).run)
                click.echo(f"agent-reach: reaping {', '.join(due_sets(conn.keys))}", err=True)
            if notify:
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
def up(
    settings: Settings,
    consumer: str | None,
    metrics_port: int | None,
    metrics_host: str,
    console: bool,
    console_host: str,
    console_port: int,
    console_token: str | None,
) -> None:
    """Run the broker: dispatcher, reaper and notifier in one process."""
    at = console_at(console_host, console_port, console_token, "--console-token")
    serve_roles(
        settings,
        consumer,
        dispatch=True,
        reap=True,
        notify=True,
        metrics=(metrics_host, metrics_port),
        console=at if console else None,
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


# The sidecar's options, as data: the command below is what it does with them.
SIDECAR_OPTIONS = (
    click.option("--agent-id", required=True, help="The agent this instance belongs to."),
    click.option(
        "--capability",
        "capabilities",
        multiple=True,
        required=True,
        help="A capability served, e.g. order.query (repeatable).",
    ),
    click.option(
        "--adapter",
        type=click.Choice(ADAPTERS),
        default=None,
        help="How to reach the agent (default: http with --http, python with --python). "
        "http-async: the agent answers 202 and POSTs its result to this sidecar's callback "
        "endpoint later.",
    ),
    click.option(
        "--http", "http_url", metavar="URL", help="The agent's HTTP endpoint (http, http-async)."
    ),
    click.option(
        "--python",
        "python_spec",
        metavar="MODULE:ATTR",
        help="An in-process Agent (python adapter).",
    ),
    click.option(
        "--max-inflight",
        type=click.IntRange(1, 100_000),
        default=8,
        show_default=True,
        help="Credits: the most unfinished messages this instance holds.",
    ),
    click.option("--idempotent", is_flag=True, help="The agent may safely run a message twice."),
    click.option("--instance-id", default=None, help="Instance id (default: AGENT_ID-random)."),
    click.option("--version", "version", default="0", show_default=True, help="Agent version."),
    click.option(
        "--weight",
        type=FiniteRange(0, 1000),
        default=1.0,
        show_default=True,
        help="Routing weight (e.g. 0.11 beside 1.0 for a 10 % canary).",
    ),
    click.option(
        "--tag", "tags", multiple=True, metavar="KEY=VALUE", help="Routing tag (repeatable)."
    ),
    click.option("--status-url", default="", metavar="URL", help="The agent's status endpoint."),
    click.option(
        "--cost",
        type=FiniteRange(0),
        default=0.0,
        show_default=True,
        help="Cost per call, for routing under a budget.",
    ),
    click.option(
        "--credits",
        "credits_mode",
        type=click.Choice(["adaptive", "static"]),
        default="adaptive",
        show_default=True,
        help="adaptive: the credit limit follows the agent's latency, between 1 and "
        "--max-inflight; static: always --max-inflight.",
    ),
    click.option(
        "--callback-host",
        default="127.0.0.1",
        show_default=True,
        help="http-async: the address the callback endpoint listens on.",
    ),
    click.option(
        "--callback-port",
        type=click.IntRange(0, 65535),
        default=0,
        show_default=True,
        help="http-async: the callback endpoint's port (0: any free one).",
    ),
    click.option(
        "--callback-public-url",
        default=None,
        metavar="URL",
        help="http-async: the callback endpoint's URL as agents reach it, when not "
        "http://HOST:PORT (behind a proxy or NAT).",
    ),
    click.option(
        "--grace",
        "grace_s",
        type=float,
        default=None,
        help="Seconds to finish in-flight work on SIGTERM (default: drain_grace_s, 40).",
    ),
)


def sidecar_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The ``sidecar`` command's options, in the order ``--help`` lists them."""
    for option in reversed(SIDECAR_OPTIONS):
        command = option(command)
    return command


@click.command()
@redis_options
@sidecar_options
@metrics_options
def sidecar(
    settings: Settings,
    agent_id: str,
    capabilities: tuple[str, ...],
    adapter: str | None,
    http_url: str | None,
    python_spec: str | None,
    max_inflight: int,
    idempotent: bool,
    instance_id: str | None,
    version: str,
    weight: float,
    tags: tuple[str, ...],
    status_url: str,
    cost: float,
    credits_mode: str,
    callback_host: str,
    callback_port: int,
    callback_public_url: str | None,
    grace_s: float | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run a sidecar for one agent instance: register, heartbeat, consume, deliver."""
    try:
        address = agent_address(adapter, http_url=http_url, python_spec=python_spec)
        card = make_card(
            agent_id=agent_id,
            capabilities=capabilities,
            endpoint=address.endpoint,
            max_inflight=max_inflight,
            instance_id=instance_id,
            idempotent=idempotent,
            version=version,
            tags=parse_tags(tags),
            weight=weight,
            cost=cost,
            status_url=status_url,
        )
        transport = _transport(settings, address, max_inflight, instance_id, callback_port)
    except SidecarOptionError as exc:
        raise usage_error(exc) from exc
    run(
        serve_sidecar,
        settings,
        card,
        transport,
        grace_s=settings.drain_grace_s if grace_s is None else grace_s,
        adaptive_credits=credits_mode == "adaptive",
        callback_host=callback_host,
        callback_port=callback_port,
        callback_public_url=callback_public_url,
        metrics=(metrics_host, metrics_port),
    )


def _transport(
    settings: Settings,
    address: AgentAddress,
    max_inflight: int,
    instance_id: str | None,
    callback_port: int,
) -> Transport:
    """The agent's transport, after a warning about how its callbacks are set up, if any."""
    warning = callback_warning(address, instance_id=instance_id, callback_port=callback_port)
    if warning:
        click.echo(f"agent-reach: warning: {warning}", err=True)
    return make_transport(
        address, timeout_s=settings.sync_call_timeout_s, max_connections=max_inflight
    )


def usage_error(exc: SidecarOptionError) -> click.UsageError:
    """The factory's refusal as click says it: ``Invalid value for --OPTION: ...`` when one
    option is at fault, the bare message when it is how they combine; exit code 2 either way."""
    if exc.option is None:
        return click.UsageError(exc.message)
    return click.BadParameter(exc.message, param_hint=exc.option)


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
    type=float,
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
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--delay-ms", type=float, default=20.0, show_default=True)
@click.option("--fail-rate", type=FiniteRange(0, 1), default=0.0, show_default=True)
def demo_agent(port: int, host: str, delay_ms: float, fail_rate: float) -> None:
    """Serve one demo HTTP agent (echoes its payload after a delay; fails at a rate)."""
    from ..demo import serve_demo_agent

    run(serve_demo_agent, host, port, delay_ms / 1000, fail_rate)
