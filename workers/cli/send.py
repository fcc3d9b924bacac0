"""``agent-reach send``: submit one envelope, optionally wait for its result;
``agent-reach request``: send one request through :meth:`broker.Client.request` and print
its result."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec

from broker.client import Client, Result
from broker.config import Settings
from broker.envelope import Envelope, capability_problem
from broker.errors import RequestTimeout

from ..runtime import connected
from .common import parse_tags, redis_options, run

# The exit codes of `send --wait` and `request`.
EXIT_FAILED = 1  # a terminal stage other than SUCCEEDED
EXIT_PENDING = 3  # no result within the timeout

# The bounds of the envelope's `timeout_s` (broker.envelope.TimeoutS).
TIMEOUT_RANGE = click.FloatRange(0, 7 * 86400, min_open=True)


def parse_payload(payload: str) -> Any:
    """The ``--payload`` value decoded from JSON, or a usage error saying where it broke."""
    try:
        return msgspec.json.decode(payload)
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--payload") from exc


def build_envelope(fields: dict[str, Any], payload: str) -> Envelope:
    """An envelope from command-line values, with the same validation as the dispatcher's."""
    raw_payload = msgspec.Raw(msgspec.json.encode(parse_payload(payload)))
    try:
        envelope = msgspec.convert({k: v for k, v in fields.items() if v is not None}, Envelope)
    except msgspec.ValidationError as exc:
        raise click.BadParameter(str(exc)) from exc
    return msgspec.structs.replace(envelope, payload=raw_payload)


@click.command()
@redis_options
@click.argument("capability")
@click.option("--payload", default="null", help="JSON payload.")
@click.option("--id", "message_id", default=None, help="Message id (default: a new ULID).")
@click.option("--session", "session_id", default=None, help="Session id (affinity).")
@click.option("--tag", "tags", multiple=True, metavar="KEY=VALUE", help="Routing selector.")
@click.option("--target", default=None, help="An agent id or instance id to send to.")
@click.option("--priority", type=click.IntRange(0, 9), default=0, show_default=True)
@click.option("--wait", is_flag=True, help="Wait for the result and print it.")
@click.option(
    "--broadcast",
    is_flag=True,
    help="To every healthy instance of the capability; the result maps instance -> outcome.",
)
@click.option(
    "--callback-url",
    default=None,
    metavar="URL",
    help="A webhook for the result (its host must be in callback_hosts).",
)
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
    session_id: str | None,
    tags: tuple[str, ...],
    target: str | None,
    priority: int,
    wait: bool,
    broadcast: bool,
    callback_url: str | None,
    timeout_s: float,
) -> None:
    """Submit one envelope; print its id, or with --wait its result."""
    fields: dict[str, Any] = {
        "capability": capability,
        "id": message_id,
        "timeout_s": timeout_s,
        "session_id": session_id,
        "tags": parse_tags(tags),
        "target": target,
        "priority": priority,
        "mode": "broadcast" if broadcast else None,
        "callback_url": callback_url,
    }

    async def submit() -> int:
        async with connected(settings) as conn:
            client = Client(conn)
            reply_to = client.new_reply_stream() if wait else None
            envelope = build_envelope({**fields, "reply_to": reply_to}, payload)
            sent = await client.submit(envelope)
            if reply_to is None:
                click.echo(sent)
                return 0
            try:
                result = await client.wait_reply(reply_to, sent, timeout_s=timeout_s)
            finally:
                await conn.call("DEL", reply_to)
        if result is None:
            return echo_pending(sent, timeout_s)
        return echo_result(result)

    sys.exit(run(submit))


@click.command()
@redis_options
@click.argument("capability")
@click.option("--payload", default="null", help="JSON payload.")
@click.option(
    "--timeout",
    "timeout_s",
    type=TIMEOUT_RANGE,
    default=30.0,
    show_default=True,
    help="End-to-end budget in seconds: the message's deadline and how long to wait.",
)
def request(settings: Settings, capability: str, payload: str, timeout_s: float) -> None:
    """Send one request and wait for its result; print the result JSON.

    Exit code 0 when it SUCCEEDED, 1 when it ended otherwise (FAILED, DEAD, EXPIRED, ...),
    3 when no result came within the timeout (the message may still finish: see `trace`).
    """
    problem = capability_problem(capability)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="CAPABILITY")
    value = parse_payload(payload)

    async def ask() -> int:
        async with connected(settings) as conn, Client(conn) as client:
            try:
                result = await client.request(capability, value, timeout=timeout_s)
            except RequestTimeout as exc:
                return echo_pending(exc.message_id, timeout_s)
        return echo_result(result)

    sys.exit(run(ask))


def echo_result(result: Result) -> int:
    click.echo(msgspec.json.encode(result).decode())
    return 0 if result.ok else EXIT_FAILED


def echo_pending(message_id: str, timeout_s: float) -> int:
    pending = {"id": message_id, "stage": "PENDING", "error": f"no result within {timeout_s}s"}
    click.echo(json.dumps(pending))
    return EXIT_PENDING
