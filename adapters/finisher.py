"""The finisher: records each outcome, tells the producer, returns the credit.

Finished entries queue up and are settled together, in a round trip or a few however many
there are. A round of one outcome on one server (a light load) goes in one pipeline: the
outcome's move (compare-and-set, fenced on attempt and instance) and ``lua/finish.lua``, which
tells the producer if the outcome is on the record and returns the credit
(:mod:`broker.finishing`, :data:`ONE_TRIP_MAX`). Otherwise (a larger round, a cluster,
``replica_acks``, a broadcast child's outcome) in three: the outcomes recorded, then the
replies of those recorded, then the credits returned and the entries acknowledged
(``lua/release.lua``). Either way replies go before the acknowledgement, so a crash in between
sends a reply again, never skips one. (In one round trip, an outcome whose record moves on
between its move and the script — an operator's replay in that instant — is released untold:
the replay ends the message again, and that answer is told.) A reply Redis refuses for good is
dead-lettered before its credit goes; one refused "for now" (OOM, READONLY) is tried again.
An outcome that moves a message elsewhere (back to waiting, or dead) is written at once
(tried again while Redis is away: :meth:`Finisher.written`), then its entry let go of the
same way.

In three round trips, recording and releasing are two stages that overlap: the next outcomes
are recorded while the replies and credits of the last are on their way, so an outcome waits
for one round trip before it is on the record. A finished call whose outcome is not recorded
is what a crash repeats (the message is still PROCESSING); the intake reads no new work while
more than :data:`UNRECORDED_MAX` wait (:meth:`Finisher.room`), so under saturation that stays
bounded. (Holding back each call instead parked a worker per call: a pool grown to thousands,
for nothing.)
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from broker.connection import Connection
from broker.delivery import producer_commands
from broker.envelope import Envelope
from broker.errors import RedisReplyError, RedisUnavailable
from broker.records import Moved
from broker.results import Command
from broker.retry import retry_delay_ms
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore, Move
from broker.timekeeping import now_ms
from broker.usage import Charge, charged

from .dropping import drop_unusable
from .holdings import Finished, Holdings, Taken, release_of
from .one_trip import OneTrip, time_ended

log = logging.getLogger("agent_reach.sidecar")
T = TypeVar("T")

RETRY_PAUSE_S = 0.5
# pauses of an outcome written at once while Redis is away (Finisher.written)
WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S = 0.1, 1.0
# outcomes waiting to be recorded before the intake holds back new work (Finisher.room):
# what a crash repeats is the calls running then, and about this many more
UNRECORDED_MAX = 32
# Rounds of at most this many outcomes go in one round trip (where fits): at a light load a
# round is one outcome, and its three round trips were most of what finishing it cost. Under
# load the two overlapping stages record sooner: with every round in one trip, the crash
# bench repeated more (mean 29 -> 40 calls over 27 and 36 runs, p90 41 -> 68) for 7 % more
# throughput; with rounds of one alone, mean 35 and p90 61 over 18 (README, "Benchmarks").
ONE_TRIP_MAX = 1


class Wakeup:
    """An event that re-arms itself once waited for: a stage's "there is work"."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()


