"""The runner: one message through the agent, and what its outcome decides.

It writes PROCESSING (write-ahead) before the request leaves, calls the transport, measures
the call (the vitals: health, latency, the credit limit), and asks the recovery policy
(:mod:`broker.recovery`) what the outcome means — then carries that out through the finisher
and the callback desk. A message found again after a restart (or an error) is resumed from
its record's stage. Any error while handling a message is kept to that message: it is taken
again a few times, then given up on (:meth:`Runner.guarded`), so one message never keeps a
sidecar busy for ever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from broker import metric_fields, process_metrics, tracing
from broker.connection import Connection
from broker.deadletters import Letter
from broker.delivery import count_commands, dead_letter_commands
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisUnavailable
from broker.process_metrics import since_ms
from broker.records import InstanceCard, MessageRecord, Moved
from broker.recovery import STATUS_SIGNALS, Action, Facts, Signal, decide
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from broker.timeline import note_command
from broker.usage import Charge, charge, usage_in_result

from .callback_desk import CallbackDesk, callback_outcome
from .finisher import Finisher
from .holdings import Holdings, Taken
from .outcome import (
    Accepted,
    Ambiguous,
    Backoff,
    Failed,
    NeedsInput,
    NotReached,
    Outcome,
    Succeeded,
    held_to_depth,
)
from .status import StatusClient
from .transport import Transport
from .vitals import Vitals
from .write_ahead import processing_move

log = logging.getLogger("agent_reach.sidecar")

# An entry whose handling raised this many times in a row is let go of (see give_up).
MAX_INTERNAL_ERRORS = 3
SIDECAR_ERROR = "SIDECAR_ERROR"
# an entry taken again from this instance's pending list: after a restart, or a try that
# failed inside the sidecar
RESUMED = "resumed from this instance's pending entries"
RESTARTED = "sidecar restarted while the agent was processing"
NEVER_CALLED = "PROCESSING written by a round trip left unanswered: the agent was never called"


_CALL: dict[type, str] = {  # the outcome label of agent_reach_agent_calls_total
    Succeeded: "succeeded",
    Failed: "failed",
    NotReached: "not_reached",
    Ambiguous: "ambiguous",
    Backoff: "back_pressure",
    Accepted: "accepted",
    NeedsInput: "needs_input",
}
# whether a call counts as succeeded, failed or neither (broker.usage.charge)
_ANSWERED: dict[type, bool] = {Succeeded: True, Failed: False, Ambiguous: False}
_STAGE_AFTER: dict[Action, Stage] = {  # what an attempt's trace span says it ended as
    Action.SUCCEED: Stage.SUCCEEDED,
    Action.FAIL: Stage.FAILED,
    Action.REQUEUE: Stage.WAITING,
    Action.RETRY: Stage.WAITING,
    Action.PARK: Stage.NEEDS_CONFIRMATION,
    Action.GIVE_UP: Stage.DEAD,
}
_SIGNALS: dict[type, Signal] = {
    Succeeded: Signal.SUCCEEDED,
    Failed: Signal.FAILED,
    NotReached: Signal.NOT_REACHED,
    Ambiguous: Signal.AMBIGUOUS,
    Backoff: Signal.BACKPRESSURE,
    Accepted: Signal.ACCEPTED,
    NeedsInput: Signal.NEEDS_INPUT,
}


class Runner:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        card: InstanceCard,
        transport: Transport,
        *,
        holdings: Holdings,
        finisher: Finisher,
        vitals: Vitals,
        desk: CallbackDesk | None,
        on_health_change: Callable[[], None],
    ) -> None:
        self.conn = conn
        self.store = store
        self.card = card
        self.transport = transport
        self.holdings = holdings
        self.finisher = finisher
        self.vitals = vitals
        self.desk = desk
        self.on_health_change = on_health_change
        self.status = StatusClient(max_answer_bytes=conn.settings.max_result_bytes)
        # calls to the agent now running: entry id -> start (time.perf_counter: the loop's
        # clock is milliseconds on uvloop); and those already counted as overdue by the
        # credit limit
        self.calls: dict[str, float] = {}
        self.overdue_counted: set[str] = set()

    # -- guarding ----------------------------------------------------------------------------

    async def guarded(self, taken: Taken, step: Callable[[], Awaitable[None]]) -> None:
        try:
            await step()
        except RedisUnavailable as exc:
            # The entry stays pending; the record's stage says where to resume, and the
            # consume loop takes it again from the pending list.
            log.warning("message %s: redis unavailable, left pending: %s", taken.message_id, exc)
            self._slip(taken)
        except Exception as exc:
            # Never let one message take the sidecar down. It stays pending and is taken
            # again — a few times, in case it was passing; then it is let go of.
            if self.holdings.failed(taken) < MAX_INTERNAL_ERRORS:
                log.exception("message %s: unexpected error, left pending", taken.message_id)
                self._slip(taken)
            else:
                log.exception("message %s: unexpected error, giving up on it", taken.message_id)
                await self.give_up(taken, exc)
        finally:
            self.finisher.wake()

    def _slip(self, taken: Taken) -> None:
        self.holdings.slip(taken)
        if self.desk is not None:
            self.desk.forget(taken)

    async def give_up(self, taken: Taken, exc: Exception) -> None:
        """Let go of an entry that failed inside this sidecar ``MAX_INTERNAL_ERRORS`` times:
        its credit returned and the entry acknowledged, the error on the message's timeline
        and in the dead letters. The record is left as it stands, to the reaper, which
        resolves it by its stage when its time comes — rerouted if the agent was never
        asked; asked, retried only if idempotent, or parked, if it may have been."""
        instance = self.card.instance_id
        error = f"sidecar {instance} gave up on it: {type(exc).__name__}: {exc}"
        queue = self.conn.keys.queue(instance)
        letter = Letter(
            id=taken.message_id,
            reason="sidecar_error",
            error=error,
            ts_ms=now_ms(),
            source=f"{queue} {taken.entry_id}",
        )
        try:
            await self.store.conn.run_all(
                [
                    note_command(
                        self.conn, taken.message_id, SIDECAR_ERROR, error, now_ms=now_ms()
                    ),
                    *dead_letter_commands(self.store.conn, letter),
                ]
            )
        except Exception:  # the entry is let go of whatever: the reaper still sees the record
            log.exception("message %s: could not record the sidecar error", taken.message_id)
        if self.desk is not None:
            self.desk.forget(taken)
        self.finisher.done(taken)

    # -- fresh and resumed work --------------------------------------------------------------

    async def run_stored(self, taken: Taken, stored: bytes, accepted_ms: int) -> None:
        """A fresh entry whose PROCESSING is written: call the agent."""
        envelope = load_envelope(stored)
        process_metrics.queue_wait(envelope.capability, since_ms(accepted_ms, now_ms()))
        await self.call_agent(taken, envelope)

    async def resume(self, taken: Taken, moved: Moved) -> None:
        """The entry did not find its record ROUTED here: a restart, or a stale delivery."""
        instance = self.card.instance_id
        if moved.missing or moved.attempt != taken.attempt or moved.instance != instance:
            log.info(
                "message %s attempt %d is stale here: dropped, not executed",
                taken.message_id,
                taken.attempt,
            )
            self.finisher.done(taken)
            return
        record = await self.store.get_record(taken.message_id)
        if record is None:
            self.finisher.done(taken)
            return
        await self._resume_at(taken, record, load_envelope(record.envelope))

    async def _resume_at(self, taken: Taken, record: MessageRecord, envelope: Envelope) -> None:
        stage = record.stage
        if stage is Stage.RECEIVED:
            await self.execute(taken, envelope, Stage.RECEIVED, RESUMED)
        elif stage is Stage.CALLBACK_RECEIVED and self.desk is not None:
            self.desk.finish(taken, envelope, callback_outcome(record))
        elif stage is Stage.PROCESSING:
            await self._restarted(taken, envelope, record)
        elif stage in TERMINAL:
            replies = self.finisher.replies(taken, envelope, stage, record.result, record.error)
            self.finisher.done(taken, replies)
        else:
            if stage is Stage.WAITING:  # sent back, maybe not yet indexed: index it
                await self.store.waiting.park(
                    record.capability, record.id, record.priority, record.accepted_ms
                )
            self.finisher.done(taken)

    async def _restarted(self, taken: Taken, envelope: Envelope, record: MessageRecord) -> None:
        """The agent may have had the message when this sidecar stopped (or an error stopped
        it) — unless this very process wrote the PROCESSING and never heard back."""
        facts = self.facts(
            taken,
            envelope,
            awaiting_callback=record.awaiting_callback,
            never_called=self.holdings.never_called(record.take_call, taken),
        )
        match decide(Signal.RESTARTED, facts):
            case Action.CALL:
                log.info("message %s attempt %d: %s", taken.message_id, taken.attempt, NEVER_CALLED)
                await self.execute(
                    taken, envelope, Stage.PROCESSING, NEVER_CALLED, last_call=record.take_call
                )
            case Action.AWAIT_CALLBACK if self.desk is not None:
                self.desk.resume_awaiting(taken)  # its callback is to come
            case Action.ASK_STATUS:
                # the agent may have finished meanwhile: ask before re-running or parking
                await self.record(taken, envelope, Ambiguous(RESTARTED))
            case Action.RUN_AGAIN:
                reason = f"{RESUMED}; agent is idempotent, same idempotency key"
                await self.execute(
                    taken, envelope, Stage.PROCESSING, reason, last_call=record.take_call
                )
            case _:
                reason = f"{RESTARTED}; agent is not idempotent"
                self.finisher.settle(taken, envelope, Stage.NEEDS_CONFIRMATION, reason)

    async def execute(
        self,
        taken: Taken,
        envelope: Envelope,
        source: Stage,
        reason: str,
        *,
        last_call: str | None = None,
    ) -> None:
        """PROCESSING (from ``source``), written with its round trip's token, then the call.
        From PROCESSING fenced on ``last_call`` too, the token the record held when this was
        decided: a write given up on that lands later cannot relabel a record since called."""
        token = self.holdings.call_token()
        move = processing_move(
            self.finisher.fenced, taken, source, token=token, reason=reason, last_call=last_call
        )
        try:
            processing = await self.store.apply(move)
        except BaseException:
            self.holdings.unanswered_call(token)  # the move may be made; no call was
            raise
        here = (Stage.PROCESSING, taken.attempt, self.card.instance_id)
        if not processing.ok and last_call is not None and processing.key == here:
            self._slip(taken)  # another token landed meanwhile: found, and decided, again
        elif not processing.ok:
            self.finisher.done(taken)  # someone else owns it now
        else:
            if last_call is not None:
                self.holdings.calling_again(taken)
            await self.call_agent(taken, envelope)

    # -- the call ------------------------------------------------------------------------------

    async def call_agent(self, taken: Taken, envelope: Envelope) -> None:
        with tracing.processing(envelope, self.card.instance_id, taken.attempt) as span:
            started = self.calls[taken.entry_id] = time.perf_counter()
            try:
                with span.calling(envelope, self.card.agent_id) as carrying_the_call:
                    outcome = await self._deliver(taken, carrying_the_call)
            finally:
                del self.calls[taken.entry_id]
                self.overdue_counted.discard(taken.entry_id)
            action = await self._after_call(taken, envelope, outcome, started)
            span.ended(
                _STAGE_AFTER.get(action, Stage.PROCESSING).value, getattr(outcome, "reason", None)
            )

    async def _after_call(
        self, taken: Taken, envelope: Envelope, outcome: Outcome, started: float
    ) -> Action:
        latency_ms = (time.perf_counter() - started) * 1000
        process_metrics.agent_call(self.card.agent_id, envelope.capability, latency_ms / 1000)
        if self.vitals.record(outcome, latency_ms=latency_ms, now_ms=now_ms()):
            self.on_health_change()  # the circuit or cooldown changed: tell the dispatchers
        call = metric_fields.agent_call(
            self.card.agent_id, envelope.capability, _CALL[type(outcome)]
        )
        bill = self._charge(taken, envelope, outcome, latency_ms)
        return await self.record(taken, envelope, outcome, counts=(call,), bill=bill)

    def _charge(
        self, taken: Taken, envelope: Envelope, outcome: Outcome, busy_ms: float
    ) -> Charge | None:
        """What this call is charged (:mod:`broker.usage`); an accepted call is charged when
        its callback settles it."""
        if isinstance(outcome, Accepted):
            return None
        usage = getattr(outcome, "usage", None)
        if usage is None and isinstance(outcome, Succeeded):
            usage = usage_in_result(outcome.result)
        return charge(
            self.card.agent_id,
            envelope.capability,
            envelope.tenant,
            attempt=taken.attempt,
            answered=_ANSWERED.get(type(outcome)),
            busy_ms=busy_ms,
            usage=usage,
            ms=now_ms(),
        )

    async def _deliver(self, taken: Taken, envelope: Envelope) -> Outcome:
        """The transport's outcome; a transport that raises instead of answering is a
        failure with its reason — never an error that leaves the entry to be run again."""
        try:
            return held_to_depth(await self.transport.deliver(envelope, taken.attempt))
        except Exception as exc:
            log.exception("message %s: the transport raised", taken.message_id)
            return Failed(f"the sidecar's transport raised {type(exc).__name__}: {exc}", False)

    def overdue(self) -> bool:
        """Count the calls running past twice the agent's normal latency (the credit limit
        sees a slowdown before its first slow answer). Whether the limit changed."""
        now = time.perf_counter()
        running = [(e, now - t) for e, t in self.calls.items() if e not in self.overdue_counted]
        if not running:
            return False
        before = self.vitals.effective_credits
        counted = self.vitals.overdue([age * 1000 for _, age in running])
        self.overdue_counted.update(e for (e, _), c in zip(running, counted, strict=True) if c)
        return self.vitals.effective_credits != before

    # -- what the outcome decides ------------------------------------------------------------

    def facts(self, taken: Taken, envelope: Envelope, **more: bool) -> Facts:
        return Facts(
            stage=Stage.PROCESSING,
            idempotent=self.card.idempotent,
            attempts_left=taken.attempt < envelope.max_attempts,
            status_endpoint=bool(self.card.status_url),
            **more,
        )

    async def record(
        self,
        taken: Taken,
        envelope: Envelope,
        outcome: Outcome,
        signal: Signal | None = None,
        counts: tuple[str, ...] = (),
        bill: Charge | None = None,
    ) -> Action:
        """Carry out what the recovery policy says ``outcome`` means (``signal``: what it
        stands for, when it came from a status answer), counting ``counts`` with the move
        that records it; the action carried out."""
        asked = signal is not None
        signal = signal or _SIGNALS[type(outcome)]
        action = decide(signal, self.facts(taken, envelope, status_asked=asked))
        reason = getattr(outcome, "reason", "")
        match action:
            case Action.ASK_STATUS:
                return await self._ask_status(taken, envelope, reason, counts, bill)
            case Action.AWAIT_CALLBACK if isinstance(outcome, Accepted) and self.desk:
                await self.desk.await_callback(taken, outcome.task_id)
                await self.conn.run_all(count_commands(self.conn, *counts))
            case Action.SUCCEED if isinstance(outcome, Succeeded):
                self.finisher.settle(
                    taken,
                    envelope,
                    Stage.SUCCEEDED,
                    "",
                    result=outcome.result,
                    counts=counts,
                    bill=bill,
                )
            case Action.FAIL:
                self.finisher.settle(
                    taken, envelope, Stage.FAILED, reason, error=reason, counts=counts, bill=bill
                )
            case Action.REQUEUE | Action.RETRY:  # a requeue did not take the work: no back-off
                retry = (*counts, metric_fields.retry(envelope.capability, signal.name.lower()))
                await self.finisher.requeue(
                    taken,
                    envelope,
                    reason,
                    back_off=action is Action.RETRY,
                    counts=retry,
                    bill=bill,
                )
            case Action.PARK:
                self.finisher.settle(
                    taken, envelope, Stage.NEEDS_CONFIRMATION, reason, counts=counts, bill=bill
                )
            case Action.GIVE_UP:  # out of attempts
                error = f"gave up after {taken.attempt} attempts: {reason}"
                await self.finisher.dead(taken, envelope, error, counts, bill)
            case _:  # a defect: counted against the entry like any other (guarded)
                raise RuntimeError(f"{action} for {type(outcome).__name__}: not for a sidecar")
        return action

    async def _ask_status(
        self,
        taken: Taken,
        envelope: Envelope,
        reason: str,
        counts: tuple[str, ...],
        bill: Charge | None,
    ) -> Action:
        """No answer in time: before guessing, ask the agent what became of the message."""
        status = await self.status.query(self.card.status_url, taken.message_id)
        why = f"{reason}; {status.why}"
        signal = STATUS_SIGNALS[status.state]
        outcome: Outcome
        if signal is Signal.STATUS_DONE:
            outcome = Succeeded(status.result_json)
        elif signal is Signal.STATUS_FAILED and not (
            self.card.idempotent and taken.attempt < envelope.max_attempts
        ):
            outcome = Failed(status.error or why)
        else:
            outcome = Ambiguous(why)
        return await self.record(taken, envelope, outcome, signal, counts, bill)
