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
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus
from redis.exceptions import ResponseError

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
from broker.ids import ulid_for_entry
from broker.keyspace import DISPATCH_GROUP
from broker.registry import Registry
from broker.routing import Decision
from broker.stages import Stage
from broker.store import Acceptance, MessageStore, ack, now_ms, trim_acknowledged
from broker.streams import GroupReader, StreamEntry, Subscriber, parse_entries
from broker.webhooks import callback_problem

from .assignment import Assigner, Routed, decision_fields, route_request, routed_instance
from .routing_table import RoutingTable, routing_policy
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.dispatcher")

READ_BLOCK_MS = 1000
TRIM_EVERY_S = 10.0
BEHIND_WAITING = "queued behind waiting work of its capability"


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
        entries = parse_entries(reply[1])
        if entries:
            log.info("claimed %d ingress entries abandoned by another dispatcher", len(entries))
            await self.handle_batch(entries, recovering=True)
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
            except (RedisUnavailable, ResponseError) as exc:
                backoff = min(backoff * 2, 5.0)
                log.warning("ingress failed, retrying in %.1fs: %s", backoff, exc)
                await anyio.sleep(backoff)

    async def handle_batch(
        self, entries: Sequence[StreamEntry], *, recovering: bool = False
    ) -> None:
        """Accept, route, assign or park, then acknowledge: a few round trips per batch."""
        envelopes: list[Envelope] = []
        for entry_id, fields in entries:
            fallback_id = ulid_for_entry(self.keys.ingress, entry_id)
            try:
                envelopes.append(self._decode(fields, fallback_id))
            except InvalidEnvelope as exc:
                await self._reject(exc, fallback_id)
        routed = await self._accept(envelopes, recovering)
        assigned = await self.assigner.assign(routed)
        if len(assigned) < len(routed):  # refused for want of a credit: now they wait
            taken = {r.message_id for r in assigned}
            self.waiting.note_waiting({r.capability for r in routed if r.message_id not in taken})
        await ack(self.conn, self.keys.ingress, DISPATCH_GROUP, [e for e, _ in entries])

    def _decode(self, fields: dict[str, bytes], fallback_id: str) -> Envelope:
        raw = fields.get("envelope")
        if raw is None:
            readable = {k: v.decode(errors="replace") for k, v in fields.items()}
            original = msgspec.json.encode(readable)
            raise InvalidEnvelope("stream entry has no `envelope` field", original)
        envelope = decode_envelope(
            raw, max_bytes=self.settings.max_envelope_bytes, reply_prefix=self.keys.reply_prefix
        )
        if envelope.parent is not None:
            raise InvalidEnvelope("invalid envelope: `parent` is set by the broker only", raw)
        if envelope.callback_url is not None and (
            problem := callback_problem(
                envelope.callback_url, self.settings.callback_hosts, self.settings.webhook_secret
            )
        ):
            raise InvalidEnvelope(problem, raw)
        if envelope.id is None:
            envelope = msgspec.structs.replace(envelope, id=fallback_id)
        return complete(envelope)

    async def _accept(self, envelopes: list[Envelope], recovering: bool) -> list[Routed]:
        """Route each envelope and create its record, ROUTED or WAITING: one round trip for
        the records (plus one for the sessions the batch names)."""
        now = now_ms()
        sessions = await self.store.sessions(
            sorted({e.session_id for e in envelopes if e.session_id})
        )
        plans = [self._plan(envelope, now, sessions) for envelope in envelopes]
        reaper_look = now + int(self.settings.delivery_timeout_s * 1000)
        results = await self.store.accept_many([a for a, _ in plans])
        routed: list[Routed] = []
        to_park: list[tuple[str, str, int, int]] = []
        bindings: list[tuple[str, str]] = []
        due: list[tuple[Any, ...]] = []
        for (plan, envelope), result in zip(plans, results, strict=True):
            if not result.created:
                self.table.unreserve(plan.instance)
                # A redelivery after a crash, or a producer's retry: not run again, but the
                # index writes for the record's stage are re-applied (each is idempotent).
                await self._repair(plan.message_id)
                continue
            # the reaper's first look: when a delivery would be late, or the deadline
            due.append(self.store.due_command(plan.message_id, min(plan.deadline_ms, reaper_look)))
            if plan.next_stage is Stage.ROUTED:
                routed.append(
                    Routed(plan.message_id, plan.capability, plan.instance, 1, plan.priority, now)
                )
                if envelope.session_id:
                    bindings.append((envelope.session_id, plan.instance))
            else:
                to_park.append((plan.capability, plan.message_id, plan.priority, now))
        # the batch's index writes (deadlines, waiting sets, sessions) in one round trip
        await self.store.run_all(
            due + self.store.park_commands(to_park) + self.store.bind_session_commands(bindings)
        )
        if to_park:
            parked = {capability for capability, *_ in to_park}
            self.waiting.note_waiting(parked)
            self._drain_soon(parked)  # at once if credits are free: behind earlier work
        return routed

    def _plan(
        self, envelope: Envelope, now: int, sessions: dict[str, str]
    ) -> tuple[Acceptance, Envelope]:
        if envelope.capability in self.waiting.backlogged:
            decision: Decision | None = None  # earlier work waits: this one queues behind it
            instance = None
        else:
            decision = self.table.decide(route_request(envelope, sessions), now_ms=now)
            instance = routed_instance(decision)
        if instance and envelope.session_id:
            sessions[envelope.session_id] = instance  # later messages of the batch follow it
        acceptance = Acceptance(
            message_id=envelope.message_id,
            envelope_json=encode_envelope(envelope),
            capability=envelope.capability,
            deadline_ms=now + int(envelope.timeout_s * 1000),
            reply_to=envelope.reply_to or "",
            priority=envelope.priority,
            next_stage=Stage.ROUTED if instance else Stage.WAITING,
            accepted_ms=now,
            instance=instance or "",
            reason=decision.reason if decision else BEHIND_WAITING,
            fields=decision_fields(decision) if decision else {},
        )
        return acceptance, envelope

    async def _repair(self, message_id: str) -> None:
        """Re-apply the index writes for a record's current stage (each is idempotent)."""
        record = await self.store.get_record(message_id)
        if record is None:
            return
        await self.conn.call(*self.store.due_command(message_id, record.deadline_ms))
        if record.stage is Stage.WAITING:
            await self.store.park(
                record.capability, message_id, record.priority, record.accepted_ms
            )
        elif record.stage is Stage.ROUTED:
            await self.assigner.assign(
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

    async def _reject(self, exc: InvalidEnvelope, fallback_id: str) -> None:
        """Record REJECTED with the precise reason, dead-letter the original bytes, tell the
        producer where it left a usable ``reply_to``."""
        message_id = salvage_id(exc.raw) or fallback_id
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
                    await self.claim_abandoned()
                    waiting = await self.store.waiting_capabilities()
                    await self.waiting.reconsider_unmatched(waiting)
                    capabilities |= set(waiting)
                await self.drain(capabilities)
            except (RedisUnavailable, ResponseError) as exc:
                log.warning("drain failed (the next sweep retries): %s", exc)

    async def drain(self, capabilities: Iterable[str]) -> int:
        return await self.waiting.drain(capabilities)

    def _drain_soon(self, capabilities: Iterable[str]) -> None:
        self._to_drain.update(capabilities)
        self._credit_freed.set()

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
                    try:
                        await self.refresh()
                        self._to_drain.update(await self.store.waiting_capabilities())
                    except (RedisUnavailable, ResponseError) as exc:
                        log.warning("registry refresh failed (the sweep retries): %s", exc)
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
