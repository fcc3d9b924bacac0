"""What ``agent-reach config`` keeps out of sight unless asked: the webhook secret and the
password of any URL (the Redis URL, the embedding service, a subscription's endpoint).

Effective configuration gets pasted into tickets and chat; like Celery's sanitised broker
URLs, the secrets in it are hidden by default and shown on request (``--show-secrets``).
A hidden value is marked, never replaced by something that would load back as a different
secret: the TOML printer writes a line holding one as a comment.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

HIDDEN = "<hidden>"
# settings whose whole value is a secret, and those holding a URL, which may name a password
SECRET_KEYS = frozenset({"webhook_secret"})
URL_KEYS = frozenset({"redis_url", "embedding_url"})
# userinfo's password in what does not split as a URL: ``//user:password@``
_USERINFO = re.compile(r"(//[^/@:]*:)[^/@]*@")


def url_without_password(value: str) -> str:
    """``value`` with the password of its userinfo replaced by :data:`HIDDEN`; unchanged when
    it names none."""
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:  # a malformed address: hidden all the same
        return _USERINFO.sub(rf"\1{HIDDEN}@", value)
    if not password:
        return value
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return parts._replace(netloc=f"{user}:{HIDDEN}@{host}").geturl()


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
