"""The funnel's common case in less than linear time: a capability's live candidates kept
ranked by reach, moved one at a time as credits are taken and given back.

A routing decision with no selectors, no session, no rate hold and nobody lapsed or ejected
since the snapshot (:func:`broker.routing.route`'s fast path) depends only on each candidate's
load. :class:`Ranking` keeps, per capability, the candidates below the load cut sorted by
their reach before weight (:func:`broker.routing.reach_scores`, the formula's one home) and the
ones at or over it in candidate order. A credit taken or released moves one entry: a bisection
and a ``list`` insert, O(log n) comparisons. A decision then reads the best reach at the end of
the list, finds the top group (reach within ``top_ratio`` of the best) by bisection, and picks
in it by rejection sampling: a uniform member, accepted with probability
``reach × weight / (best × heaviest weight)`` — exactly the weighted pick of the linear
funnel, in a few draws (every member is within ``top_ratio`` of the best). After
:data:`MAX_DRAWS` refusals (weights far apart) it falls back to the linear pick over the top
group, so the distribution is exact either way.

The decision recorded is the linear funnel's: the same steps, kept counts, load exclusions
(the first ``max_listed`` in candidate order) and reason.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping

from .candidates import Candidate, explain, reach_scores
from .routing_types import Decision, Outcome, RoutingPolicy, Step

MAX_DRAWS = 32


class Ranking:
    """One capability's live candidates (``RegistryIndex.alive``) ranked by reach, for the
    credit counts ``used`` (instance id → credits in use, the dispatcher's count)."""

    __slots__ = (
        "candidates",
        "fit",
        "heaviest",
        "listed",
        "over",
        "policy",
        "position",
        "reach",
        "used",
    )

    def __init__(
        self, candidates: list[Candidate], used: Mapping[str, int], policy: RoutingPolicy
    ) -> None:
        self.candidates = candidates
        self.policy = policy
        self.position = {c.instance_id: i for i, c in enumerate(candidates)}
        self.used = [used.get(c.instance_id, c.inflight) for c in candidates]
        self.reach: list[float] = [0.0] * len(candidates)
        self.fit: list[tuple[float, int]] = []  # (reach, position), ascending
        self.over: list[int] = []  # positions at or over the load cut, ascending
        # the load step's exclusions as recorded, until a move touches one over the cut
        self.listed: list[tuple[str, str]] | None = None
        self.heaviest = max((c.weight for c in candidates), default=0.0)
        for i in range(len(candidates)):
            self._place(i)

    def load(self, i: int) -> float:
        return self.used[i] * self.candidates[i].inv_credits

    def _place(self, i: int) -> None:
        """Put candidate ``i`` where its load says: by reach in ``fit``, or in ``over``."""
        load = self.load(i)
        if load < self.policy.load_cut:
            ((_, reach),) = reach_scores([(self.candidates[i], load)], self.policy)
            self.reach[i] = reach
            bisect.insort(self.fit, (reach, i))
        else:
            bisect.insort(self.over, i)
            self.listed = None

    def moved(self, instance_id: str, used: int) -> None:
        """``instance_id`` now has ``used`` credits in use."""
        i = self.position.get(instance_id)
        if i is None or self.used[i] == used:
            return
        if self.load(i) < self.policy.load_cut:
            key = (self.reach[i], i)
            del self.fit[bisect.bisect_left(self.fit, key)]
        else:
            del self.over[bisect.bisect_left(self.over, i)]
            self.listed = None
        self.used[i] = used
        self._place(i)

    def top_from(self) -> int:
        """Index in :attr:`fit` where the top group begins (``fit`` must not be empty)."""
        floor = (1.0 - self.policy.top_ratio) * self.fit[-1][0]
        return bisect.bisect_left(self.fit, (floor, -1))

    def pick(self, start: int, rng: random.Random) -> tuple[Candidate, float]:
        """A weighted random member of ``fit[start:]``, by reach × weight: the candidate and
        its reach before weight."""
        fit, candidates = self.fit, self.candidates
        size = len(fit) - start
        if size == 1:
            reach, i = fit[start]
            return candidates[i], reach
        bound = fit[-1][0] * self.heaviest
        if bound > 0:
            draw = rng.random
            for _ in range(MAX_DRAWS):
                reach, i = fit[start + int(draw() * size)]
                if draw() * bound < reach * candidates[i].weight:
                    return candidates[i], reach
            top = fit[start:]
            weights = [reach * candidates[i].weight for reach, i in top]
            if sum(weights) > 0:
                reach, i = rng.choices(top, weights=weights)[0]
                return candidates[i], reach
        reach, i = fit[start + int(rng.random() * size)]
        return candidates[i], reach

    def decide(self, state: Step, steps: list[Step], rng: random.Random) -> Decision:
        """The load, score and choose steps of the common case (``fit`` not empty) after the
        window's ``state`` step, recorded as the linear funnel records them."""
        fit, over, policy = self.fit, self.over, self.policy
        steps.append(Step(state.name, state.kept, state.excluded, state.more))
        load_step = Step("load", len(fit))
        if self.listed is None:
            self.listed = [
                (self.candidates[i].instance_id, f"load {self.load(i):.0%}")
                for i in over[: policy.max_listed]
            ]
        load_step.excluded = self.listed
        load_step.more = len(over) - len(self.listed)
        steps.append(load_step)
        steps.append(Step("score", len(fit)))
        start = self.top_from()
        chosen, score = self.pick(start, rng)
        top = len(fit) - start
        steps.append(Step("choose", top))
        f = explain(chosen, self.load(self.position[chosen.instance_id]), score, policy)
        reason = f"weighted random among top {top} of {len(fit)} (reach {f.reach:.3f})"
        return Decision(Outcome.ROUTED, chosen.view, reason, steps, f)


class StateWindow:
    """The state step of one capability, valid from ``since_ms`` until ``until_ms``: nobody
    lapses, ends an ejection or a back-off in between, so the step's answer holds."""

    __slots__ = ("live", "since_ms", "step", "until_ms")

    def __init__(self, live: list[Candidate], step: Step, since_ms: int, until_ms: float) -> None:
        self.live = live
        self.step = step
        self.since_ms = since_ms
        self.until_ms = until_ms


def state_until(pool: list[Candidate], now_ms: int, policy: RoutingPolicy) -> float:
    """The first time after ``now_ms`` the state step could answer differently for ``pool``:
    a live candidate's heartbeat lapsing, an ejection or a back-off ending."""
    until = float("inf")
    for c in pool:
        if not c.alive or c.credits <= 0:
            continue
        for t in (c.heartbeat_ms + policy.down_after_ms + 1, c.eject_until_ms, c.backoff_until_ms):
            if now_ms < t < until:
                until = t
    return until


class Rankings:
    """The rankings of one snapshot, built per capability on first use and kept in step with
    the dispatcher's credit counts (:meth:`moved` for every change of them); with each, the
    state step's answer for as long as it holds."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self.built: dict[str, Ranking] = {}
        self.windows: dict[str, StateWindow] = {}
        self.of_instance: dict[str, set[str]] = {}

    def window(self, capability: str, now_ms: int) -> StateWindow | None:
        """The capability's state step at ``now_ms`` if it is known to hold."""
        window = self.windows.get(capability)
        if window is not None and window.since_ms <= now_ms < window.until_ms:
            return window
        return None

    def remember(
        self,
        capability: str,
        pool: list[Candidate],
        live: list[Candidate],
        step: Step,
        now_ms: int,
    ) -> StateWindow:
        """The state step's answer ``live``/``step`` for ``pool`` at ``now_ms``."""
        window = StateWindow(live, step, now_ms, state_until(pool, now_ms, self.policy))
        self.windows[capability] = window
        return window

    def decide(
        self,
        capability: str,
        window: StateWindow,
        used: Mapping[str, int],
        steps: list[Step],
        rng: random.Random,
    ) -> Decision | None:
        """The common case's decision, or None when every live candidate is at or over the
        load cut (the linear funnel's least-loaded rule then applies)."""
        ranking = self.built.get(capability)
        if ranking is None or ranking.candidates is not window.live:
            ranking = Ranking(window.live, used, self.policy)
            self.built[capability] = ranking
            for c in window.live:
                self.of_instance.setdefault(c.instance_id, set()).add(capability)
        return ranking.decide(window.step, steps, rng) if ranking.fit else None

    def moved(self, instance_id: str, used: int) -> None:
        for capability in self.of_instance.get(instance_id, ()):
            self.built[capability].moved(instance_id, used)
