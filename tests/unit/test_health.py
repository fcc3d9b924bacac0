"""Instance health as pure state machines: the heartbeat state machine, the router's view of a
silent instance, the outcome window, and the cooldown / circuit breaker."""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from broker.health import (
    Breaker,
    BreakerPolicy,
    HealthPolicy,
    HealthTrack,
    OutcomeWindow,
    next_health,
    observed_state,
)
from broker.records import CircuitState, InstanceCard, InstanceState, InstanceView

UP, DEGRADED, DOWN, DRAINING = (
    InstanceState.UP,
    InstanceState.DEGRADED,
    InstanceState.DOWN,
    InstanceState.DRAINING,
)
POLICY = HealthPolicy()
HEALTHY = {"error_rate": 0.0, "load": 0.2}
ERRING = {"error_rate": 0.2, "load": 0.2}  # strained: error rate over 10 %
BUSY = {"error_rate": 0.0, "load": 0.85}  # strained: load over 80 %
FAILING = {"error_rate": 0.6, "load": 0.2}  # error rate over 50 %


def beats(
    track: HealthTrack, *figures: dict[str, float], policy: HealthPolicy = POLICY
) -> list[InstanceState]:
    """The state after each heartbeat (none lapsed)."""
    states = []
    for f in figures:
        track = next_health(
            track, error_rate=f["error_rate"], load=f["load"], lapsed=False, policy=policy
        )
        states.append(track.state)
    return states


def beat(track: HealthTrack, figures: dict[str, float], *, lapsed: bool = False) -> HealthTrack:
    return next_health(
        track, error_rate=figures["error_rate"], load=figures["load"], lapsed=lapsed, policy=POLICY
    )


DOWN_TRACK = HealthTrack(DOWN)


# -- next_health ------------------------------------------------------------------------------


def test_healthy_beats_stay_up() -> None:
    assert beats(HealthTrack(), *[HEALTHY] * 5) == [UP] * 5


@pytest.mark.parametrize("strain", [ERRING, BUSY], ids=["error-rate", "load"])
def test_degraded_only_after_sustained_strain(strain: dict[str, float]) -> None:
    assert beats(HealthTrack(), strain, strain, strain) == [UP, DEGRADED, DEGRADED]


def test_an_interrupted_strain_does_not_degrade() -> None:
    assert beats(HealthTrack(), ERRING, HEALTHY, BUSY, HEALTHY, ERRING) == [UP] * 5


def test_sustain_beats_is_the_policy() -> None:
    slow = HealthPolicy(sustain_beats=4)
    assert beats(HealthTrack(), *[ERRING] * 4, policy=slow) == [UP, UP, UP, DEGRADED]


def test_thresholds_are_strict() -> None:
    at_limits = {"error_rate": 0.10, "load": 0.80}
    assert beats(HealthTrack(), at_limits, at_limits, at_limits) == [UP, UP, UP]
    half = {"error_rate": 0.50, "load": 0.0}  # strained, not DOWN
    assert beats(HealthTrack(), half, half) == [UP, DEGRADED]


@pytest.mark.parametrize("start", [UP, DEGRADED])
def test_error_rate_over_half_is_down_at_once(start: InstanceState) -> None:
    track = beat(HealthTrack(start), FAILING)
    assert track.state is DOWN
    assert track.healthy_streak == 0


@pytest.mark.parametrize("start", [UP, DEGRADED, DOWN])
def test_lapsed_heartbeats_mean_down(start: InstanceState) -> None:
    assert beat(HealthTrack(start, healthy_streak=2), HEALTHY, lapsed=True).state is DOWN


def test_down_recovers_after_three_healthy_beats() -> None:
    assert POLICY.recover_beats == 3
    assert beats(DOWN_TRACK, HEALTHY, HEALTHY) == [DOWN, DOWN]  # two are not enough
    assert beats(DOWN_TRACK, HEALTHY, HEALTHY, HEALTHY, HEALTHY) == [DOWN, DOWN, UP, UP]


