"""What a delivery attempt tells the sidecar, as data.

The kinds differ in what is known about the agent: it answered (``Succeeded``, ``Failed``),
it asked for time (``Backoff``: 429 / 503, it did not take the work), it took the work and
will call back (``Accepted``: 202, async agents), it was provably never
reached (``NotReached``: a retry is always safe), or the request left and no answer came back
(``Ambiguous``: only an idempotent agent may be retried).
"""

from __future__ import annotations

import msgspec


class Succeeded(msgspec.Struct, frozen=True, tag=True):
    result: bytes  # JSON


class Failed(msgspec.Struct, frozen=True, tag=True):
    reason: str
    fault: bool = True  # the agent's own failure (5xx, an exception), not a refused request


class NotReached(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Ambiguous(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Backoff(msgspec.Struct, frozen=True, tag=True):
    """The agent answered 429 / 503: too busy now, not failed; try again after a while."""

    reason: str
    retry_after_s: float


class Accepted(msgspec.Struct, frozen=True, tag=True):
    """The agent took the work (202) and will call back with the result."""

    task_id: str = ""


Outcome = Succeeded | Failed | NotReached | Ambiguous | Backoff | Accepted
