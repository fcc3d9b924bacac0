"""An operator's repairs: find stuck work, replay, resolve by hand, read dead letters, cancel.

Every change is a compare-and-set on the record (:class:`~broker.store.Move`), so a repair
that races the broker's own processes either wins cleanly or changes nothing and says what
it found. Index writes (waiting sets, the deadline index) follow the record, as everywhere
else (see "Write order across slots" in ``docs/architecture.md``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence

import msgspec

from .connection import Connection
from .deadletters import DeadLetter, DeadLetters, letter_view
from .due_clock import due_command, message_ids
from .envelope import load_envelope
from .errors import UnknownMessage, raised
from .keyspace import due_sets
from .record_codec import timeline_commands, timeline_entries
from .records import MessageRecord
from .registry import Registry
from .stages import (
    ENDED_REPLAYABLE,
    IN_FLIGHT,
    QUEUED,
    REPAIRS,
    TERMINAL,
    Repair,
    Stage,
)
from .store import MessageStore, Move
from .timekeeping import now_ms
from .wire import ReplyEntry

PAGE = 500  # due-index entries read per round trip

REPLAYED_NOTICE = "replayed"
_RESOLVE_AS = {Stage.SUCCEEDED: Repair.RESOLVE_SUCCEEDED, Stage.FAILED: Repair.RESOLVE_FAILED}


class Action(msgspec.Struct, frozen=True):
    """What a repair did to one message: ``done``, or why not; ``stage`` is the record's stage
    afterwards (``None``: no record)."""

    id: str
    done: bool
    stage: Stage | None
    detail: str


class StuckMessage(msgspec.Struct, frozen=True):
    """A message still in flight, with how long it has been in its stage."""

    id: str
    stage: Stage
    capability: str
    instance: str
    attempt: int
    age_s: float  # since its last stage change
    accepted_age_s: float
    last_reason: str


class ReplayPlan(msgspec.Struct, frozen=True):
    """What a replay would do: the records it would replay, those it refuses (with why), and
    the capabilities where running again may repeat work (capability -> why)."""

    records: list[MessageRecord]
    refused: list[Action]
    unsafe: dict[str, str]


def replay_refusal(message_id: str, stage: Stage) -> str:
    """Why a message in ``stage`` is not replayed."""
    if stage in ENDED_REPLAYABLE:
        return (
            f"{message_id} is {stage}: its producer has had that answer; replay it with "
            "--include-ended to run it again and send a new one"
        )
    if stage in QUEUED:
        why = "not finished, it is still queued to run"
    elif stage in IN_FLIGHT:
        why = "still in flight"
    elif stage is Stage.SUCCEEDED:
        why = "it succeeded"
    elif stage is Stage.REJECTED:
        why = "an invalid envelope cannot be replayed"
    else:
        why = "not replayable"
    return f"{message_id} is {stage}: {why}, not replayed"


def cancel_refusal(message_id: str, stage: Stage) -> str:
    """Why a message in ``stage`` cannot be cancelled."""
    if stage is Stage.RECEIVED:
        why = "its sidecar has taken it"
    elif stage in IN_FLIGHT:
        why = "the agent may be working on it"
    elif stage is Stage.NEEDS_CONFIRMATION:
        why = "the agent may have done it (close it with resolve)"
    else:
        why = "it has already ended"
    return f"{message_id} is {stage}: {why}; it cannot be cancelled"


def _no_replay(message_id: str, stage: Stage | None, expected: str = "") -> str:
    """Why a message found in ``stage`` (``None``: no record any more) is not replayed."""
    if stage is None:
        return f"{message_id}: its record has expired, not replayed"
    if expected:
        return f"{message_id} is no longer {expected} (now {stage}), not replayed"
    return replay_refusal(message_id, stage)


def _letter_refusal(letter: DeadLetter) -> Action:
    """A dead letter that is not a DEAD message: a rejected envelope, an undeliverable reply."""
    if letter.stage == Stage.REJECTED:
        why = f"was rejected ({letter.reason}): an invalid envelope cannot be replayed"
        return _refused(letter.id, Stage.REJECTED, f"{letter.id} {why}")
    return _refused(
        letter.id,
        None,
        f"{letter.id} was dead-lettered for {letter.reason}: not DEAD, not replayed",
    )


def _refused(message_id: str, stage: Stage | None, detail: str) -> Action:
    return Action(message_id, False, stage, detail)


def _resolve_refusal(message_id: str, stage: Stage) -> str:
    return f"{message_id} is {stage}: only a NEEDS_CONFIRMATION message can be resolved"


class Operator:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.store = MessageStore(conn)

    # -- finding work ----------------------------------------------------------------------

    async def live_records(self, *, page: int = PAGE) -> AsyncIterator[list[MessageRecord]]:
        """The records of every message still in flight, a page of the deadline index at a
        time (every accepted message is indexed there until it has ended). Paging by index
        while the broker edits the index may skip or repeat an entry: good enough to look."""
        for due in due_sets(self.keys):  # every partition
            start = 0
            while True:
                members = await self.conn.call("ZRANGE", due, start, start + page - 1)
                if not members:
                    break
                ids = message_ids(members)
                records = await self.store.get_records(ids)
                yield [r for r in records if r is not None and r.stage not in TERMINAL]
                if len(members) < page:
                    break
                start += page

    async def stuck(
        self,
        *,
        older_than_s: float,
        stage: Stage | None = None,
        now: int | None = None,
        page: int = PAGE,
    ) -> list[StuckMessage]:
        """Messages in flight whose stage last changed at least ``older_than_s`` ago, the
        oldest first."""
        now = now_ms() if now is None else now
        bound = now - int(older_than_s * 1000)
        seen: set[str] = set()
        found: list[MessageRecord] = []
        async for records in self.live_records(page=page):
            for r in records:
                if r.updated_ms <= bound and stage in (None, r.stage) and r.id not in seen:
                    seen.add(r.id)
                    found.append(r)
        found.sort(key=lambda r: r.updated_ms)
        reasons = await self._last_reasons([r.id for r in found])
        return [
            StuckMessage(
                id=r.id,
                stage=r.stage,
                capability=r.capability,
                instance=r.instance,
                attempt=r.attempt,
                age_s=(now - r.updated_ms) / 1000,
                accepted_age_s=(now - r.accepted_ms) / 1000,
                last_reason=reason,
            )
            for r, reason in zip(found, reasons, strict=True)
        ]

    async def _last_reasons(self, message_ids: list[str]) -> list[str]:
        replies = await self.conn.call_many(
            [c for i in message_ids for c in timeline_commands(self.keys, i)]
        )
        timelines = [
            timeline_entries(field, legacy)
            for field, legacy in zip(replies[0::2], replies[1::2], strict=True)
        ]
        return [timeline[-1].reason if timeline else "" for timeline in timelines]

    async def _records(self, message_ids: Sequence[str]) -> list[MessageRecord]:
        """The records of ``message_ids``; :class:`UnknownMessage` naming the first id that
        has none."""
        records = await self.store.get_records(list(message_ids))
        for message_id, record in zip(message_ids, records, strict=True):
            if record is None:
                raise UnknownMessage(message_id)
        return [r for r in records if r is not None]

    # -- replay ----------------------------------------------------------------------------

    async def plan_replay(
        self, message_ids: Sequence[str], *, include_ended: bool = False
    ) -> ReplayPlan:
        """Replay these messages — NEEDS_CONFIRMATION and DEAD ones, and with
        ``include_ended`` FAILED, EXPIRED and CANCELLED ones too; :class:`UnknownMessage`
        (and nothing planned) when one of them has no record."""
        records = await self._records(_unique(message_ids))
        return await self._plan(records, [], include_ended=include_ended)

    async def plan_dlq_replay(
        self, matching: Callable[[DeadLetter], bool] | None = None
    ) -> ReplayPlan:
        """Replay every message the dead-letter stream lists as DEAD and that still is (of
        the letters ``matching`` accepts, when given)."""
        refused: list[Action] = []
        dead: list[str] = []
        for letter in await self._all_letters():
            if matching is not None and not matching(letter):
                continue
            if letter.stage == Stage.DEAD:
                dead.append(letter.id)
            else:
                refused.append(_letter_refusal(letter))
        dead = _unique(dead)
        records: list[MessageRecord] = []
        for message_id, record in zip(dead, await self.store.get_records(dead), strict=True):
            if record is not None and record.stage is Stage.DEAD:
                records.append(record)
            else:
                stage = record.stage if record is not None else None
                refused.append(_refused(message_id, stage, _no_replay(message_id, stage, "DEAD")))
        return await self._plan(records, refused)

    async def plan_stage_replay(self, stage: Stage) -> ReplayPlan:
        """Replay every message in flight in ``stage`` (NEEDS_CONFIRMATION, in practice)."""
        records = [r async for page in self.live_records() for r in page if r.stage is stage]
        return await self._plan(records, [])

    async def _plan(
        self, records: list[MessageRecord], refused: list[Action], *, include_ended: bool = False
    ) -> ReplayPlan:
        allowed, _ = REPAIRS[Repair.REPLAY_ENDED if include_ended else Repair.REPLAY]
        replayable = [r for r in records if r.stage in allowed]
        refused = refused + [
            _refused(r.id, r.stage, replay_refusal(r.id, r.stage))
            for r in records
            if r.stage not in allowed
        ]
        unsafe = await self.unsafe_to_repeat({r.capability for r in replayable})
        return ReplayPlan(replayable, refused, unsafe)

    async def unsafe_to_repeat(self, capabilities: Iterable[str]) -> dict[str, str]:
        """The capabilities where running a message again may do its work twice: some
        registered instance serving it is not idempotent, or none is registered (then
        whichever registers next is taken as not idempotent)."""
        views = await Registry(self.conn).snapshot()
        unsafe: dict[str, str] = {}
        for capability in sorted(set(capabilities)):
            serving = [v for v in views if capability in v.card.capabilities]
            risky = sorted(v.instance_id for v in serving if not v.card.idempotent)
            if not serving:
                unsafe[capability] = "no instance serving it is registered"
            elif risky:
                unsafe[capability] = f"served by non-idempotent {', '.join(risky)}"
        return unsafe

    async def replay(self, plan: ReplayPlan, *, by: str) -> list[Action]:
        """Send every planned record back to WAITING as a new attempt with the same
        idempotency key and a fresh deadline; the next drain assigns it. The attempt counter
        goes up at once: the answer the replay leads to is another answer than the one the
        producer may have had (its ``attempt``, and its webhook's ``webhook-id``, differ),
        and the producer's reply stream is told now (``notice: replayed``). The refused ones
        are reported as they are."""
        return plan.refused + [await self._replay_one(r, by) for r in plan.records]

    async def _replay_one(self, record: MessageRecord, by: str) -> Action:
        timeout_s = load_envelope(record.envelope).timeout_s
        deadline_ms = now_ms() + int(timeout_s * 1000)
        # indexed for the reaper first: a stop between the two writes leaves a message the
        # reaper looks at, never a live one nobody will
        await self.conn.call(*due_command(self.store.keys, record.id, deadline_ms))
        moved = await self.store.apply(
            Move(
                record.id,
                Stage.WAITING,
                # exactly what was planned (and confirmed): not a later state of the message
                any_of=frozenset({record.stage}) & REPAIRS[Repair.REPLAY_ENDED][0],
                expect_attempt=record.attempt,
                new_attempt="+",
                reason=f"replayed by {by}",
                # a fresh start: no back-off pending, no instance to steer away from
                fields={
                    "deadline_ms": deadline_ms,
                    "error": "",
                    "avoid": "",
                    "retry_at_ms": 0,
                    "extensions": 0,
                },
            )
        )
        if not moved.ok:
            return _refused(record.id, moved.stage, _no_replay(record.id, moved.stage))
        await self.conn.call("HDEL", self.conn.keys.record(record.id), "deadline_told")
        await self.store.waiting.park(
            record.capability, record.id, record.priority, record.accepted_ms
        )
        if record.reply_to:
            await self.store.delivery.send_reply(
                record.reply_to,
                ReplyEntry(
                    id=record.id,
                    stage=Stage.WAITING,
                    attempt=moved.attempt,
                    notice=REPLAYED_NOTICE,
                    error=f"replayed by {by} (was {record.stage}): a new answer follows",
                ),
            )
        return Action(record.id, True, Stage.WAITING, f"{record.id} (was {record.stage})")

    # -- resolve, cancel -------------------------------------------------------------------

    async def resolve(
        self,
        message_id: str,
        *,
        by: str,
        result: bytes | None = None,
        error: str | None = None,
    ) -> Action:
        """Close a NEEDS_CONFIRMATION message by hand: SUCCEEDED with ``result`` (JSON bytes)
        or FAILED with ``error`` — exactly one. The producer gets the reply."""
        if (result is None) == (error is None):
            raise ValueError("resolve needs exactly one of result and error")
        if result is not None:
            msgspec.json.decode(result)  # a DecodeError names what is wrong
            target, reason, fields = (
                Stage.SUCCEEDED,
                f"resolved by {by}: succeeded",
                {"result": result},
            )
        else:
            assert error is not None
            target, reason = Stage.FAILED, f"resolved by {by}: failed: {error}"
            fields = {"error": error.encode()}
        record = (await self._records([message_id]))[0]
        moved = await self.store.apply(
            Move(
                message_id,
                target,
                any_of=REPAIRS[_RESOLVE_AS[target]][0],
                reason=reason,
                fields=fields,
            )
        )
        if not moved.ok:
            return self._not_moved(message_id, moved.stage, _resolve_refusal)
        await self._finish(record, target, fields)
        return Action(message_id, True, target, f"{message_id} {target}: {reason}")

    async def cancel(self, message_id: str, *, by: str) -> Action:
        """End a message no sidecar has taken yet (ACCEPTED, WAITING or ROUTED) as CANCELLED.
        A ROUTED one's stream entry is dropped by the sidecar's fencing when it reads it
        (its RECEIVED compare-and-set finds the record CANCELLED), which returns the credit."""
        record = (await self._records([message_id]))[0]
        reason = f"cancelled by {by}"
        moved = await self.store.apply(
            Move(
                message_id,
                Stage.CANCELLED,
                any_of=REPAIRS[Repair.CANCEL][0],
                reason=reason,
                fields={"error": reason},
            )
        )
        if not moved.ok:
            return self._not_moved(message_id, moved.stage, cancel_refusal)
        await self.store.waiting.unpark_many(record.capability, [message_id])
        await self._finish(record, Stage.CANCELLED, {"error": reason.encode()})
        return Action(
            message_id, True, Stage.CANCELLED, f"{message_id} {reason} (was {record.stage})"
        )

    @staticmethod
    def _not_moved(
        message_id: str, stage: Stage | None, refusal: Callable[[str, Stage], str]
    ) -> Action:
        if stage is None:  # the record expired between our read and the move
            raise UnknownMessage(message_id)
        return _refused(message_id, stage, refusal(message_id, stage))

    async def _finish(
        self, record: MessageRecord, stage: Stage, fields: Mapping[str, bytes]
    ) -> None:
        """The message has ended: tell its producer, and drop its deadline entry."""
        error = fields.get("error")
        await self.store.delivery.deliver(
            record.envelope,
            stage,
            fields.get("result"),
            error.decode() if error else None,
            attempt=record.attempt,
        )
        await self.store.due.forget([record.id])

    # -- dead letters ----------------------------------------------------------------------

    async def dead_letters(self, count: int) -> DeadLetters:
        """The newest ``count`` dead letters, oldest first, and how many there are."""
        total, newest = await self.conn.call_many(
            [("XLEN", self.keys.dlq), ("XREVRANGE", self.keys.dlq, "+", "-", "COUNT", count)]
        )
        entries = raised(newest)  # a dead-letter key of another type: Redis's own words
        return DeadLetters(raised(total), [letter_view(e, f) for e, f in reversed(entries)])

    async def _all_letters(self) -> list[DeadLetter]:
        letters: list[DeadLetter] = []
        after = "-"
        while True:
            entries = await self.conn.call("XRANGE", self.keys.dlq, after, "+", "COUNT", PAGE)
            letters += [letter_view(e, f) for e, f in entries]
            if len(entries) < PAGE:
                return letters
            after = "(" + entries[-1][0].decode()


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))
