"""The message store: records and their timelines, and the key families beside them.

Every stage change is one call of ``lua/transition.lua`` whose allowed sources come from
:mod:`broker.stages`. Calls go through the connection's pipeliner, so concurrent callers
share round trips. The other key families each have a module of their own, reached from
here: :attr:`MessageStore.credits` (instance streams and credits), :attr:`~MessageStore.waiting`
(waiting sets), :attr:`~MessageStore.due` (the reaper's clock) and
:attr:`~MessageStore.delivery` (replies, webhooks, dead letters). Command builders are module
functions; the classes only run them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from .acceptance import Acceptance, accept_command
from .connection import Connection
from .credits import Credits, assign_keys
from .delivery import Delivery
from .due_clock import DueClock
from .entries import MAX_ATTEMPT
from .errors import RedisReplyError, errors_in_place, raised
from .event_log import emit, event_command
from .keyspace import due_for
from .record_codec import (
    STAGE_OF,
    accepted,
    moved,
    pairs,
    readable_record,
    timeline_commands,
    timeline_entries,
)
from .records import Accepted, MessageRecord, Moved, TimelineEntry
from .resp import Command
from .scripts import ScriptName
from .stages import TERMINAL, Stage, sources_for
from .streams import RawEntry, raw_entries
from .timekeeping import now_ms
from .usage import COUNTS, Charge, utc_day, utc_month
from .waiting_sets import ASSIGNED_KEEP_S, RATE_WINDOW_MS, WaitingSets

__all__ = ["Acceptance", "MessageStore", "Move", "accept_command", "move_command"]
__all__ += ["move_sources", "now_ms"]

# kept as a level in the counters (agent_reach_needs_confirmation_messages)
LEVEL_STAGE = Stage.NEEDS_CONFIRMATION.value
log = logging.getLogger("agent_reach.store")


class Move(msgspec.Struct):
    """One compare-and-set of ``lua/transition.lua``: the record moves to ``target`` only if
    its stage is an allowed source (narrowed to ``only_from`` when given) and the attempt and
    instance match."""

    message_id: str
    target: Stage
    reason: str = ""
    expect_attempt: int | None = None
    expect_instance: str | None = None
    new_attempt: int | str | None = None
    new_instance: str | None = None
    fields: Mapping[str, str | bytes | int] | None = None
    return_field: str = ""
    only_from: Stage | None = None
    # Explicit allowed sources, for an operator's repair outside the automatic lifecycle
    # (replaying a dead-lettered message); replaces the table's sources when given.
    any_of: frozenset[Stage] | None = None
    # counter fields counted if the move is made (broker/metric_fields.py: a retry, a call)
    counts: tuple[str, ...] = ()
    # the attempt's usage, charged to its day if the move is made (broker/usage.py)
    charge: Charge | None = None
    # On a single server, a drain's claim (WAITING -> ROUTED to ``new_instance``) may assign
    # it in the same script (``lua/claim_assign.lua``), the reaper's look brought forward to
    # this time (ms), and once assigned remove its waiting entries of capability
    # ``unpark_from`` and count the assignment in that capability's counter; no charge then
    assign_look_ms: int = 0
    unpark_from: str = ""
    # made only where the record's field holds this value ("": absent; lua/transition_if.lua)
    expect_field: tuple[str, str] | None = None

    def landed(self, moved: Moved) -> bool:
        """The move is on the record: made now, or by an earlier try whose answer was lost
        (the record is at the target, at this attempt, on this instance)."""
        return moved.ok or (
            moved.stage is self.target
            and moved.attempt == self.expect_attempt
            and moved.instance == self.expect_instance
        )


_SOURCES: dict[tuple[Stage, Stage | None], str] = {
    (target, only): ",".join(sorted(sources_for(target) & ({only} if only else set(Stage))))
    for target in Stage
    for only in (None, *Stage)
}


def move_sources(m: Move) -> str:
    """The stages ``m`` is allowed from, comma-separated, as the scripts read them."""
    return ",".join(sorted(m.any_of)) if m.any_of is not None else _SOURCES[m.target, m.only_from]


@functools.cache
def _expiry_unended(sources: str) -> str:
    """ARGV[10] of a move to a stage that is not terminal, from its allowed sources: ``""``
    removes the record's expiry (a move out of a terminal stage, an operator's replay);
    ``"-"`` leaves it alone — only a terminal record has one, so there is none to remove."""
    return "" if any(s in TERMINAL for s in sources.split(",")) else "-"


def _move_args(conn: Connection, m: Move) -> list[Any]:
    """``lua/transition.lua``'s ARGV up to the charge."""
    sources = move_sources(m)
    ttl = conn.settings.record_ttl_s if m.target in TERMINAL else _expiry_unended(sources)
    return [
        sources,
        "" if m.expect_attempt is None else m.expect_attempt,
        "" if m.expect_instance is None else m.expect_instance,
        m.target.value,
        "" if m.new_attempt is None else m.new_attempt,
        "" if m.new_instance is None else m.new_instance,
        now_ms(),
        m.reason,
        conn.settings.timeline_max,
        ttl,
        m.return_field,
        LEVEL_STAGE,
        conn.counting().max_series,
        len(m.counts),
        *m.counts,
    ]


