"""How often CPython's cyclic garbage collector runs, for a long-lived broker process.

By default a full collection comes every 70,000 net allocations (thresholds 700, 10, 10),
and each one walks every live object: a dispatcher's registry snapshot, its routing
candidates, the pipeliner's buffers. Allocation-heavy work — a routing decision over 2,000
candidates — meets one often enough that its p99 is the collection, not the decision
(``python -m bench.routing``, 2,000 candidates: p99 18–24 ms with the defaults, 2.0–2.2 ms
with these; 1.9 ms with no cyclic collection at all). Almost all of the broker's garbage is
freed by reference counting the moment it is dropped; the cyclic collector only finds
cycles, and finding them less often costs a little memory, not correctness.
"""

from __future__ import annotations

import gc

THRESHOLDS = (100_000, 50, 100)


def tune_gc() -> None:
    """Collect young cycles every 100,000 allocations, and rarely walk everything."""
    gc.set_threshold(*THRESHOLDS)
