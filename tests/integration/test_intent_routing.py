"""Intent routing with a real Redis, a real dispatcher and real HTTP agents whose sidecars
describe them (``--describe``, ``--example``) or an SDK-built A2A agent's card: the lexical
layer, rules and their priorities, an embeddings server on loopback (the configured model,
the "today" pitfall, the fallback when it is gone), the cheapest of close candidates,
``intent_unmatched``, and feedback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.a2a import A2ATransport
from adapters.asgi import serve_app
from adapters.factory import agent_address, make_card
from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import Settings, build_settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.feedback import RATED
from broker.governance import IntentRule
from broker.intent import CapabilityProfile, cosine, profile_text, tokens
from broker.stages import Stage
from broker.store import MessageStore
from broker.wire import route_steps
from tests.support.a2a_agents import a2a_agent
from tests.support.agents import RunningAgent, http_agent
from tests.support.embeddings import embed, embeddings_server
from tests.support.harness import collect_replies, eventually, running_dispatcher
from workers.cli import main
from workers.cli.sidecar import Named, card_fields, standard_agent
from workers.intent_embeddings import EmbeddingFailure, EmbeddingScorer
from workers.intent_resolver import IntentResolver

REFUND = "Refund or reimburse a customer's payment, today or later"
WEATHER = "Tell the weather forecast for today or tomorrow, for any city"


def intent_envelope(intent: str, reply_to: str) -> Envelope:
    raw = msgspec.json.encode({"intent": intent, "reply_to": reply_to, "payload": {"q": intent}})
    return msgspec.json.decode(raw, type=Envelope)


@asynccontextmanager
async def described_sidecar(
    conn: Connection,
    instance_id: str,
    capability: str,
    description: str,
    url: str,
    *,
    examples: tuple[str, ...] = (),
    cost: float = 0.0,
) -> AsyncIterator[Sidecar]:
    """A sidecar whose card says what its agent does, as ``agent-reach sidecar --describe``
    and ``--example`` put it there."""
    card = make_card(
        agent_id=instance_id.split("-")[0],
        instance_id=instance_id,
        capabilities=[capability],
        endpoint=url,
        max_inflight=4,
        cost=cost,
        description=description,
        examples=examples,
    )
    transport = HttpTransport(url, timeout_s=30, max_connections=4)
    sidecar = Sidecar(conn, card, transport, grace_s=2.0)
    async with anyio.create_task_group() as tg:
        await tg.start(sidecar.run)
        yield sidecar
        tg.cancel_scope.cancel()
    await transport.aclose()


@asynccontextmanager
async def fleet(conn: Connection) -> AsyncIterator[tuple[RunningAgent, RunningAgent]]:
    """Two agents, refunds and the weather, both described, and a dispatcher."""
    async with (
        http_agent("payments") as payments,
        http_agent("weather") as weather,
        described_sidecar(conn, "payments-1", "payment.refund", REFUND, payments.url),
        described_sidecar(conn, "weather-1", "weather.forecast", WEATHER, weather.url),
        running_dispatcher(conn),
    ):
        yield payments, weather


async def ask(conn: Connection, *intents: str) -> dict[str, Any]:
    """Submit each intent; their answers, by intent."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    ids = {await client.submit(intent_envelope(i, reply_to)): i for i in intents}
    results = await collect_replies(conn, reply_to, len(ids), timeout_s=30)
    return {ids[message_id]: result for message_id, result in results.items()}


async def intent_step(conn: Connection, message_id: str) -> tuple[dict[str, Any], str]:
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None and record.route_from is not None
    steps = route_steps(record.route_from)
    assert steps[0]["step"] == "intent", steps
    return steps[0], record.route_reason or ""


@asynccontextmanager
async def connected_with(conn: Connection, **changes: Any) -> AsyncIterator[Connection]:
    settings: Settings = msgspec.structs.replace(conn.settings, **changes)
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as changed:
        yield changed


