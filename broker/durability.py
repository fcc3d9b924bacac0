"""``replica_acks``: writes that must survive a failover are held until replicas have them.

Redis replicates asynchronously: a master answers a write before any replica has it, and a
master lost a moment later takes it along; the replica promoted in its place never saw it.
With ``replica_acks = N`` every pipelined round trip that writes ends with ``WAIT N T``
(``T``: ``replica_ack_timeout_s``), so its callers learn of success only once ``N`` replicas
of that server acknowledged everything the connection wrote. One ``WAIT`` per round trip,
not per command: a batch of many tasks' writes shares it.

Fewer than ``N`` acknowledgements within ``T`` (no replica, or one far behind) makes every
reply of that round trip :class:`~broker.errors.RedisUnavailable` with the reason: "not
known to be durable" is what a lost connection already means to every caller, and each
retries idempotently (records are fenced by stage and attempt, ids de-duplicated). So with
``replica_acks`` set and no replica in sync, the broker waits rather than write what a
failover could take back. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import RedisUnavailable

# Commands the broker sends that write nothing: a round trip of only these needs no WAIT.
READS = frozenset(
    {
        "EXISTS",
        "GET",
        "HEXISTS",
        "HGET",
        "HGETALL",
        "HLEN",
        "HMGET",
        "INFO",
        "LINDEX",
        "LRANGE",
        "MEMORY",
        "MGET",
        "PING",
        "PTTL",
        "SCAN",
        "SCARD",
        "SISMEMBER",
        "SMEMBERS",
        "TTL",
        "XINFO",
        "XLEN",
        "XPENDING",
        "XRANGE",
        "XREVRANGE",
        "ZCARD",
        "ZRANGE",
        "ZRANGEBYSCORE",
        "ZSCORE",
        "CLUSTER",
        "SCRIPT",
    }
)


def _name(command: Sequence[Any]) -> str:
    first = command[0]
    return (first.decode() if isinstance(first, bytes) else str(first)).upper()


def writes(commands: Sequence[Sequence[Any]]) -> bool:
    """Whether any of ``commands`` may write (a script may: it counts as a write)."""
    return any(_name(c) not in READS for c in commands)


def wait_command(replica_acks: int, timeout_s: float) -> tuple[Any, ...]:
    return ("WAIT", replica_acks, max(1, round(timeout_s * 1000)))


def shortfall(reply: Any, replica_acks: int, timeout_s: float) -> RedisUnavailable | None:
    """Why the round trip ``WAIT`` ended cannot count as durable, or ``None`` when
    ``replica_acks`` replicas acknowledged it."""
    if isinstance(reply, int) and reply >= replica_acks:
        return None
    said = f"{reply} replica(s)" if isinstance(reply, int) else f"WAIT refused ({reply})"
    return RedisUnavailable(
        f"redis unavailable: replica_acks = {replica_acks}, but {said} acknowledged the "
        f"writes within {timeout_s:g} s: not known to survive a failover",
        code="REPLICAS",
    )
