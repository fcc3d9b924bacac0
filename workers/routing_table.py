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
from broker.health import observed_state
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
        self.inflight: dict[str, int] = {}

    @property
    def instances(self) -> list[InstanceView]:
        return self.index.instances

    def load(self, instances: list[InstanceView]) -> None:
        self.index = RegistryIndex(instances)
        self.inflight = {v.instance_id: v.inflight for v in instances}

    def decide(self, request: RouteRequest, *, now_ms: int) -> Decision:
        """Run the funnel; a routed decision counts one credit taken on its instance."""
        decision = self.evaluate(request, now_ms=now_ms)
        if decision.outcome is Outcome.ROUTED and decision.instance is not None:
            inst = decision.instance.instance_id
            self.inflight[inst] = self.inflight.get(inst, 0) + 1
        return decision

    def evaluate(self, request: RouteRequest, *, now_ms: int) -> Decision:
        """Run the funnel without taking a credit: what would happen to this request now."""
        started = time.perf_counter()
        decision = route(
            request, self.index, self.inflight, now_ms=now_ms, rng=self.rng, policy=self.policy
        )
        process_metrics.routing_decision(time.perf_counter() - started)
        return decision

    def unreserve(self, instance_id: str) -> None:
        """Give back a credit counted by :meth:`decide` that was not used."""
        if instance_id and self.inflight.get(instance_id, 0) > 0:
            self.inflight[instance_id] -= 1

    def credits_released(self, instance_id: str, in_use: int) -> tuple[str, ...]:
        """A sidecar announced its credits in use; returns the capabilities it serves."""
        for view in self.index.instances:
            if view.instance_id == instance_id:
                self.inflight[instance_id] = in_use
                return view.card.capabilities
        return ()

    def mark_full(self, instance_id: str) -> None:
        for view in self.index.instances:
            if view.instance_id == instance_id:
                self.inflight[instance_id] = view.credits

    def free_credits(self, capability: str, *, now_ms: int) -> int:
        """Free credits on routable instances of ``capability`` (sizes a drain)."""
        if self.policy.mode == "loose":
            capability = self.policy.aliases.get(capability, capability)
        total = 0
        for view in self.index.by_capability.get(capability, []):
            state = observed_state(view, now_ms=now_ms, down_after_ms=self.policy.down_after_ms)
            if state in _ROUTABLE:
                total += max(0, view.credits - self.inflight.get(view.instance_id, 0))
        return total
