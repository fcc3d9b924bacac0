"""The dispatcher: reads the ingress stream, validates, de-duplicates, routes and assigns.

A batch is handled in a fixed number of pipelined round trips, whatever its size: accept
every record, assign every routed attempt, park whatever found no credit, acknowledge the
entries. Assignment happens only against a free credit; otherwise the message waits in its
capability's waiting set, drained when a sidecar announces freed credits and at every sweep.

Order of writes, chosen so a crash between two of them is always repairable: the record moves
first (ACCEPTED -> ROUTED), then the assignment appends to the instance's stream; a stream
entry is only ever executed when the record agrees (fencing by attempt and instance). The
ingress entry is acknowledged last, so a dispatcher killed mid-batch leaves it pending, and
its next start (or another dispatcher) handles it again; every step is idempotent.

A broadcast (``mode: "broadcast"``, :mod:`broker.broadcast`) is a parent record, FANNED_OUT
with its fan-out (child id -> instance) on it, then one child record per healthy instance —
the batch's children in one more round trip, assigned with the batch's other work. Parents
are written before their children, so a child never lacks the parent that collects its
outcome; handled again, a FANNED_OUT parent has its missing children created.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus

from broker import failpoints
from broker.acks import ack, trim_acknowledged
from broker.broadcast import (
    Children,
    child_envelope,
    decode_children,
    encode_children,
    fan_out,
    members,
    no_members_reason,
)
from broker.connection import Connection, ensure_group
from broker.deadletters import Letter
from broker.due_clock import due_at_most_command, due_command
from broker.entries import IngressEntry, parse_ingress
from broker.envelope import (
    Envelope,
    encode_envelope,
    load_envelope,
)
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import DISPATCH_GROUP
from broker.records import MessageRecord
from broker.registry import Registry
from broker.routing import Decision
from broker.sessions import bind_session_commands, bound_instances
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.streams import GroupReader, RawEntry, Subscriber, raw_entries
from broker.timekeeping import now_ms
from broker.waiting_sets import park_commands

from .assignment import Assigner, Routed, decision_fields, route_request, routed_instance
from .intake import Intake
from .routing_table import RoutingTable, routing_policy
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.dispatcher")

READ_BLOCK_MS = 1000
PRUNE_EVERY_S = 10.0  # how often the waiting index is pruned of capabilities with nothing
MAX_ENTRY_FAILURES = 3  # an entry failing this often on its own is rejected with the error
TRIM_EVERY_S = 10.0
BEHIND_WAITING = "queued behind waiting work of its capability"
LISTED_INSTANCES = 10  # a broadcast's timeline names this many of its instances (trace: all)


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class _Plan:
    """One record to create: what ``accept.lua`` gets, and a broadcast's children."""

    acceptance: Acceptance
    envelope: Envelope
    children: Children = field(default_factory=list)


@dataclass(slots=True)
class _Admitted:
    """What a batch's records need once created: assignments, index writes, children to
    create (parent envelope, fan-out, deadline), broadcasts to reject."""

    routed: list[Routed] = field(default_factory=list)
    to_park: list[tuple[str, str, int, int]] = field(default_factory=list)
    bindings: list[tuple[str, str]] = field(default_factory=list)
    due: list[tuple[Any, ...]] = field(default_factory=list)
    fan_outs: list[tuple[Envelope, Children, int]] = field(default_factory=list)
    rejected: list[tuple[Envelope, str]] = field(default_factory=list)


