"""The dispatcher's local view for routing: a registry snapshot plus its own credit count.

Routing decisions never cost a Redis round trip: the snapshot is refreshed on registry
notifications and every sweep, and credits taken since are counted here. The Lua assignment
stays the real check; this only keeps the dispatcher from offering work it knows cannot fit.
"""

from __future__ import annotations

import random
import time

from broker import process_metrics
from broker.config import Settings
from broker.gcra import gcra, ready_at
from broker.health import observed_state
from broker.ranking import Rankings
from broker.records import InstanceState, InstanceView
from broker.routing import Decision, Outcome, RegistryIndex, RouteRequest, RoutingPolicy, route

_ROUTABLE = (InstanceState.UP, InstanceState.DEGRADED)


def routing_policy(settings: Settings) -> RoutingPolicy:
    return RoutingPolicy(
        mode=settings.capability_mode,
        aliases=settings.capability_aliases,
        load_cut=settings.load_cut,
        top_ratio=settings.top_ratio,
        cold_start_successes=settings.cold_start_successes,
        cold_start_confidence=settings.cold_start_confidence,
        panic_threshold=settings.panic_threshold,
        down_after_ms=int(settings.down_after_s * 1000),
        max_listed=settings.route_from_max_listed,
    )


class RoutingTable:
    def __init__(self, policy: RoutingPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.rng = rng or random.Random()
        self.index = RegistryIndex([])
        # credits in use per instance as this dispatcher counts them; every change goes
        # through _count so the rankings (broker/ranking.py) move with it
        self.inflight: dict[str, int] = {}
        self.rankings = Rankings(policy)
        # instances with a rate limit: the local GCRA state, and when each may be called
        # again when that is later than now (broker/gcra.py; assign.lua is the real check)
        self.rates: dict[str, tuple[float, int]] = {}
        self.tat: dict[str, float] = {}
        self.held: dict[str, float] = {}
        # instances a decision found over their rate since the last look (rate_limit.saturated)
        self.saturated: set[str] = set()

    @property
    def instances(self) -> list[InstanceView]:
        return self.index.instances

    def load(self, instances: list[InstanceView]) -> None:
        self.index = RegistryIndex(instances)
        self.inflight = {v.instance_id: v.inflight for v in instances}
        self.rankings = Rankings(self.policy)
        self.rates = {
            v.instance_id: (v.card.rate_ms, v.card.burst) for v in instances if v.card.rate_ms > 0
        }
        # held by their own rate or their agent's: kept while the instance is registered
        self.held = {i: t for i, t in self.held.items() if i in self.index.by_instance}
        self.tat = {i: t for i, t in self.tat.items() if i in self.rates}

    def decide(self, request: RouteRequest, *, now_ms: int) -> Decision:
        """Run the funnel; a routed decision counts one credit taken on its instance."""
        decision = self.evaluate(request, now_ms=now_ms)
        if decision.outcome is Outcome.ROUTED and decision.instance is not None:
            inst = decision.instance.instance_id
            self._count(inst, self.inflight.get(inst, 0) + 1)
            if inst in self.rates:
                self._took(inst, now_ms)
        elif decision.outcome is Outcome.RATE_LIMITED:
            # an instance's own limit only: one held by its agent's is the agent's saturation,
            # reported by the rate gate (workers.rate_gate)
            self.saturated.update(i for i, t in self.held.items() if t > now_ms and i in self.rates)
        return decision

    def _count(self, inst: str, used: int) -> None:
        self.inflight[inst] = used
        self.rankings.moved(inst, used)

    def _took(self, inst: str, now_ms: int) -> None:
        interval, burst = self.rates[inst]
        verdict = gcra(self.tat.get(inst, 0.0), now_ms, interval, burst)
        self.tat[inst] = verdict.tat if verdict.allowed else self.tat.get(inst, 0.0) + interval
        ready = ready_at(self.tat[inst], interval, burst)
        if ready > now_ms:
            self.held[inst] = ready
        else:
            self.held.pop(inst, None)

    def held_until(self, inst: str, ready_ms: float, now_ms: int) -> None:
        """``inst`` may not be called before ``ready_ms`` (the later of what is known)."""
        if ready_ms > now_ms:
            self.held[inst] = max(ready_ms, self.held.get(inst, 0.0))

    def rate_refused(self, inst: str, now_ms: int) -> None:
        """``assign.lua`` found the instance over its rate (other dispatchers call it too):
        held for one interval, when the script is asked again."""
        if inst in self.rates:
            interval, burst = self.rates[inst]
            self.tat[inst] = now_ms + burst * interval
            self.held_until(inst, now_ms + interval, now_ms)

    def agent_of(self, instance_id: str) -> str | None:
        view = self.index.by_instance.get(instance_id)
        return view.card.agent_id if view is not None else None

    def capabilities_of(self, instance_id: str) -> tuple[str, ...]:
        view = self.index.by_instance.get(instance_id)
        return view.card.capabilities if view is not None else ()

    def next_ready_ms(self, now_ms: int) -> float | None:
        """The earliest time a held instance may be called again, if any is held."""
        for inst in [i for i, t in self.held.items() if t <= now_ms]:
            del self.held[inst]
        return min(self.held.values(), default=None)

    def evaluate(self, request: RouteRequest, *, now_ms: int) -> Decision:
        """Run the funnel without taking a credit: what would happen to this request now."""
        started = time.perf_counter()
        decision = route(
            request,
            self.index,
            self.inflight,
            now_ms=now_ms,
            rng=self.rng,
            policy=self.policy,
            held=self.held,
            rankings=self.rankings,
        )
        process_metrics.routing_decision(time.perf_counter() - started)
        return decision

    def unreserve(self, instance_id: str) -> None:
        """Give back a credit counted by :meth:`decide` that was not used."""
        used = self.inflight.get(instance_id, 0) if instance_id else 0
        if used > 0:
            self._count(instance_id, used - 1)

    def credits_released(self, instance_id: str, in_use: int) -> tuple[str, ...]:
        """A sidecar announced its credits in use; returns the capabilities it serves."""
        view = self.index.by_instance.get(instance_id)
        if view is None:
            return ()
        self._count(instance_id, in_use)
        return view.card.capabilities

    def mark_full(self, instance_id: str) -> None:
        view = self.index.by_instance.get(instance_id)
        if view is not None:
            self._count(instance_id, view.credits)

    def free_credits(self, capability: str, *, now_ms: int) -> int:
        """Free credits on routable instances of ``capability`` (sizes a drain)."""
        capability = self.policy.resolve(capability)
        total = 0
        for view in self.index.by_capability.get(capability, []):
            state = observed_state(view, now_ms=now_ms, down_after_ms=self.policy.down_after_ms)
            if state in _ROUTABLE:
                total += max(0, view.credits - self.inflight.get(view.instance_id, 0))
        return total
