"""The A2A protocol as data: agent cards, requests, and what a task's state means. Pure.

An A2A agent publishes a card (``/.well-known/agent-card.json``) and speaks JSON-RPC 2.0. Two
protocol versions are in use, and an agent speaks the one its card names:

- **1.0**: the card lists ``supportedInterfaces`` (``url``, ``protocolBinding``,
  ``protocolVersion``); methods ``SendMessage``, ``GetTask``, ``CancelTask``; every request
  carries the header ``A2A-Version: 1.0``; enums are ``ROLE_USER`` and ``TASK_STATE_COMPLETED``;
  parts are ``{"text": ...}`` / ``{"data": ...}``; a send answers ``{"task": ...}`` or
  ``{"message": ...}``; non-blocking is ``configuration.returnImmediately``.
- **0.3**: the card has a top-level ``url`` (``preferredTransport``, ``protocolVersion``);
  methods ``message/send``, ``tasks/get``, ``tasks/cancel``; no version header; roles
  ``user``, states ``completed``, parts carry ``kind``; a send answers the task or message
  itself (``kind``); non-blocking is ``configuration.blocking: false``.

Everything read from an agent is untrusted: a card or an answer that does not parse is a
reason (a string), never an exception.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from broker.usage import Usage, usage_from_mapping

from .outcome import Accepted, Failed, NeedsInput, Outcome, Succeeded

CARD_PATH = "/.well-known/agent-card.json"
TERMINAL_STATES = frozenset({"completed", "failed", "canceled", "rejected"})
PARKED_STATES = frozenset({"input-required", "auth-required"})
RUNNING_STATES = frozenset({"submitted", "working"})
TASK_NOT_FOUND = -32001
HTTP_JSON = "1.0+http"  # protocol 1.0 over the HTTP+JSON binding


@dataclass(frozen=True, slots=True)
class Skill:
    id: str
    name: str
    description: str


@dataclass(frozen=True, slots=True)
class AgentCardView:
    """What the sidecar needs of an A2A agent's card."""

    name: str
    version: str
    description: str
    rpc_url: str  # where JSON-RPC requests go
    protocol: str  # "1.0" or "0.3"
    skills: tuple[Skill, ...]
    push: bool  # the agent sends push notifications
    streaming: bool


@dataclass(frozen=True, slots=True)
class Dialect:
    """The method names and shapes of one protocol version."""

    version: str
    send: str
    stream: str
    get: str
    cancel: str
    user_role: str
    rest: bool = False  # the HTTP+JSON binding: a path per method, no JSON-RPC envelope

    def headers(self) -> dict[str, str]:
        return {"A2A-Version": "1.0"} if self.version.startswith("1.0") else {}


DIALECTS = {
    "1.0": Dialect(
        "1.0", "SendMessage", "SendStreamingMessage", "GetTask", "CancelTask", "ROLE_USER"
    ),
    "0.3": Dialect("0.3", "message/send", "message/stream", "tasks/get", "tasks/cancel", "user"),
    HTTP_JSON: Dialect(
        HTTP_JSON, "SendMessage", "SendStreamingMessage", "GetTask", "CancelTask", "ROLE_USER", True
    ),
}


# -- the card ----------------------------------------------------------------------------------


def parse_card(raw: bytes) -> AgentCardView | str:
    """The card's view, or why it cannot be used."""
    try:
        card = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        return f"the agent card is not JSON: {exc}"
    if not isinstance(card, dict):
        return "the agent card is not a JSON object"
    name = card.get("name")
    if not isinstance(name, str) or not name:
        return "the agent card has no name"
    where = _interface(card)
    if isinstance(where, str):
        return where
    skills = card.get("skills")
    if not isinstance(skills, list):
        return "the agent card has no skills list"
    parsed = tuple(s for s in map(_skill, skills) if s is not None)
    capabilities = card.get("capabilities")
    caps = capabilities if isinstance(capabilities, dict) else {}
    return AgentCardView(
        name=name,
        version=_text(card.get("version")),
        description=_text(card.get("description")),
        rpc_url=where[0],
        protocol=where[1],
        skills=parsed,
        push=caps.get("pushNotifications") is True,
        streaming=caps.get("streaming") is True,
    )


