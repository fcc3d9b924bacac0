"""A sidecar's intake: reading its instance's stream and taking what it holds.

Entries are read in batches (at start, first this instance's own pending list: a restart
finishes what it had taken). A batch is taken in two round trips whatever its size:
RECEIVED for every entry whose record is ROUTED here at its attempt (the fence: a stale
delivery is never executed), then PROCESSING — written before the request leaves for the
agent — for those received; then each goes to the work pool. An entry that is not an
assignment (someone else wrote to the stream) is dead-lettered and acknowledged.
"""

from __future__ import annotations

import logging
from functools import partial

import anyio

from broker import failpoints
from broker.connection import Connection
from broker.deadletters import Letter
from broker.delivery import dead_letter_commands
from broker.entries import fields_as_bytes, parse_assignment
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import SIDECAR_GROUP
from broker.stages import Stage
from broker.store import MessageStore
from broker.streams import GroupReader, StreamEntry, field_bytes
from broker.timekeeping import now_ms

from .callback_desk import CallbackDesk
from .finisher import Finisher
from .holdings import Holdings, Taken
from .runner import NOT_AWAITING, Runner
from .workpool import WorkPool

log = logging.getLogger("agent_reach.sidecar")

READ_BLOCK_MS = 1000
PENDING_AT_ONCE = 100_000


class SidecarIntake:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        instance_id: str,
        *,
        holdings: Holdings,
        finisher: Finisher,
        runner: Runner,
        desk: CallbackDesk | None,
    ) -> None:
        self.conn = conn
        self.store = store
        self.instance_id = instance_id
        self.queue = conn.keys.queue(instance_id)
        self.holdings = holdings
        self.finisher = finisher
        self.runner = runner
        self.desk = desk

    async def read(self, reader: GroupReader, *, pending: bool = False) -> list[StreamEntry]:
        """New entries, or (at start) this instance's own pending list: a restart after a crash
        first finishes what it had taken."""
        entries = await reader.read(
            self.queue,
            SIDECAR_GROUP,
            self.instance_id,
            count=PENDING_AT_ONCE if pending else self.conn.settings.sidecar_batch,
            block_ms=None if pending else READ_BLOCK_MS,
            pending=pending,
        )
        if pending and entries:
            log.info("resuming %d pending entries", len(entries))
        return entries

    async def consume(self, reader: GroupReader, pool: WorkPool, stopping: anyio.Event) -> None:
        """Read and take until the sidecar stops; after a failure (or a slipped hold), first
        take again what fell through the cracks of the pending list."""
        backoff = 0.1
        while not stopping.is_set():
            try:
                if self.holdings.recheck_pending:
                    self.holdings.recheck_pending = False
                    pending = await self.read(reader, pending=True)
                    await self.take(pool, [e for e in pending if e[0] not in self.holdings.held])
                await self.take(pool, await self.read(reader))
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("read failed, retrying in %.1fs: %s", backoff, exc)
                self.holdings.recheck_pending = True
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1

    async def take(self, pool: WorkPool, entries: list[StreamEntry]) -> None:
        """RECEIVED for a whole batch in one round trip, PROCESSING (write-ahead) for those
        received in a second, then one job per message in the pool."""
        if not entries:
            return
        parsed = [(entry_id, f, parse_assignment(entry_id, f)) for entry_id, f in entries]
        await self._drop_malformed([(e, f, why) for e, f, why in parsed if isinstance(why, str)])
        taken = [t for _, _, t in parsed if isinstance(t, Taken)]
        if not taken:
            return
        fenced = self.finisher.fenced
        received = await self.store.move_many(
            [fenced(t, Stage.RECEIVED, Stage.ROUTED, return_field="envelope") for t in taken]
        )
        failpoints.hit("sidecar.after_received")
        fresh = [(t, m.value) for t, m in zip(taken, received, strict=True) if m.ok and m.value]
        moves = [fenced(t, Stage.PROCESSING, Stage.RECEIVED, fields=NOT_AWAITING) for t, _ in fresh]
        processing = await self.store.move_many(moves) if fresh else []
        failpoints.hit("sidecar.after_processing")
        ready = {t.entry_id: (v, p.ok) for (t, v), p in zip(fresh, processing, strict=True)}
        for t, m in zip(taken, received, strict=True):
            if self.desk is not None:
                self.desk.supersede(t)
            self.holdings.take(t)
            if t.entry_id not in ready:
                pool.submit(partial(self.runner.guarded, t, partial(self.runner.resume, t, m)))
            elif ready[t.entry_id][1]:
                stored = ready[t.entry_id][0]
                step = partial(self.runner.run_stored, t, stored, m.accepted_ms)
                pool.submit(partial(self.runner.guarded, t, step))
            else:
                self.finisher.done(t)  # lost the PROCESSING race: someone else owns it now

    async def _drop_malformed(self, malformed: list[tuple[str, dict[str, bytes], str]]) -> None:
        """Entries that are not assignments (someone else wrote to this stream): each is
        dead-lettered with its bytes and why, and acknowledged. Nothing runs; no credit was
        taken for it (only ``lua/assign.lua`` takes credits)."""
        if not malformed:
            return
        letters = [
            command
            for entry_id, fields, why in malformed
            for command in dead_letter_commands(
                self.store.conn,
                Letter(
                    id="",
                    reason=f"malformed_entry: {why}",
                    raw=fields_as_bytes((field_bytes(k), v) for k, v in fields.items()),
                    source=f"{self.queue} {entry_id}",
                    ts_ms=now_ms(),
                ),
            )
        ]
        ack = ("XACK", self.queue, SIDECAR_GROUP, *(entry_id for entry_id, _, _ in malformed))
        await self.store.conn.run_all([*letters, ack])
        log.warning("dropped %d malformed entries from %s", len(malformed), self.queue)
