"""Telling producers: replies, webhooks (via the outbox), a broadcast parent's children's
outcomes — and the dead letters that take what cannot be told."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from .connection import Connection
from .deadletters import Letter, cap_text, dead_letter_command, letter_kind
from .envelope import Envelope, load_envelope
from .errors import RedisUnavailable, raised
from .event_log import event_command
from .events import is_event_delivery
from .keyspace import due_for
from .metric_fields import field
from .record_codec import pairs, readable_record, timeline_entries
from .results import Command, delivery_commands
from .scripts import ScriptName
from .stages import Stage
from .timekeeping import now_ms
from .wire import ReplyEntry, reply_fields

log = logging.getLogger("agent_reach.delivery")

EVENT_REASON_BYTES = 512  # of a dead letter's reason, in its event


def dead_letter_commands(conn: Connection, letter: Letter) -> list[Command]:
    """The capped ``XADD`` of ``letter`` to ``P:dlq`` (:mod:`broker.deadletters`), its
    count (``agent_reach_dead_letters_total``) and its ``message.dead`` event — the one place
    every dead letter is written from. An event delivery's own letter reports no event: a
    subscription whose receiver is down must not feed itself."""
    s = conn.settings
    kind = letter_kind(letter)
    commands = [
        dead_letter_command(
            conn.keys, letter, max_entries=s.dlq_max_entries, max_bytes=s.dlq_entry_max_bytes
        )
    ]
    if not is_event_delivery(letter.id):
        reason = cap_text(letter.reason, EVENT_REASON_BYTES)
        commands.append(
            event_command(
                conn, "message.dead", letter.id, reason=reason, stage=letter.stage, label=kind
            )
        )
    return commands + count_commands(conn, field("dead_letters", kind))


async def write_letters(conn: Connection, commands: list[Command], what: str) -> None:
    """Send :func:`dead_letter_commands` (of one letter or several). A Redis that cannot
    write now (:class:`RedisUnavailable`: out of memory, a failover) raises: the caller keeps
    what the letter is for, to write it again. A refusal for good — a counter someone made no
    number, a stream whose ids someone ran to the last (any writer of ``P:dlq`` or
    ``P:events`` can) — is logged, and the caller goes on: a letter that can never be written
    must not hold the work it is about, nor the work behind it."""
    for reply in await conn.call_many(commands):
        if isinstance(reply, RedisUnavailable):
            raise reply
        if isinstance(reply, Exception):
            log.error("a dead letter (%.200s) was not all written: %s", what, reply)


def count_commands(conn: Connection, *fields: str) -> list[Command]:
    """Counts not made inside a script (a dead letter, a webhook attempt, an agent's
    acceptance): each ``HINCRBY`` sent with what it counts."""
    key = conn.counting().key
    return [("HINCRBY", key, f, 1) for f in fields] if key else []


def producer_commands(
    conn: Connection,
    envelope: Envelope,
    stage: Stage,
    result: bytes | None,
    error: str | None,
    *,
    attempt: int,
) -> list[Command]:
    """:func:`broker.results.delivery_commands` with this broker's reply TTL."""
    return delivery_commands(
        conn.keys,
        envelope,
        stage,
        result,
        error,
        attempt=attempt,
        reply_ttl_s=conn.settings.reply_ttl_s,
        counting=conn.counting(),
    )


