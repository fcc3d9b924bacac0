"""Routing decision time: the pure funnel of ``broker.routing`` over growing registries.

Builds, for each size (default 10, 200 and 2,000 candidate instances of one capability, plus
a tenth as many instances of other capabilities), a registry snapshot with varied figures:
error rates, p95 latencies, cold and warm instances, loads from idle to full, a few canaries,
cooldowns and open circuits, and some DOWN, DEGRADED, DRAINING and silent instances. Then
times ``route(...)`` one call at a time with ``time.perf_counter_ns`` after a warm-up, and
prints the decision time p50 / p99 / mean in µs, the decisions per second, and how the
decisions ended. Same-run baseline: the rule this funnel replaced, one ``max()`` pass over the
same candidates for the most free credits (the floor of any per-candidate Python loop).

Each decision is timed with the credit bookkeeping a dispatcher does around it: a credit
taken on the winner and one given back by the winner of a quarter-pool's decisions before (2
at 10 candidates, 50 at 200), so loads move every decision and stay near the snapshot's. Two
funnels: ``linear`` (every step over every candidate) and ``ranked`` (the dispatcher's:
:mod:`broker.ranking` keeps the candidates ranked and a credit change moves one of them).

Each size stops at ``--decisions`` or after ``--max-seconds`` of timed decisions, whichever
comes first (the count measured is printed); the warm-up is 1,000 decisions or 2 s.

Usage: ``python -m bench.routing [--decisions 20000] [--max-seconds 30] [--sizes 10,200,2000]
[--seed 1]``.
No threshold: it prints figures, CI never fails on a time.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from broker.gc_tuning import tune_gc
from broker.ranking import Rankings
from broker.records import CircuitState, InstanceCard, InstanceState, InstanceStats, InstanceView
from broker.routing import Decision, RegistryIndex, RouteRequest, RoutingPolicy, route

CAPABILITY = "bench.route"
NOW_MS = 1_700_000_000_000
WARMUP = 1_000
WARMUP_NS = 2_000_000_000
T = TypeVar("T")


def instance(n: int, capability: str, rng: random.Random) -> InstanceView:
    """One instance with varied figures; a few DOWN, DEGRADED, DRAINING or silent."""
    roll = rng.random()
    if roll < 0.04:
        state = InstanceState.DOWN
    elif roll < 0.12:
        state = InstanceState.DEGRADED
    elif roll < 0.14:
        state = InstanceState.DRAINING
    else:
        state = InstanceState.UP
    silent = rng.random() < 0.02
    credits = rng.choice([4, 8, 16, 32])
    ejection = rng.random()
    stats = InstanceStats(
        error_rate=round(rng.betavariate(1, 25), 4),  # mostly under 5 %, a tail beyond
        p95_ms=round(rng.lognormvariate(4.5, 0.6), 2),  # ~90 ms median, some slow ones
        requests=rng.randint(0, 500),
        successes=rng.choice([0, 5, 19, 20, 100, 10_000]),
        cooldown_until_ms=NOW_MS + 10_000 if ejection < 0.02 else 0,
        circuit=CircuitState.OPEN if 0.02 <= ejection < 0.03 else CircuitState.CLOSED,
        circuit_until_ms=NOW_MS + 20_000 if 0.02 <= ejection < 0.03 else 0,
    )
    card = InstanceCard(
        agent_id=f"agent{n % 50}",
        instance_id=f"{capability}-{n}",
        capabilities=(capability,),
        endpoint=f"http://10.0.{n // 250}.{n % 250}:8080",
        max_inflight=credits,
        version="2" if rng.random() < 0.05 else "1",
        tags={"region": rng.choice(["eu", "us"])},
        weight=0.1 if rng.random() < 0.05 else 1.0,  # a few canaries
        cost=rng.choice([0.0, 1.0, 2.0]),
    )
    return InstanceView(
        card=card,
        state=state,
        credits=credits,
        inflight=rng.randint(0, credits),  # idle to full
        heartbeat_ms=NOW_MS - (60_000 if silent else rng.randint(0, 5_000)),
        stats=stats,
    )


def registry(size: int, rng: random.Random) -> RegistryIndex:
    views = [instance(n, CAPABILITY, rng) for n in range(size)]
    views += [instance(n, f"other.cap{n % 5}", rng) for n in range(max(1, size // 10))]
    return RegistryIndex(views)


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


def timed(
    decide: Callable[[], T], decisions: int, max_seconds: float
) -> tuple[list[float], list[T], float]:
    """Warm up, then call ``decide`` one at a time: sorted times in µs, the results, and the
    decisions per second."""
    warm_until = time.perf_counter_ns() + WARMUP_NS
    for _ in range(WARMUP):
        decide()
        if time.perf_counter_ns() > warm_until:
            break
    times_us: list[float] = []
    results: list[T] = []
    started = time.perf_counter_ns()
    stop_at = started + int(max_seconds * 1e9)
    for _ in range(decisions):
        t0 = time.perf_counter_ns()
        result = decide()
        t1 = time.perf_counter_ns()
        times_us.append((t1 - t0) / 1_000)
        results.append(result)
        if t1 > stop_at:
            break
    rate = len(times_us) / ((time.perf_counter_ns() - started) / 1e9)
    return sorted(times_us), results, rate


def figures(times_us: list[float], rate: float) -> str:
    return (
        f"p50 {percentile(times_us, 0.50):8.1f} µs | p99 {percentile(times_us, 0.99):8.1f} µs | "
        f"mean {statistics.fmean(times_us):8.1f} µs | {rate:8.0f} decisions/s "
        f"({len(times_us)} timed)"
    )


class Funnel:
    """Decisions with the dispatcher's credit bookkeeping around each one."""

    def __init__(self, index: RegistryIndex, rng: random.Random, *, ranked: bool) -> None:
        self.index = index
        self.rng = rng
        self.policy = RoutingPolicy()
        self.request = RouteRequest(CAPABILITY)
        self.inflight = {v.instance_id: v.inflight for v in index.instances}
        self.rankings = Rankings(self.policy) if ranked else None
        self.taken: list[str] = []
        self.depth = len(index.by_capability[CAPABILITY]) // 4  # decisions a credit stays taken

    def count(self, instance_id: str, delta: int) -> None:
        used = max(0, self.inflight[instance_id] + delta)
        self.inflight[instance_id] = used
        if self.rankings is not None:
            self.rankings.moved(instance_id, used)

    def __call__(self) -> Decision:
        decision = route(
            self.request,
            self.index,
            self.inflight,
            now_ms=NOW_MS,
            rng=self.rng,
            policy=self.policy,
            rankings=self.rankings,
        )
        if decision.instance is not None:
            self.count(decision.instance.instance_id, 1)
            self.taken.append(decision.instance.instance_id)
        if len(self.taken) > self.depth:
            self.count(self.taken.pop(0), -1)
        return decision


