"""How long a retry waits: exponential back-off with jitter (DESIGN §5). Pure."""

from __future__ import annotations

import random

MAX_DELAY_MS = 60_000


def retry_delay_ms(
    attempt: int,
    *,
    base_ms: int,
    jitter: float,
    rng: random.Random,
    cap_ms: int = MAX_DELAY_MS,
) -> int:
    """The wait before the attempt after ``attempt`` (1 for the first retry's wait): base,
    doubled for every attempt already made, at most ``cap_ms`` (a minute), spread by
    ±``jitter``."""
    delay: int = min(cap_ms, base_ms << max(0, attempt - 1))
    return max(1, int(delay * rng.uniform(1 - jitter, 1 + jitter)))
