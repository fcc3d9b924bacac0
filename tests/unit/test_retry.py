"""Retry back-off: doubling per attempt, jitter within bounds, capped."""

from __future__ import annotations

import random

from broker.retry import MAX_DELAY_MS, retry_delay_ms


def test_back_off_doubles_per_attempt_within_the_jitter() -> None:
    rng = random.Random(3)
    for attempt, base in ((1, 200), (2, 400), (3, 800)):
        delays = [retry_delay_ms(attempt, base_ms=200, jitter=0.2, rng=rng) for _ in range(200)]
        assert min(delays) >= base * 0.8 and max(delays) <= base * 1.2
        assert len(set(delays)) > 20  # jittered, not one value


def test_back_off_is_capped() -> None:
    rng = random.Random(1)
    assert retry_delay_ms(40, base_ms=200, jitter=0.0, rng=rng) == MAX_DELAY_MS
