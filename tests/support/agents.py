"""Real HTTP agents on loopback for tests: a Starlette app served by uvicorn in the test's loop.

Each agent records what it saw, measured at the agent: calls per message id, the headers of
each call, and the highest number of concurrent requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app
from adapters.python import Agent
from broker.envelope import Envelope

Behaviour = Callable[[dict[str, Any], Request], Awaitable[Response | None]]


@dataclass
class AgentLog:
    calls: Counter[str] = field(default_factory=Counter)
    headers: list[dict[str, str]] = field(default_factory=list)
    raw_headers: list[list[tuple[bytes, bytes]]] = field(default_factory=list)  # as sent
    concurrent: int = 0
    peak_concurrent: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@dataclass
class RunningAgent:
    url: str
    log: AgentLog


def _app(name: str, log: AgentLog, delay_s: float, behaviour: Behaviour | None) -> Starlette:
    async def handle(request: Request) -> Response:
        envelope = await request.json()
        message_id = request.headers.get("x-reach-message-id", "")
        log.calls[message_id] += 1
        log.headers.append(dict(request.headers))
        log.raw_headers.append(list(request.headers.raw))
        log.concurrent += 1
        log.peak_concurrent = max(log.peak_concurrent, log.concurrent)
        try:
            if delay_s:
                await anyio.sleep(delay_s)
            if behaviour is not None:
                answer = await behaviour(envelope, request)
                if answer is not None:
                    return answer
            return JSONResponse({"agent": name, "echo": envelope.get("payload")})
        finally:
            log.concurrent -= 1

    return Starlette(routes=[Route("/", handle, methods=["POST"])])


class Gate:
    """An agent behaviour that holds every call until the gate opens: saturation on demand."""

    def __init__(self) -> None:
        self._open = anyio.Event()

    def open(self) -> None:
        self._open.set()

    async def __call__(self, envelope: dict[str, Any], request: Request) -> Response | None:
        await self._open.wait()
        return None


@asynccontextmanager
async def http_agent(
    name: str = "agent", *, delay_s: float = 0.0, behaviour: Behaviour | None = None
) -> AsyncIterator[RunningAgent]:
    """Serve a test agent on a free loopback port for the block's life."""
    log = AgentLog()
    async with serve_app(_app(name, log, delay_s, behaviour)) as url:
        yield RunningAgent(url, log)


def recording_agent(agent_id: str, capability: str = "text.echo") -> tuple[Agent, list[str]]:
    """An in-process agent that answers ``{}`` to ``capability``, and the ids of the messages
    it was called with, in order."""
    calls: list[str] = []
    agent = Agent(agent_id)

    @agent.handler(capability)
    async def record(envelope: Envelope) -> dict[str, Any]:
        calls.append(envelope.id)
        return {}

    return agent, calls
