"""The records the broker writes for others to read, each with one writer and one reader. Pure.

Producers, webhooks, operators and their tools read these keys directly (``XREAD``,
``XRANGE``, ``LRANGE``), so the field names below never change; a new field comes with a
default, and an entry without it still reads (msgspec's schema evolution rule). Anyone who may
write a key may write anything to it, so every reader here returns the record or the reason
it holds none, and never raises, whatever the bytes.

- :class:`OutboxEntry` — a ``P:outbox`` entry, a webhook delivery: ``id``, ``webhook_id``,
  ``url``, ``body``, ``attempt``, and on a retry ``not_before_ms`` and ``last_error``;
  written by :func:`outbox_fields`, read by :func:`parse_outbox_entry`.
- :class:`ReplyEntry` — a ``P:reply:<name>`` entry, an outcome or a notice: ``id``,
  ``stage``, ``attempt``, ``notice`` (a notice only), then ``result`` (JSON) or ``error``;
  written by :func:`reply_fields`, read by :func:`parse_reply_entry`.
- a timeline item — a line of the record's ``timeline`` field (``P:m:{id}``; older records:
  a ``P:t:{id}`` list item), the JSON array ``[ts, stage, instance, attempt, reason]`` of
  strings; written by the Lua scripts (``lua/timeline.lua``; their shape in Python:
  :func:`timeline_item_json`), read by :func:`parse_timeline_item`.
- a record's ``route_from`` — the routing funnel, step by step: a JSON list whose items are
  a step that excluded nothing, written ``"name:kept"`` (most steps of most decisions: the
  short form keeps a finished record small), or an object ``{"step", "kept", "excluded",
  "more_excluded", …}``; written by :func:`route_from_json`, read by :func:`route_steps`
  (every item an object, whichever way it was written, and never an error).
- a dead letter — a ``P:dlq`` entry, capped (it holds what others sent):
  :mod:`broker.deadletters` (``Letter``, ``letter_fields``, ``parse_letter``).

The timeline item is :class:`~broker.records.TimelineEntry`, the type ``Client.trace``
returns: only its encoding lives here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from .records import TimelineEntry
from .stages import Stage

Fields = list[str | bytes | int]

MAX_NUMBER_DIGITS = 15  # an attempt or a time in ms; a longer number is none we wrote
# ids go into webhook headers as they are: visible ASCII only (no CR/LF, no space), bounded
HEADER_SAFE = re.compile(r"[!-~]{1,512}")
_STAGES = {stage.value: stage for stage in Stage}


class _Unreadable(ValueError):
    """Why a record cannot be read: the reason a parser returns (never raised out of here)."""


# -- outbox ----------------------------------------------------------------------------------


class OutboxEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One webhook delivery on ``P:outbox``: the ``attempt``-th POST of ``body`` (the JSON the
    webhook receives, :class:`broker.results.ResultBody`) to ``url``, not before
    ``not_before_ms`` (0: at once), signed as ``webhook_id``; ``last_error`` says how the
    attempt before it failed."""

    message_id: str
    webhook_id: str
    url: str
    body: bytes
    attempt: int = 1
    not_before_ms: int = 0
    last_error: str = ""


def outbox_fields(entry: OutboxEntry) -> Fields:
    """The stream entry's field/value pairs; ``not_before_ms`` and ``last_error`` only when
    set (a first attempt is written without them)."""
    fields: Fields = [
        "id",
        entry.message_id,
        "webhook_id",
        entry.webhook_id,
        "url",
        entry.url,
        "body",
        entry.body,
        "attempt",
        entry.attempt,
    ]
    if entry.not_before_ms:
        fields += ["not_before_ms", entry.not_before_ms]
    if entry.last_error:
        fields += ["last_error", entry.last_error]
    return fields


def parse_outbox_entry(fields: Mapping[str, bytes]) -> OutboxEntry | str:
    """The delivery an outbox entry describes, or why it describes none. ``fields`` as
    :func:`broker.streams.fields_of` gives them (a name that is not UTF-8 kept as
    surrogates). An entry without ``webhook_id`` (written by an older broker) is signed as its
    message id; without ``attempt``, it is the first."""
    try:
        return _outbox_entry(fields)
    except _Unreadable as exc:
        return str(exc)