@pytest.mark.parametrize(
    "bad", [FAILING, "lapsed"], ids=["error-rate-over-half", "lapsed-heartbeat"]
)
def test_a_bad_beat_restarts_the_recovery(bad: dict[str, float] | str) -> None:
    track = beat(beat(DOWN_TRACK, HEALTHY), HEALTHY)
    assert (track.state, track.healthy_streak) == (DOWN, 2)
    track = beat(track, HEALTHY, lapsed=True) if bad == "lapsed" else beat(track, FAILING)
    assert (track.state, track.healthy_streak) == (DOWN, 0)
    assert beats(track, HEALTHY, HEALTHY, HEALTHY) == [DOWN, DOWN, UP]


def test_strained_beats_do_not_count_toward_recovery() -> None:
    # DESIGN §5: DOWN -> UP after three consecutive *healthy* heartbeats.
    assert beats(DOWN_TRACK, ERRING, ERRING, ERRING) == [DOWN, DOWN, DOWN]


def test_recover_beats_is_the_policy() -> None:
    quick = HealthPolicy(recover_beats=1)
    assert beats(DOWN_TRACK, HEALTHY, policy=quick) == [UP]
    slow = HealthPolicy(recover_beats=5)
    assert beats(DOWN_TRACK, *[HEALTHY] * 5, policy=slow) == [DOWN] * 4 + [UP]


@pytest.mark.parametrize("figures", [HEALTHY, ERRING, FAILING])
@pytest.mark.parametrize("lapsed", [False, True])
def test_draining_is_sticky(figures: dict[str, float], lapsed: bool) -> None:
    track = HealthTrack(DRAINING)
    assert beat(track, figures, lapsed=lapsed) == track


# -- observed_state ---------------------------------------------------------------------------

NOW = 1_000_000
DOWN_AFTER = 15_000


def view(state: InstanceState, heartbeat_ms: int) -> InstanceView:
    card = InstanceCard(
        agent_id="a",
        instance_id="a-1",
        capabilities=("x.y",),
        endpoint="http://127.0.0.1/a",
        max_inflight=4,
    )
    return InstanceView(card=card, state=state, credits=4, inflight=0, heartbeat_ms=heartbeat_ms)


def observed(state: InstanceState, age_ms: int) -> InstanceState:
    return observed_state(view(state, NOW - age_ms), now_ms=NOW, down_after_ms=DOWN_AFTER)


@pytest.mark.parametrize("state", [UP, DEGRADED])
def test_silence_past_down_after_is_down(state: InstanceState) -> None:
    assert observed(state, 0) is state
    assert observed(state, DOWN_AFTER) is state
    assert observed(state, DOWN_AFTER + 1) is DOWN
    assert observed(state, 10 * DOWN_AFTER) is DOWN


def test_observed_draining_stays_draining_and_down_stays_down() -> None:
    assert observed(DRAINING, 10 * DOWN_AFTER) is DRAINING
    assert observed(DRAINING, 0) is DRAINING
    assert observed(DOWN, 0) is DOWN
    assert observed(DOWN, 10 * DOWN_AFTER) is DOWN


# -- OutcomeWindow ----------------------------------------------------------------------------


def fill(window: OutcomeWindow, events: Iterable[tuple[int, bool, float]]) -> OutcomeWindow:
    for t, failed, latency in events:
        window.add(t, failed=failed, latency_ms=latency)
    return window


def test_an_empty_window() -> None:
    assert OutcomeWindow().figures(NOW) == (0, 0.0, 0.0)


def test_error_rate_over_the_window() -> None:
    window = fill(OutcomeWindow(), [(NOW + i, i % 10 < 3, 10.0) for i in range(20)])
    requests, error_rate, _ = window.figures(NOW + 20)
    assert requests == 20
    assert error_rate == pytest.approx(0.3)


