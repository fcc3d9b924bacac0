"""Redis Cluster hash slots: which of the 16,384 slots a key lives in. Pure.

The rule is the cluster specification's: CRC16 (XMODEM) of the key modulo 16,384, where a key
holding a non-empty ``{tag}`` hashes only its first tag. Every Lua script is called with keys
of one slot (records, timelines and outcomes share ``{<id>}``; an instance's keys share
``{<inst>}``): :func:`one_slot` says whether a set of keys does, so a cluster connection can
refuse a cross-slot call before Redis answers ``CROSSSLOT``.
"""

from __future__ import annotations

import binascii
from collections.abc import Iterable

SLOTS = 16384


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0) — the standard library's
    ``binascii.crc_hqx``, in C: every command a cluster connection sends is hashed."""
    return binascii.crc_hqx(data, 0)


def hash_part(key: bytes) -> bytes:
    """What of ``key`` is hashed: the first ``{…}`` when it holds at least one byte, else all."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def key_slot(key: str | bytes) -> int:
    raw = key.encode() if isinstance(key, str) else key
    return crc16(hash_part(raw)) % SLOTS


def one_slot(keys: Iterable[str | bytes]) -> bool:
    """Whether all ``keys`` hash to one slot (no keys: trivially)."""
    return len({key_slot(key) for key in keys}) <= 1


_TAGS: list[str] = []


def slot_tag(slot: int) -> str:
    """A short hash tag whose key hashes to ``slot``: ``f"name:{{{slot_tag(s)}}}"`` lives in
    slot ``s``. The table is found once, on first use (about 170,000 CRCs, under a second),
    only by a process on a cluster."""
    if not _TAGS:
        found: dict[int, str] = {}
        n = 0
        while len(found) < SLOTS:
            tag = format(n, "x")
            found.setdefault(crc16(tag.encode()) % SLOTS, tag)
            n += 1
        _TAGS.extend(found[s] for s in range(SLOTS))
    return _TAGS[slot]
