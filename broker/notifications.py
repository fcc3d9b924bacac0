"""The dispatcher's pub/sub hints: a credit was released, a card changed.

On one server, and on a cluster older than Redis 7, both are classic channels (``P:credit``,
``P:registry``) on one connection: a cluster copies a classic ``PUBLISH`` to every node, so
any node hears everything — and every node pays for every release.

On a Redis 7 cluster a release is announced with ``SPUBLISH`` on its instance's own sharded
channel ``P:credit:{<inst>}``, in the slot of the instance's keys: only the node that ran
the release sends it, to its own subscribers. The dispatcher subscribes (``SSUBSCRIBE``) on
every master to the channels of the instances in its snapshot (:meth:`Notifications.follow`),
one connection per master, and subscribes again from a fresh slot map when the instances
change, a node is lost or a slot moves (Redis then sends ``sunsubscribe``). The registry
channel stays classic: a card changes seldom.

A hint missed while subscribing again only delays work until the next sweep; none is replayed.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from collections.abc import Iterable

import anyio
from anyio.abc import TaskStatus

from .cluster_pipeliner import ClusterPipeliner
from .connection import Connection
from .errors import RedisReplyError, RedisUnavailable
from .keyspace import Keyspace
from .resp import RespConnection
from .slots import key_slot

log = logging.getLogger("agent_reach.notifications")

RETRY_S = 0.5  # after a lost connection, before subscribing again
_QUEUED = 1000  # hints kept for a slow reader; more are dropped (the sweep covers them)
_MESSAGES = frozenset({b"message", b"smessage"})
# on the registry channel, "no instance in particular": hints may have been lost, so a
# dispatcher reads the registry and the waiting index again (workers/dispatcher.py)
MISSED = b""


def credit_shard(keys: Keyspace, instance_id: str) -> str:
    """``P:credit:{<inst>}``: the sharded channel of an instance's credit releases."""
    return f"{keys.credit_channel}:{{{instance_id}}}"


def credit_announcement(conn: Connection, instance_id: str) -> tuple[str, str]:
    """Where ``release.lua`` announces ``instance_id``'s freed credits: the channel, and
    ``"1"`` for ``SPUBLISH`` (a Redis 7 cluster) or ``"0"`` for ``PUBLISH``."""
    if sharded(conn):
        return credit_shard(conn.keys, instance_id), "1"
    return conn.keys.credit_channel, "0"


def sharded(conn: Connection) -> bool:
    """Whether credits are announced on sharded channels (a cluster of Redis 7 or newer)."""
    return isinstance(conn.pipeliner, ClusterPipeliner) and conn.pipeliner.sharded_pubsub


