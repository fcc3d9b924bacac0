"""The offset to Redis's clock (broker/timekeeping.py): when a measurement moves it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.timekeeping import TOLERANCE_MS, aligned_offset, server_time_ms

NOW = 1_800_000_000_000


def test_a_host_off_by_seconds_takes_the_measured_offset() -> None:
    # Redis answered 30 s ahead of this host's clock, halfway through a 4 ms round trip
    assert aligned_offset(NOW + 30_000 + 2, NOW, NOW + 4, 0) == 30_000
    assert aligned_offset(NOW - 30_000 + 2, NOW, NOW + 4, 0) == -30_000


def test_an_offset_within_tolerance_is_none_and_a_small_change_keeps_the_offset() -> None:
    assert aligned_offset(NOW + TOLERANCE_MS, NOW, NOW, 0) == 0  # one host, NTP: own clock
    assert aligned_offset(NOW + 30_050, NOW, NOW, 30_000) == 30_000  # jitter: kept
    assert aligned_offset(NOW + 40, NOW, NOW, 30_000) == 0  # the host's clock was set right


def test_a_loose_measurement_changes_nothing() -> None:
    # a round trip longer than the tolerance (or backwards: the host's clock stepped) says
    # too little about when Redis answered
    assert aligned_offset(NOW + 30_000, NOW, NOW + TOLERANCE_MS + 1, 0) == 0
    assert aligned_offset(NOW + 30_000, NOW, NOW - 1, 5_000) == 5_000


@given(
    server=st.integers(0, 2**50),
    sent=st.integers(0, 2**50),
    trip=st.integers(-10, 10 * TOLERANCE_MS),
    current=st.integers(-(2**40), 2**40),
)
def test_the_offset_kept_is_the_current_one_none_or_the_measured_one(
    server: int, sent: int, trip: int, current: int
) -> None:
    measured = server - (sent + sent + trip) // 2
    kept = aligned_offset(server, sent, sent + trip, current)
    assert kept in (current, 0, measured)
    if not 0 <= trip <= TOLERANCE_MS:
        assert kept == current
    elif kept != current:
        assert abs(measured - current) > TOLERANCE_MS
        assert kept == (0 if abs(measured) <= TOLERANCE_MS else measured)
    # whatever it keeps, a second identical measurement keeps it too
    assert aligned_offset(server, sent, sent + trip, kept) == kept


def test_redis_time_reads_as_milliseconds_and_anything_else_as_none() -> None:
    assert server_time_ms([b"1800000000", b"123456"]) == 1_800_000_000_123
    assert server_time_ms([b"1800000000", b"1000000"]) is None
    assert server_time_ms([b"-1", b"0"]) is None
    assert server_time_ms([b"x", b"0"]) is None
    assert server_time_ms([b"1"]) is None
    assert server_time_ms(b"1800000000") is None
    assert server_time_ms(None) is None


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.binary(),
        st.lists(st.one_of(st.binary(), st.integers(), st.none())),
    )
)
def test_no_answer_breaks_the_reading(reply: object) -> None:
    read = server_time_ms(reply)
    assert read is None or read >= 0