def test_p95_over_the_window() -> None:
    # 3 % slow: the p95 is a fast one; 10 % slow: a slow one.
    few_slow = [(NOW + i, False, 500.0 if i < 3 else 10.0 + i % 7) for i in range(100)]
    assert fill(OutcomeWindow(), few_slow).figures(NOW + 100)[2] <= 16.0
    many_slow = [(NOW + i, False, 500.0 if i % 10 == 0 else 10.0) for i in range(100)]
    assert fill(OutcomeWindow(), many_slow).figures(NOW + 100)[2] == 500.0
    assert fill(OutcomeWindow(), [(NOW, False, 42.0)]).figures(NOW) == (1, 0.0, 42.0)


def test_old_events_expire() -> None:
    window = OutcomeWindow(span_ms=1_000)
    fill(window, [(NOW, True, 900.0), (NOW + 500, False, 10.0), (NOW + 999, False, 20.0)])
    assert window.figures(NOW + 999)[:2] == (3, pytest.approx(1 / 3))
    # An event exactly span_ms old has left the window.
    assert window.figures(NOW + 1_000) == (2, 0.0, 20.0)
    assert window.figures(NOW + 1_500) == (1, 0.0, 20.0)
    assert window.figures(NOW + 5_000) == (0, 0.0, 0.0)
    window.add(NOW + 5_000, failed=True, latency_ms=7.0)
    assert window.figures(NOW + 5_000) == (1, 1.0, 7.0)


def naive_figures(
    events: list[tuple[int, bool, float]], now: int, span: int, since: int = 0
) -> tuple[int, float, float]:
    """The window's figures recomputed from every outcome, as it once did each time."""
    kept = [e for e in events if e[0] > now - span and e[0] >= since]
    if not kept:
        return 0, 0.0, 0.0
    latencies = sorted(latency for _, _, latency in kept)
    failures = sum(failed for _, failed, _ in kept)
    return len(kept), failures / len(kept), latencies[max(0, math.ceil(0.95 * len(kept)) - 1)]


@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # time step, in hundreds of ms: outcomes meet the mark
            st.sampled_from(["add", "figures", "since"]),
            st.booleans(),
            st.floats(0.0, 1e6, allow_nan=False),
            st.integers(-4, 1),  # since, in hundreds of ms from now: marks met again
        ),
        max_size=120,
    )
)
# outcomes at the very millisecond of the mark: one added there after the mark was set, and
# one there when it leaves the window
@example([(0, "since", False, 1.0, 1), (1, "add", False, 1.0, 0), (0, "since", False, 1.0, 0)])
@example(
    [
        (0, "add", True, 1.0, 0),
        (0, "since", False, 1.0, 0),
        (4, "since", False, 1.0, -4),
        (0, "figures", False, 1.0, 0),
    ]
)
def test_the_window_keeps_what_a_full_recount_would_say(
    steps: list[tuple[int, str, bool, float, int]],
) -> None:
    """Whatever the order of outcomes, figures and marks, the running totals, the sorted
    latencies and the count before the mark agree with recounting the whole window."""
    span = 300
    window = OutcomeWindow(span_ms=span)
    events: list[tuple[int, bool, float]] = []
    now = NOW
    for step, what, failed, latency, since in steps:
        now += step * 100
        if what == "add":
            window.add(now, failed=failed, latency_ms=latency)
            events.append((now, failed, latency))
        elif what == "figures":
            assert window.figures(now) == pytest.approx(naive_figures(events, now, span))
        else:
            n, rate, _ = naive_figures(events, now, span, since=now + since * 100)
            assert window.since(now, now + since * 100) == (n, pytest.approx(rate))


def test_since_filters_older_outcomes() -> None:
    window = fill(OutcomeWindow(), [(NOW + i, i < 6, 100.0 if i < 6 else 5.0) for i in range(10)])
    assert window.figures(NOW + 10)[:2] == (10, pytest.approx(0.6))
    assert window.since(NOW + 10, NOW + 6) == (4, 0.0)
    assert window.since(NOW + 10, NOW + 100) == (0, 0.0)
    assert window.since(NOW + 10, NOW + 3) == (7, pytest.approx(3 / 7))
    assert window.figures(NOW + 10)[0] == 10  # filtering removes nothing from the window


