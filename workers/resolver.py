"""How the reaper resolves one message whose time has come, by its stage.

When a message's time in its stage is up (or its instance is dead) the recovery policy
(:mod:`broker.recovery`) decides what becomes of it — the same table the sidecar asks — and
this module carries it out, every move fenced on the stage, attempt and instance looked at:

- WAITING past its deadline: EXPIRED, with why nothing could serve it; before it, indexed.
- ACCEPTED past the delivery timeout (its dispatcher stopped before routing it): WAITING.
- ROUTED or RECEIVED — the agent never asked — late, or on a dead instance: back to WAITING
  for another instance (the stale stream entry is dropped by fencing if ever read), or
  EXPIRED past the message's deadline.
- PROCESSING past the call timeout (plus grace; an async agent's callback timeout), or on a
  dead instance: the agent's status endpoint is asked, and its answer decides (a result is
  recorded, a running agent let run on a bounded number of times, an idempotent one retried,
  anything else parked for an operator). Never EXPIRED: past its deadline its producer is
  told the deadline passed (once).
- CALLBACK_RECEIVED whose sidecar stopped before finishing it: ended with the recorded result.
- FANNED_OUT: a broadcast's children whose ending never reached it are told again.
- NEEDS_CONFIRMATION: looked at hourly, so it stays visible until an operator acts.

Terminal writes carry ``reply_pending`` until the producer has been told (and a DEAD
message dead-lettered), so a reaper stopped in between leaves the telling to the next.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import anyio

from adapters.callback_desk import callback_charge, callback_outcome
from adapters.status import StatusClient
from adapters.write_ahead import TAKE_CALL
from broker.broadcast import decode_children
from broker.config import processing_lateness_s
from broker.connection import Connection
from broker.credits import return_command
from broker.deadletters import Letter
from broker.envelope import Envelope, load_envelope
from broker.metric_fields import retry
from broker.records import MessageRecord
from broker.recovery import MAX_EXTENSIONS, STATUS_SIGNALS, Action, Facts, Signal, decide
from broker.retry import retry_delay_ms
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore, Move
from broker.timekeeping import now_ms
from broker.usage import Charge, charged
from broker.wire import ReplyEntry

from .instances import Instances
from .waiting import WaitingRoom

PARKED_RECHECK_MS = 3_600_000
RACED_LOOK_MS = 1_000


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the reaper did with one message, and when to look at it again (None: never)."""

    action: str
    next_due_ms: int | None


