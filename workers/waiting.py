"""The waiting room: assigning waiting work when credits free, and ending it at its deadline.

Several dispatchers may drain the same waiting set at once: the WAITING -> ROUTED
compare-and-set lets exactly one win each message, and a waiting-set entry is removed only
after a successful assignment (a stale one only once its record can no longer return to
WAITING). A waiting message whose deadline passes ends EXPIRED — with the reason it could not
be served (``no_capability_match`` and the nearest registered capabilities,
``all_candidates_down``, or ``waited_past_deadline``) — and its producer is told.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from broker.envelope import Envelope, load_envelope
from broker.records import MessageRecord
from broker.routing import Outcome, route
from broker.stages import Stage
from broker.store import MessageStore, Move, now_ms

from .assignment import Assigner, Routed, decision_fields, route_request, routed_instance
from .routing_table import RoutingTable

log = logging.getLogger("agent_reach.waiting")

# A waiting-set entry whose record is in one of these may still be needed: leave it.
_MAY_RETURN_TO_WAITING = frozenset({Stage.ACCEPTED, Stage.WAITING, Stage.ROUTED})
_EXPLAINED = (Outcome.NO_CAPABILITY_MATCH, Outcome.NO_SELECTOR_MATCH, Outcome.ALL_CANDIDATES_DOWN)


@dataclass(frozen=True, slots=True)
class Pick:
    message_id: str
    envelope: Envelope
    instance_id: str
    fields: dict[str, bytes | str]


class WaitingRoom:
    def __init__(self, store: MessageStore, table: RoutingTable, *, batch: int) -> None:
        self.store = store
        self.table = table
        self.assigner = Assigner(store, table)
        self.batch = batch

    async def drain(self, capability: str) -> int:
        """Assign waiting messages of ``capability`` to free credits, by priority then age."""
        now = now_ms()
        free = self.table.free_credits(capability, now_ms=now)
        if free <= 0:
            return 0
        head = await self.store.waiting_head(capability, min(free, self.batch))
        records = await self.store.get_records(head)
        stale = [i for i, r in zip(head, records, strict=True) if not _may_wait(r)]
        waiting = [r for r in records if r is not None and r.stage is Stage.WAITING]
        picks = await self._pick(waiting, now)
        won = await self._claim(capability, picks)
        done = await self.assigner.assign(won)
        # Still indexed: the refused ones keep their waiting-set entry.
        await self.store.unpark_many(capability, [r.message_id for r in done] + stale)
        return len(done)

    async def _pick(self, waiting: list[MessageRecord], now: int) -> list[Pick]:
        envelopes = [load_envelope(r.envelope) for r in waiting]
        sessions = await self.store.sessions(
            sorted({e.session_id for e in envelopes if e.session_id})
        )
        picks = []
        for envelope in envelopes:
            decision = self.table.decide(route_request(envelope, sessions), now_ms=now)
            instance_id = routed_instance(decision)
            if instance_id is None:
                break  # nothing fits now: the rest keep their place in line
            picks.append(
                Pick(envelope.message_id, envelope, instance_id, decision_fields(decision))
            )
            if envelope.session_id:
                sessions[envelope.session_id] = instance_id
        return picks

    async def _claim(self, capability: str, picks: list[Pick]) -> list[Routed]:
        """WAITING -> ROUTED (a new attempt); the winners are this dispatcher's to assign."""
        moved = await self.store.move_many(
            [
                Move(
                    p.message_id,
                    Stage.ROUTED,
                    only_from=Stage.WAITING,
                    new_attempt="+",
                    new_instance=p.instance_id,
                    reason=str(p.fields["route_reason"]),
                    fields=p.fields,
                )
                for p in picks
            ]
        )
        won = []
        for p, m in zip(picks, moved, strict=True):
            if m.ok:
                won.append(
                    Routed(
                        p.message_id, capability, p.instance_id, m.attempt, p.envelope.priority, 0
                    )
                )
            else:
                self.table.unreserve(p.instance_id)
        await self.store.bind_sessions(
            [(p.envelope.session_id, p.instance_id) for p in picks if p.envelope.session_id]
        )
        return won

    async def expire_due(self, *, limit: int = 500) -> int:
        """End the waiting messages whose deadline has passed; forget the other due entries."""
        now = now_ms()
        due = await self.store.due_now(now, limit)
        if not due:
            return 0
        records = await self.store.get_records(due)
        expired = 0
        for record in records:
            if record is not None and record.stage is Stage.WAITING:
                expired += await self._expire(record, now)
        await self.store.forget_due(due)
        return expired

    async def _expire(self, record: MessageRecord, now: int) -> int:
        reason = self._why_unserved(record, now)
        moved = await self.store.move(
            record.id,
            Stage.EXPIRED,
            only_from=Stage.WAITING,
            reason=reason,
            fields={"error": reason},
        )
        if not moved.ok:
            return 0
        await self.store.unpark_many(record.capability, [record.id])
        if record.reply_to:
            await self.store.send_reply(
                record.reply_to, {"id": record.id, "stage": Stage.EXPIRED.value, "error": reason}
            )
        log.info("message %s expired: %s", record.id, reason)
        return 1

    def _why_unserved(self, record: MessageRecord, now: int) -> str:
        """Why a message is still waiting at its deadline, asked of the funnel again now."""
        envelope = load_envelope(record.envelope)
        t = self.table
        decision = route(
            route_request(envelope, {}), t.index, t.inflight, now_ms=now, rng=t.rng, policy=t.policy
        )
        if decision.outcome in _EXPLAINED:
            return decision.reason
        return "waited_past_deadline"


def _may_wait(record: MessageRecord | None) -> bool:
    return record is not None and record.stage in _MAY_RETURN_TO_WAITING