def _outbox_entry(fields: Mapping[str, bytes]) -> OutboxEntry:
    for name in fields:
        if not _is_utf8(name):
            raise _Unreadable(
                f"field name {_shown(name.encode('utf-8', 'surrogateescape'))} is not UTF-8"
            )
    message_id = _header_value(fields, "id")
    return OutboxEntry(
        message_id=message_id,
        webhook_id=_header_value(fields, "webhook_id") if "webhook_id" in fields else message_id,
        url=_text(fields, "url"),
        body=_utf8(fields, "body"),
        attempt=_count(fields, "attempt", default=1, least=1),
        not_before_ms=_count(fields, "not_before_ms", default=0, least=0),
        last_error=fields.get("last_error", b"").decode(errors="replace"),
    )


# -- reply streams ---------------------------------------------------------------------------


class ReplyEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One entry on a producer's reply stream: how attempt ``attempt`` of message ``id``
    ended (an outcome: ``result``, the agent's JSON, or else ``error``), or — with ``notice``
    — news that is no ending: ``deadline_passed`` (the agent may still be working on it),
    ``replayed`` (an operator replayed it: a new answer follows); ``error`` then says it in a
    sentence."""

    id: str
    stage: Stage
    attempt: int = 0
    result: bytes | None = None
    error: str | None = None
    notice: str | None = None
    # with a notice about a refused request (``id_conflict``): which request it was
    # (:func:`broker.envelope.request_digest`), so only its own producer takes it as its answer
    request: str | None = None

    @property
    def is_outcome(self) -> bool:
        """Whether this entry is an answer (not a notice)."""
        return self.notice is None


def reply_fields(entry: ReplyEntry) -> Fields:
    """The stream entry's field/value pairs: ``result`` when there is one, else ``error``
    (empty when none was given)."""
    fields: Fields = ["id", entry.id, "stage", entry.stage.value, "attempt", str(entry.attempt)]
    if entry.notice is not None:
        fields += ["notice", entry.notice]
    if entry.request is not None:
        fields += ["request", entry.request]
    if entry.result is not None:
        fields += ["result", entry.result]
    else:
        fields += ["error", entry.error or ""]
    return fields


def parse_reply_entry(fields: Mapping[str, bytes]) -> ReplyEntry | str:
    """What a reply-stream entry says, or why it says nothing readable: ``id`` (UTF-8) and
    ``stage`` (a stage's name) are needed, ``attempt`` is a number when present, ``result``
    JSON when present and not empty; ``error`` and ``notice`` are text (bytes that are not
    UTF-8 shown as U+FFFD). Other fields are left alone (a later version may add some)."""
    try:
        return _reply_entry(fields)
    except _Unreadable as exc:
        return str(exc)


def _reply_entry(fields: Mapping[str, bytes]) -> ReplyEntry:
    stage = _text(fields, "stage")
    if stage not in _STAGES:
        raise _Unreadable(f"field 'stage' is no stage: {_shown(fields['stage'])}")
    result = fields.get("result") or None
    if result is not None:
        _check_json(result)
    error, notice, request = fields.get("error"), fields.get("notice"), fields.get("request")
    return ReplyEntry(
        id=_text(fields, "id"),
        stage=_STAGES[stage],
        attempt=_count(fields, "attempt", default=0, least=0),
        result=result,
        error=error.decode(errors="replace") if error is not None else None,
        notice=notice.decode(errors="replace") if notice is not None else None,
        request=request.decode(errors="replace") if request is not None else None,
    )


def _check_json(raw: bytes) -> None:
    """Whether ``raw`` decodes, as its reader will decode it: well-formed JSON can still hold
    what no reader builds (an integer of 5,000 digits), and one such reply, read in the
    client's reply reader, took every request waiting on that client down with it."""
    try:
        msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _Unreadable(f"field 'result' is not JSON: {exc}") from None


# -- timelines -------------------------------------------------------------------------------

_timeline_item = msgspec.json.Decoder(tuple[str, str, str, str, str])


def timeline_item_json(entry: TimelineEntry) -> bytes:
    """One timeline item as the Lua scripts write it: ``[ts, stage, instance, attempt,
    reason]``, every element a string."""
    stage = entry.stage.value if isinstance(entry.stage, Stage) else entry.stage
    return msgspec.json.encode(
        [str(entry.ts_ms), stage, entry.instance, str(entry.attempt), entry.reason]
    )


def parse_timeline_item(raw: bytes) -> TimelineEntry | str:
    """One timeline item, or why it is none. ``stage`` is a :class:`Stage` when it names
    one, else the name of an event that changed no stage (``CALLBACK_DELIVERED``)."""
    try:
        ts, stage, instance, attempt, reason = _timeline_item.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return f"not a timeline item (a JSON array of 5 strings): {_shown(raw)}"
    for name, value in (("ts", ts), ("attempt", attempt)):
        if not (value.isascii() and _is_number(value.encode())):
            return f"timeline item's {name} is not a whole number: {_shown(value)}"
    return TimelineEntry(
        ts_ms=int(ts),
        stage=_STAGES.get(stage, stage),
        instance=instance,
        attempt=int(attempt),
        reason=reason,
    )


# -- fields ----------------------------------------------------------------------------------


def _is_utf8(name: str) -> bool:
    """Whether a field name came as UTF-8 (:func:`broker.streams.field_name` keeps other
    bytes as surrogates, which do not encode)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _text(fields: Mapping[str, bytes], name: str) -> str:
    """A field that must be present and UTF-8."""
    if name not in fields:
        raise _Unreadable(f"field {name!r} is missing")
    try:
        return fields[name].decode()
    except UnicodeDecodeError:
        raise _Unreadable(f"field {name!r} is not UTF-8: {_shown(fields[name])}") from None


def _utf8(fields: Mapping[str, bytes], name: str) -> bytes:
    """A field that must be present and UTF-8, as its bytes (a webhook receiver's
    verification decodes the body)."""
    _text(fields, name)
    return fields[name]


def _header_value(fields: Mapping[str, bytes], name: str) -> str:
    text = _text(fields, name)
    if not HEADER_SAFE.fullmatch(text):
        raise _Unreadable(
            f"field {name!r} must be 1 to 512 visible ASCII characters: {_shown(fields[name])}"
        )
    return text


def _count(fields: Mapping[str, bytes], name: str, *, default: int, least: int) -> int:
    raw = fields.get(name) or str(default).encode()
    if not (_is_number(raw) and int(raw) >= least):
        raise _Unreadable(f"field {name!r} must be a whole number from {least}: {_shown(raw)}")
    return int(raw)


def _is_number(raw: bytes) -> bool:
    """ASCII digits only (``bytes.isdigit``: no sign, space, ``_`` or other scripts' digits),
    few enough to be a number we wrote."""
    return raw.isdigit() and len(raw) <= MAX_NUMBER_DIGITS


def _shown(raw: bytes | str) -> str:
    """``raw`` for a reason: its first 40 bytes (or characters), quoted."""
    return ascii(raw[:40]) + ("…" if len(raw) > 40 else "")


# -- route_from ------------------------------------------------------------------------------

_route_json = msgspec.json.Encoder()


def route_from_json(steps: list[dict[str, Any]]) -> bytes:
    """``route_from`` as written: a step that is only its name and count becomes
    ``"name:kept"``."""
    return _route_json.encode(
        [
            f"{step['step']}:{step['kept']}" if step.keys() == {"step", "kept"} else step
            for step in steps
        ]
    )


def route_steps(raw: bytes | None) -> list[dict[str, Any]]:
    """The funnel steps of a ``route_from``, each an object (``"name:kept"`` read back as
    ``{"step": name, "kept": kept}``); what does not read as steps is left out."""
    try:
        items = msgspec.json.decode(raw) if raw else []
    except (msgspec.DecodeError, RecursionError):
        return []
    steps: list[dict[str, Any]] = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, str):
            name, _, kept = item.rpartition(":")
            if name and _is_number(kept.encode()):
                steps.append({"step": name, "kept": int(kept)})
        elif isinstance(item, dict) and _is_step(item):
            steps.append(item)
    return steps


def _is_step(item: dict[str, Any]) -> bool:
    """An object step every reader can print: a name, a count, exclusions by instance."""
    kept, excluded = item.get("kept"), item.get("excluded", {})
    return (
        isinstance(item.get("step"), str)
        and isinstance(kept, int)
        and not isinstance(kept, bool)
        and isinstance(excluded, dict)
        and all(isinstance(v, str) for v in excluded.values())
        and isinstance(item.get("more_excluded", 0), int)
    )