class Delivery:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys

    async def send_reply(self, reply_to: str, entry: ReplyEntry) -> None:
        """One entry on a reply stream (a notice, say), which then expires ``reply_ttl_s``
        after it; a stream Redis refuses to write is dead-lettered, as for any reply."""
        commands: list[Command] = [
            ("XADD", reply_to, "*", *reply_fields(entry)),
            ("EXPIRE", reply_to, self.conn.settings.reply_ttl_s),
        ]
        await self.after_delivery([entry.id] * 2, commands, await self.conn.call_many(commands))

    async def tell_deadline_passed(self, message_id: str, reply_to: str, attempt: int) -> None:
        """Once (the record's ``deadline_told``): the producer learns that the message's
        deadline passed while the agent may still work on it."""
        if await self.conn.call("HSETNX", self.conn.keys.record(message_id), "deadline_told", 1):
            notice = ReplyEntry(
                id=message_id,
                stage=Stage.PROCESSING,
                attempt=attempt,
                notice="deadline_passed",
                error="the deadline passed while the agent may still be working on it",
            )
            await self.send_reply(reply_to, notice)

    async def dead_letter_message(self, message_id: str, reason: str) -> None:
        """Dead-letter a record: its envelope, the final reason, and the chain of reasons on
        its timeline (JSON ``[[stage, instance, attempt, reason], ...]``)."""
        flat, legacy = await self.conn.call_many(
            [
                ("HGETALL", self.keys.record(message_id)),
                ("LRANGE", self.keys.timeline(message_id), 0, -1),
            ]
        )
        fields = pairs(raised(flat))
        record = readable_record(message_id, fields) if flat else None
        timeline = timeline_entries(fields.get(b"timeline"), raised(legacy))
        chain = [[e.stage, e.instance, e.attempt, e.reason] for e in timeline if e.reason]
        await self.dead_letter(
            Letter(
                id=message_id,
                stage=record.stage.value if record else "DEAD",
                reason=reason,
                raw=record.envelope if record else b"",
                chain=msgspec.json.encode(chain),
                ts_ms=now_ms(),
            )
        )

    async def dead_letter(self, letter: Letter) -> None:
        await write_letters(self.conn, dead_letter_commands(self.conn, letter), letter.reason)

    async def deliver(
        self,
        envelope: Envelope | bytes,
        stage: Stage,
        result: bytes | None = None,
        error: str | None = None,
        *,
        attempt: int,
    ) -> None:
        """Tell the producer how ``attempt`` of the message ended (:mod:`broker.results`), in
        one round trip."""
        if isinstance(envelope, bytes):
            envelope = load_envelope(envelope)
        commands = producer_commands(self.conn, envelope, stage, result, error, attempt=attempt)
        if commands:
            owners = [envelope.message_id] * len(commands)
            await self.after_delivery(owners, commands, await self.conn.call_many(commands))

    async def after_delivery(
        self, owners: list[str], commands: list[Command], replies: list[Any]
    ) -> None:
        """Read the replies of :func:`~broker.results.delivery_commands` (``owners``: the
        message each command is for).

        A delivery Redis refused for good (``reply_to`` names a key that is not a stream, say)
        is dead-lettered with its reason: one producer's bad ``reply_to`` must not stop the
        process that ended the message. A lost connection is raised: it is sent again.

        A broadcast child's outcome that ended its parent (``lua/child_done.lua``) makes this
        the parent's ender: its own producer is told, then its ``reply_pending`` mark and
        deadline entry go. A stop in between leaves ``reply_pending`` to the reaper, or to
        the re-sent child outcome (the script answers a repeat with the untold parent)."""
        ended: list[tuple[bytes, bytes]] = []
        child_done = self.conn.sha(ScriptName.CHILD_DONE)
        for message_id, command, reply in zip(owners, commands, replies, strict=True):
            if isinstance(reply, RedisUnavailable):
                raise reply
            if isinstance(reply, Exception):
                await self.dead_letter(
                    Letter(
                        id=message_id,
                        reason=f"{self._delivery_kind(command)}_undeliverable: {reply}",
                        ts_ms=now_ms(),
                    )
                )
            elif command[:2] == ("EVALSHA", child_done) and reply[0] in (1, 2):
                ended.append((reply[2], reply[1]))
        for envelope, result in ended:
            await self._tell_parent(load_envelope(envelope), result)

    async def _tell_parent(self, parent: Envelope, result: bytes) -> None:
        await self.deliver(parent, Stage.SUCCEEDED, result, attempt=0)  # a parent: attempt 0
        parent_id = parent.message_id
        await self.conn.run_all(
            [
                ("HDEL", self.keys.record(parent_id), "reply_pending"),
                ("ZREM", due_for(self.keys, parent_id), parent_id),
            ]
        )

    def _delivery_kind(self, command: Command) -> str:
        if command[0] in ("EVALSHA", "ZADD"):  # a broadcast child's, for its parent
            return "broadcast_outcome"
        return "webhook" if command[1] == self.keys.outbox else "reply"  # XADD or EXPIRE
