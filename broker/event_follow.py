"""Following ``P:events`` (``agent-reach events --follow``), through Redis going away.

While Redis is up, following is reading after the last entry read. After an outage the
stream may not be the one that was read: a Redis that came back without its data starts a
new one (whose ids, by a clock behind, may fall below the last read), a failover may have
lost the latest entries, a trim may have passed the last read. Ids alone cannot tell an
entry read before from a new one, so the follower keeps the ids it read lately and, on
resuming, looks for the newest of them the stream still holds (:func:`resume_point`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence

from .connection import Connection
from .event_log import PAGE, events_key, readable
from .events import Event
from .streams import GroupReader, id_order, parse_entries

READ_KEPT = 2_000  # ids of the entries read lately, to find where a changed stream resumes


class EventFollower:
    """Events after ``last``, of ``types`` (all, when none), read a page at a time."""

    def __init__(
        self, conn: Connection, reader: GroupReader, last: str, types: Sequence[str] = ()
    ) -> None:
        self.conn = conn
        self.reader = reader
        self.stream = events_key(conn)
        self.last = last
        self.types = types
        self._read: deque[str] = deque([last], maxlen=READ_KEPT)

    async def next(self, block_ms: int = 1000) -> list[Event]:
        """The events appended after the last read (waiting up to ``block_ms``)."""
        entries = await self.reader.read_stream(
            self.stream, self.last, count=PAGE, block_ms=block_ms
        )
        if entries:
            self.last = entries[-1][0]
            self._read.extend(entry_id for entry_id, _ in entries)
        return [e for e in readable(entries) if not self.types or e.type in self.types]

    async def resume(self) -> str | None:
        """After Redis was away: go on from where the stream allows; what was lost, if any."""
        tail, oldest = await self.conn.call_many(
            [
                ("XREVRANGE", self.stream, "+", "-", "COUNT", PAGE),
                ("XRANGE", self.stream, "-", "+", "COUNT", 1),
            ]
        )
        first = parse_entries(oldest)
        self.last, lost = resume_point(
            self.last,
            set(self._read),
            [entry_id for entry_id, _ in parse_entries(tail)],
            first[0][0] if first else None,
        )
        return lost


def resume_point(
    last: str, read: Container[str], tail: Sequence[str], oldest: str | None
) -> tuple[str, str | None]:
    """Where following goes on, and what to say of events lost to it: ``last`` is the last
    id read, ``read`` the ids read lately, ``tail`` the stream's newest ids (newest first,
    at most :data:`PAGE`), ``oldest`` its oldest.

    - the newest entry the stream holds that was read is ``last``: on after it, as if
      nothing happened;
    - it is an older one (a failover lost what came after it): on after that one, said;
    - none was read and the stream starts past ``last``: trimmed past it, or lost with
      Redis's data — on, said;
    - none was read and the stream is all in ``tail``: a new stream (Redis came back
      without its data; its ids may fall below ``last``): from its start, said;
    - none of a full page was read: from that page's oldest, said.
    """
    if last in ("0", "0-0"):
        return last, None
    if not tail:
        return "0-0", "the event stream is gone (Redis came back without its data): from its start"
    for entry_id in tail:
        if entry_id in read:
            if entry_id == last:
                return last, None
            return entry_id, (
                f"the event stream no longer holds {last}, the last read (events lost in a "
                f"failover): following after {entry_id}, the newest it holds that was read"
            )
    if oldest is not None and id_order(oldest) > id_order(last):
        return last, (
            f"the oldest event is now {oldest}, past {last}, the last read: events between "
            f"them were trimmed, or lost with Redis's data, before they were read"
        )
    if len(tail) < PAGE:
        return "0-0", (
            "the event stream is a new one (Redis came back without its data): from its start"
        )
    return just_before(tail[-1]), (
        f"none of the event stream's last {PAGE} events was read before: following from {tail[-1]}"
    )


def just_before(entry_id: str) -> str:
    """The id just before ``entry_id``: reading after it reads ``entry_id`` first."""
    ms, seq = id_order(entry_id)
    return f"{ms}-{seq - 1}" if seq else f"{ms - 1}-{2**64 - 1}"
