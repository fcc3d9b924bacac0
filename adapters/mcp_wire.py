"""MCP (Model Context Protocol) over streamable HTTP, as data: tools, calls, answers. Pure.

A server is one URL (``.../mcp``). A session starts with ``initialize`` (the server names it in
the ``Mcp-Session-Id`` response header; ``notifications/initialized`` follows), then every
request carries ``Mcp-Session-Id`` and ``MCP-Protocol-Version``. A request is answered either
as JSON or as a server-sent-event stream whose last ``data:`` frame with the request's id is
the answer (progress notifications come before it). A tool's failure — its exception, an
unknown tool, arguments that do not validate — is a *result* with ``isError: true``; a
JSON-RPC ``error`` means the request itself was malformed.

Everything read from a server is untrusted: what does not parse is a reason (a string).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from broker.envelope import capability_problem
from broker.usage import Usage, usage_from_mapping

PROTOCOL_VERSION = "2025-11-25"
SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "MCP-Protocol-Version"
ACCEPT = "application/json, text/event-stream"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    idempotent: bool  # the server's idempotentHint (absent: false, as the specification says)


def request(method: str, params: Mapping[str, Any] | None, request_id: int | None) -> bytes:
    """A JSON-RPC request, or a notification when ``request_id`` is ``None``."""
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        body["params"] = params
    if request_id is not None:
        body["id"] = request_id
    return msgspec.json.encode(body)


def initialize_params() -> dict[str, Any]:
    return {
        "protocolVersion": PROTOCOL_VERSION,
        "capabilities": {},
        "clientInfo": {"name": "agent-reach", "version": "1"},
    }


def answer_of(content_type: str, body: bytes, request_id: int) -> dict[str, Any] | str:
    """The JSON-RPC answer to ``request_id`` in a response (JSON, or an event stream), or
    why there is none."""
    if content_type.startswith("text/event-stream"):
        messages = _events(body)
    else:
        try:
            messages = [msgspec.json.decode(body)]
        except (msgspec.DecodeError, RecursionError):
            return "the server's answer is not JSON"
    for message in messages:
        if isinstance(message, dict) and message.get("id") == request_id:
            if "result" in message or "error" in message:
                return message
    return "the server's answer holds no response to the request"


def _events(body: bytes) -> list[Any]:
    """The JSON of each ``data:`` event of a server-sent-event stream (comments skipped).
    Lines are split as bytes: on ``\n`` and ``\r`` only, never at a U+2028 that JSON may
    hold unescaped."""
    messages: list[Any] = []
    data: list[bytes] = []
    for line in [*body.splitlines(), b""]:
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif line == b"" and data:
            try:
                messages.append(msgspec.json.decode(b"\n".join(data)))
            except (msgspec.DecodeError, RecursionError):
                pass  # one frame we cannot read: the answer may be in another
            data = []
    return messages


def answers(data: bytes, request_id: int) -> bool:
    """Whether an event's data is the answer (result or error) to ``request_id``."""
    try:
        message = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return (
        isinstance(message, dict)
        and message.get("id") == request_id
        and ("result" in message or "error" in message)
    )


def error_text(answer: Mapping[str, Any]) -> str | None:
    """``"MCP error CODE: MESSAGE"`` for a JSON-RPC error answer, else ``None``."""
    error = answer.get("error")
    if error is None:
        return None
    if not isinstance(error, dict):
        return "MCP error: malformed error"
    return f"MCP error {error.get('code')}: {str(error.get('message', ''))[:500]}"


def tools_of(answer: Mapping[str, Any]) -> list[Tool] | str:
    """The tools of a ``tools/list`` answer."""
    result = answer.get("result")
    tools = result.get("tools") if isinstance(result, dict) else None
    if not isinstance(tools, list):
        return "tools/list answered no tools list"
    found = []
    for raw in tools:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            continue
        hints = raw.get("annotations")
        hints = hints if isinstance(hints, dict) else {}
        description = raw.get("description")
        found.append(
            Tool(
                raw["name"],
                description if isinstance(description, str) else "",
                hints.get("idempotentHint") is True,
            )
        )
    return found


def tool_capabilities(
    tools: Sequence[Tool], mapping: Mapping[str, str], prefix: str | None
) -> dict[str, Tool] | str:
    """Capability -> tool: ``--tool NAME=domain.action`` pairs, each naming a tool the server
    lists, or every tool as ``<prefix>.<tool name>`` (``--capability-prefix``)."""
    by_name = {t.name: t for t in tools}
    unknown = sorted(set(mapping) - set(by_name))
    if unknown:
        listed = ", ".join(sorted(by_name)) or "none"
        return f"--tool {unknown[0]}: the server has no such tool (tools: {listed})"
    served = {capability: by_name[name] for name, capability in mapping.items()}
    if prefix is not None:
        for tool in tools:
            capability = f"{prefix}.{tool.name.lower()}"
            if problem := capability_problem(capability):
                return (
                    f"tool {tool.name!r} cannot be {capability!r} ({problem}): map it with --tool"
                )
            served.setdefault(capability, tool)
    if not served:
        return "give --tool NAME=domain.action for each tool to serve, or --capability-prefix"
    return served


def call_params(tool: str, arguments: Any, meta: Mapping[str, Any]) -> dict[str, Any] | str:
    """``tools/call`` params: the payload is the arguments, and must be a JSON object."""
    if not isinstance(arguments, dict):
        return "an MCP tool takes a JSON object as its arguments; the payload is not one"
    return {"name": tool, "arguments": arguments, "_meta": dict(meta)}


def call_result(answer: Mapping[str, Any]) -> tuple[bool, bytes] | str:
    """A ``tools/call`` answer as ``(ok, JSON)``: the structured content (else the content
    list) when it succeeded; when ``isError``, the content's text as a JSON string."""
    result = answer.get("result")
    if not isinstance(result, dict):
        return "tools/call answered no result"
    content = _listed(result.get("content"))
    if result.get("isError") is True:
        texts = [c["text"] for c in content if isinstance(c, dict) and _is_text(c.get("text"))]
        return False, msgspec.json.encode(" ".join(texts)[:2000] or "the tool reported an error")
    if "structuredContent" in result:
        return True, msgspec.json.encode(result["structuredContent"])
    return True, msgspec.json.encode({"content": content})


def reported_usage(answer: Mapping[str, Any]) -> Usage | None:
    """Usage a tool reported in its result's ``_meta.usage``, if any."""
    result = answer.get("result")
    meta = result.get("_meta") if isinstance(result, dict) else None
    return usage_from_mapping(meta.get("usage")) if isinstance(meta, dict) else None


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _is_text(value: Any) -> bool:
    return isinstance(value, str)
