"""Fleet events: what happened to instances, circuits, messages, budgets and rate limits. Pure.

Each event is a typed record appended to the capped stream ``P:events``; subscriptions
(``agent-reach subscribe``, config ``event_subscriptions``) receive matching ones as signed
webhooks from the notifier.
"""

from __future__ import annotations

import json

EVENT_TYPES: tuple[str, ...] = (
    "instance.registered",
    "instance.state_changed",
    "instance.drained",
    "instance.gone",
    "circuit.opened",
    "circuit.closed",
    "message.dead",
    "message.needs_confirmation",
    "budget.exceeded",
    "rate_limit.saturated",
)


def event_fields(kind: str, subject: str, now_ms: int, **detail: object) -> dict[str, str]:
    """The stream entry of one event: ``type``, ``subject`` (the instance, message, tenant or
    limit it is about), ``ts`` (ms) and ``detail`` (JSON)."""
    assert kind in EVENT_TYPES, kind
    return {
        "type": kind,
        "subject": subject,
        "ts": str(now_ms),
        "detail": json.dumps(detail, separators=(",", ":"), default=str),
    }


def append_event(stream: str, max_len: int, fields: dict[str, str]) -> tuple[str, ...]:
    """The command that appends an event to ``P:events``, trimmed to about ``max_len``."""
    flat = [item for pair in fields.items() for item in pair]
    return ("XADD", stream, "MAXLEN", "~", str(max_len), "*", *flat)