def _interface(card: Mapping[str, Any]) -> tuple[str, str] | str:
    """The endpoint and its protocol: the first 1.x interface the card lists (JSON-RPC, or
    HTTP+JSON where the card lists that first), then a 0.3 JSON-RPC one."""
    interfaces = card.get("supportedInterfaces")
    found: dict[str, str] = {}
    if isinstance(interfaces, list):
        for interface in interfaces:
            if not isinstance(interface, dict):
                continue
            binding = interface.get("protocolBinding")
            url, version = interface.get("url"), _text(interface.get("protocolVersion"))
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                continue
            if binding == "HTTP+JSON" and version.startswith("1") and "1.0" not in found:
                found.setdefault(HTTP_JSON, url)
            elif binding == "JSONRPC" and HTTP_JSON not in found:
                found.setdefault("1.0" if version.startswith("1") else "0.3", url)
    url = card.get("url")
    transport = card.get("preferredTransport", "JSONRPC")
    if isinstance(url, str) and url.startswith(("http://", "https://")) and transport == "JSONRPC":
        found.setdefault("0.3", url)
    for version in ("1.0", HTTP_JSON, "0.3"):
        if version in found:
            return found[version], version
    return "the agent card names no JSON-RPC or HTTP+JSON endpoint (supportedInterfaces or url)"


def _skill(raw: Any) -> Skill | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
        return None
    return Skill(raw["id"], _text(raw.get("name")), _text(raw.get("description")))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def skill_capabilities(
    card: AgentCardView, mapping: Mapping[str, str], every: str | None
) -> list[str] | str:
    """The capabilities an instance registers: ``--skill SKILL=domain.action`` pairs, each
    naming a skill of the card, or ``--capability`` for the agent as a whole."""
    known = {s.id for s in card.skills}
    unknown = sorted(set(mapping) - known)
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        return f"--skill {unknown[0]}: the card has no such skill (skills: {listed})"
    capabilities = list(dict.fromkeys(mapping.values()))
    if every:
        capabilities.append(every)
    if not capabilities:
        return "give --skill SKILL_ID=domain.action for each skill to serve, or --capability"
    return capabilities


# -- requests ----------------------------------------------------------------------------------


