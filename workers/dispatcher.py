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
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import msgspec
from anyio.abc import TaskStatus

from broker.connection import Connection, ensure_group
from broker.envelope import (
    Envelope,
    InvalidEnvelope,
    complete,
    decode_envelope,
    encode_envelope,
    salvage_id,
    salvage_reply_to,
)
from broker.errors import RedisUnavailable
from broker.ids import new_message_id
from broker.keyspace import DISPATCH_GROUP
from broker.records import AssignResult, Moved
from broker.registry import Registry
from broker.stages import Stage
from broker.store import Acceptance, MessageStore, Move, ack, now_ms, trim_acknowledged
from broker.streams import GroupReader, StreamEntry, Subscriber

from .routing_table import RoutingTable

log = logging.getLogger("agent_reach.dispatcher")

READ_BLOCK_MS = 1000
TRIM_EVERY_S = 10.0
_OK = (AssignResult.ASSIGNED, AssignResult.ALREADY_ASSIGNED)
# A waiting-set entry whose record is in one of these may still be needed: leave it.
_MAY_RETURN_TO_WAITING = frozenset({Stage.ACCEPTED, Stage.WAITING, Stage.ROUTED})


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class Routed:
    """A record that is ROUTED and must now be assigned (or go back to WAITING)."""

    message_id: str
    capability: str
    instance_id: str
    attempt: int
    priority: int
    accepted_ms: int


