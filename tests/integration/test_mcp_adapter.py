"""The ``mcp`` adapter (adapters/mcp.py) against servers built with the official ``mcp`` SDK
(tests/support/mcp_servers.py), behind a real sidecar and dispatcher on real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
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
from tests.support.harness import running_dispatcher, running_sidecar
from tests.support.mcp_servers import mcp_http_server

TOOLS = ["add=calc.add", "whoami=calc.whoami", "fail=calc.fail"]


@asynccontextmanager
async def behind_a_sidecar(
    conn: Connection, url: str
) -> AsyncIterator[tuple[Client, McpTransport]]:
    tools = mcp_tool_parts(await fetch_tools(url), TOOLS, None)
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