@asynccontextmanager
async def configured(conn: Connection, **keys: Any) -> AsyncIterator[Connection]:
    """A connection whose settings add ``keys`` as a config file would: read and checked
    by :func:`build_settings` (``intent_rules`` as plain tables, ``embedding_model``...)."""
    settings = build_settings([msgspec.to_builtins(conn.settings), keys])
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as changed:
        yield changed


@dataclass(frozen=True)
class Described:
    """An HTTP agent behind a described sidecar: its capability, words and declared cost."""

    name: str
    capability: str
    description: str
    examples: tuple[str, ...] = ()
    cost: float = 0.0


@asynccontextmanager
async def described_fleet(
    conn: Connection, *agents: Described
) -> AsyncIterator[dict[str, RunningAgent]]:
    """Each agent on loopback behind its described sidecar, and a dispatcher: the agents by
    name."""
    async with AsyncExitStack() as stack:
        running = {}
        for agent in agents:
            running[agent.name] = served = await stack.enter_async_context(http_agent(agent.name))
            await stack.enter_async_context(
                described_sidecar(
                    conn,
                    f"{agent.name}-1",
                    agent.capability,
                    agent.description,
                    served.url,
                    examples=agent.examples,
                    cost=agent.cost,
                )
            )
        await stack.enter_async_context(running_dispatcher(conn))
        yield running


async def test_an_intent_is_routed_by_the_lexical_layer_and_succeeds(conn: Connection) -> None:
    async with fleet(conn) as (payments, weather):
        answers = await ask(conn, "can I get reimbursed today?", "what's the weather today?")
    refund, forecast = answers["can I get reimbursed today?"], answers["what's the weather today?"]
    assert refund.stage is Stage.SUCCEEDED and refund.result["agent"] == "payments"
    assert forecast.stage is Stage.SUCCEEDED and forecast.result["agent"] == "weather"
    assert payments.log.total == 1 and weather.log.total == 1
    step, reason = await intent_step(conn, refund.id)
    assert step["layer"] == "semantic" and step["scorer"] == "lexical"
    assert step["capability"] == "payment.refund" and step["score"] >= 0.85
    assert step["candidates"]["weather.forecast"] < 0.55  # "today" is in both: it weighs little
    assert reason.startswith("intent -> payment.refund by the semantic layer (lexical): score")
    record = await MessageStore(conn).get_record(refund.id)
    assert record is not None and record.capability == "payment.refund"
    url = conn.settings.redis_url
    assert url is not None
    traced = await anyio.to_thread.run_sync(
        lambda: CliRunner().invoke(
            main, ["trace", refund.id, "--redis", url, "--prefix", conn.keys.prefix]
        )
    )
    assert traced.exit_code == 0, traced.output
    assert "intent     kept 1    weather.forecast: score" in traced.output


async def test_send_takes_an_intent_in_place_of_a_capability(conn: Connection) -> None:
    url = conn.settings.redis_url
    assert url is not None
    argv = ["send", "--intent", "can I get reimbursed today?", "--payload", '{"order": 7}']
    argv += ["--wait", "--timeout", "10", "--redis", url, "--prefix", conn.keys.prefix]
    async with fleet(conn) as (payments, weather):
        sent = await anyio.to_thread.run_sync(lambda: CliRunner().invoke(main, argv))
    assert sent.exit_code == 0, sent.output
    answer = msgspec.json.decode(sent.output)
    assert answer["stage"] == "SUCCEEDED" and answer["result"]["agent"] == "payments"
    assert payments.log.total == 1 and weather.log.total == 0
    step, _ = await intent_step(conn, answer["id"])
    assert step["capability"] == "payment.refund"


async def test_an_unmatched_intent_is_rejected_naming_the_nearest(conn: Connection) -> None:
    async with fleet(conn) as (payments, weather):
        (answer,) = (await ask(conn, "is the bank open on sunday?")).values()
    assert answer.stage is Stage.REJECTED
    assert answer.error is not None and answer.error.startswith("intent_unmatched")
    assert "payment.refund" in answer.error and "weather.forecast" in answer.error
    assert payments.log.total == weather.log.total == 0
    record = await MessageStore(conn).get_record(answer.id)
    assert record is not None and record.stage is Stage.REJECTED


