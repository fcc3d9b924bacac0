"""The ranked fast path of the funnel (broker/ranking.py) decides as the linear funnel does:
the same steps, counts, exclusions and reason, a winner from the same top group, picked with the
same weights; and the dispatcher's routing table keeps the rankings in step with its counts."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.candidates import Candidate, reach_scores
from broker.ranking import MAX_DRAWS, Rankings
from broker.records import InstanceCard, InstanceState, InstanceStats, InstanceView
from broker.routing import Decision, Outcome, RegistryIndex, RouteRequest, RoutingPolicy, route
from workers.routing_table import RoutingTable

NOW = 10_000_000
CAP = "cap.a"
POLICY = RoutingPolicy(max_listed=3)
PROPERTY = settings(database=None, derandomize=True, deadline=None, max_examples=300)


def view(
    n: int, *, credits: int, inflight: int, weight: float = 1.0, **stats: float
) -> InstanceView:
    card = InstanceCard(
        agent_id=f"agent{n % 3}",
        instance_id=f"i-{n}",
        capabilities=(CAP,),
        endpoint=f"http://127.0.0.1/{n}",
        max_inflight=credits,
        weight=weight,
    )
    return InstanceView(
        card=card,
        state=InstanceState.UP,
        credits=credits,
        inflight=inflight,
        heartbeat_ms=NOW,
        stats=InstanceStats(**stats),  # type: ignore[arg-type]
    )


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[InstanceView], list[tuple[int, int]]]:
    size = draw(st.integers(1, 25))
    pool = []
    for n in range(size):
        credits = draw(st.integers(1, 12))
        pool.append(
            view(
                n,
                credits=credits,
                inflight=draw(st.integers(0, credits)),
                weight=draw(st.sampled_from([0.1, 0.5, 1.0, 1.0, 2.0])),
                error_rate=draw(st.sampled_from([0.0, 0.01, 0.2, 0.9])),
                p95_ms=draw(st.sampled_from([5.0, 90.0, 400.0, 1500.0])),
                successes=draw(st.sampled_from([0, 19, 20, 500])),
            )
        )
    moves = draw(
        st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 12)), min_size=1, max_size=30)
    )
    return pool, moves


def linear(index: RegistryIndex, inflight: dict[str, int], seed: int) -> Decision:
    return route(
        RouteRequest(CAP), index, inflight, now_ms=NOW, rng=random.Random(seed), policy=POLICY
    )


def ranked(index: RegistryIndex, inflight: dict[str, int], rankings: Rankings) -> Decision:
    request = RouteRequest(CAP)
    rng = random.Random(7)
    return route(request, index, inflight, now_ms=NOW, rng=rng, policy=POLICY, rankings=rankings)


def top_group(index: RegistryIndex, inflight: dict[str, int]) -> set[str]:
    pool = index.alive[CAP]
    loads = [(c, inflight[c.instance_id] * c.inv_credits) for c in pool]
    fit = [(c, load) for c, load in loads if load < POLICY.load_cut]
    if not fit:  # all at or over the cut: the least loaded with a free credit
        least = min(load for _, load in loads)
        fit = [(c, load) for c, load in loads if load == least and load < 1.0]
    scored = reach_scores(fit, POLICY)
    best = max(score for _, score in scored)
    return {c.instance_id for c, s in scored if s >= (1 - POLICY.top_ratio) * best}


def without_reach(reason: str) -> str:
    return reason.split(" (reach")[0]


@PROPERTY
@given(fleets())
def test_property_the_ranking_decides_as_the_linear_funnel(
    fleet: tuple[list[InstanceView], list[tuple[int, int]]],
) -> None:
    pool, moves = fleet
    index = RegistryIndex(pool)
    inflight = {v.instance_id: v.inflight for v in pool}
    rankings = Rankings(POLICY)
    for n, (which, used) in enumerate(moves):
        expected = linear(index, inflight, n)
        got = ranked(index, inflight, rankings)
        assert got.outcome is expected.outcome
        assert got.route_from() == expected.route_from()
        if expected.outcome is Outcome.ROUTED and expected.reason.startswith("weighted"):
            assert got.instance is not None
            assert got.instance.instance_id in top_group(index, inflight)
            assert without_reach(got.reason) == without_reach(expected.reason)
            assert got.factors is not None
            reach = reach_scores(
                [
                    (c, inflight[c.instance_id] * c.inv_credits)
                    for c in index.alive[CAP]
                    if c.instance_id == got.instance.instance_id
                ],
                POLICY,
            )[0][1]
            assert got.factors.reach == reach * got.instance.card.weight
        instance = pool[which]
        used = min(used, instance.credits)
        inflight[instance.instance_id] = used
        rankings.moved(instance.instance_id, used)


def shares(decide: object, runs: int) -> dict[str, float]:
    assert callable(decide)
    counts = Counter(decide().instance.instance_id for _ in range(runs))
    return {i: n / runs for i, n in counts.items()}


def expected_shares(index: RegistryIndex, inflight: dict[str, int]) -> dict[str, float]:
    top = top_group(index, inflight)
    pool: list[Candidate] = [c for c in index.alive[CAP] if c.instance_id in top]
    scored = reach_scores([(c, inflight[c.instance_id] * c.inv_credits) for c in pool], POLICY)
    total = sum(s * c.weight for c, s in scored)
    return {c.instance_id: s * c.weight / total for c, s in scored}


def check_shares(pool: list[InstanceView], runs: int = 20_000) -> None:
    index = RegistryIndex(pool)
    inflight = {v.instance_id: v.inflight for v in pool}
    rankings = Rankings(POLICY)
    rng = random.Random(3)

    def decide() -> Decision:
        return route(
            RouteRequest(CAP),
            index,
            inflight,
            now_ms=NOW,
            rng=rng,
            policy=POLICY,
            rankings=rankings,
        )

    want = expected_shares(index, inflight)
    got = shares(decide, runs)
    assert set(got) <= set(want)
    for instance_id, share in want.items():
        assert abs(got.get(instance_id, 0.0) - share) < 0.015, (instance_id, got, want)


def test_the_pick_follows_reach_times_weight() -> None:
    check_shares(
        [
            view(0, credits=10, inflight=0, weight=1.0),
            view(1, credits=10, inflight=2, weight=1.0),
            view(2, credits=10, inflight=0, weight=0.1),  # a canary
            view(3, credits=10, inflight=1, weight=2.0),
            view(4, credits=10, inflight=5, weight=1.0),  # outside the top group
            view(5, credits=10, inflight=9, weight=1.0),  # over the load cut
        ]
    )


def test_weights_far_apart_fall_back_to_the_exact_pick() -> None:
    """The heaviest weight sits outside the top group: nearly every draw is refused and the
    linear pick over the top group decides, with the same shares."""
    pool = [
        view(0, credits=10, inflight=0, weight=0.001),
        view(1, credits=10, inflight=1, weight=0.002),
        view(2, credits=10, inflight=6, weight=1000.0),  # reach 0.4: not in the top group
    ]
    assert (1 - 0.9) * 0.001 / 1000 < 1 / MAX_DRAWS  # refusals are near certain
    check_shares(pool, runs=5_000)


def test_all_over_the_load_cut_is_left_to_the_linear_funnel() -> None:
    pool = [view(0, credits=10, inflight=9), view(1, credits=10, inflight=10)]
    index = RegistryIndex(pool)
    inflight = {v.instance_id: v.inflight for v in pool}
    decision = ranked(index, inflight, Rankings(POLICY))
    assert decision.instance is not None and decision.instance.instance_id == "i-0"
    assert [s.to_builtins() for s in decision.steps] == linear(index, inflight, 0).route_from()


def test_the_routing_table_keeps_its_rankings_in_step() -> None:
    pool = [view(n, credits=4, inflight=n % 3) for n in range(6)]
    table = RoutingTable(POLICY, random.Random(5))
    table.load(pool)
    rng = random.Random(9)
    for _ in range(400):
        op = rng.random()
        instance_id = f"i-{rng.randrange(6)}"
        if op < 0.5:
            table.decide(RouteRequest(CAP), now_ms=NOW)
        elif op < 0.75:
            table.unreserve(instance_id)
        elif op < 0.9:
            table.credits_released(instance_id, rng.randrange(5))
        else:
            table.mark_full(instance_id)
        ranking = table.rankings.built[CAP]
        assert ranking.used == [table.inflight[c.instance_id] for c in ranking.candidates]
    assert sum(table.inflight.values()) > 0
