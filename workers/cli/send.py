"""``agent-reach send``: submit one envelope, optionally wait for its result."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec

from broker.client import Client
from broker.config import Settings
from broker.envelope import Envelope

from ..runtime import connected
from .common import parse_tags, redis_options, run


def build_envelope(fields: dict[str, Any], payload: str) -> Envelope:
    """An envelope from command-line values, with the same validation as the dispatcher's."""
    try:
        raw_payload = msgspec.Raw(msgspec.json.encode(msgspec.json.decode(payload)))
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--payload") from exc
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
            pending = {"id": sent, "stage": "PENDING", "error": f"no result within {timeout_s}s"}
            click.echo(json.dumps(pending))
            return 3
        click.echo(msgspec.json.encode(result).decode())
        return 0 if result.ok else 1

    sys.exit(run(submit))
