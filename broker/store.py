"""The message store: records, timelines, waiting sets, assignments, replies, dead letters.

Every stage change is one call of ``lua/transition.lua`` whose allowed sources come from
:mod:`broker.stages`. Calls go through the connection's pipeliner, so concurrent callers
share round trips.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from .connection import Connection
from .deadletters import Letter, dead_letter_command
from .envelope import Envelope, load_envelope
from .errors import RedisReplyError, RedisUnavailable
from .fairness import PRIORITY_SPAN, split_score, waiting_score
from .records import Accepted, AssignResult, MessageRecord, Moved, TimelineEntry
from .results import Command, delivery_commands
from .scripts import ScriptName
from .stages import TERMINAL, Stage, sources_for
from .wire import ReplyEntry, parse_timeline_item, reply_fields

log = logging.getLogger("agent_reach.store")
RATE_WINDOW_MS = 10_000
RATE_SPAN_WINDOWS = 6  # the assignment rate is averaged over the last minute


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    return int(value) if value not in (None, b"") else 0


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Everything ``lua/accept.lua`` needs to create one record and take its first step."""

    message_id: str
    envelope_json: bytes
    capability: str
    deadline_ms: int
    reply_to: str
    priority: int
    next_stage: Stage
    accepted_ms: int
    instance: str = ""
    reason: str = ""
    fields: Mapping[str, str | bytes] | None = None


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


