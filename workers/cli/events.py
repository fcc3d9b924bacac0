"""``agent-reach events``, ``subscribe``, ``unsubscribe``: the fleet's events, and who gets
them as webhooks."""

from __future__ import annotations

import json

import anyio
import click

from broker.config import Settings
from broker.connection import Connection
from broker.errors import RedisUnavailable
from broker.event_follow import EventFollower
from broker.event_log import recent_events
from broker.events import EVENT_TYPES, Event, detail_text, event_body, printable
from broker.redaction import url_without_password
from broker.subscription_store import SubscriptionStore
from broker.subscriptions import STATIC_PREFIX, Subscription, subscription_problem

from ..runtime import connected, stop_on_signals
from .common import redis_options, run, utc_text

TYPE = click.Choice(EVENT_TYPES)
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 2.0  # --follow's pauses while Redis is away


def event_line(event: Event, *, as_json: bool) -> str:
    """One event as a line: the webhook's JSON body, or time, type, subject and detail."""
    if as_json:
        return event_body(event).decode()
    stamp = utc_text(event.ts, None)
    detail = detail_text(bytes(event.detail))
    return f"{stamp}  {event.type:<26} {printable(event.subject)}  {detail}".rstrip()


@click.command()
@redis_options
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until stopped.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line (the webhook body).")
@click.option("--type", "types", multiple=True, type=TYPE, help="Only this type (repeatable).")
@click.option(
    "--count", "-n", default=50, show_default=True, type=click.IntRange(0, 100_000),
    help="How many recent events to print first.",
)  # fmt: skip
def events(
    settings: Settings, follow: bool, as_json: bool, types: tuple[str, ...], count: int
) -> None:
    """Print recent fleet events, oldest first (instances, circuits, dead letters, messages
    needing confirmation, budgets, rate limits); with --follow, new ones as they come."""

    async def show() -> None:
        async with connected(settings) as conn:
            recent, last = await recent_events(conn, count, types)
            for event in recent:
                click.echo(event_line(event, as_json=as_json))
            if follow:
                await _follow(conn, last, types, as_json)

    run(show)


async def _follow(conn: Connection, last: str, types: tuple[str, ...], as_json: bool) -> None:
    """Print events after ``last`` until SIGTERM or Ctrl-C (a clean stop: exit 0). Redis away
    (a restart, a failover) is said once on stderr, then the events after ``last`` follow when
    it is back: an operator watching an incident keeps watching through it."""
    async with conn.reader() as reader, anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signals, tg.cancel_scope.cancel, tg.cancel_scope)
        follower = EventFollower(conn, reader, last, types)
        away = False
        lost: str | None = None  # what the stream lost to us while Redis was away, to say
        pause_s = RETRY_FIRST_S
        while True:
            try:
                if away:  # the stream may have lost, or trimmed, what follows the last read
                    lost = await follower.resume() or lost
                found = await follower.next()
            except RedisUnavailable as exc:
                if not away:
                    click.echo(f"Redis is unavailable ({exc}); waiting for it", err=True)
                    away = True
                await anyio.sleep(pause_s)
                pause_s = min(pause_s * 2, RETRY_MAX_S)
                continue
            if away:
                where = url_without_password(conn.url)
                back = f"Redis at {where} is back; following after {follower.last}"
                click.echo(back, err=True)
                if lost:
                    click.echo(f"note: {lost}", err=True)
                away, lost, pause_s = False, None, RETRY_FIRST_S
            for event in found:
                click.echo(event_line(event, as_json=as_json))


def subscription_line(sub_id: str, sub: Subscription, *, as_json: bool) -> str:
    source = "config" if sub_id.startswith(STATIC_PREFIX) else "stored"
    url = url_without_password(sub.url)  # listed, as in `config`, without its password
    if as_json:
        fields = {"id": sub_id, "source": source, "url": url, "events": list(sub.events)}
        return json.dumps(fields | {"created_ms": sub.created_ms})
    return f"{sub_id}  {source:<6}  {url}  {','.join(sub.events) or 'all events'}"


@click.command()
@redis_options
@click.option("--url", default=None, help="Where to POST the events (http or https).")
@click.option(
    "--event", "event_types", multiple=True, metavar="TYPE",
    help=f"An event type (repeatable; none: every type). Types: {', '.join(EVENT_TYPES)}.",
)  # fmt: skip
@click.option("--list", "listing", is_flag=True, help="List the subscriptions instead.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def subscribe(
    settings: Settings,
    url: str | None,
    event_types: tuple[str, ...],
    listing: bool,
    as_json: bool,
) -> None:
    """Subscribe a URL to fleet events: the notifier POSTs each matching event to it, signed
    as result webhooks are (webhook_secret), with retries. Remove one with `unsubscribe`."""
    if listing:
        if url is not None or event_types:
            raise click.UsageError("--list lists: give it without --url and --event")
        run(_list, settings, as_json)
        return
    if url is None:
        raise click.UsageError("give --url URL (and --event TYPE ...), or --list")
    problem = subscription_problem(
        url, event_types, settings.callback_hosts, settings.webhook_secret
    )
    if problem:
        raise click.UsageError(problem)

    async def add() -> None:
        async with connected(settings) as conn:
            sub_id, sub = await SubscriptionStore(conn).add(url, tuple(dict.fromkeys(event_types)))
        click.echo(subscription_line(sub_id, sub, as_json=as_json))

    run(add)


async def _list(settings: Settings, as_json: bool) -> None:
    async with connected(settings) as conn:
        found = await SubscriptionStore(conn).all()
    if not found and not as_json:
        click.echo("no subscriptions")
    for sub_id, sub in found.items():
        click.echo(subscription_line(sub_id, sub, as_json=as_json))


@click.command()
@redis_options
@click.argument("subscription_id")
def unsubscribe(settings: Settings, subscription_id: str) -> None:
    """Remove a stored subscription (one from config stays until config changes)."""
    if subscription_id.startswith(STATIC_PREFIX):
        raise click.UsageError(
            f"{subscription_id} is in config (event_subscriptions): edit it there"
        )

    async def remove() -> None:
        async with connected(settings) as conn:
            if not await SubscriptionStore(conn).remove(subscription_id):
                raise click.ClickException(f"no subscription {subscription_id!r}")
        click.echo(f"{subscription_id}: removed")

    run(remove)
