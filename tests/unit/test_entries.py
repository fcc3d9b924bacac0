"""Ingress and instance-stream entries read without trusting a byte: broker/entries.py."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.entries import (
    Assignment,
    IngressEntry,
    MalformedEntry,
    fields_as_bytes,
    parse_assignment,
    parse_ingress,
)
from broker.envelope import decode_envelope
from broker.errors import InvalidEnvelope
from broker.ids import entry_message_id

names = st.one_of(st.just(b"envelope"), st.binary(max_size=12))
flats = st.lists(st.binary(max_size=64) | names, max_size=8)
entry_ids = st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 1 << 64), st.integers(0, 9))


@given(entry_id=entry_ids, flat=flats, now=st.integers(0, (1 << 48) - 1))
def test_any_entry_is_an_envelope_to_judge_or_a_rejection_with_a_reason(
    entry_id: str, flat: list[bytes], now: int
) -> None:
    parsed = parse_ingress(entry_id, flat)
    if isinstance(parsed, IngressEntry):
        assert flat == [b"envelope", parsed.envelope]
        try:
            decode_envelope(parsed.envelope, max_bytes=1 << 20, reply_prefix="reach:reply:")
        except InvalidEnvelope as exc:
            assert exc.reason and exc.raw == parsed.envelope
    else:
        assert isinstance(parsed, MalformedEntry) and parsed.reason
        # the dead letter keeps every field, losslessly
        decoded = msgspec.json.decode(parsed.raw)
        assert len(decoded) == len(flat) // 2
    named = entry_message_id("reach:in", entry_id, now_ms=now, key=b"key")
    assert named is None or len(named) == 26


@given(st.binary(max_size=300))
def test_any_bytes_as_an_envelope_decode_or_are_refused_with_a_reason(raw: bytes) -> None:
    try:
        decode_envelope(raw, max_bytes=256, reply_prefix="reach:reply:")
    except InvalidEnvelope as exc:
        assert exc.reason


def test_the_fields_of_a_dead_letter_round_trip_bytes_that_are_not_utf8() -> None:
    raw = fields_as_bytes([(b"\xff", b"v"), (b"k", b"\xc3(")])
    assert msgspec.json.decode(raw) == [[{"base64": "/w=="}, "v"], ["k", {"base64": "wyg="}]]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"id": b"m1", "attempt": b"2"}, Assignment("1-0", "m1", 2)),
        ({"id": b"m1"}, "needs the fields"),
        ({"id": b"m1", "attempt": b"0"}, "not an attempt number"),
        ({"id": b"m1", "attempt": b"-1"}, "not an attempt number"),
        ({"id": b"m1", "attempt": b"99999999999999999999"}, "not an attempt number"),
        ({"id": b"m1", "attempt": b"9" * 4301}, "not an attempt number"),  # int() raised
        ({"id": b"m1", "attempt": b"0" * 4301 + b"7"}, Assignment("1-0", "m1", 7)),
        ({"id": b"a{b}", "attempt": b"1"}, "not a message id"),
        ({"id": b"\xff", "attempt": b"1"}, "not a message id"),
        ({"id": b"m1", "attempt": b"1", "x": b""}, "unexpected fields"),
    ],
)
def test_an_instance_stream_entry_is_an_assignment_or_says_why_not(
    fields: dict[str, bytes], expected: Assignment | str
) -> None:
    parsed = parse_assignment("1-0", fields)
    if isinstance(expected, Assignment):
        assert parsed == expected
    else:
        assert isinstance(parsed, str) and expected in parsed


@given(st.dictionaries(st.text(max_size=8), st.binary(max_size=24), max_size=4))
def test_any_instance_stream_entry_parses_without_raising(fields: dict[str, bytes]) -> None:
    parsed = parse_assignment("1-0", fields)
    assert isinstance(parsed, Assignment | str)