async def test_a_rule_beats_the_semantic_layer(conn: Connection) -> None:
    rules = [IntentRule(match=r"\btoday\b", capability="weather.forecast", priority=5)]
    async with connected_with(conn, intent_rules=rules) as ruled, fleet(ruled):
        (answer,) = (await ask(ruled, "can I get reimbursed today?")).values()
    assert answer.stage is Stage.SUCCEEDED and answer.result["agent"] == "weather"
    step, reason = await intent_step(conn, answer.id)
    assert step["layer"] == "rules" and step["capability"] == "weather.forecast"
    assert reason.startswith("intent rule 0")


async def test_the_semantic_layer_uses_embeddings_and_falls_back_when_they_are_gone(
    conn: Connection,
) -> None:
    async with embeddings_server() as server:
        url = server.url
        async with connected_with(conn, embedding_url=url, embedding_timeout_s=2.0) as embedded:
            async with fleet(embedded):
                (answer,) = (await ask(embedded, "I want my money back")).values()
        assert len(server.log.requests) >= 1
    assert answer.stage is Stage.SUCCEEDED and answer.result["agent"] == "payments"
    step, reason = await intent_step(conn, answer.id)
    assert step["scorer"] == "embeddings" and step["capability"] == "payment.refund"
    assert "(embeddings)" in reason
    # the server stopped: the lexical scorer answers, and says why; it sees no refund here
    async with connected_with(conn, embedding_url=url, embedding_timeout_s=2.0) as embedded:
        async with fleet(embedded):
            answers = await ask(embedded, "I want my money back", "can I get reimbursed today?")
    unmatched, refund = answers["I want my money back"], answers["can I get reimbursed today?"]
    assert unmatched.stage is Stage.REJECTED and unmatched.error is not None
    assert unmatched.error.startswith("intent_unmatched")
    assert "embeddings unavailable" in unmatched.error
    assert refund.stage is Stage.SUCCEEDED
    step, _ = await intent_step(conn, refund.id)
    assert step["scorer"].startswith("lexical; embeddings unavailable")


async def test_bad_feedback_turns_a_close_call(conn: Connection) -> None:
    url = conn.settings.redis_url
    assert url is not None
    async with (
        http_agent("careful") as careful,
        http_agent("quick") as quick,
        described_sidecar(conn, "careful-1", "translate.careful", "Translate text", careful.url),
        described_sidecar(conn, "quick-1", "translate.quick", "Translate text", quick.url),
        running_dispatcher(conn) as dispatcher,
    ):
        (first,) = (await ask(conn, "translate this text")).values()
        assert first.result["agent"] == "careful"  # a tie: the first by name
        said = await anyio.to_thread.run_sync(
            lambda: CliRunner().invoke(
                main, ["feedback", first.id, "--bad", "--redis", url, "--prefix", conn.keys.prefix]
            )
        )
        assert said.exit_code == 0, said.output
        assert "rated bad for agent careful" in said.output
        await eventually(lambda: _approved(dispatcher, "careful", 0.0))
        (second,) = (await ask(conn, "translate this text")).values()
    assert second.result["agent"] == "quick"
    step, _ = await intent_step(conn, second.id)
    assert step["candidates"]["translate.careful"] < step["candidates"]["translate.quick"]
    trace = await Client(conn).trace(first.id)
    assert [e.reason for e in trace.timeline if e.stage == RATED] == ["bad"]
    assert await conn.call("LLEN", f"{conn.keys.prefix}:fb:{{careful}}") == 1


