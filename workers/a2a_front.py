"""Agent-Reach as one A2A agent (protocol 1.0, JSON-RPC): what the gateway reads and answers,
as data. Pure; the HTTP side is :mod:`workers.a2a_gateway`.

- The card lists every registered capability as a skill (its id is the capability).
- ``SendMessage``: the capability is ``message.metadata.capability`` (or the request's
  ``metadata.capability``, or ``metadata.skill``); the payload is the first data part's value,
  else the text parts joined; ``configuration.returnImmediately`` asks for a task at once
  (WORKING, its id the message id); an inline ``taskPushNotificationConfig`` becomes the
  envelope's ``callback_url`` (checked against the same allow-list as any other).
- A message's stage is its task's state (:data:`STATE_OF`); a result is a ``result`` artifact
  with one data part; an error is the status message's text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from broker.envelope import capability_problem
from broker.stages import Stage

VERSION = "1.0"
API_KEY_HEADER = "X-API-Key"
TASK_NOT_FOUND = -32001
TASK_NOT_CANCELABLE = -32002
UNSUPPORTED = -32004
INVALID_PARAMS = -32602
METHOD_NOT_FOUND = -32601
INVALID_REQUEST = -32600
PARSE_ERROR = -32700
SERVER_BUSY = -32000  # JSON-RPC's range for a server's own errors: try again later

STATE_OF: dict[Stage, str] = {
    Stage.ACCEPTED: "TASK_STATE_SUBMITTED",
    Stage.WAITING: "TASK_STATE_SUBMITTED",
    Stage.ROUTED: "TASK_STATE_SUBMITTED",
    Stage.RECEIVED: "TASK_STATE_WORKING",
    Stage.PROCESSING: "TASK_STATE_WORKING",
    Stage.CALLBACK_RECEIVED: "TASK_STATE_WORKING",
    Stage.FANNED_OUT: "TASK_STATE_WORKING",
    Stage.NEEDS_CONFIRMATION: "TASK_STATE_INPUT_REQUIRED",  # an operator must decide
    Stage.SUCCEEDED: "TASK_STATE_COMPLETED",
    Stage.FAILED: "TASK_STATE_FAILED",
    Stage.DEAD: "TASK_STATE_FAILED",
    Stage.EXPIRED: "TASK_STATE_FAILED",
    Stage.CANCELLED: "TASK_STATE_CANCELED",
    Stage.REJECTED: "TASK_STATE_REJECTED",
}
FINAL_STATES = frozenset(
    {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"}
)


def agent_card(url: str, capabilities: Iterable[str], *, api_key: bool) -> dict[str, Any]:
    """The gateway's card: one skill per capability."""
    card: dict[str, Any] = {
        "name": "Agent-Reach",
        "description": "A dispatch broker: each skill is a capability served by its agents",
        "version": "1",
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": VERSION}
        ],
        "capabilities": {"streaming": True, "pushNotifications": True},
        "defaultInputModes": ["application/json", "text/plain"],
        "defaultOutputModes": ["application/json"],
        "skills": [
            {"id": c, "name": c, "description": f"the {c} capability", "tags": [c.split(".")[0]]}
            for c in sorted(set(capabilities))
        ],
    }
    if api_key:
        scheme = {"apiKeySecurityScheme": {"location": "header", "name": API_KEY_HEADER}}
        card["securitySchemes"] = {"apiKey": scheme}
        card["securityRequirements"] = [{"schemes": {"apiKey": {"list": []}}}]
    return card


@dataclass(frozen=True, slots=True)
class SendRequest:
    capability: str
    payload: Any
    blocking: bool
    callback_url: str | None
    message_id: str  # the client's messageId

    @property
    def fields(self) -> dict[str, Any]:
        """The envelope's fields besides its capability and payload: where to push the end."""
        return {"callback_url": self.callback_url} if self.callback_url else {}


def send_request(params: Any) -> SendRequest | str:
    """What a ``SendMessage`` asks for, or why it asks for nothing we can do."""
    if not isinstance(params, dict) or not isinstance(params.get("message"), dict):
        return "params.message is required"
    message = params["message"]
    parts = message.get("parts")
    if not isinstance(parts, list) or not parts:
        return "message.parts must hold at least one part"
    capability = _capability(message, params)
    if capability is None:
        return "name the capability in message.metadata.capability (a skill id of the card)"
    configuration = params.get("configuration")
    configuration = configuration if isinstance(configuration, dict) else {}
    push = configuration.get("taskPushNotificationConfig")
    url = push.get("url") if isinstance(push, dict) else None
    if problem := capability_problem(capability):
        return f"message.metadata.capability: {problem}"
    return SendRequest(
        capability,
        _payload(parts),
        configuration.get("returnImmediately") is not True,
        url if isinstance(url, str) else None,
        str(message.get("messageId", "")),
    )


def _capability(message: Mapping[str, Any], params: Mapping[str, Any]) -> str | None:
    for metadata in (message.get("metadata"), params.get("metadata")):
        if isinstance(metadata, dict):
            for key in ("capability", "skill"):
                if isinstance(metadata.get(key), str) and metadata[key]:
                    return str(metadata[key])
    return None


def _payload(parts: list[Any]) -> Any:
    for part in parts:
        if isinstance(part, dict) and "data" in part:
            return part["data"]
    texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return " ".join(texts)


def task_json(
    message_id: str, stage: Stage, *, result: Any = None, error: str | None = None
) -> dict[str, Any]:
    """A message as its task: id = context id = the message id."""
    status: dict[str, Any] = {"state": STATE_OF[stage]}
    words = error or (
        f"{stage}: an operator decides" if stage is Stage.NEEDS_CONFIRMATION else None
    )
    if words:
        status["message"] = {
            "messageId": f"{message_id}.status",
            "role": "ROLE_AGENT",
            "parts": [{"text": words}],
            "taskId": message_id,
            "contextId": message_id,
        }
    task: dict[str, Any] = {"id": message_id, "contextId": message_id, "status": status}
    if stage is Stage.SUCCEEDED:
        task["artifacts"] = [
            {"artifactId": f"{message_id}.result", "name": "result", "parts": [{"data": result}]}
        ]
    return task


def status_update(message_id: str, stage: Stage, error: str | None = None) -> dict[str, Any]:
    task = task_json(message_id, stage, error=error)
    return {
        "statusUpdate": {"taskId": message_id, "contextId": message_id, "status": task["status"]}
    }


def rpc_result(request_id: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def rpc_error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def is_request_id(value: Any) -> bool:
    """A JSON-RPC id: a string, a number or null (never a boolean, an object, a list)."""
    return value is None or (isinstance(value, str | int | float) and not isinstance(value, bool))


def request_problem(call: Any) -> tuple[int, str] | None:
    """Why ``call`` is no JSON-RPC 2.0 request object (code and message), or ``None``."""
    if not isinstance(call, dict):  # a batch, too: A2A sends one request a POST
        return INVALID_REQUEST, "a JSON-RPC request object"
    if call.get("jsonrpc") != "2.0":
        return INVALID_REQUEST, 'a JSON-RPC 2.0 request: "jsonrpc" must be "2.0"'
    if not is_request_id(call.get("id")):
        return INVALID_REQUEST, '"id" must be a string, a number or null'
    if not isinstance(call.get("method"), str):
        return INVALID_REQUEST, '"method" must be a string'
    return None
