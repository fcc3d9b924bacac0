"""The order in which waiting work is offered freed credits. Pure: no I/O.

Each capability's waiting set is already ordered by priority, then age. When several
capabilities wait on the same instances, a freed credit goes to the highest priority waiting
anywhere; among capabilities waiting at that same priority, they take turns, starting with the
one served least recently — so a flood of one capability cannot starve another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

# Higher priority first, then older first: score = (9 - priority) * PRIORITY_SPAN + accepted_ms.
PRIORITY_SPAN = 10**13
PRIORITY_BANDS = 10  # priorities 0-9, a band of PRIORITY_SPAN each


def waiting_score(priority: int, accepted_ms: int) -> float:
    return float((9 - priority) * PRIORITY_SPAN + accepted_ms)


def split_score(score: float) -> tuple[int, int]:
    """``(priority, accepted_ms)`` back from a waiting-set score."""
    band, accepted_ms = divmod(int(score), PRIORITY_SPAN)
    return 9 - band, accepted_ms


class Rotation:
    """Capabilities by when they were last served, least recently first (never is least)."""

    def __init__(self) -> None:
        self._order: dict[str, None] = {}

    def order(self, capabilities: Iterable[str]) -> list[str]:
        present = set(capabilities)
        known = [c for c in self._order if c in present]
        return sorted(present.difference(self._order)) + known

    def served(self, capability: str) -> None:
        self._order.pop(capability, None)
        self._order[capability] = None

    def forget(self, capability: str) -> None:
        self._order.pop(capability, None)


def fair_order(
    heads: Mapping[str, Sequence[tuple[str, int]]], turns: Sequence[str]
) -> list[tuple[str, str]]:
    """Interleave the heads of several waiting sets into one offer order.

    ``heads`` maps a capability to its first waiting ``(message_id, priority)`` pairs, in
    waiting-set order; ``turns`` is the order capabilities take turns in (see
    :class:`Rotation`). Returns ``(capability, message_id)`` pairs: all of priority 9 first,
    then 8, ...; within a priority, one message per capability per round.
    """
    levels: dict[int, dict[str, deque[str]]] = {}
    for capability in turns:
        for message_id, priority in heads.get(capability, ()):
            levels.setdefault(priority, {}).setdefault(capability, deque()).append(message_id)
    offer: list[tuple[str, str]] = []
    for priority in sorted(levels, reverse=True):
        queues = list(levels[priority].items())
        while queues:
            for capability, queue in queues:
                offer.append((capability, queue.popleft()))
            queues = [(c, q) for c, q in queues if q]
    return offer
