"""What the broker's own streams hold, read back without trusting a byte. Pure.

Anyone who can ``XADD`` to a key can write any field names and values to it, so every reader
parses through here and gets either the entry it expects or a precise reason; a reason means
the entry is acknowledged and dead-lettered, never that the reader stops.

- The ingress stream (``P:in``) holds envelopes: exactly one field, ``envelope``, whose value
  :func:`broker.envelope.decode_envelope` then judges. Whatever else an entry holds — no
  fields that count, the field twice, other fields, names that are not UTF-8 — makes it a
  :class:`MalformedEntry`, REJECTED with that reason and its bytes dead-lettered.
- An instance stream (``P:q:{<inst>}``) holds assignments: fields ``id`` (a message id) and
  ``attempt`` (a positive integer), written by ``lua/assign.lua``.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .envelope import MESSAGE_ID_PATTERN

MAX_ATTEMPT = 1_000_000
ENVELOPE_FIELD = b"envelope"
_MESSAGE_ID = re.compile(MESSAGE_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class IngressEntry:
    """An ingress entry of the expected shape: its envelope's bytes, not yet judged."""

    entry_id: str
    envelope: bytes


@dataclass(frozen=True, slots=True)
class MalformedEntry:
    """An ingress entry that holds no single envelope: why, and its bytes (the envelope's
    when it had one usable field, else every field, losslessly: :func:`fields_as_bytes`)."""

    entry_id: str
    reason: str
    raw: bytes
    # the one `envelope` field among others, if any: its id and reply_to can still be read,
    # so its producer is told why
    envelope: bytes | None = None


def parse_ingress(entry_id: str, flat: Sequence[bytes]) -> IngressEntry | MalformedEntry:
    """What an ingress entry holds, whatever its bytes; never raises."""
    pairs = list(zip(flat[::2], flat[1::2], strict=False))
    envelopes = [value for name, value in pairs if name == ENVELOPE_FIELD]
    others = [name for name, _ in pairs if name != ENVELOPE_FIELD]
    if len(envelopes) == 1 and not others and len(flat) % 2 == 0:
        return IngressEntry(entry_id, envelopes[0])
    if not envelopes:
        listed = ", ".join(_shown(name) for name in others[:10]) or "none"
        reason = f"stream entry has no `envelope` field (its fields: {listed})"
    elif len(envelopes) > 1:
        reason = f"stream entry has the `envelope` field {len(envelopes)} times"
    elif others:
        listed = ", ".join(_shown(name) for name in others[:10])
        reason = f"stream entry has fields besides `envelope`: {listed}"
    else:
        reason = "stream entry has a field without a value"
    alone = envelopes[0] if len(envelopes) == 1 else None
    return MalformedEntry(entry_id, reason, fields_as_bytes(pairs), alone)


def _shown(name: bytes) -> str:
    """A field name for a reason: quoted, its bytes that are not printable ASCII escaped
    once (as ``\\xff``), cut short."""
    return repr(name[:40])[1:]


@dataclass(frozen=True, slots=True)
class Assignment:
    """One entry of an instance's stream: attempt ``attempt`` of message ``message_id``."""

    entry_id: str
    message_id: str
    attempt: int


def parse_assignment(entry_id: str, fields: Mapping[str, bytes]) -> Assignment | str:
    """The assignment an instance-stream entry holds, or why it holds none."""
    unexpected = sorted(set(fields) - {"id", "attempt"})
    if unexpected:
        return f"unexpected fields {', '.join(map(ascii, unexpected))[:200]}"
    raw_id, raw_attempt = fields.get("id"), fields.get("attempt")
    if raw_id is None or raw_attempt is None:
        return "an assignment needs the fields `id` and `attempt`"
    message_id = raw_id.decode(errors="replace")
    if not _MESSAGE_ID.match(message_id):
        return f"`id` {message_id[:80]!r} is not a message id"
    # int() refuses more than 4,300 digits with a ValueError: the zeros in front go first
    digits = raw_attempt.lstrip(b"0")
    too_long = len(digits) > len(str(MAX_ATTEMPT))
    if not raw_attempt.isdigit() or too_long or not 1 <= int(digits or b"0") <= MAX_ATTEMPT:
        return f"`attempt` {raw_attempt[:20]!r} is not an attempt number"
    return Assignment(entry_id, message_id, int(digits))


def fields_as_bytes(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A stream entry's fields, losslessly, for a dead letter: a JSON list of
    ``[name, value]`` pairs, each a string when it is UTF-8, else ``{"base64": ...}``."""
    return msgspec.json.encode([[_lossless(name), _lossless(value)] for name, value in pairs])


def _lossless(raw: bytes) -> Any:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode()}
