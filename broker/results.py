"""What telling a producer its result takes, as Redis commands: one place for every ending.

Whoever ends a message (a sidecar, the reaper, an operator, the dispatcher) sends the same
commands, after the terminal stage is on the record and before it lets go of the work (its
stream entry, its ``reply_pending`` mark): a crash in between sends them again, so delivery
is at least once and every copy carries the message id.

- ``reply_to``: an entry on the producer's reply stream (:class:`broker.wire.ReplyEntry`:
  fields ``id``, ``stage``, ``attempt``, and ``result`` or ``error``).
- ``callback_url``: an entry on ``P:outbox`` (:class:`broker.wire.OutboxEntry`) for the
  notifier, which POSTs the signed body to the webhook, with retries.
- a broadcast child (``parent`` set): its outcome is recorded on its parent
  (``lua/child_done.lua``); the last one ends the parent, whose own producer is then told
  (:meth:`broker.store.MessageStore.after_delivery`; see :mod:`broker.broadcast`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from . import timekeeping
from .cluster_map import ORDER_BARRIER
from .envelope import Envelope
from .keyspace import Keyspace, due_for, outbox_for
from .metric_fields import Counting
from .scripts import ScriptName, script_source
from .stages import TERMINAL, Stage
from .wire import OutboxEntry, ReplyEntry, outbox_fields, reply_fields

Command = tuple[Any, ...]

# After a child ends, the reaper looks at its parent within this: a parent whose last child's
# ender stopped between ending it and telling its producer is told by the reaper
# (``reply_pending``), not an hour later.
PARENT_LOOK_MS = 30_000
# The sha ``broker.scripts`` loads ``lua/child_done.lua`` under (computed alike here, so this
# module stays pure; tests/unit/test_broadcast.py checks they agree).
CHILD_DONE_SHA = hashlib.sha1(script_source(ScriptName.CHILD_DONE).encode()).hexdigest()
NOT_COUNTING = Counting(None, 0)


class ChildOutcome(msgspec.Struct, omit_defaults=True):
    """A child's entry in its broadcast parent's result, under its instance id. ``stage``
    comes first: ``lua/child_done.lua`` reads it from the start of the JSON."""

    stage: str
    id: str
    result: msgspec.Raw | None = None
    error: str | None = None


class ResultBody(msgspec.Struct, omit_defaults=True):
    """The JSON a webhook receives. ``attempt`` tells answers apart: a message an operator
    replays ends again under a later attempt (a new answer, with a new ``webhook-id``)."""

    id: str
    stage: str
    attempt: int
    result: msgspec.Raw | None = None
    error: str | None = None


def webhook_id(message_id: str, attempt: int) -> str:
    """The ``webhook-id`` of a message's answer: the same for every resend of one ending (a
    receiver de-duplicates on it), another for the answer after a replay."""
    return f"{message_id}.{attempt}"


_encoder = msgspec.json.Encoder()


def result_body(
    message_id: str, stage: Stage, result: bytes | None, error: str | None, *, attempt: int = 0
) -> bytes:
    return _encoder.encode(
        ResultBody(
            message_id,
            stage.value,
            attempt,
            msgspec.Raw(result) if result is not None else None,
            error if result is None else None,
        )
    )


def reply_entry(
    message_id: str, stage: Stage, result: bytes | None, error: str | None, *, attempt: int = 0
) -> ReplyEntry:
    """The outcome a producer's reply stream gets: the result, or else the error."""
    return ReplyEntry(
        id=message_id,
        stage=stage,
        attempt=attempt,
        result=result,
        error=error if result is None else None,
    )


def child_outcome(message_id: str, stage: Stage, result: bytes | None, error: str | None) -> bytes:
    raw = msgspec.Raw(result) if result is not None else None
    return _encoder.encode(
        ChildOutcome(stage.value, message_id, raw, error if result is None else None)
    )


def child_done_command(
    keys: Keyspace,
    parent_id: str,
    child_id: str,
    stage: Stage,
    result: bytes | None,
    error: str | None,
    now_ms: int,
    counting: Counting = NOT_COUNTING,
) -> Command:
    """Record a child's outcome on its parent (``lua/child_done.lua``, the parent's slot)."""
    keyed = (
        keys.record(parent_id),
        keys.outcomes(parent_id),
        *counting.keys(keys.record(parent_id)),
    )
    return (
        "EVALSHA",
        CHILD_DONE_SHA,
        len(keyed),
        *keyed,
        child_id,
        child_outcome(child_id, stage, result, error),
        now_ms,
        Stage.FANNED_OUT.value,
        Stage.SUCCEEDED.value,
        counting.max_series,
    )


def delivery_commands(
    keys: Keyspace,
    envelope: Envelope,
    stage: Stage,
    result: bytes | None,
    error: str | None,
    *,
    attempt: int,
    reply_ttl_s: int | None = None,
    now_ms: int | None = None,
    counting: Counting = NOT_COUNTING,
) -> list[Command]:
    """Every command that tells the producer of ``envelope`` how attempt ``attempt`` ended —
    for a broadcast child, its parent. With ``reply_ttl_s`` the reply stream expires that
    long after its latest answer, so the stream of a producer that went away does not stay
    for ever (a live ``Client`` keeps renewing it)."""
    message_id = envelope.message_id
    commands: list[Command] = []
    if envelope.parent is not None and stage in TERMINAL:
        now = now_ms if now_ms is not None else timekeeping.now_ms()
        # first the reaper's next look at the parent, then the outcome: whatever this one
        # ends, the reaper sees it soon, even if its ender stops before telling the producer
        commands.append(
            ("ZADD", due_for(keys, envelope.parent), "LT", now + PARENT_LOOK_MS, envelope.parent)
        )
        commands.append(ORDER_BARRIER)  # on a cluster: two slots, the look written first
        commands.append(
            child_done_command(
                keys, envelope.parent, message_id, stage, result, error, now, counting
            )
        )
    if envelope.reply_to:
        entry = reply_entry(message_id, stage, result, error, attempt=attempt)
        commands.append(("XADD", envelope.reply_to, "*", *reply_fields(entry)))
        if reply_ttl_s is not None:
            commands.append(("EXPIRE", envelope.reply_to, reply_ttl_s))
    if envelope.callback_url:
        delivery = OutboxEntry(
            message_id=message_id,
            webhook_id=webhook_id(message_id, attempt),
            url=envelope.callback_url,
            body=result_body(message_id, stage, result, error, attempt=attempt),
        )
        commands.append(("XADD", outbox_for(keys, message_id), "*", *outbox_fields(delivery)))
    return commands
