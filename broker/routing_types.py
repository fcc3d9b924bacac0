"""What goes into a routing decision and what comes out of it: the policy, the request, the
decision with its funnel steps (``route_from`` on the record) and the winner's reach factors.
Plain values; :mod:`broker.routing` makes the decisions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .records import InstanceView


class Outcome(StrEnum):
    ROUTED = "routed"
    NO_CAPABILITY_MATCH = "no_capability_match"
    NO_SELECTOR_MATCH = "no_selector_match"
    ALL_CANDIDATES_DOWN = "all_candidates_down"
    NO_FREE_CREDIT = "no_free_credit"
    RATE_LIMITED = "rate_limited"  # every candidate is over its rate limit for now


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

    def resolve(self, capability: str) -> str:
        """The capability routing looks for: through the alias map in ``loose`` mode."""
        return self.aliases.get(capability, capability) if self.mode == "loose" else capability


@dataclass(frozen=True, slots=True)
class RouteRequest:
    capability: str
    tags: Mapping[str, str] = field(default_factory=dict)
    target: str | None = None
    session_instance: str | None = None
    budget_per_task: float | None = None
    avoid: str | None = None  # an instance that just failed this message: elsewhere if possible
    # the tenant is over its budget and budget_mode is "cheapest": the cheapest capable
    # instance of all that pass the funnel, not only of the top group
    cheapest: bool = False


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

    def exclude_all(self, exclusions: list[tuple[str, str]], limit: int) -> None:
        room = max(0, limit - len(self.excluded))
        self.excluded += exclusions[:room]
        self.more += max(0, len(exclusions) - room)

    def to_builtins(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.name, "kept": self.kept}
        if self.excluded:
            out["excluded"] = dict(self.excluded)
        if self.more:
            out["more_excluded"] = self.more
        return out


@dataclass(frozen=True, slots=True)
class Factors:
    """One instance's reach, factor by factor, as an operator reads it (a decision's reason,
    ``agent-reach agents``). ``reach`` is :func:`reach_scores`' figure times the weight: the
    very number the funnel ranked by, never a recomputation of it."""

    alive: float
    health: float
    load: float
    latency: float
    confidence: float
    weight: float
    reach: float

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
