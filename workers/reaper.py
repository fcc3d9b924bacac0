"""The reaper owns time: it finds messages whose next deadline has come and resolves them by
their stage, never running a non-idempotent action twice.

Every live message has an entry in ``P:due`` (message id -> next time to look at it). Any
number of reapers share it: ``claim_due.lua`` leases a batch to one of them at a time, and
each message of the batch is resolved by :mod:`workers.resolver` (what each stage gets when
its time comes). A reaper stopped in the middle of a batch hands back what it has not
resolved, due at once: only a killed one leaves its lease to run out. Each tick also takes
over the work of dead instances at once (:mod:`workers.takeover`) and runs one step of
housekeeping (:mod:`workers.janitor`).

Retries back off (``broker/retry.py``), avoid the instance that failed, and stop at the
envelope's ``max_attempts``: DEAD, dead-lettered with the chain of reasons.
"""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskStatus

from adapters.status import StatusClient
from broker.connection import Connection
from broker.errors import RedisReplyError, RedisUnavailable, first_leaf
from broker.records import MessageRecord
from broker.registry import Registry
from broker.store import MessageStore
from broker.timekeeping import now_ms

from .instances import Instances
from .janitor import Janitor
from .resolver import Resolver, Verdict
from .routing_table import RoutingTable, routing_policy
from .takeover import CLAIM_BATCH, Takeover
from .waiting import WaitingRoom

log = logging.getLogger("agent_reach.reaper")

LEASE_MS = 30_000
GIVE_BACK_S = 2.0  # how long a stopping reaper tries to hand its lease back
RESOLVE_CONCURRENCY = 32  # with 3 s status queries, a batch of 200 ends well inside its lease
MAX_JUDGE_ERRORS = 3  # unexpected errors resolving one message before it is ended DEAD
JUDGE_ERROR_RETRY_MS = 2_000


class Reaper:
    def __init__(self, conn: Connection, *, status: StatusClient | None = None) -> None:
        self.conn = conn
        self.settings = conn.settings
        self.store = MessageStore(conn)
        table = RoutingTable(routing_policy(conn.settings))
        self.instances = Instances(Registry(conn), table)
        waiting = WaitingRoom(self.store, table, batch=conn.settings.dispatch_batch)
        self.status = status or StatusClient(timeout_s=3.0)
        self.resolver = Resolver(conn, self.store, waiting, self.instances, self.status)
        self.handled: dict[str, int] = {}  # action -> count, over this reaper's life
        self.takeover = Takeover(
            conn, self.store, self.instances, self.resolver, self.resolve_guarded, self.handled
        )
        self.janitor = Janitor(conn, self.store)
        self._limit = anyio.CapacityLimiter(RESOLVE_CONCURRENCY)
        self._errors: dict[str, int] = {}  # message id -> unexpected errors resolving it

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                try:
                    await self.tick()
                except (RedisUnavailable, RedisReplyError) as exc:
                    log.warning("reaper tick failed (the next one retries): %s", exc)
                await anyio.sleep(self.settings.sweep_interval_s)
        finally:
            with anyio.CancelScope(shield=True):
                await self.status.aclose()

    async def tick(self) -> int:
        """One pass: refresh the registry, take over the work of dead instances, resolve what
        is due. Returns how many messages were looked at."""
        await self.instances.refresh()
        total = await self.takeover.dead_instances(now_ms())
        while True:
            now = now_ms()
            ids = await self.store.due.claim(now, LEASE_MS, CLAIM_BATCH)
            total += len(ids)
            if ids:
                verdicts: list[tuple[str, int | None]] = []
                try:
                    await self._judge_all(ids, now, verdicts)
                    await self.store.due.reschedule(now + LEASE_MS, verdicts)
                except BaseException:  # cut short, even in the reschedule: a second one is safe
                    await self._give_back(ids, now, verdicts)
                    raise
            if len(ids) < CLAIM_BATCH:
                break
        await self._sweep(now_ms())
        return total

    async def resolve(self, message_id: str, record: MessageRecord | None, now: int) -> Verdict:
        return await self.resolver.resolve(message_id, record, now)

    async def resolve_guarded(
        self, message_id: str, record: MessageRecord | None, now: int
    ) -> Verdict:
        """:meth:`resolve`, with one message's defect kept to that message: the others of the
        batch are resolved all the same. A message that fails ``MAX_JUDGE_ERRORS`` times in
        a row is ended DEAD with the error (dead-lettered, visible) rather than looked at for
        ever."""
        try:
            verdict = await self.resolver.resolve(message_id, record, now)
        except RedisUnavailable:
            raise
        except Exception as exc:
            log.exception("message %s: could not be resolved", message_id)
            failures = self._errors[message_id] = self._errors.get(message_id, 0) + 1
            if failures >= MAX_JUDGE_ERRORS and record is not None:
                try:
                    verdict = await self.resolver.unresolvable(record, exc)
                except RedisReplyError as refused:  # ending it failed too: looked at again
                    log.error("message %s: could not be ended DEAD: %s", message_id, refused)
                    return Verdict("error", now + JUDGE_ERROR_RETRY_MS)
                del self._errors[message_id]
                return verdict
            return Verdict("error", now + JUDGE_ERROR_RETRY_MS)
        self._errors.pop(message_id, None)
        return verdict

    async def _sweep(self, now: int) -> None:
        try:
            await self.janitor.step(now)
        except RedisUnavailable:
            raise
        except Exception:  # the sweep is housekeeping: it must never stop the reaping
            log.exception("janitor step failed (the next tick goes on)")

    async def _give_back(
        self, ids: list[str], now: int, verdicts: list[tuple[str, int | None]]
    ) -> None:
        """A batch cut short (the reaper stopped, or Redis failed under it): the verdicts
        reached are written, and the rest of the lease handed back, due at once, so the
        next reaper looks at them now, not when the lease runs out. Best effort, and
        briefly: what cannot be written keeps its lease, as before."""
        judged = {message_id for message_id, _ in verdicts}
        back = verdicts + [(message_id, now) for message_id in ids if message_id not in judged]
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + GIVE_BACK_S):
            try:
                await self.store.due.reschedule(now + LEASE_MS, back)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("a stopped batch's lease not handed back (it runs out): %s", exc)

    async def _judge_all(
        self, ids: list[str], now: int, verdicts: list[tuple[str, int | None]]
    ) -> None:
        """Resolve a leased batch concurrently: a slow status endpoint must not hold the rest
        past their lease. Adds each message's next look (``None``: forget it) to
        ``verdicts`` as it is reached."""
        records = await self.store.get_records(ids)
        try:
            async with anyio.create_task_group() as tg:
                for message_id, record in zip(ids, records, strict=True):
                    tg.start_soon(self._judge, message_id, record, now, verdicts)
        except* RedisUnavailable as lost:
            # Redis lost under the batch: the tick fails as any other call would (run()
            # retries; the batch's lease brings it back), not as a group run() cannot tell
            raise first_leaf(lost) from None

    async def _judge(
        self,
        message_id: str,
        record: MessageRecord | None,
        now: int,
        verdicts: list[tuple[str, int | None]],
    ) -> None:
        async with self._limit:
            verdict = await self.resolve_guarded(message_id, record, now)
        self.handled[verdict.action] = self.handled.get(verdict.action, 0) + 1
        verdicts.append((message_id, verdict.next_due_ms))
