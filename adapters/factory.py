"""A sidecar's parts from its options: how it reaches its agent (:func:`agent_address`), the card
it registers (:func:`make_card`) and its transport (:func:`make_transport`: ``http``,
``http-async`` or ``python``). Each refuses a bad option with a :class:`SidecarOptionError` that
names the option and says why; ``agent-reach sidecar`` only parses its options, calls these and
turns that error into a usage error (exit code 2). A program that runs a :class:`~.Sidecar`
itself builds its parts the same way.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.envelope import MESSAGE_ID_PATTERN, capability_problem
from broker.errors import ReachError, quoted
from broker.events import printable
from broker.ids import new_message_id
from broker.records import MAX_DESCRIPTION_CHARS, MAX_EXAMPLE_CHARS, MAX_EXAMPLES, InstanceCard
from broker.redaction import split_problem, url_without_password
from broker.webhooks import http_url_parts

from .a2a_wire import AgentCardView, skill_capabilities
from .http import HttpAsyncTransport, HttpTransport
from .mcp_wire import Tool, tool_capabilities
from .python import Agent
from .transport import Transport

ADAPTERS = ("http", "http-async", "python", "a2a", "mcp")
URL_ADAPTERS = ("a2a", "mcp")  # reached at --url (a standard agent's URL)


class SidecarOptionError(ReachError):
    """Raised when a sidecar's options cannot make an instance: ``option`` names the one at
    fault (``"--capability"``), ``None`` when the fault is how several combine."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(f"{option}: {message}" if option else message)
        self.message = message
        self.option = option


@dataclass(frozen=True, slots=True)
class AgentAddress:
    """How a sidecar reaches its agent: the ``adapter`` and its ``target``, a URL (``http``,
    ``http-async``) or ``MODULE:ATTR`` naming an in-process :class:`Agent` (``python``)."""

    adapter: str
    target: str

    @property
    def endpoint(self) -> str:
        """What the card registers as the agent's endpoint."""
        return f"python:{self.target}" if self.adapter == "python" else self.target


def agent_address(
    adapter: str | None,
    *,
    http_url: str | None,
    python_spec: str | None,
    url: str | None = None,
) -> AgentAddress:
    """Exactly one of ``http_url`` and ``python_spec``, the one ``adapter`` needs; without an
    ``adapter``, ``http`` for a URL and ``python`` for a ``MODULE:ATTR``. The ``a2a`` adapter
    takes ``url`` (``--url``) and nothing else."""
    if adapter in URL_ADAPTERS or url is not None:
        return _url_address(adapter, url, http_url, python_spec)
    if (http_url is None) == (python_spec is None):
        raise SidecarOptionError("give exactly one of --http URL or --python MODULE:ATTR")
    chosen = adapter or ("http" if http_url is not None else "python")
    if chosen not in ADAPTERS:
        raise SidecarOptionError(f"{chosen!r}: adapters are {', '.join(ADAPTERS)}", "--adapter")
    if (chosen == "python") != (python_spec is not None):
        needs = "--python MODULE:ATTR" if chosen == "python" else "--http URL"
        raise SidecarOptionError(f"--adapter {chosen} needs {needs}")
    if http_url is not None:
        check_http_url(http_url, "--http")
    return AgentAddress(chosen, python_spec if python_spec is not None else http_url or "")


def _url_address(
    adapter: str | None, url: str | None, http_url: str | None, python_spec: str | None
) -> AgentAddress:
    if adapter not in URL_ADAPTERS:
        raise SidecarOptionError(f"--url is for --adapter {' or '.join(URL_ADAPTERS)}", "--url")
    if url is None or http_url is not None or python_spec is not None:
        raise SidecarOptionError(f"--adapter {adapter} needs --url URL (and no --http, --python)")
    check_http_url(url, "--url")
    return AgentAddress(adapter, url)


