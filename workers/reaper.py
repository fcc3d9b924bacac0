"""The reaper owns time: it finds messages whose next deadline has come and resolves them by
their stage, never running a non-idempotent action twice.

Every live message has an entry in ``P:due`` (message id -> next time to look at it). Any
number of reapers share it: ``claim_due.lua`` leases a batch to one of them at a time. What
each stage gets when its time comes:

- WAITING past its deadline: EXPIRED (``waited_past_deadline``, or why nothing could serve
  it), the producer told.
- ACCEPTED for longer than the delivery timeout (its dispatcher died before routing it):
  WAITING, parked.
- ROUTED or RECEIVED — the agent has not been contacted — past the delivery timeout, or on an
  instance that is down: back to WAITING for another instance (the stale stream entry is
  dropped by fencing if its sidecar ever reads it), or EXPIRED past the message's deadline.
- PROCESSING past the call timeout (plus grace), or on an instance that is down: the agent's
  status endpoint is asked first. ``done`` records the result; ``running`` lets it run on
  (a bounded number of times); ``failed`` is FAILED (retried only for an idempotent agent
  with attempts left); ``unknown`` retries an idempotent agent with the same idempotency key
  and parks anything else as NEEDS_CONFIRMATION. A message past its own deadline in
  PROCESSING is never EXPIRED — its producer is told the deadline passed.
- PROCESSING awaiting an async agent's callback (it answered 202): the same, past
  ``callback_timeout_s``. A callback that comes later, while the message is not terminal, is
  still taken (also from NEEDS_CONFIRMATION).
- CALLBACK_RECEIVED whose sidecar stopped before finishing it: ended with the recorded result.
- FANNED_OUT (a broadcast waiting on its children) is looked at every delivery timeout.
- NEEDS_CONFIRMATION stays visible (and in ``P:due``) until an operator resolves it.

Retries back off (``broker/retry.py``), avoid the instance that failed, and stop at the
envelope's ``max_attempts``: DEAD, dead-lettered with the chain of reasons.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskStatus

from adapters.status import StatusClient
from broker.broadcast import decode_children
from broker.connection import Connection
from broker.deadletters import Letter
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import SIDECAR_GROUP
from broker.records import InstanceView, MessageRecord
from broker.registry import Registry
from broker.retry import retry_delay_ms
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore, Move, now_ms
from broker.streams import parse_entries
from broker.wire import ReplyEntry

from .janitor import Janitor
from .routing_table import RoutingTable, routing_policy
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.reaper")

LEASE_MS = 30_000
CLAIM_BATCH = 200
RESOLVE_CONCURRENCY = 32  # with 3 s status queries, a batch of 200 ends well inside its lease
MAX_EXTENSIONS = 5  # "running" answers before the reaper treats the agent as not knowing
PARKED_RECHECK_MS = 3_600_000
MAX_JUDGE_ERRORS = 3  # unexpected errors resolving one message before it is ended DEAD
JUDGE_ERROR_RETRY_MS = 2_000
_AGENT_NOT_ASKED = (Stage.ROUTED, Stage.RECEIVED)
_HOLDS_CREDIT = (Stage.ROUTED, Stage.RECEIVED, Stage.PROCESSING, Stage.CALLBACK_RECEIVED)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the reaper did with one message, and when to look at it again (None: never)."""

    action: str
    next_due_ms: int | None


