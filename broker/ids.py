"""Time-sortable message ids (ULID layout: 48-bit milliseconds, 80 random bits, Crockford base32).

Pure: the caller passes the time and the random bits, so tests can pin both.
"""

from __future__ import annotations

import hashlib
import os
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# Two characters per 10 bits: 13 table lookups per id instead of 26 shifts (ids are minted per
# message on the dispatch path).
_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]
_SHIFTS = tuple(range(120, -1, -10))


def encode_ulid(timestamp_ms: int, randomness: bytes) -> str:
    """Encode a ULID from a millisecond timestamp and 10 random bytes (26 characters)."""
    if not 0 <= timestamp_ms < 1 << 48:
        raise ValueError("timestamp_ms must fit in 48 bits")
    if len(randomness) != 10:
        raise ValueError("randomness must be 10 bytes")
    value = (timestamp_ms << 80) | int.from_bytes(randomness, "big")
    return "".join([_PAIRS[(value >> shift) & 1023] for shift in _SHIFTS])


def new_message_id() -> str:
    """A fresh ULID for the current time."""
    return encode_ulid(time.time_ns() // 1_000_000, os.urandom(10))


def entry_message_id(stream: str, entry_id: str, *, now_ms: int, key: bytes) -> str | None:
    """The id of the message an ingress entry without one names: a ULID of the entry's time,
    its randomness a keyed hash of the stream and entry id — so handling the entry twice (a
    dispatcher restarted mid-batch) names the same message, which must not run twice under
    two ids, while no producer can compute it ahead of time and take it for an envelope of
    its own (``key`` is the broker's, kept where producers cannot read it).

    ``None`` when the entry's time is not in the past — a producer chose an explicit entry
    id ahead of the clock (and every ``*`` id Redis gives after it inherits that time) — or
    is no entry id at all: a producer's explicit id must not decide the time, or the
    validity, of other producers' message ids. The dispatcher then mints a fresh id and keeps
    it beside the entry until the entry is acknowledged (``Keyspace.entry_name``)."""
    millis, sep, seq = entry_id.partition("-")
    if not (sep and millis.isdigit() and seq.isdigit()) or int(millis) > now_ms:
        return None
    source = f"{stream}\0{entry_id}".encode()
    digest = hashlib.blake2b(source, digest_size=10, key=key[:64]).digest()
    return encode_ulid(int(millis), digest)
