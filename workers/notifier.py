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

Every delivery is one outbox entry, pending with exactly one notifier from the moment it is
read until it is settled:

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
a POST it had already sent is sent again by the new holder (at least once, as promised).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from broker.cluster_map import ORDER_BARRIER
from broker.connection import Connection, ensure_group
from broker.deadletters import Letter
from broker.delivery import count_commands, dead_letter_commands
from broker.entries import fields_as_bytes
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import NOTIFY_GROUP
from broker.metric_fields import field
from broker.retry import retry_delay_ms
from broker.streams import GroupReader, StreamEntry, field_bytes, parse_entries
from broker.timekeeping import now_ms
from broker.timeline import CALLBACK_DELIVERED, note_command
from broker.wire import OutboxEntry, outbox_fields, parse_outbox_entry

from .dispatcher import default_consumer_name
from .webhook_post import Attempt, WebhookPoster

log = logging.getLogger("agent_reach.notifier")

UNDELIVERABLE = "callback_undeliverable"
MAX_HELD = 10_000  # entries read and not yet settled; reading pauses beyond this
READ_BATCH = 256
READ_BLOCK_MS = 1000
CLAIM_BATCH = 256
XCLAIM_CHUNK = 1000
SETTLE_TIMEOUT_S = 10.0


class Delivery(OutboxEntry, frozen=True, kw_only=True):
    """An outbox entry as the notifier holding it sees it: what it says, and which stream
    entry it is."""

    entry_id: str


def parse_delivery(entry_id: str, fields: dict[str, bytes]) -> Delivery | str:
    """The delivery an outbox entry describes (:func:`broker.wire.parse_outbox_entry`), or
    why it describes none. Never raises, whatever bytes the entry holds (anyone who can
    ``XADD`` can write one)."""
    entry = parse_outbox_entry(fields)
    if isinstance(entry, str):
        return f"malformed outbox entry {entry_id}: {entry}"
    return Delivery(entry_id=entry_id, **msgspec.structs.asdict(entry))


def backoff_ms(
    attempt: int, *, base_ms: int, cap_ms: int, jitter: float, rng: random.Random
) -> int:
    """The wait after failed attempt ``attempt`` (1 for the first): ``base_ms`` doubled for
    every attempt before it, at most ``cap_ms``, spread by ±``jitter`` (and still at most
    ``cap_ms``) so that receivers coming back from an outage are not hit all at once."""
    spread = retry_delay_ms(attempt, base_ms=base_ms, jitter=jitter, rng=rng, cap_ms=cap_ms)
    return min(cap_ms, spread)


