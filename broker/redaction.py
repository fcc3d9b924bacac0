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
# a query parameter whose name holds one of these words (split on _ - . and case) carries
# a secret: ?api_key=, ?access_token=, ?X-Amz-Signature=, ?sig=, ?password=
SECRET_PARAMETER_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "pass", "auth"}
    | {"sig", "signature", "credential", "credentials", "session"}
)
_WORD_BREAK = re.compile(r"[_\-.\s]+")
# settings whose whole value is a secret, and those holding a URL, which may name a password
SECRET_KEYS = frozenset({"webhook_secret"})
URL_KEYS = frozenset({"redis_url", "embedding_url"})


def url_without_password(value: str) -> str:
    """``value`` with the password of its userinfo replaced by :data:`HIDDEN`; unchanged when
    it names none. Read on the raw text, not through ``urlsplit``: a password holding an
    unencoded ``/``, ``?`` or ``#`` ends the authority there for a parser, which then finds
    no password at all. Everything between ``://`` and the last ``@`` counts as userinfo when
    it holds a ``:``, so a URL whose path or query has an ``@`` after a port is hidden too:
    better too much than a password shown. The values of query parameters named as secrets
    (:data:`SECRET_PARAMETER_WORDS`) after it are hidden too."""
    begins = value.find("://")
    if begins < 0:
        return value
    authority_at = begins + 3
    ends = value.rfind("@")
    if ends >= authority_at:
        user, colon, _ = value[authority_at:ends].partition(":")
        if colon:  # the query, if any, comes after the password
            value = f"{value[:authority_at]}{user}:{HIDDEN}{value[ends:]}"
            authority_at += len(user) + 1 + len(HIDDEN)
    return _query_without_secrets(value, authority_at)


def _query_without_secrets(value: str, authority_at: int) -> str:
    """``value`` with the value of each secret-named query parameter (after
    ``authority_at``, before any ``#``) replaced by :data:`HIDDEN`."""
    asks = value.find("?", authority_at)
    if asks < 0:
        return value
    fragment = value.find("#", asks)
    ends = len(value) if fragment < 0 else fragment
    pairs = value[asks + 1 : ends].split("&")
    for i, pair in enumerate(pairs):
        name, equals, _ = pair.partition("=")
        words = set(_WORD_BREAK.split(unquote(name).lower()))
        if equals and words & SECRET_PARAMETER_WORDS:
            pairs[i] = f"{name}={HIDDEN}"
    return f"{value[: asks + 1]}{'&'.join(pairs)}{value[ends:]}"


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