def rpc(method: str, params: Mapping[str, Any], request_id: str) -> bytes:
    return msgspec.json.encode(
        {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    )


def send_params(
    dialect: Dialect,
    *,
    message_id: str,
    payload: bytes,
    metadata: Mapping[str, Any],
    push: tuple[str, str] | None,
    streaming: bool = False,
) -> dict[str, Any]:
    """``SendMessage`` params: the payload as a data part (a text part when it is a JSON
    string), sent non-blocking (a stream needs no such flag); ``push`` is ``(url, token)``
    for the agent's notifications."""
    value = msgspec.json.decode(payload) if payload else None
    part: dict[str, Any] = {"text": value} if isinstance(value, str) else {"data": value}
    if dialect.version == "0.3":
        part["kind"] = "text" if "text" in part else "data"
    message: dict[str, Any] = {
        "messageId": message_id,
        "role": dialect.user_role,
        "parts": [part],
        "metadata": dict(metadata),
    }
    configuration: dict[str, Any] = {}
    if dialect.version == "1.0":
        if not streaming:
            configuration["returnImmediately"] = True
        if push:
            configuration["taskPushNotificationConfig"] = {"url": push[0], "token": push[1]}
    else:
        message["kind"] = "message"
        if not streaming:
            configuration["blocking"] = False
        if push:
            configuration["pushNotificationConfig"] = {"url": push[0], "token": push[1]}
    return {"message": message, "configuration": configuration}


# -- answers -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskView:
    """What a task (or a direct message) says: its id, its state (``completed``, ``working``,
    … — both versions' spellings read the same), the agent's words, and the result JSON."""

    task_id: str
    state: str
    said: str
    result: bytes
    usage: Usage | None = None  # reported in the task's (or message's) metadata


def state_name(raw: Any) -> str:
    """``TASK_STATE_INPUT_REQUIRED`` and ``input-required`` alike: ``input-required``."""
    if not isinstance(raw, str):
        return "unknown"
    return raw.removeprefix("TASK_STATE_").lower().replace("_", "-")


def rpc_answer(raw: bytes) -> Any:
    """The ``result`` of a JSON-RPC answer; an error is a string ``"A2A error CODE: MSG"``
    (``TASK_NOT_FOUND`` keeps its code: see :func:`not_found`)."""
    try:
        answer = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return RpcError(0, "the agent's answer is not JSON")
    if not isinstance(answer, dict):
        return RpcError(0, "the agent's answer is not a JSON-RPC response")
    error = answer.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        return RpcError(code if isinstance(code, int) else 0, _text(error.get("message")))
    if "result" not in answer:
        return RpcError(0, "the agent's answer has neither result nor error")
    return answer["result"]


@dataclass(frozen=True, slots=True)
class RpcError:
    code: int
    message: str

    def __str__(self) -> str:
        return f"A2A error {self.code}: {self.message}"


def sent_task(result: Any) -> TaskView | str:
    """A send's result (1.0 ``{"task"}`` / ``{"message"}``; 0.3 the object with its ``kind``)."""
    if isinstance(result, dict) and isinstance(result.get("task"), dict):
        return task_view(result["task"])
    if isinstance(result, dict) and isinstance(result.get("message"), dict):
        return _message_view(result["message"])
    if isinstance(result, dict) and result.get("kind") == "message":
        return _message_view(result)
    return task_view(result)


def task_view(task: Any) -> TaskView | str:
    if not isinstance(task, dict) or not isinstance(task.get("id"), str):
        return "the agent's answer holds no task"
    status = _field(task, "status", dict)
    artifacts = _field(task, "artifacts", list)
    result = {"task_id": task["id"], "artifacts": [_artifact(a) for a in artifacts]}
    said = _words(status.get("message"))
    usage = usage_from_mapping(_field(task, "metadata", dict).get("usage"))
    state = state_name(status.get("state"))
    return TaskView(task["id"], state, said, msgspec.json.encode(result), usage)


def _message_view(message: Mapping[str, Any]) -> TaskView:
    parts = _field(message, "parts", list)
    result = msgspec.json.encode({"parts": [_part(p) for p in parts]})
    usage = usage_from_mapping(_field(message, "metadata", dict).get("usage"))
    return TaskView("", "completed", _words(message), result, usage)


def _field(raw: Mapping[str, Any], name: str, kind: type[Any]) -> Any:
    """``raw[name]`` when it is a ``kind`` (a dict or a list), else an empty one."""
    value = raw.get(name)
    return value if isinstance(value, kind) else kind()


def _artifact(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        return {"parts": []}
    parts = _field(raw, "parts", list)
    artifact: dict[str, Any] = {"parts": [_part(p) for p in parts]}
    if isinstance(raw.get("name"), str):
        artifact["name"] = raw["name"]
    return artifact


def _part(raw: Any) -> Any:
    """A part as 1.0 writes it (0.3's ``kind`` dropped)."""
    if isinstance(raw, dict):
        return {k: v for k, v in raw.items() if k != "kind"}
    return raw


def _words(message: Any) -> str:
    """The text parts of a status message, joined."""
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        return ""
    texts = [
        p["text"]
        for p in message["parts"]
        if isinstance(p, dict) and isinstance(p.get("text"), str)
    ]
    return " ".join(texts)[:2000]


_WRAPPERS = {
    "task": "task",
    "message": "message",
    "status-update": "statusUpdate",
    "artifact-update": "artifactUpdate",
}


def wrapped(event: dict[str, Any]) -> dict[str, Any]:
    """A 0.3 event (the object itself, with its ``kind``) as 1.0 writes it (inside a member
    named for its kind); a 1.0 event as it is."""
    kind = event.get("kind")
    member = _WRAPPERS.get(kind) if isinstance(kind, str) else None
    return {member: event} if member is not None else event


def push_state(body: bytes) -> tuple[str, str] | str:
    """``(task id, state)`` of a push notification (the A2A 1.0 ``StreamResponse`` JSON: a
    ``task`` or a ``statusUpdate``), or why the body is not one. An artifact update carries
    no state: ``(task id, "working")``."""
    try:
        event = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return "body is not JSON"
    if not isinstance(event, dict):
        return "body is not a JSON object"
    event = wrapped(event)
    if isinstance(event.get("task"), dict):
        view = task_view(event["task"])
        return view if isinstance(view, str) else (view.task_id, view.state)
    for kind in ("statusUpdate", "artifactUpdate"):
        update = event.get(kind)
        if isinstance(update, dict) and isinstance(update.get("taskId"), str):
            status = _field(update, "status", dict)
            state = state_name(status.get("state")) if status else "working"
            return update["taskId"], state
    return "body is neither a task nor a task update"


def outcome_of(view: TaskView) -> Outcome:
    """What a task's state means for the message."""
    if view.state == "completed":
        return Succeeded(view.result, view.usage)
    if view.state in PARKED_STATES:
        return NeedsInput(f"the agent asks ({view.state}): {view.said or 'no words'}")
    if view.state in RUNNING_STATES:
        return Accepted(view.task_id)
    said = f": {view.said}" if view.said else ""
    return Failed(f"the agent's task {view.task_id} ended {view.state}{said}", usage=view.usage)