async def test_feedback_on_an_unknown_id_is_an_error(conn: Connection) -> None:
    url = conn.settings.redis_url
    assert url is not None
    said = await anyio.to_thread.run_sync(
        lambda: CliRunner().invoke(
            main, ["feedback", "no-such-id", "--good", "--redis", url, "--prefix", conn.keys.prefix]
        )
    )
    assert said.exit_code == 1 and "unknown message id 'no-such-id'" in said.output


async def _approved(dispatcher: Any, agent: str, rate: float) -> bool:
    """Whether the dispatcher's last registry refresh read ``agent``'s approval as ``rate``."""
    return bool(dispatcher.intents.approvals.get(agent) == rate)


async def test_an_embeddings_endpoint_that_stalls_errs_or_babbles_is_a_failure_in_time() -> None:
    async def stall(request: Request) -> Response:
        await anyio.sleep(30)
        return JSONResponse({})

    async def error(request: Request) -> Response:
        return JSONResponse({"error": "overloaded"}, status_code=503)

    async def babble(request: Request) -> Response:
        return JSONResponse({"data": [{"embedding": "not numbers"}]})

    app = Starlette(
        routes=[
            Route("/stall/embeddings", stall, methods=["POST"]),
            Route("/error/embeddings", error, methods=["POST"]),
            Route("/babble/embeddings", babble, methods=["POST"]),
        ]
    )
    profiles = [CapabilityProfile("payment.refund", "payment refund")]
    async with serve_app(app) as url:
        for path, said in [("stall", "no answer"), ("error", "503"), ("babble", "not an")]:
            scorer = EmbeddingScorer(f"{url.rstrip('/')}/{path}", "m", timeout_s=0.5)
            with anyio.fail_after(5):
                with pytest.raises(EmbeddingFailure, match=said):
                    await scorer.similarities(["refund me"], profiles)
            await scorer.aclose()


async def test_a_failing_embeddings_endpoint_is_left_alone_for_a_while(conn: Connection) -> None:
    """After a failure the lexical scorer answers without asking the endpoint again, so a
    stalled endpoint does not hold every batch for its timeout."""
    asked = {"n": 0}

    async def failing(request: Request) -> Response:
        asked["n"] += 1
        return JSONResponse({"error": "overloaded"}, status_code=503)

    app = Starlette(routes=[Route("/v1/embeddings", failing, methods=["POST"])])
    async with serve_app(app) as url:
        settings = msgspec.structs.replace(conn.settings, embedding_url=f"{url.rstrip('/')}/v1")
        async with open_connection(settings, conn.url) as with_embeddings:
            resolver = IntentResolver(with_embeddings)
            resolver.profiles = {"payment.refund": CapabilityProfile("payment.refund", "refund")}
            first = await resolver.decide(["refund my order"])
            second = await resolver.decide(["refund my order please"])
            await resolver.aclose()
    assert asked["n"] == 1
    for decision in (first[0], second[0]):
        assert decision.scorer.startswith("lexical; embeddings unavailable")


# -- the semantic layer with the embeddings scorer live, rules by priority, examples, cost,
# -- and an A2A agent's card


async def test_the_today_pitfall_goes_to_refunds_with_embeddings_live(conn: Connection) -> None:
    """Both descriptions say "today": with the embeddings server up (not the lexical
    fallback), "can I get reimbursed today?" reaches the refund agent, never the weather."""
    async with (
        embeddings_server() as server,
        configured(conn, embedding_url=server.url, embedding_timeout_s=5.0) as embedded,
        fleet(embedded) as (payments, weather),
    ):
        (answer,) = (await ask(embedded, "can I get reimbursed today?")).values()
        asked = len(server.log.requests)
    assert asked >= 1  # the server answered while it was up
    assert answer.stage is Stage.SUCCEEDED and answer.result["agent"] == "payments"
    assert payments.log.calls[answer.id] == 1 and weather.log.total == 0
    step, reason = await intent_step(conn, answer.id)
    assert step["layer"] == "semantic" and step["scorer"] == "embeddings"
    assert step["capability"] == "payment.refund" and step["score"] >= 0.55
    assert step["candidates"]["weather.forecast"] < 0.55  # "today" alone is not the weather
    assert reason.startswith("intent -> payment.refund by the semantic layer (embeddings): ")
    record = await MessageStore(conn).get_record(answer.id)
    assert record is not None and record.capability == "payment.refund"


