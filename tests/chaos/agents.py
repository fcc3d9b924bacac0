"""The chaos run's HTTP agents, served in the test process on loopback.

Each answers ``POST /`` with JSON after a short random delay and keeps what it executed — an
execution is a POST it answered with 2xx — so the test can count executions per message at
the agent itself. ``GET /status/{message_id}`` tells the reaper what became of a message:
``{"state": "done", "result": ...}`` for one it executed, 404 otherwise.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app

MIN_DELAY_S = 0.005
MAX_DELAY_S = 0.040


@dataclass
class Executions:
    """What one agent executed: message id -> count, and the result it answered."""

    counts: Counter[str] = field(default_factory=Counter)
    results: dict[str, Any] = field(default_factory=dict)
    running: int = 0  # requests being handled now

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def twice(self) -> dict[str, int]:
        return {message_id: n for message_id, n in self.counts.items() if n > 1}


@dataclass
class ChaosAgent:
    name: str
    idempotent: bool
    url: str
    executions: Executions

    @property
    def status_url(self) -> str:
        return f"{self.url.rstrip('/')}/status"


def _app(name: str, executions: Executions, rng: random.Random) -> Starlette:
    async def handle(request: Request) -> Response:
        envelope = await request.json()
        message_id = request.headers.get("x-reach-message-id", "")
        executions.running += 1
        try:
            await anyio.sleep(rng.uniform(MIN_DELAY_S, MAX_DELAY_S))
        finally:
            executions.running -= 1
        result = {"agent": name, "echo": envelope.get("payload")}
        executions.counts[message_id] += 1  # answered 2xx just below: an execution
        executions.results[message_id] = result
        return JSONResponse(result)

    async def status(request: Request) -> Response:
        message_id = request.path_params["message_id"]
        if message_id not in executions.results:
            return JSONResponse({"state": "unknown"}, status_code=404)
        return JSONResponse({"state": "done", "result": executions.results[message_id]})

    return Starlette(
        routes=[
            Route("/", handle, methods=["POST"]),
            Route("/status/{message_id}", status, methods=["GET"]),
        ]
    )


@asynccontextmanager
async def chaos_agent(name: str, *, idempotent: bool, seed: int) -> AsyncIterator[ChaosAgent]:
    """Serve one agent on a free loopback port for the block's life."""
    executions = Executions()
    async with serve_app(_app(name, executions, random.Random(seed))) as url:
        yield ChaosAgent(name, idempotent, url, executions)
