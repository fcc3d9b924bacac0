"""An adaptive credit limit that follows an agent's latency — a gradient limiter in the
manner of Netflix's concurrency-limits ``Gradient2``. Pure: the sidecar feeds it answers and
publishes :attr:`credits` with its heartbeat.

Two moving averages of latency: a short one (the last few answers) and a long one (the
agent's normal). Their ratio is the gradient, clamped to [0.5, 1], with ``slack_ms`` added to
both so that a few milliseconds of jitter on a fast agent do not read as a slowdown:

    new = limit × gradient          when the gradient is under ``tolerance`` (congested)
    new = limit + √limit            otherwise (probe upwards)
    limit ← limit × (1 − smoothing) + new × smoothing

Steady latency, however jittery, keeps the gradient near 1 and the limit at its ceiling;
when the model behind an agent slows down, the short average jumps, the gradient drops to
0.5 and the limit falls by 15 % an answer, to the floor if the slowdown lasts, so the agent
stops being handed work it can only queue. The headroom is added only while uncongested:
added always (as ``Gradient2`` does) it holds the limit at a fixed point of 4 under any
slowdown, so a small limit could never fall at all. An explicit "too busy" (429 / 503)
halves the limit at once.

A slowdown must not have to wait for its first slow answer to be seen: a call still running
well past the agent's normal latency (:meth:`overdue_after_ms`) is counted once, at its age
so far, as a lower bound on its latency (:meth:`on_overdue`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class AdaptiveLimit:
    ceiling: int
    floor: int = 1
    short_weight: float = 0.1  # EWMA weight of a new answer in the short average
    long_weight: float = 0.005  # ... and in the long one (about 200 answers)
    smoothing: float = 0.3
    tolerance: float = 0.9  # a gradient at or above this is jitter, not congestion
    slack_ms: float = 25.0
    limit: float = field(init=False)
    short_ms: float | None = field(default=None, init=False)
    long_ms: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.limit = float(self.ceiling)

    @property
    def credits(self) -> int:
        return max(self.floor, min(self.ceiling, int(self.limit)))

    def on_answer(self, latency_ms: float) -> None:
        """An answer (success or failure) that took ``latency_ms``."""
        latency_ms = max(latency_ms, 0.001)
        if self.short_ms is None or self.long_ms is None:
            self.short_ms = self.long_ms = latency_ms
            return
        self.short_ms += (latency_ms - self.short_ms) * self.short_weight
        self.long_ms += (latency_ms - self.long_ms) * self.long_weight
        slack = self.slack_ms
        gradient = max(0.5, min(1.0, (self.long_ms + slack) / (self.short_ms + slack)))
        if gradient < self.tolerance:
            target = self.limit * gradient
        else:
            target = self.limit + math.sqrt(self.limit)
        self._set(self.limit * (1 - self.smoothing) + target * self.smoothing)

    def overdue_after_ms(self) -> float | None:
        """How long a call may run before its age alone counts as a slow answer."""
        if self.long_ms is None:
            return None
        return 2 * self.long_ms + self.slack_ms

    def on_overdue(self, age_ms: float) -> bool:
        """A call has been running ``age_ms`` and has not answered: count it as an answer of
        at least that latency, if that is already past normal. True when it was counted."""
        threshold = self.overdue_after_ms()
        if threshold is None or age_ms < threshold:
            return False
        self.on_answer(age_ms)
        return True

    def on_overload(self) -> None:
        """The agent said it is too busy (429 / 503), or did not answer in time."""
        self._set(self.limit * 0.5)

    def _set(self, value: float) -> None:
        self.limit = max(float(self.floor), min(float(self.ceiling), value))