async def test_the_embeddings_request_names_the_configured_model(conn: Connection) -> None:
    """Every request carries ``embedding_model``; the capabilities' texts are asked once,
    later batches send their intents only."""
    model = "reach-test-embedder-2"
    async with (
        embeddings_server() as server,
        configured(conn, embedding_url=server.url, embedding_model=model) as embedded,
        fleet(embedded),
    ):
        first = (await ask(embedded, "I want my money back")).values()
        second = (await ask(embedded, "what's the weather tomorrow?")).values()
        requests = list(server.log.requests)
    assert [a.result["agent"] for a in (*first, *second)] == ["payments", "weather"]
    assert len(requests) == 2, requests
    assert [r["model"] for r in requests] == [model, model]
    texts = {
        profile_text("payment.refund", [REFUND], []),
        profile_text("weather.forecast", [WEATHER], []),
    }
    inputs: list[Any] = [r["input"] for r in requests]
    assert inputs[0][0] == "I want my money back"
    assert set(inputs[0][1:]) == texts and len(inputs[0]) == 3
    assert inputs[1] == ["what's the weather tomorrow?"]


EXPRESS = Described(
    "express", "refund.express", "Refund and reimburse a payment the same day", cost=2.0
)
STANDARD = Described(
    "standard", "refund.standard", "Refund a payment later, by bank transfer", cost=0.5
)


async def test_between_the_thresholds_the_cheaper_close_candidate_wins(conn: Connection) -> None:
    """Both refund agents score between intent_reject and intent_hit, within intent_close
    of each other: the cheaper one is called though the dearer one scores higher."""
    intent = "I want a refund today"
    expected = {
        a.capability: cosine(embed(intent), embed(profile_text(a.capability, [a.description], [])))
        for a in (EXPRESS, STANDARD)
    }  # what the test's embeddings server will answer (its vectors are deterministic)
    policy = conn.settings
    assert policy.intent_reject <= expected["refund.standard"] < expected["refund.express"]
    assert expected["refund.express"] < policy.intent_hit
    assert expected["refund.express"] - expected["refund.standard"] <= policy.intent_close
    async with (
        embeddings_server() as server,
        configured(conn, embedding_url=server.url, embedding_timeout_s=5.0) as embedded,
        described_fleet(embedded, EXPRESS, STANDARD) as agents,
    ):
        (answer,) = (await ask(embedded, intent)).values()
    assert answer.stage is Stage.SUCCEEDED and answer.result["agent"] == "standard"
    assert agents["standard"].log.calls[answer.id] == 1 and agents["express"].log.total == 0
    step, reason = await intent_step(conn, answer.id)
    assert step["layer"] == "semantic" and step["scorer"] == "embeddings"
    assert step["capability"] == "refund.standard"
    assert step["candidates"] == pytest.approx(expected, abs=1e-3)
    assert "the cheapest (cost 0.5) of 2 within intent_close" in reason, reason


