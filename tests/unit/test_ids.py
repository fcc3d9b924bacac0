"""ULID message ids: layout, known vectors, time order, input checks."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.ids import encode_ulid, new_message_id

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
ULID = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")
PROPERTY = settings(database=None)
timestamps = st.integers(0, (1 << 48) - 1)
KEY = b"k" * 32
randomness = st.binary(min_size=10, max_size=10)


def decode_ulid(text: str) -> tuple[int, bytes]:
    value = 0
    for char in text:
        value = value * 32 + CROCKFORD.index(char)
    return value >> 80, (value & ((1 << 80) - 1)).to_bytes(10, "big")


def test_zero_vector() -> None:
    assert encode_ulid(0, bytes(10)) == "0" * 26


def test_hand_computed_vectors() -> None:
    # 26 characters hold 130 bits: 2 zero pad bits, 48 of time, 80 of randomness.
    # Time 1 is bit 80, i.e. the 17th character from the right has value 1.
    assert encode_ulid(1, bytes(10)) == "0" * 9 + "1" + "0" * 16
    # Randomness 0x...1f is the last character at value 31 ("Z").
    assert encode_ulid(0, bytes(9) + b"\x1f") == "0" * 25 + "Z"
    # 0x20 carries into the next character.
    assert encode_ulid(0, bytes(9) + b"\x20") == "0" * 24 + "10"
    # Time 10 = 0b01010: "A" (10) in the time's last character.
    assert encode_ulid(10, bytes(10)) == "0" * 9 + "A" + "0" * 16
    # Time 32 = 0b100000: one character further left.
    assert encode_ulid(32, bytes(10)) == "0" * 8 + "10" + "0" * 16
    # The largest ULID of the spec.
    assert encode_ulid((1 << 48) - 1, b"\xff" * 10) == "7" + "Z" * 25


def test_spec_time_prefix() -> None:
    # ulid/spec: time 1469918176385 encodes as 01ARYZ6S41.
    assert encode_ulid(1469918176385, bytes(10))[:10] == "01ARYZ6S41"


@PROPERTY
@given(ts=timestamps, rnd=randomness)
def test_layout_round_trips(ts: int, rnd: bytes) -> None:
    text = encode_ulid(ts, rnd)
    assert ULID.match(text)
    assert decode_ulid(text) == (ts, rnd)


@PROPERTY
@given(a=timestamps, b=timestamps, ra=randomness, rb=randomness)
def test_lexicographic_order_follows_time(a: int, b: int, ra: bytes, rb: bytes) -> None:
    if a < b:
        assert encode_ulid(a, ra) < encode_ulid(b, rb)
    elif a > b:
        assert encode_ulid(a, ra) > encode_ulid(b, rb)
    else:
        assert (encode_ulid(a, ra) < encode_ulid(b, rb)) == (ra < rb)


@pytest.mark.parametrize("ts", [-1, 1 << 48, 1 << 60])
def test_timestamp_out_of_range(ts: int) -> None:
    with pytest.raises(ValueError, match="48 bits"):
        encode_ulid(ts, bytes(10))


@pytest.mark.parametrize("rnd", [b"", bytes(9), bytes(11)])
def test_randomness_of_wrong_length(rnd: bytes) -> None:
    with pytest.raises(ValueError, match="10 bytes"):
        encode_ulid(0, rnd)


def test_new_message_id_is_current_and_unique() -> None:
    before = time.time_ns() // 1_000_000
    ids = [new_message_id() for _ in range(100)]
    after = time.time_ns() // 1_000_000

    assert len(set(ids)) == 100
    for text in ids:
        assert ULID.match(text)
        assert before <= decode_ulid(text)[0] <= after


def test_an_ingress_entry_always_names_the_same_message() -> None:
    from broker.ids import entry_message_id

    now = 1_800_000_000_000
    first = entry_message_id("reach:in", "1700000000000-3", now_ms=now, key=KEY)
    assert first is not None
    assert first == entry_message_id("reach:in", "1700000000000-3", now_ms=now + 5_000, key=KEY)
    assert first != entry_message_id("reach:in", "1700000000000-4", now_ms=now, key=KEY)
    assert first != entry_message_id("other:in", "1700000000000-3", now_ms=now, key=KEY)
    assert first[:10] == encode_ulid(1_700_000_000_000, bytes(10))[:10]  # its time
    # another broker key names another message: no one without the key can compute it
    other = entry_message_id("reach:in", "1700000000000-3", now_ms=now, key=b"x" * 32)
    assert other is not None and other != first and other[:10] == first[:10]


@pytest.mark.parametrize(
    "entry_id",
    [
        "1800000000001-0",  # ahead of the clock: a producer's explicit id, or one after it
        f"{1 << 48}-0",  # beyond what a ULID can hold
        "18446744073709551615-18446744073709551615",  # the largest id Redis accepts
        "garbage",
        "12-",
        "-1",
    ],
)
def test_an_entry_time_the_clock_has_not_reached_names_nothing(entry_id: str) -> None:
    from broker.ids import entry_message_id

    assert entry_message_id("reach:in", entry_id, now_ms=1_800_000_000_000, key=KEY) is None


@PROPERTY
@given(millis=st.integers(0, 1 << 64), seq=st.integers(0, 1 << 64), now=timestamps)
def test_any_entry_id_names_a_valid_id_or_nothing(millis: int, seq: int, now: int) -> None:
    from broker.ids import entry_message_id

    named = entry_message_id("reach:in", f"{millis}-{seq}", now_ms=now, key=KEY)
    assert (named is None) == (millis > now)
    assert named is None or ULID.match(named)
