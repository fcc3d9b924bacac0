"""What a delivery attempt tells the sidecar, as data.

The four kinds differ in what is known about the agent: it answered (``Succeeded``,
``Failed``), it was provably never reached (``NotReached``: a retry is always safe), or the
request left and no answer came back (``Ambiguous``: only an idempotent agent may be retried).
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


Outcome = Succeeded | Failed | NotReached | Ambiguous
