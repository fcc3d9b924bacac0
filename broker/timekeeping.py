"""The broker's one wall clock: milliseconds since the epoch, as every record stores them, on
Redis's clock.

Processes on many hosts write times that others judge: a sidecar's heartbeat is read by every
dispatcher and reaper (and by Redis's own ``TIME`` in the direct lane's script), a producer's
deadline by the reaper. A host whose clock is off by more than ``down_after_s`` would have its
live sidecars read as DOWN, or a dead one as alive that much longer; a producer's clock behind
would send messages whose deadline has already passed. So each process keeps the offset of
its clock to Redis's ``TIME`` (measured when a connection opens and every
:data:`REALIGN_S` after, :func:`broker.connection.keep_clock_aligned`), and :func:`now_ms` adds
it.

An offset within :data:`TOLERANCE_MS` is not applied: the processes of one host, and hosts kept
by NTP, keep their own clocks, so two of them never disagree by a measurement's rounding (a
timeline's stages stay in order), and an offset is changed only by a measurement that differs
from it by more than that. A measurement whose round trip took longer than that is not used.
"""

from __future__ import annotations

import time

TOLERANCE_MS = 100
REALIGN_S = 60.0

_offset_ms = 0


def now_ms() -> int:
    """Now, on Redis's clock (this host's, where the two agree within :data:`TOLERANCE_MS`)."""
    return time.time_ns() // 1_000_000 + _offset_ms


def now_s() -> float:
    """:func:`now_ms` in seconds, to the clock's own precision (an envelope's ``created_at``)."""
    return time.time() + _offset_ms / 1000


def local_ms() -> int:
    """Now on this host's own clock: what a measurement of the offset compares with."""
    return time.time_ns() // 1_000_000


def offset_ms() -> int:
    """What :func:`now_ms` adds to this host's clock."""
    return _offset_ms


def aligned_offset(server_ms: int, sent_ms: int, answered_ms: int, current_ms: int) -> int:
    """The offset to keep after asking Redis the time: ``server_ms`` its answer, asked at
    ``sent_ms`` and answered at ``answered_ms`` on this host's clock. The answer is taken as
    given halfway through the round trip; ``current_ms`` stays unless the measurement is
    tight (a round trip within :data:`TOLERANCE_MS`) and differs from it by more than that,
    and an offset within that of none is none."""
    if not 0 <= answered_ms - sent_ms <= TOLERANCE_MS:
        return current_ms
    measured = server_ms - (sent_ms + answered_ms) // 2
    if abs(measured - current_ms) <= TOLERANCE_MS:
        return current_ms
    return 0 if abs(measured) <= TOLERANCE_MS else measured


def align(offset: int) -> None:
    """Set the offset :func:`now_ms` adds (:func:`aligned_offset` says which)."""
    global _offset_ms
    _offset_ms = offset


def server_time_ms(reply: object) -> int | None:
    """Redis's ``TIME`` answer (seconds and microseconds, as strings) in milliseconds, or
    ``None`` for anything else."""
    if not isinstance(reply, list) or len(reply) != 2:
        return None
    try:
        seconds, micros = (int(part) for part in reply)
    except (TypeError, ValueError):
        return None
    if seconds < 0 or not 0 <= micros < 1_000_000:
        return None
    return seconds * 1000 + micros // 1000
