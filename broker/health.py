"""Instance health as pure state machines: no I/O, time passed in.

- :func:`next_health` — UP / DEGRADED / DOWN / DRAINING from one heartbeat's figures (DESIGN
  §5): DEGRADED when the error rate passes 10 % or the load 80 % for ``sustain_beats``
  heartbeats; DOWN when the error rate passes 50 % or heartbeats lapsed; back UP only after
  ``recover_beats`` consecutive healthy heartbeats.
- :func:`observed_state` — what a router must assume: a card whose heartbeat is older than
  ``down_after_ms`` is DOWN whatever it last said (a dead process cannot say so itself).
- :class:`OutcomeWindow` — the sliding window of outcomes behind the error rate and p95.
- :class:`Breaker` — consecutive-failure cooldown and a circuit breaker over the window
  (≥ 50 % failures with ≥ 10 requests in 60 s → open 30 s → half-open with 3 probes).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from .records import CircuitState, InstanceState, InstanceView


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    degrade_error_rate: float = 0.10
    down_error_rate: float = 0.50
    degrade_load: float = 0.80
    sustain_beats: int = 2
    recover_beats: int = 3


@dataclass(frozen=True, slots=True)
class HealthTrack:
    """The state machine's memory between heartbeats."""

    state: InstanceState = InstanceState.UP
    healthy_streak: int = 0
    strained_streak: int = 0


def next_health(
    track: HealthTrack,
    *,
    error_rate: float,
    load: float,
    lapsed: bool,
    policy: HealthPolicy,
) -> HealthTrack:
    """The state after one heartbeat. ``lapsed``: the previous heartbeat is older than the
    down-after bound (this process was stopped, partitioned or paused), so it was DOWN."""
    if track.state is InstanceState.DRAINING:
        return track
    if lapsed or error_rate > policy.down_error_rate:
        return HealthTrack(InstanceState.DOWN, 0, 0)
    strained = error_rate > policy.degrade_error_rate or load > policy.degrade_load
    strained_streak = track.strained_streak + 1 if strained else 0
    if track.state is InstanceState.DOWN:
        # Recovery needs healthy beats in a row: a strained one starts the count again.
        streak = 0 if strained else track.healthy_streak + 1
        if streak < policy.recover_beats:
            return HealthTrack(InstanceState.DOWN, streak, strained_streak)
    sustained = strained_streak >= policy.sustain_beats
    state = InstanceState.DEGRADED if sustained else InstanceState.UP
    return HealthTrack(state, 0, strained_streak)


def observed_state(view: InstanceView, *, now_ms: int, down_after_ms: int) -> InstanceState:
    """The state a router must assume: silence past ``down_after_ms`` means DOWN."""
    if now_ms - view.heartbeat_ms > down_after_ms and view.state is not InstanceState.DRAINING:
        return InstanceState.DOWN
    return view.state


@dataclass(slots=True)
class OutcomeWindow:
    """Outcomes of the last ``span_ms``: (time, failed, latency).

    Each figure costs O(log n) however many outcomes the window holds: the counts are running
    totals, the latencies a sorted list (``sortedcontainers``), and the circuit's "since it
    closed" a count kept from that mark on. (The p95 was a sort of the whole window at each
    heartbeat, and a sidecar beats whenever its credit limit moves: at thousands of outcomes
    a second, a profile put a sixth of a busy sidecar's CPU there, in stalls of its event
    loop.)"""

    span_ms: int = 60_000
    _events: deque[tuple[int, bool, float]] = field(default_factory=deque)
    _latencies: SortedList = field(default_factory=SortedList)
    _failures: int = 0
    # outcomes in the window from before the mark, and how many of them failed (since())
    _mark_ms: int = 0
    _before_mark: int = 0
    _failed_before_mark: int = 0

    def add(self, now_ms: int, *, failed: bool, latency_ms: float) -> None:
        self._events.append((now_ms, failed, latency_ms))
        self._latencies.add(latency_ms)
        self._failures += failed
        if now_ms < self._mark_ms:
            self._before_mark += 1
            self._failed_before_mark += failed
        self._expire(now_ms)

    def _expire(self, now_ms: int) -> None:
        events = self._events
        while events and events[0][0] <= now_ms - self.span_ms:
            at, failed, latency = events.popleft()
            self._latencies.remove(latency)
            self._failures -= failed
            if at < self._mark_ms:
                self._before_mark -= 1
                self._failed_before_mark -= failed

    def figures(self, now_ms: int) -> tuple[int, float, float]:
        """``(requests, error_rate, p95_ms)`` over the window."""
        self._expire(now_ms)
        n = len(self._events)
        if not n:
            return 0, 0.0, 0.0
        p95: float = self._latencies[max(0, math.ceil(0.95 * n) - 1)]  # nearest rank
        return n, self._failures / n, p95

    def since(self, now_ms: int, since_ms: int) -> tuple[int, float]:
        """``(requests, error_rate)`` of the outcomes in the window from ``since_ms`` on. A
        new ``since_ms`` counts the window once; the circuit moves it only when it closes."""
        self._expire(now_ms)
        if since_ms != self._mark_ms:
            before = [failed for at, failed, _ in self._events if at < since_ms]
            self._mark_ms, self._before_mark = since_ms, len(before)
            self._failed_before_mark = sum(before)
        n = len(self._events) - self._before_mark
        return n, (self._failures - self._failed_before_mark) / n if n else 0.0


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    allowed_fails: int = 3
    cooldown_ms: int = 30_000
    min_requests: int = 10
    fail_ratio: float = 0.5
    open_ms: int = 30_000
    probes: int = 3


@dataclass(slots=True)
class Breaker:
    """Cooldown after consecutive failures, and a circuit breaker over the outcome window."""

    policy: BreakerPolicy = field(default_factory=BreakerPolicy)
    state: CircuitState = CircuitState.CLOSED
    until_ms: int = 0
    cooldown_until_ms: int = 0
    consecutive_failures: int = 0
    probe_successes: int = 0
    closed_at_ms: int = 0  # outcomes before this no longer count against the circuit

    def tick(self, now_ms: int) -> None:
        """An open circuit turns half-open when its time is up."""
        if self.state is CircuitState.OPEN and now_ms >= self.until_ms:
            self.state = CircuitState.HALF_OPEN
            self.probe_successes = 0

    def record(self, now_ms: int, *, failed: bool, window: OutcomeWindow) -> None:
        """One outcome (already added to ``window``)."""
        self.tick(now_ms)
        p = self.policy
        self.consecutive_failures = self.consecutive_failures + 1 if failed else 0
        if self.consecutive_failures >= p.allowed_fails:
            self.cooldown_until_ms = now_ms + p.cooldown_ms
            self.consecutive_failures = 0
        if self.state is CircuitState.HALF_OPEN:
            if failed:
                self._open(now_ms)
            else:
                self.probe_successes += 1
                if self.probe_successes >= p.probes:
                    self.state = CircuitState.CLOSED
                    self.closed_at_ms = now_ms + 1
        elif self.state is CircuitState.CLOSED and failed:
            requests, error_rate = window.since(now_ms, self.closed_at_ms)
            if requests >= p.min_requests and error_rate >= p.fail_ratio:
                self._open(now_ms)

    def _open(self, now_ms: int) -> None:
        self.state = CircuitState.OPEN
        self.until_ms = now_ms + self.policy.open_ms
        self.probe_successes = 0
