"""What may travel in an agent's HTTP headers: the rules of broker/headers.py, no I/O."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.envelope import Envelope, envelope_problem
from broker.headers import (
    MAX_HEADERS,
    agent_headers,
    header_problem,
    headers_problem,
    idempotency_key_problem,
    is_reserved,
    traceparent_problem,
    tracestate_problem,
)


@pytest.mark.parametrize(
    "name",
    [
        "Host",
        "host",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        "Keep-Alive",
        "Upgrade",
        "TE",
        "Trailer",
        "Proxy-Authorization",
        "Content-Type",
        "traceparent",
        "X-Reach-Message-Id",
        "x-reach-callback-url",
        "X-REACH-ATTEMPT",
        "x-reach-anything-new",
    ],
)
def test_a_producer_may_not_set_framing_hop_by_hop_or_our_headers(name: str) -> None:
    problem = header_problem(name, "v")
    assert problem is not None and repr(name) in problem and "may not be set" in problem


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("X Bad", "v", "not an HTTP token"),
        ("", "v", "not an HTTP token"),
        ("Näme", "v", "not an HTTP token"),
        ("X:Colon", "v", "not an HTTP token"),
        ("X-Split", "a\r\nInjected: 1", "control character"),
        ("X-Lf", "a\nb", "control character"),
        ("X-Nul", "a\x00b", "control character"),
        ("X-Unicode", "café", "non-ASCII"),
        ("X-Long", "v" * 4097, "over 4096"),
        ("X" * 129, "v", "not an HTTP token"),
    ],
)
def test_a_header_that_http_cannot_carry_is_refused_with_why(
    name: str, value: str, expected: str
) -> None:
    problem = header_problem(name, value)
    assert problem is not None and expected in problem


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-Tenant": "a"}, {"Authorization": "Bearer t0k.en", "tracestate": "a=b,c=d"}],
)
def test_ordinary_headers_pass(headers: dict[str, str]) -> None:
    assert headers_problem(headers) is None


def test_names_are_case_insensitive_so_a_repeat_in_other_case_is_refused() -> None:
    problem = headers_problem({"X-A": "1", "x-a": "2"})
    assert problem is not None and "twice" in problem


def test_too_many_headers_are_refused() -> None:
    problem = headers_problem({f"X-{i}": "v" for i in range(MAX_HEADERS + 1)})
    assert problem is not None and str(MAX_HEADERS) in problem


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future",
    ],
)
def test_w3c_traceparents_pass(value: str) -> None:
    assert traceparent_problem(value) is None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "hello",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero parent id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # 00 has no more
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX: y",
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-é",
    ],
)
def test_anything_else_is_not_a_traceparent(value: str) -> None:
    problem = traceparent_problem(value)
    assert problem is not None and "traceparent" in problem


@pytest.mark.parametrize("key", ["k", "order-42", "a b", "~!@#$%^&*()", "x" * 256])
def test_idempotency_keys_of_printable_ascii_pass(key: str) -> None:
    assert idempotency_key_problem(key) is None


@pytest.mark.parametrize("key", ["", " lead", "trail ", "tab\tinside", "é", "x" * 257, "a\nb"])
def test_other_idempotency_keys_are_refused(key: str) -> None:
    assert idempotency_key_problem(key) is not None


def test_our_headers_come_last_and_appear_once_whatever_the_producer_sent() -> None:
    ours = {"X-Reach-Message-Id": "m1", "Content-Type": "application/json"}
    producer = {"x-reach-message-id": "spoofed", "CONTENT-TYPE": "text/plain", "X-Tenant": "a"}
    merged = httpx.Headers(agent_headers(producer, ours))
    assert merged.get_list("x-reach-message-id") == ["m1"]
    assert merged.get_list("content-type") == ["application/json"]
    assert merged["x-tenant"] == "a"
    assert list(agent_headers(producer, ours))[-2:] == list(ours)


@given(st.text(max_size=30), st.text(max_size=60))
def test_whatever_passes_the_check_can_be_sent_by_an_http_client(name: str, value: str) -> None:
    if header_problem(name, value) is None:
        request = httpx.Request("POST", "http://127.0.0.1/", headers={name: value})
        assert request.headers[name] == value
        assert not is_reserved(name)


@pytest.mark.parametrize("value", ["congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"])
def test_w3c_tracestates_pass(value: str) -> None:
    assert tracestate_problem(value) is None
    assert check_envelope_problem(value) is None


@pytest.mark.parametrize("value", ["a=" + "x" * 600, "a=b\r\nHost: evil", "a=\tb", "é=1"])
def test_a_tracestate_an_http_header_cannot_carry_is_refused(value: str) -> None:
    assert tracestate_problem(value) is not None
    problem = check_envelope_problem(value)
    assert problem is not None and "tracestate" in problem


def check_envelope_problem(tracestate: str) -> str | None:
    return envelope_problem(Envelope(capability="a.b", payload=b"1", tracestate=tracestate))
