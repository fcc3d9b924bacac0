"""What ``agent-reach config`` keeps out of sight unless asked: the webhook secret and the
password of any URL (the Redis URL, the embedding service, a subscription's endpoint).

Effective configuration gets pasted into tickets and chat; like Celery's sanitised broker
URLs, the secrets in it are hidden by default and shown on request (``--show-secrets``).
A hidden value is marked, never replaced by something that would load back as a different
secret: the TOML printer writes a line holding one as a comment.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

HIDDEN = "<hidden>"
# settings whose whole value is a secret
SECRET_KEYS = frozenset({"webhook_secret"})


def url_without_password(value: str) -> str:
    """``value`` with the password of its userinfo replaced by :data:`HIDDEN`; unchanged when
    it names none (or is no URL)."""
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:  # a malformed address: settings validation names it elsewhere
        return value
    if not password:
        return value
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return parts._replace(netloc=f"{user}:{HIDDEN}@{host}").geturl()


def hide_secrets(value: Any, key: str | None = None) -> Any:
    """``value`` (settings as builtins) with every secret hidden, at any depth."""
    if key in SECRET_KEYS and value is not None:
        return HIDDEN
    if isinstance(value, dict):
        return {k: hide_secrets(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [hide_secrets(v) for v in value]
    if isinstance(value, str):
        return url_without_password(value)
    return value
