"""What became of one webhook delivery, written: delivered, retried later, or dead-lettered.

Each settlement acknowledges and deletes the outbox entry in one ``MULTI`` on its own
partition (:func:`broker.keyspace.outbox_for`), with what else must go with it: a retry is a
new entry on the same partition (``attempt`` + 1, ``not_before_ms`` after an exponential
back-off with jitter, ``last_error``), so it is as durable as the first attempt. A dead letter
is written first and awaited (on a cluster ``P:dlq`` is another slot): a crash between the
two leaves the entry pending, to be settled again, never a delivery lost without its letter.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import msgspec

from broker.cluster_map import ORDER_BARRIER
from broker.connection import Connection
from broker.deadletters import Letter
from broker.delivery import count_commands, dead_letter_commands
from broker.entries import fields_as_bytes
from broker.events import is_event_delivery
from broker.keyspace import NOTIFY_GROUP
from broker.metric_fields import field
from broker.redaction import url_without_password
from broker.retry import retry_delay_ms
from broker.streams import field_bytes
from broker.timekeeping import now_ms
from broker.timeline import CALLBACK_DELIVERED, note_command
from broker.wire import OutboxEntry, outbox_fields, parse_outbox_entry

from .webhook_post import Attempt

log = logging.getLogger("agent_reach.notifier")

UNDELIVERABLE = "callback_undeliverable"


class Delivery(OutboxEntry, frozen=True, kw_only=True):
    """An outbox entry as the notifier holding it sees it: what it says, and which entry of
    which partition it is."""

    stream: str
    entry_id: str


def parse_delivery(stream: str, entry_id: str, fields: dict[str, bytes]) -> Delivery | str:
    """The delivery an outbox entry describes (:func:`broker.wire.parse_outbox_entry`), or
    why it describes none. Never raises, whatever bytes the entry holds (anyone who can
    ``XADD`` can write one)."""
    entry = parse_outbox_entry(fields)
    if isinstance(entry, str):
        return f"malformed outbox entry {entry_id}: {entry}"
    return Delivery(stream=stream, entry_id=entry_id, **msgspec.structs.asdict(entry))


def backoff_ms(
    attempt: int, *, base_ms: int, cap_ms: int, jitter: float, rng: random.Random
) -> int:
    """The wait after failed attempt ``attempt`` (1 for the first): ``base_ms`` doubled for
    every attempt before it, at most ``cap_ms``, spread by ±``jitter`` (and still at most
    ``cap_ms``) so that receivers coming back from an outage are not hit all at once."""
    spread = retry_delay_ms(attempt, base_ms=base_ms, jitter=jitter, rng=rng, cap_ms=cap_ms)
    return min(cap_ms, spread)


class Settlement:
    """Writes the outcome of deliveries; counts them in :attr:`handled` (delivered / retried /
    dead-lettered) over the notifier's life."""

    def __init__(self, conn: Connection, rng: random.Random) -> None:
        self.conn = conn
        self.settings = conn.settings
        self.rng = rng
        self.handled: dict[str, int] = {}

    async def settle(self, delivery: Delivery, attempt: Attempt) -> None:
        if attempt.delivered:
            await self._delivered(delivery, attempt)
        elif not attempt.final and delivery.attempt < self.settings.webhook_attempts:
            await self._retry_later(delivery, attempt)
        else:
            await self._dead_letter(delivery, attempt)

    async def _delivered(self, delivery: Delivery, attempt: Attempt) -> None:
        shown = url_without_password(delivery.url)  # the timeline and the log: no password
        reason = f"webhook {shown} {attempt.detail} (attempt {delivery.attempt})"
        done = self._done(delivery.stream, delivery.entry_id, "delivered")
        if not is_event_delivery(delivery.message_id):  # an event's has no timeline
            note = note_command(
                self.conn, delivery.message_id, CALLBACK_DELIVERED, reason, now_ms=now_ms()
            )
            done.insert(0, note)
        await self._run(done)
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
        added = ("XADD", delivery.stream, "*", *outbox_fields(retry))
        await self._run(self._done(delivery.stream, delivery.entry_id, "retried", also=[added]))
        self._count("retried")
        log.warning(
            "message %s: webhook %s %s (attempt %d of %d), next in %d ms",
            delivery.message_id,
            url_without_password(delivery.url),
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
        await self._run(self._dead_lettered(letter, delivery.stream, delivery.entry_id, "dead"))
        self._count("dead-lettered")
        log.warning(
            "message %s: webhook %s undeliverable after %d attempt(s), dead-lettered: %s",
            delivery.message_id,
            url_without_password(delivery.url),
            posts,
            attempt.detail,
        )

    async def malformed(
        self, stream: str, entry_id: str, fields: dict[str, bytes], problem: str
    ) -> None:
        """An entry no delivery can be read from: dead-lettered with what is wrong."""
        letter = Letter(
            id=fields.get("id", b"").decode(errors="replace"),
            stage=_stage_of(fields.get("body", b"")),
            reason=UNDELIVERABLE,
            raw=fields_as_bytes((field_bytes(name), value) for name, value in fields.items()),
            url=fields.get("url", b"").decode(errors="replace"),
            attempts=0,
            error=problem,
            ts_ms=now_ms(),
            source=f"{stream} {entry_id}",
        )
        await self._run(self._dead_lettered(letter, stream, entry_id, "malformed"))
        self._count("dead-lettered")
        log.warning("%s: dead-lettered", problem)

    def _dead_lettered(
        self, letter: Letter, stream: str, entry_id: str, outcome: str
    ) -> list[tuple[Any, ...]]:
        """The dead letter, then (on a cluster: once it is written) the entry settled."""
        return [
            *dead_letter_commands(self.conn, letter),
            ORDER_BARRIER,
            *self._done(stream, entry_id, outcome),
        ]

    def _done(
        self, stream: str, entry_id: str, outcome: str, *, also: Sequence[tuple[Any, ...]] = ()
    ) -> list[tuple[Any, ...]]:
        """Count the attempt's ``outcome`` (``agent_reach_webhook_deliveries_total``), then
        acknowledge and delete the entry together with ``also`` (commands on the same
        partition: one key, one slot), atomically. A stop between the two counts the attempt
        again when the entry is handled again: it is made again."""
        return [
            *count_commands(self.conn, field("webhooks", outcome)),
            ("MULTI",),
            *also,
            ("XACK", stream, NOTIFY_GROUP, entry_id),
            ("XDEL", stream, entry_id),
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
