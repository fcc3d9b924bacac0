"""An operator's repair commands: ``stuck``, ``replay``, ``resolve``, ``dlq``, ``cancel``.

The logic is :class:`broker.operator.Operator`; these commands parse, ask, and print.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import click
import msgspec

from broker.config import Settings
from broker.durations import format_age, parse_duration
from broker.errors import ReachError
from broker.events import printable
from broker.jsondepth import json_problem
from broker.operator import Action, Operator, ReplayPlan, StuckMessage
from broker.redaction import url_without_password
from broker.stages import TERMINAL, Stage

from ..runtime import connected
from ..task_cancel import cancel_agent_task
from .common import redis_options, run, utc_text

T = TypeVar("T")


def default_operator() -> str:
    """``$USER@hostname``: who a repair's timeline entry names when ``--by`` is not given."""
    try:
        user = os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (a bare container)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


if TYPE_CHECKING:  # generic in the click that type-checks; not at run time in click 8.1
    SecondsType = click.ParamType[float, Any]
    StageType = click.ParamType[Stage, Any]
else:
    SecondsType = StageType = click.ParamType


class Duration(SecondsType):
    """``90s``, ``5m``, ``2h``, ``1d`` or plain seconds, as seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class StageChoice(StageType):
    """A stage name (any case) among ``allowed``; ``why`` says why the others are not."""

    name = "stage"

    def __init__(self, allowed: Iterable[Stage], why: str) -> None:
        self.allowed = [s for s in Stage if s in set(allowed)]
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, Stage):
            return value
        try:
            stage = Stage(str(value).upper())
        except ValueError:
            self.fail(f"{value!r} is not a stage; stages: {', '.join(Stage)}", param, ctx)
        if stage not in self.allowed:
            self.fail(f"{stage} {self.why}; use {' or '.join(self.allowed)}", param, ctx)
        return stage


def _operator_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Who repairs, as the timeline says it: printable text on one line, not empty."""
    if not value.strip() or printable(value) != value or len(value) > 200:
        raise click.BadParameter("give a name: 1-200 printable characters, on one line")
    return value


by_option = click.option(
    "--by",
    default=default_operator,
    callback=_operator_name,
    metavar="NAME",
    show_default="$USER@hostname",
    help="Who is repairing, for the message's timeline.",
)


@dataclass(frozen=True, slots=True)
class _Failed:
    error: ReachError | click.ClickException | click.Abort


def operate(settings: Settings, work: Callable[[Operator], Awaitable[T]]) -> T:
    """Run ``work`` with an :class:`Operator` on a fresh connection. An error is raised only
    once the connection has closed: raised inside it, it would come out wrapped in the
    connection's task-group exception group — a traceback instead of one clear line."""

    async def main() -> T | _Failed:
        async with connected(settings) as conn:
            try:
                return await work(Operator(conn))
            except (ReachError, click.ClickException, click.Abort) as exc:
                return _Failed(exc)

    outcome = run(main)
    if not isinstance(outcome, _Failed):
        return outcome
    if isinstance(outcome.error, ReachError):
        raise click.ClickException(str(outcome.error)) from outcome.error
    raise outcome.error


def finished(action: Action) -> None:
    """Print what one repair did; a refusal is an error (exit 1)."""
    if not action.done:
        raise click.ClickException(action.detail)
    click.echo(action.detail)


@click.command()
@redis_options
@click.option(
    "--older-than",
    "older_than_s",
    type=Duration(),
    default="5m",
    show_default=True,
    help="Only messages whose stage last changed at least this long ago (90s, 5m, 2h).",
)
@click.option(
    "--stage",
    type=StageChoice(
        [s for s in Stage if s not in TERMINAL], "has ended: stuck lists work in flight"
    ),
    default=None,
    help="Only messages in this stage.",
)
@click.option("--json", "as_json", is_flag=True, help="A JSON list, one object per message.")
def stuck(settings: Settings, older_than_s: float, stage: Stage | None, as_json: bool) -> None:
    """Messages in flight that have not moved for a while: stage, instance, attempt, age in
    the stage and since acceptance, and the reason of their last step."""
    found = operate(settings, lambda op: op.stuck(older_than_s=older_than_s, stage=stage))
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(found)))
    elif not found:
        click.echo(f"nothing in flight for {format_age(older_than_s)} or more")
    else:
        print_stuck(found)


def print_stuck(found: list[StuckMessage]) -> None:
    click.echo(
        f"{'ID':<26} {'STAGE':<18} {'CAPABILITY':<24} {'INSTANCE':<20} {'ATTEMPT':>7} "
        f"{'AGE':>7} {'ACCEPTED':>8}  LAST REASON"
    )
    for m in found:
        click.echo(
            f"{m.id:<26} {m.stage:<18} {m.capability:<24} {m.instance or '-':<20} "
            f"{m.attempt:>7} {format_age(m.age_s):>7} {format_age(m.accepted_age_s):>8}  "
            f"{printable(m.last_reason)}"  # stored text: escaped for the terminal
        )


