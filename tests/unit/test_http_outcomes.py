"""How the ``http`` adapter reads an agent's answer: no I/O."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.http import (
    DEFAULT_RETRY_AFTER_S,
    MAX_RETRY_AFTER_S,
    agent_limits,
    retry_after_s,
)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, DEFAULT_RETRY_AFTER_S),
        ("", DEFAULT_RETRY_AFTER_S),
        ("2", 2.0),
        ("-5", 0.0),
        ("inf", MAX_RETRY_AFTER_S),
        ("1e400", MAX_RETRY_AFTER_S),
        ("nan", DEFAULT_RETRY_AFTER_S),
        ("-inf", 0.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # in the past
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER_S),
        ("not a date", DEFAULT_RETRY_AFTER_S),
    ],
)
def test_retry_after_is_a_finite_bounded_wait(value: str | None, seconds: float) -> None:
    assert retry_after_s(value) == seconds


@given(st.text(max_size=40))
def test_any_retry_after_text_is_a_wait_a_process_can_take(value: str) -> None:
    seconds = retry_after_s(value)
    assert math.isfinite(seconds) and 0.0 <= seconds <= MAX_RETRY_AFTER_S
    assert int(seconds * 1000) >= 0  # what the notifier and the vitals do with it


def test_an_agent_pool_gives_up_idle_connections_before_common_servers_close_them() -> None:
    """A request on a connection the server is closing fails unanswered: for an agent that
    is not idempotent, a call nobody can say ran. gunicorn closes idle connections after
    2 s, uvicorn and Node after 5 s; httpx's default (5 s) raced uvicorn's."""
    limits = agent_limits(16)
    assert limits.keepalive_expiry is not None and limits.keepalive_expiry < 2.0
    assert limits.max_connections == limits.max_keepalive_connections == 16
