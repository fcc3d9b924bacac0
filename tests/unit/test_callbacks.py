"""The callback endpoint's pure parts: tokens and what a callback body may be."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.callbacks import (
    TOKEN_HEADER,
    Answer,
    CallbackTokens,
    callback_app,
    parse_callback,
)
from adapters.outcome import Failed, Succeeded
from adapters.write_ahead import not_awaiting
from broker.stages import Stage


def test_a_token_names_its_message_and_attempt() -> None:
    tokens = CallbackTokens(b"k" * 32)
    token = tokens.token("m1", 2)

    assert token.startswith("2.")
    assert tokens.attempt_of(token, "m1", 3) == 2
    assert tokens.attempt_of(token, "m1", 0) == 2  # no record needed to check it
    assert tokens.attempt_of(token, "m2", 3) is None
    assert CallbackTokens(b"x" * 32).attempt_of(token, "m1", 3) is None
    mac = token.partition(".")[2]
    assert tokens.attempt_of(f"3.{mac}", "m1", 3) is None  # the attempt is signed too
    assert tokens.attempt_of("1." + "0" * 64, "m1", 3) is None


def test_a_bare_hex_token_from_before_the_attempt_was_carried_is_still_taken() -> None:
    tokens = CallbackTokens(b"k" * 32)
    legacy = hmac.new(b"k" * 32, b"m1:2", hashlib.sha256).hexdigest()

    assert tokens.attempt_of(legacy, "m1", 3) == 2
    assert tokens.attempt_of(legacy, "m1", 1) is None  # attempt 2 was never made
    assert tokens.attempt_of(legacy, "m1", 0) is None  # no record: it proves nothing
    assert tokens.attempt_of(legacy, "m2", 3) is None


@pytest.mark.parametrize(
    "token",
    ["", ".", "2.", ".abc", "0." + "0" * 64, "-1.ab", "1e3.ab", "²." + "a" * 64, "9" * 5000 + ".a"],
)
def test_malformed_tokens_are_refused_quietly(token: str) -> None:
    assert CallbackTokens(b"k" * 32).attempt_of(token, "m1", 3) is None


@given(st.text(max_size=200), st.text(max_size=40), st.integers(0, 100))
def test_no_text_but_a_real_token_names_an_attempt(
    token: str, message_id: str, latest: int
) -> None:
    """Whatever arrives in the header, the answer is an attempt for a real token, else None."""
    tokens = CallbackTokens(b"k" * 32)
    attempt = tokens.attempt_of(token, message_id, latest)

    assert attempt is None or token in {
        tokens.token(message_id, attempt),
        tokens.token(message_id, attempt).partition(".")[2],
    }


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
        (b'{"result": ' + b"[" * 100 + b"]" * 100 + b"}", "nested 101 levels deep"),
        (b"[" * 100_000, "at most 64 levels"),
        (b'{"result": "\\udbff"}', "lone UTF-16 surrogate"),
    ],
)
def test_bad_bodies_say_why(body: bytes, says: str) -> None:
    problem = parse_callback(body)

    assert isinstance(problem, str) and says in problem


def test_a_result_nested_within_the_limit_is_taken() -> None:
    nested = b"[" * 60 + b"1" + b"]" * 60
    assert parse_callback(b'{"result": ' + nested + b"}") == Succeeded(nested)


class Feed:
    """An ASGI request body sent in chunks, counting how many the app asked for."""

    def __init__(self, chunk: bytes, chunks: int) -> None:
        self.chunk, self.left, self.taken = chunk, chunks, 0

    async def receive(self) -> dict[str, Any]:
        self.taken += 1
        self.left -= 1
        return {"type": "http.request", "body": self.chunk, "more_body": self.left > 0}


async def post(
    feed: Feed,
    *,
    max_bytes: int,
    headers: list[tuple[bytes, bytes]],
    token_ok: bool = True,
    body_timeout_s: float = 30.0,
) -> tuple[int, list[str]]:
    """Call the endpoint's ASGI app in-process: the status, and what ``receive`` was given."""
    received: list[str] = []
    answers: list[dict[str, Any]] = []

    async def authorize(message_id: str, token: str) -> Answer | None:
        return None if token_ok else Answer(401, {"error": "callback token does not match"})

    async def receive(message_id: str, token: str, outcome: Succeeded | Failed) -> Answer:
        received.append(message_id)
        return Answer(200, {"id": message_id})

    async def send(message: dict[str, Any]) -> None:
        answers.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/callbacks/m1",
        "raw_path": b"/callbacks/m1",
        "root_path": "",
        "query_string": b"",
        "headers": [(TOKEN_HEADER.lower().encode(), b"t"), *headers],
        "scheme": "http",
        "server": ("127.0.0.1", 1),
        "client": ("127.0.0.1", 2),
    }
    app = callback_app(authorize, receive, max_bytes=max_bytes, body_timeout_s=body_timeout_s)
    await app(scope, feed.receive, send)
    return answers[0]["status"], received


async def test_a_chunked_body_is_read_no_further_than_the_limit() -> None:
    """2 MB in 1 KB chunks, a 10 KB limit: 413 after at most 11 chunks, never the rest."""
    feed = Feed(b"x" * 1024, 2048)

    status, received = await post(feed, max_bytes=10_240, headers=[])

    assert status == 413 and received == []
    assert feed.taken <= 11


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    feed = Feed(b"x" * 1024, 2048)
    huge = b"9" * 5000  # a number int() would refuse to parse

    for length in (b"20000", huge):
        status, _ = await post(feed, max_bytes=10_240, headers=[(b"content-length", length)])
        assert status == 413
    assert feed.taken == 0


async def test_a_body_at_the_limit_is_read_whole() -> None:
    body = b'{"result": "' + b"x" * 1000 + b'"}'
    status, received = await post(Feed(body, 1), max_bytes=len(body), headers=[])

    assert status == 200 and received == ["m1"]


async def test_without_a_good_token_not_a_byte_of_the_body_is_read() -> None:
    feed = Feed(b"x" * 1024, 2048)
    status, received = await post(feed, max_bytes=10_240, headers=[], token_ok=False)
    assert status == 401 and received == [] and feed.taken == 0


class Trickle(Feed):
    """A body that never finishes arriving."""

    async def receive(self) -> dict[str, Any]:
        self.taken += 1
        if self.taken > 1:
            await anyio.sleep_forever()
        return {"type": "http.request", "body": b"{", "more_body": True}


async def test_a_body_that_does_not_arrive_in_time_gets_408() -> None:
    with anyio.fail_after(5):
        status, received = await post(
            Trickle(b"", 0), max_bytes=10_240, headers=[], body_timeout_s=0.2
        )
    assert status == 408 and received == []


@given(st.sampled_from(list(Stage)), st.integers(min_value=1, max_value=10**6))
def test_processing_clears_a_callbacks_fields_unless_nothing_can_have_set_them(
    source: Stage, attempt: int
) -> None:
    """A callback's fields are set only in PROCESSING, and every way back to ROUTED starts a
    new attempt: the first attempt from RECEIVED is the one PROCESSING with nothing to clear."""
    cleared = not_awaiting(source, attempt)
    if source is Stage.RECEIVED and attempt == 1:
        assert cleared is None
    else:
        assert cleared == {"awaiting_callback": "", "agent_task": ""}
