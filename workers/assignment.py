"""Turning routing decisions into assignments: the shared last step of dispatch and drain.

A decision becomes a record write (the record moves first, ROUTED to the
instance at an attempt) and then an assignment (``assign.lua``: the entry on the instance's
stream, only against a free credit). A refused assignment moves the record back to WAITING
and gives the attempt number back: no stream entry exists for it.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from broker.envelope import Envelope
from broker.records import AssignResult, Moved
from broker.resp import Command
from broker.routing import Decision, Outcome, RouteRequest
from broker.stages import Stage
from broker.store import MessageStore, Move
from broker.timekeeping import now_ms
from broker.waiting_sets import count_assigned_commands, park_commands, parks_hint
from broker.wire import route_from_json

from .budget_watch import BudgetWatch
from .rate_gate import Limited, RateGate
from .routing_table import RoutingTable

OK = (AssignResult.ASSIGNED, AssignResult.ALREADY_ASSIGNED)


@dataclass(frozen=True, slots=True)
class Routed:
    """A record that is ROUTED and must now be assigned (or go back to WAITING)."""

    message_id: str
    capability: str
    instance_id: str
    attempt: int
    priority: int
    accepted_ms: int
    tenant: str | None = None


class Assigned(NamedTuple):
    """The attempts assigned, and the writes that may follow them in the caller's next round
    trip, at no cost of their own: the assignment counters (a statistic; one lost to a
    failure is only a count)."""

    routed: list[Routed]
    after: list[Command]


def route_request(
    envelope: Envelope, sessions: dict[str, str], *, avoid: str = "", cheapest: bool = False
) -> RouteRequest:
    return RouteRequest(
        capability=envelope.capability,
        tags=envelope.tags,
        target=envelope.target,
        session_instance=sessions.get(envelope.session_id) if envelope.session_id else None,
        budget_per_task=envelope.budget_per_task,
        avoid=avoid or None,
        cheapest=cheapest,
    )


def decision_fields(decision: Decision) -> dict[str, Any]:
    """What the record keeps of a decision: ``route_from`` (the funnel, step by step) and
    ``route_reason`` (why the winner won, or why nothing could)."""
    if any(step.excluded or step.more for step in decision.steps):
        route_from = route_from_json(decision.route_from())
    else:
        route_from = _plain_route_from(tuple((step.name, step.kept) for step in decision.steps))
    return {"route_from": route_from, "route_reason": decision.reason}


@functools.lru_cache(maxsize=1024)
def _plain_route_from(steps: tuple[tuple[str, int], ...]) -> bytes:
    """``route_from`` of a funnel that excluded no one, by its steps' names and counts: most
    decisions of a busy dispatcher have one of a few (encoding each was 5 % of its CPU)."""
    return route_from_json([{"step": name, "kept": kept} for name, kept in steps])


def routed_instance(decision: Decision) -> str | None:
    if decision.outcome is Outcome.ROUTED and decision.instance is not None:
        return decision.instance.instance_id
    return None


class Assigner:
    def __init__(self, store: MessageStore, table: RoutingTable) -> None:
        self.store = store
        self.table = table
        self.gate = RateGate(store.conn, table)
        self.budgets = BudgetWatch(store.conn)  # one view of spending for admission and drain

    async def assign(
        self,
        routed: list[Routed],
        *,
        ahead: Sequence[Command] = (),
        known: Mapping[str, AssignResult] | None = None,
        counted: Collection[str] = (),
    ) -> Assigned:
        """Assign each ROUTED attempt within the rate limits; the refused go back to WAITING
        and are parked. ``ahead``: writes made before the assignments, in their round trip on
        one server (admission's deadline entries). ``known``: the answers of assignments
        already made (with the record, ``lua/accept_assign.lua``), by message id; those in
        ``counted`` were counted by their script too (``lua/claim_assign.lua``)."""
        now = now_ms()
        await self._saturated_instances(now)
        if not routed:
            await self.store.conn.run_all(list(ahead))
            return Assigned([], [])
        known = known or {}
        refused: list[tuple[Routed, str, int]] = []  # (attempt, why, retry at ms or 0)
        asked = [r for r in routed if r.message_id not in known]
        if self.gate.active:
            scopes = [self.gate.scopes(r.capability, r.instance_id, r.tenant) for r in asked]
            verdicts = await self.gate.check(scopes, now)
            refused = [self._limited(r, v, now) for r, v in zip(asked, verdicts, strict=True) if v]
            asked = [r for r, v in zip(asked, verdicts, strict=True) if v is None]
        answers = await self.store.credits.assign_many(
            [(r.instance_id, r.message_id, r.attempt) for r in asked], ahead=ahead
        )
        routed = [r for r in routed if r.message_id in known] + asked
        results = [known[r.message_id] for r in routed if r.message_id in known] + answers
        for r, res in zip(routed, results, strict=True):
            if res not in OK:
                refused.append(self._refused(r, res, now))
        await self._send_back(refused)
        counts = Counter(
            r.capability
            for r, res in zip(routed, results, strict=True)
            if res is AssignResult.ASSIGNED and r.message_id not in counted
        )
        return Assigned(
            [r for r, res in zip(routed, results, strict=True) if res in OK],
            count_assigned_commands(self.store.keys, counts, now_ms()),
        )

    async def _send_back(self, refused: list[tuple[Routed, str, int]]) -> None:
        """The refused back to WAITING, and parked where the move was made: before anything
        acknowledges the work that led here, so a failed park leaves that work to be done
        again."""
        moved = await self.return_to_waiting(refused)
        await self.store.conn.run_all(
            park_commands(
                self.store.keys,
                [  # one held by a limit takes the place of one that comes when it may go
                    (r.capability, r.message_id, r.priority, retry_at or r.accepted_ms)
                    for (r, _, retry_at), m in zip(refused, moved, strict=True)
                    if m.ok
                ],
                hint=parks_hint(self.store.conn),
            )
        )

    async def _saturated_instances(self, now: int) -> None:
        """``rate_limit.saturated`` for the instances routing found over their rate."""
        if not self.table.saturated:
            return
        over = [
            Limited(("instance", inst), int(self.table.held.get(inst, now)))
            for inst in sorted(self.table.saturated)
        ]
        self.table.saturated.clear()
        await self.gate.saturated(over, now)

    def _limited(self, r: Routed, limited: Limited, now: int) -> tuple[Routed, str, int]:
        """Over a config limit. A tenant's or capability's holds the message until the limit
        lets it through; an agent's holds that agent's instances, so another agent may serve."""
        self.table.unreserve(r.instance_id)
        kind, name = limited.scope
        if kind == "agent":
            for view in self.table.index.instances:
                if view.card.agent_id == name:
                    self.table.held_until(view.instance_id, limited.retry_at_ms, now)
            return r, limited.reason, 0
        return r, limited.reason, limited.retry_at_ms

    def _refused(self, r: Routed, res: AssignResult, now: int) -> tuple[Routed, str, int]:
        if res is AssignResult.RATE_LIMITED:  # the instance's own limit, checked with the credit
            self.table.unreserve(r.instance_id)
            self.table.rate_refused(r.instance_id, now)
            self.table.saturated.add(r.instance_id)
            return r, f"rate_limited: instance {r.instance_id!r} over its rate limit", 0
        self.table.mark_full(r.instance_id)
        return r, f"assignment to {r.instance_id} refused: {res.name.lower()}", 0

    async def return_to_waiting(self, refused: list[tuple[Routed, str, int]]) -> list[Moved]:
        """The credit was gone by the time the assignment ran, or a rate limit said not yet:
        ROUTED -> WAITING (a rate limit's with the time to retry at)."""
        if not refused:
            return []
        return await self.store.move_many(
            [
                Move(
                    r.message_id,
                    Stage.WAITING,
                    only_from=Stage.ROUTED,
                    expect_attempt=r.attempt,
                    expect_instance=r.instance_id,
                    # No stream entry exists for a refused attempt: give the number back, so
                    # `attempt` counts deliveries, not lost races for a credit.
                    new_attempt=r.attempt - 1,
                    reason=why,
                    fields={"retry_at_ms": retry_at} if retry_at else None,
                )
                for r, why, retry_at in refused
            ]
        )
