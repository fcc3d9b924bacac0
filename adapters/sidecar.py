"""The sidecar: one per agent instance. It registers the instance, heartbeats, consumes the
instance's stream and walks each message through RECEIVED -> PROCESSING -> outcome.

PROCESSING is written before the request leaves for the agent (write-ahead), so a crash
between RECEIVED and PROCESSING is always safe to redeliver, and a crash after PROCESSING is
resolved only where that is safe: an idempotent agent is called again with the same
idempotency key, any other parks as NEEDS_CONFIRMATION for an operator. A stream entry whose
attempt or instance is no longer the record's current one is dropped, never executed.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from broker import failpoints
from broker.connection import Connection, ensure_group
from broker.deadletters import Letter
from broker.entries import Assignment, fields_as_bytes, parse_assignment
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import SIDECAR_GROUP
from broker.records import InstanceCard, InstanceState, MessageRecord, Moved
from broker.registry import Registry
from broker.results import Command
from broker.retry import retry_delay_ms
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore, Move, now_ms, trim_acknowledged
from broker.streams import GroupReader, StreamEntry, field_bytes, parse_entries
from broker.timeline import note_command

from .asgi import serve_app
from .callbacks import Answer, CallbackTokens, callback_app
from .outcome import Accepted, Ambiguous, Backoff, Failed, NotReached, Outcome, Succeeded
from .status import StatusClient
from .transport import Transport
from .vitals import Vitals
from .workpool import WorkPool

log = logging.getLogger("agent_reach.sidecar")

READ_BLOCK_MS = 1000
# An entry whose handling raised this many times in a row is let go of (see _give_up).
MAX_INTERNAL_ERRORS = 3
SIDECAR_ERROR = "SIDECAR_ERROR"
# an entry taken again from this instance's pending list: after a restart, or a try that
# failed inside the sidecar
RESUMED = "resumed from this instance's pending entries"
OVERDUE_CHECK_S = 0.1


class Sidecar:
    def __init__(
        self,
        conn: Connection,
        card: InstanceCard,
        transport: Transport,
        *,
        grace_s: float = 40.0,
        adaptive_credits: bool = True,
        callback_host: str = "127.0.0.1",
        callback_port: int = 0,
        callback_public_url: str | None = None,
    ) -> None:
        self.conn = conn
        self.card = card
        self.transport = transport
        self.grace_s = grace_s
        self.store = MessageStore(conn)
        self.registry = Registry(conn)
        self.instance_id = card.instance_id
        self.queue = conn.keys.queue(card.instance_id)
        self._stopping = anyio.Event()
        self._finished: list[Finished] = []
        self.stopped = anyio.Event()
        self._finished_ready = anyio.Event()
        self._beat_now = anyio.Event()
        self._pool: WorkPool | None = None
        # Entries this process has taken and not yet released: after a failure, the pending
        # list minus these is what fell through the cracks and must be taken again.
        self._held: set[str] = set()
        self._recheck_pending = False
        # Calls to the agent now running: entry id -> start (monotonic); and those already
        # counted as overdue by the credit limit.
        self._calls: dict[str, float] = {}
        self._overdue_counted: set[str] = set()
        self._rng = random.Random()
        self._errors: dict[str, int] = {}  # entry id -> unexpected errors handling it
        self._status = StatusClient()
        # Async agents answer by callback: the entries held for them (by message id), those
        # waiting for their callback (and since when), and those a callback is finishing.
        self._wants_callbacks = bool(getattr(transport, "wants_callbacks", False))
        self._callback_bind = (callback_host, callback_port, callback_public_url)
        self._tokens: CallbackTokens | None = None
        self.callback_url = ""
        self._by_message: dict[str, Taken] = {}
        self._awaiting: dict[str, float] = {}
        self._finishing: set[str] = set()
        self.vitals = Vitals(
            conn.settings,
            credits=card.max_inflight,
            now_ms=now_ms(),
            # an async agent's latency is its callback's: minutes, not a congestion signal
            adaptive=adaptive_credits and not self._wants_callbacks,
        )

    def stop(self) -> None:
        """Begin a graceful stop: no new reads, finish in-flight work, then deregister."""
        self._stopping.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await ensure_group(self.conn, self.queue, SIDECAR_GROUP)
        await self.registry.register(self.card, credits=self.card.max_inflight)
        log.info(
            "instance %s registered for %s", self.instance_id, ",".join(self.card.capabilities)
        )
        try:
            async with self.conn.reader() as reader, anyio.create_task_group() as outer:
                outer.start_soon(self._heartbeat_loop)
                outer.start_soon(self._finish_loop)
                outer.start_soon(self._overdue_loop)
                if self._wants_callbacks:
                    await outer.start(self._serve_callbacks)
                    outer.start_soon(self._watch_callbacks)
                task_status.started()
                async with anyio.create_task_group() as work:
                    pool = self._pool = WorkPool(work, self.card.max_inflight)
                    await self._take(pool, await self._read(reader, pending=True))
                    await self._consume(reader, pool)
                    await self._wait_idle(pool, work)
                await self._finish_now()
                outer.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._status.aclose()
        await self.registry.deregister(self.instance_id)
        log.info("instance %s deregistered", self.instance_id)
        self.stopped.set()

    # -- the loops -------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Heartbeat every interval, or at once when the circuit or cooldown changed; follow
        an operator's DRAINING; re-register if the card vanished."""
        trim_every = 12
        beats = 0
        while True:
            with anyio.move_on_after(self.conn.settings.heartbeat_s):
                await self._beat_now.wait()
            self._beat_now = anyio.Event()
            try:
                await self._beat()
                beats += 1
                if beats % trim_every == 0:
                    await trim_acknowledged(self.conn, self.queue)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _overdue_loop(self) -> None:
        """Let the credit limit see a slowdown before the first slow answer arrives."""
        while True:
            await anyio.sleep(OVERDUE_CHECK_S)
            now = anyio.current_time()
            running = [
                (e, now - t) for e, t in self._calls.items() if e not in self._overdue_counted
            ]
            if not running:
                continue
            before = self.vitals.effective_credits
            counted = self.vitals.overdue([age * 1000 for _, age in running])
            self._overdue_counted.update(e for (e, _), c in zip(running, counted, strict=True) if c)
            if self.vitals.effective_credits != before:
                self._beat_now.set()

    async def _beat(self) -> None:
        active = self._pool.unfinished if self._pool is not None else 0
        beat_ms = now_ms()
        state, stats, announce = self.vitals.beat(beat_ms, active=active)
        if self._stopping.is_set():
            state = InstanceState.DRAINING
        on_card = await self.registry.heartbeat(
            self.instance_id,
            state,
            stats,
            announce=announce,
            hb_ms=beat_ms,
            credits=self.vitals.effective_credits,
        )
        # The very time written on the card, which is what observers compare against.
        self.vitals.beat_delivered(beat_ms)
        if on_card is None and not self._stopping.is_set():
            log.warning("instance %s was not registered: registering again", self.instance_id)
            await self.registry.register(self.card, credits=self.card.max_inflight)
        elif on_card is InstanceState.DRAINING and not self._stopping.is_set():
            log.info("instance %s set DRAINING: finishing in-flight work", self.instance_id)
            self.stop()

    async def _read(self, reader: GroupReader, *, pending: bool = False) -> list[StreamEntry]:
        """New entries, or (at start) this instance's own pending list: a restart after a crash
        first finishes what it had taken."""
        entries = await reader.read(
            self.queue,
            SIDECAR_GROUP,
            self.instance_id,
            count=100_000 if pending else self.conn.settings.sidecar_batch,
            block_ms=None if pending else READ_BLOCK_MS,
            pending=pending,
        )
        if pending and entries:
            log.info("resuming %d pending entries", len(entries))
        return entries

    async def _consume(self, reader: GroupReader, pool: WorkPool) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                if self._recheck_pending:
                    self._recheck_pending = False
                    pending = await self._read(reader, pending=True)
                    await self._take(pool, [e for e in pending if e[0] not in self._held])
                entries = await self._read(reader)
                await self._take(pool, entries)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("read failed, retrying in %.1fs: %s", backoff, exc)
                self._recheck_pending = True
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1

    async def _take(self, pool: WorkPool, entries: list[StreamEntry]) -> None:
        """RECEIVED for a whole batch in one round trip, PROCESSING (write-ahead) for those
        received in a second, then one task per message to call the agent."""
        if not entries:
            return
        parsed = [(entry_id, f, parse_assignment(entry_id, f)) for entry_id, f in entries]
        await self._drop_malformed([(e, f, why) for e, f, why in parsed if isinstance(why, str)])
        taken = [t for _, _, t in parsed if isinstance(t, Taken)]
        if not taken:
            return
        received = await self.store.move_many(
            [self._fenced(t, Stage.RECEIVED, Stage.ROUTED, return_field="envelope") for t in taken]
        )
        failpoints.hit("sidecar.after_received")
        fresh = [(t, m.value) for t, m in zip(taken, received, strict=True) if m.ok and m.value]
        processing = (
            await self.store.move_many(
                [
                    self._fenced(t, Stage.PROCESSING, Stage.RECEIVED, fields=_NOT_AWAITING)
                    for t, _ in fresh
                ]
            )
            if fresh
            else []
        )
        failpoints.hit("sidecar.after_processing")
        ready = {t.entry_id: (v, p.ok) for (t, v), p in zip(fresh, processing, strict=True)}
        for t, m in zip(taken, received, strict=True):
            self._held.add(t.entry_id)
            self._supersede(t)
            self._by_message[t.message_id] = t
            if t.entry_id not in ready:
                pool.submit(partial(self._guarded, t, partial(self._resume, t, m)))
            elif ready[t.entry_id][1]:
                stored = ready[t.entry_id][0]
                pool.submit(partial(self._guarded, t, partial(self._call_stored, t, stored)))
            else:
                self._done(t)  # lost the PROCESSING race: someone else owns the record now

    async def _drop_malformed(self, malformed: list[tuple[str, dict[str, bytes], str]]) -> None:
        """Entries that are not assignments (someone else wrote to this stream): each is
        dead-lettered with its bytes and why, and acknowledged. Nothing runs; no credit was
        taken for it (only ``lua/assign.lua`` takes credits)."""
        if not malformed:
            return
        letters = [
            self.store.dead_letter_command(
                Letter(
                    id="",
                    reason=f"malformed_entry: {why}",
                    raw=fields_as_bytes((field_bytes(k), v) for k, v in fields.items()),
                    source=f"{self.queue} {entry_id}",
                    ts_ms=now_ms(),
                )
            )
            for entry_id, fields, why in malformed
        ]
        ack = ("XACK", self.queue, SIDECAR_GROUP, *(entry_id for entry_id, _, _ in malformed))
        await self.store.run_all([*letters, ack])
        log.warning("dropped %d malformed entries from %s", len(malformed), self.queue)

    def _supersede(self, taken: Taken) -> None:
        """A new attempt of a message this sidecar still awaits a callback for (the reaper
        retried it here): the old attempt's entry and credit are let go of now — its callback
        can no longer settle it — not left held until a restart."""
        old = self._by_message.get(taken.message_id)
        if old is not None and old != taken and taken.message_id in self._awaiting:
            del self._awaiting[taken.message_id]
            self._done(old)

    async def _wait_idle(self, pool: WorkPool, work: TaskGroup) -> None:
        """DRAINING: no new assignments; reroute what was assigned but never read; give
        in-flight work the grace period, then cancel what is left (it stays pending)."""
        await self.registry.set_state(self.instance_id, InstanceState.DRAINING)
        await self._reroute_unread()
        pool.close()
        with anyio.move_on_after(self.grace_s):
            await pool.join()
            # callbacks still to come in: polled, a drain is rare and lasts seconds
            while self._awaiting or self._finishing:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        work.cancel_scope.cancel()

    async def _reroute_unread(self) -> None:
        """Entries assigned to this instance but never delivered to it go back to WAITING, so
        another instance takes them; their credits here are returned."""
        groups = await self.conn.call("XINFO", "GROUPS", self.queue)
        info = dict(zip(groups[0][::2], groups[0][1::2], strict=True)) if groups else {}
        after = b"(" + info.get(b"last-delivered-id", b"0-0")
        unread = await self.conn.call("XRANGE", self.queue, after, "+")
        returned = []
        for entry_id, fields in parse_entries(unread):
            taken = parse_assignment(entry_id, fields)
            if isinstance(taken, str):
                continue  # not an assignment: no credit to return; left for the trim
            record = await self.store.get_record(taken.message_id)
            moved = await self.store.apply(
                self._fenced(taken, Stage.WAITING, Stage.ROUTED, reason="instance draining")
            )
            if moved.ok and record is not None:
                await self.store.park(
                    record.capability, record.id, record.priority, record.accepted_ms
                )
            returned.append((f"{taken.message_id}:{taken.attempt}", taken.entry_id))
        if returned:
            log.info("rerouting %d unread entries", len(returned))
            await self.conn.call(
                *self.store.release_command(self.instance_id, SIDECAR_GROUP, returned)
            )

    async def _finish_loop(self) -> None:
        while True:
            await self._finished_ready.wait()
            self._finished_ready = anyio.Event()
            try:
                await self._finish_now()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("release failed, retrying: %s", exc)
                await anyio.sleep(0.5)
                self._finished_ready.set()

    async def _finish_now(self) -> None:
        """Settle every finished entry in a few round trips: record the outcomes, deliver the
        replies of those recorded, then return the credits and acknowledge. Replies go before
        the acknowledgement, so a crash in between re-sends a reply, never skips one."""
        batch, self._finished = self._finished, []
        if not batch:
            return
        try:
            settles = [item for item in batch if item.settle is not None]
            moved = await self.store.move_many([item.settle for item in settles])  # type: ignore[misc]
            recorded = {
                id(item) for item, m in zip(settles, moved, strict=True) if self._recorded(item, m)
            }
            replying = [
                (item.taken.message_id, command)
                for item in batch
                if item.settle is None or id(item) in recorded
                for command in item.replies
            ]
            commands = [command for _, command in replying]
            replies = await self.conn.call_many(commands)
            await self.store.after_delivery([m for m, _ in replying], commands, replies)
            release = self.store.release_command(
                self.instance_id,
                SIDECAR_GROUP,
                [(f"{i.taken.message_id}:{i.taken.attempt}", i.taken.entry_id) for i in batch],
            )
            await self.conn.call(*release)
        except Exception:
            # anything that stopped the round trip: the batch is finished again next time
            self._finished = batch + self._finished
            raise
        self._held.difference_update(item.taken.entry_id for item in batch)
        for item in batch:
            self._forget(item.taken)
            self._errors.pop(item.taken.entry_id, None)  # let go of: its count goes too

    def _forget(self, taken: Taken) -> None:
        if self._by_message.get(taken.message_id) == taken:
            del self._by_message[taken.message_id]
        self._finishing.discard(taken.message_id)

    def _recorded(self, item: Finished, moved: Moved) -> bool:
        """The outcome is on the record: written now, or by an earlier try of this batch."""
        assert item.settle is not None
        return moved.ok or (
            moved.stage is item.settle.target
            and moved.attempt == item.taken.attempt
            and moved.instance == self.instance_id
        )

    # -- async agents: callbacks -----------------------------------------------------------

    async def _serve_callbacks(self, *, task_status: TaskStatus[None]) -> None:
        """The callback endpoint, on an ASGI server, for as long as the sidecar runs."""
        key = self.conn.keys.callback_key(self.instance_id)
        await self.conn.call("SET", key, secrets.token_hex(32), "NX")
        self._tokens = CallbackTokens(await self.conn.call("GET", key))
        host, port, public_url = self._callback_bind
        settings = self.conn.settings
        app = callback_app(
            self.authorize_callback,
            self.on_callback,
            max_bytes=settings.max_callback_bytes,
            body_timeout_s=settings.callback_body_timeout_s,
        )
        async with serve_app(
            app,
            host,
            port,
            header_timeout_s=settings.callback_header_timeout_s,
            max_connections=settings.callback_max_connections,
        ) as url:
            self.callback_url = (public_url or url).rstrip("/")
            self.transport.bind_callbacks(self.callback_url, self._tokens)  # type: ignore[attr-defined]
            log.info("instance %s takes callbacks at %s", self.instance_id, self.callback_url)
            task_status.started()
            await anyio.sleep_forever()

    async def _await_callback(self, taken: Taken, task_id: str) -> None:
        """The agent took the work (202): it stays PROCESSING, its credit held, until the
        callback comes (or the reaper, asking the status endpoint, settles it)."""
        since = anyio.current_time()
        reason = "accepted by the agent (202)" + (f", task {task_id}" if task_id else "")
        moved = await self.store.apply(
            self._fenced(
                taken,
                Stage.PROCESSING,
                Stage.PROCESSING,
                reason=f"{reason}; awaiting its callback",
                fields={"awaiting_callback": 1, "agent_task": task_id},
            )
        )
        if moved.ok and taken.message_id not in self._finishing:
            self._awaiting[taken.message_id] = since
        elif not moved.ok and moved.stage is not Stage.CALLBACK_RECEIVED:
            self._done(taken)  # settled meanwhile by someone else: let go of it
        # CALLBACK_RECEIVED: the callback beat the 202 here, and is finishing it

    async def authorize_callback(self, message_id: str, token: str) -> Answer | None:
        """The token's check, before a body is read: a token made here for this id (a bare
        hex one of an earlier version is checked against the record's attempts)."""
        assert self._tokens is not None
        latest = 0
        if "." not in token:  # bare hex: which attempts it may be for, the record says
            record = await self.store.get_record(message_id)
            latest = record.attempt if record is not None else 0
        if self._tokens.attempt_of(token, message_id, latest) is None:
            return Answer(401, {"error": "callback token does not match"})
        return None

    async def on_callback(self, message_id: str, token: str, outcome: Succeeded | Failed) -> Answer:
        """An agent's callback: checked against the token and the record, then recorded
        (CALLBACK_RECEIVED, write-ahead) before it is answered; the outcome follows."""
        record = await self.store.get_record(message_id)
        checked = self._check_callback(message_id, token, record)
        if isinstance(checked, Answer):
            return checked
        assert record is not None
        refused = await self._write_callback(record, checked, outcome)
        if refused is not None:
            return refused
        since = self._awaiting.pop(message_id, None)
        if since is not None:
            self.vitals.record(
                outcome, latency_ms=(anyio.current_time() - since) * 1000, now_ms=now_ms()
            )
        envelope = load_envelope(record.envelope)
        taken = self._by_message.get(message_id)
        if taken is not None and taken.attempt == checked:
            self._finish_callback(taken, envelope, outcome)
        else:  # parked for an operator, its entry long released: settle it here
            await self._settle_unheld(envelope, checked, outcome)
        return Answer(200, {"id": message_id, "stage": Stage.CALLBACK_RECEIVED.value})

    def _check_callback(
        self, message_id: str, token: str, record: MessageRecord | None
    ) -> Answer | int:
        """The attempt a callback settles, or the answer that refuses it. The token comes
        first: without a good one, an unknown id and a known one get the same 401."""
        assert self._tokens is not None
        latest = record.attempt if record is not None else 0
        attempt = self._tokens.attempt_of(token, message_id, latest)
        if attempt is None:
            return Answer(401, {"error": "callback token does not match"})
        if record is None or record.attempt < 1:
            return Answer(404, {"error": f"unknown message {message_id}"})
        if record.stage in TERMINAL or record.stage is Stage.CALLBACK_RECEIVED:
            return _duplicate(message_id, record.stage)
        if attempt != record.attempt or record.instance != self.instance_id:
            why = f"attempt {attempt} is no longer current (now {record.attempt})"
            return Answer(409, {"error": why, "stage": record.stage.value})
        if record.stage not in (Stage.PROCESSING, Stage.NEEDS_CONFIRMATION):
            why = f"message is {record.stage.value}, not awaiting a result"
            return Answer(409, {"error": why, "stage": record.stage.value})
        return attempt

    async def _write_callback(
        self, record: MessageRecord, attempt: int, outcome: Succeeded | Failed
    ) -> Answer | None:
        """CALLBACK_RECEIVED with the result on the record; an answer when a race lost it."""
        late = now_ms() - record.updated_ms
        fields: dict[str, str | bytes] = (
            {"result": outcome.result}
            if isinstance(outcome, Succeeded)
            else {"error": outcome.reason}
        )
        moved = await self.store.apply(
            Move(
                record.id,
                Stage.CALLBACK_RECEIVED,
                any_of=frozenset({Stage.PROCESSING, Stage.NEEDS_CONFIRMATION}),
                expect_attempt=attempt,
                expect_instance=self.instance_id,
                reason=f"callback from the agent, {late / 1000:.1f} s after the last step",
                fields=fields,
            )
        )
        if moved.ok:  # should this sidecar stop before it finishes, the reaper does, soon
            soon = now_ms() + int(self.conn.settings.delivery_timeout_s * 1000)
            await self.conn.call(*self.store.due_at_most_command(record.id, soon))
            return None
        if moved.stage in TERMINAL or moved.stage is Stage.CALLBACK_RECEIVED:
            assert moved.stage is not None
            return _duplicate(record.id, moved.stage)  # raced: another callback, the reaper
        return Answer(409, {"error": f"message is {moved.stage}", "stage": str(moved.stage)})

    def _finish_callback(
        self, taken: Taken, envelope: Envelope, outcome: Succeeded | Failed
    ) -> None:
        """CALLBACK_RECEIVED -> SUCCEEDED / FAILED in the next finishing round trip, with the
        producer told, the credit returned and the entry acknowledged."""
        if taken.message_id in self._finishing:
            return  # queued already (the endpoint and the watch both saw it)
        self._finishing.add(taken.message_id)
        self._awaiting.pop(taken.message_id, None)
        stage, result, error = _ending(outcome)
        fields: dict[str, str | bytes] = {"result": result} if result is not None else {}
        settle = self._fenced(
            taken,
            stage,
            Stage.CALLBACK_RECEIVED,
            reason="result from the agent's callback",
            fields=fields,
        )
        self._finished.append(
            Finished(taken, self._reply(taken, envelope, stage, result, error), settle)
        )
        self._finished_ready.set()

    async def _settle_unheld(
        self, envelope: Envelope, attempt: int, outcome: Succeeded | Failed
    ) -> None:
        """Settle a callback whose stream entry is long released (the message was parked for
        an operator). No entry keeps the telling pending, so the record does
        (``reply_pending``, as the reaper's endings do): a stop before the telling leaves it
        to the reaper."""
        stage, result, error = _ending(outcome)
        moved = await self.store.apply(
            Move(
                envelope.message_id,
                stage,
                only_from=Stage.CALLBACK_RECEIVED,
                expect_attempt=attempt,
                expect_instance=self.instance_id,
                reason="result from the agent's callback",
                fields={"reply_pending": 1},
            )
        )
        if moved.ok:
            await self.store.deliver(envelope, stage, result, error, attempt=attempt)
            record_key = self.conn.keys.record(envelope.message_id)
            await self.conn.call("HDEL", record_key, "reply_pending")

    async def _watch_callbacks(self) -> None:
        while True:
            await anyio.sleep(self.conn.settings.sweep_interval_s)
            try:
                await self._check_awaited()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("callback watch failed (the next one retries): %s", exc)

    async def _check_awaited(self) -> None:
        """Let go of messages awaited in vain: the reaper (asking the status endpoint) or an
        operator settled them, and told their producers."""
        ids = [m for m in self._awaiting if m not in self._finishing]
        if not ids:
            return
        states = await self.conn.call_many(
            [("HMGET", self.conn.keys.record(m), "stage", "attempt", "instance") for m in ids]
        )
        received: list[Taken] = []
        for message_id, state in zip(ids, states, strict=True):
            taken = self._by_message.get(message_id)
            if taken is None or message_id not in self._awaiting or isinstance(state, Exception):
                continue
            stage, attempt, instance = (v.decode() if v else "" for v in state)
            mine = attempt == str(taken.attempt) and instance == self.instance_id
            if mine and stage == Stage.PROCESSING.value:
                continue
            if mine and stage == Stage.CALLBACK_RECEIVED.value:
                received.append(taken)  # recorded, but its finishing was lost
                continue
            del self._awaiting[message_id]
            self._done(taken)
            self._finished_ready.set()
        for taken in received:
            record = await self.store.get_record(taken.message_id)
            if record is not None and record.stage is Stage.CALLBACK_RECEIVED:
                envelope = load_envelope(record.envelope)
                self._finish_callback(taken, envelope, _callback_outcome(record))

    # -- one message -----------------------------------------------------------------------

    async def _guarded(self, taken: Taken, step: Callable[[], Awaitable[None]]) -> None:
        try:
            await step()
        except RedisUnavailable as exc:
            # The entry stays pending; the record's stage says where to resume, and the
            # consume loop takes it again from the pending list.
            log.warning("message %s: redis unavailable, left pending: %s", taken.message_id, exc)
            self._release_hold(taken)
        except Exception as exc:
            # Never let one message take the sidecar down. It stays pending and is taken
            # again — a few times, in case it was passing; then it is let go of, so one
            # message can never keep a sidecar busy for ever (see _give_up).
            failures = self._errors[taken.entry_id] = self._errors.get(taken.entry_id, 0) + 1
            if failures < MAX_INTERNAL_ERRORS:
                log.exception("message %s: unexpected error, left pending", taken.message_id)
                self._release_hold(taken)
            else:
                log.exception("message %s: unexpected error, giving up on it", taken.message_id)
                del self._errors[taken.entry_id]
                await self._give_up(taken, exc)
        finally:
            self._finished_ready.set()

    async def _give_up(self, taken: Taken, exc: Exception) -> None:
        """Let go of an entry that failed inside this sidecar ``MAX_INTERNAL_ERRORS`` times:
        its credit returned and the entry acknowledged, the error on the message's timeline
        and in the dead letters. The record is left as it stands, to the reaper, which
        resolves it by its stage when its time comes — rerouted if the agent was never
        asked; asked, retried only if idempotent, or parked, if it may have been."""
        error = f"sidecar {self.instance_id} gave up on it: {type(exc).__name__}: {exc}"
        try:
            await self.store.run_all(
                [
                    note_command(
                        self.conn, taken.message_id, SIDECAR_ERROR, error, now_ms=now_ms()
                    ),
                    self.store.dead_letter_command(
                        Letter(
                            id=taken.message_id,
                            reason="sidecar_error",
                            error=error,
                            ts_ms=now_ms(),
                            source=f"{self.queue} {taken.entry_id}",
                        )
                    ),
                ]
            )
        except Exception:  # the entry is let go of whatever: the reaper still sees the record
            log.exception("message %s: could not record the sidecar error", taken.message_id)
        self._awaiting.pop(taken.message_id, None)
        self._done(taken)

    def _release_hold(self, taken: Taken) -> None:
        self._held.discard(taken.entry_id)
        self._awaiting.pop(taken.message_id, None)
        self._forget(taken)
        self._recheck_pending = True

    async def _resume(self, taken: Taken, moved: Moved) -> None:
        """The entry did not find its record ROUTED here: a restart, or a stale delivery."""
        if moved.missing or moved.attempt != taken.attempt or moved.instance != self.instance_id:
            log.info(
                "message %s attempt %d is stale here: dropped, not executed",
                taken.message_id,
                taken.attempt,
            )
            self._done(taken)
            return
        record = await self.store.get_record(taken.message_id)
        if record is None:
            self._done(taken)
            return
        envelope = load_envelope(record.envelope)
        if moved.stage is Stage.RECEIVED:
            await self._execute(taken, envelope, Stage.RECEIVED, RESUMED)
        elif moved.stage is Stage.CALLBACK_RECEIVED:
            self._finish_callback(taken, envelope, _callback_outcome(record))
        elif moved.stage is Stage.PROCESSING:
            await self._resume_processing(taken, envelope, record)
        elif moved.stage in TERMINAL:
            self._done(
                taken, self._reply(taken, envelope, moved.stage, record.result, record.error)
            )
        else:
            if moved.stage is Stage.WAITING:  # sent back, maybe not yet indexed: index it
                await self.store.park(
                    record.capability, record.id, record.priority, record.accepted_ms
                )
            self._done(taken)

    async def _resume_processing(
        self, taken: Taken, envelope: Envelope, record: MessageRecord
    ) -> None:
        """Restarted while the agent had the message: wait for an async agent's callback;
        otherwise ask the status endpoint, or re-run an idempotent agent, or park it."""
        if record.awaiting_callback:
            self._awaiting[taken.message_id] = anyio.current_time()  # its callback is to come
        elif self.card.status_url:
            # the agent may have finished meanwhile: ask before re-running or parking
            unknown = Ambiguous("sidecar restarted while the agent was processing")
            await self._record(taken, envelope, unknown)
        elif self.card.idempotent:
            await self._execute(
                taken,
                envelope,
                Stage.PROCESSING,
                f"{RESUMED}; agent is idempotent, same idempotency key",
            )
        else:
            await self._settle(
                taken,
                envelope,
                Stage.NEEDS_CONFIRMATION,
                "sidecar restarted while the agent was processing; agent is not idempotent",
            )

    async def _execute(self, taken: Taken, envelope: Envelope, source: Stage, reason: str) -> None:
        processing = await self.store.apply(
            self._fenced(taken, Stage.PROCESSING, source, reason=reason, fields=_NOT_AWAITING)
        )
        if not processing.ok:
            self._done(taken)
            return
        await self._call_agent(taken, envelope)

    async def _call_stored(self, taken: Taken, stored: bytes) -> None:
        await self._call_agent(taken, load_envelope(stored))

    async def _call_agent(self, taken: Taken, envelope: Envelope) -> None:
        started = self._calls[taken.entry_id] = anyio.current_time()
        try:
            outcome = await self._deliver(taken, envelope)
        finally:
            del self._calls[taken.entry_id]
            self._overdue_counted.discard(taken.entry_id)
        latency_ms = (anyio.current_time() - started) * 1000
        if self.vitals.record(outcome, latency_ms=latency_ms, now_ms=now_ms()):
            self._beat_now.set()  # the circuit or cooldown changed: tell the dispatchers now
        await self._record(taken, envelope, outcome)

    async def _deliver(self, taken: Taken, envelope: Envelope) -> Outcome:
        """The transport's outcome; a transport that raises instead of answering is a
        failure with its reason — never an error that leaves the entry to be run again."""
        try:
            return await self.transport.deliver(envelope, taken.attempt)
        except Exception as exc:
            log.exception("message %s: the transport raised", taken.message_id)
            return Failed(f"the sidecar's transport raised {type(exc).__name__}: {exc}", False)

    async def _record(self, taken: Taken, envelope: Envelope, outcome: Outcome) -> None:
        retries_left = taken.attempt < envelope.max_attempts
        if isinstance(outcome, Ambiguous) and self.card.status_url:
            outcome = await self._ask_status(taken, outcome, retries_left)
        match outcome:
            case Accepted(task_id=task_id):
                await self._await_callback(taken, task_id)
            case Succeeded(result=result):
                await self._settle(taken, envelope, Stage.SUCCEEDED, "", result=result)
            case Backoff(reason=reason):
                # it did not take the work: not a failure, no back-off of our own
                await self._requeue(taken, envelope, reason, back_off=False)
            case Failed(reason=reason):
                await self._settle(taken, envelope, Stage.FAILED, reason, error=reason)
            case NotReached(reason=reason) if retries_left:
                await self._requeue(taken, envelope, reason, back_off=True)
            case Ambiguous(reason=reason) if retries_left and self.card.idempotent:
                await self._requeue(taken, envelope, reason, back_off=True)
            case Ambiguous(reason=reason) if not self.card.idempotent:
                await self._settle(taken, envelope, Stage.NEEDS_CONFIRMATION, reason)
            case NotReached(reason=reason) | Ambiguous(reason=reason):
                await self._dead(
                    taken, envelope, f"gave up after {taken.attempt} attempts: {reason}"
                )

    async def _ask_status(self, taken: Taken, outcome: Ambiguous, retries_left: bool) -> Outcome:
        """No answer in time: before guessing, ask the agent what became of the message."""
        status = await self._status.query(self.card.status_url, taken.message_id)
        why = f"{outcome.reason}; {status.why}"
        if status.state == "done":
            return Succeeded(status.result_json)
        if status.state == "failed" and not (self.card.idempotent and retries_left):
            return Failed(status.error or why)
        return Ambiguous(why)

    async def _settle(
        self,
        taken: Taken,
        envelope: Envelope,
        stage: Stage,
        reason: str,
        *,
        result: bytes | None = None,
        error: str | None = None,
    ) -> None:
        """Queue the outcome for the next finishing round trip (see :meth:`_finish_now`)."""
        fields: dict[str, str | bytes] = {}
        if result is not None:
            fields["result"] = result
        if error is not None:
            fields["error"] = error
        settle = self._fenced(taken, stage, Stage.PROCESSING, reason=reason, fields=fields)
        replies = self._reply(taken, envelope, stage, result, error) if stage in TERMINAL else []
        self._finished.append(Finished(taken, replies, settle))

    async def _requeue(
        self, taken: Taken, envelope: Envelope, reason: str, *, back_off: bool
    ) -> None:
        """The agent provably did not do the work (not reached, or busy), or is idempotent:
        back to WAITING for another attempt, with the same idempotency key — elsewhere if
        another instance can take it, and after a back-off for a failure."""
        fields: dict[str, str | bytes | int] = {"avoid": self.instance_id}
        if back_off:
            delay = retry_delay_ms(
                taken.attempt,
                base_ms=self.conn.settings.retry_backoff_ms,
                jitter=self.conn.settings.retry_jitter,
                rng=self._rng,
            )
            fields["retry_at_ms"] = now_ms() + delay
            reason = f"{reason}; retry in {delay} ms"
        moved = await self.store.apply(
            self._fenced(
                taken,
                Stage.WAITING,
                Stage.PROCESSING,
                reason=reason,
                fields=fields,
                return_field="accepted_ms",
            )
        )
        if moved.ok:
            # ordered by when the broker accepted it, never by the producer's own clock
            accepted_ms = int(moved.value or 0)
            await self.store.park(
                envelope.capability, envelope.message_id, envelope.priority, accepted_ms
            )
        self._done(taken)

    async def _dead(self, taken: Taken, envelope: Envelope, error: str) -> None:
        """Out of attempts: DEAD, dead-lettered with the envelope and every reason on the way."""
        moved = await self.store.apply(
            self._fenced(taken, Stage.DEAD, Stage.PROCESSING, reason=error, fields={"error": error})
        )
        if moved.ok:
            await self.store.dead_letter_message(envelope.message_id, error)
            self._done(taken, self._reply(taken, envelope, Stage.DEAD, None, error))
        else:
            self._done(taken)

    def _fenced(self, taken: Taken, target: Stage, source: Stage, **options: Any) -> Move:
        """A move allowed only from ``source``, at this entry's attempt, on this instance:
        the fence that keeps a stale delivery from ever acting on the record."""
        return Move(
            taken.message_id,
            target,
            only_from=source,
            expect_attempt=taken.attempt,
            expect_instance=self.instance_id,
            **options,
        )

    def _done(self, taken: Taken, replies: list[Command] | None = None) -> None:
        """Queue the entry for the next release round trip (credit, ack, replies)."""
        self._finished.append(Finished(taken, replies or []))

    def _reply(
        self,
        taken: Taken,
        envelope: Envelope,
        stage: Stage,
        result: bytes | None,
        error: str | None,
    ) -> list[Command]:
        """The commands that tell the producer (:mod:`broker.results`)."""
        return self.store.delivery_commands(envelope, stage, result, error, attempt=taken.attempt)


# Written with every PROCESSING that is about to call the agent: a retry's attempt awaits no
# callback until its own agent answers 202.
_NOT_AWAITING: dict[str, str | bytes | int] = {"awaiting_callback": "", "agent_task": ""}


def _duplicate(message_id: str, stage: Stage) -> Answer:
    return Answer(200, {"id": message_id, "stage": stage.value, "duplicate": True})


def _ending(outcome: Succeeded | Failed) -> tuple[Stage, bytes | None, str | None]:
    if isinstance(outcome, Succeeded):
        return Stage.SUCCEEDED, outcome.result, None
    return Stage.FAILED, None, outcome.reason


def _callback_outcome(record: MessageRecord) -> Succeeded | Failed:
    """The outcome a callback left on the record (CALLBACK_RECEIVED)."""
    if record.result is not None:
        return Succeeded(record.result)
    return Failed(record.error or "the agent reported failure")


Taken = Assignment  # one entry read from the instance's stream


@dataclass(frozen=True, slots=True)
class Finished:
    """An entry done with the agent: its outcome to record, reply to send, credit to return."""

    taken: Taken
    replies: list[Command]
    settle: Move | None = None