class Reaper:
    def __init__(self, conn: Connection, *, status: StatusClient | None = None) -> None:
        self.conn = conn
        self.settings = conn.settings
        self.store = MessageStore(conn)
        self.registry = Registry(conn)
        self.table = RoutingTable(routing_policy(conn.settings))
        self.waiting = WaitingRoom(self.store, self.table, batch=conn.settings.dispatch_batch)
        self.status = status or StatusClient(timeout_s=3.0)
        self.views: dict[str, InstanceView] = {}
        self.rng = random.Random()
        self.delivery_timeout_ms = int(conn.settings.delivery_timeout_s * 1000)
        self.processing_timeout_ms = int(
            (conn.settings.sync_call_timeout_s + conn.settings.processing_grace_s) * 1000
        )
        self.callback_timeout_ms = int(conn.settings.callback_timeout_s * 1000)
        self.handled: dict[str, int] = {}  # action -> count, over this reaper's life
        self._limit = anyio.CapacityLimiter(RESOLVE_CONCURRENCY)
        self._errors: dict[str, int] = {}  # message id -> unexpected errors resolving it
        self.janitor = Janitor(conn, self.store)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                try:
                    await self.tick()
                except (RedisUnavailable, RedisReplyError) as exc:
                    log.warning("reaper tick failed (the next one retries): %s", exc)
                await anyio.sleep(self.settings.sweep_interval_s)
        finally:
            with anyio.CancelScope(shield=True):
                await self.status.aclose()

    async def tick(self) -> int:
        """One pass: refresh the registry, take over the work of dead instances, resolve what
        is due. Returns how many messages were looked at."""
        await self.refresh()
        total = await self.dead_instances(now_ms())
        while True:
            now = now_ms()
            ids = await self.store.claim_due(now, LEASE_MS, CLAIM_BATCH)
            total += len(ids)
            if ids:
                verdicts = await self._judge_all(ids, now)
                await self.store.reschedule_due(now + LEASE_MS, verdicts)
            if len(ids) < CLAIM_BATCH:
                break
        await self._sweep(now_ms())
        return total

    async def _sweep(self, now: int) -> None:
        try:
            await self.janitor.step(now)
        except RedisUnavailable:
            raise
        except Exception:  # the sweep is housekeeping: it must never stop the reaping
            log.exception("janitor step failed (the next tick goes on)")

    async def _judge_all(self, ids: list[str], now: int) -> list[tuple[str, int | None]]:
        """Resolve a leased batch concurrently: a slow status endpoint must not hold the rest
        past their lease. Returns each message's next look (``None``: forget it)."""
        verdicts: list[tuple[str, int | None]] = []
        records = await self.store.get_records(ids)
        async with anyio.create_task_group() as tg:
            for message_id, record in zip(ids, records, strict=True):
                tg.start_soon(self._judge, message_id, record, now, verdicts)
        return verdicts

    async def _judge(
        self,
        message_id: str,
        record: MessageRecord | None,
        now: int,
        verdicts: list[tuple[str, int | None]],
    ) -> None:
        async with self._limit:
            verdict = await self.resolve_guarded(message_id, record, now)
        self.handled[verdict.action] = self.handled.get(verdict.action, 0) + 1
        verdicts.append((message_id, verdict.next_due_ms))

    async def resolve_guarded(
        self, message_id: str, record: MessageRecord | None, now: int
    ) -> Verdict:
        """:meth:`resolve`, with one message's defect kept to that message: the others of the
        batch are resolved all the same. A message that fails ``MAX_JUDGE_ERRORS`` times in
        a row is ended DEAD with the error (dead-lettered, visible) rather than looked at for
        ever."""
        try:
            verdict = await self.resolve(message_id, record, now)
        except RedisUnavailable:
            raise
        except Exception as exc:
            log.exception("message %s: could not be resolved", message_id)
            failures = self._errors[message_id] = self._errors.get(message_id, 0) + 1
            if failures >= MAX_JUDGE_ERRORS and record is not None:
                del self._errors[message_id]
                return await self._unresolvable(record, exc)
            return Verdict("error", now + JUDGE_ERROR_RETRY_MS)
        self._errors.pop(message_id, None)
        return verdict

    async def _unresolvable(self, record: MessageRecord, exc: Exception) -> Verdict:
        """End a message the reaper cannot resolve (an unreadable envelope, say) as DEAD with
        the error, from whatever stage it is in (fenced on that stage, attempt and
        instance): nothing is sent to the agent, the record's bytes go to the dead letters
        as they are, its producer is told on the reply stream the record names, and a credit
        it held on a dead instance is returned."""
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
                reason=error,
                fields={"error": error},
            )
        )
        if not moved.ok:
            return Verdict("raced", now_ms() + 1_000)
        letter = Letter(
            id=record.id, stage=Stage.DEAD.value, reason=error, raw=record.envelope, ts_ms=now_ms()
        )
        await self.store.dead_letter(letter)
        await self._release(record)
        if record.reply_to:
            entry = ReplyEntry(id=record.id, stage=Stage.DEAD, attempt=record.attempt, error=error)
            await self.store.send_reply(record.reply_to, entry)
        return Verdict("dead: unresolvable", None)

    async def dead_instances(self, now: int) -> int:
        """The work of instances that are down, at once (not at its delivery timeout): every
        credit they hold names a message attempt, resolved through the record's stage; then
        their stream's pending entries are claimed (``XAUTOCLAIM``) and acknowledged, each
        resolved the same way first."""
        total = 0
        for instance_id in [i for i in self.views if self.instance_down(i, now)]:
            raw = await self.conn.call("SMEMBERS", self.conn.keys.inflight(instance_id))
            members = {m.decode() for m in raw}
            ids = sorted({m.rpartition(":")[0] for m in members})
            total += await self._resolve_now(ids, instance_id, now, members)
            total += await self._claim_pending(instance_id, now)
        return total

    async def _resolve_now(
        self, ids: list[str], instance_id: str, now: int, members: set[str] | None = None
    ) -> int:
        if not ids:
            return 0
        commands: list[tuple[Any, ...]] = []
        for message_id, record in zip(ids, await self.store.get_records(ids), strict=True):
            leaked = _stale_credits(message_id, record, instance_id, members or set())
            if leaked:
                commands.append(("SREM", self.conn.keys.inflight(instance_id), *leaked))
            if record is None or record.instance != instance_id:
                continue
            if record.stage in _AGENT_NOT_ASKED:
                verdict = await self.resolve_guarded(message_id, record, now)
                self.handled[verdict.action] = self.handled.get(verdict.action, 0) + 1
                if verdict.next_due_ms is not None:
                    commands.append(self.store.due_command(message_id, verdict.next_due_ms))
            elif record.stage in (Stage.PROCESSING, Stage.CALLBACK_RECEIVED):
                # due now: this tick's claim asks the agent (or finishes a received callback)
                commands.append(self.store.due_at_most_command(message_id, now))
            elif record.stage in TERMINAL:
                # finished, but the sidecar died before it returned the credit — and maybe
                # before the reply left: send it (at least once; it carries the id)
                await self._release(record)
                await self._retell(record)
        await self.store.run_all(commands)
        return len(ids)

    async def _retell(self, record: MessageRecord) -> None:
        try:
            await self._reply(record, record.stage, record.result, record.error)
        except RedisUnavailable:
            raise
        except Exception:  # one unreadable record must not stop the take-over of the rest
            log.exception("message %s: its ending could not be told again", record.id)

    async def _claim_pending(self, instance_id: str, now: int) -> int:
        """Entries a dead sidecar read and never acknowledged: claim, resolve, acknowledge."""
        queue = self.conn.keys.queue(instance_id)
        idle_ms = self.table.policy.down_after_ms
        try:
            reply = await self.conn.call(
                "XAUTOCLAIM", queue, SIDECAR_GROUP, "reaper", idle_ms, "0-0", "COUNT", CLAIM_BATCH
            )
        except RedisReplyError:
            return 0  # no stream or no group: nothing was ever assigned there
        claimed = [e[0] for e in reply[1] if e]
        if not claimed:
            return 0
        entries = parse_entries(reply[1])  # without the entries deleted while pending
        ids = sorted({f["id"].decode() for _, f in entries})
        await self._resolve_now(ids, instance_id, now)
        await self.conn.call("XACK", queue, SIDECAR_GROUP, *claimed)
        return len(claimed)

    async def refresh(self) -> None:
        views = await self.registry.snapshot()
        self.table.load(views)
        self.views = {v.instance_id: v for v in views}

    def instance_down(self, instance_id: str, now: int) -> bool:
        """Its sidecar is gone: deregistered, or silent past ``down_after_s``. Only the
        heartbeat counts — a live sidecar reporting DOWN (errors) or DRAINING still owns its
        work; a dead one that was DRAINING does not."""
        view = self.views.get(instance_id)
        return view is None or now - view.heartbeat_ms > self.table.policy.down_after_ms

    async def resolve(self, message_id: str, record: MessageRecord | None, now: int) -> Verdict:
        if record is not None and record.stage in TERMINAL and record.reply_pending:
            # ended by a reaper that stopped before telling the producer (or dead-lettering)
            await self._finish_telling(record)
        elif record is not None and record.stage is Stage.EXPIRED:
            await self.waiting.reply_expired(record, record.error or "waited_past_deadline")
        if record is None or record.stage in TERMINAL:
            return Verdict("forgotten", None)
        match record.stage:
            case Stage.WAITING:
                return await self._waiting(record, now)
            case Stage.ACCEPTED:
                return await self._accepted(record, now)
            case Stage.ROUTED | Stage.RECEIVED:
                return await self._not_asked(record, now)
            case Stage.PROCESSING:
                return await self._processing(record, now)
            case Stage.CALLBACK_RECEIVED:
                return await self._callback_received(record, now)
            case Stage.FANNED_OUT:
                await self._children_told(record)
                return Verdict("fanned out", now + self.delivery_timeout_ms)
        return Verdict("parked", now + PARKED_RECHECK_MS)  # NEEDS_CONFIRMATION

    # -- the agent was never asked ---------------------------------------------------------

    async def _waiting(self, record: MessageRecord, now: int) -> Verdict:
        if now < record.deadline_ms:
            # whoever moved it to WAITING may have stopped before indexing it: index it
            # (unless it was set aside as unmatched; a drain then finds it either way)
            set_aside = await self.conn.call(
                "ZSCORE", self.conn.keys.unmatched(record.capability), record.id
            )
            if set_aside is None:
                await self.store.park(
                    record.capability, record.id, record.priority, record.accepted_ms
                )
            return Verdict("waiting", min(record.deadline_ms, now + self.delivery_timeout_ms))
        if await self.waiting.expire(record, now):
            return Verdict("expired", None)
        return Verdict("raced", now + 1_000)  # it just left WAITING: look again shortly

    async def _accepted(self, record: MessageRecord, now: int) -> Verdict:
        if now - record.updated_ms < self.delivery_timeout_ms:
            return Verdict("accepted", record.updated_ms + self.delivery_timeout_ms)
        moved = await self.store.move(
            record.id,
            Stage.WAITING,
            only_from=Stage.ACCEPTED,
            reason="accepted but never routed (its dispatcher stopped): waiting",
        )
        if moved.ok:
            await self.store.park(record.capability, record.id, record.priority, record.accepted_ms)
        return Verdict("parked accepted", self._next_look(record, now))

    async def _not_asked(self, record: MessageRecord, now: int) -> Verdict:
        down = self.instance_down(record.instance, now)
        late = now - record.updated_ms >= self.delivery_timeout_ms
        if now >= record.deadline_ms:
            ended = await self._end(
                record, Stage.EXPIRED, "deadline passed before the agent was asked"
            )
            return Verdict("expired", None if ended else now + 1_000)
        if not (down or late):
            due = min(record.updated_ms + self.delivery_timeout_ms, record.deadline_ms)
            return Verdict("in time", due)
        why = (
            f"{record.instance} is down: rerouted"
            if down
            else f"delivery timeout: {record.instance} did not take it within "
            f"{self.settings.delivery_timeout_s:g} s: rerouted"
        )
        moved = await self.store.apply(
            self._fenced(record, Stage.WAITING, reason=why, fields={"avoid": record.instance})
        )
        if moved.ok:
            await self._release(record)
            await self.store.park(record.capability, record.id, record.priority, record.accepted_ms)
            return Verdict("rerouted", self._next_look(record, now))
        return Verdict("raced", now + 1_000)

    # -- the agent may be working on it ----------------------------------------------------

    async def _processing(self, record: MessageRecord, now: int) -> Verdict:
        # an async agent took it (202): its answer is a callback, due within callback_timeout_s
        timeout_ms = (
            self.callback_timeout_ms if record.awaiting_callback else self.processing_timeout_ms
        )
        down = self.instance_down(record.instance, now)
        late = now - record.updated_ms >= timeout_ms
        if now >= record.deadline_ms and record.reply_to:
            await self._tell_deadline_passed(record)
        if not (down or late):
            return Verdict("in time", record.updated_ms + timeout_ms)
        view = self.views.get(record.instance)
        status = await self.status.query(view.card.status_url if view else "", record.id)
        idempotent = view is not None and view.card.idempotent
        envelope = load_envelope(record.envelope)
        attempts_left = record.attempt < envelope.max_attempts
        why = (
            "instance down"
            if down
            else "callback late"
            if record.awaiting_callback
            else "no answer in time"
        )
        match status.state:
            case "done":
                ended = await self._end(
                    record, Stage.SUCCEEDED, f"{why}; {status.why}", result=status.result_json
                )
                return Verdict("recovered result", None if ended else now + 1_000)
            case "running" if record.extensions < MAX_EXTENSIONS:
                await self.conn.call("HINCRBY", self.conn.keys.record(record.id), "extensions", 1)
                return Verdict("extended", now + timeout_ms)
            case "failed" if not (idempotent and attempts_left):
                error = status.error or "the agent reported failure"
                ended = await self._end(record, Stage.FAILED, f"{why}; {status.why}", error=error)
                return Verdict("failed", None if ended else now + 1_000)
        reason = f"{why}; {status.why or status.state}"
        if idempotent and attempts_left:
            return await self._retry(record, envelope, reason, now)
        if idempotent:
            error = f"gave up after {record.attempt} attempts: {reason}"
            ended = await self._end(record, Stage.DEAD, error, error=error)
            return Verdict("dead", None if ended else now + 1_000)
        moved = await self.store.apply(
            self._fenced(
                record,
                Stage.NEEDS_CONFIRMATION,
                reason=f"{reason}; the agent is not idempotent: parked for an operator",
            )
        )
        if moved.ok:
            await self._release(record)
        return Verdict("needs confirmation", now + PARKED_RECHECK_MS)

    async def _callback_received(self, record: MessageRecord, now: int) -> Verdict:
        """An async agent's result is on the record, and its sidecar stopped before it
        finished the message: finish it here (the result is known, nothing runs again)."""
        stale = now - record.updated_ms >= self.delivery_timeout_ms
        if not (stale or self.instance_down(record.instance, now)):
            return Verdict("in time", record.updated_ms + self.delivery_timeout_ms)
        reason = "callback received; finished by the reaper (its sidecar stopped)"
        if record.result is not None:
            ended = await self._end(record, Stage.SUCCEEDED, reason, result=record.result)
        else:
            ended = await self._end(record, Stage.FAILED, reason, error=record.error or "failed")
        return Verdict("finished callback", None if ended else now + 1_000)

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
                await self.store.deliver(
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
            self._fenced(
                record,
                Stage.WAITING,
                reason=f"{reason}; retry in {delay} ms (idempotent agent)",
                fields={"avoid": record.instance, "retry_at_ms": now + delay},
            )
        )
        if not moved.ok:
            return Verdict("raced", now + 1_000)
        await self._release(record)
        await self.store.park(envelope.capability, record.id, record.priority, record.accepted_ms)
        return Verdict("retried", max(now + delay, self._next_look(record, now)))

    # -- helpers ---------------------------------------------------------------------------

    def _next_look(self, record: MessageRecord, now: int) -> int:
        """After the reaper sent a message back to WAITING: soon enough to see it through
        (parked, routed, delivered), or at its deadline if that comes first."""
        return min(record.deadline_ms, now + self.delivery_timeout_ms)

    def _fenced(self, record: MessageRecord, target: Stage, **options: Any) -> Move:
        """A move only from the stage, attempt and instance the reaper looked at."""
        return Move(
            record.id,
            target,
            only_from=record.stage,
            expect_attempt=record.attempt,
            expect_instance=record.instance,
            **options,
        )

    async def _end(
        self,
        record: MessageRecord,
        stage: Stage,
        reason: str,
        *,
        result: bytes | None = None,
        error: str | None = None,
    ) -> bool:
        """A terminal outcome: recorded (fenced), the credit returned, the producer told."""
        fields: dict[str, str | bytes | int] = {"reply_pending": 1}
        if result is not None:
            fields["result"] = result
        if error is not None or stage is Stage.EXPIRED:
            fields["error"] = error or reason
        # Shielded: a reaper being stopped (SIGTERM, a cancelled task group) finishes the write
        # and the telling together; only a kill in between leaves reply_pending to the next.
        ended = False
        with anyio.CancelScope(shield=True):
            moved = await self.store.apply(
                self._fenced(record, stage, reason=reason, fields=fields)
            )
            if moved.ok:
                await self._release(record)
                if stage is Stage.DEAD:  # dead-lettered before the producer hears of it
                    await self.store.dead_letter_message(record.id, str(fields["error"]))
                await self._reply(record, stage, result, str(fields.get("error", reason)))
                await self.conn.call("HDEL", self.conn.keys.record(record.id), "reply_pending")
                ended = True
        return ended

    async def _finish_telling(self, record: MessageRecord) -> None:
        if record.stage is Stage.DEAD:
            await self.store.dead_letter_message(record.id, record.error or "dead")
        await self._reply(record, record.stage, record.result, record.error)
        await self.conn.call("HDEL", self.conn.keys.record(record.id), "reply_pending")

    async def _reply(
        self, record: MessageRecord, stage: Stage, result: bytes | None, error: str | None
    ) -> None:
        await self.store.deliver(record.envelope, stage, result, error, attempt=record.attempt)

    async def _release(self, record: MessageRecord) -> None:
        """Return the credit the abandoned attempt held on a dead instance. A live sidecar
        returns its own when it reads (and drops) or finishes the entry: taken back here, the
        instance could be handed more than its limit while its call still runs."""
        if record.instance and self.instance_down(record.instance, now_ms()):
            await self.conn.call(
                "SREM", self.conn.keys.inflight(record.instance), f"{record.id}:{record.attempt}"
            )

    async def _tell_deadline_passed(self, record: MessageRecord) -> None:
        """Once: the producer learns its deadline passed while the agent may still work."""
        key = self.conn.keys.record(record.id)
        if await self.conn.call("HSETNX", key, "deadline_told", 1):
            await self.store.send_reply(
                record.reply_to,
                ReplyEntry(
                    id=record.id,
                    stage=Stage.PROCESSING,
                    attempt=record.attempt,
                    notice="deadline_passed",
                    error="the deadline passed while the agent may still be working on it",
                ),
            )


def _stale_credits(
    message_id: str, record: MessageRecord | None, instance_id: str, members: set[str]
) -> list[str]:
    """The message's credits on the instance that no live attempt there holds any more."""
    live = (
        f"{message_id}:{record.attempt}"
        if record is not None and record.instance == instance_id and record.stage in _HOLDS_CREDIT
        else None
    )
    return [m for m in members if m.rpartition(":")[0] == message_id and m != live]