@click.command()
@redis_options
@click.argument("message_ids", nargs=-1, metavar="[ID]...")
@click.option("--dlq", is_flag=True, help="Every DEAD message in the dead-letter stream.")
@click.option(
    "--stage",
    type=StageChoice([Stage.NEEDS_CONFIRMATION], "cannot be replayed as a whole stage"),
    default=None,
    help="Every message in this stage (NEEDS_CONFIRMATION).",
)
@click.option(
    "--include-ended",
    is_flag=True,
    help="Also replay FAILED, EXPIRED and CANCELLED messages: their producer had an answer "
    "and gets a new one.",
)
@click.option("--yes", is_flag=True, help="Do not ask, even where the agent is not idempotent.")
@by_option
def replay(
    settings: Settings,
    message_ids: tuple[str, ...],
    dlq: bool,
    stage: Stage | None,
    include_ended: bool,
    yes: bool,
    by: str,
) -> None:
    """Run messages again: a new attempt with the same idempotency key.

    Replays NEEDS_CONFIRMATION and DEAD messages; with --include-ended also FAILED, EXPIRED
    and CANCELLED ones, whose producer then gets a new answer (told at once on its reply
    stream, and with a new webhook-id). Where an agent serving the capability is not
    idempotent (or none is registered) it asks first, unless --yes."""
    if sum((bool(message_ids), dlq, stage is not None)) != 1:
        raise click.UsageError("give message ids, --dlq or --stage: exactly one of them")

    async def apply(operator: Operator) -> list[Action]:
        if dlq:
            plan = await operator.plan_dlq_replay()
        elif stage is not None:
            plan = await operator.plan_stage_replay(stage)
        else:
            plan = await operator.plan_replay(message_ids, include_ended=include_ended)
        if plan.records and plan.unsafe and not yes:
            if not await anyio.to_thread.run_sync(confirm_unsafe, plan):
                raise click.ClickException("not confirmed: nothing replayed")
        return await operator.replay(plan, by=by)

    actions = operate(settings, apply)
    if not actions:
        click.echo("nothing to replay")
    for action in actions:
        click.echo(f"{'replayed' if action.done else 'skipped '}  {action.detail}")
    if message_ids and not all(a.done for a in actions):
        click.get_current_context().exit(1)  # an id the operator named was not replayed


def confirm_unsafe(plan: ReplayPlan) -> bool:
    click.echo(f"{len(plan.records)} message(s) to replay; running again may repeat work:")
    for capability, why in plan.unsafe.items():
        click.echo(f"  {capability}: {why}")
    return click.confirm("Replay anyway?", default=False)


@click.command()
@redis_options
@click.argument("message_id")
@click.option("--succeeded", "result", metavar="JSON", help="Close as SUCCEEDED with this result.")
@click.option("--failed", "reason", metavar="REASON", help="Close as FAILED with this reason.")
@by_option
def resolve(
    settings: Settings, message_id: str, result: str | None, reason: str | None, by: str
) -> None:
    """Close a NEEDS_CONFIRMATION message by hand, as SUCCEEDED or FAILED; its producer gets
    the reply."""
    if (result is None) == (reason is None):
        raise click.UsageError("give exactly one of --succeeded JSON and --failed REASON")
    if result is not None:
        check_result_json(result)
    if reason is not None and not reason.strip():
        raise click.BadParameter("give the reason it failed", param_hint="--failed")

    encoded = None if result is None else result.encode()
    finished(
        operate(settings, lambda op: op.resolve(message_id, by=by, result=encoded, error=reason))
    )


def check_result_json(result: str) -> None:
    """A usage error unless ``--succeeded`` is JSON the broker can keep: decodable, and
    nested no deeper than any result taken from an agent."""
    problem = json_problem(result)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="--succeeded")


@click.command()
@redis_options
@click.argument("message_id")
@by_option
def cancel(settings: Settings, message_id: str, by: str) -> None:
    """Cancel a message no sidecar has taken yet (ACCEPTED, WAITING or ROUTED); its producer
    gets a CANCELLED reply. A PROCESSING message on an A2A agent: the agent is asked to
    cancel its task (CancelTask), and the message ends as the task does."""

    async def work(op: Operator) -> Action:
        asked = await cancel_agent_task(op.conn, message_id, by=by)
        return asked if asked is not None else await op.cancel(message_id, by=by)

    finished(operate(settings, work))


@click.command()
@redis_options
@click.option("--json", "as_json", is_flag=True, help="A JSON list, one object per letter.")
@click.option(
    "--count",
    type=click.IntRange(1, 1_000_000),
    default=100,
    show_default=True,
    help="How many of the newest to show.",
)
def dlq(settings: Settings, as_json: bool, count: int) -> None:
    """Dead letters, the newest last: rejected envelopes, dead messages, undeliverable
    replies, with their reasons."""
    found = operate(settings, lambda op: op.dead_letters(count))
    if as_json:  # a webhook URL's secrets hidden, as below (and as `config` hides them)
        letters = [
            msgspec.structs.replace(letter, url=url_without_password(letter.url))
            if letter.url is not None
            else letter
            for letter in found.letters
        ]
        click.echo(json.dumps(msgspec.to_builtins(letters)))
        return
    shown = len(found.letters)
    click.echo(f"{found.total} dead letter(s)" + (f", the newest {shown}:" if shown else ""))
    for letter in found.letters:
        when = utc_text(letter.ts_ms)
        line = f"{when}  {letter.id:<26} {letter.stage or '-':<10} {letter.reason}"
        click.echo(printable(line))  # stored text, any byte: escaped for the terminal
        if letter.url is not None:
            tries = f" after {letter.attempts} attempts" if letter.attempts else ""
            url = url_without_password(letter.url)
            click.echo(printable(f"{'':<21}webhook {url}{tries}: {letter.error or '?'}"))
