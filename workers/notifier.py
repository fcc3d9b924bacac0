"""The notifier: POSTs each ended message's result to its ``callback_url``, signed, with retries.

Whoever ends a message adds an entry to ``P:outbox`` (:mod:`broker.results`; the entry is a
:class:`broker.wire.OutboxEntry`): ``id``, ``webhook_id``, ``url``, ``body`` (the JSON the
webhook receives), ``attempt``. Notifiers share the stream through the consumer group
``notify``. Each POST is signed as the Standard Webhooks specification says, with the entry's
``webhook_id`` (the message id for an entry written without one; the same on every retry, so
receivers de-duplicate on it: delivery is at least once, DESIGN §3 invariant 7), and goes only
where the allow-list and the egress guard let it (:mod:`workers.webhook_post`): a name on the
list that leads to a loopback, private or otherwise internal address is refused unless the
list covers that address too. Redirects are not followed. A refusal is final: the delivery is
dead-lettered at once.

With ``ingress_partitions`` > 1 the outbox is in as many partitions (``P:outbox``,
``P:outbox:{1}``, …; :func:`broker.keyspace.outbox_for` by message id), each its own slot on a
cluster: every notifier reads every partition, on a reader of its own, and a retry stays on
its delivery's partition.

Every delivery is one outbox entry, pending with exactly one notifier from the moment it is
read until it is settled (:mod:`workers.webhook_settlement` writes how):

- 2xx: ``CALLBACK_DELIVERED`` on the message's timeline, then the entry acknowledged and
  deleted;
- any other answer, no answer within ``webhook_timeout_s``, or no connection, with attempts
  left: in one ``MULTI`` a new entry (``attempt`` + 1, ``not_before_ms`` after an exponential
  back-off with jitter, ``last_error``) is added and the old one acknowledged and deleted, so
  the retry is as durable as the first attempt;
- out of attempts, the URL refused by this notifier's own settings (they may differ from the
  dispatcher's), or its host's addresses refused by the egress guard: dead-lettered with
  reason ``callback_undeliverable``, then acknowledged and deleted;
- an entry this notifier cannot read (a field missing, not UTF-8 — names included —, an
  attempt that is not a positive number): dead-lettered the same way, with what is wrong.

An entry whose ``not_before_ms`` is ahead is *held* — read, pending, not acknowledged — until
then, without taking a delivery slot. The holder renews its claim on everything it holds
(``XCLAIM ... JUSTID``) every third of ``claim_idle_s``, after checking (``XPENDING``) that each
entry is still its own; so another notifier's ``XAUTOCLAIM`` (idle past ``claim_idle_s``) takes
only the entries of a notifier that stopped, however long their back-off. A notifier killed
at any point loses nothing: its entries stay pending, and its restart (same consumer name)
reads them back at once, or another notifier claims them after ``claim_idle_s``. One that
stalled longer than that finds at its next renewal what was taken over and lets go of it;
and right before each POST it renews that one entry only if it is still its own
(``lua/renew_own.lua``), so a stall that lost it meanwhile does not POST it beside the new
holder. A POST already sent when the stall began is sent again by the new holder (at least
once, as promised).

It also relays fleet events to their subscriptions (:mod:`workers.event_relay`): each as
outbox entries like the ones above, so they are delivered the same way.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence

import anyio
from anyio.abc import TaskGroup, TaskStatus

from broker.connection import Connection, ensure_group
from broker.errors import RedisReplyError, RedisUnavailable
from broker.idle_claims import IdleClaim
from broker.keyspace import NOTIFY_GROUP, outboxes
from broker.scripts import ScriptName
from broker.streams import GroupReader, StreamEntry, parse_entries
from broker.timekeeping import now_ms

from .dispatcher import default_consumer_name
from .event_relay import EventRelay
from .webhook_post import WebhookPoster
from .webhook_settlement import Settlement, parse_delivery

log = logging.getLogger("agent_reach.notifier")

MAX_HELD = 10_000  # entries read and not yet settled; reading pauses beyond this
READ_BATCH = 256
READ_BLOCK_MS = 1000
CLAIM_BATCH = 256
XCLAIM_CHUNK = 1000
SETTLE_TIMEOUT_S = 10.0

Held = tuple[str, str]  # (outbox partition, entry id)


class Notifier:
    def __init__(
        self, conn: Connection, *, consumer: str | None = None, rng: random.Random | None = None
    ) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.consumer = consumer or default_consumer_name()
        self.outboxes = outboxes(conn.keys)
        self._abandoned = {
            outbox: IdleClaim(conn, outbox, NOTIFY_GROUP, self.consumer) for outbox in self.outboxes
        }
        self.poster = WebhookPoster(self.settings)
        self.settlement = Settlement(conn, rng or random.Random())
        self.relay = EventRelay(conn, consumer=self.consumer)  # events to subscriptions
        self._held: dict[Held, anyio.CancelScope] = {}  # entry -> its task's scope
        self._room = anyio.Event()
        self._tg: TaskGroup | None = None

    @property
    def handled(self) -> dict[str, int]:
        """Deliveries delivered / retried / dead-lettered, over its life."""
        return self.settlement.handled

    @property
    def holding(self) -> int:
        """Entries read and not yet settled (waiting out a back-off, or being POSTed)."""
        return len(self._held)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        for outbox in self.outboxes:
            await ensure_group(self.conn, outbox, NOTIFY_GROUP)
        async with self.poster, anyio.create_task_group() as tg:
            self._tg = tg
            for outbox in self.outboxes:  # each partition's own pending taken back first
                await tg.start(self._lane, outbox)
            await tg.start(self.relay.run)
            tg.start_soon(self._every, self._renew_every_s(), self.renew)
            tg.start_soon(self._every, self.settings.sweep_interval_s, self.claim_abandoned)
            task_status.started()

    # -- taking entries ----------------------------------------------------------------------

    async def _lane(self, outbox: str, *, task_status: TaskStatus[None]) -> None:
        async with self.conn.reader() as reader:
            await self._recover(reader, outbox)
            task_status.started()
            await self._read_loop(reader, outbox)

    async def _recover(self, reader: GroupReader, outbox: str) -> None:
        """Take back this consumer's own pending entries: a restart after a stop or a crash."""
        entries = await reader.read(
            outbox, NOTIFY_GROUP, self.consumer, count=MAX_HELD, block_ms=None, pending=True
        )
        if entries:
            log.info("recovering %d pending webhook deliveries of %s", len(entries), outbox)
            self._hold(outbox, entries)

    async def _read_loop(self, reader: GroupReader, outbox: str) -> None:
        backoff = 0.1
        while True:
            while len(self._held) >= MAX_HELD:
                self._room = anyio.Event()
                await self._room.wait()
            try:
                entries = await reader.read(
                    outbox,
                    NOTIFY_GROUP,
                    self.consumer,
                    count=min(READ_BATCH, MAX_HELD - len(self._held)),
                    block_ms=READ_BLOCK_MS,
                )
            except (RedisUnavailable, RedisReplyError) as exc:
                backoff = min(backoff * 2, 5.0)
                log.warning("%s read failed, retrying in %.1fs: %s", outbox, backoff, exc)
                await anyio.sleep(backoff)
                continue
            backoff = 0.1
            self._hold(outbox, entries)

    async def claim_abandoned(self) -> int:
        """Take over entries pending with a notifier that stopped renewing them (it died, and
        did not come back under its name) for ``claim_idle_s``, on every partition. Returns
        how many."""
        taken = 0
        for outbox in self.outboxes:
            taken += await self._claim_abandoned(outbox)
        if taken:
            log.info("took over %d webhook deliveries from a stopped notifier", taken)
        return taken

    async def _claim_abandoned(self, outbox: str) -> int:
        claim, taken = self._abandoned[outbox], 0
        idle_ms = int(self.settings.claim_idle_s * 1000)
        while len(self._held) < MAX_HELD:
            claimed = await claim.batch(idle_ms, min(CLAIM_BATCH, MAX_HELD - len(self._held)))
            if claimed.gone:  # deleted while pending (6.2)
                await self.conn.call("XACK", outbox, NOTIFY_GROUP, *claimed.gone)
            taken += self._hold(outbox, parse_entries(claimed.entries))
            if claim.wrapped:
                break
        return taken

    def _hold(self, outbox: str, entries: Sequence[StreamEntry]) -> int:
        """Start a task for each entry not held yet; registered before it starts, so that
        renewal covers it from now on."""
        assert self._tg is not None
        started = 0
        for entry_id, fields in entries:
            if (outbox, entry_id) in self._held:
                continue
            scope = anyio.CancelScope()
            self._held[outbox, entry_id] = scope
            self._tg.start_soon(self._handle, outbox, entry_id, fields, scope)
            started += 1
        return started

    def _let_go(self, held: Held) -> None:
        self._held.pop(held, None)
        if len(self._held) < MAX_HELD:
            self._room.set()

    # -- keeping them ------------------------------------------------------------------------

    def _renew_every_s(self) -> float:
        return self.settings.claim_idle_s / 3

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[int]]) -> None:
        while True:
            await anyio.sleep(interval_s)
            try:
                await step()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("%s failed (retried in %.1fs): %s", step.__name__, interval_s, exc)

    async def renew(self) -> int:
        """Reset the idle time of every entry this notifier holds and still owns, so that no
        ``XAUTOCLAIM`` takes it while it waits out a back-off; let go of any another notifier
        took meanwhile (this one stalled past ``claim_idle_s``). Returns how many it renewed."""
        renewed = 0
        for outbox in self.outboxes:
            held = [entry_id for stream, entry_id in self._held if stream == outbox]
            if held:
                renewed += await self._renew(outbox, held)
        return renewed

    async def _renew(self, outbox: str, held: list[str]) -> int:
        scan = 2 * MAX_HELD
        rows = await self.conn.call("XPENDING", outbox, NOTIFY_GROUP, "-", "+", scan, self.consumer)
        mine = {row[0].decode() for row in rows}
        if len(rows) < scan:  # the whole list: what is missing is no longer ours
            lost = [entry_id for entry_id in held if entry_id not in mine]
            for entry_id in lost:
                if scope := self._held.get((outbox, entry_id)):
                    scope.cancel()  # a settlement under way is shielded and completes
            if lost:
                log.info(
                    "let go of %d deliveries no longer pending here (settled, or taken"
                    " over after a stall)",
                    len(lost),
                )
        keep = [entry_id for entry_id in held if entry_id in mine]
        for i in range(0, len(keep), XCLAIM_CHUNK):
            chunk = keep[i : i + XCLAIM_CHUNK]
            await self.conn.call("XCLAIM", outbox, NOTIFY_GROUP, self.consumer, 0, *chunk, "JUSTID")
        return len(keep)

    # -- one delivery ------------------------------------------------------------------------

    async def _handle(
        self, outbox: str, entry_id: str, fields: dict[str, bytes], scope: anyio.CancelScope
    ) -> None:
        try:
            with scope:
                delivery = parse_delivery(outbox, entry_id, fields)
                if isinstance(delivery, str):
                    malformed = self.settlement.malformed(outbox, entry_id, fields, delivery)
                    await self._settle_shielded(malformed)
                    return
                # never longer than this broker would ever have asked: an entry written
                # with a wait of years must not hold a delivery slot of ours for years
                wait_ms = min(delivery.not_before_ms - now_ms(), self._longest_wait_ms())
                if wait_ms > 0:
                    await anyio.sleep(wait_ms / 1000)
                if not await self._still_mine(outbox, entry_id):
                    return
                attempt = await self.poster.attempt(delivery)
                await self._settle_shielded(self.settlement.settle(delivery, attempt))
        except (RedisUnavailable, RedisReplyError, TimeoutError) as exc:
            # still pending: taken up again (by this notifier or another) after claim_idle_s
            log.warning("webhook delivery %s not settled, retried later: %s", entry_id, exc)
        finally:
            self._let_go((outbox, entry_id))

    async def _still_mine(self, outbox: str, entry_id: str) -> bool:
        """Renew the entry's claim right before its POST, if it is still this notifier's: a
        loop stalled past ``claim_idle_s`` (its renewals late) may have lost it to another
        notifier, which POSTs it too; the renewal loop would say so only at its next turn."""
        keys, args = (outbox,), (NOTIFY_GROUP, self.consumer, entry_id)
        if await self.conn.evalsha(ScriptName.RENEW_OWN, keys, args):
            return True
        log.info("webhook delivery %s was taken over meanwhile: left to its new holder", entry_id)
        return False

    def _longest_wait_ms(self) -> int:
        """The longest wait a retry is ever written with (:mod:`workers.webhook_settlement`)."""
        return self.settings.webhook_backoff_max_ms

    async def _settle_shielded(self, settle: Awaitable[None]) -> None:
        """Write the outcome even while stopping: a settlement is one short round trip."""
        with anyio.CancelScope(shield=True), anyio.fail_after(SETTLE_TIMEOUT_S):
            await settle
