"""``agent-reach send``: submit one envelope, optionally wait for its result;
``agent-reach request``: send one request through :meth:`broker.Client.request` and print
its result."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click
import msgspec

from broker import tracing
from broker.broadcast import id_problem
from broker.client import Client, Result
from broker.config import Settings, answer_grace_s
from broker.envelope import Envelope, capability_problem, envelope_problem
from broker.errors import ReachError, RequestTimeout
from broker.jsondepth import decode_error_text, depth_problem
from broker.stages import Stage
from broker.webhooks import callback_url_problem

from ..runtime import connected
from .common import FiniteRange, check_id, parse_tags, redis_options, run

# The exit codes of `send --wait` and `request`.
EXIT_FAILED = 1  # a terminal stage other than SUCCEEDED
EXIT_PENDING = 3  # no result by the deadline plus the broker's grace

# The bounds of the envelope's `timeout_s` (broker.envelope.TimeoutS).
TIMEOUT_RANGE = FiniteRange(0, 7 * 86400, min_open=True)


def parse_payload(payload: str) -> Any:
    """The ``--payload`` value decoded from JSON, or a usage error saying where it broke."""
    too_deep = depth_problem(payload)
    if too_deep is not None:  # before decoding: the decoder recurses
        raise click.BadParameter(too_deep, param_hint="--payload")
    try:
        return msgspec.json.decode(payload)
    except msgspec.DecodeError as exc:
        problem = decode_error_text(exc, payload)
        raise click.BadParameter(f"not JSON: {problem}", param_hint="--payload") from exc


def build_envelope(fields: dict[str, Any], payload: str) -> Envelope:
    """An envelope from command-line values, with the same validation as the dispatcher's
    (that every argument is UTF-8 text, the command group checks: workers/cli/__init__.py)."""
    raw_payload = msgspec.Raw(msgspec.json.encode(parse_payload(payload)))
    try:
        envelope = msgspec.convert({k: v for k, v in fields.items() if v is not None}, Envelope)
    except msgspec.ValidationError as exc:
        raise click.BadParameter(str(exc)) from exc
    if problem := envelope_problem(envelope):
        raise click.BadParameter(problem)
    # what the dispatcher refuses whatever its settings (intake.Intake._decode)
    if envelope.callback_url is not None and (
        problem := callback_url_problem(envelope.callback_url)
    ):
        raise click.BadParameter(problem, param_hint="--callback-url")
    if envelope.mode == "broadcast" and envelope.id and (problem := id_problem(envelope.id)):
        raise click.BadParameter(problem, param_hint="--id")
    return msgspec.structs.replace(envelope, payload=raw_payload)


# The options of `send`, as data: the command below is what it does with them.
SEND_OPTIONS = (
    click.option("--payload", default="null", help="JSON payload."),
    click.option("--id", "message_id", default=None, help="Message id (default: a new ULID)."),
    click.option("--session", "session_id", default=None, help="Session id (affinity)."),
    click.option("--tag", "tags", multiple=True, metavar="KEY=VALUE", help="Routing selector."),
    click.option("--target", default=None, help="An agent id or instance id to send to."),
    click.option("--priority", type=click.IntRange(0, 9), default=0, show_default=True),
    click.option("--tenant", default=None, help="Who pays: usage, budgets, rate limits."),
    click.option(
        "--intent",
        default=None,
        metavar="TEXT",
        help="What is wanted, in words, in place of CAPABILITY (mapped by intent routing).",
    ),
    click.option(
        "--budget-per-task",
        type=FiniteRange(0, 1e12),  # finite: JSON has no infinity, it would mean no cap
        default=None,
        help="The highest declared cost of an instance that may run it.",
    ),
    click.option("--wait", is_flag=True, help="Wait for the result and print it."),
    click.option(
        "--broadcast",
        is_flag=True,
        help="To every healthy instance of the capability; the result maps instance -> outcome.",
    ),
    click.option(
        "--callback-url",
        default=None,
        metavar="URL",
        help="A webhook for the result (its host must be in callback_hosts).",
    ),
    click.option(
        "--timeout",
        "timeout_s",
        type=TIMEOUT_RANGE,
        default=30.0,
        show_default=True,
        help="End-to-end budget in seconds: the message's deadline. --wait waits that long plus "
        "the few seconds the broker may take to end a message at its deadline.",
    ),
)


def send_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The ``send`` command's options, in the order ``--help`` lists them."""
    for option in reversed(SEND_OPTIONS):
        command = option(command)
    return command


