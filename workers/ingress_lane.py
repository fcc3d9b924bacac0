"""One ingress stream's consumer in a dispatcher: read, handle a batch, acknowledge.

With ``ingress_partitions = N`` the ingress is N streams (``P:in``, ``P:in:{1}``, …, each
its own consumer group ``dispatch``) and a dispatcher runs one lane per stream, each on its own
blocking reader; the lanes share the dispatcher's routing table, credits and waiting room.
A lane's own pending entries are handled again first after a restart or a failure, entries
another dispatcher abandoned are claimed, and one entry that keeps failing is rejected with
the error (:meth:`IngressLane.handle`): no entry stops its stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import anyio

from broker import tracing
from broker.acks import ack, trim_acknowledged
from broker.config import Settings
from broker.connection import Connection
from broker.entries import IngressEntry, parse_ingress
from broker.errors import RedisReplyError, RedisUnavailable
from broker.idle_claims import IdleClaim
from broker.keyspace import DISPATCH_GROUP
from broker.streams import GroupReader, RawEntry, raw_entries

from .admission import Admission
from .assignment import Assigner
from .intake import Intake
from .intent_resolver import IntentResolver
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.dispatcher")

READ_BLOCK_MS = 1000
# batches of abandoned entries (ingress_batch each, as a read) a sweep takes over at most:
# the sweep is the dispatcher's clock, and drains wait for it
CLAIM_BATCHES = 32
MAX_ENTRY_FAILURES = 3  # an entry failing this often on its own is rejected with the error


class IngressLane:
    def __init__(
        self,
        conn: Connection,
        stream: str,
        consumer: str,
        *,
        intake: Intake,
        admission: Admission,
        assigner: Assigner,
        waiting: WaitingRoom,
        intents: IntentResolver,
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.consumer = consumer
        self.settings: Settings = conn.settings
        self.intake = intake
        self.admission = admission
        self.assigner = assigner
        self.waiting = waiting
        self.intents = intents
        self.abandoned = IdleClaim(conn, stream, DISPATCH_GROUP, consumer)

    async def recover(self, reader: GroupReader) -> None:
        """Re-handle this consumer's own pending entries: a restart after a crash mid-batch."""
        entries = await reader.read_raw(
            self.stream,
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
        did not come back under its name): ``XAUTOCLAIM`` after ``claim_idle_s``, a batch of
        ``ingress_batch`` at a time, up to :data:`CLAIM_BATCHES` a sweep (the next goes on
        from there). Handling an entry twice is harmless: a record is created once per id."""
        idle_ms = int(self.settings.claim_idle_s * 1000)
        taken = 0
        async for claimed in self.abandoned.sweep(
            idle_ms, self.settings.ingress_batch, CLAIM_BATCHES
        ):
            if entries := raw_entries(claimed.entries):
                await self._handle(entries, recovering=True)
                taken += len(entries)
            if claimed.gone:  # deleted while pending (Redis 6.2)
                await ack(
                    self.conn, self.stream, DISPATCH_GROUP, [g.decode() for g in claimed.gone]
                )
        if taken:
            log.info("claimed %d ingress entries abandoned by another dispatcher", taken)
        return taken

    async def consume(self, reader: GroupReader) -> None:
        backoff = 0.1
        while True:
            try:
                if backoff > 0.1:  # after a failure: first finish what this consumer holds
                    await self.recover(reader)
                entries = await reader.read_raw(
                    self.stream,
                    DISPATCH_GROUP,
                    self.consumer,
                    count=self.settings.ingress_batch,
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
        except Exception as exc:
            if for_every_entry(exc):
                raise
            log.exception("a batch of %d ingress entries failed: one at a time", len(entries))
        for entry in entries:
            await self._handle_alone(entry)

    async def _handle_alone(self, entry: RawEntry) -> None:
        for failures in range(1, MAX_ENTRY_FAILURES + 1):
            try:
                await self.handle_batch([entry], recovering=True)
                return
            except Exception as exc:
                if for_every_entry(exc):
                    raise
                if failures == MAX_ENTRY_FAILURES:
                    await self._set_aside(entry, exc)
                else:
                    log.warning("ingress entry %s failed (%d): %s", entry[0], failures, exc)

    async def _set_aside(self, entry: RawEntry, exc: Exception) -> None:
        """An entry that failed on its own every time: REJECTED with the error — unless its
        message was accepted before the failure (a later write of its batch refused, a key
        the whole capability shares that someone spoiled, say). That message lives, indexed
        for the reaper's look: it is left to it, not refused under its own id."""
        entry_id, flat = entry
        reason = f"the dispatcher could not handle it: {type(exc).__name__}: {exc}"
        names, minted = await self.intake.names([entry_id], recovering=True)
        parsed = parse_ingress(entry_id, flat)
        raw = parsed.envelope if isinstance(parsed, IngressEntry) else parsed.raw
        rejection = self.intake.rejection(entry_id, names[entry_id], reason, raw)
        if await self._accepted(rejection.message_id):
            log.error(
                "ingress entry %s failed %d times after message %s was accepted: left to the "
                "reaper (%s)",
                entry_id,
                MAX_ENTRY_FAILURES,
                rejection.message_id,
                exc,
            )
        else:
            log.error("ingress entry %s failed %d times; rejected", entry_id, MAX_ENTRY_FAILURES)
            await self.intake.reject([rejection])
        await self.intake.acknowledge([entry_id], minted)

    async def _accepted(self, message_id: str) -> bool:
        """Whether ``message_id`` has a record (a key of another type is none: spoiled)."""
        try:
            stage = await self.conn.call("HGET", self.conn.keys.record(message_id), "stage")
        except RedisReplyError:
            return False
        return stage is not None

    async def handle_batch(self, entries: Sequence[RawEntry], *, recovering: bool = False) -> None:
        """Take in, map intents to capabilities, accept, route, assign or park, then
        acknowledge: a few round trips per batch, whatever the entries hold
        (:mod:`workers.intake`, :mod:`workers.intent_resolver`). The deadline entries go
        with the assignments (or the parks, when there are any), and the assignment counters
        with the acknowledgement, which comes last."""
        started_ns = time.time_ns()
        intaken = await self.intake.take(entries, recovering=recovering)
        resolved = await self.intents.resolve(intaken.envelopes, self.intake)
        admitted = await self.admission.admit(resolved.envelopes, resolved.decisions)
        routed = admitted.routed
        assigned = await self.assigner.assign(routed, ahead=admitted.due, known=admitted.assigned)
        if len(assigned.routed) < len(routed):  # refused for want of a credit: now they wait
            taken = {r.message_id for r in assigned.routed}
            self.waiting.note_waiting({r.capability for r in routed if r.message_id not in taken})
        await self.intake.acknowledge(
            [entry_id for entry_id, _ in entries], intaken.minted, after=assigned.after
        )
        tracing.dispatched(intaken.envelopes, self.stream, started_ns, time.time_ns())

    async def trim(self) -> None:
        await trim_acknowledged(self.conn, self.stream)


# Redis refusing this process, not an entry: every entry would fail alike, so none is set
# aside for it; the lane waits, saying so, until Redis or its user's rules are put right.
_PROCESS_REFUSED = frozenset({"NOPERM", "NOAUTH", "WRONGPASS", "NOSCRIPT"})


def for_every_entry(exc: Exception) -> bool:
    """Whether a batch's failure is one every entry would meet (Redis away, or refusing this
    process), not one of its entries' own: a key an entry names that someone made of
    another type (any writer of records can) failed the batch with WRONGTYPE, again at every
    try, and the lane read nothing more."""
    if isinstance(exc, RedisUnavailable):
        return True
    return isinstance(exc, RedisReplyError) and exc.code in _PROCESS_REFUSED
