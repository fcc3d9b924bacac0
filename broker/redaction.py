"""What ``agent-reach config`` keeps out of sight unless asked: the webhook secret and the
password of any URL (the Redis URL, the embedding service, a subscription's endpoint), with
the values of its query parameters named as secrets (``?api_key=``, ``?token=``).

Effective configuration gets pasted into tickets and chat; like Celery's sanitised broker
URLs, the secrets in it are hidden by default and shown on request (``--show-secrets``).
A hidden value is marked, never replaced by something that would load back as a different
secret: the TOML printer writes a line holding one as a comment.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

HIDDEN = "<hidden>"
# a query (or fragment) parameter whose name holds one of these words carries a secret:
# ?api_key=, ?access_token=, ?accessToken=, ?X-Amz-Signature=, ?sig=, #access_token=;
# the long ones anywhere in it (?ACCESSTOKEN=, ?sessionid=), the short ones as words only
# (?monkey= and ?author= carry none)
SECRET_PARAMETER_PARTS = frozenset(
    {"token", "secret", "password", "passwd", "apikey", "signature", "credential"}
    | {"session", "jwt", "hmac", "bearer", "cookie"}
)
SECRET_PARAMETER_WORDS = frozenset({"key", "sig", "pass", "pwd", "auth", "pin", "otp"})
_CASE_BREAK = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_BREAK = re.compile(r"[_\-.+\s]+")
_DROPPED = str.maketrans("", "", "\t\r\n")  # urlsplit drops these wherever they are
# settings whose whole value is a secret, and those holding a URL, which may name a password
SECRET_KEYS = frozenset({"webhook_secret"})
URL_KEYS = frozenset({"redis_url", "embedding_url"})

Span = tuple[int, int]


def url_without_password(value: str) -> str:
    """``value`` with the password of its userinfo replaced by :data:`HIDDEN`, and the
    value of each query or fragment parameter named as a secret (:func:`secret_name`);
    unchanged when it names neither (but for tabs and line breaks, dropped as a URL parser
    drops them). For display only: it never makes a URL to use.

    Read on the raw text, not through ``urlsplit``: a password holding an unencoded ``/``,
    ``?`` or ``#`` ends the authority there for a parser, which then finds no password at
    all. Everything between the first ``//`` (the whole text's start, where it has none: a
    URL mistyped, ``https:user:pw@h``) and the last ``@`` counts as userinfo when it holds a
    ``:``; the parameters are read from the first ``?`` or ``#`` after that ``//``. Where
    the two readings overlap (an ``@`` in a parameter's value, a ``?`` in a password), what
    either would hide is hidden: better too much than a secret shown."""
    value = value.translate(_DROPPED)
    slashes = value.find("//")
    authority_at = 0 if slashes < 0 else slashes + 2
    spans = _password_span(value, authority_at) + _parameter_spans(value, authority_at)
    shown, at = [], 0
    for start, end in _merged(spans):
        shown += [value[at:start], HIDDEN]
        at = end
    return "".join([*shown, value[at:]])


def _password_span(value: str, authority_at: int) -> list[Span]:
    ends = value.rfind("@")
    colon = value.find(":", authority_at, max(ends, authority_at))
    return [(colon + 1, ends)] if colon >= 0 else []


def _parameter_spans(value: str, authority_at: int) -> list[Span]:
    """The values of secret-named parameters: after the first ``?`` or ``#``, parameters
    are split on ``&`` and ``#``; one named as a secret (or holding a ``;``-separated one)
    is hidden to the next of them, as a server reading ``a=1?2;3`` whole would take it."""
    starts = [i for i in (value.find("?", authority_at), value.find("#", authority_at)) if i >= 0]
    if not starts:
        return []
    spans: list[Span] = []
    at = min(starts) + 1
    for chunk in re.split(r"[&#]", value[at:]):
        offset = 0
        for part in chunk.split(";"):
            name, equals, _ = part.partition("=")
            if equals and secret_name(name):
                spans.append((at + offset + len(name) + 1, at + len(chunk)))
                break
            offset += len(part) + 1
        at += len(chunk) + 1
    return spans


def _merged(spans: list[Span]) -> list[Span]:
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def secret_name(name: str) -> bool:
    """Whether a URL parameter called ``name`` (percent-encoded or not) carries a secret:
    it holds one of :data:`SECRET_PARAMETER_PARTS`, or one of its words (split on
    ``_ - . +``, spaces and case: ``accessToken``) is one of :data:`SECRET_PARAMETER_WORDS`."""
    text = unquote(name)
    folded = text.lower()
    if any(part in folded for part in SECRET_PARAMETER_PARTS):
        return True
    words = _WORD_BREAK.split(_CASE_BREAK.sub(" ", text).lower())
    return not SECRET_PARAMETER_WORDS.isdisjoint(words)


def split_problem(exc: ValueError) -> str:
    """What ``urlsplit`` found wrong with a URL, in words of our own: its message quotes the
    text it took for a port, which a password holding an unencoded ``/`` puts there."""
    said = str(exc)
    if said.startswith("Port out of range"):
        return "the port is out of range 0-65535"
    if said.startswith("Port could not be cast"):
        return (
            "what stands for the port is not a number (a password holding / ? # or @ must be"
            " percent-encoded: %2F %3F %23 %40)"
        )
    if "IPv6" in said:
        return "a malformed IPv6 host (write it in brackets: [::1])"
    return "it does not parse as a URL"


def hide_secrets(values: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``values`` (settings as builtins) with every secret hidden, and the keys whose value
    changed: the webhook secret, the password of a URL setting and of each event
    subscription's URL. Named keys only: a user's name that happens to be a key's (a tenant
    called ``webhook_secret``) is not one."""
    shown = dict(values)
    for key in SECRET_KEYS:
        if shown.get(key) is not None:
            shown[key] = HIDDEN
    for key in URL_KEYS:
        if isinstance(shown.get(key), str):
            shown[key] = url_without_password(shown[key])
    subscriptions = shown.get("event_subscriptions")
    if isinstance(subscriptions, list):
        shown["event_subscriptions"] = [
            {**s, "url": url_without_password(s["url"])}
            if isinstance(s, dict) and isinstance(s.get("url"), str)
            else s
            for s in subscriptions
        ]
    hidden = {k for k in values if shown[k] != values[k]}
    return shown, hidden | {k for k in SECRET_KEYS if values.get(k) is not None}
