"""The tokens of a sidecar's unanswered round trips (adapters/holdings.py)."""

from __future__ import annotations

from adapters.holdings import MAX_UNANSWERED, Holdings, Taken

TAKEN = Taken("1-0", "m", 1)


def test_only_a_token_of_an_unanswered_call_says_never_called() -> None:
    holdings = Holdings()
    answered, unanswered = holdings.call_token(), holdings.call_token()
    assert answered != unanswered
    holdings.unanswered_call(unanswered)
    assert holdings.never_called(unanswered, TAKEN)
    assert not holdings.never_called(answered, TAKEN)
    assert not holdings.never_called("", TAKEN)  # a record no sidecar of this version wrote


def test_the_oldest_unanswered_tokens_are_forgotten_past_the_cap() -> None:
    holdings = Holdings()
    tokens = [holdings.call_token() for _ in range(MAX_UNANSWERED + 2)]
    for token in tokens:
        holdings.unanswered_call(token)
    assert len(holdings.unanswered) == MAX_UNANSWERED
    assert not any(holdings.never_called(t, TAKEN) for t in tokens[:2])
    assert all(holdings.never_called(t, TAKEN) for t in tokens[2:])


def test_a_message_called_again_is_never_uncalled_again_whatever_its_token() -> None:
    """Found PROCESSING and called: an older record given back by a Redis that lost writes
    it had acknowledged still shows a token of an unanswered call; the message is not
    called a third time on it. Another message of the same unanswered take still is."""
    holdings = Holdings()
    token = holdings.call_token()
    holdings.unanswered_call(token)
    other = Taken("2-0", "n", 1)
    holdings.calling_again(TAKEN)
    assert not holdings.never_called(token, TAKEN)
    assert holdings.never_called(token, other)
    assert holdings.never_called(token, Taken("1-0", "m", 2))  # a later attempt is its own


def test_the_pending_list_is_read_again_after_an_error() -> None:
    holdings = Holdings()
    assert not holdings.look_again(lateness_s=10, every_s=0)  # nothing went wrong
    holdings.recheck_pending = True
    assert holdings.look_again(lateness_s=10, every_s=0)
    assert not holdings.look_again(lateness_s=10, every_s=0)  # once per error


def test_the_pending_list_is_read_again_while_a_lost_answers_writes_may_land() -> None:
    holdings = Holdings()
    holdings.unanswered_call(holdings.call_token())
    assert holdings.look_again(lateness_s=10, every_s=0)  # while the reaper waits: again
    assert holdings.look_again(lateness_s=10, every_s=0)
    assert not holdings.look_again(lateness_s=0, every_s=0)  # past it: only after errors


def test_a_lost_answers_looks_are_spaced_and_an_error_is_looked_at_at_once() -> None:
    holdings = Holdings()
    holdings.unanswered_call(holdings.call_token())
    assert holdings.look_again(lateness_s=10, every_s=3600)
    assert not holdings.look_again(lateness_s=10, every_s=3600)  # the next: an hour on
    holdings.recheck_pending = True
    assert holdings.look_again(lateness_s=10, every_s=3600)


def test_a_failed_read_is_looked_for_at_once_and_for_a_while() -> None:
    holdings = Holdings()
    holdings.read_failed()  # a plain read writes no token, and may land late all the same
    assert holdings.look_again(lateness_s=10, every_s=0)
    assert holdings.look_again(lateness_s=10, every_s=0)
    assert not holdings.look_again(lateness_s=0, every_s=0)
