"""What routing ranks: each instance of a registry snapshot with its figures precomputed
(:class:`Candidate`), the snapshot indexed by capability (:class:`RegistryIndex`), and the reach
formula (:func:`reach_scores`) with its explanation factor by factor. Pure: no I/O."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from .records import CircuitState, InstanceState, InstanceView
from .routing_types import Factors, RoutingPolicy

ALIVE = {InstanceState.UP: 1.0, InstanceState.DEGRADED: 0.6}


@dataclass(slots=True)
class Candidate:
    """An instance with what routing needs precomputed once per snapshot: a decision then
    touches only plain numbers (200 candidates in well under 100 µs)."""

    view: InstanceView
    instance_id: str
    agent_id: str
    credits: int
    inflight: int
    alive: float  # 1.0 UP, 0.6 DEGRADED, 0.0 otherwise (as reported)
    heartbeat_ms: int
    health: float  # the snapshot's factors of the reach; load and confidence are the decision's
    latency: float
    base: float  # health × latency: one multiplication less per candidate and decision
    successes: int
    weight: float
    cost: float
    eject_until_ms: int
    eject_reason: str
    backoff_until_ms: int
    inv_credits: float  # 1 / credits: a load is one multiplication

    @classmethod
    def of(cls, view: InstanceView, state: InstanceState | None = None) -> Candidate:
        """``view`` ready for routing; ``state`` overrides the reported one (the observed
        state, when silence has made an instance DOWN)."""
        stats = view.stats
        cooldown = stats.cooldown_until_ms
        circuit = stats.circuit_until_ms if stats.circuit is CircuitState.OPEN else 0
        health = max(0.0, 1.0 - stats.error_rate)
        latency = max(0.2, 1.0 - stats.p95_ms / 1000.0)
        return cls(
            view=view,
            instance_id=view.card.instance_id,
            agent_id=view.card.agent_id,
            credits=view.credits,
            inflight=view.inflight,
            alive=ALIVE.get(view.state if state is None else state, 0.0),
            heartbeat_ms=view.heartbeat_ms,
            health=health,
            latency=latency,
            base=health * latency,
            successes=stats.successes,
            weight=view.card.weight,
            cost=view.card.cost,
            eject_until_ms=max(cooldown, circuit),
            eject_reason="cooldown" if cooldown >= circuit else "circuit open",
            backoff_until_ms=stats.backoff_until_ms,
            inv_credits=1.0 / view.credits if view.credits > 0 else 0.0,
        )


class RegistryIndex:
    """A snapshot indexed by capability, built once per refresh."""

    def __init__(self, instances: Iterable[InstanceView]) -> None:
        self.instances = list(instances)
        self.by_instance = {view.instance_id: view for view in self.instances}
        self.by_capability: dict[str, list[InstanceView]] = {}
        self.candidates: dict[str, list[Candidate]] = {}
        for view in self.instances:
            candidate = Candidate.of(view)
            for capability in view.card.capabilities:
                self.by_capability.setdefault(capability, []).append(view)
                self.candidates.setdefault(capability, []).append(candidate)
        self.capabilities = sorted(self.by_capability)
        # Per capability: the reported-alive candidates with credits, and the earliest time
        # one of them falls silent. Before that time a decision skips the per-candidate
        # state checks entirely.
        self.alive: dict[str, list[Candidate]] = {}
        self.first_lapse_ms: dict[str, int] = {}
        self.first_ejection_end_ms: dict[str, int] = {}
        self.weighted = {
            cap: all(c.weight > 0 for c in pool) for cap, pool in self.candidates.items()
        }
        for capability, pool in self.candidates.items():
            alive = [c for c in pool if c.alive and c.credits > 0]
            self.alive[capability] = alive
            self.first_lapse_ms[capability] = min((c.heartbeat_ms for c in alive), default=0)
            self.first_ejection_end_ms[capability] = max(
                (max(c.eject_until_ms, c.backoff_until_ms) for c in alive), default=0
            )

    def nearest(self, capability: str, n: int = 3) -> list[str]:
        """Registered capabilities closest to ``capability`` (a typo's likely intent)."""
        return difflib.get_close_matches(capability, self.capabilities, n=n, cutoff=0.6)


def reach_scores(
    fit: list[tuple[Candidate, float]], policy: RoutingPolicy
) -> list[tuple[Candidate, float]]:
    """The reach before weight, ``alive × health × latency × load × confidence``, of each
    ``(candidate, load share)``: the formula's one home (docs/architecture.md "Routing"), for
    the funnel's ranking, a decision's reason and ``agent-reach agents`` alike.

    ``health × latency`` come precomputed per snapshot (:attr:`Candidate.base`); load and
    confidence are the decision's. It scores a batch, not one candidate a call: the funnel scores
    every candidate that fits, every decision, and a call each would cost more than the
    arithmetic. The weight multiplies in at the pick, so a canary stays in the top group."""
    cold, cold_below = policy.cold_start_confidence, policy.cold_start_successes
    return [
        (
            c,
            c.alive
            * c.base
            * (1.0 - load if load < 0.9 else 0.1)
            * (cold if c.successes < cold_below else 1.0),
        )
        for c, load in fit
    ]


def explain(c: Candidate, load: float, before_weight: float, policy: RoutingPolicy) -> Factors:
    """``c``'s factors for reading, around the figure :func:`reach_scores` gave it. The load
    and confidence factors are written out again here, to be shown one by one;
    ``tests/unit/test_routing.py`` holds their product to that figure."""
    return Factors(
        alive=c.alive,
        health=c.health,
        load=1.0 - load if load < 0.9 else 0.1,
        latency=c.latency,
        confidence=(
            policy.cold_start_confidence if c.successes < policy.cold_start_successes else 1.0
        ),
        weight=c.weight,
        reach=before_weight * c.weight,
    )


def factors(view: InstanceView, state: InstanceState, used: int, policy: RoutingPolicy) -> Factors:
    """The reach of ``view`` in ``state`` with ``used`` credits in use (an instance without
    credits counts as full)."""
    candidate = Candidate.of(view, state)
    load = used / view.credits if view.credits > 0 else 1.0
    ((_, before_weight),) = reach_scores([(candidate, load)], policy)
    return explain(candidate, load, before_weight, policy)
