"""Webhook rules, pure: which callback URLs are allowed, and the signature receivers check."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from broker.webhooks import callback_problem, signature, signature_valid


def test_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    body = b'{"id":"m1","stage":"SUCCEEDED","result":1}'
    expected = hmac.new(b"s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()

    assert signature("s3cret", "1700000000", body) == f"sha256={expected}"
    assert signature_valid("s3cret", "1700000000", body, f"sha256={expected}")


@pytest.mark.parametrize(
    ("secret", "timestamp", "body"),
    [
        ("other", "1700000000", b"{}"),
        ("s3cret", "1700000001", b"{}"),
        ("s3cret", "1700000000", b"[]"),
    ],
)
def test_any_change_breaks_the_signature(secret: str, timestamp: str, body: bytes) -> None:
    good = signature("s3cret", "1700000000", b"{}")

    assert not signature_valid(secret, timestamp, body, good)


def test_an_allowed_host_with_a_secret_is_fine() -> None:
    assert callback_problem("http://127.0.0.1:8080/hook", ["127.0.0.1"], "s") is None
    assert callback_problem("https://Hooks.Example.com/x", ["hooks.example.com"], "s") is None


def test_a_host_with_a_port_allows_that_port_only() -> None:
    hosts = ["127.0.0.1:8080", "hooks.example.com:443"]

    assert callback_problem("http://127.0.0.1:8080/hook", hosts, "s") is None
    assert callback_problem("https://hooks.example.com/x", hosts, "s") is None
    assert callback_problem("http://127.0.0.1:6379/", hosts, "s") is not None
    assert callback_problem("http://hooks.example.com/x", hosts, "s") is not None  # port 80


@pytest.mark.parametrize(
    ("url", "hosts", "secret", "says"),
    [
        ("http://evil.example/x", ["127.0.0.1"], "s", "host 'evil.example' is not allowed"),
        ("http://127.0.0.1/x", [], "s", "allowed: none configured"),
        ("ftp://127.0.0.1/x", ["127.0.0.1"], "s", "must be an http:// or https:// URL"),
        ("http:///nohost", ["127.0.0.1"], "s", "must be an http:// or https:// URL"),
        ("http://127.0.0.1:99999/x", ["127.0.0.1"], "s", "not a valid URL"),
        ("http://127.0.0.1/x", ["127.0.0.1"], None, "no webhook_secret"),
    ],
)
def test_refusals_say_why(url: str, hosts: list[str], secret: str | None, says: str) -> None:
    problem = callback_problem(url, hosts, secret)

    assert problem is not None and says in problem
