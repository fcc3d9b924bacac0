"""At start-up: is the URL a node of a Redis Cluster? Its slot map if so; the scripts loaded.

The URL of any node is enough: ``CLUSTER SLOTS`` answers with every master and the slots it
serves. A single server answers that cluster support is disabled. A cluster has only database
0, so a URL naming another is refused with a sentence saying so (a node would refuse
``SELECT`` with a bare error).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from .cluster_map import SlotMap
from .errors import ConfigError, RedisReplyError, RedisUnavailable
from .redis_url import parse_redis_url
from .resp import RespConnection
from .scripts import Script
from .slots import slot_tag

log = logging.getLogger("agent_reach.connection")


def without_db(url: str) -> str:
    """The URL without its ``/<db>`` path (a cluster node is connected to this way)."""
    return urlunsplit(urlsplit(url)._replace(path=""))


def _redacted(url: str) -> str:
    return parse_redis_url(url).where


async def detect(conn: RespConnection, url: str) -> SlotMap | None:
    """The cluster's slot map, or ``None`` for a single server (or a user who may not ask:
    ``NOPERM``, taken as a single server, as before clusters were known)."""
    (reply,) = await conn.execute([("CLUSTER", "SLOTS")])
    if isinstance(reply, RedisReplyError):
        if "cluster support disabled" in reply.message or reply.code == "NOPERM":
            return None
        raise RedisUnavailable(f"redis at {_redacted(url)} refused CLUSTER SLOTS: {reply}")
    if isinstance(reply, Exception):
        raise reply
    db = parse_redis_url(url).db
    if db:
        raise ConfigError(
            "redis_url",
            f"redis at {_redacted(url)} is a Redis Cluster node, and a cluster has only "
            f"database 0: drop /{db} from the URL (keep keys apart with `prefix`)",
        )
    slot_map = SlotMap.from_cluster_slots(reply, without_db(url))
    if not slot_map.covered():
        raise RedisUnavailable(
            f"redis at {_redacted(url)} is a Redis Cluster that does not serve every slot yet"
        )
    slot_tag(0)  # the per-slot counters' tags, found now rather than on the first message
    version = await server_version(conn)
    slot_map.sharded_pubsub = version >= (7,)
    log.info(
        "redis at %s is a Redis Cluster node: cluster mode, %d masters, %s pub/sub",
        _redacted(url),
        len(slot_map.nodes),
        "sharded" if slot_map.sharded_pubsub else "classic",
    )
    return slot_map


async def server_version(conn: RespConnection) -> tuple[int, ...]:
    """The server's version from ``INFO server``; ``(0,)`` when it will not say (a user
    without the grant, a provider that renames the command): the oldest behaviour is kept."""
    (reply,) = await conn.execute([("INFO", "server")])
    if not isinstance(reply, bytes):
        return (0,)
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("redis_version:"):
            parts = line.partition(":")[2].strip().split(".")
            return tuple(int(p) for p in parts if p.isdigit())
    return (0,)


async def preload(
    conn: RespConnection, url: str, slot_map: SlotMap | None, scripts: Sequence[Script]
) -> None:
    """``SCRIPT LOAD`` every script on the server, or on every master of a cluster."""
    if not scripts:
        return
    if slot_map is None:
        await _load(conn, scripts)
        return
    for node in slot_map.nodes:
        node_conn = await RespConnection.open(node)
        try:
            await _load(node_conn, scripts)
        finally:
            await node_conn.close()


async def _load(conn: RespConnection, scripts: Sequence[Script]) -> None:
    replies = await conn.execute([("SCRIPT", "LOAD", script.source) for script in scripts])
    for reply in replies:
        if isinstance(reply, RedisReplyError) and reply.code == "NOPERM":
            continue  # this user may not: the pipeliner loads them on first use, if it may
        if isinstance(reply, Exception):
            raise RedisUnavailable(f"redis refused SCRIPT LOAD: {reply}") from reply
