"""The A2A protocol as data (adapters/a2a_wire.py): cards of both versions, requests, what a
task's state means, and answers with any bytes."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from adapters.a2a import A2ATransport
from adapters.a2a_rpc import as_status
from adapters.a2a_tasks import A2ATasks
from adapters.a2a_wire import (
    DIALECTS,
    AgentCardView,
    RpcError,
    TaskView,
    outcome_of,
    parse_card,
    push_state,
    rpc_answer,
    send_params,
    sent_task,
    skill_capabilities,
    state_name,
    task_view,
)
from adapters.outcome import Accepted, Failed, NeedsInput, Succeeded

CARD_1_0 = {
    "name": "Demo",
    "version": "1.0.0",
    "description": "d",
    "supportedInterfaces": [
        {"url": "http://a/rest", "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0"},
        {"url": "http://a/", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
    ],
    "capabilities": {"pushNotifications": True, "streaming": True},
    "skills": [{"id": "echo", "name": "Echo", "description": "echoes"}, {"bad": 1}],
}
CARD_0_3 = {
    "name": "Old",
    "url": "http://b/",
    "preferredTransport": "JSONRPC",
    "protocolVersion": "0.3",
    "skills": [{"id": "s"}],
}


def test_a_1_0_card_names_its_preferred_interface_and_skills() -> None:
    card = parse_card(msgspec.json.encode(CARD_1_0))
    assert not isinstance(card, str)
    assert (card.rpc_url, card.protocol) == ("http://a/rest", "1.0+http")  # listed first
    assert card.push and card.streaming
    rpc_first = {**CARD_1_0, "supportedInterfaces": CARD_1_0["supportedInterfaces"][::-1]}
    again = parse_card(msgspec.json.encode(rpc_first))
    assert not isinstance(again, str) and (again.rpc_url, again.protocol) == ("http://a/", "1.0")
    assert [s.id for s in card.skills] == ["echo"]  # the malformed skill left out


def test_a_0_3_card_is_read_too() -> None:
    card = parse_card(msgspec.json.encode(CARD_0_3))
    assert not isinstance(card, str) and (card.rpc_url, card.protocol) == ("http://b/", "0.3")


def test_cards_that_cannot_be_used_say_why() -> None:
    assert parse_card(b"[]") == "the agent card is not a JSON object"
    assert "no JSON-RPC or HTTP+JSON endpoint" in str(parse_card(b'{"name":"x","skills":[]}'))
    assert "not JSON" in str(parse_card(b"\xff"))


def test_skills_become_capabilities_by_the_map_or_all_as_one() -> None:
    card = parse_card(msgspec.json.encode(CARD_1_0))
    assert not isinstance(card, str)
    assert skill_capabilities(card, {"echo": "text.echo"}, None) == ["text.echo"]
    assert skill_capabilities(card, {}, "text.all") == ["text.all"]
    assert "no such skill" in str(skill_capabilities(card, {"x": "a.b"}, None))


def test_a_send_is_non_blocking_with_the_payload_as_a_data_or_text_part() -> None:
    params = send_params(
        DIALECTS["1.0"], message_id="m.1", payload=b'{"a":1}', metadata={}, push=("u", "t")
    )
    assert params["message"]["parts"] == [{"data": {"a": 1}}]
    assert params["message"]["role"] == "ROLE_USER"
    assert params["configuration"] == {
        "returnImmediately": True,
        "taskPushNotificationConfig": {"url": "u", "token": "t"},
    }
    old = send_params(DIALECTS["0.3"], message_id="m.1", payload=b'"hi"', metadata={}, push=None)
    assert old["message"]["parts"] == [{"text": "hi", "kind": "text"}]
    assert old["configuration"] == {"blocking": False} and old["message"]["role"] == "user"


def test_states_of_both_versions_read_alike_and_map_to_outcomes() -> None:
    assert state_name("TASK_STATE_INPUT_REQUIRED") == state_name("input-required")
    done = TaskView("t", "completed", "", b'{"task_id":"t","artifacts":[]}')
    assert outcome_of(done) == Succeeded(b'{"task_id":"t","artifacts":[]}')
    assert isinstance(outcome_of(TaskView("t", "failed", "no", b"")), Failed)
    assert isinstance(outcome_of(TaskView("t", "input-required", "why?", b"")), NeedsInput)
    assert outcome_of(TaskView("t", "working", "", b"")) == Accepted("t")
    assert as_status(RpcError(-32001, "Task not found")).why == "GetTask: task not found"
    assert as_status(TaskView("t", "working", "", b"")).state == "running"
    assert as_status(TaskView("t", "canceled", "", b"")).state == "failed"


def test_answers_of_both_versions_are_read() -> None:
    task = {"id": "t", "status": {"state": "TASK_STATE_COMPLETED"}, "artifacts": []}
    assert sent_task(rpc_answer(msgspec.json.encode({"result": {"task": task}}))) == task_view(task)
    old = {"kind": "task", **task, "status": {"state": "completed"}}
    assert isinstance(view := sent_task(old), TaskView) and view.state == "completed"
    error = rpc_answer(b'{"error":{"code":-32001,"message":"Task not found"}}')
    assert error == RpcError(-32001, "Task not found")
    assert push_state(
        b'{"statusUpdate":{"taskId":"t","status":{"state":"TASK_STATE_FAILED"}}}'
    ) == (
        "t",
        "failed",
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(st.one_of(st.binary(max_size=200), json_values.map(msgspec.json.encode)))
def test_no_answer_card_or_push_makes_a_parser_raise(raw: bytes) -> None:
    parse_card(raw)
    push_state(raw)
    result = rpc_answer(raw)
    if not isinstance(result, RpcError):
        sent_task(result)


class RecordingDesk:
    """Where A2A task endings go (the callback desk's ``on_callback``), kept to look at."""

    conn = None

    def __init__(self) -> None:
        self.outcomes: list[object] = []

    async def on_callback(self, message_id: str, token: str, outcome: object) -> None:
        self.outcomes.append(outcome)


async def test_an_a2a_task_result_is_held_to_64_levels_as_a_calls_is() -> None:
    """A task ended by push or by asking is recorded as a callback is: a result nested past
    64 levels is the agent's failure, as from a call (Runner) or an HTTP callback."""
    nested: object = 1
    for _ in range(200):
        nested = [nested]
    task = {
        "id": "t1",
        "status": {"state": "completed"},
        "artifacts": [{"parts": [{"kind": "data", "data": nested}]}],
    }
    card = AgentCardView("a", "1", "", "http://127.0.0.1:9/", "1.0", (), False, False)
    transport = A2ATransport(card, timeout_s=1.0, max_connections=1)
    desk = RecordingDesk()
    tasks = A2ATasks(desk, transport)  # type: ignore[arg-type]
    view = task_view(task)
    assert isinstance(view, TaskView)
    await tasks._ended("m1", "token", view)
    await transport.aclose()
    [outcome] = desk.outcomes
    assert isinstance(outcome, Failed) and "JSON nested 20" in outcome.reason
