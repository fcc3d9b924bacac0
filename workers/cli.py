"""The ``agent-reach`` command line: run the broker and sidecars, send, trace, inspect."""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from functools import wraps
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import anyio
import click
import msgspec

from adapters.http import HttpTransport
from adapters.python import Agent
from adapters.sidecar import Sidecar
from adapters.transport import Transport
from broker.client import Client
from broker.config import Settings, load_settings
from broker.embedded import running_embedded_url
from broker.envelope import (
    MESSAGE_ID_PATTERN,
    Envelope,
    capability_problem,
    envelope_schema,
)
from broker.errors import ConfigError, ReachError, UnknownMessage
from broker.ids import new_message_id
from broker.records import InstanceCard
from broker.registry import Registry
from broker.store import now_ms

from .dispatcher import Dispatcher
from .runtime import configure_logging, connected, stop_on_signals

P = ParamSpec("P")
T = TypeVar("T")


def run(main: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a coroutine on asyncio; our errors become one clear line and a non-zero exit."""
    try:
        return anyio.run(lambda: main(*args, **kwargs), backend="asyncio")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except ReachError as exc:
        raise click.ClickException(str(exc)) from exc


def redis_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--redis``, ``--config`` and ``--prefix`` for every command that talks to Redis."""

    @click.option(
        "--redis",
        "redis_url",
        envvar="AGENT_REACH_REDIS_URL",
        metavar="URL",
        help="Redis URL; without one an embedded redis-server is started.",
    )
    @click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        envvar="AGENT_REACH_CONFIG",
        help="TOML configuration file.",
    )
    @click.option("--prefix", default=None, help="Key prefix (default: reach).")
    @wraps(command)
    def wrapper(
        redis_url: str | None, config_file: Path | None, prefix: str | None, **kwargs: Any
    ) -> Any:
        try:
            settings = load_settings(config_file, {"redis_url": redis_url, "prefix": prefix})
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        return command(settings=settings, **kwargs)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="agent-reach")
def main(verbose: int) -> None:
    """Agent-Reach: an asynchronous dispatch broker for multi-agent systems, on Redis Streams."""
    configure_logging(verbose)


@main.command()
def schema() -> None:
    """Print the envelope's JSON Schema."""
    click.echo(json.dumps(envelope_schema(), indent=2))


@main.command(name="redis-url")
def redis_url_command() -> None:
    """Print the URL of the running embedded Redis (for redis-cli and other tools)."""
    url = running_embedded_url()
    if url is None:
        raise click.ClickException(
            "no embedded redis is running; it starts with the first command that needs it "
            "(e.g. agent-reach up)"
        )
    click.echo(url)


@main.command()
@redis_options
@click.option("--consumer", default=None, help="Consumer name (default: host-pid).")
def up(settings: Settings, consumer: str | None) -> None:
    """Run the broker: dispatcher (and, as they arrive, reaper and notifier) in one process."""

    async def serve() -> None:
        async with connected(settings) as conn, anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope.cancel, tg.cancel_scope)
            await tg.start(Dispatcher(conn, consumer=consumer).run)
            click.echo(f"agent-reach up: dispatching from {conn.keys.ingress}", err=True)

    run(serve)


