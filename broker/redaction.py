"""What ``agent-reach config`` keeps out of sight unless asked: the webhook secret and the
password of any URL (the Redis URL, the embedding service, a subscription's endpoint).

Effective configuration gets pasted into tickets and chat; like Celery's sanitised broker
URLs, the secrets in it are hidden by default and shown on request (``--show-secrets``).
A hidden value is marked, never replaced by something that would load back as a different
secret: the TOML printer writes a line holding one as a comment.
"""

from __future__ import annotations

from typing import Any

HIDDEN = "<hidden>"
# settings whose whole value is a secret, and those holding a URL, which may name a password
SECRET_KEYS = frozenset({"webhook_secret"})
URL_KEYS = frozenset({"redis_url", "embedding_url"})


def url_without_password(value: str) -> str:
    """``value`` with the password of its userinfo replaced by :data:`HIDDEN`; unchanged when
    it names none. Read on the raw text, not through ``urlsplit``: a password holding an
    unencoded ``/``, ``?`` or ``#`` ends the authority there for a parser, which then finds
    no password at all. Everything between ``://`` and the last ``@`` counts as userinfo when
    it holds a ``:``, so a URL whose path or query has an ``@`` after a port is hidden too:
    better too much than a password shown."""
    begins = value.find("://")
    ends = value.rfind("@")
    if begins < 0 or ends < begins + 3:
        return value
    userinfo = value[begins + 3 : ends]
    user, colon, _ = userinfo.partition(":")
    if not colon:
        return value
    return f"{value[: begins + 3]}{user}:{HIDDEN}{value[ends:]}"


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
