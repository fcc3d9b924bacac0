"""Answers an agent (or whatever listens at its URL) may send that no well-behaved server
would: each call still ends within its time, and within its memory."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import tracemalloc
import zlib
from typing import Any

import anyio
import msgspec
import pytest

from adapters.a2a import A2ATransport
from adapters.a2a_wire import AgentCardView
from adapters.callbacks import CallbackTokens
from adapters.http import HttpAsyncTransport, HttpTransport
from adapters.mcp import McpTransport, ServerError, fetch_tools
from adapters.mcp_wire import Tool
from adapters.outcome import Accepted, Ambiguous, Backoff, Failed, NotReached, Succeeded
from adapters.status import StatusClient
from broker.client import Client
from broker.connection import Connection
from broker.envelope import Envelope, complete
from broker.stages import Stage
from tests.support.harness import running_dispatcher, running_sidecar
from tests.support.raw_http import Answer, raw_http

TIMEOUT_S = 0.5
WATCH_S = 10.0  # far past the call's time: only a call that never ends reaches it


def envelope() -> Envelope:
    return complete(Envelope(capability="text.echo", payload=msgspec.Raw(b"1")))


async def body_a_byte_at_a_time(request: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    writer.write(b"Content-Length: 100000\r\n\r\n")
    while True:  # every read sees a byte well within its timeout
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(TIMEOUT_S / 5)


async def headers_a_byte_at_a_time(request: bytes, writer: asyncio.StreamWriter) -> None:
    while True:
        writer.write(b"X")
        await writer.drain()
        await asyncio.sleep(TIMEOUT_S / 5)


async def test_an_answer_trickled_a_byte_at_a_time_ends_the_call_at_its_time() -> None:
    """httpx bounds each read, not the call: an agent that kept a byte coming held the call,
    and its credit, for good. Headers or body, the call ends ambiguous at its time."""
    outcomes = []
    for trickle in (body_a_byte_at_a_time, headers_a_byte_at_a_time):
        async with raw_http(trickle) as (url, requests):
            transport = HttpTransport(url, timeout_s=TIMEOUT_S, max_connections=1)
            with anyio.fail_after(WATCH_S):
                outcomes.append(await transport.deliver(envelope(), 1))
            await transport.aclose()
        assert len(requests) == 1
    for outcome in outcomes:
        assert isinstance(outcome, Ambiguous), outcome
        assert f"no whole answer within {TIMEOUT_S:g} s" in outcome.reason


async def test_a_status_endpoint_that_trickles_is_unknown_at_its_time() -> None:
    async with raw_http(body_a_byte_at_a_time) as (url, _):
        client = StatusClient(timeout_s=TIMEOUT_S)
        with anyio.fail_after(WATCH_S):
            status = await client.query(f"{url}status", "m1")
        await client.aclose()
    assert status.state == "unknown" and "ReadTimeout" in status.why


def encoded(body: bytes, encoding: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: "
        + encoding
        + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def test_a_compressed_bomb_is_cut_off_at_the_limit_not_inflated_whole() -> None:
    """200 MB of zeros in 200 KB of gzip: httpx inflated each 64 KiB read whole (the answer
    peaked at 140 MiB for a 1 MiB limit). Inflated a bounded piece at a time, the call
    holds little more than the limit."""
    bomb = gzip.compress(b"0" * (200 * 1024 * 1024), compresslevel=9)

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(encoded(bomb, b"gzip"))
        await writer.drain()

    async with raw_http(answer) as (url, _):
        transport = HttpTransport(url, timeout_s=10, max_connections=1)
        tracemalloc.start()
        try:
            outcome = await transport.deliver(envelope(), 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await transport.aclose()
    assert isinstance(outcome, Failed) and "over the 1048576-byte limit" in outcome.reason
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB held for a 1 MiB limit"


async def test_compressed_answers_within_the_limit_are_read_as_before() -> None:
    """gzip, deflate as RFC 9110 says (zlib), and deflate as some servers send it (raw); an
    answer that is not what it says it is, ambiguous (it came, and could not be read)."""
    result = b'{"answer": "' + b"x" * 5000 + b'"}'
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    bodies = [
        encoded(gzip.compress(result), b"gzip"),
        encoded(zlib.compress(result), b"deflate"),
        encoded(raw.compress(result) + raw.flush(), b"Deflate"),
        encoded(b"not gzip at all", b"gzip"),
    ]
    outcomes = []
    for body in bodies:

        async def answer(request: bytes, writer: asyncio.StreamWriter, body: bytes = body) -> None:
            writer.write(body)
            await writer.drain()

        async with raw_http(answer) as (url, _):
            transport = HttpTransport(url, timeout_s=10, max_connections=1)
            outcomes.append(await transport.deliver(envelope(), 1))
            await transport.aclose()
    assert outcomes[:3] == [Succeeded(result)] * 3
    assert isinstance(outcomes[3], Ambiguous) and "answer not gzip" in outcomes[3].reason


def plain(status: bytes, body: bytes, extra: bytes = b"") -> Answer:
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + extra)
        writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    return answer


async def test_what_a_status_says_holds_however_long_its_body() -> None:
    """A 202 is taken work and a 429 back-pressure, with a body over the limit too (it was
    a final failure: the callback that followed found the message FAILED)."""
    big = b"x" * (1024 * 1024 + 10)
    async with raw_http(plain(b"202 Accepted", big)) as (url, _):
        taking = HttpAsyncTransport(url, timeout_s=10, max_connections=1)
        taking.bind_callbacks("http://127.0.0.1:9", CallbackTokens(b"k" * 32))
        taken = await taking.deliver(envelope(), 1)
        await taking.aclose()
    async with raw_http(plain(b"429 Too Many Requests", big, b"Retry-After: 2\r\n")) as (url, _):
        busy = HttpTransport(url, timeout_s=10, max_connections=1)
        refused = await busy.deliver(envelope(), 1)
        await busy.aclose()
    async with raw_http(plain(b"200 OK", big)) as (url, _):
        answering = HttpTransport(url, timeout_s=10, max_connections=1)
        answered = await answering.deliver(envelope(), 1)
        await answering.aclose()
    assert taken == Accepted("")
    assert isinstance(refused, Backoff) and refused.retry_after_s == 2.0
    assert isinstance(answered, Failed) and "over the 1048576-byte limit" in answered.reason


async def test_a_result_nested_past_the_limit_is_the_agents_failure(conn: Connection) -> None:
    """As a callback's result is held to 64 levels, so is a call's (and what a status
    endpoint says of one): 900 levels decode in the sidecar, and fail a reader whose stack
    is deeper where it decodes them (a trace, the console, a client)."""
    deep = b"[" * 900 + b"]" * 900
    async with (
        raw_http(plain(b"200 OK", deep)) as (url, _),
        running_sidecar(conn, "deep-1", ("text.echo",), url=url),
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        result = await client.request("text.echo", 1, timeout=20)
    statuses = []
    for value in (deep, b"1" * 5000):  # too deep; and an integer no reader builds
        said = b'{"state": "done", "result": ' + value + b"}"
        async with raw_http(plain(b"200 OK", said)) as (url, _):
            asking = StatusClient(timeout_s=5)
            statuses.append(await asking.query(f"{url}status", "m1"))
            await asking.aclose()
    status, unbuildable = statuses
    assert result.stage is Stage.FAILED
    assert result.error is not None and "JSON nested 900 levels deep" in result.error
    assert status.state == "unknown" and "nested 900 levels" in status.why
    assert unbuildable.state == "unknown" and "result not readable" in unbuildable.why


async def mcp_with_an_unusable_session(request: bytes, writer: asyncio.StreamWriter) -> None:
    """An MCP server that names its session in a byte no client may send back (obs-text:
    HTTP parsers take it, httpx cannot encode it)."""
    await mcp_server(request, writer, session=b"s\xe9ssion")


async def mcp_server(request: bytes, writer: asyncio.StreamWriter, *, session: bytes) -> None:
    said = json.loads(request.split(b"\r\n\r\n", 1)[1] or b"null")
    if "id" not in said:  # a notification
        writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return
    if said["method"] == "initialize":
        version, server = "2025-11-25", {"name": "x", "version": "1"}
        result: dict[str, Any] = {"protocolVersion": version, "serverInfo": server}
    elif said["method"] == "tools/list":
        result = {"tools": [{"name": "echo"}]}
    else:
        result = {"structuredContent": {"ok": True}, "content": []}
    body = json.dumps({"jsonrpc": "2.0", "id": said["id"], "result": result}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    writer.write(b"Mcp-Session-Id: " + session + b"\r\n")
    writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()


async def test_an_mcp_session_id_no_header_can_carry_is_refused_before_any_call() -> None:
    """It was kept, and every call then raised from httpx before it was sent, out of the
    transport: at start a traceback, at run time a final failure of a call never made. Now
    the session is refused with the reason: the start-up stops with it, and a call is not
    reached (a retry is safe)."""
    async with raw_http(mcp_with_an_unusable_session) as (url, requests):
        with pytest.raises(ServerError, match="session id is unusable"):
            await fetch_tools(url, timeout_s=5)
        tools = {"tool.echo": Tool("echo", "", False)}
        transport = McpTransport(url, tools, timeout_s=5, max_connections=1)
        asked = Envelope(capability="tool.echo", payload=msgspec.Raw(b"{}"))
        outcome = await transport.deliver(complete(asked), 1)
        await transport.aclose()
    assert isinstance(outcome, NotReached) and "'séssion'" in outcome.reason
    assert not [r for r in requests if b"tools/call" in r]


async def test_a_connect_that_never_completes_is_not_reached_within_the_deadline() -> None:
    """A port whose accept queue is full: the connect hangs, nothing is sent. The whole
    exchange's deadline equals the connect timeout (both the call's timeout), and it must
    say what happened — not reached, a retry safe — not an ambiguous answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.socket()
    filler.connect(listener.getsockname())  # the queue is full: the next connect waits
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    plain = HttpTransport(url, timeout_s=1.0, max_connections=1)
    outcomes = []
    with anyio.fail_after(WATCH_S):
        outcomes.append(await plain.deliver(envelope(), 1))
        for streaming in (False, True):  # A2A: JSON-RPC, and a streamed send
            card = AgentCardView("a", "1", "", url, "1.0", (), False, streaming)
            a2a = A2ATransport(card, timeout_s=1.0, max_connections=1)
            outcomes.append(await a2a.deliver(envelope(), 1))
            await a2a.aclose()
    await plain.aclose()
    filler.close()
    listener.close()
    assert all(isinstance(o, NotReached) for o in outcomes), outcomes


async def test_an_empty_mcp_session_id_is_a_stateless_server() -> None:
    """``Mcp-Session-Id:`` with no value names no session: the server is stateless, and
    its tools are listed and called as ever."""

    async def stateless(request: bytes, writer: asyncio.StreamWriter) -> None:
        await mcp_server(request, writer, session=b"")

    async with raw_http(stateless) as (url, _):
        tools = await fetch_tools(url, timeout_s=5)
        transport = McpTransport(url, {"tool.echo": tools[0]}, timeout_s=5, max_connections=1)
        asked = Envelope(capability="tool.echo", payload=msgspec.Raw(b"{}"))
        outcome = await transport.deliver(complete(asked), 1)
        await transport.aclose()
    assert [t.name for t in tools] == ["echo"]
    assert isinstance(outcome, Succeeded), outcome
