"""JSON-RPC to an A2A agent over HTTP (the transport's requests, the reaper's ``GetTask``).

An answer other than HTTP 200, or none, is already an outcome, sorted as the ``http``
adapter sorts them: not connected is not reached, no answer is ambiguous, 429 / 503 with
``Retry-After`` is back-pressure, any other status a failure.
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from .a2a_wire import (
    DIALECTS,
    RUNNING_STATES,
    TASK_NOT_FOUND,
    Dialect,
    RpcError,
    TaskView,
    rpc,
    rpc_answer,
    task_view,
)
from .http import NOT_SENT, AgentAnswer, exchange, refusal
from .outcome import Ambiguous, Failed, NotReached, Outcome, Status

STATUS_SCHEME = "a2a:"  # an A2A agent's status URL: a2a:<protocol version>:<JSON-RPC URL>


async def json_rpc(
    client: httpx.AsyncClient,
    url: str,
    dialect: Dialect,
    call: tuple[str, dict[str, Any], dict[str, str]],
    *,
    max_bytes: int,
) -> AgentAnswer | Outcome:
    """One JSON-RPC request ``(method, params, headers)``; an HTTP answer other than 200 (or
    none) is its outcome already."""
    method, params, extra = call
    headers = {**extra, **dialect.headers(), "Content-Type": "application/json"}
    verb, body = "POST", rpc(method, params, uuid.uuid4().hex)
    if dialect.rest:
        verb, url, body = rest_request(dialect, url, method, params)
    try:
        request = client.build_request(verb, url, content=body, headers=headers)
    except Exception as exc:  # before anything was sent
        return Failed(f"cannot build the request to {url}: {exc!r}", fault=False)
    try:
        response, raw = await exchange(client, request, max_bytes)
    except NOT_SENT as exc:
        return NotReached(f"agent unreachable at {url}: {type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        return Ambiguous(f"no answer from {url}: {type(exc).__name__}: {exc}")
    status = response.status_code
    if raw is None and 200 <= status < 300:
        return Failed(f"agent answered {status} with a body over {max_bytes} bytes")
    answer = AgentAnswer(status, response.headers, raw or b"")  # a refusal: by its status
    return http_outcome(rest_answer(answer) if dialect.rest else answer)


def rest_request(
    dialect: Dialect, base: str, method: str, params: dict[str, Any]
) -> tuple[str, str, bytes]:
    """The HTTP+JSON binding's request for a method: ``(verb, URL, body)``."""
    base = base.rstrip("/")
    if method == dialect.get:
        return "GET", f"{base}/tasks/{quote(str(params.get('id', '')), safe='')}", b""
    if method == dialect.cancel:
        return "POST", f"{base}/tasks/{quote(str(params.get('id', '')), safe='')}:cancel", b"{}"
    return "POST", f"{base}/message:send", msgspec.json.encode(params)


def rest_answer(answer: AgentAnswer) -> AgentAnswer:
    """An HTTP+JSON answer as a JSON-RPC one (the rest of the adapter reads those): 200 is the
    result; 404 is "task not found"."""
    if answer.status == 200:
        return AgentAnswer(200, answer.headers, b'{"result":' + (answer.body or b"null") + b"}")
    if answer.status == 404:
        error = {"error": {"code": TASK_NOT_FOUND, "message": "Task not found"}}
        return AgentAnswer(200, answer.headers, msgspec.json.encode(error))
    return answer


def http_outcome(answer: AgentAnswer) -> AgentAnswer | Outcome:
    """An HTTP answer other than 200 as the outcome it is (:func:`adapters.http.refusal`);
    a 200 is read on."""
    refused = refusal(answer)
    if refused is None and answer.status != 200:
        refused = Failed(f"agent answered {answer.status}: {answer.snippet}", fault=False)
    return answer if refused is None else refused


async def a2a_status(
    client: httpx.AsyncClient, url: str, task_id: str, *, max_bytes: int
) -> Status:
    """The reaper's question to an A2A agent (status URL ``a2a:<version>:<url>``): GetTask."""
    version, _, rpc_url = url.removeprefix(STATUS_SCHEME).partition(":")
    dialect = DIALECTS.get(version)
    if dialect is None or not rpc_url:
        return Status("unknown", why=f"not an A2A status URL: {url[:80]}")
    if not task_id:
        return Status("unknown", why="no A2A task known for this attempt")
    answer = await json_rpc(
        client, rpc_url, dialect, (dialect.get, {"id": task_id}, {}), max_bytes=max_bytes
    )
    if not isinstance(answer, AgentAnswer):
        return Status("unknown", why=f"GetTask: {getattr(answer, 'reason', 'no answer')}")
    result = rpc_answer(answer.body)
    return as_status(result if isinstance(result, RpcError) else task_view(result))


async def a2a_cancel(client: httpx.AsyncClient, url: str, task_id: str) -> str:
    """``CancelTask`` on the agent behind status URL ``url``: what it said, in words."""
    version, _, rpc_url = url.removeprefix(STATUS_SCHEME).partition(":")
    dialect = DIALECTS.get(version)
    if dialect is None or not rpc_url:
        return f"not an A2A status URL: {url[:80]}"
    answer = await json_rpc(
        client, rpc_url, dialect, (dialect.cancel, {"id": task_id}, {}), max_bytes=1024 * 1024
    )
    if not isinstance(answer, AgentAnswer):
        return f"CancelTask: {getattr(answer, 'reason', 'no answer')}"
    result = rpc_answer(answer.body)
    if isinstance(result, RpcError):
        return f"CancelTask: {result}"
    view = task_view(result)
    return f"CancelTask: {view}" if isinstance(view, str) else f"task now {view.state}"


def as_status(view: TaskView | RpcError | str) -> Status:
    """A ``GetTask`` answer as the reaper reads a status endpoint's: COMPLETED done,
    SUBMITTED / WORKING running, FAILED / CANCELED / REJECTED failed; a task the agent does
    not know (it restarted, say), or any other answer, unknown."""
    if isinstance(view, RpcError):
        known = "task not found" if view.code == TASK_NOT_FOUND else str(view)
        return Status("unknown", why=f"GetTask: {known}")
    if isinstance(view, str):
        return Status("unknown", why=f"GetTask failed: {view}")
    if view.state == "completed":
        return Status("done", result=msgspec.Raw(view.result), why="GetTask: completed")
    if view.state in RUNNING_STATES:
        return Status("running", why=f"GetTask: {view.state}")
    if view.state in ("failed", "canceled", "rejected"):
        return Status("failed", error=view.said or view.state, why=f"GetTask: {view.state}")
    return Status("unknown", why=f"GetTask: {view.state}")
