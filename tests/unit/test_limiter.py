"""The adaptive credit limit: steady latency keeps it up, a slowdown brings it down."""

from __future__ import annotations

import random

from broker.limiter import AdaptiveLimit


def test_steady_jittery_latency_keeps_the_limit_at_its_ceiling() -> None:
    limit = AdaptiveLimit(ceiling=8)
    rng = random.Random(5)
    for _ in range(1000):
        limit.on_answer(rng.uniform(15, 30))
    assert limit.credits == 8


def test_a_slowdown_from_20_ms_to_2_s_cuts_the_limit_within_a_few_answers() -> None:
    limit = AdaptiveLimit(ceiling=8)
    for _ in range(200):
        limit.on_answer(20)
    for _ in range(10):  # 10 slow answers: ~2.5 s of an 8-wide agent at 2 s each
        limit.on_answer(2000)
    assert limit.credits <= 5


def test_overload_halves_and_the_floor_holds() -> None:
    limit = AdaptiveLimit(ceiling=16)
    limit.on_overload()
    assert limit.credits == 8
    for _ in range(10):
        limit.on_overload()
    assert limit.credits == 1


def test_it_recovers_once_the_agent_is_fast_again() -> None:
    limit = AdaptiveLimit(ceiling=8)
    for _ in range(20):
        limit.on_overload()
    for _ in range(200):
        limit.on_answer(20)
    assert limit.credits == 8


def test_a_call_running_past_normal_counts_once_before_it_answers() -> None:
    limit = AdaptiveLimit(ceiling=8)
    assert not limit.on_overdue(5_000.0)  # nothing known yet of normal: not counted
    for _ in range(50):
        limit.on_answer(20.0)
    assert limit.credits == 8
    threshold = limit.overdue_after_ms()
    assert threshold is not None and 40.0 < threshold < 100.0
    assert not limit.on_overdue(threshold - 1)  # still within normal
    for _ in range(8):  # eight calls each seen running for 200 ms, none answered yet
        assert limit.on_overdue(200.0)
    assert limit.credits < 8


def test_a_lasting_slowdown_takes_even_a_small_limit_to_the_floor() -> None:
    for ceiling in (2, 4, 8, 64):
        limit = AdaptiveLimit(ceiling=ceiling)
        for _ in range(200):
            limit.on_answer(20)
        first = None
        for n in range(1, 60):
            limit.on_answer(2000)
            if first is None and limit.credits < ceiling:
                first = n
        assert first is not None and first <= 3, (ceiling, first)
        assert limit.credits == 1, ceiling
