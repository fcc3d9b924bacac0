"""``agent-reach sidecar``: its options, and the parts it builds from them
(:mod:`adapters.factory`); a standard agent (``--adapter a2a``) is read from its card first."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import click

from adapters.a2a import A2ATransport, CardError, fetch_card, status_url
from adapters.factory import (
    ADAPTERS,
    AgentAddress,
    SidecarOptionError,
    a2a_card_parts,
    a2a_description,
    agent_address,
    callback_warning,
    check_urls,
    make_card,
    make_transport,
    mcp_tool_parts,
)
from adapters.mcp import McpTransport, ServerError, fetch_tools
from adapters.transport import Transport
from broker.config import Settings
from broker.governance import parse_rate

from .common import FiniteRange, host_option, parse_tags, redis_options, run
from .processes import metrics_options, serve_sidecar


def _rate_option(ctx: click.Context, param: click.Parameter, value: str | None) -> float:
    """``--rate``'s emission interval in ms (0: no limit)."""
    if value is None:
        return 0.0
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def card_fields(
    standard: StandardAgent | None,
    capabilities: tuple[str, ...],
    version: str,
    tag_options: tuple[str, ...],
    status_url: str,
    idempotent: bool | None,
    words: tuple[str, tuple[str, ...]] = ("", ()),
) -> dict[str, Any]:
    """What the command line says of the card, or a standard agent's card where it says
    more (its capabilities, its version unless ``--version`` is given, its status query, its
    description unless ``--describe`` is given). ``words``: ``--describe`` and ``--example``."""
    tags = parse_tags(tag_options)
    description, examples = words
    if standard is None:
        if not capabilities:
            raise SidecarOptionError("give at least one --capability", "--capability")
        return {
            "capabilities": capabilities,
            "version": version,
            "tags": tags,
            "status_url": status_url,
            "idempotent": bool(idempotent),
            "description": description,
            "examples": examples,
        }
    return {
        "idempotent": standard.idempotent if idempotent is None else idempotent,
        "capabilities": standard.capabilities,
        "version": standard.version if version == "0" else version,
        "tags": {**standard.tags, **tags},
        "status_url": standard.status_url,
        "description": description or standard.description,
        "examples": examples,
    }


@dataclass(frozen=True, slots=True)
class StandardAgent:
    """What a standard agent's card gives the sidecar."""

    capabilities: tuple[str, ...]
    version: str
    tags: dict[str, str]
    status_url: str
    transport: Transport
    idempotent: bool  # what the agent says of itself (MCP: every tool's idempotentHint)
    description: str = ""  # A2A: the card's and its skills' descriptions


@dataclass(frozen=True, slots=True)
class Named:
    """What the command line says of a standard agent: where, and its skills or tools."""

    url: str | None
    skills: tuple[str, ...]
    tools: tuple[str, ...]
    prefix: str | None


STANDARD_OPTIONS = (
    click.option("--url", "agent_url", metavar="URL", help="A standard agent's URL (a2a, mcp)."),
    click.option(
        "--skill",
        "skills",
        multiple=True,
        metavar="SKILL_ID=domain.action",
        help="a2a: serve the card's skill as this capability (repeatable).",
    ),
    click.option(
        "--tool",
        "tool_pairs",
        multiple=True,
        metavar="NAME=domain.action",
        help="mcp: serve the server's tool as this capability (repeatable).",
    ),
    click.option(
        "--capability-prefix",
        default=None,
        metavar="DOMAIN",
        help="mcp: serve every tool as DOMAIN.<tool name>.",
    ),
)