def measure(size: int, decisions: int, max_seconds: float, seed: int) -> None:
    rng = random.Random(seed)
    index = registry(size, rng)
    pool = index.by_capability[CAPABILITY]
    inflight = {v.instance_id: v.inflight for v in pool}

    def most_free() -> InstanceView:
        """The baseline: the previous rule, one pass for the most free credits."""
        return max(pool, key=lambda v: v.credits - inflight.get(v.instance_id, v.inflight))

    base_us, _, base_rate = timed(most_free, decisions, max_seconds)
    print(f"{size:>6} candidates  baseline    {figures(base_us, base_rate)}")
    for name in ("linear", "ranked"):
        funnel = Funnel(index, random.Random(seed), ranked=name == "ranked")
        times_us, results, rate = timed(funnel, decisions, max_seconds)
        outcomes = Counter(d.outcome.value for d in results)
        chosen = {d.instance.instance_id for d in results if d.instance is not None}
        steps = " → ".join(f"{s.name} {s.kept}" for s in results[-1].steps)
        ends = ", ".join(f"{outcome} {count}" for outcome, count in outcomes.most_common())
        ratio = percentile(times_us, 0.5) / percentile(base_us, 0.5)
        print(f"{'':>19}{name:<12}{figures(times_us, rate)}")
        print(f"{'':>19}{'':<12}p50 ratio {name} / baseline: {ratio:.1f}×")
        print(
            f"{'':>19}{'':<12}funnel: {steps}; {ends}; {len(chosen)} distinct instances chosen",
            flush=True,
        )


def main(sizes: list[int], decisions: int, max_seconds: float, seed: int, default_gc: bool) -> None:
    if not default_gc:
        tune_gc()  # as every agent-reach process does (broker/gc_tuning.py)
    print(
        f"route() over one capability: up to {decisions} decisions or {max_seconds:.0f} s per "
        "size and funnel, after a warm-up, each with a credit taken and one given back; "
        "baseline: one max() pass for the most free credits; "
        f"garbage collector thresholds {gc.get_threshold()}"
    )
    for size in sizes:
        measure(size, decisions, max_seconds, seed)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--max-seconds", type=float, default=30.0, help="timed, per size")
    parser.add_argument("--sizes", default="10,200,2000", help="comma-separated pool sizes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="CPython's collector thresholds, not the broker's (broker/gc_tuning.py)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    main(sizes, args.decisions, args.max_seconds, args.seed, args.default_gc)


if __name__ == "__main__":
    cli()