def load_python_agent(spec: str) -> Agent:
    """``module:attribute`` naming an :class:`Agent` (or a function returning one)."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise click.BadParameter("expected module:attribute", param_hint="--python")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot load {spec}: {exc}", param_hint="--python") from exc
    agent = target() if callable(target) and not isinstance(target, Agent) else target
    if not isinstance(agent, Agent):
        raise click.BadParameter(f"{spec} is not an Agent", param_hint="--python")
    return agent


@main.command()
@redis_options
@click.option("--agent-id", required=True, help="The agent this instance belongs to.")
@click.option(
    "--capability",
    "capabilities",
    multiple=True,
    required=True,
    help="A capability served, e.g. order.query (repeatable).",
)
@click.option("--http", "http_url", metavar="URL", help="The agent's HTTP endpoint (http adapter).")
@click.option(
    "--python", "python_spec", metavar="MODULE:ATTR", help="An in-process Agent (python adapter)."
)
@click.option(
    "--max-inflight",
    type=click.IntRange(1, 100_000),
    default=8,
    show_default=True,
    help="Credits: the most unfinished messages this instance holds.",
)
@click.option("--idempotent", is_flag=True, help="The agent may safely run a message twice.")
@click.option("--instance-id", default=None, help="Instance id (default: AGENT_ID-random).")
@click.option(
    "--grace",
    "grace_s",
    type=float,
    default=40.0,
    show_default=True,
    help="Seconds to finish in-flight work on SIGTERM.",
)
def sidecar(
    settings: Settings,
    agent_id: str,
    capabilities: tuple[str, ...],
    http_url: str | None,
    python_spec: str | None,
    max_inflight: int,
    idempotent: bool,
    instance_id: str | None,
    grace_s: float,
) -> None:
    """Run a sidecar for one agent instance: register, heartbeat, consume, deliver."""
    if (http_url is None) == (python_spec is None):
        raise click.UsageError("give exactly one of --http URL or --python MODULE:ATTR")
    for capability in capabilities:
        if problem := capability_problem(capability):
            raise click.BadParameter(problem, param_hint="--capability")
    transport: Transport
    if http_url is not None:
        transport = HttpTransport(
            http_url, timeout_s=settings.sync_call_timeout_s, max_connections=max_inflight
        )
    else:
        transport = load_python_agent(python_spec or "")
    for name, value in (("--agent-id", agent_id), ("--instance-id", instance_id)):
        if value is not None and not re.match(MESSAGE_ID_PATTERN, value):
            raise click.BadParameter(
                f"{value!r}: use 1-128 of letters, digits and _ . : -", param_hint=name
            )
    card = InstanceCard(
        agent_id=agent_id,
        instance_id=instance_id or f"{agent_id}-{new_message_id()[-8:]}",
        capabilities=capabilities,
        endpoint=http_url or f"python:{python_spec}",
        max_inflight=max_inflight,
        idempotent=idempotent,
    )

    async def serve() -> None:
        async with connected(settings) as conn, anyio.create_task_group() as tg:
            runner = Sidecar(conn, card, transport, grace_s=grace_s)
            tg.start_soon(stop_on_signals, runner.stop, tg.cancel_scope)
            await tg.start(runner.run)
            click.echo(f"sidecar {card.instance_id} serving {', '.join(capabilities)}", err=True)
            await runner.stopped.wait()
            tg.cancel_scope.cancel()
        await transport.aclose()

    run(serve)


@main.command()
@redis_options
@click.argument("capability")
@click.option("--payload", default="null", help="JSON payload.")
@click.option("--id", "message_id", default=None, help="Message id (default: a new ULID).")
@click.option("--wait", is_flag=True, help="Wait for the result and print it.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=30.0,
    show_default=True,
    help="End-to-end budget in seconds (and how long --wait waits).",
)
def send(
    settings: Settings,
    capability: str,
    payload: str,
    message_id: str | None,
    wait: bool,
    timeout_s: float,
) -> None:
    """Submit one envelope; print its id, or with --wait its result."""
    try:
        raw_payload = msgspec.Raw(msgspec.json.encode(msgspec.json.decode(payload)))
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--payload") from exc

    async def submit() -> int:
        async with connected(settings) as conn:
            client = Client(conn)
            reply_to = client.new_reply_stream() if wait else None
            try:
                envelope = msgspec.convert(
                    {
                        "capability": capability,
                        "id": message_id,
                        "timeout_s": timeout_s,
                        "reply_to": reply_to,
                    },
                    Envelope,
                )
            except msgspec.ValidationError as exc:
                raise click.BadParameter(str(exc)) from exc
            envelope = msgspec.structs.replace(envelope, payload=raw_payload)
            sent = await client.submit(envelope)
            if reply_to is None:
                click.echo(sent)
                return 0
            try:
                result = await client.wait_reply(reply_to, sent, timeout_s=timeout_s)
            finally:
                await conn.call("DEL", reply_to)
            if result is None:
                click.echo(
                    json.dumps(
                        {"id": sent, "stage": "PENDING", "error": f"no result within {timeout_s}s"}
                    )
                )
                return 3
            click.echo(msgspec.json.encode(result).decode())
            return 0 if result.ok else 1

    sys.exit(run(submit))


@main.command()
@redis_options
@click.argument("message_id")
@click.option("--json", "as_json", is_flag=True, help="JSON with a `stages` list and `stage`.")
def trace(settings: Settings, message_id: str, as_json: bool) -> None:
    """Show one message's stage timeline."""

    async def show() -> None:
        async with connected(settings) as conn:
            try:
                found = await Client(conn).trace(message_id)
            except UnknownMessage as exc:
                raise click.ClickException(str(exc)) from exc
        record = found.record
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "id": record.id,
                        "stage": record.stage.value,
                        "attempt": record.attempt,
                        "instance": record.instance,
                        "capability": record.capability,
                        "error": record.error,
                        "result": msgspec.json.decode(record.result) if record.result else None,
                        "stages": [msgspec.to_builtins(e) for e in found.timeline],
                    }
                )
            )
            return
        click.echo(
            f"{record.id}  {record.capability}  stage {record.stage}  attempt {record.attempt}"
        )
        start = found.timeline[0].ts_ms if found.timeline else 0
        for e in found.timeline:
            click.echo(
                f"  +{e.ts_ms - start:>7} ms  {e.stage:<18} {e.instance or '-':<24} "
                f"attempt {e.attempt}  {e.reason}"
            )
        if record.error:
            click.echo(f"  error: {record.error}")

    run(show)


