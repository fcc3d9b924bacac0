"""A transport reaches one agent: one async method and a close."""

from __future__ import annotations

from typing import Protocol

from broker.envelope import Envelope
from broker.headers import agent_headers

from .outcome import Outcome


class Transport(Protocol):
    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        """Send one attempt of ``envelope`` to the agent and say what is known of the outcome."""
        ...

    async def aclose(self) -> None: ...


def reach_headers(envelope: Envelope, attempt: int) -> dict[str, str]:
    """The headers every adapter passes to its agent (DESIGN §7): the producer's own, then
    ours, set last so that each appears once (:func:`broker.headers.agent_headers`)."""
    ours = {
        "X-Reach-Message-Id": envelope.message_id,
        "X-Reach-Idempotency-Key": envelope.idempotency,
        "X-Reach-Attempt": str(attempt),
        "X-Reach-Capability": envelope.capability,
    }
    if envelope.traceparent:
        ours["traceparent"] = envelope.traceparent
        if envelope.tracestate:
            ours["tracestate"] = envelope.tracestate
    return agent_headers(envelope.headers, ours)
