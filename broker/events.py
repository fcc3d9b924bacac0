"""Fleet events: what happened to instances, circuits, messages, budgets and rate limits. Pure.

Each event is a typed record appended to the capped stream ``P:events``; subscriptions
(``agent-reach subscribe``, config ``event_subscriptions``) receive matching ones as signed
webhooks from the notifier.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

import msgspec

from .records import CircuitState, InstanceStats

EVENT_TYPES: tuple[str, ...] = (
    "instance.registered",
    "instance.state_changed",
    "instance.duplicate",
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


# -- reading events back, and delivering them -------------------------------------------------

# what a type may look like: ours are `noun.verb_ed`; a newer broker's are relayed too
_TYPE = re.compile(r"[a-z][a-z_]{0,39}\.[a-z][a-z_]{0,39}")
MAX_SUBJECT = 1024
MAX_DETAIL_BYTES = 65_536
# an event delivery's outbox `id` starts with this: its dead letter is no message's, and
# reports no `message.dead` (an undeliverable subscription must not feed itself). `~` is in
# no message id (broker/envelope.py), so no producer can pass a message off as an event's.
DELIVERY_PREFIX = "~event."


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of ``P:events`` as read back: ``id`` is its stream entry id, ``detail`` a
    JSON object (kept as its bytes)."""

    id: str
    type: str
    subject: str
    ts: int
    detail: msgspec.Raw


def parse_event(entry_id: str, fields: Mapping[str, bytes]) -> Event | str:
    """The event a stream entry holds, or why it holds none. Never raises, whatever the
    bytes: anyone who can ``XADD`` to ``P:events`` can write an entry."""
    try:
        kind = fields["type"].decode()
        subject = fields["subject"].decode()
        stamp = fields["ts"]
        detail = fields["detail"]
    except KeyError as exc:
        return f"event {entry_id}: no field {exc.args[0]}"
    except UnicodeDecodeError:
        return f"event {entry_id}: type or subject is not UTF-8"
    if not _TYPE.fullmatch(kind):
        return f"event {entry_id}: {kind[:60]!r} is not an event type"
    if len(subject) > MAX_SUBJECT or not subject.isprintable():
        return f"event {entry_id}: the subject is not printable text of at most {MAX_SUBJECT}"
    if not (stamp.isdigit() and len(stamp) <= 19):
        return f"event {entry_id}: ts is not a time in ms"
    if len(detail) > MAX_DETAIL_BYTES or not _is_object(detail):
        return f"event {entry_id}: detail is not a JSON object of at most {MAX_DETAIL_BYTES} bytes"
    return Event(id=entry_id, type=kind, subject=subject, ts=int(stamp), detail=msgspec.Raw(detail))


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(msgspec.json.decode(raw), dict)
    except (msgspec.DecodeError, RecursionError):
        return False


def event_body(event: Event) -> bytes:
    """The JSON a subscription's webhook receives: ``{type, subject, ts, detail, id}``."""
    return msgspec.json.encode(
        {
            "type": event.type,
            "subject": event.subject,
            "ts": event.ts,
            "detail": event.detail,
            "id": event.id,
        }
    )


def delivery_ids(entry_id: str, subscription_id: str) -> tuple[str, str]:
    """The outbox ``id`` and the ``webhook-id`` of one event's delivery to one subscription:
    unique per delivery, the same on every retry (receivers de-duplicate on it)."""
    webhook_id = f"{entry_id}.{subscription_id}"
    return f"{DELIVERY_PREFIX}{webhook_id}", webhook_id


def is_event_delivery(message_id: str) -> bool:
    return message_id.startswith(DELIVERY_PREFIX)


def unknown_types(kinds: Iterable[str]) -> list[str]:
    """The names in ``kinds`` that are no event type, sorted."""
    return sorted(set(kinds) - set(EVENT_TYPES))


def types_problem(kinds: Iterable[str]) -> str | None:
    """Why ``kinds`` cannot be subscribed to (an unknown type, with the known ones), or ``None``."""
    if unknown := unknown_types(kinds):
        return f"unknown event type {', '.join(unknown)}; known: {', '.join(EVENT_TYPES)}"
    return None


def detail_text(detail: bytes) -> str:
    """``detail`` as ``key=value`` words, for a line a person reads — on a terminal: control
    characters (an agent's words reach dead-letter reasons) are shown escaped, never sent."""
    try:
        decoded = msgspec.json.decode(detail)
        if not isinstance(decoded, dict):
            return printable(str(decoded))
        # a value nested deep enough to decode may still be too deep to write out again
        return printable(" ".join(f"{key}={_word(value)}" for key, value in decoded.items()))
    except (msgspec.DecodeError, RecursionError):
        return printable(detail.decode(errors="replace"))


def printable(text: str) -> str:
    """``text`` with every character Python does not count as printable written as an
    escape: C0 and C1 controls (ESC sequences, CR), line and paragraph separators (a new
    line to many terminals), the bidirectional overrides and isolates that reorder what
    follows them on screen ("Trojan Source"), zero-width and other invisible format
    characters, unassigned code points. Stored text an operator reads is shown as it is, not
    as it would have the screen look. (Joiners inside emoji sequences are escaped too.)"""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _word(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def heartbeat_events(
    state_before: str, state_now: str, circuit_before: str, stats: InstanceStats
) -> list[tuple[str, dict[str, object]]]:
    """The events a heartbeat reports (``lua/heartbeat.lua`` answers with the card's state
    and circuit before it): ``instance.state_changed`` with ``from`` and ``to``;
    ``circuit.opened`` when the circuit opened, ``circuit.closed`` when it closed again
    (half-open in between is no event)."""
    found: list[tuple[str, dict[str, object]]] = []
    figures: dict[str, object] = {"error_rate": stats.error_rate, "requests": stats.requests}
    if state_now != state_before:
        found.append(("instance.state_changed", {"from": state_before, "to": state_now, **figures}))
    circuit = stats.circuit.value
    if circuit != (circuit_before or CircuitState.CLOSED.value):
        if circuit == CircuitState.OPEN.value:
            found.append(("circuit.opened", {"until_ms": stats.circuit_until_ms, **figures}))
        elif circuit == CircuitState.CLOSED.value:
            found.append(("circuit.closed", figures))
    return found
