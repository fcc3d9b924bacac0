"""Session affinity: which instance a session is bound to, for ``session_ttl_s``."""

from __future__ import annotations

from typing import Any

from .connection import Connection


def bind_session_commands(
    conn: Connection, bindings: list[tuple[str, str]]
) -> list[tuple[Any, ...]]:
    """``(session_id, instance_id)`` pairs, each with the session TTL."""
    ttl_ms = int(conn.settings.session_ttl_s * 1000)
    return [("SET", conn.keys.session(s), i, "PX", ttl_ms) for s, i in bindings]


async def bound_instances(conn: Connection, session_ids: list[str]) -> dict[str, str]:
    """The instance each session is bound to, for the sessions that have one."""
    replies = await conn.call_many([("GET", conn.keys.session(s)) for s in session_ids])
    return {s: r.decode() for s, r in zip(session_ids, replies, strict=True) if r}
