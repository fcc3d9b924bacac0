"""The broker's one wall clock: milliseconds since the epoch, as every record stores them."""

from __future__ import annotations

import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000
