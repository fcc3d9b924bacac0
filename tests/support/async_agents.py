"""A real async agent on loopback: it answers 202, works, and POSTs its result to the
callback URL it was given; it also answers status queries (``GET /status/<id>``). And a raw
HTTP client, for what a well-behaved one cannot send (a lying ``Content-Length``, half a
request's headers)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import httpx
from anyio.abc import SocketStream, TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app
from adapters.callbacks import TOKEN_HEADER, URL_HEADER


@dataclass
class Received:
    """One request the agent took: where and how to call back, and what it was asked."""

    message_id: str
    callback_url: str
    token: str
    payload: Any


@dataclass
class Callback:
    status: int
    body: dict[str, Any]


@dataclass
class AsyncAgent:
    url: str = ""
    status_url: str = ""
    received: dict[str, Received] = field(default_factory=dict)
    callbacks: list[Callback] = field(default_factory=list)
    status_queries: list[str] = field(default_factory=list)
    # what GET /status/<id> says: "running" while it works, unless told otherwise
    status: Literal["running", "done", "unknown"] = "running"
    client: httpx.AsyncClient = field(default_factory=httpx.AsyncClient)

    async def call_back(
        self, message_id: str, body: dict[str, Any], *, token: str | None = None
    ) -> Callback:
        """POST a result to the sidecar, as the agent would (with its token, or ``token``)."""
        taken = self.received[message_id]
        response = await self.client.post(
            taken.callback_url,
            json=body,
            headers={TOKEN_HEADER: taken.token if token is None else token},
        )
        callback = Callback(response.status_code, response.json())
        self.callbacks.append(callback)
        return callback


@asynccontextmanager
async def async_agent(
    *, call_back_after_s: float | None = None, plain_202: bool = False
) -> AsyncIterator[AsyncAgent]:
    """Serve an async agent; with ``call_back_after_s`` it calls back by itself (echoing the
    payload) that long after taking each request; otherwise the test calls back. It answers
    202 with ``{"task_id": ...}``, or (``plain_202``) with the text "Accepted"."""
    agent = AsyncAgent()

    async def work(tg: TaskGroup, taken: Received) -> None:
        assert call_back_after_s is not None
        await anyio.sleep(call_back_after_s)  # the agent's own work time, not synchronisation
        await agent.call_back(taken.message_id, {"result": {"echo": taken.payload}})

    async def take(request: Request) -> Response:
        envelope = await request.json()
        taken = Received(
            request.headers["x-reach-message-id"],
            request.headers[URL_HEADER],
            request.headers[TOKEN_HEADER],
            envelope.get("payload"),
        )
        agent.received[taken.message_id] = taken
        if call_back_after_s is not None:
            tg.start_soon(work, tg, taken)
        if plain_202:
            return PlainTextResponse("Accepted", status_code=202)
        return JSONResponse({"task_id": f"task-{taken.message_id}"}, status_code=202)

    async def status(request: Request) -> Response:
        message_id = request.path_params["message_id"]
        agent.status_queries.append(message_id)
        if agent.status == "done":
            return JSONResponse({"state": "done", "result": {"from": "status"}})
        return JSONResponse({"state": agent.status})

    app = Starlette(
        routes=[
            Route("/", take, methods=["POST"]),
            Route("/status/{message_id}", status, methods=["GET"]),
        ]
    )
    async with anyio.create_task_group() as tg, serve_app(app) as url:
        agent.url = url
        agent.status_url = f"{url}status"
        try:
            yield agent
        finally:
            tg.cancel_scope.cancel()
            await agent.client.aclose()


@asynccontextmanager
async def raw_connection(url: str) -> AsyncIterator[SocketStream]:
    """A plain TCP connection to the host and port of ``url``."""
    parsed = httpx.URL(url)
    assert parsed.port is not None
    async with await anyio.connect_tcp(parsed.host, parsed.port) as stream:
        yield stream


async def read_until_closed(stream: SocketStream, *, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection; fails after
    ``timeout_s`` if it does not."""
    received = b""
    with anyio.fail_after(timeout_s):
        while True:
            try:
                received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return received


async def read_response(stream: SocketStream, *, timeout_s: float) -> bytes:
    """One whole response (head and ``Content-Length`` body) from a kept-alive connection."""
    received = b""
    with anyio.fail_after(timeout_s):
        while b"\r\n\r\n" not in received:
            received += await stream.receive()
        head, _, body = received.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += await stream.receive()
    return head + b"\r\n\r\n" + body


def raw_post(url: str, token: str, body: bytes, *, content_length: int) -> bytes:
    """A POST to ``url`` declaring ``content_length``, whatever ``body``'s real length."""
    target = httpx.URL(url)
    head = (
        f"POST {target.raw_path.decode()} HTTP/1.1\r\n"
        f"Host: {target.host}:{target.port}\r\n"
        f"X-Reach-Callback-Token: {token}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def status_of(response: bytes) -> int:
    """The status code of the first response in raw bytes."""
    return int(response.split(b" ", 2)[1])
