"""Reading back what the Lua scripts write: the record hash and its timeline. Pure.

Every reader of a record goes through :func:`record_from_hash`; a hash that does not read as
a record (written by hand, say) is logged and left alone by :func:`readable_record`, never
raised into a worker's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .keyspace import Keyspace
from .records import Accepted, AssignResult, MessageRecord, Moved, TimelineEntry
from .stages import Stage
from .wire import parse_timeline_item

log = logging.getLogger("agent_reach.store")

UNREADABLE = "UNREADABLE"
STAGE_OF: dict[bytes, Stage] = {stage.value.encode(): stage for stage in Stage}


def pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """A flat RESP ``[k1, v1, k2, v2, ...]`` reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_count(value: Any) -> bool:
    """Whether a reply's ``value`` is a count as the scripts write one (digits, not many)."""
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, bytes) and value.isascii() and value.isdigit() and len(value) < 19


def _int(value: Any) -> int:
    return int(value) if value not in (None, b"") else 0


def accepted(reply: list[Any]) -> Accepted:
    """The reply of ``lua/accept.lua`` (or ``lua/accept_assign.lua``: with the assignment's
    answer when it created the record)."""
    assigned = AssignResult(reply[3]) if len(reply) > 3 and reply[0] else None
    return Accepted(bool(reply[0]), STAGE_OF[reply[1]], int(reply[2]), assigned)


def moved(reply: list[Any]) -> Moved:
    """The reply of ``lua/transition.lua`` (or ``lua/claim_assign.lua``: with the
    assignment's answer when the claim was made)."""
    if reply[0] == -1:
        return Moved(False, None, 0, "")
    stage = STAGE_OF.get(reply[1])
    if stage is None or not _is_count(reply[2]):
        # a record no version wrote (by hand, or a role that may write records): not moved,
        # and read as no record — whoever asked lets its delivery go, never crashes on it
        log.warning("a move met a record that does not read: stage %r, attempt %r", *reply[1:3])
        return Moved(False, None, 0, "")
    value = reply[4] if reply[0] == 1 and len(reply) > 4 and reply[4] else None
    accepted_ms = int(reply[5]) if len(reply) > 5 and _is_count(reply[5]) else 0
    assigned = AssignResult(reply[6]) if len(reply) > 6 else None  # lua/claim_assign.lua
    return Moved(
        reply[0] == 1,
        stage,
        int(reply[2]),
        reply[3].decode(errors="replace"),
        value,
        accepted_ms,
        assigned,
    )


def readable_record(message_id: str, raw: Mapping[bytes, bytes]) -> MessageRecord | None:
    """:func:`record_from_hash`, or ``None`` (logged) where the hash does not read as one."""
    try:
        return record_from_hash(message_id, raw)
    except (ValueError, UnicodeDecodeError) as exc:
        log.error("record of %r does not read as one, left alone: %s", message_id, exc)
        return None


def record_from_hash(message_id: str, raw: Mapping[bytes, bytes]) -> MessageRecord:
    """A record hash read back. A field holding its default is not written
    (``lua/accept_record.lua``): an absent ``attempt`` or ``priority`` is 0, ``instance`` and
    ``error`` are empty, and ``updated_ms`` is ``accepted_ms`` until the record first moves."""

    def get(name: str) -> bytes:
        return raw.get(name.encode(), b"")

    result = raw.get(b"result")
    accepted_ms = _int(get("accepted_ms"))
    attempt = _int(get("attempt"))
    return MessageRecord(
        id=message_id,
        stage=Stage(text(get("stage"))),
        attempt=attempt,
        instance=text(get("instance")),
        capability=text(get("capability")),
        envelope=get("envelope"),
        accepted_ms=accepted_ms,
        deadline_ms=_int(get("deadline_ms")),
        updated_ms=_int(get("updated_ms")) or accepted_ms,
        kept_reply_to=text(get("reply_to")),  # MessageRecord.reply_to reads the rest
        priority=_int(get("priority")),
        result=result,
        error=text(get("error")),
        route_reason=text(raw[b"route_reason"]) if b"route_reason" in raw else None,
        route_from=raw.get(b"route_from"),
        avoid=text(get("avoid")),
        retry_at_ms=_int(get("retry_at_ms")),
        extensions=_int(get("extensions")),
        reply_pending=bool(get("reply_pending")),
        awaiting_callback=bool(get("awaiting_callback")),
        agent_task=text(get("agent_task")),
        usage=raw.get(f"usage:{attempt}".encode()),
        take_call=text(get("take_call")),
        taken_over=text(get("taken_over")),
    )


def timeline_commands(keys: Keyspace, message_id: str) -> list[tuple[Any, ...]]:
    """What :func:`timeline_entries` reads, for one pipeline: the record's ``timeline`` field
    and the list an older record kept its entries in."""
    return [
        ("HGET", keys.record(message_id), "timeline"),
        ("LRANGE", keys.timeline(message_id), 0, -1),
    ]


def timeline_entries(field: bytes | None, legacy: Sequence[bytes] = ()) -> list[TimelineEntry]:
    """A message's timeline, oldest first: the entries of an older record's list, then the
    lines of its ``timeline`` field (``lua/timeline.lua``)."""
    lines = field.split(b"\n") if field else []
    return [timeline_entry(raw) for raw in [*legacy, *lines]]


def timeline_entry(raw: bytes) -> TimelineEntry:
    """One timeline item (:func:`broker.wire.parse_timeline_item`); one that is unreadable
    shows as an ``UNREADABLE`` event saying why, so the rest of the timeline still reads."""
    entry = parse_timeline_item(raw)
    if isinstance(entry, str):
        return TimelineEntry(ts_ms=0, stage=UNREADABLE, instance="", attempt=0, reason=entry)
    return entry
