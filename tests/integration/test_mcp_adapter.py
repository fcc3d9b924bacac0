"""The ``mcp`` adapter (adapters/mcp.py) against servers built with the official ``mcp`` SDK
(tests/support/mcp_servers.py), behind a real sidecar and dispatcher on real Redis."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
from mcp.types import CallToolResult, TextContent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from adapters.asgi import serve_app
from adapters.factory import SidecarOptionError, mcp_tool_parts
from adapters.mcp import McpTransport, ServerError, fetch_tools
from adapters.mcp_wire import Tool
from adapters.outcome import Succeeded
from broker.client import Client
from broker.connection import Connection
from broker.embedded import free_port
from broker.envelope import Envelope, complete
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.harness import running_dispatcher, running_sidecar
from tests.support.mcp_servers import (
    IDEMPOTENT,
    NOT_IDEMPOTENT,
    RunningServer,
    ToolLog,
    mcp_http_server,
    mcp_server,
)
from tests.support.usage_days import usage_lately

TOOLS = ["add=calc.add", "whoami=calc.whoami", "fail=calc.fail"]


@asynccontextmanager
async def behind_a_sidecar(
    conn: Connection, url: str, mapping: list[str] = TOOLS
) -> AsyncIterator[tuple[Client, McpTransport]]:
    tools = mcp_tool_parts(await fetch_tools(url), mapping, None)
    transport = McpTransport(url, tools, timeout_s=10.0, max_connections=4)
    async with (
        running_sidecar(conn, "calc-1", tuple(tools), transport=transport),
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        yield client, transport


async def test_a_tool_call_succeeds_with_its_structured_content_and_our_ids(
    conn: Connection,
) -> None:
    async with mcp_http_server() as server, behind_a_sidecar(conn, server.url) as (client, _):
        added = await client.request("calc.add", {"a": 2, "b": 3}, timeout=20)
        seen = await client.request("calc.whoami", {}, timeout=20)

    assert added.ok and added.result == {"result": 5}
    assert seen.ok
    assert seen.result == {"key": seen.id, "message": seen.id, "header": seen.id}


async def test_a_tool_error_and_arguments_that_are_no_object_fail_with_the_reason(
    conn: Connection,
) -> None:
    async with mcp_http_server() as server, behind_a_sidecar(conn, server.url) as (client, _):
        failed = await client.request("calc.fail", {}, timeout=20)
        refused = await client.request("calc.add", [1, 2], timeout=20)
        invalid = await client.request("calc.add", {"a": "x"}, timeout=20)

    assert failed.stage is Stage.FAILED and "deliberate failure" in (failed.error or "")
    assert refused.stage is Stage.FAILED
    assert "takes a JSON object as its arguments" in (refused.error or "")
    assert invalid.stage is Stage.FAILED and "validation error" in (invalid.error or "")


async def test_a_server_that_forgot_the_session_is_met_with_a_new_one(conn: Connection) -> None:
    port = free_port()
    async with mcp_http_server(port=port) as server:
        url = server.url
        tools = mcp_tool_parts(await fetch_tools(url), TOOLS, None)
    transport = McpTransport(url, tools, timeout_s=10.0, max_connections=4)
    async with (
        running_sidecar(conn, "calc-1", tuple(tools), transport=transport),
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        async with mcp_http_server(port=port):
            first = await client.request("calc.add", {"a": 1, "b": 1}, timeout=20)
        async with mcp_http_server(port=port):  # restarted: every session gone
            second = await client.request("calc.add", {"a": 2, "b": 2}, timeout=20)

    assert first.result == {"result": 2} and second.result == {"result": 4}
    assert transport.session.sessions_made == 2


async def test_tools_map_to_capabilities_and_hints_to_idempotency() -> None:
    async with mcp_http_server() as server:
        tools = await fetch_tools(server.url)
    served = mcp_tool_parts(tools, ["add=calc.add"], "kv")
    assert set(served) == {
        "calc.add",
        "kv.add",
        "kv.whoami",
        "kv.fail",
        "kv.slow_read",
        "kv.slow_write",
    }
    assert served["calc.add"].idempotent and not served["kv.fail"].idempotent
    with pytest.raises(SidecarOptionError, match="the server has no such tool"):
        mcp_tool_parts(tools, ["nope=calc.nope"], None)
    with pytest.raises(ServerError, match="cannot list the tools"):
        await fetch_tools(f"http://127.0.0.1:{free_port()}/mcp")


async def test_an_answer_on_a_stream_the_server_keeps_open_is_taken_at_once() -> None:
    """The specification lets a server keep its event stream open after the answer: the
    call ends at the answer's frame, not when the stream closes."""

    async def mcp(request: Request) -> Response:
        call = await request.json()
        if "id" not in call:
            return Response(status_code=202)
        answer = {"jsonrpc": "2.0", "id": call["id"]}
        if call["method"] == "initialize":
            answer["result"] = {"protocolVersion": "2025-11-25", "capabilities": {}}
        else:
            answer["result"] = {"content": [], "structuredContent": {"ok": "a\u2028b"}}

        async def frames() -> AsyncIterator[bytes]:
            yield b"data: " + msgspec.json.encode(answer) + b"\r\n\r\n"
            await anyio.sleep(60)  # and never closes

        return StreamingResponse(frames(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/mcp", mcp, methods=["POST"])])
    async with serve_app(app) as base:
        tools = {"calc.add": Tool("add", "", True)}
        url = base.rstrip("/") + "/mcp"
        transport = McpTransport(url, tools, timeout_s=30.0, max_connections=2)
        envelope = complete(Envelope(capability="calc.add", payload=msgspec.Raw(b"{}")))
        with anyio.fail_after(10):
            outcome = await transport.deliver(envelope, 1)
        await transport.aclose()
    assert outcome == Succeeded(msgspec.json.encode({"ok": "a\u2028b"}))


# -- usage reported in a tool result's _meta --------------------------------------------------


@asynccontextmanager
async def billing_server() -> AsyncIterator[RunningServer]:
    """The support server's tools, and two that report what they used in their result's
    ``_meta.usage``: ``summarize(words, cost)`` succeeds, ``refuse(cost)`` is a tool error."""
    log = ToolLog()
    server = mcp_server(log)

    @server.tool(annotations=IDEMPOTENT)
    def summarize(words: int, cost: float) -> CallToolResult:
        """Summarize, reporting the tokens and cost of it."""
        used = {"input_tokens": words, "output_tokens": words // 10, "cost": cost}
        return CallToolResult(
            content=[TextContent(type="text", text=f"{words} words")],
            structured_content={"summary": f"{words} words"},
            _meta={"usage": used},
        )

    @server.tool(annotations=NOT_IDEMPOTENT)
    def refuse(cost: float) -> CallToolResult:
        """Fail, after spending ``cost``."""
        used = {"input_tokens": 9, "output_tokens": 0, "cost": cost}
        return CallToolResult(
            content=[TextContent(type="text", text="too long to summarize")],
            is_error=True,
            _meta={"usage": used},
        )

    port = free_port()
    app = server.streamable_http_app()
    async with server.session_manager.run(), serve_app(app, "127.0.0.1", port):
        yield RunningServer(f"http://127.0.0.1:{port}/mcp", log)


async def test_usage_in_a_tool_results_meta_is_recorded_and_charged(conn: Connection) -> None:
    """What a tool reports in ``_meta.usage`` — with its result, or with its error — is on the
    record and the timeline of the ending and charged to the agent, the capability and the
    tenant; a tool that reports nothing is charged a request and no usage."""
    mapping = ["summarize=text.summarize", "refuse=text.refuse", "add=calc.add"]
    async with (
        billing_server() as server,
        behind_a_sidecar(conn, server.url, mapping) as (
            client,
            _,
        ),
    ):
        began = anyio.current_time()
        short = await client.request(
            "text.summarize", {"words": 120, "cost": 0.25}, tenant="team-a", timeout=20
        )
        long = await client.request(
            "text.summarize", {"words": 2000, "cost": 1.5}, tenant="team-a", timeout=20
        )
        refused = await client.request("text.refuse", {"cost": 0.125}, tenant="team-b", timeout=20)
        added = await client.request("calc.add", {"a": 1, "b": 2}, timeout=20)
        took_ms = (anyio.current_time() - began) * 1000

    assert short.ok and short.result == {"summary": "120 words"} and long.ok
    assert refused.stage is Stage.FAILED and "too long to summarize" in (refused.error or "")
    assert added.ok and added.result == {"result": 3}
    store = MessageStore(conn)
    reports = {
        short.id: ({"input_tokens": 120, "output_tokens": 12, "cost": 0.25}, "SUCCEEDED"),
        long.id: ({"input_tokens": 2000, "output_tokens": 200, "cost": 1.5}, "SUCCEEDED"),
        refused.id: ({"input_tokens": 9, "cost": 0.125}, "FAILED"),  # 0 tokens: left out
    }
    for message_id, (used, ending) in reports.items():
        stored = await conn.call("HGET", conn.keys.record(message_id), "usage:1")
        assert stored is not None and json.loads(stored) == used, message_id
        timeline = await store.get_timeline(message_id)
        said = (
            f"usage in={used['input_tokens']} out={used.get('output_tokens', 0)} "
            f"cost={used['cost']:g}"
        )
        assert str(timeline[-1].stage) == ending and said in timeline[-1].reason, timeline[-1]
        assert sum(said in entry.reason for entry in timeline) == 1, timeline
    assert await conn.call("HGET", conn.keys.record(added.id), "usage:1") is None

    rows = await usage_lately(conn, "capability")
    by_capability: dict[str, dict[str, Any]] = {row.name: row.as_json() for row in rows}
    summarize = by_capability["text.summarize"]
    assert (summarize["requests"], summarize["succeeded"], summarize["reported"]) == (2, 2, 2)
    assert (summarize["input_tokens"], summarize["output_tokens"]) == (2120, 212)
    assert summarize["cost"] == 1.75
    refuse = by_capability["text.refuse"]
    assert (refuse["requests"], refuse["failed"], refuse["reported"]) == (1, 1, 1)
    assert (refuse["input_tokens"], refuse["output_tokens"], refuse["cost"]) == (9, 0, 0.125)
    plain = by_capability["calc.add"]
    assert (plain["requests"], plain["succeeded"], plain["reported"], plain["cost"]) == (1, 1, 0, 0)
    [by_agent] = await usage_lately(conn, "agent")
    figures = by_agent.as_json()
    assert 0 <= figures.pop("busy_ms") <= took_ms + 4  # the calls, one after another
    assert figures == {
        "name": "calc",
        "requests": 4,
        "succeeded": 3,
        "failed": 1,
        "retried": 0,
        "reported": 3,
        "input_tokens": 2129,
        "output_tokens": 212,
        "cost": 1.875,
    }
    by_tenant = {row.name: row.as_json() for row in await usage_lately(conn, "tenant")}
    assert (by_tenant["team-a"]["cost"], by_tenant["team-b"]["cost"]) == (1.75, 0.125)
