"""``agent-reach notifier``: run a notifier alone, POSTing results to their webhooks."""

from __future__ import annotations

import anyio
import click

from broker.config import Settings
from broker.keyspace import outboxes

from ..notifier import Notifier
from ..runtime import connected, stop_on_signals
from .common import redis_options, run

NO_SECRET = (
    "no webhook_secret (or AGENT_REACH_WEBHOOK_SECRET): every webhook delivery is dead-lettered"
)
NO_HOSTS = (
    "no callback_hosts (or AGENT_REACH_CALLBACK_HOSTS) allowed: every webhook delivery is"
    " dead-lettered"
)


@click.command()
@redis_options
@click.option("--consumer", default=None, help="Consumer name (default: host-pid).")
def notifier(settings: Settings, consumer: str | None) -> None:
    """Run a notifier alone: signed webhooks for `callback_url`, with retries (any number
    share the outbox; each delivery goes to one)."""
    # without these every delivery is dead-lettered: say so now, not one letter at a time
    if not settings.webhook_secret:
        click.echo(f"agent-reach: warning: {NO_SECRET}", err=True)
    if not settings.callback_hosts:
        click.echo(f"agent-reach: warning: {NO_HOSTS}", err=True)

    async def serve() -> None:
        async with connected(settings) as conn, anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope.cancel, tg.cancel_scope)
            await tg.start(Notifier(conn, consumer=consumer).run)
            click.echo(f"agent-reach: notifying from {', '.join(outboxes(conn.keys))}", err=True)

    run(serve)