class Dispatcher:
    def __init__(self, conn: Connection, *, consumer: str | None = None) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.store = MessageStore(conn)
        self.registry = Registry(conn)
        self.consumer = consumer or default_consumer_name()
        self.table = RoutingTable(routing_policy(self.settings))
        self.assigner = Assigner(self.store, self.table)
        self.waiting = WaitingRoom(self.store, self.table, batch=self.settings.dispatch_batch)
        self.intake = Intake(conn, self.store)
        self._credit_freed = anyio.Event()
        self._to_drain: set[str] = set()
        self._next_prune = 0.0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await ensure_group(self.conn, self.keys.ingress, DISPATCH_GROUP)
        await self.refresh()
        async with self.conn.reader() as reader, anyio.create_task_group() as tg:
            await tg.start(self._watch_notifications)
            tg.start_soon(self._drain_loop)
            tg.start_soon(self._trim_loop)
            await self._recover(reader)
            task_status.started()
            await self._ingress_loop(reader)

    async def refresh(self) -> None:
        self.table.load(await self.registry.snapshot())

    # -- ingress -----------------------------------------------------------------------------

    async def _recover(self, reader: GroupReader) -> None:
        """Re-handle this consumer's own pending entries: a restart after a crash mid-batch."""
        entries = await reader.read_raw(
            self.keys.ingress,
            DISPATCH_GROUP,
            self.consumer,
            count=100_000,
            block_ms=None,
            pending=True,
        )
        if entries:
            log.info("recovering %d pending ingress entries", len(entries))
            await self._handle(entries, recovering=True)

    async def claim_abandoned(self) -> int:
        """Take over ingress entries another dispatcher read and never finished (it died, and
        did not come back under its name): ``XAUTOCLAIM`` after ``claim_idle_s``. Handling
        an entry twice is harmless: a record is created once per id."""
        reply = await self.conn.call(
            "XAUTOCLAIM",
            self.keys.ingress,
            DISPATCH_GROUP,
            self.consumer,
            int(self.settings.claim_idle_s * 1000),
            "0-0",
            "COUNT",
            self.settings.dispatch_batch,
        )
        entries = raw_entries(reply[1])
        if entries:
            log.info("claimed %d ingress entries abandoned by another dispatcher", len(entries))
            await self._handle(entries, recovering=True)
        gone = [e[0] for e in reply[1] if e and not e[1]]  # deleted while pending (Redis 6.2)
        if gone:
            await ack(self.conn, self.keys.ingress, DISPATCH_GROUP, [g.decode() for g in gone])
        return len(entries)

    async def _ingress_loop(self, reader: GroupReader) -> None:
        backoff = 0.1
        while True:
            try:
                if backoff > 0.1:  # after a failure: first finish what this consumer holds
                    await self._recover(reader)
                entries = await reader.read_raw(
                    self.keys.ingress,
                    DISPATCH_GROUP,
                    self.consumer,
                    count=self.settings.dispatch_batch,
                    block_ms=READ_BLOCK_MS,
                )
                if entries:
                    await self._handle(entries, recovering=False)
                backoff = 0.1
            except (RedisUnavailable, RedisReplyError) as exc:
                backoff = min(backoff * 2, 5.0)
                log.warning("ingress failed, retrying in %.1fs: %s", backoff, exc)
                await anyio.sleep(backoff)
            except Exception:  # a defect outside any one entry: never out of the loop
                backoff = min(backoff * 2, 5.0)
                log.exception("ingress failed unexpectedly, retrying in %.1fs", backoff)
                await anyio.sleep(backoff)

    async def _handle(self, entries: Sequence[RawEntry], *, recovering: bool) -> None:
        """A batch at once; should it fail unexpectedly, its entries one at a time, each tried
        up to ``MAX_ENTRY_FAILURES`` times — on every path: the read loop, the recovery at
        start, entries taken over from another dispatcher. An entry that still fails is
        REJECTED with the error (dead-lettered, acknowledged): no entry can stop the ingress,
        or its dispatcher, for ever."""
        try:
            await self.handle_batch(entries, recovering=recovering)
            return
        except (RedisUnavailable, RedisReplyError):
            raise
        except Exception:
            log.exception("a batch of %d ingress entries failed: one at a time", len(entries))
        for entry in entries:
            await self._handle_alone(entry)

    async def _handle_alone(self, entry: RawEntry) -> None:
        for failures in range(1, MAX_ENTRY_FAILURES + 1):
            try:
                await self.handle_batch([entry], recovering=True)
                return
            except (RedisUnavailable, RedisReplyError):
                raise
            except Exception as exc:
                if failures == MAX_ENTRY_FAILURES:
                    await self._set_aside(entry, exc)
                else:
                    log.warning("ingress entry %s failed (%d): %s", entry[0], failures, exc)

    async def _set_aside(self, entry: RawEntry, exc: Exception) -> None:
        entry_id, flat = entry
        log.error("ingress entry %s failed %d times; rejected", entry_id, MAX_ENTRY_FAILURES)
        reason = f"the dispatcher could not handle it: {type(exc).__name__}: {exc}"
        names, minted = await self.intake.names([entry_id], recovering=True)
        parsed = parse_ingress(entry_id, flat)
        raw = parsed.envelope if isinstance(parsed, IngressEntry) else parsed.raw
        await self.intake.reject([self.intake.rejection(entry_id, names[entry_id], reason, raw)])
        await self.intake.acknowledge([entry_id], minted)

    async def handle_batch(self, entries: Sequence[RawEntry], *, recovering: bool = False) -> None:
        """Take in, accept, route, assign or park, then acknowledge: a few round trips per
        batch, whatever the entries hold (:mod:`workers.intake`)."""
        intaken = await self.intake.take(entries, recovering=recovering)
        routed = await self._accept(intaken.envelopes, recovering)
        assigned = await self.assigner.assign(routed)
        if len(assigned) < len(routed):  # refused for want of a credit: now they wait
            taken = {r.message_id for r in assigned}
            self.waiting.note_waiting({r.capability for r in routed if r.message_id not in taken})
        await self.intake.acknowledge([entry_id for entry_id, _ in entries], intaken.minted)

    async def _accept(self, envelopes: list[Envelope], recovering: bool) -> list[Routed]:
        """Route each envelope and create its record, ROUTED or WAITING (a broadcast: the
        parent FANNED_OUT, then its children): one round trip for the records, one more for
        every child of the batch's broadcasts (plus one for the sessions the batch names)."""
        now = now_ms()
        sessions = await bound_instances(
            self.store.conn, sorted({e.session_id for e in envelopes if e.session_id})
        )
        admitted = _Admitted()
        await self._admit([self._plan(e, now, sessions) for e in envelopes], admitted, now)
        if admitted.fan_outs:
            # Parents first, children after: a child never exists without the parent that
            # collects its outcome. A stop in between leaves the ingress entry pending; handled
            # again, the parent exists and its missing children are created (_repair).
            failpoints.hit("dispatcher.after_fan_out")
            children = [
                self._plan(child_envelope(parent, child, inst), now, sessions, deadline_ms)
                for parent, fanned, deadline_ms in admitted.fan_outs
                for child, inst in fanned
            ]
            admitted.fan_outs = []
            await self._admit(children, admitted, now)
        # the batch's index writes (deadlines, waiting sets, sessions) in one round trip
        await self.store.conn.run_all(
            admitted.due
            + park_commands(self.store.keys, admitted.to_park)
            + bind_session_commands(self.store.conn, admitted.bindings)
        )
        if admitted.to_park:
            parked = {capability for capability, *_ in admitted.to_park}
            self.waiting.note_waiting(parked)
            self._drain_soon(parked)  # at once if credits are free: behind earlier work
        for envelope, reason in admitted.rejected:
            await self._reject_broadcast(envelope, reason)
        return admitted.routed

    async def _admit(self, plans: list[_Plan], admitted: _Admitted, now: int) -> None:
        """Create the planned records (one round trip) and sort out what each needs next."""
        results = await self.store.accept_many([p.acceptance for p in plans])
        reaper_look = now + int(self.settings.delivery_timeout_s * 1000)
        existing: list[tuple[str, Envelope]] = []
        for plan, result in zip(plans, results, strict=True):
            a = plan.acceptance
            if not result.created:
                # A redelivery after a crash, or a producer's retry: not run again, but the
                # index writes for the record's stage are re-applied (each is idempotent).
                # Unless it is another request under a taken id (see _repair).
                self.table.unreserve(a.instance)
                existing.append((a.message_id, plan.envelope))
                continue
            if a.next_stage is Stage.REJECTED:
                admitted.rejected.append((plan.envelope, a.reason))
                continue
            # the reaper's first look: when a delivery would be late, or the deadline
            admitted.due.append(
                due_command(self.store.keys, a.message_id, min(a.deadline_ms, reaper_look))
            )
            if a.next_stage is Stage.FANNED_OUT:
                admitted.fan_outs.append((plan.envelope, plan.children, a.deadline_ms))
            elif a.next_stage is Stage.ROUTED:
                admitted.routed.append(
                    Routed(a.message_id, a.capability, a.instance, 1, a.priority, now)
                )
                if plan.envelope.session_id:
                    admitted.bindings.append((plan.envelope.session_id, a.instance))
            else:
                admitted.to_park.append((a.capability, a.message_id, a.priority, now))
        await self._repair(existing, admitted)

    def _plan(
        self,
        envelope: Envelope,
        now: int,
        sessions: dict[str, str],
        deadline_ms: int | None = None,
    ) -> _Plan:
        if deadline_ms is None:
            deadline_ms = now + int(envelope.timeout_s * 1000)
        if envelope.mode == "broadcast":
            return self._plan_broadcast(envelope, now, deadline_ms)
        if envelope.capability in self.waiting.backlogged:
            decision: Decision | None = None  # earlier work waits: this one queues behind it
            instance = None
        else:
            decision = self.table.decide(route_request(envelope, sessions), now_ms=now)
            instance = routed_instance(decision)
        if instance and envelope.session_id:
            sessions[envelope.session_id] = instance  # later messages of the batch follow it
        acceptance = _acceptance(
            envelope,
            now,
            deadline_ms,
            Stage.ROUTED if instance else Stage.WAITING,
            decision.reason if decision else BEHIND_WAITING,
            decision_fields(decision) if decision else {},
            instance=instance or "",
        )
        return _Plan(acceptance, envelope)

    def _plan_broadcast(self, envelope: Envelope, now: int, deadline_ms: int) -> _Plan:
        """FANNED_OUT to one child per healthy instance, the fan-out kept on the record; with
        no healthy instance at all, REJECTED with the funnel's reason (told at once, not
        parked: a broadcast that waited would go to whichever instance came first)."""
        request = route_request(envelope, {})
        instances = members(request, self.table.index, self.table.policy, now_ms=now)
        children = fan_out(envelope.message_id, instances)
        fields: dict[str, Any]
        if children:
            stage = Stage.FANNED_OUT
            listed = ", ".join(instances[:LISTED_INSTANCES])
            more = len(instances) - LISTED_INSTANCES
            reason = f"broadcast to {len(children)} instances: {listed}"
            reason += f" (+{more} more)" if more > 0 else ""
            fields = {
                "children": encode_children(children),
                # what lua/child_done.lua needs to end the parent like transition.lua would
                "timeline_max": str(self.settings.timeline_max),
                "ttl_s": str(self.settings.record_ttl_s),
                "route_reason": f"broadcast to {len(children)} healthy instances",
            }
        else:
            stage = Stage.REJECTED
            decision = self.table.evaluate(request, now_ms=now)
            reason = no_members_reason(decision.reason)
            fields = {**decision_fields(decision), "reply_pending": "1"}
        acceptance = _acceptance(envelope, now, deadline_ms, stage, reason, fields)
        return _Plan(acceptance, envelope, children)

    async def _repair(self, existing: list[tuple[str, Envelope]], admitted: _Admitted) -> None:
        """Ids that name a message already: the same request gets the existing message — the
        index writes for its stage re-applied (each is idempotent), in a few round trips for
        the lot, a broadcast parent's children planned again (the missing ones get created);
        another request under a taken id is refused, the first message untouched."""
        if not existing:
            return
        ids = list(dict.fromkeys(message_id for message_id, _ in existing))
        found = dict(zip(ids, await self.store.get_records(ids), strict=True))
        records: dict[str, MessageRecord] = {}
        for message_id, planned in existing:
            record = found[message_id]
            if record is None:
                continue
            if not self.intake.same_request(record, planned):
                await self._refuse(record, planned)
                continue
            records[message_id] = record
        await self._reapply(list(records.values()), admitted)

    async def _refuse(self, record: MessageRecord, planned: Envelope) -> None:
        """Another request under ``record``'s id. A broadcast's child whose id a producer
        had already used (``X.1`` before broadcast ``X``): that message is left alone, and
        the child's slot on the parent ends REJECTED with the reason, so the parent does not
        wait for it for ever. Anything else: REJECTED ``id_conflict`` (:mod:`workers.intake`)."""
        if planned.parent is None:
            await self.intake.conflict(record, planned)
            return
        reason = f"child id {record.id} already names another message"
        await self.store.delivery.deliver(planned, Stage.REJECTED, None, reason, attempt=0)
        log.warning("broadcast %s: %s", planned.parent, reason)

    async def _reapply(self, records: list[MessageRecord], admitted: _Admitted) -> None:
        if not records:
            return
        # never later than a look already due (a delivery timeout, a lease): only sooner
        commands = [due_at_most_command(self.store.keys, r.id, r.deadline_ms) for r in records]
        commands += park_commands(
            self.store.keys,
            [
                (r.capability, r.id, r.priority, r.accepted_ms)
                for r in records
                if r.stage is Stage.WAITING
            ],
        )
        await self.store.conn.run_all(commands)
        await self.assigner.assign(
            [
                Routed(r.id, r.capability, r.instance, r.attempt, r.priority, r.accepted_ms)
                for r in records
                if r.stage is Stage.ROUTED
            ]
        )
        parents = [r for r in records if r.stage is Stage.FANNED_OUT]
        fanned = await self.conn.call_many(
            [("HGET", self.keys.record(r.id), "children") for r in parents]
        )
        for parent, raw in zip(parents, fanned, strict=True):
            children = decode_children(raw or b"[]")
            admitted.fan_outs.append((load_envelope(parent.envelope), children, parent.deadline_ms))
        for r in records:
            if r.stage is Stage.REJECTED and r.reply_pending:  # a broadcast nobody could take
                await self._reject_broadcast(load_envelope(r.envelope), r.error or "")

    async def _reject_broadcast(self, envelope: Envelope, reason: str) -> None:
        """A broadcast no instance could take: dead-lettered like every REJECTED envelope, its
        producer told (reply and webhook), then the record's ``reply_pending`` cleared."""
        message_id = envelope.message_id
        # Shielded: a dispatcher being stopped finishes telling; only a kill leaves it (the
        # ingress entry is still pending then: handled again, _repair tells).
        with anyio.CancelScope(shield=True):
            await self.store.delivery.dead_letter(
                Letter(
                    id=message_id,
                    stage=Stage.REJECTED.value,
                    reason=reason,
                    raw=encode_envelope(envelope),
                    ts_ms=now_ms(),
                )
            )
            await self.store.delivery.deliver(envelope, Stage.REJECTED, None, reason, attempt=0)
            await self.conn.call("HDEL", self.keys.record(message_id), "reply_pending")
        log.info("broadcast %s rejected: %s", message_id, reason)

    # -- waiting -----------------------------------------------------------------------------

    async def _drain_loop(self) -> None:
        """Drain the capabilities whose instances just freed credits, at once; and every sweep
        interval — however busy the notifications keep this loop — refresh the registry and
        drain every capability with waiting work."""
        next_sweep = anyio.current_time()
        while True:
            with anyio.move_on_after(max(0.0, next_sweep - anyio.current_time())):
                await self._credit_freed.wait()
            self._credit_freed = anyio.Event()
            capabilities, self._to_drain = self._to_drain, set()
            try:
                if anyio.current_time() >= next_sweep:
                    next_sweep = anyio.current_time() + self.settings.sweep_interval_s
                    await self.refresh()
                    await self.claim_abandoned()
                    waiting = await self._waiting_capabilities()
                    await self.waiting.reconsider_unmatched(waiting)
                    capabilities |= set(waiting)
                await self.drain(capabilities)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("drain failed (the next sweep retries): %s", exc)
            except Exception:  # a defect: this loop is the dispatcher's clock, it never stops
                log.exception("drain failed unexpectedly (the next sweep retries)")

    async def drain(self, capabilities: Iterable[str]) -> int:
        return await self.waiting.drain(capabilities)

    async def _waiting_capabilities(self) -> list[str]:
        """The capabilities with waiting work; now and then the index is pruned of those
        with none left, and so is this dispatcher's memory of them."""
        waiting = await self.store.waiting.capabilities()
        now = anyio.current_time()
        if now < self._next_prune:
            return waiting
        self._next_prune = now + PRUNE_EVERY_S
        dropped = set(await self.store.waiting.prune_index(waiting))
        self.waiting.forget(dropped)
        return [c for c in waiting if c not in dropped]

    def _drain_soon(self, capabilities: Iterable[str]) -> None:
        self._to_drain.update(capabilities)
        self._credit_freed.set()

    # -- notifications and housekeeping ------------------------------------------------------

    async def _watch_notifications(self, *, task_status: TaskStatus[None]) -> None:
        """Credit releases wake the drain loop; registry changes refresh the snapshot. A
        notification is a hint: one that does not parse (anyone allowed to publish may send
        anything) is dropped, and the sweep does the work a lost hint would have."""
        subscriber = Subscriber(
            self.conn.url, [self.keys.credit_channel, self.keys.registry_channel]
        )
        task_status.started()
        try:
            while True:
                try:
                    message = await subscriber.next(timeout_s=1.0)
                except RedisUnavailable as exc:
                    log.warning("notifications lost, reconnecting: %s", exc)
                    await anyio.sleep(0.5)
                    continue
                if message is not None:
                    await self._notified(*message)
        finally:
            await subscriber.close()

    async def _notified(self, channel: str, data: bytes) -> None:
        if channel == self.keys.registry_channel:
            try:
                await self.refresh()
                self._to_drain.update(await self.store.waiting.capabilities())
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("registry refresh failed (the sweep retries): %s", exc)
        else:
            released = credit_release(data)
            if released is None:
                log.warning("credit notification not understood, dropped: %r", data[:80])
                return
            self._to_drain.update(self.table.credits_released(*released))
        self._credit_freed.set()

    async def _trim_loop(self) -> None:
        while True:
            await anyio.sleep(TRIM_EVERY_S)
            try:
                await trim_acknowledged(self.conn, self.keys.ingress)
            except RedisUnavailable as exc:
                log.warning("trim failed: %s", exc)


def credit_release(data: bytes) -> tuple[str, int] | None:
    """``"<instance id> <credits in use>"`` from ``lua/release.lua``, or ``None``."""
    instance_id, _, in_use = data.decode(errors="replace").partition(" ")
    if not instance_id or not in_use.isdigit() or len(in_use) > 9:
        return None
    return instance_id, int(in_use)


def _acceptance(
    envelope: Envelope,
    now: int,
    deadline_ms: int,
    next_stage: Stage,
    reason: str,
    fields: Mapping[str, str | bytes],
    *,
    instance: str = "",
) -> Acceptance:
    return Acceptance(
        message_id=envelope.message_id,
        envelope_json=encode_envelope(envelope),
        capability=envelope.capability,
        deadline_ms=deadline_ms,
        reply_to=envelope.reply_to or "",
        priority=envelope.priority,
        next_stage=next_stage,
        accepted_ms=now,
        instance=instance,
        reason=reason,
        fields=fields,
    )
