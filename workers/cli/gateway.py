"""``agent-reach a2a-gateway`` and ``up --a2a``: Agent-Reach as one A2A agent
(:mod:`workers.a2a_gateway`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import click

from broker.config import Settings
from broker.connection import Connection

from ..console.security import is_loopback
from .common import host_option, redis_options
from .endpoints import listen_options, serve_endpoint

DEFAULT_PORT = 8701
API_KEY_ENV = "AGENT_REACH_A2A_API_KEY"


@dataclass(frozen=True, slots=True)
class GatewayAt:
    host: str
    port: int
    api_key: str | None
    public_url: str | None = None


def gateway_at(host: str, port: int, api_key: str | None, public_url: str | None) -> GatewayAt:
    """The gateway's address, refused when it would take requests off loopback unkeyed."""
    api_key = api_key or None
    if api_key is not None and len(api_key) < 16:
        raise click.BadParameter("use at least 16 characters", param_hint="--api-key")
    if not is_loopback(host) and api_key is None:
        raise click.UsageError(
            f"the A2A gateway would listen on {host} with no API key: give --api-key "
            f"(or {API_KEY_ENV}) to listen off loopback"
        )
    return GatewayAt(host, port, api_key, public_url)


async def open_gateway(stack: AsyncExitStack, conn: Connection, at: GatewayAt | None) -> None:
    """Serve the gateway for the life of ``stack`` when it is asked for."""
    if at is not None:
        from ..a2a_gateway import gateway_endpoint

        endpoint = gateway_endpoint(conn, at.host, at.port, at.api_key, at.public_url)
        url = await stack.enter_async_context(endpoint)
        click.echo(
            f"agent-reach: A2A gateway at {url} (card: {url}.well-known/agent-card.json)", err=True
        )


def up_a2a_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``up``'s gateway options, passed to ``command`` as one ``a2a_at`` (``None``: off)."""

    @functools.wraps(command)
    def with_gateway(
        *args: Any, a2a: bool, a2a_host: str, a2a_port: int, a2a_api_key: str | None, **kwargs: Any
    ) -> Any:
        at = gateway_at(a2a_host, a2a_port, a2a_api_key, None) if a2a else None
        return command(*args, a2a_at=at, **kwargs)

    options = (
        click.option("--a2a", is_flag=True, help="Also serve the A2A gateway."),
        host_option("--a2a-host", "Its address."),
        click.option(
            "--a2a-port",
            type=click.IntRange(0, 65535),
            default=DEFAULT_PORT,
            show_default=True,
            help="Its port (0: any).",
        ),
        click.option(
            "--a2a-api-key",
            envvar=API_KEY_ENV,
            default=None,
            help=f"The key A2A clients send in X-API-Key; needed off loopback ({API_KEY_ENV}).",
        ),
    )
    wrapped: Callable[..., Any] = with_gateway
    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped


@click.command("a2a-gateway")
@redis_options
@listen_options(DEFAULT_PORT)
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    default=None,
    help=f"The key A2A clients send in X-API-Key; needed off loopback (or set {API_KEY_ENV}).",
)
@click.option(
    "--public-url", default=None, metavar="URL", help="The URL clients reach it at (its card's)."
)
def a2a_gateway(
    settings: Settings, host: str, port: int, api_key: str | None, public_url: str | None
) -> None:
    """Serve Agent-Reach as one A2A agent: every capability a skill; SendMessage, GetTask,
    CancelTask, SendStreamingMessage over JSON-RPC."""
    at = gateway_at(host, port, api_key, public_url)
    serve_endpoint(settings, lambda stack, conn: open_gateway(stack, conn, at))
