"""A real async agent on loopback: it answers 202, works, and POSTs its result to the
callback URL it was given; it also answers status queries (``GET /status/<id>``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import httpx
from anyio.abc import TaskGroup
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