# -- Breaker ----------------------------------------------------------------------------------


class Feed:
    """A breaker and its window, fed outcomes as the sidecar does (window first)."""

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.window = OutcomeWindow()
        self.breaker = Breaker(policy or BreakerPolicy())

    def __call__(self, now_ms: int, *outcomes: bool) -> Breaker:
        """Record ``outcomes`` (True = failed), one ms apart from ``now_ms``."""
        for i, failed in enumerate(outcomes):
            self.window.add(now_ms + i, failed=failed, latency_ms=10.0)
            self.breaker.record(now_ms + i, failed=failed, window=self.window)
        return self.breaker


OK, FAIL = False, True
NO_COOLDOWN = BreakerPolicy(allowed_fails=1_000)  # isolate the circuit from the cooldown


def test_consecutive_failures_start_a_cooldown() -> None:
    feed = Feed()
    breaker = feed(NOW, FAIL, FAIL)
    assert breaker.cooldown_until_ms == 0
    breaker = feed(NOW + 10, FAIL)
    assert breaker.cooldown_until_ms == NOW + 10 + 30_000
    assert breaker.consecutive_failures == 0
    assert breaker.state is CircuitState.CLOSED  # 3 requests: too few for the circuit


def test_a_success_resets_the_failure_count() -> None:
    feed = Feed()
    breaker = feed(NOW, FAIL, FAIL, OK, FAIL, FAIL, OK, FAIL)
    assert breaker.cooldown_until_ms == 0
    assert breaker.consecutive_failures == 1


def test_the_count_restarts_after_a_cooldown() -> None:
    feed = Feed(BreakerPolicy(allowed_fails=2, cooldown_ms=1_000, min_requests=100))
    breaker = feed(NOW, FAIL, FAIL)
    assert breaker.cooldown_until_ms == NOW + 1 + 1_000
    breaker = feed(NOW + 100, FAIL)
    assert breaker.cooldown_until_ms == NOW + 1 + 1_000  # one failure: not yet again
    breaker = feed(NOW + 200, FAIL)
    assert breaker.cooldown_until_ms == NOW + 200 + 1_000


def test_half_failures_over_ten_requests_open_the_circuit() -> None:
    feed = Feed(NO_COOLDOWN)
    breaker = feed(NOW, *[OK, FAIL] * 4, OK)  # 9 requests, 4 failed
    assert breaker.state is CircuitState.CLOSED
    breaker = feed(NOW + 9, FAIL)  # 10 requests, 5 failed
    assert breaker.state is CircuitState.OPEN
    assert breaker.until_ms == NOW + 9 + 30_000


def test_too_few_requests_or_failures_keep_it_closed() -> None:
    few = Feed(NO_COOLDOWN)
    assert few(NOW, *[FAIL] * 9).state is CircuitState.CLOSED  # 9 requests: too few
    mostly_ok = Feed(NO_COOLDOWN)
    assert mostly_ok(NOW, *[OK] * 6, *[FAIL] * 5).state is CircuitState.CLOSED  # 5 of 11
    assert mostly_ok(NOW + 11, FAIL).state is CircuitState.OPEN  # 6 of 12


def test_failures_that_left_the_window_do_not_count() -> None:
    feed = Feed(NO_COOLDOWN)
    feed(NOW, *[FAIL] * 9)
    breaker = feed(NOW + 60_009, FAIL)  # the 9 earlier failures have just expired
    assert feed.window.figures(NOW + 60_009)[0] == 1
    assert breaker.state is CircuitState.CLOSED
    breaker = feed(NOW + 60_010, *[FAIL] * 9)  # ten failures inside the window
    assert breaker.state is CircuitState.OPEN