class MessageStore:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self._sources = {stage: sources_for(stage) for stage in Stage}
        self._joined: dict[tuple[Stage, Stage | None], str] = {}

    # -- stage changes ---------------------------------------------------------------------

    async def accept(self, acceptance: Acceptance) -> Accepted:
        """Create the record (once per id) and take its first step: ROUTED, WAITING or REJECTED."""
        return _accepted(await self.conn.call(*self._accept_command(acceptance)))

    async def accept_many(self, acceptances: list[Acceptance]) -> list[Accepted]:
        replies = await self.conn.call_many([self._accept_command(a) for a in acceptances])
        return [_accepted(_raise(r)) for r in replies]

    def _accept_command(self, a: Acceptance) -> tuple[Any, ...]:
        assert a.next_stage in (Stage.ROUTED, Stage.WAITING, Stage.REJECTED, Stage.FANNED_OUT)
        ttl = self.conn.settings.record_ttl_s if a.next_stage in TERMINAL else ""
        args = (
            a.envelope_json,
            a.capability,
            a.accepted_ms,
            a.deadline_ms,
            a.reply_to,
            a.priority,
            self.conn.settings.timeline_max,
            a.next_stage.value,
            a.instance,
            a.reason,
            ttl,
            *_flat(a.fields or {}),
        )
        keys = (self.keys.record(a.message_id), self.keys.timeline(a.message_id))
        return self.conn.script_command(ScriptName.ACCEPT, keys, args)

    async def move(self, message_id: str, target: Stage, **options: Any) -> Moved:
        """Compare-and-set the record's stage to ``target``; see :class:`Move`."""
        return _moved(
            await self.conn.call(*self._move_command(Move(message_id, target, **options)))
        )

    async def apply(self, move: Move) -> Moved:
        """One prepared :class:`Move`."""
        return _moved(await self.conn.call(*self._move_command(move)))

    async def move_many(self, moves: list[Move]) -> list[Moved]:
        replies = await self.conn.call_many([self._move_command(m) for m in moves])
        return [_moved(_raise(r)) for r in replies]

    def _sources_arg(self, m: Move) -> str:
        if m.any_of is not None:
            return ",".join(sorted(m.any_of))
        sources = self._joined.get((m.target, m.only_from))
        if sources is None:
            allowed = self._sources[m.target]
            if m.only_from is not None:
                allowed = allowed & {m.only_from}
            sources = self._joined[(m.target, m.only_from)] = ",".join(sorted(allowed))
        return sources

    def _move_command(self, m: Move) -> tuple[Any, ...]:
        sources = self._sources_arg(m)
        ttl = self.conn.settings.record_ttl_s if m.target in TERMINAL else ""
        args: list[Any] = [
            sources,
            "" if m.expect_attempt is None else m.expect_attempt,
            "" if m.expect_instance is None else m.expect_instance,
            m.target.value,
            "" if m.new_attempt is None else m.new_attempt,
            "" if m.new_instance is None else m.new_instance,
            now_ms(),
            m.reason,
            self.conn.settings.timeline_max,
            ttl,
            m.return_field,
        ]
        for key, value in (m.fields or {}).items():
            args += [key, value]
        keys = (self.keys.record(m.message_id), self.keys.timeline(m.message_id))
        return self.conn.script_command(ScriptName.TRANSITION, keys, args)

    # -- assignment and credits ------------------------------------------------------------

    async def assign(self, instance_id: str, message_id: str, attempt: int) -> AssignResult:
        """Append the attempt to the instance's stream, only against a free credit."""
        command = self._assign_command(instance_id, message_id, attempt)
        return AssignResult(await self.conn.call(*command))

    async def assign_many(self, assignments: list[tuple[str, str, int]]) -> list[AssignResult]:
        """``(instance_id, message_id, attempt)`` triples, in one round trip."""
        replies = await self.conn.call_many([self._assign_command(*a) for a in assignments])
        return [AssignResult(_raise(r)) for r in replies]

    def _assign_command(self, instance_id: str, message_id: str, attempt: int) -> tuple[Any, ...]:
        keys = (
            self.keys.card(instance_id),
            self.keys.inflight(instance_id),
            self.keys.queue(instance_id),
        )
        down_after_ms = int(self.conn.settings.down_after_s * 1000)
        args = (message_id, attempt, now_ms(), down_after_ms)
        return self.conn.script_command(ScriptName.ASSIGN, keys, args)

    def release_command(
        self, instance_id: str, group: str, finished: list[tuple[str, str]]
    ) -> tuple[Any, ...]:
        """Free the credits of ``(member, entry_id)`` pairs, ack the entries, announce it."""
        keys = (self.keys.inflight(instance_id), self.keys.queue(instance_id))
        args: list[str] = [group, self.keys.credit_channel, instance_id]
        for member, entry_id in finished:
            args += [member, entry_id]
        return self.conn.script_command(ScriptName.RELEASE, keys, args)

    # -- waiting -----------------------------------------------------------------------------

    async def park(self, capability: str, message_id: str, priority: int, accepted_ms: int) -> None:
        """Index a WAITING message in its capability's waiting set (idempotent)."""
        await self.park_many([(capability, message_id, priority, accepted_ms)])

    async def park_many(self, items: list[tuple[str, str, int, int]]) -> None:
        """``(capability, message_id, priority, accepted_ms)`` tuples, in one round trip.

        The deadline index (``P:due``) is written at acceptance (:meth:`due_command`)."""
        await self.run_all(self.park_commands(items))

    def park_commands(self, items: list[tuple[str, str, int, int]]) -> list[tuple[Any, ...]]:
        """The waiting-set entries, then the capability index: in that order, so that a
        prune of the index (:meth:`prune_waiting_index`) never drops a capability that has
        just been given work."""
        commands: list[tuple[Any, ...]] = [
            ("ZADD", self.keys.waiting(capability), waiting_score(priority, accepted), message_id)
            for capability, message_id, priority, accepted in items
        ]
        commands += [
            ("SADD", self.keys.waiting_index, capability) for capability in {i[0] for i in items}
        ]
        return commands

    async def prune_waiting_index(self, capabilities: list[str]) -> list[str]:
        """Drop from ``P:waiting`` the capabilities with nothing waiting, so the index — and
        every sweep's work — does not grow with each capability name a producer ever sent.
        Removed, then checked again and put back if work arrived meanwhile: work is parked
        before its capability is indexed (:meth:`park_commands`), so whichever order the two
        run in, a capability with waiting work ends up indexed. Returns those dropped."""
        empty = await self._empty_waiting(capabilities)
        if not empty:
            return []
        await self.conn.call("SREM", self.keys.waiting_index, *empty)
        still = set(await self._empty_waiting(empty))
        back = [c for c in empty if c not in still]
        if back:
            await self.conn.call("SADD", self.keys.waiting_index, *back)
        return [c for c in empty if c in still]

    async def _empty_waiting(self, capabilities: list[str]) -> list[str]:
        keys = [(self.keys.waiting(c), self.keys.unmatched(c)) for c in capabilities]
        replies = await self.conn.call_many([("ZCARD", k) for pair in keys for k in pair])
        return [
            c
            for i, c in enumerate(capabilities)
            if not _raise(replies[2 * i]) and not _raise(replies[2 * i + 1])
        ]

    async def run_all(self, commands: list[tuple[Any, ...]]) -> None:
        """Commands in one round trip; the first error reply is raised."""
        for reply in await self.conn.call_many(commands):
            _raise(reply)

    def due_command(self, message_id: str, deadline_ms: int) -> tuple[Any, ...]:
        """Set a message's next deadline in the reaper's clock (``P:due``), which indexes
        every live message."""
        return ("ZADD", self.keys.due, deadline_ms, message_id)

    async def claim_due(self, now: int, lease_ms: int, count: int) -> list[str]:
        """The messages whose next deadline has come, claimed for ``lease_ms`` (see
        ``lua/claim_due.lua``): no other reaper sees them until this one reschedules them."""
        command = self.conn.script_command(
            ScriptName.CLAIM_DUE, (self.keys.due,), (now, lease_ms, count)
        )
        return [_text(i) for i in await self.conn.call(*command)]

    async def reschedule_due(self, lease_score: int, verdicts: list[tuple[str, int | None]]) -> int:
        """Write each leased message's next look (``None``: it ended, forget it), only where
        the lease still stands (see ``lua/reschedule_due.lua``)."""
        if not verdicts:
            return 0
        args: list[Any] = [lease_score]
        for message_id, next_ms in verdicts:
            args += [message_id, "" if next_ms is None else next_ms]
        command = self.conn.script_command(ScriptName.RESCHEDULE_DUE, (self.keys.due,), args)
        return int(await self.conn.call(*command))

    def due_at_most_command(self, message_id: str, at_ms: int) -> tuple[Any, ...]:
        """Bring a message's next deadline forward to ``at_ms`` (never later): the delivery
        timeout of an assignment, say, comes before the message's own deadline."""
        return ("ZADD", self.keys.due, "LT", at_ms, message_id)

    async def forget_due(self, message_ids: list[str]) -> None:
        if message_ids:
            await self.conn.call("ZREM", self.keys.due, *message_ids)

    async def sessions(self, session_ids: list[str]) -> dict[str, str]:
        """The instance each session is bound to (affinity), for the sessions that have one."""
        replies = await self.conn.call_many([("GET", self.keys.session(s)) for s in session_ids])
        return {s: r.decode() for s, r in zip(session_ids, replies, strict=True) if r}

    async def waiting_heads(self, windows: Mapping[str, int]) -> dict[str, list[tuple[str, int]]]:
        """The first ``count`` ``(message_id, priority)`` of each capability's waiting set, in
        waiting order: one round trip."""
        capabilities = list(windows)
        replies = await self.conn.call_many(
            [
                ("ZRANGE", self.keys.waiting(c), 0, windows[c] - 1, "WITHSCORES")
                for c in capabilities
            ]
        )
        heads: dict[str, list[tuple[str, int]]] = {}
        for capability, flat in zip(capabilities, replies, strict=True):
            _raise(flat)
            heads[capability] = [
                (_text(flat[i]), split_score(float(flat[i + 1]))[0]) for i in range(0, len(flat), 2)
            ]
        return heads

    async def unpark_many(self, capability: str, message_ids: list[str]) -> None:
        await self.run_all(self.unpark_commands({capability: message_ids}))

    def unpark_commands(self, removals: Mapping[str, list[str]]) -> list[tuple[Any, ...]]:
        """Remove waiting entries, wherever they are: the waiting set or the unmatched one."""
        commands: list[tuple[Any, ...]] = []
        for capability, ids in removals.items():
            if ids:
                commands += [
                    ("ZREM", self.keys.waiting(capability), *ids),
                    ("ZREM", self.keys.unmatched(capability), *ids),
                ]
        return commands

    def set_aside_commands(
        self, capability: str, records: list[MessageRecord]
    ) -> list[tuple[Any, ...]]:
        """Move waiting messages no instance can take at all out of the waiting set, so they
        do not stand in front of work that could be served (same score, other set)."""
        return self._move_between(
            self.keys.waiting(capability), self.keys.unmatched(capability), records
        )

    def restore_commands(
        self, capability: str, records: list[MessageRecord]
    ) -> list[tuple[Any, ...]]:
        """Put set-aside messages back in the waiting set, in their place by priority and age."""
        return self._move_between(
            self.keys.unmatched(capability), self.keys.waiting(capability), records
        )

    def _move_between(
        self, source: str, target: str, records: list[MessageRecord]
    ) -> list[tuple[Any, ...]]:
        if not records:
            return []
        scored: list[Any] = []
        for r in records:
            scored += [waiting_score(r.priority, r.accepted_ms), r.id]
        return [("ZADD", target, *scored), ("ZREM", source, *(r.id for r in records))]

    async def unmatched_heads(self, windows: Mapping[str, tuple[int, int]]) -> dict[str, list[str]]:
        """Ids in each capability's unmatched set from ``(start, count)``: one round trip."""
        capabilities = list(windows)
        replies = await self.conn.call_many(
            [
                ("ZRANGE", self.keys.unmatched(c), windows[c][0], sum(windows[c]) - 1)
                for c in capabilities
            ]
        )
        for reply in replies:
            _raise(reply)
        return {c: [_text(i) for i in ids] for c, ids in zip(capabilities, replies, strict=True)}

    async def oldest_waiting(self, capability: str) -> tuple[int, int, int | None]:
        """``(depth, unmatched, accepted_ms of the oldest waiting message or None)``. The
        oldest is the first of some priority band in one of the two sets: a look per band."""
        keys = (self.keys.waiting(capability), self.keys.unmatched(capability))
        commands: list[tuple[Any, ...]] = [("ZCARD", key) for key in keys] + [
            (
                "ZRANGEBYSCORE",
                key,
                band * PRIORITY_SPAN,
                f"({(band + 1) * PRIORITY_SPAN}",
                "WITHSCORES",
                "LIMIT",
                0,
                1,
            )
            for key in keys
            for band in range(10)
        ]
        waiting, unmatched, *firsts = await self.conn.call_many(commands)
        ages = [split_score(float(f[1]))[1] for f in firsts if f]
        return int(waiting) + int(unmatched), int(unmatched), min(ages) if ages else None

    async def waiting_capabilities(self) -> list[str]:
        members = await self.conn.call("SMEMBERS", self.keys.waiting_index)
        return sorted(_text(m) for m in members)

    async def waiting_depth(self, capability: str) -> int:
        """Messages waiting for ``capability``: for a credit, and for any instance at all."""
        keys = (self.keys.waiting(capability), self.keys.unmatched(capability))
        return sum(int(n) for n in await self.conn.call_many([("ZCARD", k) for k in keys]))

    def count_assigned_commands(self, counts: Mapping[str, int], now: int) -> list[tuple[Any, ...]]:
        """Add to each capability's assignment counter for the current window."""
        window = now // RATE_WINDOW_MS
        keep_s = (RATE_SPAN_WINDOWS + 2) * RATE_WINDOW_MS // 1000
        commands: list[tuple[Any, ...]] = []
        for capability, n in counts.items():
            key = self.keys.assigned(capability, window)
            commands += [("INCRBY", key, n), ("EXPIRE", key, keep_s)]
        return commands

    async def assignment_rates(self, capabilities: list[str], now: int) -> dict[str, float]:
        """Assignments per second over the last minute (the current window counts for the
        part of it that has passed)."""
        window = now // RATE_WINDOW_MS
        first = window - RATE_SPAN_WINDOWS
        elapsed_s = (now - first * RATE_WINDOW_MS) / 1000
        replies = await self.conn.call_many(
            [
                ("MGET", *(self.keys.assigned(c, w) for w in range(first, window + 1)))
                for c in capabilities
            ]
        )
        return {
            c: sum(int(v) for v in counts if v) / elapsed_s
            for c, counts in zip(capabilities, replies, strict=True)
        }

    # -- results, dead letters ---------------------------------------------------------------

    async def send_reply(self, reply_to: str, entry: ReplyEntry) -> None:
        """One entry on a reply stream (a notice, say), which then expires ``reply_ttl_s``
        after it; a stream Redis refuses to write is dead-lettered, as for any reply."""
        commands: list[Command] = [
            ("XADD", reply_to, "*", *reply_fields(entry)),
            ("EXPIRE", reply_to, self.conn.settings.reply_ttl_s),
        ]
        await self.after_delivery([entry.id] * 2, commands, await self.conn.call_many(commands))

    async def dead_letter_message(self, message_id: str, reason: str) -> None:
        """Dead-letter a record: its envelope, the final reason, and the chain of reasons on
        its timeline (JSON ``[[stage, instance, attempt, reason], ...]``)."""
        record = await self.get_record(message_id)
        timeline = await self.get_timeline(message_id)
        chain = [[e.stage, e.instance, e.attempt, e.reason] for e in timeline if e.reason]
        await self.dead_letter(
            Letter(
                id=message_id,
                stage=record.stage.value if record else "DEAD",
                reason=reason,
                raw=record.envelope if record else b"",
                chain=msgspec.json.encode(chain),
                ts_ms=now_ms(),
            )
        )

    async def dead_letter(self, letter: Letter) -> None:
        await self.conn.call(*self.dead_letter_command(letter))

    def dead_letter_command(self, letter: Letter) -> Command:
        """The capped ``XADD`` of ``letter`` to ``P:dlq`` (:mod:`broker.deadletters`)."""
        s = self.conn.settings
        return dead_letter_command(
            self.keys, letter, max_entries=s.dlq_max_entries, max_bytes=s.dlq_entry_max_bytes
        )

    async def deliver(
        self,
        envelope: Envelope | bytes,
        stage: Stage,
        result: bytes | None = None,
        error: str | None = None,
        *,
        attempt: int,
    ) -> None:
        """Tell the producer how ``attempt`` of the message ended (:mod:`broker.results`), in
        one round trip."""
        if isinstance(envelope, bytes):
            envelope = load_envelope(envelope)
        commands = self.delivery_commands(envelope, stage, result, error, attempt=attempt)
        if commands:
            owners = [envelope.message_id] * len(commands)
            await self.after_delivery(owners, commands, await self.conn.call_many(commands))

    def delivery_commands(
        self,
        envelope: Envelope,
        stage: Stage,
        result: bytes | None,
        error: str | None,
        *,
        attempt: int,
    ) -> list[Command]:
        """:func:`broker.results.delivery_commands` with this broker's reply TTL."""
        return delivery_commands(
            self.keys,
            envelope,
            stage,
            result,
            error,
            attempt=attempt,
            reply_ttl_s=self.conn.settings.reply_ttl_s,
        )

    async def after_delivery(
        self, owners: list[str], commands: list[Command], replies: list[Any]
    ) -> None:
        """Read the replies of :func:`~broker.results.delivery_commands` (``owners``: the
        message each command is for).

        A delivery Redis refused for good (``reply_to`` names a key that is not a stream, say)
        is dead-lettered with its reason: one producer's bad ``reply_to`` must not stop the
        process that ended the message. A lost connection is raised: it is sent again.

        A broadcast child's outcome that ended its parent (``lua/child_done.lua``) makes this
        the parent's ender: its own producer is told, then its ``reply_pending`` mark and
        deadline entry go. A stop in between leaves ``reply_pending`` to the reaper, or to
        the re-sent child outcome (the script answers a repeat with the untold parent)."""
        ended: list[tuple[bytes, bytes]] = []
        child_done = self.conn.sha(ScriptName.CHILD_DONE)
        for message_id, command, reply in zip(owners, commands, replies, strict=True):
            if isinstance(reply, RedisUnavailable):
                raise reply
            if isinstance(reply, Exception):
                await self.dead_letter(
                    Letter(
                        id=message_id,
                        reason=f"{self._delivery_kind(command)}_undeliverable: {reply}",
                        ts_ms=now_ms(),
                    )
                )
            elif command[:2] == ("EVALSHA", child_done) and reply[0] in (1, 2):
                ended.append((reply[2], reply[1]))
        for envelope, result in ended:
            await self._tell_parent(load_envelope(envelope), result)

    async def _tell_parent(self, parent: Envelope, result: bytes) -> None:
        await self.deliver(parent, Stage.SUCCEEDED, result, attempt=0)  # a parent: attempt 0
        parent_id = parent.message_id
        await self.run_all(
            [
                ("HDEL", self.keys.record(parent_id), "reply_pending"),
                ("ZREM", self.keys.due, parent_id),
            ]
        )

    def _delivery_kind(self, command: Command) -> str:
        if command[0] in ("EVALSHA", "ZADD"):  # a broadcast child's, for its parent
            return "broadcast_outcome"
        return "webhook" if command[1] == self.keys.outbox else "reply"  # XADD or EXPIRE

    # -- reading -----------------------------------------------------------------------------

    async def get_record(self, message_id: str) -> MessageRecord | None:
        return (await self.get_records([message_id]))[0]

    async def get_records(self, message_ids: list[str]) -> list[MessageRecord | None]:
        """Several records in one round trip (``None`` where there is none — or where what
        is there does not read as a record: logged, and left alone, never raised)."""
        replies = await self.conn.call_many([("HGETALL", self.keys.record(i)) for i in message_ids])
        return [
            _readable_record(i, pairs(_raise(flat))) if flat else None
            for i, flat in zip(message_ids, replies, strict=True)
        ]

    async def stages(self, message_ids: list[str]) -> list[Stage | None]:
        """Just the stage of several records, in one round trip (``None``: no record, or
        none a stage is read from)."""
        replies = await self.conn.call_many(
            [("HGET", self.keys.record(i), "stage") for i in message_ids]
        )
        return [_STAGE_OF.get(_raise(r)) if r else None for r in replies]

    async def bind_sessions(self, bindings: list[tuple[str, str]]) -> None:
        """Session affinity: ``(session_id, instance_id)`` pairs, each with the session TTL."""
        await self.run_all(self.bind_session_commands(bindings))

    def bind_session_commands(self, bindings: list[tuple[str, str]]) -> list[tuple[Any, ...]]:
        ttl_ms = int(self.conn.settings.session_ttl_s * 1000)
        return [("SET", self.keys.session(s), i, "PX", ttl_ms) for s, i in bindings]

    async def get_timeline(self, message_id: str) -> list[TimelineEntry]:
        entries = await self.conn.call("LRANGE", self.keys.timeline(message_id), 0, -1)
        return [timeline_entry(raw) for raw in entries]


def pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """A flat RESP ``[k1, v1, k2, v2, ...]`` reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _raise(reply: Any) -> Any:
    if isinstance(reply, Exception):
        raise reply
    return reply


_STAGE_OF: dict[bytes, Stage] = {stage.value.encode(): stage for stage in Stage}


def _accepted(reply: list[Any]) -> Accepted:
    return Accepted(bool(reply[0]), _STAGE_OF[reply[1]], int(reply[2]))


def _moved(reply: list[Any]) -> Moved:
    if reply[0] == -1:
        return Moved(False, None, 0, "")
    value = reply[4] if reply[0] == 1 and len(reply) > 4 and reply[4] else None
    return Moved(reply[0] == 1, _STAGE_OF[reply[1]], int(reply[2]), reply[3].decode(), value)


def _flat(fields: Mapping[str, str | bytes]) -> list[str | bytes]:
    return [item for pair in fields.items() for item in pair]


def _readable_record(message_id: str, raw: Mapping[bytes, bytes]) -> MessageRecord | None:
    try:
        return record_from_hash(message_id, raw)
    except (ValueError, UnicodeDecodeError) as exc:
        log.error("record of %r does not read as one, left alone: %s", message_id, exc)
        return None


def record_from_hash(message_id: str, raw: Mapping[bytes, bytes]) -> MessageRecord:
    def get(name: str) -> bytes:
        return raw.get(name.encode(), b"")

    result = raw.get(b"result")
    error = raw.get(b"error")
    return MessageRecord(
        id=message_id,
        stage=Stage(_text(get("stage"))),
        attempt=_int(get("attempt")),
        instance=_text(get("instance")),
        capability=_text(get("capability")),
        envelope=get("envelope"),
        accepted_ms=_int(get("accepted_ms")),
        deadline_ms=_int(get("deadline_ms")),
        updated_ms=_int(get("updated_ms")),
        reply_to=_text(get("reply_to")),
        priority=_int(get("priority")),
        result=result,
        error=_text(error) if error is not None else None,
        route_reason=_text(raw[b"route_reason"]) if b"route_reason" in raw else None,
        route_from=raw.get(b"route_from"),
        avoid=_text(get("avoid")),
        retry_at_ms=_int(get("retry_at_ms")),
        extensions=_int(get("extensions")),
        reply_pending=bool(get("reply_pending")),
        awaiting_callback=bool(get("awaiting_callback")),
        agent_task=_text(get("agent_task")),
    )


UNREADABLE = "UNREADABLE"


def timeline_entry(raw: bytes) -> TimelineEntry:
    """One timeline item (:func:`broker.wire.parse_timeline_item`); one that is unreadable
    shows as an ``UNREADABLE`` event saying why, so the rest of the timeline still reads."""
    entry = parse_timeline_item(raw)
    if isinstance(entry, str):
        return TimelineEntry(ts_ms=0, stage=UNREADABLE, instance="", attempt=0, reason=entry)
    return entry


async def ack(conn: Connection, stream: str, group: str, entry_ids: list[str]) -> None:
    if entry_ids:
        await conn.call("XACK", stream, group, *entry_ids)


async def trim_acknowledged(conn: Connection, stream: str) -> int:
    """Trim a stream below what every consumer group has acknowledged; never unread work.

    An entry may go when every group has delivered it and none holds it pending: the cut is the
    lowest pending id, or the last delivered id, across groups (``XTRIM MINID``, Redis 6.2).
    """
    try:
        groups = [pairs(flat) for flat in await conn.call("XINFO", "GROUPS", stream)]
    except RedisReplyError:  # no such stream yet
        return 0
    if not groups:
        return 0
    cuts: list[str] = []
    for group in groups:
        summary = await conn.call("XPENDING", stream, group[b"name"])
        pending, low = summary[0], summary[1]
        cuts.append(_text(low) if pending else _text(group[b"last-delivered-id"]))
    cut = min(cuts, key=_stream_id_key)
    if cut in ("0-0", "0"):
        return 0
    return int(await conn.call("XTRIM", stream, "MINID", cut))


def _stream_id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
