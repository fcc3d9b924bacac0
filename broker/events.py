"""Fleet events: what happened to instances, circuits, messages, budgets and rate limits. Pure.

Each event is a typed record appended to the capped stream ``P:events``; subscriptions
(``agent-reach subscribe``, config ``event_subscriptions``) receive matching ones as signed
webhooks from the notifier.
"""

from __future__ import annotations

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
