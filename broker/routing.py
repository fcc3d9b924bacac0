"""Routing: who can, who is reachable, who fits best. Pure functions over a registry
snapshot — no I/O; time and randomness are arguments, so tests pin them.

The funnel of DESIGN §5, each step recorded in the decision (:class:`Step`: how many were
kept, which were excluded and why):

1. **capability** — exact match (``strict``), or through the alias map (``loose``);
2. **selectors** — ``tags`` exact match, ``target`` (agent or instance id), cost within
   ``budget_per_task``, weight above zero;
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
   pushing a canary out of the group. Under a ``budget_per_task`` the cheapest of the group
   win ties.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from .candidates import Candidate, RegistryIndex, explain, factors, reach_scores
from .ranking import Rankings
from .routing_types import Decision, Factors, Outcome, RouteRequest, RoutingPolicy, Step

__all__ = [
    "Candidate",
    "Decision",
    "Factors",
    "Outcome",
    "Rankings",
    "RegistryIndex",
    "RouteRequest",
    "RoutingPolicy",
    "Step",
    "explain",
    "factors",
    "reach_scores",
    "route",
]


def route(
    request: RouteRequest,
    index: RegistryIndex,
    inflight: Mapping[str, int],
    *,
    now_ms: int,
    rng: random.Random,
    policy: RoutingPolicy,
    held: Mapping[str, float] | None = None,
    rankings: Rankings | None = None,
) -> Decision:
    """Run the funnel for one request; ``inflight`` is the caller's live credit count,
    ``held`` when instances over their rate limit may be called again (ms; only those).
    ``rankings``, kept in step with ``inflight`` by the caller (:mod:`broker.ranking`), lets
    the common case skip the per-candidate steps; the decision is the same."""
    capability = policy.resolve(request.capability)
    pool = index.candidates.get(capability, [])
    steps = [Step("capability", len(pool), more=len(index.instances) - len(pool))]
    if not pool:
        return _no_capability(request, index, steps)
    selected = _selectors(request, pool, steps, policy, index.weighted[capability])
    if not selected:
        return Decision(Outcome.NO_SELECTOR_MATCH, None, "no_selector_match", steps)
    fast = _unchanged(index, capability, now_ms, policy) if selected is pool else None
    if rankings is not None and selected is pool and _plain(request, held, now_ms):
        ranked = _ranked(capability, pool, fast, inflight, steps, rng, now_ms, policy, rankings)
        if ranked is not None:
            return ranked
    live = _live(selected, steps, now_ms, policy, fast)
    if not live:
        return Decision(Outcome.ALL_CANDIDATES_DOWN, None, "all_candidates_down", steps)
    if request.avoid is not None and len(live) > 1:
        live = _avoid(request.avoid, live, steps)
    if held:
        before = live
        live = _rate(live, held, now_ms, steps, policy)
        if not live:
            return _rate_limited(before, held, now_ms, steps)
    fit = _load_cut(live, inflight, steps, policy)
    if not fit:
        return Decision(Outcome.NO_FREE_CREDIT, None, "no_free_credit", steps)
    return _choose(request, fit, inflight, steps, rng, policy)


def _no_capability(request: RouteRequest, index: RegistryIndex, steps: list[Step]) -> Decision:
    nearest = index.nearest(request.capability)
    hint = f"; nearest registered: {', '.join(nearest)}" if nearest else ""
    reason = f"no_capability_match: no instance serves {request.capability!r}{hint}"
    return Decision(Outcome.NO_CAPABILITY_MATCH, None, reason, steps, nearest=nearest)


def _ranked(
    capability: str,
    pool: list[Candidate],
    fast: list[Candidate] | None,
    inflight: Mapping[str, int],
    steps: list[Step],
    rng: random.Random,
    now_ms: int,
    policy: RoutingPolicy,
    rankings: Rankings,
) -> Decision | None:
    """The decision from ``rankings``, with the state step computed once per window."""
    window = rankings.window(capability, now_ms)
    if window is None:
        state: list[Step] = []
        live = _live(pool, state, now_ms, policy, fast)
        window = rankings.remember(capability, pool, live, state[0], now_ms)
    return rankings.decide(capability, window, inflight, steps, rng)


def _unchanged(
    index: RegistryIndex, capability: str, now_ms: int, policy: RoutingPolicy
) -> list[Candidate] | None:
    """The capability's live candidates when nobody has lapsed or is ejected or backing off
    since the snapshot (the state step then has nothing to do), else None."""
    if (
        now_ms - policy.down_after_ms <= index.first_lapse_ms[capability]
        and now_ms >= index.first_ejection_end_ms[capability]
        and len(index.alive[capability]) == len(index.candidates[capability])
    ):
        return index.alive[capability]
    return None


def _plain(request: RouteRequest, held: Mapping[str, float] | None, now_ms: int) -> bool:
    """Nothing but load decides: no session, retry, cheapest rule or rate hold in play."""
    if request.session_instance or request.avoid or request.cheapest:
        return False
    return not (held and any(t > now_ms for t in held.values()))


def _selectors(
    request: RouteRequest,
    pool: list[Candidate],
    steps: list[Step],
    policy: RoutingPolicy,
    weighted: bool,
) -> list[Candidate]:
    """``pool`` itself when no selector applies and every weight is above zero."""
    if weighted and not (request.tags or request.target) and request.budget_per_task is None:
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
    if request.budget_per_task is not None and c.cost > request.budget_per_task:
        return f"cost {c.cost} over budget_per_task {request.budget_per_task}"
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


def _rate_limited(
    before: list[Candidate], held: Mapping[str, float], now_ms: int, steps: list[Step]
) -> Decision:
    ready = min(held[c.instance_id] for c in before) - now_ms
    reason = f"rate_limited: every candidate is over its rate limit (next in {ready:.0f} ms)"
    return Decision(Outcome.RATE_LIMITED, None, reason, steps)


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
    if request.budget_per_task is not None or request.cheapest:
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
    return explain(c, load, before_weight, policy)