@main.command()
@redis_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per instance.")
def agents(settings: Settings, as_json: bool) -> None:
    """List registered instances: capabilities, state, credits in use / limit."""

    async def show() -> None:
        async with connected(settings) as conn:
            views = await Registry(conn).snapshot()
        now = now_ms()
        if as_json:
            click.echo(
                json.dumps(
                    [
                        {
                            **msgspec.to_builtins(v.card),
                            "state": v.state.value,
                            "credits": v.credits,
                            "inflight": v.inflight,
                            "heartbeat_age_s": (now - v.heartbeat_ms) / 1000,
                        }
                        for v in views
                    ]
                )
            )
            return
        if not views:
            click.echo("no instances registered")
            return
        click.echo(f"{'INSTANCE':<28} {'STATE':<9} {'CREDITS':>9}  {'HB AGE':>7}  CAPABILITIES")
        for v in views:
            click.echo(
                f"{v.instance_id:<28} {v.state.value:<9} {v.inflight:>4}/{v.credits:<4} "
                f"{(now - v.heartbeat_ms) / 1000:>7.1f}s  {','.join(v.card.capabilities)}"
            )

    run(show)


@main.command()
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
    """Run the whole system on the embedded Redis with three demo agents, and report."""
    from .demo import run_demo

    prefix = settings.prefix if settings.prefix != "reach" else f"demo-{int(time.time())}"
    settings = msgspec.structs.replace(settings, prefix=prefix)
    lost = run(run_demo, settings, messages, timeout_s)
    sys.exit(0 if lost == 0 else 1)


@main.command(name="demo-agent")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--delay-ms", type=float, default=20.0, show_default=True)
@click.option("--fail-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True)
def demo_agent(port: int, host: str, delay_ms: float, fail_rate: float) -> None:
    """Serve one demo HTTP agent (echoes its payload after a delay; fails at a rate)."""
    from .demo import serve_demo_agent

    run(serve_demo_agent, host, port, delay_ms / 1000, fail_rate)
