"""An instance's life in the registry: registered, heartbeating, draining, gone.

Each heartbeat carries the instance's state, live stats and credit limit (the vitals); it is
sent every interval, or at once when the circuit, cooldown or limit changed. An operator's
DRAINING on the card is followed; a card that vanished is written again. Draining
(SIGTERM, or ``agent-reach drain``): no new assignments, what was assigned but never read
goes back to WAITING with its credit, in-flight work gets the grace period, then the card is
removed.

A stop has one deadline, the grace period from :meth:`Lifecycle.stop`. Redis away then (a
restart or a failover takes seconds, and a fleet is often stopped because of one) costs a
wait, not work: in-flight calls still get their grace; DRAINING and the rerouting, the
outcomes queued for recording and the deregistration are each tried again until the
deadline. What is still unwritten then is what a crash leaves, recovered by the reaper; the
stop ends with the error.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from contextlib import suppress

import anyio
from anyio.abc import TaskGroup

from broker.acks import trim_acknowledged
from broker.connection import Connection
from broker.credits import release_command
from broker.entries import parse_assignment
from broker.errors import RedisReplyError, RedisUnavailable
from broker.event_log import emit, event_command
from broker.events import printable
from broker.keyspace import SIDECAR_GROUP
from broker.metric_fields import retry
from broker.records import InstanceCard, InstanceState
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.streams import parse_entries
from broker.timekeeping import now_ms

from .callback_desk import CallbackDesk
from .finisher import Finisher
from .runner import Runner
from .vitals import Vitals
from .workpool import WorkPool

log = logging.getLogger("agent_reach.sidecar")

OVERDUE_CHECK_S = 0.1
TRIM_EVERY_BEATS = 12
DRAIN_POLL_S = 0.05
STOP_RETRY_FIRST_S, STOP_RETRY_MAX_S = 0.1, 1.0  # a stop's pauses while Redis is away
STOP_LAST_TRY_S = 1.0  # how long past the stop's deadline its last try may take
WITHDRAW_TIMEOUT_S = 2.0  # a failed start: how long the card may take to be written DOWN
DUPLICATE_TOLD_EVERY_S = 60.0  # another sidecar under this id: said at once, then this often


def incarnation_token() -> str:
    """One sidecar's incarnation, written on its card at registering and at every beat: where
    it runs (host and process, for the operator looking for a duplicate) and a random part
    (two sidecars in one process differ too)."""
    return f"{socket.gethostname()[:64]}/{os.getpid()}/{secrets.token_hex(4)}"


class Lifecycle:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        card: InstanceCard,
        *,
        vitals: Vitals,
        finisher: Finisher,
        runner: Runner,
        desk: CallbackDesk | None,
        grace_s: float,
    ) -> None:
        self.conn = conn
        self.store = store
        self.card = card
        self.instance_id = card.instance_id
        self.queue = conn.keys.queue(card.instance_id)
        self.registry = Registry(conn)
        self.vitals = vitals
        self.finisher = finisher
        self.runner = runner
        self.desk = desk
        self.grace_s = grace_s
        self.stopping = anyio.Event()
        self.pool: WorkPool | None = None
        self.stop_deadline = float("inf")  # anyio time; set by stop()
        self._drain_told = False  # DRAINING written and the unread entries rerouted
        self._beat_now = anyio.Event()
        self.incarnation = incarnation_token()
        self._duplicate_told = -DUPLICATE_TOLD_EVERY_S  # anyio time it was last said

    def stop(self) -> None:
        """Begin a graceful stop: no new reads, finish in-flight work, then deregister — all
        by the grace period from now (what an orchestrator counts before its SIGKILL)."""
        if not self.stopping.is_set():
            self.stop_deadline = anyio.current_time() + self.grace_s
        self.stopping.set()

    def beat_soon(self) -> None:
        """Heartbeat now: the circuit, cooldown or credit limit changed."""
        self._beat_now.set()

    async def register(self) -> None:
        await self.registry.register(
            self.card, credits=self.card.max_inflight, incarnation=self.incarnation
        )
        log.info(
            "instance %s registered for %s", self.instance_id, ",".join(self.card.capabilities)
        )

    async def withdraw(self) -> None:
        """A start that failed after the card was written (the stream's group refused, the
        callback port taken): the card DOWN at once, so that no dispatcher routes to an
        instance no one serves; a restart writes it UP again and reads what was assigned.
        One try, never long: the start's error is what the operator must see."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(WITHDRAW_TIMEOUT_S):
            try:
                await self.registry.set_state(self.instance_id, InstanceState.DOWN)
                log.warning("instance %s did not start: its card is DOWN", self.instance_id)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning(
                    "instance %s did not start; its card is left: %s", self.instance_id, exc
                )

    async def deregister(self) -> None:
        await self.registry.deregister(self.instance_id)
        log.info("instance %s deregistered", self.instance_id)

    # -- heartbeats --------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        """Heartbeat every interval, or at once when asked to; trim the acknowledged part of
        the instance's stream now and then."""
        beats = 0
        while True:
            with anyio.move_on_after(self.conn.settings.heartbeat_s):
                await self._beat_now.wait()
            self._beat_now = anyio.Event()
            try:
                await self._beat()
                beats += 1
                if beats % TRIM_EVERY_BEATS == 0:
                    await trim_acknowledged(self.conn, self.queue)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def overdue_loop(self) -> None:
        """Let the credit limit see a slowdown before the first slow answer arrives."""
        while True:
            await anyio.sleep(OVERDUE_CHECK_S)
            if self.runner.overdue():
                self.beat_soon()

    async def _beat(self) -> None:
        active = self.pool.unfinished if self.pool is not None else 0
        beat_ms = now_ms()
        state, stats, announce = self.vitals.beat(beat_ms, active=active)
        if self.stopping.is_set():
            state = InstanceState.DRAINING
        beat = await self.registry.heartbeat(
            self.instance_id,
            state,
            stats,
            announce=announce,
            hb_ms=beat_ms,
            credits=self.vitals.effective_credits,
            incarnation=self.incarnation,
        )
        # The very time written on the card, which is what observers compare against.
        self.vitals.beat_delivered(beat_ms)
        if beat is None:
            if not self.stopping.is_set():
                log.warning("instance %s was not registered: registering again", self.instance_id)
                await self.register()
            return
        if beat.other_writer:
            await self._tell_duplicate(beat.other_writer)
        if beat.state is InstanceState.DRAINING and not self.stopping.is_set():
            log.info("instance %s set DRAINING: finishing in-flight work", self.instance_id)
            self.stop()

    async def _tell_duplicate(self, other: str) -> None:
        """Another sidecar process wrote this instance's card since the last beat: two run
        under one instance id. They share its stream and card, so a drain of one stops both
        and one that starts resumes what the other is running. Said as an error and an
        ``instance.duplicate`` event at once, then at most once a minute while it lasts."""
        now = anyio.current_time()
        if now - self._duplicate_told < DUPLICATE_TOLD_EVERY_S:
            return
        self._duplicate_told = now
        other = other[:200]
        log.error(
            "instance %s: another sidecar (%s) runs under this instance id beside this one (%s):"
            " give each its own --instance-id",
            self.instance_id,
            printable(other),
            self.incarnation,
        )
        told = event_command(
            self.conn, "instance.duplicate", self.instance_id, other=other, this=self.incarnation
        )
        await emit(self.conn, [told])

    # -- draining ----------------------------------------------------------------------------

    async def drain(self, pool: WorkPool, work: TaskGroup) -> None:
        """DRAINING: no new assignments; reroute what was assigned but never read; give
        in-flight work the grace period, then cancel what is left (it stays pending). With
        Redis away the work still gets its grace, and DRAINING is tried again beside it."""
        pool.close()
        with anyio.move_on_at(self.stop_deadline):
            async with anyio.create_task_group() as beside:
                beside.start_soon(self._tell_draining_soon)
                await pool.join()
                # callbacks still to come in: polled, a drain is rare and lasts seconds
                while self.desk is not None and self.desk.busy:  # noqa: ASYNC110
                    await anyio.sleep(DRAIN_POLL_S)
        work.cancel_scope.cancel()

    async def settle(self, finish: Callable[[], Awaitable[None]]) -> None:
        """After the drain: DRAINING and the rerouting if the drain could not write them, then
        ``finish`` (the last outcomes recorded) — each tried again while Redis is away, until
        the stop's deadline (:attr:`stop_deadline`); past it, the error is raised."""
        if not self._drain_told:
            await self._by_the_deadline(self._tell_draining, "rerouting unread work")
        await self._by_the_deadline(finish, "recording the last outcomes")

    async def leave(self) -> None:
        """The card removed, tried again while Redis is away until the stop's deadline. Only
        once the heartbeats have stopped: a beat that finds no card writes it again."""
        await self._by_the_deadline(self.deregister, "deregistering")

    async def _tell_draining_soon(self) -> None:
        with suppress(RedisUnavailable):  # not by the deadline: settle tries a last time
            await self._by_the_deadline(self._tell_draining, "draining")

    async def _by_the_deadline(self, step: Callable[[], Awaitable[None]], what: str) -> None:
        await by_the_deadline(step, self.stop_deadline, what)

    async def _tell_draining(self) -> None:
        await self.registry.set_state(self.instance_id, InstanceState.DRAINING)
        await self._reroute_unread()
        self._drain_told = True

    async def _reroute_unread(self) -> None:
        """Entries assigned to this instance but never delivered to it go back to WAITING, so
        another instance takes them; their credits here are returned."""
        try:
            groups = await self.conn.call("XINFO", "GROUPS", self.queue)
        except RedisReplyError as exc:
            if "no such key" not in exc.message:
                raise
            return  # no stream (lost with a Redis that came back without its data): none unread
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
                self.finisher.fenced(
                    taken,
                    Stage.WAITING,
                    Stage.ROUTED,
                    reason="instance draining",
                    counts=(retry(record.capability, "drained"),) if record else (),
                )
            )
            if moved.ok and record is not None:
                await self.store.waiting.park(
                    record.capability, record.id, record.priority, record.accepted_ms
                )
            returned.append((f"{taken.message_id}:{taken.attempt}", taken.entry_id))
        if returned:
            log.info("rerouting %d unread entries", len(returned))
            await self.conn.call(
                *release_command(self.store.conn, self.instance_id, SIDECAR_GROUP, returned)
            )


async def by_the_deadline(step: Callable[[], Awaitable[None]], deadline: float, what: str) -> None:
    """``step``, tried again while Redis is away (0.1 s doubling to 1 s) until ``deadline``
    (anyio time), the last try made at it; past it, the error is raised. Every try ends by
    the deadline and :data:`STOP_LAST_TRY_S`: a Redis that takes connections and never
    answers cannot stretch a stop."""
    pause_s = STOP_RETRY_FIRST_S
    while True:
        with anyio.move_on_at(deadline + STOP_LAST_TRY_S) as attempt:
            try:
                await step()
                return
            except RedisUnavailable as exc:
                problem = exc
        if attempt.cancelled_caught:
            problem = RedisUnavailable(f"redis unavailable: no answer {what}")
        left_s = deadline - anyio.current_time()
        if left_s <= 0:
            log.error("%s: Redis is unavailable and the grace period is over", what)
            raise problem
        log.warning("%s: Redis is unavailable (%s); trying again", what, problem)
        await anyio.sleep(min(pause_s, left_s))
        pause_s = min(pause_s * 2, STOP_RETRY_MAX_S)
