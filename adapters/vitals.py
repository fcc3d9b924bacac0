"""What a sidecar measures about its own agent, and what it reports with each heartbeat.

Outcomes feed a sliding window (error rate, p95 latency), the cooldown / circuit breaker and
the health state machine — all pure parts from :mod:`broker.health`; this class only keeps
them together and turns them into the card's figures.
"""

from __future__ import annotations

from broker.config import Settings
from broker.health import (
    Breaker,
    BreakerPolicy,
    HealthPolicy,
    HealthTrack,
    OutcomeWindow,
    next_health,
)
from broker.limiter import AdaptiveLimit
from broker.records import CircuitState, InstanceState, InstanceStats

from .outcome import Accepted, Ambiguous, Backoff, Failed, NotReached, Outcome


def is_agent_fault(outcome: Outcome) -> bool:
    """Failures that speak of the agent's health. A 4xx is the request's fault, not the
    agent's: it does not count against the instance."""
    match outcome:
        case Failed(fault=fault):
            return fault
        case NotReached() | Ambiguous():
            return True
    return False  # Succeeded, and Backoff: busy is not broken


class Vitals:
    def __init__(
        self, settings: Settings, *, credits: int, now_ms: int, adaptive: bool = True
    ) -> None:
        self.credits = credits
        self.limit = AdaptiveLimit(ceiling=credits) if adaptive else None
        self.backoff_until_ms = 0
        self.window = OutcomeWindow(span_ms=int(settings.stats_window_s * 1000))
        self.breaker = Breaker(
            BreakerPolicy(
                allowed_fails=settings.allowed_fails,
                cooldown_ms=int(settings.cooldown_s * 1000),
                min_requests=settings.circuit_min_requests,
                fail_ratio=settings.circuit_fail_ratio,
                open_ms=int(settings.circuit_open_s * 1000),
                probes=settings.circuit_probes,
            )
        )
        self.health_policy = HealthPolicy(
            degrade_error_rate=settings.degrade_error_rate,
            down_error_rate=settings.down_error_rate,
            degrade_load=settings.degrade_load,
            sustain_beats=settings.sustain_heartbeats,
            recover_beats=settings.recover_heartbeats,
        )
        self.down_after_ms = int(settings.down_after_s * 1000)
        self.track = HealthTrack()
        self.successes = 0
        self.last_beat_ms = now_ms
        self._reported = self._ejection()

    @property
    def effective_credits(self) -> int:
        """The credit limit to publish: adaptive, or the declared ``max_inflight``."""
        return self.limit.credits if self.limit is not None else self.credits

    def record(self, outcome: Outcome, *, latency_ms: float, now_ms: int) -> bool:
        """One outcome; true when something dispatchers should learn now changed: the
        circuit, the cooldown, the credit limit, a back-off."""
        before = self.effective_credits
        if isinstance(outcome, Accepted):
            return False  # an async agent took it: its answer is the callback, counted then
        if isinstance(outcome, Backoff):
            self.backoff_until_ms = now_ms + int(outcome.retry_after_s * 1000)
            if self.limit is not None:
                self.limit.on_overload()
            return True  # not an answer to count: busy is neither success nor failure
        if self.limit is not None:
            if isinstance(outcome, Ambiguous):
                self.limit.on_overload()  # no answer in time: the agent is overwhelmed
            elif not isinstance(outcome, NotReached):
                self.limit.on_answer(latency_ms)
        failed = is_agent_fault(outcome)
        if not failed:
            self.successes += 1
        self.window.add(now_ms, failed=failed, latency_ms=latency_ms)
        self.breaker.record(now_ms, failed=failed, window=self.window)
        return self._ejection() != self._reported or self.effective_credits != before

    def overdue(self, ages_ms: list[float]) -> list[bool]:
        """Calls still running at these ages: each one already slow counts once for the
        credit limit (see :meth:`AdaptiveLimit.on_overdue`). Returns which were counted."""
        if self.limit is None:
            return [False] * len(ages_ms)
        return [self.limit.on_overdue(age) for age in ages_ms]

    def beat(self, now_ms: int, *, active: int) -> tuple[InstanceState, InstanceStats, bool]:
        """The state and figures for a heartbeat at ``now_ms``, and whether to announce them."""
        self.breaker.tick(now_ms)
        requests, error_rate, p95 = self.window.figures(now_ms)
        before = self.track.state
        self.track = next_health(
            self.track,
            error_rate=error_rate,
            load=active / max(self.credits, 1),
            lapsed=now_ms - self.last_beat_ms > self.down_after_ms,
            policy=self.health_policy,
        )
        stats = InstanceStats(
            error_rate=round(error_rate, 4),
            p95_ms=round(p95, 2),
            requests=requests,
            successes=self.successes,
            cooldown_until_ms=self.breaker.cooldown_until_ms,
            circuit=self.breaker.state,
            circuit_until_ms=self.breaker.until_ms,
            backoff_until_ms=self.backoff_until_ms,
        )
        announce = self._ejection() != self._reported or self.track.state is not before
        self._reported = self._ejection()
        return self.track.state, stats, announce

    def beat_delivered(self, now_ms: int) -> None:
        self.last_beat_ms = now_ms

    def _ejection(self) -> tuple[CircuitState, int, int, int]:
        return (
            self.breaker.state,
            self.breaker.cooldown_until_ms,
            self.backoff_until_ms,
            self.effective_credits,
        )