def _field_args(m: Move) -> list[Any]:
    return [item for pair in (m.fields or {}).items() for item in pair]


def move_command(conn: Connection, m: Move) -> tuple[Any, ...]:
    args = _move_args(conn, m)
    counting = conn.counting()
    record = conn.keys.record(m.message_id)
    keys: tuple[str, ...] = (record, *counting.keys(record))
    if m.assign_look_ms:
        assert m.charge is None and m.new_instance and m.unpark_from and not conn.cluster
        args += ["", *_field_args(m)]
        fused = (
            *assign_keys(conn, m.new_instance),
            due_for(conn.keys, m.message_id),
            conn.keys.waiting(m.unpark_from),
            conn.keys.unmatched(m.unpark_from),
            conn.keys.assigned(m.unpark_from, now_ms() // RATE_WINDOW_MS),
        )
        down_after_ms = int(conn.settings.down_after_s * 1000)
        fence = m.expect_field or ("", "")
        return conn.script_command(
            ScriptName.CLAIM_ASSIGN,
            (record, *fused, *counting.keys(record)),
            (m.message_id, down_after_ms, m.assign_look_ms, *fence, ASSIGNED_KEEP_S, *args),
        )
    if m.charge is None:
        args.append("")
    else:
        keys += usage_keys(conn, m.charge.ms, record)
        args += charge_args(conn, m.charge)
    args += _field_args(m)
    if m.expect_field is not None:
        return conn.script_command(ScriptName.TRANSITION_IF, keys, (*m.expect_field, *args))
    return conn.script_command(ScriptName.TRANSITION, keys, args)


def receive_process_command(conn: Connection, received: Move, processing: Move) -> tuple[Any, ...]:
    """RECEIVED and then PROCESSING of one message in one script (``lua/receive_process.lua``):
    neither charges, both on the record's own keys."""
    assert received.message_id == processing.message_id
    assert (received.target, processing.target) == (Stage.RECEIVED, Stage.PROCESSING)
    assert received.charge is None and processing.charge is None
    assert not (received.assign_look_ms or processing.assign_look_ms)
    assert received.expect_field is None and processing.expect_field is None
    first = [*_move_args(conn, received), "", *_field_args(received)]
    second = [*_move_args(conn, processing), "", *_field_args(processing)]
    record = conn.keys.record(received.message_id)
    keys = (record, *conn.counting().keys(record))
    return conn.script_command(ScriptName.RECEIVE_PROCESS, keys, (len(first), *first, *second))


# The envelope bytes one lua/take.lua answers at most before it leaves the rest of its batch
# to Python's way (one receive_process.lua each): a script holds Redis while it runs, and on
# Redis 6.2 one that moved 2,000 envelopes of 100 kB held it past the read's timeout.
TAKE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Took:
    """What ``lua/take.lua`` answered (:func:`took`)."""

    after: str  # the id the next blocking read waits past
    entries: list[RawEntry]  # every entry the group gave, as read
    moves: dict[str, tuple[Moved, Moved]]  # by entry id: RECEIVED's and PROCESSING's answers
    error: Exception | None = None  # the group could not be read (nothing was)

    @property
    def received(self) -> set[str]:
        """The entries whose RECEIVED the script made: their records were ROUTED to this
        instance at their attempt, so each is the assignment, not a copy of it (a copy's
        RECEIVED finds the record moved on, and is in ``moves`` all the same)."""
        return {entry_id for entry_id, (r, _) in self.moves.items() if r.ok}


def take_command(
    conn: Connection, stream: str, group: str, consumer: str, count: int, moves: tuple[Move, ...]
) -> tuple[Any, ...]:
    """A sidecar's read of its group and RECEIVED + PROCESSING of what it reads, in one script
    (``lua/take.lua``; single server only). ``moves``: the RECEIVED move, and the PROCESSING
    moves of a first and of a later attempt, of any one message; the script sets each
    entry's attempt and its own clock's time in them. Sent as :func:`take_stamped` makes
    it, with the call's token."""
    assert not conn.cluster
    assert [m.target for m in moves] == [Stage.RECEIVED, Stage.PROCESSING, Stage.PROCESSING]
    assert all(m.charge is None and not m.assign_look_ms and not m.expect_field for m in moves)
    receiving, first, later = ([*_move_args(conn, m), "", *_field_args(m)] for m in moves)
    before, after = conn.keys.record("\n").split("\n")
    counters = "".join(conn.counting().keys(stream))  # an argument, not a key: lua/take.lua
    head = [group, consumer, count, before, after, counters, MAX_ATTEMPT, TAKE_BYTES, ""]
    head += [len(receiving), len(first)]
    command = conn.script_command(ScriptName.TAKE, (stream,), [*head, *receiving, *first, *later])
    assert command[_TAKE_TOKEN_AT] == ""
    return command


_TAKE_TOKEN_AT = 4 + 8  # EVALSHA sha 1 stream, then ARGV[9]: the call's token (lua/take.lua)


def take_stamped(command: tuple[Any, ...], token: str) -> tuple[Any, ...]:
    """:func:`take_command`'s call, writing ``token`` on each PROCESSING it makes (field
    ``take_call``): one token per call, so that a call left unanswered is known by it."""
    return (*command[:_TAKE_TOKEN_AT], token, *command[_TAKE_TOKEN_AT + 1 :])


def took(reply: Any) -> Took:
    """The reply of :func:`take_command`. An entry whose moves failed (an error in their
    place) is left out of ``moves``, as one the script left alone: it is taken again the
    way of every other, and fails there as it would have."""
    if reply[0] == b"":
        return Took("", [], {}, reply[1])
    moves = {
        e[0].decode(): (moved(e[2]), moved(e[3]))
        for e in reply[1:]
        if len(e) == 4  # {id, fields, received, processing}
    }
    return Took(reply[0].decode(), raw_entries(reply[1:]), moves)


def usage_keys(conn: Connection, ms: int, near: str) -> tuple[str, str]:
    """The day's and the month's usage hashes a script on ``near``'s slot charges."""
    day, month = conn.fleet.usage(utc_day(ms)), conn.fleet.usage(utc_month(ms))
    return (conn.per_slot(day, near), conn.per_slot(month, near))


def charge_args(conn: Connection, c: Charge) -> list[Any]:
    """The charge's part of a move's arguments (``lua/transition.lua``). A figure of 0 adds
    nothing and is left out; a count that is a whole number goes as digits, which the script
    adds with ``HINCRBY`` (``bench.script_replay``: ``HINCRBYFLOAT``'s parse and print of a
    float cost the outcome's move 7 % of its time, three of them a message)."""
    s = conn.settings
    keep_s = max(s.usage_keep_days, 32) * 86400
    figures = [(name, amount_arg(name, value)) for name, value in c.figures.items() if value]
    cap = s.metrics_max_series * 4  # each combination is a few fields
    budgeted = "1" if c.tenant in s.budgets else ""  # never folded: budgets read it
    pairs = [item for pair in figures for item in pair]
    return [c.combination, cap, keep_s, c.tenant, repr(c.spend), budgeted, len(figures), *pairs]


def amount_arg(figure: str, value: float) -> str:
    """A figure's amount as the script reads it: digits alone for a count that is a whole
    number (exact as a float: below 2**53), else the float's repr. A cost always goes as a
    float: its field holds fractions, which refuse an integer first (each refusal counted
    as an error in Redis's own statistics) before it is added as a float."""
    number = float(value)
    if figure in COUNTS and number.is_integer() and abs(number) < 2**53:
        return str(int(number))
    return repr(number)


def parked_events(conn: Connection, moves: list[Move], done: list[Moved]) -> list[Any]:
    """A ``message.needs_confirmation`` event for each move made into NEEDS_CONFIRMATION:
    every such move is one of :class:`MessageStore`'s, so this is where they are told."""
    return [
        event_command(
            conn,
            "message.needs_confirmation",
            m.message_id,
            reason=m.reason,
            attempt=d.attempt,
            instance=d.instance,
        )
        for m, d in zip(moves, done, strict=True)
        if d.ok and m.target is Stage.NEEDS_CONFIRMATION
    ]


class MessageStore:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.credits = Credits(conn)
        self.waiting = WaitingSets(conn)
        self.due = DueClock(conn)
        self.delivery = Delivery(conn)

    # -- stage changes ---------------------------------------------------------------------

    async def accept(self, acceptance: Acceptance) -> Accepted:
        """Create the record (once per id) and take its first step: ROUTED, WAITING or REJECTED."""
        return accepted(await self.conn.call(*accept_command(self.conn, acceptance)))

    async def accept_many(self, acceptances: list[Acceptance]) -> list[Accepted]:
        return [raised(answer) for answer in await self.try_accept_many(acceptances)]

    async def try_accept_many(
        self, acceptances: list[Acceptance]
    ) -> list[Accepted | RedisReplyError]:
        """As :meth:`accept_many`, an acceptance Redis refused (its record a key of another
        type, say) with the error in its place; a Redis that cannot serve now raises."""
        replies = await self.conn.call_many([accept_command(self.conn, a) for a in acceptances])
        return [
            r if isinstance(r, RedisReplyError) else accepted(r) for r in errors_in_place(replies)
        ]

    async def move(self, message_id: str, target: Stage, **options: Any) -> Moved:
        """Compare-and-set the record's stage to ``target``; see :class:`Move`."""
        return await self.apply(Move(message_id, target, **options))

    async def apply(self, move: Move) -> Moved:
        """One prepared :class:`Move`."""
        done = moved(await self.conn.call(*move_command(self.conn, move)))
        await emit(self.conn, parked_events(self.conn, [move], [done]))
        return done

    async def move_many(self, moves: list[Move]) -> list[Moved]:
        return [raised(answer) for answer in await self.try_moves(moves)]

    async def try_moves(self, moves: list[Move]) -> list[Moved | RedisReplyError]:
        """Several moves in one round trip. A move Redis answered with an error (its record
        a key of another type, say) has that error in its place; a Redis that cannot serve
        now raises :class:`RedisUnavailable`."""
        replies = await self.conn.call_many([move_command(self.conn, m) for m in moves])
        answers: list[Moved | RedisReplyError] = [
            r if isinstance(r, RedisReplyError) else moved(r) for r in errors_in_place(replies)
        ]
        made = [(m, a) for m, a in zip(moves, answers, strict=True) if isinstance(a, Moved)]
        await emit(self.conn, parked_events(self.conn, [m for m, _ in made], [a for _, a in made]))
        return answers

    async def receive_and_process(
        self, pairs: list[tuple[Move, Move]]
    ) -> list[tuple[Moved, Moved] | RedisReplyError]:
        """RECEIVED then PROCESSING of each message, one script each (PROCESSING made only
        where RECEIVED was), all in one round trip. A message whose script Redis answered
        with an error (its record a key of another type, say) has that error in its place;
        a Redis that cannot serve now raises :class:`RedisUnavailable`."""
        replies = await self.conn.call_many([receive_process_command(self.conn, *p) for p in pairs])
        return [
            r if isinstance(r, RedisReplyError) else (moved(r[0]), moved(r[1]))
            for r in errors_in_place(replies)
        ]

    # -- reading -----------------------------------------------------------------------------

    async def get_record(self, message_id: str) -> MessageRecord | None:
        return (await self.get_records([message_id]))[0]

    async def get_records(self, message_ids: list[str]) -> list[MessageRecord | None]:
        """Several records in one round trip (``None`` where there is none — or where what
        is there does not read as a record: logged, and left alone, never raised)."""
        commands = [("HGETALL", self.keys.record(i)) for i in message_ids]
        replies = errors_in_place(await self.conn.call_many(commands))
        return [_record(i, flat) for i, flat in zip(message_ids, replies, strict=True)]

    async def stages(self, message_ids: list[str]) -> list[Stage | None]:
        """Just the stage of several records, in one round trip (``None``: no record, or
        none a stage is read from)."""
        return stages_read(await self.conn.call_many(self.stage_commands(message_ids)))

    def stage_commands(self, message_ids: list[str]) -> list[Command]:
        """The reads of :meth:`stages`, to send with other commands (:func:`stages_read`)."""
        return [("HGET", self.keys.record(i), "stage") for i in message_ids]

    async def get_timeline(self, message_id: str) -> list[TimelineEntry]:
        field, legacy = await self.conn.call_many(timeline_commands(self.keys, message_id))
        return timeline_entries(raised(field), raised(legacy))


def _record(message_id: str, flat: Any) -> MessageRecord | None:
    """A record from its ``HGETALL``; ``None`` for none, or (logged) for a key of another
    type, which a sidecar's user may make: never a failure of the batch it was read in."""
    if isinstance(flat, RedisReplyError):
        if flat.permission_refused:  # our own user may not: no record is no answer
            raise flat
        log.error("record of %r cannot be read, left alone: %s", message_id, flat)
        return None
    return readable_record(message_id, pairs(flat)) if flat else None


def stages_read(replies: list[Any]) -> list[Stage | None]:
    """The answers of :meth:`MessageStore.stage_commands`: each stage, or ``None`` (also
    for a record key of another type: see :func:`_record`)."""
    for reply in errors_in_place(replies):
        if isinstance(reply, RedisReplyError) and reply.permission_refused:
            raise reply
    return [STAGE_OF.get(r) if isinstance(r, bytes) else None for r in replies]
