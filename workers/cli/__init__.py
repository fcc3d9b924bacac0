"""The ``agent-reach`` command line: run the broker and sidecars, send and request, trace,
inspect, repair."""

from __future__ import annotations

import click

from broker.gc_tuning import tune_gc

from ..runtime import configure_logging
from .acl import acl
from .console import console
from .events import events, subscribe, unsubscribe
from .feedback import feedback
from .gateway import a2a_gateway
from .inspect import agents, config, drain, redis_url_command, schema, stats, trace, weight
from .notify import notifier
from .processes import demo, demo_agent, dispatcher, reaper, up
from .repair import cancel, dlq, replay, resolve, stuck
from .send import request, send
from .sidecar import sidecar
from .top import top
from .usage import usage

__all__ = ["main"]


class AgentReach(click.Group):
    """The command group; every argument of every command is text, checked here once."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for position, arg in enumerate(args, start=1):
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError as exc:  # bytes of the command line that are not UTF-8
                shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                raise click.UsageError(
                    f"argument {position} ({shown}) is not UTF-8 text, at character {exc.start}",
                    ctx,
                ) from exc
        return super().parse_args(ctx, args)


@click.group(cls=AgentReach, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="agent-reach")
def main(verbose: int) -> None:
    """Agent-Reach: an asynchronous dispatch broker for multi-agent systems, on Redis Streams."""
    configure_logging(verbose)
    tune_gc()


for command in (
    up,
    dispatcher,
    reaper,
    notifier,
    sidecar,
    demo,
    demo_agent,
    send,
    request,
    trace,
    agents,
    stats,
    top,
    console,
    a2a_gateway,
    weight,
    drain,
    config,
    schema,
    redis_url_command,
    stuck,
    replay,
    resolve,
    dlq,
    cancel,
    events,
    subscribe,
    unsubscribe,
    feedback,
    acl,
    usage,
):
    main.add_command(command)