async def test_of_two_matching_rules_the_higher_priority_wins(conn: Connection) -> None:
    """Rules from config: the higher priority wins though listed later (and though the
    semantic layer would say otherwise); equal priorities go to the first listed; a rule
    that alone matches still answers."""
    rules = [
        {"match": "reimburs", "capability": "payment.refund", "priority": 1},
        {"match": r"\btoday\b", "capability": "weather.forecast", "priority": 9},
        {"match": r"reimbursed", "capability": "payment.refund", "priority": 9},
    ]
    async with configured(conn, intent_rules=rules) as ruled, fleet(ruled) as (payments, weather):
        answers = await ask(ruled, "can I get reimbursed today?", "reimburse me, please")
    both, only_first = answers["can I get reimbursed today?"], answers["reimburse me, please"]
    assert both.stage is Stage.SUCCEEDED and both.result["agent"] == "weather"
    assert only_first.stage is Stage.SUCCEEDED and only_first.result["agent"] == "payments"
    assert weather.log.calls[both.id] == 1 and payments.log.calls[only_first.id] == 1
    step, reason = await intent_step(conn, both.id)
    assert step["layer"] == "rules" and step["capability"] == "weather.forecast"
    assert reason.startswith(f"intent rule 1 ({rules[1]['match']!r}, priority 9) -> weather")
    step, reason = await intent_step(conn, only_first.id)
    assert step["layer"] == "rules" and step["capability"] == "payment.refund"
    assert reason.startswith("intent rule 0 ('reimburs', priority 1) -> payment.refund")


async def test_an_example_feeds_the_semantic_layer(conn: Connection) -> None:
    """``--example`` words route an intent that the description and name do not match."""
    example = "I want my money back"
    said = tokens(profile_text("payment.refund", [REFUND], []))
    assert not tokens(example) & said  # without the example, nothing of it is known
    payments = Described("payments", "payment.refund", REFUND, examples=(example,))
    weather = Described("weather", "weather.forecast", WEATHER)
    async with described_fleet(conn, payments, weather) as agents:
        (answer,) = (await ask(conn, "can I have my money back?")).values()
    assert answer.stage is Stage.SUCCEEDED and answer.result["agent"] == "payments"
    assert agents["payments"].log.calls[answer.id] == 1 and agents["weather"].log.total == 0
    step, reason = await intent_step(conn, answer.id)
    assert step["layer"] == "semantic" and step["scorer"] == "lexical"
    assert step["capability"] == "payment.refund" and step["score"] >= conn.settings.intent_hit
    assert reason.startswith("intent -> payment.refund by the semantic layer (lexical)")


async def test_an_a2a_agents_card_feeds_intent_routing(conn: Connection) -> None:
    """An A2A agent's card, read as ``agent-reach sidecar --adapter a2a --url ... --skill
    echo=misc.relay`` reads it, gives its capability the card's words: an intent naming
    only what its skill's description says ("Echoes data") is routed to it."""
    async with a2a_agent() as agent:
        address = agent_address("a2a", http_url=None, python_spec=None, url=agent.url)
        named = Named(agent.url, ("echo=misc.relay",), (), None)
        standard = await anyio.to_thread.run_sync(
            standard_agent, address, named, (), conn.settings, 4
        )
        assert standard is not None and isinstance(standard.transport, A2ATransport)
        card = make_card(
            agent_id="echo",
            instance_id="echo-1",
            endpoint=address.endpoint,
            max_inflight=4,
            **card_fields(standard, (), "0", (), "", None),
        )
        assert card.capabilities == ("misc.relay",) and "Echo: Echoes data" in card.description
        assert "data" not in tokens(f"misc relay {card.description.splitlines()[0]}")
        sidecar = Sidecar(conn, card, standard.transport, grace_s=2.0)
        async with (
            http_agent("weather") as weather,
            described_sidecar(conn, "weather-1", "weather.forecast", WEATHER, weather.url),
            anyio.create_task_group() as tg,
        ):
            await tg.start(sidecar.run)
            async with running_dispatcher(conn):
                (answer,) = (await ask(conn, "here is some data")).values()
            tg.cancel_scope.cancel()
        await standard.transport.aclose()
    assert answer.stage is Stage.SUCCEEDED, answer
    assert sum(agent.executions.values()) == 1 and weather.log.total == 0
    step, reason = await intent_step(conn, answer.id)
    assert step["layer"] == "semantic" and step["capability"] == "misc.relay"
    assert step["score"] >= conn.settings.intent_hit
    assert reason.startswith("intent -> misc.relay by the semantic layer (lexical)")
    assert step["candidates"]["weather.forecast"] < conn.settings.intent_reject
