"""The notifier's second job: each fleet event, to every subscription that wants it.

A relay reads ``P:events`` in the consumer group ``events`` (notifiers share it: each event
is relayed by one) and, for each event and each matching subscription (config's and
``P:subs``'), adds a delivery to the outbox — the same entries result webhooks are, so the
notifier's one delivery engine signs them (Standard Webhooks; ``webhook-id`` =
``<event entry id>.<subscription id>``), retries them with back-off, guards their egress and
dead-letters what cannot be delivered. The event is acknowledged once its deliveries are
written: a relay that stops in between relays it again (at least once). An event with no
subscription is acknowledged at once, so nothing piles up in the group; the stream itself
is capped (``events_max``) and kept for ``agent-reach events``.

An entry that does not read as an event (anyone who can ``XADD`` can write one) is skipped
with a log line and acknowledged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus

from broker.connection import Connection, ensure_group
from broker.errors import RedisReplyError, RedisUnavailable
from broker.event_log import events_key
from broker.events import Event, delivery_ids, event_body, parse_event
from broker.idle_claims import IdleClaim
from broker.keyspace import outbox_for
from broker.streams import GroupReader, StreamEntry, parse_entries
from broker.subscription_store import SubscriptionStore
from broker.subscriptions import Subscription
from broker.wire import OutboxEntry, outbox_fields

log = logging.getLogger("agent_reach.notifier")

EVENTS_GROUP = "events"
BATCH = 256
CLAIM_BATCHES = 16  # batches of another notifier's pending events taken over at a time
READ_BLOCK_MS = 1000


def deliveries(event: Event, subscriptions: dict[str, Subscription]) -> list[OutboxEntry]:
    """The outbox entries of one event: one per subscription it matches. Pure."""
    body = event_body(event)
    found = []
    for sub_id, subscription in subscriptions.items():
        if subscription.matches(event.type):
            message_id, webhook_id = delivery_ids(event.id, sub_id)
            found.append(
                OutboxEntry(
                    message_id=message_id, webhook_id=webhook_id, url=subscription.url, body=body
                )
            )
    return found


class EventRelay:
    def __init__(self, conn: Connection, *, consumer: str) -> None:
        self.conn = conn
        self.consumer = consumer
        self.stream = events_key(conn)
        self.subscriptions = SubscriptionStore(conn)
        self.relayed = 0  # deliveries written to the outbox, over its life
        self.skipped = 0  # entries that did not read as events
        self.abandoned = IdleClaim(conn, self.stream, EVENTS_GROUP, consumer)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await ensure_group(self.conn, self.stream, EVENTS_GROUP)
        async with self.conn.reader() as reader:
            await self._recover(reader)
            task_status.started()
            await self._loop(reader)

    async def _recover(self, reader: GroupReader) -> None:
        """This consumer's own pending events (a restart): relayed again."""
        while entries := await self._read(reader, pending=True):
            await self.relay(entries)

    async def _loop(self, reader: GroupReader) -> None:
        backoff = 0.1
        claim_every = self.conn.settings.claim_idle_s
        next_claim = anyio.current_time() + claim_every
        while True:
            try:
                await self.relay(await self._read(reader, pending=False))
                if anyio.current_time() >= next_claim:
                    next_claim = anyio.current_time() + claim_every
                    await self.take_over_abandoned()
            except (RedisUnavailable, RedisReplyError) as exc:
                backoff = min(backoff * 2, 5.0)
                log.warning("event relay failed, retrying in %.1fs: %s", backoff, exc)
                await anyio.sleep(backoff)
                continue
            backoff = 0.1

    async def _read(self, reader: GroupReader, *, pending: bool) -> list[StreamEntry]:
        return await reader.read(
            self.stream,
            EVENTS_GROUP,
            self.consumer,
            count=BATCH,
            block_ms=None if pending else READ_BLOCK_MS,
            pending=pending,
        )

    async def take_over_abandoned(self) -> None:
        """Events pending with a notifier that stopped for ``claim_idle_s``: taken over and
        relayed a batch at a time, up to :data:`CLAIM_BATCHES` each time (the next goes on
        from there)."""
        idle_ms = int(self.conn.settings.claim_idle_s * 1000)
        async for claimed in self.abandoned.sweep(idle_ms, BATCH, CLAIM_BATCHES):
            if claimed.gone:  # trimmed while pending (6.2)
                await self.conn.call("XACK", self.stream, EVENTS_GROUP, *claimed.gone)
            await self.relay(parse_entries(claimed.entries))

    async def relay(self, entries: Sequence[StreamEntry]) -> int:
        """Write the deliveries of ``entries``, then acknowledge them. Returns how many
        deliveries were written."""
        if not entries:
            return 0
        subscriptions = await self.subscriptions.all()
        commands: list[tuple[Any, ...]] = []
        for entry_id, fields in entries:
            event = parse_event(entry_id, fields)
            if isinstance(event, str):
                self.skipped += 1
                log.warning("skipped, not relayed: %s", event)
                continue
            for delivery in deliveries(event, subscriptions):
                outbox = outbox_for(self.conn.keys, delivery.message_id)
                commands.append(("XADD", outbox, "*", *outbox_fields(delivery)))
        if commands:
            await self.conn.run_all(commands)
        await self.conn.call("XACK", self.stream, EVENTS_GROUP, *(e[0] for e in entries))
        self.relayed += len(commands)
        return len(commands)
