"""Acknowledging consumed stream entries, and trimming what every group has acknowledged."""

from __future__ import annotations

from .connection import Connection
from .errors import RedisReplyError
from .record_codec import pairs, text
from .streams import id_order


async def ack(conn: Connection, stream: str, group: str, entry_ids: list[str]) -> None:
    if entry_ids:
        await conn.call("XACK", stream, group, *entry_ids)


async def trim_acknowledged(conn: Connection, stream: str) -> int:
    """Trim a stream below what every consumer group has acknowledged; never unread work.

    An entry may go when every group has delivered it and none holds it pending: the cut is the
    lowest pending id, or the last delivered id, across groups (``XTRIM MINID``, Redis 6.2).
    """
    try:
        groups = [pairs(flat) for flat in await conn.call("XINFO", "GROUPS", stream)]
    except RedisReplyError:  # no such stream yet
        return 0
    if not groups:
        return 0
    cuts: list[str] = []
    for group in groups:
        summary = await conn.call("XPENDING", stream, group[b"name"])
        pending, low = summary[0], summary[1]
        cuts.append(text(low) if pending else text(group[b"last-delivered-id"]))
    cut = min(cuts, key=id_order)
    if cut in ("0-0", "0"):
        return 0
    return int(await conn.call("XTRIM", stream, "MINID", cut))
