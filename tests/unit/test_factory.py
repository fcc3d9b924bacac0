"""The sidecar's parts from its options (``adapters.factory``): each bad option is refused with
the option's name and the reason, and ``agent-reach sidecar`` says it as a usage error."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.a2a_wire import AgentCardView, Skill
from adapters.factory import (
    AgentAddress,
    SidecarOptionError,
    a2a_description,
    agent_address,
    callback_warning,
    load_python_agent,
    make_card,
    make_transport,
)
from adapters.http import HttpAsyncTransport, HttpTransport
from adapters.python import Agent
from broker.envelope import MESSAGE_ID_PATTERN
from broker.records import InstanceCard
from workers.cli import main

# What --python can name: an agent, a function making one, and two that cannot serve.
AGENT = Agent("here")
NOT_AN_AGENT = 42
HERE = __name__


def make_agent() -> Agent:
    return Agent("made")


def broken_agent() -> Agent:
    raise RuntimeError("no model loaded")


def refusal(call: Callable[[], object]) -> SidecarOptionError:
    with pytest.raises(SidecarOptionError) as caught:
        call()
    return caught.value


# -- how the sidecar reaches its agent --------------------------------------------------------


def test_the_adapter_follows_the_option_given() -> None:
    assert agent_address(None, http_url="http://a/", python_spec=None) == AgentAddress(
        "http", "http://a/"
    )
    assert agent_address(None, http_url=None, python_spec="m:x") == AgentAddress("python", "m:x")
    asynchronous = agent_address("http-async", http_url="http://a/", python_spec=None)
    assert asynchronous.endpoint == "http://a/"
    assert AgentAddress("python", "m:x").endpoint == "python:m:x"


@pytest.mark.parametrize(
    ("adapter", "http_url", "python_spec", "said"),
    [
        (None, None, None, "give exactly one of --http URL or --python MODULE:ATTR"),
        (None, "http://a/", "m:x", "give exactly one of --http URL or --python MODULE:ATTR"),
        ("http-async", None, "m:x", "--adapter http-async needs --http URL"),
        ("http", None, "m:x", "--adapter http needs --http URL"),
        ("python", "http://a/", None, "--adapter python needs --python MODULE:ATTR"),
    ],
)
def test_options_that_do_not_combine_are_refused_as_a_whole(
    adapter: str | None, http_url: str | None, python_spec: str | None, said: str
) -> None:
    error = refusal(lambda: agent_address(adapter, http_url=http_url, python_spec=python_spec))
    assert (error.message, error.option) == (said, None)


@pytest.mark.parametrize(
    ("adapter", "http_url", "url", "option"),
    [
        (None, "ftp://x", None, "--http"),
        (None, "", None, "--http"),
        (None, "http://", None, "--http"),
        ("http-async", "http://[::1", None, "--http"),
        (None, "http://127.0.0.1:99999/", None, "--http"),
        ("a2a", None, "https://", "--url"),
        ("mcp", None, "http://h:port/", "--url"),
    ],
)
def test_an_agent_url_that_names_no_http_host_is_refused(
    adapter: str | None, http_url: str | None, url: str | None, option: str
) -> None:
    """Taken, `--http ftp://x` registered an instance whose every call ended DEAD,
    "agent unreachable"."""
    error = refusal(lambda: agent_address(adapter, http_url=http_url, python_spec=None, url=url))

    assert error.option == option and "URL" in error.message


def test_an_unknown_adapter_is_refused_by_name() -> None:
    error = refusal(lambda: agent_address("grpc", http_url="http://a/", python_spec=None))
    assert error.option == "--adapter" and "'grpc'" in error.message


def test_only_an_async_agent_without_a_fixed_id_and_port_is_warned_about() -> None:
    asynchronous = AgentAddress("http-async", "http://a/")
    assert callback_warning(asynchronous, instance_id=None, callback_port=9000)
    assert callback_warning(asynchronous, instance_id="a-1", callback_port=0)
    assert callback_warning(asynchronous, instance_id="a-1", callback_port=9000) is None
    assert (
        callback_warning(AgentAddress("http", "http://a/"), instance_id=None, callback_port=0)
        is None
    )


# -- the card ---------------------------------------------------------------------------------


def card_of(
    *,
    agent_id: str = "order",
    capabilities: Sequence[str] = ("order.query",),
    instance_id: str | None = None,
    tags: dict[str, str] | None = None,
    weight: float = 1.0,
    cost: float = 0.0,
    version: str = "0",
) -> InstanceCard:
    return make_card(
        agent_id=agent_id,
        capabilities=capabilities,
        endpoint="http://a/",
        max_inflight=4,
        instance_id=instance_id,
        tags=tags,
        weight=weight,
        cost=cost,
        version=version,
    )


def test_the_card_carries_the_options_and_a_fresh_instance_id() -> None:
    card = card_of(tags={"region": "eu"}, weight=0.5, cost=2.0)
    assert card.capabilities == ("order.query",) and card.tags == {"region": "eu"}
    assert (card.weight, card.cost, card.max_inflight, card.endpoint) == (0.5, 2.0, 4, "http://a/")
    assert re.fullmatch(r"order-[0-9A-Za-z]{8}", card.instance_id)
    assert card_of().instance_id != card.instance_id
    assert card_of(instance_id="order-7").instance_id == "order-7"
    longest = card_of(agent_id="a" * 128).instance_id  # the default stays an id
    assert re.match(MESSAGE_ID_PATTERN, longest) and longest.startswith("a" * 119 + "-")


@pytest.mark.parametrize(
    ("overrides", "option", "said"),
    [
        ({"capabilities": ("order.query", "Bad")}, "--capability", "domain.action"),
        ({"agent_id": "bad}{"}, "--agent-id", "'bad}{': use 1-128 of letters"),
        ({"instance_id": "a b"}, "--instance-id", "'a b': use 1-128 of letters"),
        ({"version": "1\nfake-1  UP"}, "--version", "1\\nfake-1  UP: no control characters"),
        ({"version": "\x1b]0;title\x07"}, "--version", "no control characters"),
    ],
)
def test_a_bad_card_option_is_refused_by_name(
    overrides: dict[str, Any], option: str, said: str
) -> None:
    error = refusal(lambda: card_of(**overrides))
    assert error.option == option and said in error.message
    assert str(error) == f"{option}: {error.message}"


@settings(database=None, derandomize=True, deadline=None, max_examples=300)
@given(
    agent_id=st.text(max_size=140),
    instance_id=st.none() | st.text(max_size=140),
    capabilities=st.lists(st.text(max_size=40), max_size=3),
)
def test_any_identity_makes_a_card_with_safe_ids_or_is_refused(
    agent_id: str, instance_id: str | None, capabilities: list[str]
) -> None:
    try:
        card = card_of(agent_id=agent_id, instance_id=instance_id, capabilities=capabilities)
    except SidecarOptionError as error:
        assert error.option in {"--agent-id", "--instance-id", "--capability"}
        return
    assert re.match(MESSAGE_ID_PATTERN, card.agent_id)
    assert re.match(MESSAGE_ID_PATTERN, card.instance_id)


# -- the transport ----------------------------------------------------------------------------


async def test_http_adapters_make_http_transports() -> None:
    for adapter, kind in (("http", HttpTransport), ("http-async", HttpAsyncTransport)):
        transport = make_transport(
            AgentAddress(adapter, "http://127.0.0.1:9/"), timeout_s=5.0, max_connections=2
        )
        try:
            assert type(transport) is kind
        finally:
            await transport.aclose()


def test_the_python_adapter_loads_an_agent_or_what_makes_one() -> None:
    assert load_python_agent(f"{HERE}:AGENT") is AGENT
    transport = make_transport(
        AgentAddress("python", f"{HERE}:make_agent"), timeout_s=5.0, max_connections=2
    )
    assert isinstance(transport, Agent) and transport.agent_id == "made"


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("no_attribute", "expected module:attribute"),
        ("agent_reach_no_such_module:x", "cannot load agent_reach_no_such_module:x: No module"),
        (":x", "cannot load :x: "),
        (f"{HERE}:missing", f"cannot load {HERE}:missing: module"),
        (f"{HERE}:broken_agent", f"cannot load {HERE}:broken_agent: no model loaded"),
        (f"{HERE}:NOT_AN_AGENT", f"{HERE}:NOT_AN_AGENT is not an Agent"),
    ],
)
def test_a_python_agent_that_cannot_be_loaded_is_refused_not_a_crash(spec: str, said: str) -> None:
    error = refusal(lambda: load_python_agent(spec))
    assert error.option == "--python" and error.message.startswith(said), error.message


def test_the_command_says_a_refusal_as_a_usage_error() -> None:
    argv = ["sidecar", "--agent-id", "a", "--capability", "a.b"]
    result = CliRunner().invoke(main, [*argv, "--python", f"{HERE}:broken_agent"])
    assert result.exit_code == 2, result.output
    said = f"Invalid value for --python: cannot load {HERE}:broken_agent: no model loaded"
    assert said in result.output
    result = CliRunner().invoke(main, [*argv, "--http", "http://a/", "--adapter", "python"])
    assert result.exit_code == 2
    assert "Error: --adapter python needs --python MODULE:ATTR" in result.output


def test_an_a2a_description_speaks_only_of_the_skills_served() -> None:
    skills = (
        Skill("refund", "Refunds", "gives money back"),
        Skill("ship", "Shipping", "tracks parcels"),
    )
    card = AgentCardView(
        "Shop", "1", "A shop's agent", "http://127.0.0.1:1", "1.0", skills, False, False
    )
    mapped = a2a_description(card, ["refund=payment.refund"], [])
    assert mapped == "A shop's agent\nRefunds: gives money back"
    whole = a2a_description(card, [], ["shop.any"])  # the agent as a whole: every skill
    assert whole == "A shop's agent\nRefunds: gives money back\nShipping: tracks parcels"
