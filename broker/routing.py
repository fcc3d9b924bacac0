"""Routing: who can, who is reachable, who fits best. Pure functions over a registry
snapshot — no I/O; time and randomness are arguments, so tests pin them.

The funnel of DESIGN §5, each step recorded in the decision (:class:`Step`: how many were
kept, which were excluded and why):

1. **capability** — exact match (``strict``), or through the alias map (``loose``);
2. **selectors** — ``tags`` exact match, ``target`` (agent or instance id), cost within
   ``budget``, weight above zero;
3. **state** — DOWN (said so, or silent past ``down_after_ms``) and DRAINING out; cooled-down
   and open-circuit instances out too, unless more than ``panic_threshold`` of the live ones
   are ejected (Envoy's panic threshold: better a weak route than none);
4. **load** — instances at ≥ ``load_cut`` of their credits out, unless all are (then the
   least loaded stay);
5. **score** — ``reach = alive × health × load × latency × confidence × weight``;
6. **choose** — the session's instance when it survived the funnel; otherwise a weighted
   random pick (by reach) among the *top group*: instances whose reach before weight is within
   ``top_ratio`` of the best. Never always the top one; weight shapes traffic share without
   pushing a canary out of the group. Under a ``budget`` the cheapest of the group win ties.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .health import observed_state
from .records import CircuitState, InstanceState, InstanceView

ALIVE = {InstanceState.UP: 1.0, InstanceState.DEGRADED: 0.6}


class Outcome(StrEnum):
    ROUTED = "routed"
    NO_CAPABILITY_MATCH = "no_capability_match"
    NO_SELECTOR_MATCH = "no_selector_match"
    ALL_CANDIDATES_DOWN = "all_candidates_down"
    NO_FREE_CREDIT = "no_free_credit"


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    mode: str = "strict"  # or "loose": resolve through `aliases`
    aliases: Mapping[str, str] = field(default_factory=dict)
    load_cut: float = 0.9
    top_ratio: float = 0.3
    cold_start_successes: int = 20
    cold_start_confidence: float = 0.8
    panic_threshold: float = 0.5
    down_after_ms: int = 15_000
    max_listed: int = 20  # exclusions listed per step; the rest are counted


@dataclass(frozen=True, slots=True)
class RouteRequest:
    capability: str
    tags: Mapping[str, str] = field(default_factory=dict)
    target: str | None = None
    session_instance: str | None = None
    budget: float | None = None


@dataclass(slots=True)
class Step:
    """One funnel step: how many candidates it kept, and the ones it excluded, with why."""

    name: str
    kept: int
    excluded: list[tuple[str, str]] = field(default_factory=list)
    more: int = 0  # exclusions beyond the listed ones

    def exclude(self, instance_id: str, why: str, limit: int) -> None:
        if len(self.excluded) < limit:
            self.excluded.append((instance_id, why))
        else:
            self.more += 1

    def to_builtins(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.name, "kept": self.kept}
        if self.excluded:
            out["excluded"] = dict(self.excluded)
        if self.more:
            out["more_excluded"] = self.more
        return out


@dataclass(frozen=True, slots=True)
class Factors:
    alive: float
    health: float
    load: float
    latency: float
    confidence: float
    weight: float

    @property
    def reach(self) -> float:
        return self.alive * self.health * self.load * self.latency * self.confidence * self.weight

    def to_builtins(self) -> dict[str, float]:
        return {
            "reach": round(self.reach, 4),
            "alive": self.alive,
            "health": round(self.health, 4),
            "load": round(self.load, 4),
            "latency": round(self.latency, 4),
            "confidence": self.confidence,
            "weight": self.weight,
        }


@dataclass(slots=True)
class Decision:
    outcome: Outcome
    instance: InstanceView | None
    reason: str
    steps: list[Step]
    factors: Factors | None = None
    nearest: list[str] = field(default_factory=list)

    def route_from(self) -> list[dict[str, Any]]:
        return [step.to_builtins() for step in self.steps]


class RegistryIndex:
    """A snapshot indexed by capability, built once per refresh."""

    def __init__(self, instances: Iterable[InstanceView]) -> None:
        self.instances = list(instances)
        self.by_capability: dict[str, list[InstanceView]] = {}
        for view in self.instances:
            for capability in view.card.capabilities:
                self.by_capability.setdefault(capability, []).append(view)
        self.capabilities = sorted(self.by_capability)

    def nearest(self, capability: str, n: int = 3) -> list[str]:
        """Registered capabilities closest to ``capability`` (a typo's likely intent)."""
        return difflib.get_close_matches(capability, self.capabilities, n=n, cutoff=0.6)


def factors(view: InstanceView, state: InstanceState, used: int, policy: RoutingPolicy) -> Factors:
    stats = view.stats
    return Factors(
        alive=ALIVE.get(state, 0.0),
        health=max(0.0, 1.0 - stats.error_rate),
        load=max(0.1, 1.0 - used / max(view.credits, 1)),
        latency=max(0.2, 1.0 - stats.p95_ms / 1000.0),
        confidence=(
            policy.cold_start_confidence if stats.successes < policy.cold_start_successes else 1.0
        ),
        weight=view.card.weight,
    )


def route(
    request: RouteRequest,
    index: RegistryIndex,
    inflight: Mapping[str, int],
    *,
    now_ms: int,
    rng: random.Random,
    policy: RoutingPolicy,
) -> Decision:
    """Run the funnel for one request; ``inflight`` is the caller's live credit count."""
    capability = request.capability
    if policy.mode == "loose":
        capability = policy.aliases.get(capability, capability)
    pool = index.by_capability.get(capability, [])
    steps = [Step("capability", len(pool), more=len(index.instances) - len(pool))]
    if not pool:
        nearest = index.nearest(request.capability)
        hint = f"; nearest registered: {', '.join(nearest)}" if nearest else ""
        reason = f"no_capability_match: no instance serves {request.capability!r}{hint}"
        return Decision(Outcome.NO_CAPABILITY_MATCH, None, reason, steps, nearest=nearest)
    pool = _selectors(request, pool, steps, policy)
    if not pool:
        return Decision(Outcome.NO_SELECTOR_MATCH, None, "no_selector_match", steps)
    live = _live(pool, steps, now_ms, policy)
    if not live:
        return Decision(Outcome.ALL_CANDIDATES_DOWN, None, "all_candidates_down", steps)
    fit = _load_cut(live, inflight, steps, policy)
    if not fit:
        return Decision(Outcome.NO_FREE_CREDIT, None, "no_free_credit", steps)
    return _choose(request, fit, inflight, steps, rng, policy)


def _selectors(
    request: RouteRequest, pool: list[InstanceView], steps: list[Step], policy: RoutingPolicy
) -> list[InstanceView]:
    if not (request.tags or request.target or request.budget is not None) and all(
        v.card.weight > 0 for v in pool
    ):
        steps.append(Step("selectors", len(pool)))
        return pool
    step = Step("selectors", 0)
    kept = []
    for view in pool:
        why = _selector_miss(request, view)
        if why:
            step.exclude(view.instance_id, why, policy.max_listed)
        else:
            kept.append(view)
    step.kept = len(kept)
    steps.append(step)
    return kept


def _selector_miss(request: RouteRequest, view: InstanceView) -> str:
    card = view.card
    for key, wanted in request.tags.items():
        if card.tags.get(key) != wanted:
            return f"tag {key}={card.tags.get(key)!r}, wanted {wanted!r}"
    if request.target and request.target not in (card.instance_id, card.agent_id):
        return f"not the target {request.target!r}"
    if request.budget is not None and card.cost > request.budget:
        return f"cost {card.cost} over budget {request.budget}"
    if card.weight <= 0:
        return "weight 0"
    return ""


def _live(
    pool: list[InstanceView], steps: list[Step], now_ms: int, policy: RoutingPolicy
) -> list[tuple[InstanceView, InstanceState]]:
    """Drop DOWN and DRAINING; drop ejected ones (cooldown, open circuit) unless in panic."""
    step = Step("state", 0)
    alive: list[tuple[InstanceView, InstanceState]] = []
    ejected: list[tuple[InstanceView, InstanceState, str]] = []
    for view in pool:
        state = observed_state(view, now_ms=now_ms, down_after_ms=policy.down_after_ms)
        if state not in ALIVE:
            lapsed = state is not view.state
            step.exclude(
                view.instance_id, "heartbeat lapsed" if lapsed else state.value, policy.max_listed
            )
            continue
        why = _ejection(view, now_ms)
        if why:
            ejected.append((view, state, why))
        else:
            alive.append((view, state))
    if ejected and len(ejected) > policy.panic_threshold * (len(alive) + len(ejected)):
        alive += [(view, state) for view, state, _ in ejected]  # panic: ejection ignored
        for view, _, why in ejected:
            step.exclude(view.instance_id, f"{why} (kept: panic threshold)", policy.max_listed)
    else:
        for view, _, why in ejected:
            step.exclude(view.instance_id, why, policy.max_listed)
    step.kept = len(alive)
    steps.append(step)
    return alive


def _ejection(view: InstanceView, now_ms: int) -> str:
    stats = view.stats
    if stats.cooldown_until_ms > now_ms:
        return "cooldown"
    if stats.circuit is CircuitState.OPEN and stats.circuit_until_ms > now_ms:
        return "circuit open"
    return ""


def _load_cut(
    live: list[tuple[InstanceView, InstanceState]],
    inflight: Mapping[str, int],
    steps: list[Step],
    policy: RoutingPolicy,
) -> list[tuple[InstanceView, InstanceState]]:
    """Below the load cut; if none is, the least loaded — and only with a free credit."""
    step = Step("load", 0)
    loads = [(inflight.get(v.instance_id, v.inflight) / max(v.credits, 1), v, s) for v, s in live]
    kept = [(v, s) for load, v, s in loads if load < policy.load_cut]
    if not kept:
        least = min(load for load, _, _ in loads)
        kept = [(v, s) for load, v, s in loads if load == least and load < 1.0]
    kept_ids = {v.instance_id for v, _ in kept}
    for load, view, _ in loads:
        if view.instance_id not in kept_ids:
            step.exclude(view.instance_id, f"load {load:.0%}", policy.max_listed)
    step.kept = len(kept)
    steps.append(step)
    return kept


def _choose(
    request: RouteRequest,
    fit: Sequence[tuple[InstanceView, InstanceState]],
    inflight: Mapping[str, int],
    steps: list[Step],
    rng: random.Random,
    policy: RoutingPolicy,
) -> Decision:
    scored = [
        (view, factors(view, state, inflight.get(view.instance_id, view.inflight), policy))
        for view, state in fit
    ]
    steps.append(Step("score", len(scored)))
    if request.session_instance:
        for view, f in scored:
            if view.instance_id == request.session_instance:
                reason = f"session affinity (reach {f.reach:.3f})"
                return Decision(Outcome.ROUTED, view, reason, steps, f)
    unweighted = [f.reach / f.weight for _, f in scored]
    cut = (1.0 - policy.top_ratio) * max(unweighted)
    top = [(v, f) for (v, f), u in zip(scored, unweighted, strict=True) if u >= cut]
    if request.budget is not None:
        cheapest = min(v.card.cost for v, _ in top)
        top = [(v, f) for v, f in top if v.card.cost == cheapest]
    view, f = top[0] if len(top) == 1 else rng.choices(top, weights=[f.reach for _, f in top])[0]
    steps.append(Step("choose", len(top)))
    reason = f"weighted random among top {len(top)} of {len(scored)} (reach {f.reach:.3f})"
    return Decision(Outcome.ROUTED, view, reason, steps, f)
