"""``replica_acks`` (broker/durability.py): which round trips WAIT, and what a shortfall says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.durability import READS, shortfall, wait_command, writes
from broker.errors import RedisReplyError, RedisUnavailable


def test_a_round_trip_of_reads_needs_no_wait_and_one_write_or_script_does() -> None:
    reads = [("HGETALL", "k"), (b"xrange", "s", "-", "+"), ("ZSCORE", "z", "m")]
    assert not writes(reads)
    assert writes([*reads, ("XADD", "s", "*", "f", "v")])
    assert writes([("EVALSHA", "abc", 1, "k")])  # a script may write


def test_wait_asks_for_the_replicas_within_the_timeout_in_milliseconds() -> None:
    assert wait_command(1, 1.0) == ("WAIT", 1, 1000)
    assert wait_command(2, 0.0001) == ("WAIT", 2, 1)  # never 0: WAIT 0 blocks for ever


@given(st.integers(min_value=1, max_value=16), st.integers(min_value=0, max_value=16))
def test_enough_acknowledgements_are_durable_and_fewer_are_unavailable(
    wanted: int, acked: int
) -> None:
    problem = shortfall(acked, wanted, 1.0)
    if acked >= wanted:
        assert problem is None
    else:
        assert isinstance(problem, RedisUnavailable)
        assert f"replica_acks = {wanted}, but {acked} replica(s)" in str(problem)


def test_a_refused_wait_is_unavailable_with_the_refusal() -> None:
    problem = shortfall(RedisReplyError("NOPERM no permission to run WAIT"), 1, 1.0)
    assert problem is not None and "WAIT refused (NOPERM" in str(problem)


def test_reads_are_names_of_commands_that_write_nothing() -> None:
    assert not READS & {"XADD", "HSET", "EVALSHA", "XREADGROUP", "XACK", "DEL", "WAIT"}