@click.command()
@redis_options
@click.argument("capability", required=False)
@send_options
def send(
    settings: Settings,
    capability: str | None,
    payload: str,
    message_id: str | None,
    session_id: str | None,
    tags: tuple[str, ...],
    target: str | None,
    priority: int,
    tenant: str | None,
    intent: str | None,
    budget_per_task: float | None,
    wait: bool,
    broadcast: bool,
    callback_url: str | None,
    timeout_s: float,
) -> None:
    """Submit one envelope to CAPABILITY (or for an --intent); print its id, or with --wait
    its result."""
    check_id(message_id, "--id")
    if capability is None and intent is None:
        raise click.UsageError("give a CAPABILITY, or an --intent in its place")
    fields: dict[str, Any] = {
        "tenant": tenant,
        "intent": intent,
        "budget_per_task": budget_per_task,
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
    build_envelope(fields, payload)  # a bad value is a usage error before Redis is asked
    tracing.setup("agent-reach-client")
    sys.exit(run(submit, settings, fields, payload, wait=wait, timeout_s=timeout_s))


async def submit(
    settings: Settings, fields: dict[str, Any], payload: str, *, wait: bool, timeout_s: float
) -> int:
    """Submit the envelope of ``fields`` and ``payload`` and print its id; with ``wait``, wait
    for its result (the deadline and the broker's grace) and print that. The exit code."""
    async with connected(settings) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream() if wait else None
        envelope = build_envelope({**fields, "reply_to": reply_to}, payload)
        sent = await client.submit(envelope)
        if reply_to is None:
            click.echo(sent)
            return 0
        waited_s = timeout_s + answer_grace_s(settings)
        try:
            result = await client.wait_reply(reply_to, sent, timeout_s=waited_s)
        finally:
            await client.discard_reply_stream(reply_to)
        if result is None:
            return echo_pending(sent, waited_s, timeout_s, await stage_now(client, sent))
    return echo_result(result)


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
    3 when no result came by the deadline plus the few seconds the broker may take to end a
    message at its deadline (the line names the stage it is in now; see `trace`).
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
                now = await stage_now(client, exc.message_id)
                return echo_pending(exc.message_id, exc.timeout_s, timeout_s, now)
        return echo_result(result)

    tracing.setup("agent-reach-client")
    sys.exit(run(ask))


def echo_result(result: Result) -> int:
    click.echo(msgspec.json.encode(result).decode())
    return 0 if result.ok else EXIT_FAILED


async def stage_now(client: Client, message_id: str) -> Stage | None:
    """The stage the message's record is in, where it has one (read, not waited for)."""
    try:
        record = await client.store.get_record(message_id)
    except ReachError:  # an unreadable record, Redis gone: the line says less, no more
        return None
    return record.stage if record is not None else None


def echo_pending(
    message_id: str, waited_s: float, deadline_s: float, now: Stage | None = None
) -> int:
    """The PENDING line: no answer after ``waited_s`` (the ``deadline_s`` and the grace),
    with the stage the message is in now (``now``): one parked for an operator will not
    finish by itself, and the line says so."""
    if now is Stage.NEEDS_CONFIRMATION:
        what = (
            "it is NEEDS_CONFIRMATION: the agent may or may not have run it, and an operator "
            f"decides (agent-reach resolve or replay): agent-reach trace {message_id}"
        )
    else:
        what = f"it may still finish: agent-reach trace {message_id}"
    why = (
        f"no result within {waited_s:g}s (the {deadline_s:g}s deadline and "
        f"{waited_s - deadline_s:g}s for the broker to end it); {what}"
    )
    line: dict[str, Any] = {"id": message_id, "stage": "PENDING", "error": why}
    if now is not None:
        line["now"] = now.value
    click.echo(json.dumps(line))
    return EXIT_PENDING
