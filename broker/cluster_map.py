"""Redis Cluster: which node serves a command. Pure.

- :class:`SlotMap` is the cluster's ``CLUSTER SLOTS`` answer as a table slot → node URL. A
  node's URL is the seed URL with the node's host and port: the same user, password and TLS
  parameters (every node of a cluster shares them).
- :func:`command_slot` is the slot a command's keys hash to (``None`` for a command without
  keys, which any node serves); keys of more than one slot are :class:`CrossSlot`, refused
  here rather than by Redis. The key positions are those of the commands the broker sends.
- :func:`redirection` reads a ``MOVED`` or ``ASK`` error reply: where to go instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .errors import RedisReplyError
from .redis_url import url_host
from .slots import SLOTS, key_slot

Command = tuple[Any, ...]


# In a batch: everything before it is written before anything after it is sent. On one
# server a pipeline keeps that order by itself and the barrier is dropped; on a cluster the
# parts of a batch run on their nodes at once, so a batch whose order matters for a crash (an
# index after what it points at) waits at the barrier. Its reply is ``None``.
ORDER_BARRIER: Command = ("-- order barrier --",)


class CrossSlot(ValueError):
    """A command whose keys live in more than one slot: no cluster node can run it."""


def _name(part: Any) -> str:
    return part.decode() if isinstance(part, bytes) else str(part)


def _keys(command: Command) -> Sequence[Any]:
    name = _name(command[0]).upper()
    if name in _SCRIPTED:
        return command[3 : 3 + int(command[2])]
    if name in _READS:
        upper = [_name(p).upper() for p in command]
        at = upper.index("STREAMS") + 1
        return command[at : at + (len(command) - at) // 2]
    if name in _KEY_SECOND:
        return command[2:3]
    if name in _ALL_KEYS:
        return command[1:]
    if name in _SHARD_CHANNEL:
        return command[1:2]
    if name in _KEYLESS or len(command) < 2:
        return ()
    return command[1:2]


_SCRIPTED = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL"})
_READS = frozenset({"XREAD", "XREADGROUP"})
_KEY_SECOND = frozenset({"XGROUP", "XINFO", "MEMORY", "OBJECT"})  # a subcommand, then the key
_ALL_KEYS = frozenset({"DEL", "EXISTS", "UNLINK", "MGET", "TOUCH", "WATCH"})
REDIRECT_CODES = frozenset({"MOVED", "ASK"})
_SHARD_CHANNEL = frozenset({"SPUBLISH", "SSUBSCRIBE"})  # the channel's slot, as a key's
_KEYLESS = frozenset(
    {
        "SCAN",  # walks one node: sent with Connection.call_on
        "KEYS",
        "RANDOMKEY",
        "PING",
        "INFO",
        "SCRIPT",
        "CLUSTER",
        "CLIENT",
        "CONFIG",
        "PUBLISH",
        "MULTI",
        "EXEC",
        "DISCARD",
        "ASKING",
        "FLUSHALL",
        "FLUSHDB",
        "DBSIZE",
        "TIME",
        "ACL",
        "AUTH",
        "HELLO",
        "SELECT",
        "WAIT",
        "COMMAND",
        "ECHO",
        "SUBSCRIBE",
        "PSUBSCRIBE",
        "UNSUBSCRIBE",
    }
)


def command_slot(command: Command) -> int | None:
    """The slot ``command`` must run in; ``None``: any node."""
    slots = {key_slot(k if isinstance(k, bytes) else str(k)) for k in _keys(command)}
    if len(slots) > 1:
        raise CrossSlot(f"{_name(command[0]).upper()} names keys of {len(slots)} slots")
    return slots.pop() if slots else None


def block_slot(commands: Sequence[Command]) -> int | None:
    """The one slot of a ``MULTI`` … ``EXEC`` block (it runs on one node, as a unit)."""
    slots = {s for s in map(command_slot, commands) if s is not None}
    if len(slots) > 1:
        raise CrossSlot(f"a MULTI block names keys of {len(slots)} slots")
    return slots.pop() if slots else None


@dataclass(frozen=True, slots=True)
class Redirect:
    ask: bool  # ASK: this command only, after ASKING; MOVED: the map is out of date
    slot: int
    url: str


def redirection(reply: Any, seed_url: str) -> Redirect | None:
    """``MOVED <slot> <host>:<port>`` or ``ASK …`` as a :class:`Redirect`; else ``None``."""
    if not isinstance(reply, RedisReplyError) or reply.code not in REDIRECT_CODES:
        return None
    parts = reply.message.split()
    if len(parts) != 3:
        return None
    host, _, port = parts[2].rpartition(":")
    return Redirect(reply.code == "ASK", int(parts[1]), node_url(seed_url, host, int(port)))


def node_url(seed_url: str, host: str, port: int) -> str:
    """The seed URL pointed at another node: credentials, TLS parameters and path kept."""
    parts = urlsplit(seed_url)
    auth = parts.netloc.rpartition("@")[0]
    where = f"{url_host(host)}:{port}"
    return urlunsplit(parts._replace(netloc=f"{auth}@{where}" if auth else where))


class SlotMap:
    """Slot → the URL of the master serving it."""

    def __init__(self, owners: list[str | None]) -> None:
        assert len(owners) == SLOTS
        self._owners = owners
        self.sharded_pubsub = False  # the servers have SPUBLISH (Redis 7): set at start-up
        self._nodes: list[str] | None = None  # worked out when asked, after the last move

    @classmethod
    def from_cluster_slots(cls, reply: Any, seed_url: str) -> SlotMap:
        """From ``CLUSTER SLOTS``: ``[[start, end, [host, port, id, ...], replicas...], ...]``.
        A master announced without a host (``""`` or ``?``) is the seed's host."""
        seed_host = urlsplit(seed_url).hostname or "127.0.0.1"
        owners: list[str | None] = [None] * SLOTS
        for start, end, master, *_ in reply:
            host = _name(master[0])
            url = node_url(seed_url, host if host not in ("", "?") else seed_host, int(master[1]))
            for slot in range(int(start), int(end) + 1):
                owners[slot] = url
        return cls(owners)

    def url_for(self, slot: int) -> str | None:
        """The master serving ``slot`` (``None``: no master does: the cluster is down)."""
        return self._owners[slot]

    def moved(self, slot: int, url: str) -> None:
        """One slot's new master (a ``MOVED`` reply): a resharding sends one per slot, so
        this stays O(1) and the node list is worked out again when next asked."""
        self._owners[slot] = url
        self._nodes = None

    @property
    def nodes(self) -> list[str]:
        """Every master's URL, in slot order."""
        if self._nodes is None:
            self._nodes = list(dict.fromkeys(u for u in self._owners if u is not None))
        return self._nodes

    def covered(self) -> bool:
        return all(u is not None for u in self._owners)