def standard_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options that name a standard agent, passed to ``command`` as one ``named``."""

    @functools.wraps(command)
    def with_named(
        *args: Any,
        agent_url: str | None,
        skills: tuple[str, ...],
        tool_pairs: tuple[str, ...],
        capability_prefix: str | None,
        **kwargs: Any,
    ) -> Any:
        named = Named(agent_url, skills, tool_pairs, capability_prefix)
        return command(*args, named=named, **kwargs)

    wrapped: Callable[..., Any] = with_named
    for option in reversed(STANDARD_OPTIONS):
        wrapped = option(wrapped)
    return wrapped


def standard_agent(
    address: AgentAddress,
    named: Named,
    capabilities: tuple[str, ...],
    settings: Settings,
    max_inflight: int,
) -> StandardAgent | None:
    """A standard agent read (its A2A card, its MCP tools; one that cannot be read stops
    start-up with the reason) and its parts made; ``None`` for the other adapters."""
    if address.adapter != "a2a" and named.skills:
        raise SidecarOptionError("--skill is for --adapter a2a", "--skill")
    if address.adapter != "mcp" and (named.tools or named.prefix):
        raise SidecarOptionError("--tool and --capability-prefix are for --adapter mcp")
    timeout_s, url = settings.sync_call_timeout_s, address.target
    try:
        if address.adapter == "a2a":
            card = anyio.run(fetch_card, url)
            served, tags = a2a_card_parts(card, named.skills, capabilities)
            transport: Transport = A2ATransport(
                card, timeout_s=timeout_s, max_connections=max_inflight
            )
            return StandardAgent(
                tuple(served),
                card.version or "0",
                tags,
                status_url(card),
                transport,
                False,
                a2a_description(card, named.skills, capabilities),
            )
        if address.adapter == "mcp":
            tools = mcp_tool_parts(anyio.run(fetch_tools, url), named.tools, named.prefix)
            transport = McpTransport(url, tools, timeout_s=timeout_s, max_connections=max_inflight)
            idempotent = all(t.idempotent for t in tools.values())
            return StandardAgent(tuple(tools), "0", {"mcp.url": url}, "", transport, idempotent)
    except (CardError, ServerError) as exc:
        raise click.ClickException(f"cannot start the sidecar: {exc}") from exc
    return None


# The sidecar's options, as data: the command below is what it does with them.
SIDECAR_OPTIONS = (
    click.option("--agent-id", required=True, help="The agent this instance belongs to."),
    click.option(
        "--capability",
        "capabilities",
        multiple=True,
        help="A capability served, e.g. order.query (repeatable; a2a: every skill serves it).",
    ),
    click.option(
        "--adapter",
        type=click.Choice(ADAPTERS),
        default=None,
        help="How to reach the agent (default: http with --http, python with --python). "
        "http-async: the agent answers 202 and POSTs its result to this sidecar's callback "
        "endpoint later. a2a: an Agent2Agent agent at --url, read from its card.",
    ),
    click.option(
        "--http", "http_url", metavar="URL", help="The agent's HTTP endpoint (http, http-async)."
    ),
    click.option(
        "--python",
        "python_spec",
        metavar="MODULE:ATTR",
        help="An in-process Agent (python adapter).",
    ),
    click.option(
        "--max-inflight",
        type=click.IntRange(1, 100_000),
        default=8,
        show_default=True,
        help="Credits: the most unfinished messages this instance holds.",
    ),
    click.option(
        "--idempotent/--not-idempotent",
        default=None,
        help="The agent may safely run a message twice (default: no; mcp: when every tool "
        "served says idempotentHint).",
    ),
    click.option("--instance-id", default=None, help="Instance id (default: AGENT_ID-random)."),
    click.option("--version", "version", default="0", show_default=True, help="Agent version."),
    click.option(
        "--weight",
        type=FiniteRange(0, 1000),
        default=1.0,
        show_default=True,
        help="Routing weight (e.g. 0.11 beside 1.0 for a 10 % canary).",
    ),
    click.option(
        "--tag", "tags", multiple=True, metavar="KEY=VALUE", help="Routing tag (repeatable)."
    ),
    click.option("--status-url", default="", metavar="URL", help="The agent's status endpoint."),
    click.option(
        "--cost",
        type=FiniteRange(0, 1e12),  # as an envelope's budget_per_task
        default=0.0,
        show_default=True,
        help="Cost per call, for routing under a budget.",
    ),
    click.option(
        "--rate",
        "rate_ms",
        default=None,
        callback=_rate_option,
        metavar="N/UNIT",
        help="Call the agent at most this often, e.g. 10/s or 600/min (default: no limit).",
    ),
    click.option(
        "--burst",
        type=click.IntRange(1, 1_000_000),
        default=1,
        show_default=True,
        help="With --rate: calls that may start at once.",
    ),
    click.option(
        "--credits",
        "credits_mode",
        type=click.Choice(["adaptive", "static"]),
        default="adaptive",
        show_default=True,
        help="adaptive: the credit limit follows the agent's latency, between 1 and "
        "--max-inflight; static: always --max-inflight.",
    ),
    host_option("--callback-host", "http-async: the address the callback endpoint listens on."),
    click.option(
        "--callback-port",
        type=click.IntRange(0, 65535),
        default=0,
        show_default=True,
        help="http-async: the callback endpoint's port (0: any free one).",
    ),
    click.option(
        "--callback-public-url",
        default=None,
        metavar="URL",
        help="http-async: the callback endpoint's URL as agents reach it, when not "
        "http://HOST:PORT (behind a proxy or NAT).",
    ),
    click.option(
        "--grace",
        "grace_s",
        type=FiniteRange(0, 86400),
        default=None,
        help="Seconds to finish in-flight work on SIGTERM (default: drain_grace_s, 40).",
    ),
)


WORDS_OPTIONS = (
    click.option(
        "--describe",
        "description",
        default="",
        metavar="TEXT",
        help="What the agent does, in words: intents are routed by it (a2a: the card's).",
    ),
    click.option(
        "--example",
        "examples",
        multiple=True,
        metavar="TEXT",
        help="A request the agent serves, in words, for intent routing (repeatable).",
    ),
)


def words_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--describe`` and ``--example``, passed to ``command`` as one ``words`` pair: what
    the card says of the agent for the intent router."""

    @functools.wraps(command)
    def with_words(*args: Any, description: str, examples: tuple[str, ...], **kwargs: Any) -> Any:
        return command(*args, words=(description, examples), **kwargs)

    wrapped: Callable[..., Any] = with_words
    for option in reversed(WORDS_OPTIONS):
        wrapped = option(wrapped)
    return wrapped


