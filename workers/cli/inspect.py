"""Commands that show and steer: ``trace``, ``agents``, ``stats``, ``weight``, ``drain``,
``config``, ``schema``, ``redis-url``."""

from __future__ import annotations

import json
from typing import Any

import anyio
import click
import msgspec

from broker.client import Client, Trace
from broker.config import Settings
from broker.embedded import running_embedded_url
from broker.envelope import envelope_schema
from broker.errors import UnknownMessage
from broker.events import printable
from broker.health import observed_state
from broker.records import InstanceView
from broker.redaction import hide_secrets
from broker.registry import Registry
from broker.routing import factors
from broker.stats import BacklogStats, backlog_stats
from broker.timekeeping import now_ms
from broker.wire import route_steps

from ..overview import broadcast_children
from ..routing_table import routing_policy
from ..runtime import connected
from .common import FiniteRange, redis_options, run


@click.command()
def schema() -> None:
    """Print the envelope's JSON Schema."""
    click.echo(json.dumps(envelope_schema(), indent=2))


@click.command(name="redis-url")
def redis_url_command() -> None:
    """Print the URL of the running embedded Redis (for redis-cli and other tools)."""
    url = running_embedded_url()
    if url is None:
        raise click.ClickException(
            "no embedded redis is running; it starts with the first command that needs it "
            "(e.g. agent-reach up)"
        )
    click.echo(url)


@click.command()
@redis_options
@click.option("--json", "as_json", is_flag=True, help="The effective configuration as JSON.")
@click.option(
    "--show-secrets",
    is_flag=True,
    help="Print the webhook secret and URL passwords too (hidden by default).",
)
def config(settings: Settings, as_json: bool, show_secrets: bool) -> None:
    """Print the effective configuration (defaults < file < environment < flags). Secrets are
    hidden unless --show-secrets: in TOML, a line holding one is printed as a comment, so the
    output still loads back (without that key)."""
    values = msgspec.to_builtins(settings)
    shown, hidden = (values, set()) if show_secrets else hide_secrets(values)
    if as_json:
        click.echo(json.dumps(shown, indent=2))
        return
    for key, value in shown.items():
        if value is None:
            click.echo(f"# {key} is not set")
        elif key in hidden:
            click.echo(f"# {key} = {toml_value(value)}  (secret hidden; --show-secrets prints it)")
        else:
            click.echo(f"{key} = {toml_value(value)}")


def toml_value(value: Any) -> str:
    """``value`` as TOML: tables inline, so each key stays on one line. TOML has no null: a
    key whose value is unset is left out of its table (the default applies)."""
    if isinstance(value, dict):
        inline = ", ".join(
            f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items() if v is not None
        )
        return f"{{ {inline} }}" if inline else "{}"
    if isinstance(value, list):
        return f"[{', '.join(toml_value(v) for v in value)}]"
    if isinstance(value, str):
        # JSON's escapes are TOML's, but for a character past U+FFFF (a surrogate pair in
        # JSON, not allowed in TOML: written as itself) and DEL (TOML wants it escaped)
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return json.dumps(value)


def readable_json(raw: bytes) -> Any:
    """``raw`` decoded, or, where it is no JSON a reader can build (whoever may write a
    record may write anything there), ``{"unreadable": <its text>}``."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return {"unreadable": raw[:1000].decode(errors="replace")}


def trace_document(found: Trace) -> dict[str, Any]:
    record = found.record
    return {
        "id": record.id,
        "stage": record.stage.value,
        "attempt": record.attempt,
        "instance": record.instance,
        "capability": record.capability,
        "error": record.error,
        "result": readable_json(record.result) if record.result else None,
        "route_reason": record.route_reason,
        "route_from": route_steps(record.route_from) if record.route_from else None,
        "stages": [msgspec.to_builtins(e) for e in found.timeline],
    }


@click.command()
@redis_options
@click.argument("message_id")
@click.option("--json", "as_json", is_flag=True, help="JSON with a `stages` list and `stage`.")
def trace(settings: Settings, message_id: str, as_json: bool) -> None:
    """Show one message's stage timeline and its route decision."""

    async def show() -> None:
        async with connected(settings) as conn:
            try:
                found = await Client(conn).trace(message_id)
            except UnknownMessage as exc:
                raise click.ClickException(str(exc)) from exc
            children = await broadcast_children(conn, message_id)
        if as_json:
            document = trace_document(found)
            click.echo(json.dumps({**document, "children": children} if children else document))
        else:
            print_trace(found)
            for child in children:
                click.echo(f"  child {child['id']:<32} {child['instance']:<24} {child['stage']}")

    run(show)


def print_trace(found: Trace) -> None:
    record = found.record
    click.echo(f"{record.id}  {record.capability}  stage {record.stage}  attempt {record.attempt}")
    start = found.timeline[0].ts_ms if found.timeline else 0
    for e in found.timeline:  # stored text, a sidecar's user may write: escaped for the terminal
        click.echo(
            f"  +{e.ts_ms - start:>7} ms  {printable(str(e.stage)):<18} "
            f"{printable(e.instance) or '-':<24} attempt {e.attempt}  {printable(e.reason)}"
        )
    if record.route_from:
        click.echo(f"  route: {printable(record.route_reason or '')}")
        for step in route_steps(record.route_from):
            excluded = step.get("excluded", {})
            listed = "; ".join(f"{inst}: {why}" for inst, why in excluded.items())
            more = f" (+{step['more_excluded']} more)" if step.get("more_excluded") else ""
            click.echo(printable(f"    {step['step']:<10} kept {step['kept']:<4} {listed}{more}"))
    if record.error:
        click.echo(f"  error: {printable(record.error)}")


