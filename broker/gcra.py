"""The generic cell rate algorithm (GCRA), the one rule every rate limit follows. Pure.

A limit is an emission interval ``T`` (ms per call: ``10/s`` is 100 ms) and a ``burst``
``B`` (calls that may start at once). Its whole state is one number, the *theoretical
arrival time* ``tat``: a call at ``now`` conforms when ``max(tat, now) + T - now <= B·T``,
and then ``tat`` becomes ``max(tat, now) + T``. In any window of ``W`` ms at most
``B + W / T`` calls conform. A call that does not conform may start ``wait`` ms later.

``lua/assign.lua`` (instance limits, with the credit) and ``lua/gcra.lua`` (agent, capability
and tenant limits) run this same arithmetic in Redis, where the state lives; a dispatcher
runs it locally to route around an instance that would refuse (``workers/routing_table.py``).

``now`` is the caller's clock: dispatchers' clocks differ a little. A state further ahead
than any conforming call leaves it (``tat > now + (B+1)·T``: one interval of slack for
rounding) was written by a clock ahead of the caller's, and is read as ``now``: a skewed
dispatcher can hold a limit for at most ``(B+1)·T``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rounding: the state is kept to the microsecond (``%.3f`` in Redis); a call this close to
# conforming conforms.
EPSILON_MS = 0.001


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    tat: float  # the state after this call (unchanged when refused)
    wait_ms: float  # 0 when allowed; else how long until a call would conform


def gcra(tat: float, now: float, interval_ms: float, burst: int) -> Verdict:
    if tat > now + (burst + 1) * interval_ms:  # no call leaves it there: a clock ahead did
        tat = now
    new_tat = max(tat, now) + interval_ms
    over = new_tat - now - burst * interval_ms
    if over > EPSILON_MS:
        return Verdict(False, tat, over)
    return Verdict(True, new_tat, 0.0)


def ready_at(tat: float, interval_ms: float, burst: int) -> float:
    """When the next call conforms, given the state ``tat``."""
    return tat - burst * interval_ms + interval_ms
