"""Choosing an instance for a message: pure functions over a registry snapshot, no I/O.

This slice routes by capability match and picks the least-loaded healthy instance; the full
scoring funnel of DESIGN §5 replaces :func:`choose` without changing its callers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .records import InstanceState, InstanceView

ACCEPTING = frozenset({InstanceState.UP, InstanceState.DEGRADED})


def is_healthy(view: InstanceView, *, now_ms: int, down_after_ms: int) -> bool:
    """Accepting work and heard from within ``down_after_ms``."""
    return view.state in ACCEPTING and now_ms - view.heartbeat_ms <= down_after_ms


def candidates(
    instances: Iterable[InstanceView], capability: str, *, now_ms: int, down_after_ms: int
) -> list[InstanceView]:
    """Healthy instances that serve ``capability``."""
    return [
        v
        for v in instances
        if capability in v.card.capabilities
        and is_healthy(v, now_ms=now_ms, down_after_ms=down_after_ms)
    ]


def choose(pool: Sequence[InstanceView], inflight: dict[str, int]) -> InstanceView | None:
    """The instance with the most free credits (by ``inflight``, the caller's live count);
    ``None`` when every credit is in use. Ties go to the lowest load ratio, then the id."""
    best: InstanceView | None = None
    best_key: tuple[int, float, str] | None = None
    for view in pool:
        used = inflight.get(view.instance_id, view.inflight)
        free = view.credits - used
        if free <= 0:
            continue
        key = (-free, used / max(view.credits, 1), view.instance_id)
        if best_key is None or key < best_key:
            best, best_key = view, key
    return best
