"""Fleet events in Redis: appending them to ``P:events`` beside the change they report, and
reading them back (``agent-reach events``).

Where a change is a script on another slot (a card, a record), the event is appended from
Python right after the script's reply says the change happened, in the same process: one
more command in the same pipeline where there is one, so it works on a single server and on
a cluster alike (``P:events`` is one key, in one slot). An event that cannot be appended is
logged with what it said, never dropped without a word.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .connection import Connection
from .errors import RedisReplyError, RedisUnavailable
from .events import Event, append_event, event_fields, parse_event
from .streams import parse_entries
from .timekeeping import now_ms

log = logging.getLogger("agent_reach.events")

Command = tuple[Any, ...]
PAGE = 500


def events_key(conn: Connection) -> str:
    return conn.fleet.events


def event_command(conn: Connection, kind: str, subject: str, **detail: object) -> Command:
    """The capped ``XADD`` of one event (:func:`broker.events.append_event`)."""
    fields = event_fields(kind, subject, now_ms(), **detail)
    return append_event(events_key(conn), conn.settings.events_max, fields)


async def emit(conn: Connection, commands: Sequence[Command]) -> None:
    """Append events (from :func:`event_command`) in one round trip. A failure is logged
    with each event it lost, and not raised: the change it reports has happened, and the
    caller (a heartbeat, a janitor pass) must carry on."""
    if not commands:
        return
    try:
        replies: list[Any] = await conn.call_many(list(commands))
    except (RedisUnavailable, RedisReplyError) as exc:  # said below, with the events
        replies = [exc] * len(commands)
    _say_lost(commands, replies)


def _say_lost(events: Sequence[Command], replies: Sequence[Any]) -> None:
    """Log each event whose reply is an error, with what it said."""
    for command, reply in zip(events, replies, strict=True):
        if isinstance(reply, Exception):
            log.error("event not recorded (%s): %s", reply, " ".join(map(str, command[6:])))


async def run_with_events(
    conn: Connection, commands: Sequence[Command], events: Sequence[Command]
) -> list[Any]:
    """``commands`` and the events that report them, in one round trip: the first error
    reply among ``commands`` is raised, an event refused is logged as :func:`emit` does (an
    events stream whose ids someone ran to the last must not stop a sidecar registering)."""
    replies: list[Any] = await conn.call_many([*commands, *events])
    done, told = replies[: len(commands)], replies[len(commands) :]
    for reply in done:
        if isinstance(reply, Exception):
            raise reply
    _say_lost(events, told)
    return done


async def recent_events(
    conn: Connection, count: int, types: Sequence[str] = ()
) -> tuple[list[Event], str]:
    """The last ``count`` events (of ``types``, when given), oldest first, and the newest
    entry id seen (where following starts). Entries that do not read as events are left
    out (logged)."""
    if count == 0:  # none to show: only where following starts (never from the beginning)
        last = parse_entries(await conn.call("XREVRANGE", events_key(conn), "+", "-", "COUNT", 1))
        return [], last[0][0] if last else "0-0"
    found: list[Event] = []
    newest, end = "0-0", "+"
    while len(found) < count:
        raw = await conn.call("XREVRANGE", events_key(conn), end, "-", "COUNT", PAGE)
        entries = parse_entries(raw)
        if not entries:
            break
        if newest == "0-0":
            newest = entries[0][0]
        found += [e for e in readable(entries) if not types or e.type in types]
        end = f"({entries[-1][0]}"
        if len(entries) < PAGE:
            break
    return list(reversed(found[:count])), newest


def readable(entries: Sequence[tuple[str, dict[str, bytes]]]) -> list[Event]:
    events = []
    for entry_id, fields in entries:
        event = parse_event(entry_id, fields)
        if isinstance(event, str):
            log.warning("skipped: %s", event)
        else:
            events.append(event)
    return events
