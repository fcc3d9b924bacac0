"""Timeline events: steps in a message's life that change no stage.

A stage change and its timeline entry are written together by ``lua/transition.lua``. Some
facts come after the message has ended and move nothing on the record — its result reached
the producer's webhook — yet belong on the same timeline, in the same shape
(``[ts, event, instance, attempt, reason]``; :class:`~broker.records.TimelineEntry` then holds
the event's name where a stage would be). ``lua/note.lua`` appends one only while the
timeline exists, so an event arriving after the record expired does not re-create a
timeline that would never expire.
"""

from __future__ import annotations

from typing import Any

from .connection import Connection
from .scripts import ScriptName

CALLBACK_DELIVERED = "CALLBACK_DELIVERED"
"""The message's result was accepted (2xx) by its ``callback_url``."""


def note_command(
    conn: Connection, message_id: str, event: str, reason: str, *, now_ms: int
) -> tuple[Any, ...]:
    """The command that appends ``event`` to the message's timeline (for a pipeline); its
    reply is 1 when appended, 0 when the message has no timeline."""
    keys = conn.keys
    return conn.script_command(
        ScriptName.NOTE,
        (keys.record(message_id),),
        (now_ms, event, reason, conn.settings.timeline_max),
    )


async def note_event(
    conn: Connection, message_id: str, event: str, reason: str, *, now_ms: int
) -> bool:
    """Append ``event`` to the message's timeline; ``False`` when it has none (expired or
    unknown id), in which case nothing is written."""
    return bool(await conn.call(*note_command(conn, message_id, event, reason, now_ms=now_ms)))
