"""Webhooks, pure: which ``callback_url`` may be called, and how a delivery is signed.

A delivery is signed the way receivers already know from payment providers: the header
``X-Reach-Signature: sha256=<hex>`` is HMAC-SHA256, under the shared secret, of
``<timestamp>.<body>``, where ``<timestamp>`` is the ``X-Reach-Timestamp`` header (Unix
seconds). A receiver recomputes it, compares in constant time, and refuses old timestamps
(replays).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection
from urllib.parse import urlsplit

SIGNATURE_HEADER = "X-Reach-Signature"
TIMESTAMP_HEADER = "X-Reach-Timestamp"
MESSAGE_ID_HEADER = "X-Reach-Message-Id"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The ``X-Reach-Signature`` value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def signature_valid(secret: str, timestamp: str, body: bytes, header: str) -> bool:
    return hmac.compare_digest(signature(secret, timestamp, body), header)


def callback_problem(url: str, allowed_hosts: Collection[str], secret: str | None) -> str | None:
    """Why results may not be POSTed to ``url``, or ``None`` when they may. An allowed entry
    is a host (any port) or ``host:port`` (that port only)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        return f"callback_url {url!r} is not a valid URL: {exc}"
    if parts.scheme not in ("http", "https") or not host:
        return f"callback_url {url!r} must be an http:// or https:// URL with a host"
    allowed = {h.lower() for h in allowed_hosts}
    if host not in allowed and f"{host}:{port}" not in allowed:
        listed = ", ".join(sorted(allowed_hosts)) or "none configured"
        return (
            f"callback_url host {host!r} is not allowed (allowed: {listed}; set callback_hosts"
            " or AGENT_REACH_CALLBACK_HOSTS)"
        )
    if not secret:
        return "webhooks are off: no webhook_secret (or AGENT_REACH_WEBHOOK_SECRET) is configured"
    return None
