"""A move's answer read back (``broker.record_codec.moved``): what a record holds that no
version wrote reads as no record, never as an exception in whoever asked."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.record_codec import moved
from broker.stages import Stage

KNOWN = {s.value.encode() for s in Stage}


def test_a_made_move_reads_back_whole() -> None:
    answer = moved([1, b"PROCESSING", b"2", b"a-1", b"{}", b"1700000000000"])
    assert (answer.ok, answer.stage, answer.attempt, answer.instance) == (
        True,
        Stage.PROCESSING,
        2,
        "a-1",
    )
    assert (answer.value, answer.accepted_ms) == (b"{}", 1700000000000)


@pytest.mark.parametrize(
    "reply",
    [
        [0, b"NOT-A-STAGE", b"1", b"a-1"],
        [0, b"ROUTED", b"x", b"a-1"],
        [0, b"ROUTED", b"\xd9\xa1", b"a-1"],  # a digit that is not ASCII
        [0, b"ROUTED", b"9" * 40, b"a-1"],
        [-1],
    ],
)
def test_a_record_that_does_not_read_reads_as_none(reply: list[Any]) -> None:
    answer = moved(reply)
    assert not answer.ok and answer.missing


def test_junk_beside_a_readable_stage_reads_as_nothing_worse() -> None:
    answer = moved([1, b"RECEIVED", b"1", b"\xff\xfe", False, b"abc"])
    assert answer.ok and answer.instance == "\ufffd\ufffd" and answer.accepted_ms == 0


@given(
    st.sampled_from([0, 1]),
    st.one_of(st.sampled_from(sorted(KNOWN)), st.binary(max_size=12)),
    st.one_of(st.from_regex(rb"\A[0-9]{1,6}\Z"), st.binary(max_size=12)),
    st.binary(max_size=12),
    st.one_of(st.just(False), st.binary(max_size=8)),
    st.binary(max_size=20),
)
def test_any_answer_reads_without_raising(
    ok: int, stage: bytes, attempt: bytes, instance: bytes, value: Any, accepted: bytes
) -> None:
    answer = moved([ok, stage, attempt, instance, value, accepted])
    readable = stage in KNOWN and attempt.isascii() and attempt.isdigit() and len(attempt) < 19
    assert answer.missing is not readable
    if readable:
        assert answer.stage is not None and answer.stage.value.encode() == stage
        assert answer.attempt == int(attempt) and answer.ok is (ok == 1)