class Dispatcher:
    def __init__(self, conn: Connection, *, consumer: str | None = None) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.store = MessageStore(conn)
        self.registry = Registry(conn)
        self.consumer = consumer or default_consumer_name()
        self.table = RoutingTable(down_after_ms=int(self.settings.down_after_s * 1000))
        self._credit_freed = anyio.Event()
        self._to_drain: set[str] = set()

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
        entries = await reader.read(
            self.keys.ingress,
            DISPATCH_GROUP,
            self.consumer,
            count=100_000,
            block_ms=None,
            pending=True,
        )
        if entries:
            log.info("recovering %d pending ingress entries", len(entries))
            await self.handle_batch(entries, recovering=True)

    async def _ingress_loop(self, reader: GroupReader) -> None:
        backoff = 0.1
        while True:
            try:
                entries = await reader.read(
                    self.keys.ingress,
                    DISPATCH_GROUP,
                    self.consumer,
                    count=self.settings.dispatch_batch,
                    block_ms=READ_BLOCK_MS,
                )
                if entries:
                    await self.handle_batch(entries)
                backoff = 0.1
            except RedisUnavailable as exc:
                log.warning("ingress read failed, retrying in %.1fs: %s", backoff, exc)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def handle_batch(
        self, entries: Sequence[StreamEntry], *, recovering: bool = False
    ) -> None:
        """Accept, route, assign or park, then acknowledge: a few round trips per batch."""
        envelopes: list[Envelope] = []
        for _, fields in entries:
            try:
                envelopes.append(self._decode(fields))
            except InvalidEnvelope as exc:
                await self._reject(exc)
        routed = await self._accept(envelopes, recovering)
        await self._assign(routed)
        await ack(self.conn, self.keys.ingress, DISPATCH_GROUP, [e for e, _ in entries])

    def _decode(self, fields: dict[str, bytes]) -> Envelope:
        raw = fields.get("envelope")
        if raw is None:
            readable = {k: v.decode(errors="replace") for k, v in fields.items()}
            original = msgspec.json.encode(readable)
            raise InvalidEnvelope("stream entry has no `envelope` field", original)
        envelope = decode_envelope(
            raw, max_bytes=self.settings.max_envelope_bytes, reply_prefix=self.keys.reply_prefix
        )
        return complete(envelope)

    async def _accept(self, envelopes: list[Envelope], recovering: bool) -> list[Routed]:
        """Create the records, each ROUTED to a chosen instance or WAITING for a credit."""
        now = now_ms()
        acceptances = [self._plan(envelope, now) for envelope in envelopes]
        results = await self.store.accept_many(acceptances)
        routed: list[Routed] = []
        to_park: list[tuple[str, str, int, int]] = []
        for plan, result in zip(acceptances, results, strict=True):
            if not result.created:
                self.table.unreserve(plan.instance)
                if recovering:
                    await self._repair(plan.message_id)
                else:
                    log.info("message %s: duplicate submission ignored", plan.message_id)
            elif plan.next_stage is Stage.ROUTED:
                routed.append(
                    Routed(plan.message_id, plan.capability, plan.instance, 1, plan.priority, now)
                )
            else:
                to_park.append((plan.capability, plan.message_id, plan.priority, now))
        if to_park:
            await self.store.park_many(to_park)
        return routed

    def _plan(self, envelope: Envelope, now: int) -> Acceptance:
        chosen = self.table.pick(envelope.capability, now_ms=now)
        return Acceptance(
            message_id=envelope.message_id,
            envelope_json=encode_envelope(envelope),
            capability=envelope.capability,
            deadline_ms=now + int(envelope.timeout_s * 1000),
            reply_to=envelope.reply_to or "",
            priority=envelope.priority,
            next_stage=Stage.ROUTED if chosen else Stage.WAITING,
            accepted_ms=now,
            instance=chosen.instance_id if chosen else "",
            reason="least loaded" if chosen else "no free credit",
        )

    async def _assign(self, routed: list[Routed]) -> None:
        """Assign each ROUTED attempt; without a credit, move it back to WAITING and park it."""
        if not routed:
            return
        results = await self.store.assign_many(
            [(r.instance_id, r.message_id, r.attempt) for r in routed]
        )
        refused = [(r, res) for r, res in zip(routed, results, strict=True) if res not in _OK]
        moved = await self._return_to_waiting(refused)
        await self.store.park_many(
            [
                (r.capability, r.message_id, r.priority, r.accepted_ms)
                for (r, _), m in zip(refused, moved, strict=True)
                if m.ok
            ]
        )

    async def _repair(self, message_id: str) -> None:
        """Re-apply the index writes for a record's current stage (each is idempotent)."""
        record = await self.store.get_record(message_id)
        if record is None:
            return
        if record.stage is Stage.WAITING:
            await self.store.park(
                record.capability, message_id, record.priority, record.accepted_ms
            )
        elif record.stage is Stage.ROUTED:
            await self._assign(
                [
                    Routed(
                        message_id,
                        record.capability,
                        record.instance,
                        record.attempt,
                        record.priority,
                        record.accepted_ms,
                    )
                ]
            )

    async def _reject(self, exc: InvalidEnvelope) -> None:
        """Record REJECTED with the precise reason, dead-letter the original bytes, tell the
        producer where it left a usable ``reply_to``."""
        message_id = salvage_id(exc.raw) or new_message_id()
        reply_to = salvage_reply_to(exc.raw, self.keys.reply_prefix) or ""
        result = await self.store.accept(
            Acceptance(
                message_id,
                exc.raw,
                capability="",
                deadline_ms=0,
                reply_to=reply_to,
                priority=0,
                next_stage=Stage.REJECTED,
                accepted_ms=now_ms(),
                reason=exc.reason,
            )
        )
        reason = exc.reason if result.created else f"{exc.reason} (id already in use)"
        await self.store.dead_letter(
            {
                "id": message_id,
                "stage": Stage.REJECTED.value,
                "reason": reason,
                "raw": exc.raw,
                "ts": str(now_ms()),
            }
        )
        if reply_to and result.created:
            await self.store.send_reply(
                reply_to, {"id": message_id, "stage": Stage.REJECTED.value, "error": reason}
            )
        log.info("message %s rejected: %s", message_id, reason)

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
                    capabilities |= set(await self.store.waiting_capabilities())
                for capability in sorted(capabilities):
                    await self.drain(capability)
            except RedisUnavailable as exc:
                log.warning("drain failed: %s", exc)

    async def drain(self, capability: str) -> int:
        """Assign waiting messages of ``capability`` to free credits, by priority then age.

        Several dispatchers may drain the same set: the WAITING -> ROUTED compare-and-set lets
        exactly one win each message; the waiting-set entry is removed only after assignment.
        """
        now = now_ms()
        free = self.table.free_credits(capability, now_ms=now)
        if free <= 0:
            return 0
        head = await self.store.waiting_head(capability, min(free, self.settings.dispatch_batch))
        picks = []
        for message_id in head:
            chosen = self.table.pick(capability, now_ms=now)
            if chosen is None:
                break
            picks.append((message_id, chosen.instance_id))
        moved = await self.store.move_many(
            [
                Move(
                    message_id,
                    Stage.ROUTED,
                    only_from=Stage.WAITING,
                    new_attempt="+",
                    new_instance=instance_id,
                    reason="credit freed",
                )
                for message_id, instance_id in picks
            ]
        )
        won: list[Routed] = []
        stale: list[str] = []
        for (message_id, instance_id), m in zip(picks, moved, strict=True):
            if m.ok:
                won.append(Routed(message_id, capability, instance_id, m.attempt, 0, 0))
            else:
                self.table.unreserve(instance_id)
                if m.stage not in _MAY_RETURN_TO_WAITING:
                    stale.append(message_id)
        assigned = (
            await self.store.assign_many([(r.instance_id, r.message_id, r.attempt) for r in won])
            if won
            else []
        )
        done = [r for r, res in zip(won, assigned, strict=True) if res in _OK]
        await self.store.unpark_many(capability, [r.message_id for r in done] + stale)
        # Still indexed: the waiting-set entry is removed only after a successful assignment.
        await self._return_to_waiting(
            [(r, res) for r, res in zip(won, assigned, strict=True) if res not in _OK]
        )
        return len(done)

    async def _return_to_waiting(self, refused: list[tuple[Routed, AssignResult]]) -> list[Moved]:
        """The credit was gone by the time the assignment ran: ROUTED -> WAITING."""
        for r, _ in refused:
            self.table.mark_full(r.instance_id)
        if not refused:
            return []
        return await self.store.move_many(
            [
                Move(
                    r.message_id,
                    Stage.WAITING,
                    only_from=Stage.ROUTED,
                    expect_attempt=r.attempt,
                    expect_instance=r.instance_id,
                    # No stream entry exists for a refused attempt: give the number back, so
                    # `attempt` counts deliveries, not lost races for a credit.
                    new_attempt=r.attempt - 1,
                    reason=f"assignment to {r.instance_id} refused: {res.name.lower()}",
                )
                for r, res in refused
            ]
        )

    # -- notifications and housekeeping ------------------------------------------------------

    async def _watch_notifications(self, *, task_status: TaskStatus[None]) -> None:
        """Credit releases wake the drain loop; registry changes refresh the snapshot."""
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
                if message is None:
                    continue
                if message[0] == self.keys.registry_channel:
                    await self.refresh()
                    self._to_drain.update(await self.store.waiting_capabilities())
                else:
                    instance_id, _, in_use = message[1].decode().partition(" ")
                    self._to_drain.update(
                        self.table.credits_released(instance_id, int(in_use or 0))
                    )
                self._credit_freed.set()
        finally:
            await subscriber.close()

    async def _trim_loop(self) -> None:
        while True:
            await anyio.sleep(TRIM_EVERY_S)
            try:
                await trim_acknowledged(self.conn, self.keys.ingress)
            except RedisUnavailable as exc:
                log.warning("trim failed: %s", exc)
