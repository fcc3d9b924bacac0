"""``agent-reach console`` and ``up --console``: the web console's options and start-up."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import click

from broker.config import Settings
from broker.connection import Connection

from ..console.security import TOKEN_ENV, bind_refusal, token_problem
from .common import host_option, redis_options
from .endpoints import listen_options, serve_endpoint

DEFAULT_PORT = 8700


@dataclass(frozen=True, slots=True)
class ConsoleAt:
    host: str
    port: int
    token: str | None


def console_at(host: str, port: int, token: str | None, hint: str) -> ConsoleAt:
    """The console's address, refused here when it would be open to anyone off loopback."""
    token = token or None
    if token is not None and (problem := token_problem(token)):
        raise click.BadParameter(problem, param_hint=hint)
    refusal = bind_refusal(host, token)
    if refusal is not None:
        raise click.UsageError(refusal)
    return ConsoleAt(host, port, token)


async def open_console(stack: AsyncExitStack, conn: Connection, at: ConsoleAt | None) -> None:
    """Serve the console for the life of ``stack`` when it is asked for."""
    if at is not None:
        from ..console.app import console_endpoint

        url = await stack.enter_async_context(console_endpoint(conn, at.host, at.port, at.token))
        click.echo(f"agent-reach: console at {url}", err=True)


def up_console_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = (
        click.option("--console", "console", is_flag=True, help="Also serve the web console."),
        host_option("--console-host", "The console's address."),
        click.option(
            "--console-port",
            type=click.IntRange(0, 65535),
            default=DEFAULT_PORT,
            show_default=True,
            help="The console's port (0: any).",
        ),
        click.option(
            "--console-token",
            envvar=TOKEN_ENV,
            default=None,
            help=f"Required to use the console; needed off loopback (or set {TOKEN_ENV}).",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


@click.command()
@redis_options
@listen_options(DEFAULT_PORT)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    default=None,
    help=f"Required to use the console; needed off loopback (or set {TOKEN_ENV}).",
)
def console(settings: Settings, host: str, port: int, token: str | None) -> None:
    """Serve the web console: overview, agents, messages, dead letters, live; with the
    operator's actions (drain, weight, replay, resolve, cancel). Also serves /metrics."""
    at = console_at(host, port, token, "--token")
    serve_endpoint(settings, lambda stack, conn: open_console(stack, conn, at))
