"""The dispatcher: reads the ingress stream, validates, de-duplicates, routes and assigns.

A batch is handled in a fixed number of pipelined round trips, whatever its size: accept
every record, assign every routed attempt, park whatever found no credit, acknowledge the
entries. Assignment happens only against a free credit; otherwise the message waits in its
capability's waiting set, drained when a sidecar announces freed credits and at every sweep.

Order of writes, chosen so a crash between two of them is always repairable: the record moves
first (ACCEPTED -> ROUTED), then the assignment appends to the instance's stream; a stream
entry is only ever executed when the record agrees (fencing by attempt and instance). The
ingress entry is acknowledged last, so a dispatcher killed mid-batch leaves it pending, and
its next start (or another dispatcher) handles it again; every step is idempotent.

A broadcast (``mode: "broadcast"``, :mod:`broker.broadcast`) is a parent record, FANNED_OUT
with its fan-out (child id -> instance) on it, then one child record per healthy instance —
the batch's children in one more round trip, assigned with the batch's other work. Parents
are written before their children, so a child never lacks the parent that collects its
outcome; handled again, a FANNED_OUT parent has its missing children created.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Sequence

import anyio
from anyio.abc import TaskStatus

from broker.connection import Connection, ensure_group
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import DISPATCH_GROUP, ingress_streams
from broker.notifications import Notifications
from broker.registry import Registry
from broker.store import MessageStore
from broker.streams import RawEntry
from broker.timekeeping import now_ms
from broker.waiting_sets import heard_waiting

from .admission import Admission
from .assignment import Assigner
from .direct_publisher import DirectPublisher
from .ingress_lane import IngressLane
from .intake import Intake
from .intent_resolver import IntentResolver
from .routing_table import RoutingTable, routing_policy
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.dispatcher")

PRUNE_EVERY_S = 10.0  # how often the waiting index is pruned of capabilities with nothing
TRIM_EVERY_S = 10.0
BEHIND_WAITING = "queued behind waiting work of its capability"
LISTED_INSTANCES = 10  # a broadcast's timeline names this many of its instances (trace: all)


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Dispatcher:
    def __init__(
        self,
        conn: Connection,
        *,
        consumer: str | None = None,
        prune_every_s: float = PRUNE_EVERY_S,
    ) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.store = MessageStore(conn)
        self.registry = Registry(conn)
        self.consumer = consumer or default_consumer_name()
        self.table = RoutingTable(routing_policy(self.settings))
        self.assigner = Assigner(self.store, self.table)
        self.waiting = WaitingRoom(
            self.store,
            self.table,
            batch=self.settings.dispatch_batch,
            pass_size=self.settings.ingress_batch,
            assigner=self.assigner,
        )
        self.intents = IntentResolver(conn)
        self.direct = DirectPublisher(conn, self.table, self.waiting, self.assigner)
        streams = ingress_streams(self.keys, self.settings.ingress_partitions)
        self.lanes = [self._lane(stream) for stream in streams]
        self._credit_freed = anyio.Event()
        self._to_drain: set[str] = set()
        self._next_prune = 0.0
        self._prune_every_s = prune_every_s
        self.notifications = Notifications(conn)

    def _lane(self, stream: str) -> IngressLane:
        intake = Intake(self.conn, self.store, stream)
        admission = Admission(
            self.conn,
            self.store,
            self.table,
            assigner=self.assigner,
            waiting=self.waiting,
            intake=intake,
            on_parked=self._drain_soon,
        )
        return IngressLane(
            self.conn,
            stream,
            self.consumer,
            intake=intake,
            admission=admission,
            assigner=self.assigner,
            waiting=self.waiting,
            intents=self.intents,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        for lane in self.lanes:
            await ensure_group(self.conn, lane.stream, DISPATCH_GROUP)
        # Work a predecessor left waiting goes before what arrives now: arrivals queue behind
        # it from the start (and no direct lane is published for it), not only once the
        # first drain has met it; that drain lets them pass again where what waits cannot use
        # the free credits, or is gone.
        inherited = await self.store.waiting.capabilities()
        self.waiting.may_wait.add(inherited)
        self.waiting.backlogged.update(inherited)
        await self.refresh()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._watch_notifications)
                tg.start_soon(self._drain_loop)
                tg.start_soon(self._trim_loop)
                for lane in self.lanes:  # each lane's own pending entries handled before started
                    await tg.start(self._run_lane, lane)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self.intents.aclose()

    async def refresh(self) -> None:
        """A new registry snapshot for routing, for the intent router (with the agents'
        approval rates), and for the direct lanes."""
        self.table.load(await self.registry.snapshot())
        self.notifications.follow(i.instance_id for i in self.table.instances)
        await self.intents.load(self.table.index)
        try:  # a lane is an option: its failure takes nothing else of the sweep with it
            await self.direct.publish()
        except (RedisUnavailable, RedisReplyError) as exc:
            log.warning("direct lanes not published (the next snapshot retries): %s", exc)

    # -- ingress -----------------------------------------------------------------------------

    async def _run_lane(self, lane: IngressLane, *, task_status: TaskStatus[None]) -> None:
        async with self.conn.reader() as reader:
            await lane.recover(reader)
            task_status.started()
            await lane.consume(reader)

    async def claim_abandoned(self) -> int:
        """Take over ingress entries other dispatchers read and never finished, on every
        partition (:meth:`IngressLane.claim_abandoned`). Returns how many."""
        return sum([await lane.claim_abandoned() for lane in self.lanes])

    async def handle_batch(self, entries: Sequence[RawEntry], *, recovering: bool = False) -> None:
        """A batch of the first partition's entries (see :meth:`IngressLane.handle_batch`)."""
        await self.lanes[0].handle_batch(entries, recovering=recovering)

    # -- waiting -----------------------------------------------------------------------------

    async def _drain_loop(self) -> None:
        """Drain the capabilities whose instances just freed credits, at once; and every sweep
        interval — however busy the notifications keep this loop — refresh the registry and
        drain every capability with waiting work."""
        next_sweep = anyio.current_time()
        while True:
            ready = self._rate_ready_at()
            with anyio.move_on_after(max(0.0, min(next_sweep, ready) - anyio.current_time())):
                await self._credit_freed.wait()
            self._credit_freed = anyio.Event()
            capabilities, self._to_drain = self._to_drain, set()
            try:
                if anyio.current_time() >= ready:  # a rate limit lets work through again
                    held = await self.store.waiting.capabilities()
                    self.waiting.may_wait.add(held)
                    capabilities |= set(held)
                if anyio.current_time() >= next_sweep:
                    next_sweep = anyio.current_time() + self.settings.sweep_interval_s
                    await self.refresh()
                    await self.claim_abandoned()
                    waiting = await self._waiting_capabilities()
                    self.waiting.may_wait.add(waiting)
                    served = self._served(waiting)  # no credit is free for any other
                    await self.waiting.unmatched.reconsider(served)
                    capabilities |= set(served)
                await self.drain(capabilities)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("drain failed (the next sweep retries): %s", exc)
            except Exception:  # a defect: this loop is the dispatcher's clock, it never stops
                log.exception("drain failed unexpectedly (the next sweep retries)")

    def _served(self, capabilities: list[str]) -> list[str]:
        """Those some registered instance serves: work set aside for any other can find
        nothing to take it, however often it is looked at again (a producer may name any
        number of capabilities; looking at each one at every sweep cost a core's fifth)."""
        served = self.table.index.by_capability
        return [c for c in capabilities if self.table.policy.resolve(c) in served]

    def _rate_ready_at(self) -> float:
        """When (loop clock) the first held rate limit lets work through again (inf: none)."""
        now = now_ms()
        times = [self.table.next_ready_ms(now), self.assigner.gate.next_ready_ms(now)]
        soonest = min((t for t in times if t is not None), default=None)
        if soonest is None:
            return float("inf")
        return anyio.current_time() + max(0.0, soonest - now) / 1000

    async def drain(self, capabilities: Iterable[str]) -> int:
        return await self.waiting.drain(capabilities)

    async def _waiting_capabilities(self) -> list[str]:
        """The capabilities with waiting work; now and then the index is pruned of those
        with none left, and so is this dispatcher's memory of them."""
        waiting = await self.store.waiting.capabilities()
        if self.store.waiting.index_unreadable:  # any capability served may have work
            await self.store.waiting.remove_index()
            return sorted(self.table.index.by_capability)
        now = anyio.current_time()
        if now < self._next_prune:
            return waiting
        self._next_prune = now + self._prune_every_s
        heard = self.waiting.may_wait.heard()
        dropped = set(await self.store.waiting.prune_index(waiting))
        self.waiting.forget(dropped, heard)
        return [c for c in waiting if c not in dropped]

    def _drain_soon(self, capabilities: Iterable[str]) -> None:
        self._to_drain.update(capabilities)
        self._credit_freed.set()

    # -- notifications and housekeeping ------------------------------------------------------

    async def _watch_notifications(self, *, task_status: TaskStatus[None]) -> None:
        """Credit releases wake the drain loop; registry changes refresh the snapshot. A
        notification is a hint: one that does not parse (anyone allowed to publish may send
        anything) is dropped, and the sweep does the work a lost hint would have."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.notifications.run)
            task_status.started()
            while True:
                message = await self.notifications.next(timeout_s=1.0)
                if message is not None:
                    await self._notified(*message)

    async def _notified(self, channel: str, data: bytes) -> None:
        if channel != self.keys.registry_channel:
            released = credit_release(data)
            if released is None:
                log.warning("credit notification not understood, dropped: %r", data[:80])
                return
            worth = self.waiting.may_wait.worth_draining(self.table.credits_released(*released))
            if not worth:
                return  # nothing may wait for what it freed: no drain to wake
            self._to_drain.update(worth)
        elif (capability := heard_waiting(data)) is not None:
            if self.table.policy.resolve(capability) not in self.table.index.by_capability:
                return  # no instance of it here: a registry change brings it (below)
            self.waiting.may_wait.add([capability])
            self._to_drain.add(capability)
        else:  # a card changed, or hints may have been missed (MISSED): read both again
            try:
                await self.refresh()
                waiting = await self.store.waiting.capabilities()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("registry refresh failed (the sweep retries): %s", exc)
                return
            self.waiting.may_wait.add(waiting)
            self._to_drain.update(waiting)
        self._credit_freed.set()

    async def _trim_loop(self) -> None:
        while True:
            await anyio.sleep(TRIM_EVERY_S)
            for lane in self.lanes:  # one lane refused (a group gone meanwhile) stops no other
                try:
                    await lane.trim()
                except (RedisUnavailable, RedisReplyError) as exc:
                    log.warning("trim failed (the next one retries): %s", exc)


def credit_release(data: bytes) -> tuple[str, int] | None:
    """``"<instance id> <credits in use>"`` from ``lua/release.lua``, or ``None``."""
    instance_id, _, in_use = data.decode(errors="replace").partition(" ")
    if not instance_id or not in_use.isdigit() or len(in_use) > 9:
        return None
    return instance_id, int(in_use)