class Finisher:
    def __init__(
        self, conn: Connection, store: MessageStore, instance_id: str, holdings: Holdings
    ) -> None:
        self.conn = conn
        self.store = store
        self.instance_id = instance_id
        self.holdings = holdings
        self._one_trip = OneTrip(conn, store, instance_id)
        self._queued: list[Finished] = []  # outcomes not recorded yet
        self._ready = Wakeup()
        self._record_lock = anyio.Lock()
        self._written = anyio.Event()  # set after each recording round
        # recorded rounds whose replies and credits are still to go, with the ids of the
        # items whose outcome is on the record
        self._unreleased: list[tuple[list[Finished], set[int]]] = []
        self._recorded_ready = Wakeup()
        self._release_lock = anyio.Lock()
        self._rng = random.Random()
        # told when an entry is let go of (the callback desk forgets what it awaited)
        self.on_let_go: list[Callable[[Taken], None]] = []

    # -- queueing ----------------------------------------------------------------------------

    def done(self, taken: Taken, replies: list[Command] | None = None) -> None:
        """Queue the entry for the next release round trip (credit, ack, replies)."""
        self.queue(Finished(taken, replies or []))

    def queue(self, finished: Finished) -> None:
        self._queued.append(finished)
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    def settle(
        self,
        taken: Taken,
        envelope: Envelope,
        stage: Stage,
        reason: str,
        *,
        source: Stage = Stage.PROCESSING,
        result: bytes | None = None,
        error: str | None = None,
        counts: tuple[str, ...] = (),
        bill: Charge | None = None,
    ) -> None:
        """Queue ``stage`` (with its result or error, and ``counts`` counted and ``bill``
        charged with it) for the next finishing round trip."""
        fields: dict[str, str | bytes] = {}
        if result is not None:
            fields["result"] = result
        if error is not None:
            fields["error"] = error
        move = self.fenced(
            taken, stage, source, reason=reason, fields=fields, counts=counts, charge=bill
        )
        replies = self.replies(taken, envelope, stage, result, error) if stage in TERMINAL else []
        self.queue(Finished(taken, replies, move, envelope.capability, envelope))

    async def requeue(
        self,
        taken: Taken,
        envelope: Envelope,
        reason: str,
        *,
        back_off: bool,
        counts: tuple[str, ...] = (),
        bill: Charge | None = None,
    ) -> None:
        """Back to WAITING for another attempt, with the same idempotency key — elsewhere if
        another instance can take it, and after a back-off for a failure."""
        fields: dict[str, str | bytes | int] = {"avoid": self.instance_id}
        if back_off:
            settings = self.conn.settings
            delay = retry_delay_ms(
                taken.attempt,
                base_ms=settings.retry_backoff_ms,
                jitter=settings.retry_jitter,
                rng=self._rng,
            )
            fields["retry_at_ms"] = now_ms() + delay
            reason = f"{reason}; retry in {delay} ms"
        move = self.fenced(
            taken,
            Stage.WAITING,
            Stage.PROCESSING,
            reason=reason,
            fields=fields,
            return_field="accepted_ms",
            counts=counts,
            charge=bill,
        )
        moved = await self.written(lambda: self.store.apply(move), taken, "requeueing")
        if move.landed(moved):
            # ordered by when the broker accepted it, never by the producer's own clock
            accepted_ms = int(moved.value or 0) if moved.ok else await self._accepted_ms(taken)
            await self.written(
                lambda: self.store.waiting.park(
                    envelope.capability, envelope.message_id, envelope.priority, accepted_ms
                ),
                taken,
                "parking the requeued message",
            )
        self.done(taken)

    async def dead(
        self,
        taken: Taken,
        envelope: Envelope,
        error: str,
        counts: tuple[str, ...] = (),
        bill: Charge | None = None,
    ) -> None:
        """Out of attempts: DEAD, dead-lettered with the envelope and every reason on the way.

        The move carries ``reply_pending`` (as the reaper's endings do), cleared with the
        reply: the dead letter (an ``XADD``) is written once, never retried, and whatever
        is not done here — the letter failed, the stop's deadline came, or the move is found
        made without this try's answer (an earlier try's, or the reaper's: not told apart) —
        the reaper finishes from the record (:meth:`workers.resolver.Resolver.finish_telling`).
        Nothing is lettered or told twice for a retried write."""
        fields: dict[str, str | bytes | int] = {"error": error, "reply_pending": 1}
        move = self.fenced(
            taken,
            Stage.DEAD,
            Stage.PROCESSING,
            reason=error,
            fields=fields,
            counts=counts,
            charge=bill,
        )
        moved = await self.written(lambda: self.store.apply(move), taken, "ending it DEAD")
        if not moved.ok:
            if move.landed(moved):
                log.info("message %s: found DEAD: its telling is the reaper's", taken.message_id)
            self.done(taken)
            return
        try:
            await self.store.delivery.dead_letter_message(envelope.message_id, error)
        except RedisUnavailable as exc:
            log.warning(
                "message %s: dead letter not written (%s): the reaper writes it, and tells",
                taken.message_id,
                exc,
            )
            self.done(taken)
            return
        replies = self.replies(taken, envelope, Stage.DEAD, None, error)
        told = ("HDEL", self.conn.keys.record(taken.message_id), "reply_pending")
        self.done(taken, [*replies, told])

    async def written(self, write: Callable[[], Awaitable[T]], taken: Taken, what: str) -> T:
        """``write``, tried again while Redis is away (0.1 s doubling to 1 s) until it is made:
        an outcome written at once (a requeue, a retry, DEAD) is kept, not left pending for a
        resumption that no longer knows it (a non-idempotent agent's refusal would be parked
        as "may have run"). Only for writes that may be repeated: a fenced move (an answer
        lost on the way: :meth:`broker.store.Move.landed`), a park, a read. A stop's deadline
        cancels the wait; the entry then stays pending for the reaper. Each try is bounded
        by the connection's own timeouts."""
        pause_s = WRITE_RETRY_FIRST_S
        while True:
            try:
                made = await write()
                if pause_s > WRITE_RETRY_FIRST_S:
                    log.info("message %s: %s: done, Redis is back", taken.message_id, what)
                return made
            except RedisUnavailable as exc:
                if pause_s == WRITE_RETRY_FIRST_S:
                    log.warning(
                        "message %s: %s: Redis is unavailable (%s); trying again",
                        taken.message_id,
                        what,
                        exc,
                    )
            await anyio.sleep(pause_s)
            pause_s = min(pause_s * 2, WRITE_RETRY_MAX_S)

    async def _accepted_ms(self, taken: Taken) -> int:
        """When the broker accepted the message, read back: a requeue whose answer was lost
        returned none."""
        record = await self.written(
            lambda: self.store.get_record(taken.message_id), taken, "reading its record"
        )
        return record.accepted_ms if record is not None else 0

    def fenced(self, taken: Taken, target: Stage, source: Stage, **options: Any) -> Move:
        """A move allowed only from ``source``, at this entry's attempt, on this instance:
        the fence that keeps a stale delivery from ever acting on the record. A charge puts
        what it says on the record (:func:`charged`)."""
        options = charged(options, taken.attempt)
        return Move(
            taken.message_id,
            target,
            only_from=source,
            expect_attempt=taken.attempt,
            expect_instance=self.instance_id,
            **options,
        )

    def replies(
        self,
        taken: Taken,
        envelope: Envelope,
        stage: Stage,
        result: bytes | None,
        error: str | None,
    ) -> list[Command]:
        """The commands that tell the producer (:mod:`broker.results`)."""
        return producer_commands(
            self.store.conn, envelope, stage, result, error, attempt=taken.attempt
        )

    # -- settling ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Two stages, each a round trip or two behind the other: outcomes are recorded as
        soon as they are queued, while the replies and credits of those recorded before
        are still on their way. What a crash repeats is what was not recorded yet."""
        async with anyio.create_task_group() as stages:
            stages.start_soon(self._recording)
            stages.start_soon(self._releasing)

    async def _recording(self) -> None:
        await self._stage(self._ready, self.record_now, "recording outcomes")

    async def _releasing(self) -> None:
        await self._stage(self._recorded_ready, self.release_now, "release")

    @staticmethod
    async def _stage(wakeup: Wakeup, step: Callable[[], Awaitable[None]], what: str) -> None:
        while True:
            await wakeup.wait()
            try:
                await step()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("%s failed, retrying: %s", what, exc)
                await anyio.sleep(RETRY_PAUSE_S)
                wakeup.set()

    async def finish_now(self) -> None:
        """Settle every queued entry: record the outcomes, deliver the replies of those
        recorded, then return the credits and acknowledge."""
        await self.record_now()
        await self.release_now()

    @property
    def crowded(self) -> bool:
        """Whether more than :data:`UNRECORDED_MAX` outcomes wait to be recorded."""
        return len(self._queued) > UNRECORDED_MAX

    async def room(self) -> None:
        """Wait while the outcomes waiting to be recorded are too many (:attr:`crowded`):
        work taken now would add to what a crash repeats."""
        while self.crowded:
            await self._written.wait()

    async def record_now(self) -> None:
        """Record every queued outcome (one round trip); its replies and credit follow — in
        the same round trip for a round of one outcome on one server (:data:`ONE_TRIP_MAX`,
        :mod:`adapters.one_trip`), else in the releasing stage (:mod:`adapters.dropping`:
        where Redis cannot move the record, dead-lettered and released instead)."""
        async with self._record_lock:
            batch, self._queued = self._queued, []
            if not batch:
                return
            again: list[Finished] = []
            problem: Exception | None = None
            one_trip = len(batch) <= ONE_TRIP_MAX and self._one_trip.fits(batch)
            try:
                if one_trip:
                    again, problem = await self._one_trip.finish(batch)
                else:
                    # awaited first: the releasing stage swaps the list while this is out
                    recorded = await self._record(batch)
                    self._unreleased.append(recorded)
                    self._recorded_ready.set()
            except Exception:
                # anything that stopped the round trip: the batch is recorded again next time
                self._queued = batch + self._queued
                raise
            self._queued = again + self._queued
            self._written.set()
            self._written = anyio.Event()
        if not one_trip:
            return  # the releasing stage lets go of them
        held = {id(item) for item in again}
        for item in batch:
            if id(item) not in held:
                self._let_go(item)
        if problem is not None:
            raise problem  # the stage waits a moment, then tries what is held again
        if again:
            self._ready.set()  # entries the script did not reach: the next round, at once

    async def release_now(self) -> None:
        """Deliver the replies of the recorded outcomes, then return their credits and
        acknowledge their entries (replies first: a crash in between repeats a reply)."""
        async with self._release_lock:
            rounds, self._unreleased = self._unreleased, []
            if not rounds:
                return
            batch = [item for items, _ in rounds for item in items]
            recorded = {i for _, ids in rounds for i in ids}
            try:
                await self._tell(batch, recorded)
                await self.conn.call(*release_of(self.conn, self.instance_id, batch))
            except Exception:
                self._unreleased = rounds + self._unreleased
                raise
        for item in batch:
            self._let_go(item)

    def _let_go(self, item: Finished) -> None:
        self.holdings.let_go(item.taken)
        for listener in self.on_let_go:
            listener(item.taken)

    async def _record(self, batch: list[Finished]) -> tuple[list[Finished], set[int]]:
        """Write the outcomes. Returns the items to tell and release, and the ids of those
        whose outcome is on the record; one whose record Redis could not move is let go of
        here, dead-lettered and released (:func:`~adapters.dropping.drop_unusable`)."""
        settles = [item for item in batch if item.settle is not None]
        answers = await self.store.try_moves([item.settle for item in settles if item.settle])
        dropped = await drop_unusable(
            self.conn,
            self.instance_id,
            [item.taken for item in settles],
            answers,
            settles,
        )
        done = [(item, a) for item, a in zip(settles, answers, strict=True) if isinstance(a, Moved)]
        time_ended(done)
        for item in batch:
            if item.taken.entry_id in dropped:
                self._let_go(item)
        kept = [item for item in batch if item.taken.entry_id not in dropped]
        return kept, {id(item) for item, m in done if self._recorded(item, m)}

    async def _tell(self, batch: list[Finished], recorded: set[int]) -> None:
        replying = [
            (item.taken.message_id, command)
            for item in batch
            if item.settle is None or id(item) in recorded
            for command in item.replies
        ]
        commands = [command for _, command in replying]
        replies = await self.conn.call_many(commands)
        await self.store.delivery.after_delivery([m for m, _ in replying], commands, replies)

    def _recorded(self, item: Finished, moved: Moved) -> bool:
        """The outcome is on the record: written now, or by an earlier try of this batch."""
        assert item.settle is not None
        return item.settle.landed(moved)
