"""Admission: a batch's envelopes become records — routed, parked, or fanned out.

Routes each envelope (or plans a broadcast's fan-out), creates every record in one round
trip (``lua/accept.lua``; on one server a record ROUTED is assigned in the same script,
``lua/accept_assign.lua``, with its deadline entry), then writes the batch's waiting sets
and sessions in one more, when it has any, with the other deadline entries. Without them,
those ride with the batch's assignments (:meth:`workers.assignment.Assigner.assign`,
``ahead``). A stop between the two leaves the ingress entry pending; handled again, the
record exists and its deadline entry is written then (``_reapply``).

A broadcast parent is created before its children. An id that already names a
message is the same request handled again (its index writes re-applied, idempotently) or
another request under a taken id (refused, the first message untouched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from broker import failpoints
from broker.acceptance import Acceptance, acceptance_of
from broker.broadcast import (
    Children,
    child_envelope,
    decode_children,
    encode_children,
    fan_out,
    members,
    no_members_reason,
)
from broker.budgets import Overrun
from broker.connection import Connection
from broker.deadletters import Letter
from broker.due_clock import due_at_most_command, due_command
from broker.envelope import Envelope, encode_envelope, load_envelope
from broker.intent import IntentDecision
from broker.records import AssignResult, MessageRecord
from broker.routing import Decision
from broker.sessions import bind_session_commands, bound_instances
from broker.stages import Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from broker.waiting_sets import park_commands, parks_hint

from .assignment import Assigner, Routed, decision_fields, route_request, routed_instance
from .intake import Intake
from .intent_resolver import with_intent
from .routing_table import RoutingTable
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.dispatcher")

BEHIND_WAITING = "queued behind waiting work of its capability"
LISTED_INSTANCES = 10  # a broadcast's timeline names this many of its instances (trace: all)


@dataclass(frozen=True, slots=True)
class Plan:
    """One record to create: what ``accept.lua`` gets, and a broadcast's children."""

    acceptance: Acceptance
    envelope: Envelope
    children: Children = field(default_factory=list)


@dataclass(slots=True)
class Admitted:
    """What a batch's records need once created: assignments, index writes, children to
    create (parent envelope, fan-out, deadline), broadcasts to reject."""

    routed: list[Routed] = field(default_factory=list)
    to_park: list[tuple[str, str, int, int]] = field(default_factory=list)
    bindings: list[tuple[str, str]] = field(default_factory=list)
    due: list[tuple[Any, ...]] = field(default_factory=list)
    # the routed already assigned with their records (lua/accept_assign.lua): the answers
    assigned: dict[str, AssignResult] = field(default_factory=dict)
    fan_outs: list[tuple[Envelope, Children, int]] = field(default_factory=list)
    rejected: list[tuple[Envelope, str]] = field(default_factory=list)


