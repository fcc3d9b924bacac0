"""What telling a producer its result takes, as Redis commands: one place for every ending.

Whoever ends a message (a sidecar, the reaper, an operator, the dispatcher) sends the same
commands, after the terminal stage is on the record and before it lets go of the work (its
stream entry, its ``reply_pending`` mark): a crash in between sends them again, so delivery
is at least once and every copy carries the message id.

- ``reply_to``: an entry on the producer's reply stream (fields ``id``, ``stage``, and
  ``result`` or ``error``).
- ``callback_url``: an entry on ``P:outbox`` for the notifier, which POSTs the signed body to
  the webhook, with retries.
- a broadcast child: its outcome is recorded on its parent (see :mod:`broker.broadcast`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .envelope import Envelope
from .keyspace import Keyspace
from .stages import Stage

Command = tuple[Any, ...]


class ResultBody(msgspec.Struct, omit_defaults=True):
    """The JSON a webhook receives."""

    id: str
    stage: str
    result: msgspec.Raw | None = None
    error: str | None = None


_encoder = msgspec.json.Encoder()


def result_body(message_id: str, stage: Stage, result: bytes | None, error: str | None) -> bytes:
    return _encoder.encode(
        ResultBody(
            message_id,
            stage.value,
            msgspec.Raw(result) if result is not None else None,
            error if result is None else None,
        )
    )


def reply_fields(
    message_id: str, stage: Stage, result: bytes | None, error: str | None
) -> list[str | bytes]:
    fields: list[str | bytes] = ["id", message_id, "stage", stage.value]
    if result is not None:
        fields += ["result", result]
    else:
        fields += ["error", error or ""]
    return fields


def delivery_commands(
    keys: Keyspace,
    envelope: Envelope,
    stage: Stage,
    result: bytes | None,
    error: str | None,
) -> list[Command]:
    """Every command that tells the producer of ``envelope`` how it ended."""
    message_id = envelope.message_id
    commands: list[Command] = []
    if envelope.reply_to:
        fields = reply_fields(message_id, stage, result, error)
        commands.append(("XADD", envelope.reply_to, "*", *fields))
    if envelope.callback_url:
        body = result_body(message_id, stage, result, error)
        commands.append(
            (
                "XADD",
                keys.outbox,
                "*",
                "id",
                message_id,
                "url",
                envelope.callback_url,
                "body",
                body,
                "attempt",
                1,
            )
        )
    return commands
