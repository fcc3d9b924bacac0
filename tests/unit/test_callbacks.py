"""The callback endpoint's pure parts: tokens and what a callback body may be."""

from __future__ import annotations

import pytest

from adapters.callbacks import CallbackTokens, parse_callback
from adapters.outcome import Failed, Succeeded


def test_a_token_names_its_message_and_attempt() -> None:
    tokens = CallbackTokens(b"k" * 32)
    token = tokens.token("m1", 2)

    assert tokens.attempt_of(token, "m1", 3) == 2
    assert tokens.attempt_of(token, "m1", 1) is None  # attempt 2 was never made
    assert tokens.attempt_of(token, "m2", 3) is None
    assert CallbackTokens(b"x" * 32).attempt_of(token, "m1", 3) is None
    assert tokens.attempt_of("0" * 64, "m1", 3) is None


def test_result_and_error_bodies() -> None:
    assert parse_callback(b'{"result": {"a": [1, 2]}}') == Succeeded(b'{"a":[1,2]}')
    assert parse_callback(b'{"result": null}') == Succeeded(b"null")
    assert parse_callback(b'{"error": "no stock"}') == Failed("no stock")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "not JSON"),
        (b"[1]", "exactly one of"),
        (b"{}", "exactly one of"),
        (b'{"result": 1, "error": "x"}', "exactly one of"),
        (b'{"error": ""}', "non-empty string"),
        (b'{"error": 3}', "non-empty string"),
    ],
)
def test_bad_bodies_say_why(body: bytes, says: str) -> None:
    problem = parse_callback(body)

    assert isinstance(problem, str) and says in problem
