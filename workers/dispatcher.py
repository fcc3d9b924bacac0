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
import time
from collections.abc import Iterable, Sequence

import anyio
from anyio.abc import TaskStatus

from broker import tracing
from broker.acks import ack, trim_acknowledged
from broker.connection import Connection, ensure_group
from broker.entries import IngressEntry, parse_ingress
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import DISPATCH_GROUP
from broker.registry import Registry
from broker.store import MessageStore
from broker.streams import GroupReader, RawEntry, Subscriber, raw_entries

from .admission import Admission
from .assignment import Assigner
from .intake import Intake
from .routing_table import RoutingTable, routing_policy
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.dispatcher")

READ_BLOCK_MS = 1000
PRUNE_EVERY_S = 10.0  # how often the waiting index is pruned of capabilities with nothing
MAX_ENTRY_FAILURES = 3  # an entry failing this often on its own is rejected with the error
TRIM_EVERY_S = 10.0
BEHIND_WAITING = "queued behind waiting work of its capability"
LISTED_INSTANCES = 10  # a broadcast's timeline names this many of its instances (trace: all)


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Dispatcher:
    def __init__(self, conn: Connection, *, consumer: str | None = None) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.store = MessageStore(conn)
        self.registry = Registry(conn)
        self.consumer = consumer or default_consumer_name()
        self.table = RoutingTable(routing_policy(self.settings))
        self.assigner = Assigner(self.store, self.table)
        self.waiting = WaitingRoom(self.store, self.table, batch=self.settings.dispatch_batch)
        self.intake = Intake(conn, self.store)
        self.admission = Admission(
            conn,
            self.store,
            self.table,
            assigner=self.assigner,
            waiting=self.waiting,
            intake=self.intake,
            on_parked=self._drain_soon,
        )
        self._credit_freed = anyio.Event()
        self._to_drain: set[str] = set()
        self._next_prune = 0.0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await ensure_group(self.conn, self.keys.ingress, DISPATCH_GROUP)
        await self.refresh()
        async with self.conn.reader() as reader, anyio.create_task_group() as tg:
            await tg.start(self._watch_notifications)
            tg.start_soon(self._drain_loop)
            tg.start_soon(self._trim_loop)
            await self._recover(reader)
            task_status.started()
            await self._ingress_loop(reader)

    async def refresh(self) -> None:
        self.table.load(await self.registry.snapshot())

    # -- ingress -----------------------------------------------------------------------------

    async def _recover(self, reader: GroupReader) -> None:
        """Re-handle this consumer's own pending entries: a restart after a crash mid-batch."""
        entries = await reader.read_raw(
            self.keys.ingress,
            DISPATCH_GROUP,
            self.consumer,
            count=100_000,
            block_ms=None,
            pending=True,
        )
        if entries:
            log.info("recovering %d pending ingress entries", len(entries))
            await self._handle(entries, recovering=True)

    async def claim_abandoned(self) -> int:
        """Take over ingress entries another dispatcher read and never finished (it died, and
        did not come back under its name): ``XAUTOCLAIM`` after ``claim_idle_s``. Handling
        an entry twice is harmless: a record is created once per id."""
        reply = await self.conn.call(
            "XAUTOCLAIM",
            self.keys.ingress,
            DISPATCH_GROUP,
            self.consumer,
            int(self.settings.claim_idle_s * 1000),
            "0-0",
            "COUNT",
            self.settings.dispatch_batch,
        )
        entries = raw_entries(reply[1])
        if entries:
            log.info("claimed %d ingress entries abandoned by another dispatcher", len(entries))
            await self._handle(entries, recovering=True)
        gone = [e[0] for e in reply[1] if e and not e[1]]  # deleted while pending (Redis 6.2)
        if gone:
            await ack(self.conn, self.keys.ingress, DISPATCH_GROUP, [g.decode() for g in gone])
        return len(entries)

    async def _ingress_loop(self, reader: GroupReader) -> None:
        backoff = 0.1
        while True:
            try:
                if backoff > 0.1:  # after a failure: first finish what this consumer holds
                    await self._recover(reader)
                entries = await reader.read_raw(
                    self.keys.ingress,
                    DISPATCH_GROUP,
                    self.consumer,
                    count=self.settings.dispatch_batch,
                    block_ms=READ_BLOCK_MS,
                )
                if entries:
                    await self._handle(entries, recovering=False)
                backoff = 0.1
            except (RedisUnavailable, RedisReplyError) as exc:
                backoff = min(backoff * 2, 5.0)
                log.warning("ingress failed, retrying in %.1fs: %s", backoff, exc)
                await anyio.sleep(backoff)
            except Exception:  # a defect outside any one entry: never out of the loop
                backoff = min(backoff * 2, 5.0)
                log.exception("ingress failed unexpectedly, retrying in %.1fs", backoff)
                await anyio.sleep(backoff)

    async def _handle(self, entries: Sequence[RawEntry], *, recovering: bool) -> None:
        """A batch at once; should it fail unexpectedly, its entries one at a time, each tried
        up to ``MAX_ENTRY_FAILURES`` times — on every path: the read loop, the recovery at
        start, entries taken over from another dispatcher. An entry that still fails is
        REJECTED with the error (dead-lettered, acknowledged): no entry can stop the ingress,
        or its dispatcher, for ever."""
        try:
            await self.handle_batch(entries, recovering=recovering)
            return
        except (RedisUnavailable, RedisReplyError):
            raise
        except Exception:
            log.exception("a batch of %d ingress entries failed: one at a time", len(entries))
        for entry in entries:
            await self._handle_alone(entry)

    async def _handle_alone(self, entry: RawEntry) -> None:
        for failures in range(1, MAX_ENTRY_FAILURES + 1):
            try:
                await self.handle_batch([entry], recovering=True)
                return
            except (RedisUnavailable, RedisReplyError):
                raise
            except Exception as exc:
                if failures == MAX_ENTRY_FAILURES:
                    await self._set_aside(entry, exc)
                else:
                    log.warning("ingress entry %s failed (%d): %s", entry[0], failures, exc)

    async def _set_aside(self, entry: RawEntry, exc: Exception) -> None:
        entry_id, flat = entry
        log.error("ingress entry %s failed %d times; rejected", entry_id, MAX_ENTRY_FAILURES)
        reason = f"the dispatcher could not handle it: {type(exc).__name__}: {exc}"
        names, minted = await self.intake.names([entry_id], recovering=True)
        parsed = parse_ingress(entry_id, flat)
        raw = parsed.envelope if isinstance(parsed, IngressEntry) else parsed.raw
        await self.intake.reject([self.intake.rejection(entry_id, names[entry_id], reason, raw)])
        await self.intake.acknowledge([entry_id], minted)

    async def handle_batch(self, entries: Sequence[RawEntry], *, recovering: bool = False) -> None:
        """Take in, accept, route, assign or park, then acknowledge: a few round trips per
        batch, whatever the entries hold (:mod:`workers.intake`)."""
        started_ns = time.time_ns()
        intaken = await self.intake.take(entries, recovering=recovering)
        routed = await self.admission.admit(intaken.envelopes)
        assigned = await self.assigner.assign(routed)
        if len(assigned) < len(routed):  # refused for want of a credit: now they wait
            taken = {r.message_id for r in assigned}
            self.waiting.note_waiting({r.capability for r in routed if r.message_id not in taken})
        await self.intake.acknowledge([entry_id for entry_id, _ in entries], intaken.minted)
        tracing.dispatched(intaken.envelopes, self.keys.ingress, started_ns, time.time_ns())

    # -- waiting -----------------------------------------------------------------------------

    async def _drain_loop(self) -> None:
        """Drain the capabilities whose instances just freed credits, at once; and every sweep
        interval — however busy the notifications keep this loop — refresh the registry and
        drain every capability with waiting work."""
        next_sweep = anyio.current_time()
        while True:
            with anyio.move_on_after(max(0.0, next_sweep - anyio.current_time())):
                await self._credit_freed.wait()
            self._credit_freed = anyio.Event()
            capabilities, self._to_drain = self._to_drain, set()
            try:
                if anyio.current_time() >= next_sweep:
                    next_sweep = anyio.current_time() + self.settings.sweep_interval_s
                    await self.refresh()
                    await self.claim_abandoned()
                    waiting = await self._waiting_capabilities()
                    await self.waiting.reconsider_unmatched(waiting)
                    capabilities |= set(waiting)
                await self.drain(capabilities)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("drain failed (the next sweep retries): %s", exc)
            except Exception:  # a defect: this loop is the dispatcher's clock, it never stops
                log.exception("drain failed unexpectedly (the next sweep retries)")

    async def drain(self, capabilities: Iterable[str]) -> int:
        return await self.waiting.drain(capabilities)

    async def _waiting_capabilities(self) -> list[str]:
        """The capabilities with waiting work; now and then the index is pruned of those
        with none left, and so is this dispatcher's memory of them."""
        waiting = await self.store.waiting.capabilities()
        now = anyio.current_time()
        if now < self._next_prune:
            return waiting
        self._next_prune = now + PRUNE_EVERY_S
        dropped = set(await self.store.waiting.prune_index(waiting))
        self.waiting.forget(dropped)
        return [c for c in waiting if c not in dropped]

    def _drain_soon(self, capabilities: Iterable[str]) -> None:
        self._to_drain.update(capabilities)
        self._credit_freed.set()

    # -- notifications and housekeeping ------------------------------------------------------

    async def _watch_notifications(self, *, task_status: TaskStatus[None]) -> None:
        """Credit releases wake the drain loop; registry changes refresh the snapshot. A
        notification is a hint: one that does not parse (anyone allowed to publish may send
        anything) is dropped, and the sweep does the work a lost hint would have."""
        subscriber = Subscriber(
            self.conn.url, [self.keys.credit_channel, self.keys.registry_channel]
        )
        task_status.started()
        try:
            while True:
                try:
                    message = await subscriber.next(timeout_s=1.0)
                except RedisUnavailable as exc:
                    log.warning("notifications lost, reconnecting: %s", exc)
                    await anyio.sleep(0.5)
                    continue
                if message is not None:
                    await self._notified(*message)
        finally:
            await subscriber.close()

    async def _notified(self, channel: str, data: bytes) -> None:
        if channel == self.keys.registry_channel:
            try:
                await self.refresh()
                self._to_drain.update(await self.store.waiting.capabilities())
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("registry refresh failed (the sweep retries): %s", exc)
        else:
            released = credit_release(data)
            if released is None:
                log.warning("credit notification not understood, dropped: %r", data[:80])
                return
            self._to_drain.update(self.table.credits_released(*released))
        self._credit_freed.set()

    async def _trim_loop(self) -> None:
        while True:
            await anyio.sleep(TRIM_EVERY_S)
            try:
                await trim_acknowledged(self.conn, self.keys.ingress)
            except RedisUnavailable as exc:
                log.warning("trim failed: %s", exc)


def credit_release(data: bytes) -> tuple[str, int] | None:
    """``"<instance id> <credits in use>"`` from ``lua/release.lua``, or ``None``."""
    instance_id, _, in_use = data.decode(errors="replace").partition(" ")
    if not instance_id or not in_use.isdigit() or len(in_use) > 9:
        return None
    return instance_id, int(in_use)
