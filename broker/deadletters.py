"""Dead letters: the one shape of an entry on ``P:dlq``, written and read only here. Pure.

Whatever ends up there — a rejected envelope, a DEAD message with its chain of reasons, a
reply or webhook that could not be delivered, a malformed stream entry — is a
:class:`Letter`. Every letter is capped, so an attacker who can ``XADD`` cannot make the dead
letter stream the largest thing in Redis:

- each byte value (``raw``, ``body``, ``chain``) and text (``reason``, ``error``) keeps at
  most ``dlq_entry_max_bytes``; a cut value says so (``raw_size``, ``body_size``: the size it
  had), so a 10 MB rejected envelope stores its first 64 KiB and the number 10,485,760;
- the stream keeps about ``dlq_max_entries`` (``XADD MAXLEN ~``): no consumer group reads
  it, so trimming its oldest entries drops no work.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from .keyspace import Keyspace

Command = tuple[Any, ...]

_CUT = "…"
_MAX_DIGITS = 19  # a count or a time in ms; a longer number is none we wrote


class Letter(msgspec.Struct, frozen=True, kw_only=True):
    """One dead letter. ``raw`` is the original bytes (an envelope, a stream entry), ``chain``
    a DEAD message's timeline reasons (JSON ``[[stage, instance, attempt, reason], ...]``);
    ``url``, ``attempts``, ``error`` and ``body`` describe a webhook that was never
    delivered; ``source`` names the stream entry a malformed entry came from."""

    id: str
    reason: str
    ts_ms: int
    stage: str = ""
    raw: bytes | None = None
    raw_size: int | None = None
    chain: bytes | None = None
    url: str | None = None
    attempts: int | None = None
    error: str | None = None
    body: bytes | None = None
    body_size: int | None = None
    source: str | None = None


_KIND = re.compile(r"^([a-z][a-z_]{0,39})(?::|$)")


def letter_kind(letter: Letter) -> str:
    """A bounded label for why ``letter`` was written (the ``reason`` label of
    ``agent_reach_dead_letters_total``): its reason is free text."""
    if letter.stage == "REJECTED":
        return "rejected"
    if letter.stage == "DEAD":
        return "dead"
    found = _KIND.match(letter.reason)  # ours: "callback_undeliverable", "sidecar_error: ..."
    if found:
        return found.group(1)
    return "malformed_entry" if letter.source else "other"


def cap_bytes(value: bytes, max_bytes: int) -> tuple[bytes, int | None]:
    """``value`` cut to ``max_bytes``, and its full size when it was cut (else ``None``)."""
    if len(value) <= max_bytes:
        return value, None
    return value[:max_bytes], len(value)


def cap_text(value: str, max_bytes: int) -> str:
    """``value`` cut to at most ``max_bytes`` of UTF-8, marked with an ellipsis when cut."""
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) <= max_bytes:
        return value
    keep = encoded[: max(0, max_bytes - len(_CUT.encode()))]
    return keep.decode("utf-8", "ignore") + _CUT


def letter_fields(letter: Letter, max_bytes: int) -> list[str | bytes | int]:
    """The stream entry's field/value pairs, every value capped."""
    fields: list[str | bytes | int] = [
        "id",
        cap_text(letter.id, max_bytes),
        "stage",
        letter.stage,
        "reason",
        cap_text(letter.reason, max_bytes),
        "ts",
        letter.ts_ms,
    ]
    for name, value, size in (
        ("raw", letter.raw, letter.raw_size),
        ("body", letter.body, letter.body_size),
    ):
        if value is not None:
            kept, cut = cap_bytes(value, max_bytes)
            fields += [name, kept]
            if cut is not None or size is not None:
                fields += [f"{name}_size", size if size is not None else cut or 0]
    if letter.chain is not None:
        fields += ["chain", cap_bytes(letter.chain, max_bytes)[0]]
    for name, text in (("url", letter.url), ("error", letter.error), ("source", letter.source)):
        if text is not None:
            fields += [name, cap_text(text, max_bytes)]
    if letter.attempts is not None:
        fields += ["attempts", letter.attempts]
    return fields


