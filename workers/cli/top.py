"""``agent-reach top``: the overview and the agents, live in the terminal (``q`` quits)."""

from __future__ import annotations

import os
import sys
import termios
import tty
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from broker.config import Settings
from broker.errors import RedisUnavailable

from ..overview import TOTALS, Overview, Readings, read_overview
from ..runtime import connected
from .common import FiniteRange, redis_options, run


def render(view: Overview) -> Group:
    """The screen: totals and rates, waiting per capability, and every instance."""
    head = Text.assemble(
        ("agent-reach top", "bold"),
        "  ",
        *(
            f"{name.lower()} {view.totals.get(name, 0)} ({_per_s(view.rates.get(name))})  "
            for name in TOTALS
        ),
        f"dlq {view.dlq_entries}  needs confirmation {view.needs_confirmation}   q: quit",
    )
    waiting = Table("capability", "waiting", "unmatched", "oldest", "assigned/s", "instances")
    for c in view.capabilities:
        oldest = "-" if c.oldest_waiting_s is None else f"{c.oldest_waiting_s:.1f}s"
        waiting.add_row(
            c.capability,
            str(c.waiting),
            str(c.unmatched),
            oldest,
            f"{c.assigned_per_s:.2f}",
            str(c.instances),
        )
    agents = Table(
        "instance", "state", "reach", "credits", "errors", "p95", "circuit", "beat", "ver", "wt"
    )
    for a in view.agents:
        agents.add_row(
            a.instance,
            a.state,
            f"{a.reach:.3f}",
            f"{a.in_use}/{a.effective}/{a.declared}",
            f"{a.error_rate:.0%}",
            f"{a.p95_ms:.0f}ms",
            a.circuit,
            f"{a.heartbeat_age_s:.1f}s",
            a.version,
            f"{a.weight:g}",
        )
    return Group(head, waiting, agents)


def _per_s(rate: float | None) -> str:
    """A rate, or "-" where none is known (the first reading, the first after an outage)."""
    return "-/s" if rate is None else f"{rate:.1f}/s"


def render_away(last: Overview | None, exc: RedisUnavailable) -> Group:
    """Redis away (a restart, a failover): said on top of the last screen, which stays as it
    was read — ``top`` goes on, and shows live figures again once Redis is back."""
    said = Text(f"Redis is unavailable ({exc}); the figures below are from before", style="bold")
    return Group(said, *(render(last).renderables if last is not None else ()))


@contextmanager
def keys_one_at_a_time() -> Iterator[bool]:
    """The terminal in cbreak mode (a key arrives without Enter); whether stdin is one."""
    if not os.isatty(sys.stdin.fileno()):
        yield False
        return
    saved = termios.tcgetattr(sys.stdin.fileno())
    tty.setcbreak(sys.stdin.fileno())
    try:
        yield True
    finally:
        termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)


async def wait_for_q() -> None:
    """Return when ``q`` is typed (never, without a terminal: stop it with Ctrl-C)."""
    while True:
        await anyio.wait_readable(sys.stdin.fileno())
        key = os.read(sys.stdin.fileno(), 1)
        if key in (b"q", b"Q", b""):
            return


@click.command()
@redis_options
@click.option(
    "--interval",
    type=FiniteRange(0.2, 86400),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
def top(settings: Settings, interval: float) -> None:
    """A live view of the broker: totals and rates, waiting work, every instance (q quits)."""

    async def show() -> None:
        console = Console()
        async with connected(settings) as conn, anyio.create_task_group() as tg:
            with keys_one_at_a_time() as interactive:
                if interactive:
                    tg.start_soon(_quit_on_q, tg.cancel_scope)
                readings = Readings()
                with Live(console=console, auto_refresh=False) as live:
                    while True:
                        try:
                            current = readings.read(await read_overview(conn))
                        except RedisUnavailable as exc:
                            readings.lost()
                            live.update(render_away(readings.last, exc), refresh=True)
                            await anyio.sleep(interval)
                            continue
                        live.update(render(current), refresh=True)
                        await anyio.sleep(interval)

    run(show)


async def _quit_on_q(scope: anyio.CancelScope) -> None:
    await wait_for_q()
    scope.cancel()
