"""The ``python`` adapter: an in-process handler per capability.

::

    agent = Agent("orders")

    @agent.handler("order.query")
    async def handle(envelope: Envelope) -> dict:
        return {"status": "shipped", "order": envelope.payload_json()["order"]}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from broker.envelope import Envelope

from .outcome import Failed, Outcome, Succeeded

Handler = Callable[[Envelope], Awaitable[Any]]

_encoder = msgspec.json.Encoder()


class Agent:
    """A set of in-process handlers, one per capability; it is its own transport."""

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        self._handlers: dict[str, Handler] = {}

    def handler(self, capability: str) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            if capability in self._handlers:
                raise ValueError(f"capability {capability!r} already has a handler")
            self._handlers[capability] = fn
            return fn

        return register

    @property
    def capabilities(self) -> tuple[str, ...]:
        return tuple(self._handlers)

    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        handler = self._handlers.get(envelope.capability)
        if handler is None:
            return Failed(f"agent {self.agent_id!r} has no handler for {envelope.capability!r}")
        try:
            result = await handler(envelope.for_agent())
        except Exception as exc:
            return Failed(f"handler raised {type(exc).__name__}: {exc}")
        try:
            return Succeeded(_encoder.encode(result))
        except (TypeError, msgspec.EncodeError) as exc:
            return Failed(f"handler returned a value that is not JSON: {exc}")

    async def aclose(self) -> None:
        return None
