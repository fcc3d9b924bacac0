"""``agent-reach usage``: what each agent, capability or tenant used, per UTC day, summed."""

from __future__ import annotations

import click
import msgspec

from broker.config import Settings
from broker.timekeeping import now_ms
from broker.usage import DIMENSIONS, Totals, parse_since
from broker.usage_reader import usage_totals

from ..runtime import connected
from .common import redis_options, run


def _since(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_since(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command()
@redis_options
@click.option("--by", type=click.Choice(DIMENSIONS), default="agent", show_default=True)
@click.option(
    "--since",
    "days",
    default="1d",
    show_default=True,
    callback=_since,
    metavar="SPAN",
    help="How far back, in whole UTC days including today: 1d, 7d, 24h, 2w.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def usage(settings: Settings, by: str, days: int, as_json: bool) -> None:
    """Requests, outcomes, busy time, tokens and cost, by agent, capability or tenant.

    Every attempt an agent ran is counted: a message retried twice is three requests, and
    RETRIED says how many of them were repeats. Tokens and cost are what agents reported."""

    async def show() -> list[Totals]:
        async with connected(settings) as conn:
            return await usage_totals(conn, by, days, now_ms())

    rows = run(show)
    if as_json:
        document = {"by": by, "days": days, "rows": [row.as_json() for row in rows]}
        click.echo(msgspec.json.encode(document).decode())
        return
    print_usage(rows, by, days)


def print_usage(rows: list[Totals], by: str, days: int) -> None:
    span = "today (UTC)" if days == 1 else f"the last {days} UTC days"
    if not rows:
        click.echo(f"no usage recorded {span}")
        return
    click.echo(f"usage {span}, by {by}")
    click.echo(
        f"{by.upper():<28} {'REQUESTS':>8} {'OK':>7} {'FAILED':>7} {'RETRIED':>7}"
        f" {'BUSY':>9} {'IN TOKENS':>10} {'OUT TOKENS':>10} {'COST':>10}"
    )
    for row in rows:
        f = row.figures
        click.echo(
            f"{row.name[:28]:<28} {int(f['requests']):>8} {int(f['succeeded']):>7}"
            f" {int(f['failed']):>7} {int(f['retried']):>7} {f['busy_ms'] / 1000:>8.1f}s"
            f" {int(f['input_tokens']):>10} {int(f['output_tokens']):>10} {f['cost']:>10.4f}"
        )
    retried = sum(int(row.figures["retried"]) for row in rows)
    if retried:
        click.echo(f"{retried} of these requests were retries: each attempt counts what it used")
