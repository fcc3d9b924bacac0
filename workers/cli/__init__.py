"""The ``agent-reach`` command line: run the broker and sidecars, send and request, trace,
inspect, repair.

A command's module is imported when the command runs (or when help lists it), not before:
importing every command's module took about 0.7 s, twice what a command such as ``stats``
needs, and every invocation paid it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

import click

from broker.gc_tuning import tune_gc

from ..runtime import configure_logging

__all__ = ["main"]

# every command: its name, the module of this package that defines it, and its attribute there
# (tests/e2e/test_cli.py checks each against the command's own name)
COMMANDS: dict[str, tuple[str, str]] = {
    "a2a-gateway": ("gateway", "a2a_gateway"),
    "acl": ("acl", "acl"),
    "agents": ("inspect", "agents"),
    "cancel": ("repair", "cancel"),
    "config": ("inspect", "config"),
    "console": ("console", "console"),
    "demo": ("processes", "demo"),
    "demo-agent": ("processes", "demo_agent"),
    "dispatcher": ("processes", "dispatcher"),
    "dlq": ("repair", "dlq"),
    "drain": ("inspect", "drain"),
    "events": ("events", "events"),
    "feedback": ("feedback", "feedback"),
    "notifier": ("notify", "notifier"),
    "reaper": ("processes", "reaper"),
    "redis-url": ("inspect", "redis_url_command"),
    "replay": ("repair", "replay"),
    "request": ("send", "request"),
    "resolve": ("repair", "resolve"),
    "schema": ("inspect", "schema"),
    "send": ("send", "send"),
    "sidecar": ("sidecar", "sidecar"),
    "stats": ("inspect", "stats"),
    "stuck": ("repair", "stuck"),
    "subscribe": ("events", "subscribe"),
    "top": ("top", "top"),
    "trace": ("inspect", "trace"),
    "unsubscribe": ("events", "unsubscribe"),
    "up": ("processes", "up"),
    "usage": ("usage", "usage"),
    "weight": ("inspect", "weight"),
}


class Commands(MutableMapping[str, click.Command]):
    """The group's commands by name (click's ``Group.commands``): a command's module is
    imported when the command is looked up. Listing them, or matching a mistyped name
    against them (click's "Did you mean"), imports nothing."""

    def __init__(self) -> None:
        self._added: dict[str, click.Command] = {}  # by add_command, as in any click group

    def __getitem__(self, name: str) -> click.Command:
        if name in self._added:
            return self._added[name]
        module, attribute = COMMANDS[name]  # KeyError: no such command
        command: click.Command = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
        return command

    def __contains__(self, name: object) -> bool:
        return name in self._added or name in COMMANDS

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(COMMANDS.keys() | self._added.keys()))

    def __len__(self) -> int:
        return len(COMMANDS.keys() | self._added.keys())

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._added[name] = command

    def __delitem__(self, name: str) -> None:
        del self._added[name]


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


@click.group(
    cls=AgentReach, commands=Commands(), context_settings={"help_option_names": ["-h", "--help"]}
)
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="agent-reach")
def main(verbose: int) -> None:
    """Agent-Reach: an asynchronous dispatch broker for multi-agent systems, on Redis Streams."""
    configure_logging(verbose)
    tune_gc()