class Notifications:
    """``(channel, data)`` hints from the credit and registry channels."""

    def __init__(self, conn: Connection, *, retry_s: float = RETRY_S) -> None:
        self._conn = conn
        self._retry_s = retry_s  # after a failure, or between reads of an incomplete map
        self._keys = conn.keys
        self._instances: frozenset[str] = frozenset()
        self._changed = anyio.Event()
        self._failed = False
        self._queue: deque[tuple[str, bytes]] = deque(maxlen=_QUEUED)
        self._arrived = anyio.Event()
        self._lost = False  # the subscriptions dropped: hints may have gone by unheard
        self._missed = False  # some hint was dropped or may have been: say so first

    def follow(self, instances: Iterable[str]) -> None:
        """Hear the credit releases of ``instances`` (on sharded channels: subscribes to
        theirs, and leaves those of instances no longer named)."""
        wanted = frozenset(instances)
        if wanted != self._instances:
            self._instances = wanted
            if sharded(self._conn):  # classic channels do not depend on the instances
                self._changed.set()

    async def next(self, *, timeout_s: float) -> tuple[str, bytes] | None:
        """The next hint, or ``None`` after ``timeout_s`` of quiet. Where hints may have been
        lost — subscribed again after a failure, or more than ``_QUEUED`` left unread — first
        an empty one on the registry channel (:data:`MISSED`): read everything again."""
        if self._missed:
            self._missed = False
            return self._keys.registry_channel, MISSED
        if not self._queue:
            self._arrived = anyio.Event()
            with anyio.move_on_after(timeout_s):
                await self._arrived.wait()
        return self._queue.popleft() if self._queue else None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep the subscriptions until cancelled; a failure is logged and subscribed again."""
        task_status.started()
        while True:
            self._changed = anyio.Event()
            self._failed = False
            try:
                plan, unserved = self._plan()
            except RedisUnavailable as exc:  # the map names no master at all
                log.warning("notifications not subscribed, trying again: %s", exc)
                self._lost = True
                await self._stale()
                await anyio.sleep(self._retry_s)
                continue
            async with anyio.create_task_group() as tg:
                for url, channels in plan.items():
                    tg.start_soon(self._listen, url, channels)
                if unserved:
                    tg.start_soon(self._until_served, unserved)
                await self._changed.wait()
                tg.cancel_scope.cancel()
            if self._failed:
                await self._stale()
                await anyio.sleep(self._retry_s)

    def _plan(self) -> tuple[dict[str, list[tuple[str, ...]]], list[str]]:
        """Node URL -> the subscribe commands to send there; and the sharded channels whose
        slot no master serves in the map (read mid-failover, say): left out for now."""
        classic = ("SUBSCRIBE", self._keys.registry_channel)
        if not sharded(self._conn):
            return {self._conn.url: [(*classic, self._keys.credit_channel)]}, []
        route = self._conn.pipeliner
        assert isinstance(route, ClusterPipeliner)
        plan: dict[str, list[tuple[str, ...]]] = defaultdict(list)
        if not route.map.nodes:
            raise RedisUnavailable("redis unavailable: the slot map names no master")
        plan[route.map.nodes[0]].append(classic)  # a classic message reaches every node
        unserved: list[str] = []
        for instance in sorted(self._instances):
            channel = credit_shard(self._keys, instance)
            url = route.map.url_for(key_slot(channel))
            if url is None:
                unserved.append(channel)
            else:
                plan[url].append(("SSUBSCRIBE", channel))
        return plan, unserved

    async def _until_served(self, channels: list[str]) -> None:
        """Read the slot map again until a master serves each of ``channels``, then have
        every subscription made again: the others go on meanwhile."""
        log.warning("credit hints of %d instances wait for their slots' masters", len(channels))
        route = self._conn.pipeliner
        assert isinstance(route, ClusterPipeliner)
        while any(route.map.url_for(key_slot(c)) is None for c in channels):
            await anyio.sleep(self._retry_s)
            await self._stale()
        self._lost = True  # what went by on them meanwhile is unknown: read everything again
        self._changed.set()

    async def _listen(self, url: str, commands: list[tuple[str, ...]]) -> None:
        """Subscribe on one node and pass its messages on; a failure ends every node's
        subscriptions, to be made again from a fresh slot map."""
        try:
            await self._subscribed(url, commands)
        except (RedisUnavailable, RedisReplyError) as exc:
            log.warning("notifications lost, subscribing again: %s", exc)
            self._failed = True
            self._lost = True
            self._changed.set()

    async def _subscribed(self, url: str, commands: list[tuple[str, ...]]) -> None:
        conn = await RespConnection.open(url)
        try:
            for reply in await conn.execute(list(commands)):
                if isinstance(reply, Exception):  # MOVED: the slot left this node
                    raise reply
            if self._lost:  # heard again from now on: what went by meanwhile is unknown
                self._lost = False
                self._missed = True
                self._arrived.set()
            while True:
                push = await conn.read_one()
                if not isinstance(push, list) or len(push) < 3:
                    continue
                if push[0] in _MESSAGES:
                    self._hint(push[1].decode(errors="replace"), push[2])
                elif push[0] == b"sunsubscribe":  # the slot moved: subscribe where it went
                    raise RedisUnavailable(f"redis unavailable: {push[1]!r} moved")
        finally:
            with anyio.CancelScope(shield=True):
                await conn.close()

    def _hint(self, channel: str, data: bytes) -> None:
        if len(self._queue) == _QUEUED:  # the oldest goes: say so (next)
            self._missed = True
        self._queue.append((channel, data))
        self._arrived.set()

    async def _stale(self) -> None:
        route = self._conn.pipeliner
        if isinstance(route, ClusterPipeliner):
            route.mark_stale()
            try:
                await route.refresh()
            except RedisUnavailable as exc:
                log.warning("slot map not read (retried): %s", exc)
