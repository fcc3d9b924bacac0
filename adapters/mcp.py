"""The ``mcp`` adapter: reach the tools of an MCP server (streamable HTTP), as they are.

At start the sidecar lists the server's tools (:func:`fetch_tools`): ``--tool NAME=domain.action``
serves a tool as a capability, ``--capability-prefix P`` serves every tool as ``P.<name>``; a
server that cannot be listed stops start-up with the reason. The card is idempotent when every
tool served says ``idempotentHint`` (``--idempotent`` / ``--not-idempotent`` override).

Each attempt is one ``tools/call`` of the capability's tool, the payload (a JSON object) as
its arguments, our message id, attempt, idempotency key and trace context in ``_meta`` and in
the headers. ``structuredContent`` (else the content list) is the result; ``isError`` is a
failure with the tool's words; a JSON-RPC error a failure with its code. Transport errors as
for ``http``: not connected is not reached, no answer is ambiguous, 429 / 503 with
``Retry-After`` is back-pressure.

The session (``Mcp-Session-Id``) is kept, and made again when the server no longer knows it
(404: it restarted, or the session expired) — then the call is sent once more: a 404 means
the server ran nothing.

Written on ``httpx`` rather than the ``mcp`` SDK client: the sidecar must tell "never sent"
from "sent, no answer", and the client side of streamable HTTP is a handful of requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any

import anyio
import httpx
import msgspec

from broker.envelope import Envelope

from .http import NOT_SENT, AgentAnswer, agent_limits, read_limited, refusal
from .mcp_wire import (
    ACCEPT,
    SESSION_HEADER,
    VERSION_HEADER,
    Tool,
    answer_of,
    answers,
    call_params,
    call_result,
    error_text,
    initialize_params,
    reported_usage,
    request,
    tools_of,
)
from .outcome import Ambiguous, Failed, NotReached, Outcome, Succeeded
from .sse import sse_data
from .transport import reach_headers

LIST_LIMIT_BYTES = 4 * 1024 * 1024


class ServerError(Exception):
    """The MCP server cannot be listed: start-up stops with this reason."""


async def fetch_tools(url: str, *, timeout_s: float = 10.0) -> list[Tool]:
    """The tools the server at ``url`` lists."""
    session = McpSession(url, timeout_s=timeout_s, max_connections=1)
    try:
        answer = await session.request("tools/list", {}, {})
    finally:
        await session.aclose()
    if not isinstance(answer, dict):
        raise ServerError(f"cannot list the tools of {url}: {getattr(answer, 'reason', answer)}")
    if (error := error_text(answer)) is not None:
        raise ServerError(f"cannot list the tools of {url}: {error}")
    tools = tools_of(answer)
    if isinstance(tools, str):
        raise ServerError(f"{url}: {tools}")
    return tools


class McpSession:
    """Requests on one MCP session, made (and made again) as needed."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        max_connections: int,
        max_answer_bytes: int = LIST_LIMIT_BYTES,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.session_id: str | None = None
        self.sessions_made = 0
        self._ids = itertools.count(1)
        self._starting = anyio.Lock()
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=agent_limits(max_connections),
        )

    async def request(
        self, method: str, params: Mapping[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any] | Outcome:
        """The answer to one request; a session the server forgot is made again and the
        request sent once more."""
        for _ in range(2):
            used = await self._session()
            if not isinstance(used, str | None):
                return used  # the session could not be made: that outcome
            request_id = next(self._ids)
            sent = await self._post(request(method, params, request_id), headers, used, request_id)
            if isinstance(sent, AgentAnswer) and sent.status == 404 and used:
                self.session_id = None if self.session_id == used else self.session_id
                continue
            return _answer(sent, request_id)
        return Failed("the MCP server forgot two sessions in a row", fault=True)

    async def _session(self) -> str | Outcome | None:
        async with self._starting:
            if self.session_id is not None:
                return self.session_id
            request_id = next(self._ids)
            hello = request("initialize", initialize_params(), request_id)
            sent = await self._post(hello, {}, None, request_id)
            if not isinstance(sent, AgentAnswer):
                return sent
            answer = _answer(sent, request_id)
            if not isinstance(answer, dict):
                return answer
            if (error := error_text(answer)) is not None:
                return Failed(f"initialize: {error}")
            session = sent.headers.get(SESSION_HEADER)
            if session and not _visible_ascii(session):  # "": a stateless server
                # the spec's own rule; any other byte cannot be sent back in a header
                # (the call was never sent: a retry, on another instance say, is safe)
                why = f"{session!r}: a session id holds visible ASCII only"
                return NotReached(f"initialize: the MCP server's session id is unusable: {why}")
            initialized = request("notifications/initialized", None, None)
            await self._post(initialized, {}, session, None)
            self.session_id = session or ""  # "": a stateless server
            self.sessions_made += 1
            return self.session_id

    async def _post(
        self, body: bytes, headers: Mapping[str, str], session: str | None, request_id: int | None
    ) -> AgentAnswer | Outcome:
        """One POST, its answer read within the call's time: an event stream only until the
        frame answering ``request_id`` (a server may keep the stream open after it)."""
        sent = {**headers, "Accept": ACCEPT, "Content-Type": "application/json"}
        if session:
            sent[SESSION_HEADER] = session
            sent[VERSION_HEADER] = "2025-11-25"
        answer: AgentAnswer | Outcome | None = None
        with anyio.move_on_after(self.timeout_s):
            try:
                answer = await self._send(sent, body, request_id)
            except NOT_SENT as exc:
                why = f"{type(exc).__name__}: {exc}"
                return NotReached(f"MCP server unreachable at {self.url}: {why}")
            except httpx.HTTPError as exc:
                return Ambiguous(f"no answer from {self.url}: {type(exc).__name__}: {exc}")
        if answer is None:
            return Ambiguous(f"no answer from {self.url} within {self.timeout_s:g} s")
        return answer

    async def _send(
        self, headers: dict[str, str], body: bytes, request_id: int | None
    ) -> AgentAnswer | Outcome:
        request = self._client.build_request("POST", self.url, content=body, headers=headers)
        response = await self._client.send(request, stream=True)
        try:
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            if streamed and request_id is not None and response.status_code == 200:
                # closed on leaving, so that the response (and its connection) is let go of
                async with aclosing(sse_data(response)) as events:
                    async for data in events:
                        if answers(data, request_id):
                            plain = httpx.Headers(response.headers)  # Mcp-Session-Id kept
                            plain["content-type"] = "application/json"
                            return AgentAnswer(200, plain, data)
                return Ambiguous("the MCP server's event stream ended without the answer")
            raw = await read_limited(response, self.max_answer_bytes)
        finally:
            await response.aclose()
        if raw is None:
            return Failed(f"the MCP server's answer is over {self.max_answer_bytes} bytes")
        return AgentAnswer(response.status_code, response.headers, raw)

    async def aclose(self) -> None:
        await self._client.aclose()


def _visible_ascii(text: str) -> bool:
    return all("\x21" <= c <= "\x7e" for c in text)


def _answer(sent: AgentAnswer | Outcome, request_id: int) -> dict[str, Any] | Outcome:
    if not isinstance(sent, AgentAnswer):
        return sent
    refused = refusal(sent, "MCP server")
    if refused is None and sent.status != 200:
        refused = Failed(f"MCP server answered {sent.status}: {sent.snippet}", fault=False)
    if refused is not None:
        return refused
    answer = answer_of(sent.headers.get("content-type", ""), sent.body, request_id)
    if isinstance(answer, str):
        return Ambiguous(answer)  # sent and answered, but not with the call's outcome
    return answer


class McpTransport:
    def __init__(
        self,
        url: str,
        tools: Mapping[str, Tool],
        *,
        timeout_s: float,
        max_connections: int,
        max_result_bytes: int = 1024 * 1024,
    ) -> None:
        self.tools = dict(tools)  # capability -> tool
        self.session = McpSession(
            url,
            timeout_s=timeout_s,
            max_connections=max_connections,
            max_answer_bytes=max_result_bytes,
        )

    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        tool = self.tools.get(envelope.capability)
        if tool is None:
            return Failed(f"no tool serves {envelope.capability!r} here", fault=False)
        headers = reach_headers(envelope, attempt)
        meta = {
            "agent-reach/messageId": envelope.message_id,
            "agent-reach/attempt": attempt,
            "agent-reach/idempotencyKey": envelope.idempotency,
            **({"traceparent": envelope.traceparent} if envelope.traceparent else {}),
        }
        params = call_params(
            tool.name, msgspec.json.decode(bytes(envelope.payload) or b"null"), meta
        )
        if isinstance(params, str):
            return Failed(params, fault=False)
        answer = await self.session.request("tools/call", params, headers)
        if not isinstance(answer, dict):
            return answer
        if (error := error_text(answer)) is not None:
            return Failed(error)
        result = call_result(answer)
        if isinstance(result, str):
            return Ambiguous(result)
        ok, body = result
        usage = reported_usage(answer)
        if ok:
            return Succeeded(body, usage)
        return Failed(f"tool {tool.name}: {msgspec.json.decode(body)}", usage=usage)

    async def aclose(self) -> None:
        await self.session.aclose()