def check_urls(given: Mapping[str, str | None]) -> None:
    """:func:`check_http_url` on each URL given, by its option (an empty one is none)."""
    for option, url in given.items():
        if url:
            check_http_url(url, option)


def check_http_url(url: str, option: str) -> None:
    """Refuse what is no ``http://`` or ``https://`` URL of a host with a port that parses:
    taken, it registered an instance whose every call failed ("agent unreachable")."""
    shown = quoted(url_without_password(url), length=len(url))  # said back: no secret
    try:
        parts = http_url_parts(url)
    except ValueError as exc:
        raise SidecarOptionError(f"{shown}: not a URL ({split_problem(exc)})", option) from exc
    if parts is None:
        raise SidecarOptionError(f"{shown}: an http:// or https:// URL with a host", option)


def capability_pairs(values: Sequence[str], option: str, left: str) -> dict[str, str]:
    """``--skill`` / ``--tool`` values, ``<name>=domain.action``, as name -> capability."""
    mapping: dict[str, str] = {}
    for pair in values:
        name, sep, capability = pair.partition("=")
        if not sep or not name or not capability:
            raise SidecarOptionError(f"{pair!r}: expected {left}=domain.action", option)
        mapping[name] = capability
    return mapping


def a2a_card_parts(
    card: AgentCardView, skills: Sequence[str], capabilities: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """From an A2A agent's card: the capabilities to register (``--skill SKILL=cap`` pairs,
    ``--capability`` for all) and the tags that carry its name and description."""
    mapping = capability_pairs(skills, "--skill", "SKILL_ID")
    chosen = skill_capabilities(card, mapping, None)
    if isinstance(chosen, str) and not (capabilities and not mapping):
        raise SidecarOptionError(chosen)
    served = list(dict.fromkeys([*(chosen if isinstance(chosen, list) else []), *capabilities]))
    tags = {"a2a.name": card.name[:200], "a2a.protocol": card.protocol}
    if card.description:
        tags["a2a.description"] = card.description[:500]
    return served, tags


def a2a_description(
    card: AgentCardView, skills: Sequence[str] = (), capabilities: Sequence[str] = ()
) -> str:
    """An A2A agent's words for the intent router, within what a card may say: its card's
    description and the name and description of each skill it is registered for — those
    ``--skill`` pairs name, or all of them when ``--capability`` serves the agent whole. A
    skill it does not serve would draw intents to a capability that cannot answer them."""
    named = capability_pairs(skills, "--skill", "SKILL_ID")
    serves = [s for s in card.skills if capabilities or s.id in named]
    parts = [card.description, *(f"{s.name}: {s.description}".strip(": ") for s in serves)]
    return "\n".join(p for p in parts if p.strip())[:MAX_DESCRIPTION_CHARS]


def mcp_tool_parts(
    tools: Sequence[Tool], pairs: Sequence[str], prefix: str | None
) -> dict[str, Tool]:
    """From an MCP server's tools: capability -> tool (``--tool NAME=domain.action`` pairs,
    ``--capability-prefix`` for every tool)."""
    mapping = capability_pairs(pairs, "--tool", "NAME")
    served = tool_capabilities(tools, mapping, prefix)
    if isinstance(served, str):
        raise SidecarOptionError(served)
    for capability in served:
        if problem := capability_problem(capability):
            raise SidecarOptionError(problem, "--tool")
    return served


def make_card(
    *,
    agent_id: str,
    capabilities: Sequence[str],
    endpoint: str,
    max_inflight: int,
    instance_id: str | None = None,
    idempotent: bool = False,
    version: str = "0",
    tags: Mapping[str, str] | None = None,
    weight: float = 1.0,
    cost: float = 0.0,
    status_url: str = "",
    description: str = "",
    examples: Sequence[str] = (),
    rate_ms: float = 0.0,
    burst: int = 1,
) -> InstanceCard:
    """The card an instance registers. Capabilities must read ``domain.action``; the agent id
    and the instance id (default: ``<agent_id>-`` and 8 random characters) are message-id
    safe, as they end up inside key names and hash tags."""
    for capability in capabilities:
        if problem := capability_problem(capability):
            raise SidecarOptionError(problem, "--capability")
    _check_id(agent_id, "--agent-id")
    if instance_id is not None:
        _check_id(instance_id, "--instance-id")
    _check_words(description, examples)
    if printable(version) != version:  # an operator's terminal shows it (`agents`)
        raise SidecarOptionError(f"{printable(version)}: no control characters", "--version")
    return InstanceCard(
        agent_id=agent_id,
        instance_id=instance_id or default_instance_id(agent_id),
        capabilities=tuple(capabilities),
        endpoint=endpoint,
        max_inflight=max_inflight,
        idempotent=idempotent,
        version=version,
        tags=dict(tags or {}),
        weight=weight,
        cost=cost,
        status_url=status_url,
        description=description,
        examples=tuple(examples),
        rate_ms=rate_ms,
        burst=burst,
    )


def default_instance_id(agent_id: str) -> str:
    """``<agent_id>-`` and 8 random characters, the agent id cut so the whole stays an id (at
    most 128): a longest agent id made an instance id every dispatcher left out."""
    return f"{agent_id[:119]}-{new_message_id()[-8:]}"


def _check_words(description: str, examples: Sequence[str]) -> None:
    """The card's words for the intent router, within what a dispatcher reads of them."""
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise SidecarOptionError(f"at most {MAX_DESCRIPTION_CHARS} characters", "--describe")
    if len(examples) > MAX_EXAMPLES:
        raise SidecarOptionError(f"at most {MAX_EXAMPLES} examples", "--example")
    if any(len(e) > MAX_EXAMPLE_CHARS for e in examples):
        raise SidecarOptionError(f"at most {MAX_EXAMPLE_CHARS} characters each", "--example")


def _check_id(value: str, option: str) -> None:
    if not re.match(MESSAGE_ID_PATTERN, value):
        raise SidecarOptionError(f"{value!r}: use 1-128 of letters, digits and _ . : -", option)


def callback_warning(
    address: AgentAddress, *, instance_id: str | None, callback_port: int
) -> str | None:
    """Why callbacks handed out now may miss this sidecar after a restart, or ``None``: an
    ``http-async`` callback URL holds the instance id and the port, so both must stay put."""
    if address.adapter == "http-async" and (instance_id is None or callback_port == 0):
        return (
            "callbacks handed out now reach a restarted sidecar only under the same "
            "--instance-id and --callback-port; give both"
        )
    return None


def make_transport(address: AgentAddress, *, timeout_s: float, max_connections: int) -> Transport:
    """The transport to the agent at ``address``: an HTTP client (``max_connections``, each
    call bounded by ``timeout_s``), or the in-process agent, loaded."""
    if address.adapter == "python":
        return load_python_agent(address.target)
    if address.adapter in URL_ADAPTERS:
        raise SidecarOptionError(
            f"the {address.adapter} transport is made from what the agent says"
        )
    http = HttpAsyncTransport if address.adapter == "http-async" else HttpTransport
    return http(address.target, timeout_s=timeout_s, max_connections=max_connections)


def load_python_agent(spec: str) -> Agent:
    """The :class:`Agent` that ``MODULE:ATTR`` names, or that calling it returns. Whatever
    importing the module or making the agent raises is a refusal of ``--python``, not a
    crash: it is the user's code."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise SidecarOptionError("expected module:attribute", "--python")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
        agent = target() if callable(target) and not isinstance(target, Agent) else target
    except Exception as exc:
        raise SidecarOptionError(f"cannot load {spec}: {exc}", "--python") from exc
    if not isinstance(agent, Agent):
        raise SidecarOptionError(f"{spec} is not an Agent", "--python")
    return agent
