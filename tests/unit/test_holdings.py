"""The tokens of a sidecar's unanswered round trips (adapters/holdings.py)."""

from __future__ import annotations

from adapters.holdings import MAX_UNANSWERED, Holdings


def test_only_a_token_of_an_unanswered_call_says_never_called() -> None:
    holdings = Holdings()
    answered, unanswered = holdings.call_token(), holdings.call_token()
    assert answered != unanswered
    holdings.unanswered_call(unanswered)
    assert holdings.never_called(unanswered)
    assert not holdings.never_called(answered)
    assert not holdings.never_called("")  # a record no sidecar of this version wrote


def test_the_oldest_unanswered_tokens_are_forgotten_past_the_cap() -> None:
    holdings = Holdings()
    tokens = [holdings.call_token() for _ in range(MAX_UNANSWERED + 2)]
    for token in tokens:
        holdings.unanswered_call(token)
    assert len(holdings.unanswered) == MAX_UNANSWERED
    assert not holdings.never_called(tokens[0]) and not holdings.never_called(tokens[1])
    assert all(holdings.never_called(t) for t in tokens[2:])