class Resolver:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        waiting: WaitingRoom,
        instances: Instances,
        status: StatusClient,
    ) -> None:
        self.conn = conn
        self.settings = conn.settings
        self.store = store
        self.waiting = waiting
        self.instances = instances
        self.status = status
        self.rng = random.Random()
        self.delivery_timeout_ms = int(conn.settings.delivery_timeout_s * 1000)
        self.processing_timeout_ms = int(processing_lateness_s(conn.settings) * 1000)
        self.callback_timeout_ms = int(conn.settings.callback_timeout_s * 1000)

    async def resolve(self, message_id: str, record: MessageRecord | None, now: int) -> Verdict:
        if record is None or record.stage in TERMINAL:
            if record is not None:
                await self._ended(record)
            return Verdict("forgotten", None)
        match record.stage:
            case Stage.WAITING:
                return await self._waiting(record, now)
            case Stage.ACCEPTED:
                return await self._accepted(record, now)
            case Stage.ROUTED | Stage.RECEIVED:
                return await self._at_the_door(record, now)
            case Stage.PROCESSING:
                return await self._processing(record, now)
            case Stage.CALLBACK_RECEIVED:
                return await self._callback_received(record, now)
            case Stage.FANNED_OUT:
                await self._children_told(record)
                return Verdict("fanned out", now + self.delivery_timeout_ms)
        return Verdict("parked", now + PARKED_RECHECK_MS)  # NEEDS_CONFIRMATION

    async def _ended(self, record: MessageRecord) -> None:
        """What an ended message may still need: its producer told, by a reaper that stopped
        before it (or its dead letter written); its credit returned, where the reaper had
        taken it over and the message was ended by a sidecar that never held its entry."""
        if record.credit_taken_over:  # first: the telling may fail, and is tried again
            await self.release(record)
        if record.reply_pending:
            await self.finish_telling(record)
        elif record.stage is Stage.EXPIRED:
            await self.waiting.reply_expired(record, record.error or "waited_past_deadline")

    # -- the agent was never asked ---------------------------------------------------------

    async def _waiting(self, record: MessageRecord, now: int) -> Verdict:
        if now < record.deadline_ms:
            # whoever moved it to WAITING may have stopped before indexing it: index it
            # (unless it was set aside as unmatched; a drain then finds it either way)
            set_aside = await self.conn.call(
                "ZSCORE", self.conn.keys.unmatched(record.capability), record.id
            )
            if set_aside is None:  # no hint: every look at every waiting message comes here
                await self.store.waiting.park(
                    record.capability, record.id, record.priority, record.accepted_ms, hint=False
                )
            return Verdict("waiting", min(record.deadline_ms, now + self.delivery_timeout_ms))
        decide(Signal.DEADLINE, Facts(stage=Stage.WAITING))  # EXPIRE
        if await self.waiting.expire(record, now):
            return Verdict("expired", None)
        return Verdict("raced", now + RACED_LOOK_MS)  # it just left WAITING: look again

    async def _accepted(self, record: MessageRecord, now: int) -> Verdict:
        if now - record.updated_ms < self.delivery_timeout_ms:
            return Verdict("accepted", record.updated_ms + self.delivery_timeout_ms)
        decide(Signal.LATE, Facts(stage=Stage.ACCEPTED))  # REROUTE
        moved = await self.store.move(
            record.id,
            Stage.WAITING,
            only_from=Stage.ACCEPTED,
            reason="accepted but never routed (its dispatcher stopped): waiting",
        )
        if moved.ok:
            await self.store.waiting.park(
                record.capability, record.id, record.priority, record.accepted_ms
            )
        return Verdict("parked accepted", self.next_look(record, now))

    async def _at_the_door(self, record: MessageRecord, now: int) -> Verdict:
        down = self.instances.down(record.instance, now)
        late = now - record.updated_ms >= self.delivery_timeout_ms
        past = now >= record.deadline_ms
        if not (down or late or past):
            due = min(record.updated_ms + self.delivery_timeout_ms, record.deadline_ms)
            return Verdict("in time", due)
        if decide(Signal.LATE, Facts(stage=record.stage, deadline_passed=past)) is Action.EXPIRE:
            reason = "deadline passed before the agent was asked"
            ended = await self.end(record, Stage.EXPIRED, reason)
            return Verdict("expired", None if ended else now + RACED_LOOK_MS)
        why = (
            f"{record.instance} is down: rerouted"
            if down
            else f"delivery timeout: {record.instance} did not take it within "
            f"{self.settings.delivery_timeout_s:g} s: rerouted"
        )
        label = "instance_down" if down else "delivery_timeout"
        moved = await self.store.apply(
            self.fenced(
                record,
                Stage.WAITING,
                reason=why,
                fields={"avoid": record.instance},
                counts=(retry(record.capability, label),),
            )
        )
        if moved.ok:
            await self.release(record)
            await self.store.waiting.park(
                record.capability, record.id, record.priority, record.accepted_ms
            )
            return Verdict("rerouted", self.next_look(record, now))
        return Verdict("raced", now + RACED_LOOK_MS)

    # -- the agent may be working on it ----------------------------------------------------

    async def _processing(self, record: MessageRecord, now: int) -> Verdict:
        # an async agent took it (202): its answer is a callback, due within callback_timeout_s
        timeout_ms = (
            self.callback_timeout_ms if record.awaiting_callback else self.processing_timeout_ms
        )
        down = self.instances.down(record.instance, now)
        late = now - record.updated_ms >= timeout_ms
        if now >= record.deadline_ms and record.reply_to:
            await self.store.delivery.tell_deadline_passed(
                record.id, record.reply_to, record.attempt
            )
        if not (down or late):
            return Verdict("in time", record.updated_ms + timeout_ms)
        view = self.instances.view(record.instance)
        envelope = load_envelope(record.envelope)
        facts = Facts(
            stage=Stage.PROCESSING,
            idempotent=view is not None and view.card.idempotent,
            attempts_left=record.attempt < envelope.max_attempts,
            status_endpoint=view is not None and bool(view.card.status_url),
            status_asked=True,
            extensions_left=record.extensions < MAX_EXTENSIONS,
        )
        decide(Signal.LATE, facts)  # ASK_STATUS: the reaper always asks (none: "unknown")
        status_url = view.card.status_url if view else ""
        status = await self.status.query(status_url, record.id, record.agent_task)
        why = "instance down" if down else "callback late" if record.awaiting_callback else ""
        why = why or "no answer in time"
        match decide(STATUS_SIGNALS[status.state], facts):
            case Action.SUCCEED:
                reason = f"{why}; {status.why}"
                ended = await self.end(record, Stage.SUCCEEDED, reason, result=status.result_json)
                return Verdict("recovered result", None if ended else now + RACED_LOOK_MS)
            case Action.EXTEND:
                await self.conn.call("HINCRBY", self.conn.keys.record(record.id), "extensions", 1)
                return Verdict("extended", now + timeout_ms)
            case Action.FAIL:
                error = status.error or "the agent reported failure"
                ended = await self.end(record, Stage.FAILED, f"{why}; {status.why}", error=error)
                return Verdict("failed", None if ended else now + RACED_LOOK_MS)
            case Action.RETRY:
                reason = f"{why}; {status.why or status.state}"
                return await self._retry(record, envelope, reason, now)
            case Action.GIVE_UP:
                reason = f"{why}; {status.why or status.state}"
                error = f"gave up after {record.attempt} attempts: {reason}"
                ended = await self.end(record, Stage.DEAD, error, error=error)
                return Verdict("dead", None if ended else now + RACED_LOOK_MS)
        return await self._park(record, f"{why}; {status.why or status.state}", now)

    async def _park(self, record: MessageRecord, reason: str, now: int) -> Verdict:
        # Shielded, as an ending is: a reaper stopped between the two would leave the credit
        # held on the dead instance until another reaper's pass found it stale.
        with anyio.CancelScope(shield=True):
            moved = await self.store.apply(
                self.fenced(
                    record,
                    Stage.NEEDS_CONFIRMATION,
                    reason=f"{reason}; the agent is not idempotent: parked for an operator",
                )
            )
            if not moved.ok:  # it moved on meanwhile: look again soon
                return Verdict("raced", now + RACED_LOOK_MS)
            await self.release(record)
        return Verdict("needs confirmation", now + PARKED_RECHECK_MS)

    async def _callback_received(self, record: MessageRecord, now: int) -> Verdict:
        """An async agent's result is on the record, and its sidecar stopped before it
        finished the message: finish it here (the result is known, nothing runs again)."""
        stale = now - record.updated_ms >= self.delivery_timeout_ms
        if not (stale or self.instances.down(record.instance, now)):
            return Verdict("in time", record.updated_ms + self.delivery_timeout_ms)
        decide(Signal.LATE, Facts(stage=Stage.CALLBACK_RECEIVED))  # FINISH
        reason = "callback received; finished by the reaper (its sidecar stopped)"
        bill = self._callback_charge(record)
        if record.result is not None:
            ended = await self.end(record, Stage.SUCCEEDED, reason, result=record.result, bill=bill)
        else:
            error = record.error or "failed"
            ended = await self.end(record, Stage.FAILED, reason, error=error, bill=bill)
        return Verdict("finished callback", None if ended else now + RACED_LOOK_MS)

    def _callback_charge(self, record: MessageRecord) -> Charge | None:
        """The agent answered (its callback is on the record): the attempt is charged as its
        sidecar would have charged it, with the usage the agent reported and no busy time
        (unknown here). Nothing when the instance's card is gone: no agent to charge."""
        view = self.instances.view(record.instance)
        if view is None:
            return None
        envelope = load_envelope(record.envelope)
        outcome = callback_outcome(record)
        return callback_charge(view.card.agent_id, record.attempt, envelope, outcome, 0.0)

    async def _children_told(self, record: MessageRecord) -> None:
        """A broadcast waits on its children; the last one to end ends it. A child whose ender
        stopped before it told the parent (an operator's command killed midway, say) is told
        again here: a repeat changes nothing, and the parent's own telling follows."""
        raw = await self.conn.call("HGET", self.conn.keys.record(record.id), "children")
        children = [child for child, _ in decode_children(raw)] if raw else []
        if not children:
            return
        told = await self.conn.call("HMGET", self.conn.keys.outcomes(record.id), *children)
        untold = [child for child, outcome in zip(children, told, strict=True) if not outcome]
        for child in await self.store.get_records(untold):
            if child is not None and child.stage in TERMINAL:
                await self.store.delivery.deliver(
                    child.envelope, child.stage, child.result, child.error, attempt=child.attempt
                )

    async def _retry(
        self, record: MessageRecord, envelope: Envelope, reason: str, now: int
    ) -> Verdict:
        """Another attempt with the same idempotency key, after a back-off, elsewhere."""
        delay = retry_delay_ms(
            record.attempt,
            base_ms=self.settings.retry_backoff_ms,
            jitter=self.settings.retry_jitter,
            rng=self.rng,
        )
        moved = await self.store.apply(
            self.fenced(
                record,
                Stage.WAITING,
                reason=f"{reason}; retry in {delay} ms (idempotent agent)",
                fields={"avoid": record.instance, "retry_at_ms": now + delay},
                counts=(retry(record.capability, "processing_timeout"),),
            )
        )
        if not moved.ok:
            return Verdict("raced", now + RACED_LOOK_MS)
        await self.release(record)
        await self.store.waiting.park(
            envelope.capability, record.id, record.priority, record.accepted_ms
        )
        return Verdict("retried", max(now + delay, self.next_look(record, now)))

    # -- carrying it out ---------------------------------------------------------------------

    def next_look(self, record: MessageRecord, now: int) -> int:
        """After the reaper sent a message back to WAITING: soon enough to see it through
        (parked, routed, delivered), or at its deadline if that comes first."""
        return min(record.deadline_ms, now + self.delivery_timeout_ms)

    def fenced(self, record: MessageRecord, target: Stage, **options: Any) -> Move:
        """A move only from the stage, attempt and instance the reaper looked at; from
        PROCESSING, only while the sidecar's last write before a call is the one it looked
        at (``take_call``): a sidecar that since called the agent (a record it found never
        called, adapters/holdings.py) is not parked, or retried, under it."""
        return Move(
            record.id,
            target,
            only_from=record.stage,
            expect_attempt=record.attempt,
            expect_instance=record.instance,
            expect_field=self.call_fence(record),
            **options,
        )

    @staticmethod
    def call_fence(record: MessageRecord) -> tuple[str, str] | None:
        """From PROCESSING, a move is made only while the record's ``take_call`` is the one
        looked at."""
        return (TAKE_CALL, record.take_call) if record.stage is Stage.PROCESSING else None

    async def end(
        self,
        record: MessageRecord,
        stage: Stage,
        reason: str,
        *,
        result: bytes | None = None,
        error: str | None = None,
        bill: Charge | None = None,
    ) -> bool:
        """A terminal outcome: recorded (fenced), the credit returned, the producer told;
        with ``bill``, the attempt charged to its day (:func:`adapters.finisher.charged`)."""
        fields: dict[str, str | bytes | int] = {"reply_pending": 1}
        if result is not None:
            fields["result"] = result
        if error is not None or stage is Stage.EXPIRED:
            fields["error"] = error or reason
        # Shielded: a reaper being stopped (SIGTERM, a cancelled task group) finishes the write
        # and the telling together; only a kill in between leaves reply_pending to the next.
        with anyio.CancelScope(shield=True):
            options = charged({"reason": reason, "fields": fields, "charge": bill}, record.attempt)
            moved = await self.store.apply(self.fenced(record, stage, **options))
            if not moved.ok:
                return False
            await self.release(record)
            if stage is Stage.DEAD:  # dead-lettered before the producer hears of it
                await self.store.delivery.dead_letter_message(record.id, str(fields["error"]))
            await self.reply(record, stage, result, str(fields.get("error", reason)))
            await self.conn.call("HDEL", self.conn.keys.record(record.id), "reply_pending")
        return True

    async def unresolvable(self, record: MessageRecord, exc: Exception) -> Verdict:
        """End a message the reaper cannot resolve (an unreadable envelope, say) as DEAD with
        the error, from whatever stage it is in (fenced on that stage, attempt and
        instance, and from PROCESSING on its last call: :meth:`call_fence`): nothing is sent
        to the agent, the record's bytes go to the dead letters as they are, its producer is
        told on the reply stream the record names, and a credit it held on a dead instance
        is returned."""
        if record.stage in TERMINAL:
            return Verdict("forgotten", None)
        error = f"the reaper could not resolve it: {type(exc).__name__}: {exc}"
        moved = await self.store.apply(
            Move(
                record.id,
                Stage.DEAD,
                any_of=frozenset({record.stage}),
                expect_attempt=record.attempt,
                expect_instance=record.instance,
                expect_field=self.call_fence(record),
                reason=error,
                fields={"error": error},
            )
        )
        if not moved.ok:
            return Verdict("raced", now_ms() + RACED_LOOK_MS)
        letter = Letter(
            id=record.id, stage=Stage.DEAD.value, reason=error, raw=record.envelope, ts_ms=now_ms()
        )
        await self.store.delivery.dead_letter(letter)
        await self.release(record)
        if record.reply_to:
            entry = ReplyEntry(id=record.id, stage=Stage.DEAD, attempt=record.attempt, error=error)
            await self.store.delivery.send_reply(record.reply_to, entry)
        return Verdict("dead: unresolvable", None)

    async def finish_telling(self, record: MessageRecord) -> None:
        if record.stage is Stage.DEAD:
            await self.store.delivery.dead_letter_message(record.id, record.error or "dead")
        await self.reply(record, record.stage, record.result, record.error)
        await self.conn.call("HDEL", self.conn.keys.record(record.id), "reply_pending")

    async def reply(
        self, record: MessageRecord, stage: Stage, result: bytes | None, error: str | None
    ) -> None:
        await self.store.delivery.deliver(
            record.envelope, stage, result, error, attempt=record.attempt
        )

    async def release(self, record: MessageRecord) -> None:
        """Return the credit the abandoned attempt held on a dead instance, or whose entry
        the reaper acknowledged for its dead sidecar (``credit_taken_over``: the instance
        may live again since, its sidecar restarted without the entry). A live sidecar
        returns its own when it reads (and drops) or finishes the entry: taken back here, the
        instance could be handed more than its limit while its call still runs."""
        if not record.instance:
            return
        if record.credit_taken_over or self.instances.down(record.instance, now_ms()):
            member = f"{record.id}:{record.attempt}"
            await self.conn.call(*return_command(self.conn, record.instance, [member]))