def routing_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--weight``, ``--cost``, ``--rate`` and ``--burst``, passed to ``command`` as one
    ``routing`` dict: what the card says to the routers."""

    @functools.wraps(command)
    def with_routing(
        *args: Any, weight: float, cost: float, rate_ms: float, burst: int, **kwargs: Any
    ) -> Any:
        routing = {"weight": weight, "cost": cost, "rate_ms": rate_ms, "burst": burst}
        return command(*args, routing=routing, **kwargs)

    return with_routing


def sidecar_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The ``sidecar`` command's options, in the order ``--help`` lists them (the card's
    words, ``--describe`` and ``--example``, last)."""
    command = words_options(routing_options(command))
    for option in reversed(SIDECAR_OPTIONS):
        command = option(command)
    return command


@click.command()
@redis_options
@sidecar_options
@standard_options
@metrics_options
def sidecar(
    settings: Settings,
    named: Named,
    agent_id: str,
    capabilities: tuple[str, ...],
    adapter: str | None,
    http_url: str | None,
    python_spec: str | None,
    max_inflight: int,
    idempotent: bool | None,
    instance_id: str | None,
    version: str,
    tags: tuple[str, ...],
    status_url: str,
    words: tuple[str, tuple[str, ...]],
    routing: dict[str, Any],
    credits_mode: str,
    callback_host: str,
    callback_port: int,
    callback_public_url: str | None,
    grace_s: float | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run a sidecar for one agent instance: register, heartbeat, consume, deliver."""
    try:
        check_urls({"--status-url": status_url, "--callback-public-url": callback_public_url})
        address = agent_address(adapter, http_url=http_url, python_spec=python_spec, url=named.url)
        standard = standard_agent(address, named, capabilities, settings, max_inflight)
        card = make_card(
            agent_id=agent_id,
            endpoint=address.endpoint,
            max_inflight=max_inflight,
            instance_id=instance_id,
            **routing,
            **card_fields(standard, capabilities, version, tags, status_url, idempotent, words),
        )
        transport = _transport(
            settings, address, max_inflight, instance_id, callback_port, standard
        )
    except SidecarOptionError as exc:
        raise usage_error(exc) from exc
    run(
        serve_sidecar,
        settings,
        card,
        transport,
        grace_s=settings.drain_grace_s if grace_s is None else grace_s,
        adaptive_credits=credits_mode == "adaptive",
        callback_host=callback_host,
        callback_port=callback_port,
        callback_public_url=callback_public_url,
        metrics=(metrics_host, metrics_port),
    )


def _transport(
    settings: Settings,
    address: AgentAddress,
    max_inflight: int,
    instance_id: str | None,
    callback_port: int,
    standard: StandardAgent | None,
) -> Transport:
    """The agent's transport (a standard agent's, made from its card), after a warning about
    how its callbacks are set up, if any."""
    if standard is not None:
        return standard.transport
    warning = callback_warning(address, instance_id=instance_id, callback_port=callback_port)
    if warning:
        click.echo(f"agent-reach: warning: {warning}", err=True)
    return make_transport(
        address, timeout_s=settings.sync_call_timeout_s, max_connections=max_inflight
    )


def usage_error(exc: SidecarOptionError) -> click.UsageError:
    """The factory's refusal as click says it: ``Invalid value for --OPTION: ...`` when one
    option is at fault, the bare message when it is how they combine; exit code 2 either way."""
    if exc.option is None:
        return click.UsageError(exc.message)
    return click.BadParameter(exc.message, param_hint=exc.option)