def dead_letter_command(
    keys: Keyspace, letter: Letter, *, max_entries: int, max_bytes: int
) -> Command:
    """``XADD`` of one capped letter to ``P:dlq``, trimming the stream to about
    ``max_entries``."""
    return ("XADD", keys.dlq, "MAXLEN", "~", max_entries, "*", *letter_fields(letter, max_bytes))


def parse_letter(entry_id: bytes, flat: list[bytes]) -> Letter:
    """A dead-letter stream entry as a :class:`Letter`; never raises, whatever its bytes
    (an entry written by hand or by an older version reads as far as it can)."""
    fields = dict(zip(flat[::2], flat[1::2], strict=False))

    def text(name: bytes) -> str | None:
        value = fields.get(name)
        return value.decode(errors="replace") if value is not None else None

    def number(name: bytes) -> int | None:
        return _number(fields.get(name, b""))

    stamp = number(b"ts")
    if stamp is None:
        stamp = _number(entry_id.split(b"-", 1)[0]) or 0
    return Letter(
        id=text(b"id") or "",
        reason=text(b"reason") or "",
        ts_ms=stamp,
        stage=text(b"stage") or "",
        raw=fields.get(b"raw"),
        raw_size=number(b"raw_size"),
        chain=fields.get(b"chain"),
        url=text(b"url"),
        attempts=number(b"attempts"),
        error=text(b"error"),
        body=fields.get(b"body"),
        body_size=number(b"body_size"),
        source=text(b"source"),
    )


def _number(raw: bytes) -> int | None:
    """ASCII digits as a number (``int`` refuses more than 4,300 of them: never asked)."""
    return int(raw) if raw.isdigit() and len(raw) <= _MAX_DIGITS else None


class DeadLetter(msgspec.Struct, frozen=True):
    """One entry of the dead-letter stream. ``raw`` is the original bytes as text when they
    are UTF-8; otherwise they are in ``raw_base64``."""

    entry_id: str
    id: str
    stage: str
    reason: str
    ts_ms: int
    raw: str | None = None
    raw_base64: bytes | None = None
    # a webhook that could not be delivered: where to, how often tried, the last error
    url: str | None = None
    attempts: int | None = None
    error: str | None = None
    # `raw` was cut to `dlq_entry_max_bytes`: the size it had
    raw_size: int | None = None
    # a malformed stream entry: "<stream> <entry id>"
    source: str | None = None


class DeadLetters(msgspec.Struct, frozen=True):
    total: int  # entries in the stream
    letters: list[DeadLetter]  # the newest ones asked for, oldest first


def letter_view(entry_id: bytes, flat: list[bytes]) -> DeadLetter:
    """A dead-letter stream entry as an operator reads it: raw bytes as text where they are
    UTF-8."""
    letter = parse_letter(entry_id, flat)
    raw = letter.raw
    text = _utf8(raw, cut=letter.raw_size is not None) if raw is not None else None
    return DeadLetter(
        entry_id=entry_id.decode(),
        id=letter.id,
        stage=letter.stage,
        reason=letter.reason,
        ts_ms=letter.ts_ms,
        raw=text,
        raw_base64=raw if raw is not None and text is None else None,
        raw_size=letter.raw_size,
        url=letter.url,
        attempts=letter.attempts,
        error=letter.error,
        source=letter.source,
    )


def _utf8(raw: bytes, *, cut: bool) -> str | None:
    """``raw`` as text when it is UTF-8 — a cut one may end inside a character."""
    for end in range(len(raw), max(0, len(raw) - 3) - 1, -1) if cut else (len(raw),):
        try:
            return raw[:end].decode()
        except UnicodeDecodeError:
            continue
    return None