def agent_document(view: InstanceView, settings: Settings, now: int) -> dict[str, Any]:
    policy = routing_policy(settings)
    state = observed_state(view, now_ms=now, down_after_ms=policy.down_after_ms)
    return {
        **msgspec.to_builtins(view.card),
        "state": state.value,
        "reach": factors(view, state, view.inflight, policy).to_builtins(),
        "credits": view.credits,
        "inflight": view.inflight,
        "error_rate": view.stats.error_rate,
        "p95_ms": view.stats.p95_ms,
        "circuit": view.stats.circuit.value,
        "cooldown_s": max(0.0, (view.stats.cooldown_until_ms - now) / 1000),
        "heartbeat_age_s": round((now - view.heartbeat_ms) / 1000, 3),
    }


@click.command()
@redis_options
@click.option("--json", "as_json", is_flag=True, help="A JSON list, one object per instance.")
def agents(settings: Settings, as_json: bool) -> None:
    """Registered instances: state, reach score and factors, credits, error rate, p95,
    version, weight, heartbeat age."""

    async def show() -> None:
        async with connected(settings) as conn:
            views = await Registry(conn).snapshot()
        now = now_ms()
        documents = [agent_document(v, settings, now) for v in views]
        if as_json:
            click.echo(json.dumps(documents))
        elif not documents:
            click.echo("no instances registered")
        else:
            print_agents(documents)

    run(show)


def print_agents(documents: list[dict[str, Any]]) -> None:
    click.echo(
        f"{'INSTANCE':<24} {'STATE':<9} {'REACH':>6} {'CREDITS':>9} {'ERR':>5} {'P95':>7} "
        f"{'VERSION':<8} {'WEIGHT':>6} {'HB AGE':>7}  CAPABILITIES"
    )
    for d in documents:
        reach = d["reach"]
        click.echo(
            f"{d['instance_id']:<24} {d['state']:<9} {reach['reach']:>6.3f} "
            f"{d['inflight']:>4}/{d['credits']:<4} {d['error_rate']:>5.0%} "
            f"{d['p95_ms']:>5.0f}ms {printable(d['version']):<8} {d['weight']:>6.2f} "
            f"{d['heartbeat_age_s']:>6.1f}s  {','.join(d['capabilities'])}"
        )
        click.echo(
            f"{'':<24} alive {reach['alive']} × health {reach['health']} × load {reach['load']}"
            f" × latency {reach['latency']} × confidence {reach['confidence']}"
            f" × weight {reach['weight']}"
        )


@click.command()
@redis_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option(
    "--watch",
    type=FiniteRange(0.1, 86400),
    default=None,
    metavar="SECONDS",
    help="Print again every SECONDS until interrupted.",
)
def stats(settings: Settings, as_json: bool, watch: float | None) -> None:
    """Backpressure at a glance. Per capability: waiting depth (and how many of those no
    registered instance can take at all), oldest waiting age, assignment rate (last minute).
    Per instance: credits in use / effective limit / declared limit, entries on its stream."""

    async def show() -> None:
        async with connected(settings) as conn:
            while True:
                found = await backlog_stats(conn)
                if as_json:
                    click.echo(msgspec.json.encode(found).decode())
                else:
                    print_stats(found)
                if watch is None:
                    return
                await anyio.sleep(watch)
                click.echo()

    run(show)


def print_stats(found: BacklogStats) -> None:
    if not found.capabilities and not found.instances:
        click.echo("nothing registered and nothing waiting")
        return
    click.echo(
        f"{'CAPABILITY':<32} {'WAITING':>8} {'UNMATCHED':>9} {'OLDEST':>9} {'ASSIGNED/S':>11}"
        f" {'INSTANCES':>9}"
    )
    for c in found.capabilities:
        oldest = "-" if c.oldest_waiting_s is None else f"{c.oldest_waiting_s:.1f}s"
        click.echo(
            f"{c.capability:<32} {c.waiting:>8} {c.unmatched:>9} {oldest:>9} "
            f"{c.assigned_per_s:>11.2f} {c.instances:>9}"
        )
    click.echo()
    click.echo(
        f"{'INSTANCE':<24} {'STATE':<9} {'IN USE':>6} {'EFFECTIVE':>9} {'DECLARED':>8}"
        f" {'STREAM':>6}  CAPABILITIES"
    )
    for i in found.instances:
        click.echo(
            f"{i.instance_id:<24} {i.state:<9} {i.in_use:>6} {i.effective:>9} {i.declared:>8} "
            f"{i.stream:>6}  {','.join(i.capabilities)}"
        )


# a negative weight is read as the value it is ("not in the range"), not as an option
@click.command(context_settings={"ignore_unknown_options": True})
@redis_options
@click.argument("instance_id")
@click.argument("weight", type=FiniteRange(0, 1000))
def weight(settings: Settings, instance_id: str, weight: float) -> None:
    """Set an instance's routing weight now (canary share: 0.11 beside 1.0 is about 10 %)."""
    context = click.get_current_context()

    async def apply() -> None:
        async with connected(settings) as conn:
            if not await Registry(conn).set_weight(instance_id, weight):
                if instance_id.startswith("--"):  # let through as a value (above): a typo
                    raise click.NoSuchOption(instance_id, ctx=context)
                raise click.ClickException(f"unknown instance {instance_id!r}")
        click.echo(f"{instance_id}: weight {weight}")

    run(apply)


@click.command()
@redis_options
@click.argument("instance_id")
def drain(settings: Settings, instance_id: str) -> None:
    """Drain an instance: no new work; it finishes in-flight work, then deregisters."""

    async def apply() -> None:
        async with connected(settings) as conn:
            if not await Registry(conn).drain(instance_id):
                raise click.ClickException(f"unknown instance {instance_id!r}")
        click.echo(f"{instance_id}: DRAINING")

    run(apply)
