"""Routing: who can, who is reachable, who fits best. Pure functions over a registry
snapshot — no I/O; time and randomness are arguments, so tests pin them.

The funnel of DESIGN §5, each step recorded in the decision (:class:`Step`: how many were
kept, which were excluded and why):

1. **capability** — exact match (``strict``), or through the alias map (``loose``);
2. **selectors** — ``tags`` exact match, ``target`` (agent or instance id), cost within
   ``budget``, weight above zero;
3. **state** — DOWN (said so, or silent past ``down_after_ms``), DRAINING and backing-off
   (429/503 with ``Retry-After``) out; cooled-down and open-circuit instances out too, unless
   more than ``panic_threshold`` of the live ones are ejected (Envoy's panic threshold:
   better a weak route than none);
4. **load** — instances at ≥ ``load_cut`` of their credits out, unless all are (then the
   least loaded stay);
   then **rate** — instances over their rate limit (``sidecar --rate``) out until they may
   be called again (the dispatcher's estimate, :mod:`broker.gcra`; ``assign.lua`` decides);
5. **score** — ``reach = alive × health × load × latency × confidence × weight``, by
   :func:`reach_scores` (health and latency precomputed per snapshot, the weight applied at
   the pick);
6. **choose** — the session's instance when it survived the funnel; otherwise a weighted
   random pick (by reach) among the *top group*: instances whose reach before weight is within
   ``top_ratio`` of the best. Never always the top one; weight shapes traffic share without
   pushing a canary out of the group. Under a ``budget`` the cheapest of the group win ties.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .records import CircuitState, InstanceState, InstanceView
from .routing_types import Decision, Factors, Outcome, RouteRequest, RoutingPolicy, Step

__all__ = [
    "Candidate",
    "Decision",
    "Factors",
    "Outcome",
    "RegistryIndex",
    "RouteRequest",
    "RoutingPolicy",
    "Step",
    "factors",
    "reach_scores",
    "route",
]

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


def _explain(c: Candidate, load: float, before_weight: float, policy: RoutingPolicy) -> Factors:
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
    return _explain(candidate, load, before_weight, policy)


def route(
    request: RouteRequest,
    index: RegistryIndex,
    inflight: Mapping[str, int],
    *,
    now_ms: int,
    rng: random.Random,
    policy: RoutingPolicy,
    held: Mapping[str, float] | None = None,
) -> Decision:
    """Run the funnel for one request; ``inflight`` is the caller's live credit count,
    ``held`` when instances over their rate limit may be called again (ms; only those)."""
    capability = request.capability
    if policy.mode == "loose":
        capability = policy.aliases.get(capability, capability)
    pool = index.candidates.get(capability, [])
    steps = [Step("capability", len(pool), more=len(index.instances) - len(pool))]
    if not pool:
        nearest = index.nearest(request.capability)
        hint = f"; nearest registered: {', '.join(nearest)}" if nearest else ""
        reason = f"no_capability_match: no instance serves {request.capability!r}{hint}"
        return Decision(Outcome.NO_CAPABILITY_MATCH, None, reason, steps, nearest=nearest)
    selected = _selectors(request, pool, steps, policy)
    if not selected:
        return Decision(Outcome.NO_SELECTOR_MATCH, None, "no_selector_match", steps)
    fast = None
    if (
        selected is pool
        and now_ms - policy.down_after_ms <= index.first_lapse_ms[capability]
        and now_ms >= index.first_ejection_end_ms[capability]
        and len(index.alive[capability]) == len(pool)
    ):
        fast = index.alive[capability]
    live = _live(selected, steps, now_ms, policy, fast)
    if not live:
        return Decision(Outcome.ALL_CANDIDATES_DOWN, None, "all_candidates_down", steps)
    if request.avoid is not None and len(live) > 1:
        live = _avoid(request.avoid, live, steps)
    if held:
        before = live
        live = _rate(live, held, now_ms, steps, policy)
        if not live:
            ready = min(held[c.instance_id] for c in before) - now_ms
            reason = (
                f"rate_limited: every candidate is over its rate limit (next in {ready:.0f} ms)"
            )
            return Decision(Outcome.RATE_LIMITED, None, reason, steps)
    fit = _load_cut(live, inflight, steps, policy)
    if not fit:
        return Decision(Outcome.NO_FREE_CREDIT, None, "no_free_credit", steps)
    return _choose(request, fit, inflight, steps, rng, policy)


def _selectors(
    request: RouteRequest, pool: list[Candidate], steps: list[Step], policy: RoutingPolicy
) -> list[Candidate]:
    if not (request.tags or request.target or request.budget is not None):
        kept = [c for c in pool if c.weight > 0]
        if len(kept) == len(pool):
            steps.append(Step("selectors", len(pool)))
            return pool
    step = Step("selectors", 0)
    kept = []
    for c in pool:
        why = _selector_miss(request, c)
        if why:
            step.exclude(c.instance_id, why, policy.max_listed)
        else:
            kept.append(c)
    step.kept = len(kept)
    steps.append(step)
    return kept


def _selector_miss(request: RouteRequest, c: Candidate) -> str:
    tags = c.view.card.tags
    for key, wanted in request.tags.items():
        if tags.get(key) != wanted:
            return f"tag {key}={tags.get(key)!r}, wanted {wanted!r}"
    if request.target and request.target not in (c.instance_id, c.agent_id):
        return f"not the target {request.target!r}"
    if request.budget is not None and c.cost > request.budget:
        return f"cost {c.cost} over budget {request.budget}"
    if c.weight <= 0:
        return "weight 0"
    return ""


def _live(
    pool: list[Candidate],
    steps: list[Step],
    now_ms: int,
    policy: RoutingPolicy,
    fast: list[Candidate] | None = None,
) -> list[Candidate]:
    """Drop DOWN (reported, or silent too long), DRAINING and instances without credits; drop
    ejected ones (cooldown, open circuit) unless more than the panic threshold of the live
    ones are ejected. ``fast``: the index's precomputed answer, valid when nobody lapsed and
    no ejection is running."""
    if fast is not None:
        steps.append(Step("state", len(fast)))
        return fast
    silent_before = now_ms - policy.down_after_ms
    alive = [c for c in pool if c.alive and c.credits > 0 and c.heartbeat_ms >= silent_before]
    step = Step("state", 0)
    backing_off = [c for c in alive if c.backoff_until_ms > now_ms]
    if backing_off:  # the agent asked for time (Retry-After): never overridden by panic
        step.exclude_all(
            [(c.instance_id, "backing off (Retry-After)") for c in backing_off], policy.max_listed
        )
        alive = [c for c in alive if c.backoff_until_ms <= now_ms]
    ejected = [c for c in alive if c.eject_until_ms > now_ms]
    if len(alive) < len(pool):
        step.exclude_all(
            [
                (c.instance_id, _why_down(c, silent_before))
                for c in pool
                if not c.alive or c.credits <= 0 or c.heartbeat_ms < silent_before
            ],
            policy.max_listed,
        )
    if ejected:
        panic = len(ejected) > policy.panic_threshold * len(alive)
        suffix = " (kept: panic threshold)" if panic else ""
        step.exclude_all(
            [(c.instance_id, c.eject_reason + suffix) for c in ejected], policy.max_listed
        )
        if not panic:
            alive = [c for c in alive if c.eject_until_ms <= now_ms]
    step.kept = len(alive)
    steps.append(step)
    return alive


def _why_down(c: Candidate, silent_before: int) -> str:
    if not c.alive:
        return c.view.state.value
    if c.credits <= 0:
        return "no credits"
    return "heartbeat lapsed"


def _avoid(instance_id: str, live: list[Candidate], steps: list[Step]) -> list[Candidate]:
    """A retry goes to another instance than the one that just failed it, where one exists."""
    kept = [c for c in live if c.instance_id != instance_id]
    if len(kept) == len(live):
        return live
    step = Step("avoid", len(kept))
    step.exclude(instance_id, "failed this message's last attempt", 1)
    steps.append(step)
    return kept


def _rate(
    live: list[Candidate],
    held: Mapping[str, float],
    now_ms: int,
    steps: list[Step],
    policy: RoutingPolicy,
) -> list[Candidate]:
    """Out: instances over their rate limit (``sidecar --rate``) until they may be called."""
    over = [(c, held[c.instance_id]) for c in live if held.get(c.instance_id, 0) > now_ms]
    if not over:
        return live
    step = Step("rate", len(live) - len(over))
    step.exclude_all(
        [(c.instance_id, f"rate limited for {until - now_ms:.0f} ms") for c, until in over],
        policy.max_listed,
    )
    steps.append(step)
    out = {c.instance_id for c, _ in over}
    return [c for c in live if c.instance_id not in out]


def _load_cut(
    live: list[Candidate], inflight: Mapping[str, int], steps: list[Step], policy: RoutingPolicy
) -> list[tuple[Candidate, float]]:
    """Below the load cut; if none is, the least loaded — and only with a free credit.
    Returns ``(candidate, load)`` pairs."""
    get = inflight.get
    cut = policy.load_cut
    loads = [(c, get(c.instance_id, c.inflight) * c.inv_credits) for c in live]
    kept = [pair for pair in loads if pair[1] < cut]
    if len(kept) == len(loads):
        steps.append(Step("load", len(kept)))
        return kept
    if not kept:
        least = min(load for _, load in loads)
        kept = [(c, load) for c, load in loads if load == least and load < 1.0]
    step = Step("load", len(kept))
    kept_ids = {c.instance_id for c, _ in kept}
    step.exclude_all(
        [(c.instance_id, f"load {load:.0%}") for c, load in loads if c.instance_id not in kept_ids],
        policy.max_listed,
    )
    steps.append(step)
    return kept


def _choose(
    request: RouteRequest,
    fit: list[tuple[Candidate, float]],
    inflight: Mapping[str, int],
    steps: list[Step],
    rng: random.Random,
    policy: RoutingPolicy,
) -> Decision:
    scored = reach_scores(fit, policy)
    steps.append(Step("score", len(scored)))
    if request.session_instance:
        for c, score in scored:
            if c.instance_id == request.session_instance:
                steps.append(Step("choose", 1))
                f = _explain_chosen(c, score, inflight, policy)
                reason = f"session affinity (reach {f.reach:.3f})"
                return Decision(Outcome.ROUTED, c.view, reason, steps, f)
    best = max([score for _, score in scored])
    floor = (1.0 - policy.top_ratio) * best
    top = [(c, score) for c, score in scored if score >= floor]
    if request.cheapest:
        top = scored
    if request.budget is not None or request.cheapest:
        cheapest = min(c.cost for c, _ in top)
        top = [(c, score) for c, score in top if c.cost == cheapest]
    weights = [score * c.weight for c, score in top]
    if len(top) == 1:
        chosen, score = top[0]
    elif sum(weights) > 0:
        chosen, score = rng.choices(top, weights=weights)[0]
    else:  # every one scores zero (e.g. all failing): no reason to prefer any
        chosen, score = rng.choice(top)
    steps.append(Step("choose", len(top)))
    f = _explain_chosen(chosen, score, inflight, policy)
    reason = f"weighted random among top {len(top)} of {len(scored)} (reach {f.reach:.3f})"
    if request.cheapest:
        reason = (
            f"cheapest of {len(scored)} (cost {chosen.cost:g}, over budget; reach {f.reach:.3f})"
        )
    return Decision(Outcome.ROUTED, chosen.view, reason, steps, f)


def _explain_chosen(
    c: Candidate, before_weight: float, inflight: Mapping[str, int], policy: RoutingPolicy
) -> Factors:
    """The winner's factors, from the load share the load step measured (its state passed the
    funnel, so the reported one is the observed one)."""
    load = inflight.get(c.instance_id, c.inflight) * c.inv_credits
    return _explain(c, load, before_weight, policy)
