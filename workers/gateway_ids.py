"""The ids of the messages the A2A gateway submits, which it alone can mint: ``GetTask`` and
``CancelTask`` answer for those only.

A gateway caller holds the gateway's key, not a Redis user: without this, any caller could
read the result of, or cancel, any message a producer had sent straight to the ingress, by
its id. The id carries its own proof, ``a2a-<random>-<MAC>`` (HMAC-SHA256 under a secret
kept in Redis, made once by the first gateway and shared by every gateway of the prefix), so
nothing is written per message and a restart keeps the tasks it had.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from broker.connection import Connection

PREFIX = "a2a-"
_NONCE_HEX = 16
_MAC_HEX = 24


def secret_key(conn: Connection) -> str:
    return f"{conn.keys.prefix}:a2a:secret"


async def gateway_secret(conn: Connection) -> bytes:
    """The gateways' shared secret: made by the first to ask (``SET NX``), read by all."""
    key, made = secret_key(conn), secrets.token_hex(32)
    await conn.call("SET", key, made, "NX")
    secret: bytes | None = await conn.call("GET", key)
    if secret is None:  # deleted in between (by hand): this one's is the secret now
        await conn.call("SET", key, made)
        return made.encode()
    return secret


def _mac(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, nonce.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX]


def mint_task_id(secret: bytes) -> str:
    nonce = secrets.token_hex(_NONCE_HEX // 2)
    return f"{PREFIX}{nonce}-{_mac(secret, nonce)}"


def minted_here(secret: bytes, task_id: str) -> bool:
    """Whether ``task_id`` is one a gateway holding ``secret`` minted."""
    head, _, mac = task_id.removeprefix(PREFIX).partition("-")
    if not task_id.startswith(PREFIX) or len(head) != _NONCE_HEX or len(mac) != _MAC_HEX:
        return False
    if not task_id.isascii():  # compare_digest takes no other text
        return False
    return hmac.compare_digest(mac, _mac(secret, head))