class Admission:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        table: RoutingTable,
        *,
        assigner: Assigner,
        waiting: WaitingRoom,
        intake: Intake,
        on_parked: Callable[[Iterable[str]], None],
    ) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.store = store
        self.table = table
        self.assigner = assigner
        self.waiting = waiting
        self.intake = intake
        self.on_parked = on_parked
        self.budgets = assigner.budgets
        self._overruns: dict[str, Overrun] = {}

    async def admit(
        self, envelopes: list[Envelope], intents: Mapping[str, IntentDecision] | None = None
    ) -> Admitted:
        """Route each envelope and create its record, ROUTED or WAITING (a broadcast: the
        parent FANNED_OUT, then its children): one round trip for the records, one more for
        every child of the batch's broadcasts (plus one for the sessions the batch names).
        ``intents``: how an envelope's intent was mapped, by message id (recorded with it).
        Returns the records to assign (``routed``) and their deadline entries (``due``), which
        the caller writes with the assignments."""
        now = now_ms()
        await self.budgets.refresh(now)
        sessions = await bound_instances(
            self.store.conn, sorted({e.session_id for e in envelopes if e.session_id})
        )
        admitted = Admitted()
        intents = intents or {}
        plans = [self._plan(e, now, sessions, intent=intents.get(e.message_id)) for e in envelopes]
        await self._admit(plans, admitted, now)
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
        # waiting sets before a drain can look for them, sessions before the next batch, and
        # with them the deadline entries; with neither, those go with the assignments
        first = park_commands(self.store.keys, admitted.to_park, hint=parks_hint(self.store.conn))
        first += bind_session_commands(self.store.conn, admitted.bindings)
        if first:
            await self.store.conn.run_all(admitted.due + first)
            admitted.due = []
        if admitted.to_park:
            parked = {capability for capability, *_ in admitted.to_park}
            self.waiting.note_waiting(parked)
            self.on_parked(parked)  # at once if credits are free: behind earlier work
        for envelope, reason in admitted.rejected:
            await self._tell_rejected(envelope, reason)
        overruns, self._overruns = self._overruns, {}
        for found in overruns.values():
            await self.budgets.announce(found)
        return admitted

    async def _admit(self, plans: list[Plan], admitted: Admitted, now: int) -> None:
        """Create the planned records (one round trip) and sort out what each needs next. On
        one server, with no configured rate limit to check first, a record ROUTED is assigned
        in the same script, its deadline entry written with it (``lua/accept_assign.lua``)."""
        results = await self.store.accept_many([p.acceptance for p in plans])
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
            if result.assigned is None:  # the reaper's first look: a late delivery, or the end
                admitted.due.append(
                    due_command(self.store.keys, a.message_id, self._first_look(now, a.deadline_ms))
                )
            if a.next_stage is Stage.FANNED_OUT:
                admitted.fan_outs.append((plan.envelope, plan.children, a.deadline_ms))
            elif a.next_stage is Stage.ROUTED:
                admitted.routed.append(
                    Routed(
                        a.message_id,
                        a.capability,
                        a.instance,
                        1,
                        a.priority,
                        now,
                        plan.envelope.tenant,
                    )
                )
                if result.assigned is not None:
                    admitted.assigned[a.message_id] = result.assigned
                if plan.envelope.session_id:
                    admitted.bindings.append((plan.envelope.session_id, a.instance))
            else:
                admitted.to_park.append((a.capability, a.message_id, a.priority, now))
                self.waiting.parked.keep(a.capability, plan.envelope, now, len(a.envelope_json))
        await self._repair(existing, admitted)

    def _plan(
        self,
        envelope: Envelope,
        now: int,
        sessions: dict[str, str],
        deadline_ms: int | None = None,
        *,
        intent: IntentDecision | None = None,
    ) -> Plan:
        if deadline_ms is None:
            deadline_ms = now + int(envelope.timeout_s * 1000)
        over = self.budgets.verdict(envelope.tenant) if envelope.parent is None else None
        if over is not None:
            self._overruns[over.tenant] = over
            if self.settings.budget_mode == "reject":
                rejected = {"reply_pending": "1", "route_reason": over.reason}
                stage = Stage.REJECTED
                return Plan(
                    acceptance_of(envelope, now, deadline_ms, stage, over.reason, rejected),
                    envelope,
                )
        if envelope.mode == "broadcast":
            return self._plan_broadcast(envelope, now, deadline_ms)
        if envelope.capability in self.waiting.backlogged:
            decision: Decision | None = None  # earlier work waits: this one queues behind it
            instance = None
        else:
            request = route_request(envelope, sessions, cheapest=over is not None)
            decision = self.table.decide(request, now_ms=now)
            instance = routed_instance(decision)
        if instance and envelope.session_id:
            sessions[envelope.session_id] = instance  # later messages of the batch follow it
        reason = decision.reason if decision else BEHIND_WAITING
        fields = decision_fields(decision) if decision else {}
        if intent is not None:  # how the capability was found comes first
            fields = with_intent(fields, reason, intent)
            reason = fields["route_reason"]
        acceptance = acceptance_of(
            envelope,
            now,
            deadline_ms,
            Stage.ROUTED if instance else Stage.WAITING,
            reason,
            fields,
            instance=instance or "",
            assign_due_ms=self._assigned_at_once(now, deadline_ms) if instance else 0,
        )
        return Plan(acceptance, envelope)

    def _assigned_at_once(self, now: int, deadline_ms: int) -> int:
        """Where a record ROUTED is assigned in the script that creates it (one server, no
        configured rate limit to check first: :meth:`_admit`), when its deadline entry is due
        (:meth:`_first_look`). 0: it is assigned after. (Given at planning: a copy of each
        acceptance made with it cost a busy dispatcher 5 % of its CPU.)"""
        if self.conn.cluster or self.assigner.gate.active:
            return 0
        return self._first_look(now, deadline_ms)

    def _first_look(self, now: int, deadline_ms: int) -> int:
        """When the reaper first looks at a message accepted ``now``: a late delivery
        (``delivery_timeout_s``) or its end, whichever comes first."""
        return min(deadline_ms, now + int(self.settings.delivery_timeout_s * 1000))

    def _plan_broadcast(self, envelope: Envelope, now: int, deadline_ms: int) -> Plan:
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
        acceptance = acceptance_of(envelope, now, deadline_ms, stage, reason, fields)
        return Plan(acceptance, envelope, children)

    async def _repair(self, existing: list[tuple[str, Envelope]], admitted: Admitted) -> None:
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

    async def _reapply(self, records: list[MessageRecord], admitted: Admitted) -> None:
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
            hint=parks_hint(self.store.conn),
        )
        await self.store.conn.run_all(commands)
        assigned = await self.assigner.assign(
            [
                Routed(
                    r.id,
                    r.capability,
                    r.instance,
                    r.attempt,
                    r.priority,
                    r.accepted_ms,
                    load_envelope(r.envelope).tenant,
                )
                for r in records
                if r.stage is Stage.ROUTED
            ]
        )
        await self.store.conn.run_all(assigned.after)
        parents = [r for r in records if r.stage is Stage.FANNED_OUT]
        fanned = await self.conn.call_many(
            [("HGET", self.keys.record(r.id), "children") for r in parents]
        )
        for parent, raw in zip(parents, fanned, strict=True):
            children = decode_children(raw or b"[]")
            admitted.fan_outs.append((load_envelope(parent.envelope), children, parent.deadline_ms))
        for r in records:
            if r.stage is Stage.REJECTED and r.reply_pending:  # rejected at admission
                await self._tell_rejected(load_envelope(r.envelope), r.error or "")

    async def _tell_rejected(self, envelope: Envelope, reason: str) -> None:
        """A broadcast no instance could take, or a tenant over its budget: dead-lettered like
        every REJECTED envelope, its producer told (reply and webhook), then the record's
        ``reply_pending`` cleared."""
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
        log.info("%s rejected: %s", message_id, reason)