def opened(now_ms: int = NOW) -> tuple[Feed, int]:
    """A feed whose circuit opened at ``now_ms + 9``; returns it and the half-open time."""
    feed = Feed(NO_COOLDOWN)
    breaker = feed(now_ms, *[FAIL] * 10)
    assert breaker.state is CircuitState.OPEN
    return feed, breaker.until_ms


def test_tick_turns_an_open_circuit_half_open_when_its_time_is_up() -> None:
    feed, until = opened()
    breaker = feed.breaker
    breaker.tick(until - 1)
    assert breaker.state is CircuitState.OPEN
    breaker.tick(until)
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.probe_successes == 0


def test_outcomes_while_open_change_nothing() -> None:
    feed, until = opened()
    breaker = feed(until - 100, OK, FAIL)
    assert (breaker.state, breaker.until_ms) == (CircuitState.OPEN, until)


def test_three_good_probes_close_the_circuit() -> None:
    feed, until = opened()
    feed.breaker.tick(until)
    breaker = feed(until, OK, OK)
    assert breaker.state is CircuitState.HALF_OPEN
    breaker = feed(until + 2, OK)
    assert breaker.state is CircuitState.CLOSED


def test_record_itself_turns_half_open() -> None:
    feed, until = opened()
    breaker = feed(until, OK)  # no tick first: the outcome is the first probe
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.probe_successes == 1


def test_a_failed_probe_reopens() -> None:
    feed, until = opened()
    feed.breaker.tick(until)
    breaker = feed(until, OK, OK, FAIL)
    assert breaker.state is CircuitState.OPEN
    assert breaker.until_ms == until + 2 + 30_000
    breaker.tick(breaker.until_ms)
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.probe_successes == 0  # the earlier good probes do not carry over
    assert feed(breaker.until_ms, OK, OK).state is CircuitState.HALF_OPEN


def test_after_closing_old_failures_do_not_reopen_it() -> None:
    feed, until = opened()
    feed.breaker.tick(until)
    closed_at = until + 10
    assert feed(closed_at - 2, OK, OK, OK).state is CircuitState.CLOSED
    # The ten failures are still in the 60 s window (and the ratio over it is above half):
    assert feed.window.figures(closed_at + 1)[1] > 0.5
    assert feed(closed_at + 1, OK).state is CircuitState.CLOSED
    assert feed(closed_at + 2, FAIL).state is CircuitState.CLOSED
    assert feed(closed_at + 3, FAIL, FAIL).state is CircuitState.CLOSED


def test_after_closing_new_failures_still_open_it() -> None:
    feed, until = opened()
    feed.breaker.tick(until)
    feed(until, OK, OK, OK)
    assert feed.breaker.state is CircuitState.CLOSED
    breaker = feed(until + 100, *[OK] * 5, *[FAIL] * 4)
    assert breaker.state is CircuitState.CLOSED  # 4 of 9 since closing
    breaker = feed(until + 200, FAIL)  # 5 of 10 since closing
    assert breaker.state is CircuitState.OPEN


def test_a_strained_beat_restarts_recovery_from_down() -> None:
    policy = HealthPolicy()
    track = HealthTrack(InstanceState.DOWN)
    for error_rate in (0.0, 0.3, 0.0, 0.0):  # healthy, strained, healthy, healthy
        track = next_health(track, error_rate=error_rate, load=0.0, lapsed=False, policy=policy)
    assert track.state is InstanceState.DOWN
    track = next_health(track, error_rate=0.0, load=0.0, lapsed=False, policy=policy)
    assert track.state is InstanceState.UP


def test_p95_is_the_nearest_rank() -> None:
    window = OutcomeWindow(span_ms=60_000)
    for i in range(95):
        window.add(1_000 + i, failed=False, latency_ms=10.0)
    for i in range(5):
        window.add(2_000 + i, failed=False, latency_ms=500.0)
    assert window.figures(3_000) == (100, 0.0, 10.0)
    window.add(3_000, failed=False, latency_ms=500.0)  # 6 of 101 slow: now p95 is slow
    assert window.figures(3_000)[2] == 500.0
