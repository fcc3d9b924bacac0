"""The coalescing pipeliner over a Redis Cluster: one :class:`~broker.pipeliner.Pipeliner` per
master, each batch split by node and its replies put back in order.

Why not redis-py's ``ClusterPipeline``: the per-node pipeliners keep what makes the broker
fast — concurrent tasks' commands leave together in one round trip per node — and a batch of
one task still costs one round trip per node it touches, all of them at once.

- A command goes to the master of its keys' slot (:func:`~broker.cluster_map.command_slot`);
  a command without keys to the first master; a ``MULTI`` … ``EXEC`` block as a unit to its
  slot's master. Keys of two slots in one command are refused before anything is sent.
- ``MOVED``: the slot map is read again (``CLUSTER SLOTS``) and the command re-sent;
  ``ASK``: the command is sent once to the node named, after ``ASKING``. Up to
  :data:`MAX_REDIRECTS` times, then the redirection is returned as the error it is.
- ``TRYAGAIN`` and ``CLUSTERDOWN`` are unavailability (:mod:`broker.resp`): the caller's
  loop backs off and retries, as for a lost connection; a lost node marks the map stale, so
  the next batch reads it again (a replica promoted in its place is found).
- Scripts: every node pipeliner loads them when its node answers ``NOSCRIPT``.

Order across nodes within one batch is not kept (they run at once): a caller whose writes
must land in order across slots awaits the first before sending the next.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .cluster_map import (
    ORDER_BARRIER,
    Command,
    SlotMap,
    block_slot,
    command_slot,
    redirection,
)
from .errors import RedisUnavailable, raised
from .pipeliner import Pipeliner
from .scripts import Script
from .slots import key_slot

MAX_REDIRECTS = 5
REFRESH_ASK_S = 2.0  # how long one node may take to answer CLUSTER SLOTS
_Unit = tuple[list[int], int | None]  # command indices (a MULTI block is one unit), its slot
_Sent = tuple[_Unit, str | None]  # a unit, and the node an ASK sent it to


def units_of(commands: Sequence[Command]) -> list[_Unit]:
    """The batch as units that each run on one node: single commands, and whole blocks."""
    units: list[_Unit] = []
    i = 0
    while i < len(commands):
        if str(commands[i][0]).upper() == "MULTI":
            end = i
            while end < len(commands) and str(commands[end][0]).upper() != "EXEC":
                end += 1
            block = list(range(i, min(end, len(commands) - 1) + 1))
            units.append((block, block_slot([commands[j] for j in block])))
            i = block[-1] + 1
        else:
            units.append(([i], command_slot(commands[i])))
            i += 1
    return units


class ClusterPipeliner:
    """The :class:`~broker.pipeliner.Pipeliner`'s calls, over every master of a cluster."""

    def __init__(
        self,
        seed_url: str,
        scripts: list[Script],
        slot_map: SlotMap,
        *,
        sharded_pubsub: bool,
        durability: dict[str, Any] | None = None,
    ) -> None:
        self._seed = seed_url
        self._durability = durability or {}  # each node's replica_acks (broker.durability)
        # Redis 7 or newer: SPUBLISH, heard only by the channel's slot's node
        self.sharded_pubsub = sharded_pubsub
        self._scripts = scripts
        self.map = slot_map
        self._nodes: dict[str, Pipeliner] = {}
        self._tg: TaskGroup | None = None
        self._stale = False
        self._refreshing = anyio.Lock()
        self._starting = anyio.Lock()

    async def call(self, *command: Any) -> Any:
        return raised((await self.call_many([command]))[0])

    async def call_many(self, commands: list[Command]) -> list[Any]:
        """As :meth:`Pipeliner.call_many`; at an :data:`~broker.cluster_map.ORDER_BARRIER`
        what came before is awaited before what follows is sent."""
        if ORDER_BARRIER in commands:
            at = commands.index(ORDER_BARRIER)
            head = await self.call_many(commands[:at])
            return [*head, None, *await self.call_many(commands[at + 1 :])]
        if not commands:
            return []
        if self._stale:
            await self.refresh()
        replies: list[Any] = [None] * len(commands)
        todo: list[_Sent] = [(unit, None) for unit in units_of(commands)]
        for _ in range(MAX_REDIRECTS + 1):
            todo = await self._send(commands, todo, replies)
            if not todo:
                return replies
        # still redirected (a reshard or a failover under way): "not now", not an answer
        for (indices, _), _ask in todo:
            for i in indices:
                if redirection(replies[i], self._seed) is not None:
                    replies[i] = RedisUnavailable(f"redis unavailable: {replies[i]}", code="MOVED")
        self._stale = True
        return replies

    async def _send(
        self, commands: list[Command], todo: list[_Sent], replies: list[Any]
    ) -> list[_Sent]:
        """Send each unit to its node, all nodes at once; the units to send again: those
        redirected (their redirection is their reply should they run out of tries)."""
        by_node: dict[str, list[_Sent]] = defaultdict(list)
        for unit, ask_url in todo:
            by_node[ask_url or self._url_of(unit[1])].append((unit, ask_url))
        try:
            answers = await asyncio.gather(
                *(self._node_call(url, commands, sent) for url, sent in by_node.items())
            )
        except RedisUnavailable:
            self._stale = True
            raise
        again: list[_Sent] = []
        hints: dict[int, str] = {}  # slot -> the node a MOVED named: newer than any map
        for sent, node_replies in zip(by_node.values(), answers, strict=True):
            at = 0
            for unit, ask_url in sent:
                at += ask_url is not None  # the ASKING reply
                unit_replies = node_replies[at : at + len(unit[0])]
                at += len(unit[0])
                for i, reply in zip(unit[0], unit_replies, strict=True):
                    replies[i] = reply
                moved = next(filter(None, (redirection(r, self._seed) for r in unit_replies)), None)
                if moved is None:
                    continue
                if not moved.ask:
                    hints[moved.slot] = moved.url
                    self._stale = True
                again.append((unit, moved.url if moved.ask else None))
        if again and self._stale:
            await self.refresh()
        for slot, url in hints.items():  # a node asked may not know the new owner yet
            self.map.moved(slot, url)
        return again

    async def _node_call(self, url: str, commands: list[Command], sent: list[_Sent]) -> list[Any]:
        batch: list[Command] = []
        for (indices, _), ask_url in sent:
            if ask_url is not None:
                batch.append(("ASKING",))
            batch += [commands[i] for i in indices]
        return await (await self._node(url)).call_many(batch)

    async def call_on(self, url: str, *command: Any) -> Any:
        """One command on the master at ``url`` (a command that walks one node: ``SCAN``)."""
        return raised((await (await self._node(url)).call_many([command]))[0])

    def _url_of(self, slot: int | None) -> str:
        url = self.map.url_for(slot) if slot is not None else (self.map.nodes or [self._seed])[0]
        if url is None:
            self._stale = True
            raise RedisUnavailable(f"redis unavailable: no master serves slot {slot}")
        return url

    def url_for_key(self, key: str) -> str:
        """The URL of the master serving ``key`` (for a blocking reader of its own)."""
        return self._url_of(key_slot(key))

    async def _node(self, url: str) -> Pipeliner:
        node = self._nodes.get(url)
        if node is not None:
            return node
        async with self._starting:  # one pipeliner per node, used only once it runs
            node = self._nodes.get(url)
            if node is None:
                assert self._tg is not None, "ClusterPipeliner.run() is not running"
                node = Pipeliner(url, self._scripts, **self._durability)
                await self._tg.start(node.run)
                self._nodes[url] = node
        return node

    def mark_stale(self) -> None:
        """The map may be out of date (a node was lost): the next batch reads it again."""
        self._stale = True

    @property
    def stale(self) -> bool:
        """Whether the map is to be read again before it is used."""
        return self._stale

    async def refresh_soon(self) -> None:
        """The map is out of date (a reader met ``MOVED``): read it again now."""
        self._stale = True
        await self.refresh()

    async def refresh(self) -> None:
        """Read the slot map again from the first master that answers."""
        async with self._refreshing:
            if not self._stale:
                return
            last: Exception | None = None
            for url in [*self.map.nodes, self._seed]:
                reply = None
                with anyio.move_on_after(REFRESH_ASK_S):  # a node that is gone: the next one
                    try:
                        reply = await (await self._node(url)).call("CLUSTER", "SLOTS")
                    except RedisUnavailable as exc:
                        last = exc
                if reply is None:
                    continue
                self.map = SlotMap.from_cluster_slots(reply, self._seed)
                self._stale = False
                return
            raise RedisUnavailable(f"redis unavailable: no cluster node answers: {last}")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the node pipeliners until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()
