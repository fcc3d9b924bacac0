"""``agent-reach feedback ID --good|--bad``: rate the agent that ran a message
(:mod:`broker.feedback`); the agents' recent approval enters intent routing."""

from __future__ import annotations

import click

from broker.client import Client
from broker.config import Settings

from ..runtime import connected
from .common import redis_options, run


@click.command()
@redis_options
@click.argument("message_id")
@click.option("--good/--bad", "good", default=None, help="How the agent did on it (required).")
def feedback(settings: Settings, message_id: str, good: bool | None) -> None:
    """Rate the agent that ran MESSAGE_ID, good or bad. An unknown id, or a message that
    never reached an agent, is an error (exit code 1)."""
    if good is None:
        raise click.UsageError("give --good or --bad")
    rated = good

    async def rate() -> str:
        async with connected(settings) as conn:
            return await Client(conn).feedback(message_id, rated)

    agent = run(rate)
    click.echo(f"{message_id}: rated {'good' if rated else 'bad'} for agent {agent}")