class Notifier:
    def __init__(
        self, conn: Connection, *, consumer: str | None = None, rng: random.Random | None = None
    ) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.settings = conn.settings
        self.consumer = consumer or default_consumer_name()
        self.rng = rng or random.Random()
        self.poster = WebhookPoster(self.settings)
        self.handled: dict[str, int] = {}  # delivered / retried / dead-lettered, over its life
        self._held: dict[str, anyio.CancelScope] = {}  # entry id -> its task's scope
        self._room = anyio.Event()
        self._tg: TaskGroup | None = None

    @property
    def holding(self) -> int:
        """Entries read and not yet settled (waiting out a back-off, or being POSTed)."""
        return len(self._held)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await ensure_group(self.conn, self.keys.outbox, NOTIFY_GROUP)
        async with (
            self.poster,
            self.conn.reader() as reader,
            anyio.create_task_group() as tg,
        ):
            self._tg = tg
            await self._recover(reader)
            tg.start_soon(self._every, self._renew_every_s(), self.renew)
            tg.start_soon(self._every, self.settings.sweep_interval_s, self.claim_abandoned)
            task_status.started()
            await self._read_loop(reader)

    # -- taking entries ----------------------------------------------------------------------

    async def _recover(self, reader: GroupReader) -> None:
        """Take back this consumer's own pending entries: a restart after a stop or a crash."""
        entries = await reader.read(
            self.keys.outbox,
            NOTIFY_GROUP,
            self.consumer,
            count=MAX_HELD,
            block_ms=None,
            pending=True,
        )
        if entries:
            log.info("recovering %d pending webhook deliveries", len(entries))
            self._hold(entries)

    async def _read_loop(self, reader: GroupReader) -> None:
        backoff = 0.1
        while True:
            while len(self._held) >= MAX_HELD:
                self._room = anyio.Event()
                await self._room.wait()
            try:
                entries = await reader.read(
                    self.keys.outbox,
                    NOTIFY_GROUP,
                    self.consumer,
                    count=min(READ_BATCH, MAX_HELD - len(self._held)),
                    block_ms=READ_BLOCK_MS,
                )
            except (RedisUnavailable, RedisReplyError) as exc:
                backoff = min(backoff * 2, 5.0)
                log.warning("outbox read failed, retrying in %.1fs: %s", backoff, exc)
                await anyio.sleep(backoff)
                continue
            backoff = 0.1
            self._hold(entries)

    async def claim_abandoned(self) -> int:
        """Take over entries pending with a notifier that stopped renewing them (it died, and
        did not come back under its name) for ``claim_idle_s``. Returns how many."""
        cursor, taken = "0-0", 0
        idle_ms = int(self.settings.claim_idle_s * 1000)
        while len(self._held) < MAX_HELD:
            reply = await self.conn.call(
                "XAUTOCLAIM",
                self.keys.outbox,
                NOTIFY_GROUP,
                self.consumer,
                idle_ms,
                cursor,
                "COUNT",
                min(CLAIM_BATCH, MAX_HELD - len(self._held)),
            )
            gone = [e[0] for e in reply[1] if e and not e[1]]  # deleted while pending (6.2)
            if gone:
                await self.conn.call("XACK", self.keys.outbox, NOTIFY_GROUP, *gone)
            taken += self._hold(parse_entries(reply[1]))
            cursor = reply[0].decode()
            if cursor == "0-0":
                break
        if taken:
            log.info("took over %d webhook deliveries from a stopped notifier", taken)
        return taken

    def _hold(self, entries: Sequence[StreamEntry]) -> int:
        """Start a task for each entry not held yet; registered before it starts, so that
        renewal covers it from now on."""
        assert self._tg is not None
        started = 0
        for entry_id, fields in entries:
            if entry_id in self._held:
                continue
            scope = anyio.CancelScope()
            self._held[entry_id] = scope
            self._tg.start_soon(self._handle, entry_id, fields, scope)
            started += 1
        return started

    def _let_go(self, entry_id: str) -> None:
        self._held.pop(entry_id, None)
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
        held = list(self._held)
        if not held:
            return 0
        scan = 2 * MAX_HELD
        rows = await self.conn.call(
            "XPENDING", self.keys.outbox, NOTIFY_GROUP, "-", "+", scan, self.consumer
        )
        mine = {row[0].decode() for row in rows}
        if len(rows) < scan:  # the whole list: what is missing is no longer ours
            lost = [entry_id for entry_id in held if entry_id not in mine]
            for entry_id in lost:
                if scope := self._held.get(entry_id):
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
            await self.conn.call(
                "XCLAIM", self.keys.outbox, NOTIFY_GROUP, self.consumer, 0, *chunk, "JUSTID"
            )
        return len(keep)

    # -- one delivery ------------------------------------------------------------------------

    async def _handle(
        self, entry_id: str, fields: dict[str, bytes], scope: anyio.CancelScope
    ) -> None:
        try:
            with scope:
                delivery = parse_delivery(entry_id, fields)
                if isinstance(delivery, str):
                    await self._settle_shielded(
                        self._dead_letter_malformed(entry_id, fields, delivery)
                    )
                    return
                # never longer than this broker would ever have asked: an entry written
                # with a wait of years must not hold a delivery slot of ours for years
                wait_ms = min(delivery.not_before_ms - now_ms(), self._longest_wait_ms())
                if wait_ms > 0:
                    await anyio.sleep(wait_ms / 1000)
                attempt = await self.poster.attempt(delivery)
                await self._settle_shielded(self._settle(delivery, attempt))
        except (RedisUnavailable, RedisReplyError, TimeoutError) as exc:
            # still pending: taken up again (by this notifier or another) after claim_idle_s
            log.warning("webhook delivery %s not settled, retried later: %s", entry_id, exc)
        finally:
            self._let_go(entry_id)

    def _longest_wait_ms(self) -> int:
        """The longest wait a retry is ever written with (:meth:`_retry_later`)."""
        return self.settings.webhook_backoff_max_ms

    async def _settle_shielded(self, settle: Awaitable[None]) -> None:
        """Write the outcome even while stopping: a settlement is one short round trip."""
        with anyio.CancelScope(shield=True), anyio.fail_after(SETTLE_TIMEOUT_S):
            await settle

    # -- settling ----------------------------------------------------------------------------

    async def _settle(self, delivery: Delivery, attempt: Attempt) -> None:
        if attempt.delivered:
            await self._delivered(delivery, attempt)
        elif not attempt.final and delivery.attempt < self.settings.webhook_attempts:
            await self._retry_later(delivery, attempt)
        else:
            await self._dead_letter(delivery, attempt)

    async def _delivered(self, delivery: Delivery, attempt: Attempt) -> None:
        reason = f"webhook {delivery.url} {attempt.detail} (attempt {delivery.attempt})"
        note = note_command(
            self.conn, delivery.message_id, CALLBACK_DELIVERED, reason, now_ms=now_ms()
        )
        await self._run([note, *self._done(delivery.entry_id, "delivered")])
        self._count("delivered")
        log.info("message %s: %s", delivery.message_id, reason)

    async def _retry_later(self, delivery: Delivery, attempt: Attempt) -> None:
        s = self.settings
        wait_ms = backoff_ms(
            delivery.attempt,
            base_ms=s.webhook_backoff_ms,
            cap_ms=s.webhook_backoff_max_ms,
            jitter=s.retry_jitter,
            rng=self.rng,
        )
        wait_ms = max(wait_ms, min(attempt.retry_after_ms, s.webhook_backoff_max_ms))
        retry = OutboxEntry(
            message_id=delivery.message_id,
            webhook_id=delivery.webhook_id,
            url=delivery.url,
            body=delivery.body,
            attempt=delivery.attempt + 1,
            not_before_ms=now_ms() + wait_ms,
            last_error=attempt.detail,
        )
        added = ("XADD", self.keys.outbox, "*", *outbox_fields(retry))
        await self._run(self._done(delivery.entry_id, "retried", also=[added]))
        self._count("retried")
        log.warning(
            "message %s: webhook %s %s (attempt %d of %d), next in %d ms",
            delivery.message_id,
            delivery.url,
            attempt.detail,
            delivery.attempt,
            s.webhook_attempts,
            wait_ms,
        )

    async def _dead_letter(self, delivery: Delivery, attempt: Attempt) -> None:
        posts = delivery.attempt if attempt.posted else delivery.attempt - 1
        letter = Letter(
            id=delivery.message_id,
            stage=_stage_of(delivery.body),
            reason=UNDELIVERABLE,
            url=delivery.url,
            attempts=posts,
            error=attempt.detail,
            body=delivery.body,
            ts_ms=now_ms(),
        )
        await self._run(self._dead_lettered(letter, delivery.entry_id, "dead"))
        self._count("dead-lettered")
        log.warning(
            "message %s: webhook %s undeliverable after %d attempt(s), dead-lettered: %s",
            delivery.message_id,
            delivery.url,
            posts,
            attempt.detail,
        )

    async def _dead_letter_malformed(
        self, entry_id: str, fields: dict[str, bytes], problem: str
    ) -> None:
        letter = Letter(
            id=fields.get("id", b"").decode(errors="replace"),
            stage=_stage_of(fields.get("body", b"")),
            reason=UNDELIVERABLE,
            raw=fields_as_bytes((field_bytes(name), value) for name, value in fields.items()),
            url=fields.get("url", b"").decode(errors="replace"),
            attempts=0,
            error=problem,
            ts_ms=now_ms(),
            source=f"{self.keys.outbox} {entry_id}",
        )
        await self._run(self._dead_lettered(letter, entry_id, "malformed"))
        self._count("dead-lettered")
        log.warning("%s: dead-lettered", problem)

    def _dead_lettered(self, letter: Letter, entry_id: str, outcome: str) -> list[tuple[Any, ...]]:
        """The dead letter, then (on a cluster: once it is written) the entry settled."""
        return [
            *dead_letter_commands(self.conn, letter),
            ORDER_BARRIER,
            *self._done(entry_id, outcome),
        ]

    def _done(
        self, entry_id: str, outcome: str, *, also: Sequence[tuple[Any, ...]] = ()
    ) -> list[tuple[Any, ...]]:
        """Count the attempt's ``outcome`` (``agent_reach_webhook_deliveries_total``), then
        acknowledge and delete the entry together with ``also`` (commands on the outbox
        itself: one key, one slot), atomically. A stop between the two counts the attempt
        again when the entry is handled again: it is made again."""
        outbox = self.keys.outbox
        return [
            *count_commands(self.conn, field("webhooks", outcome)),
            ("MULTI",),
            *also,
            ("XACK", outbox, NOTIFY_GROUP, entry_id),
            ("XDEL", outbox, entry_id),
            ("EXEC",),
        ]

    async def _run(self, commands: list[tuple[Any, ...]]) -> None:
        for reply in await self.conn.call_many(commands):
            if isinstance(reply, Exception):
                raise reply

    def _count(self, action: str) -> None:
        self.handled[action] = self.handled.get(action, 0) + 1


class _BodyStage(msgspec.Struct):
    stage: str = ""


def _stage_of(body: bytes) -> str:
    """The ``stage`` a result body names, for its dead letter; ``""`` for a body that is no
    JSON object, or nests too deeply to read."""
    try:
        return msgspec.json.decode(body, type=_BodyStage).stage
    except (msgspec.DecodeError, RecursionError):
        return ""
