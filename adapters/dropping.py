"""Entries a sidecar cannot take or finish: each is dead-lettered with its bytes and why,
acknowledged, and its credit returned where it holds one. Nothing runs, or nothing more.

Two kinds come here. An entry that is no assignment (someone else wrote to the stream: a
*malformed entry*) holds no credit, since only ``lua/assign.lua`` takes credits. An
assignment whose record Redis cannot move (an *unusable record*: a key of another type, or
fields no version wrote, which anyone allowed to write records can make) holds one; it is
dropped when it is taken, or when its outcome cannot be written, so that one such record
never holds up the others — the intake's batch, or the finisher's round — for ever. The
producer of an outcome dropped so is told its message ended DEAD, and why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from broker.connection import Connection
from broker.deadletters import Letter
from broker.delivery import Delivery, dead_letter_commands, producer_commands, write_letters
from broker.entries import fields_as_bytes
from broker.envelope import Envelope
from broker.errors import RedisReplyError
from broker.keyspace import SIDECAR_GROUP
from broker.results import Command
from broker.stages import Stage
from broker.streams import field_bytes
from broker.timekeeping import now_ms

from .holdings import Finished, Taken, release_of

log = logging.getLogger("agent_reach.sidecar")

MalformedEntry = tuple[str, dict[str, bytes], str]  # entry id, its fields, why


def unusable(taken: Sequence[Taken], answers: Sequence[object]) -> list[tuple[Taken, str]]:
    """The entries whose record Redis could not move: an error reply for that entry alone,
    with the error. A refusal to this user concerns them all: it is raised."""
    for answer in answers:
        if isinstance(answer, RedisReplyError) and answer.permission_refused:
            raise answer
    return [
        (t, str(a)) for t, a in zip(taken, answers, strict=True) if isinstance(a, RedisReplyError)
    ]


async def drop_unusable(
    conn: Connection,
    instance_id: str,
    taken: Sequence[Taken],
    answers: Sequence[object],
    finished: Sequence[Finished] = (),
) -> set[str]:
    """Drop the entries :func:`unusable` finds among ``taken``; returns their entry ids.

    The producer of one among ``finished`` that holds its envelope (an outcome the finisher
    could not record) is told first that it ended DEAD, and why, as the dead letter
    says: the call ran, but its outcome is on no record, and a producer left waiting would
    hear nothing until its own timeout. (At the take there is no envelope, nor a call: that
    message is the reaper's, from its deadline.)"""
    failed = unusable(taken, answers)
    if not failed:
        return set()
    envelopes = {i.taken.entry_id: i.envelope for i in finished if i.envelope is not None}
    told = [(t, envelopes.get(t.entry_id), why) for t, why in failed]
    await tell_dead(conn, [(t, e, f"unusable_record: {why}") for t, e, why in told if e])
    entries = [
        (t.entry_id, {"id": t.message_id.encode(), "attempt": b"%d" % t.attempt}, why)
        for t, why in failed
    ]
    await drop_entries(conn, instance_id, entries, "unusable_record", [t for t, _ in failed])
    return {t.entry_id for t, _ in failed}


async def tell_dead(conn: Connection, ended: Sequence[tuple[Taken, Envelope, str]]) -> None:
    """Tell each producer its message ended DEAD with the error given (a reply Redis refuses
    is dead-lettered, as any reply)."""
    owners: list[str] = []
    commands: list[Command] = []
    for taken, envelope, error in ended:
        for command in producer_commands(
            conn, envelope, Stage.DEAD, None, error, attempt=taken.attempt
        ):
            owners.append(taken.message_id)
            commands.append(command)
    if commands:
        replies = await conn.call_many(commands)
        await Delivery(conn).after_delivery(owners, commands, replies)


async def drop_entries(
    conn: Connection,
    instance_id: str,
    entries: list[MalformedEntry],
    kind: str = "malformed_entry",
    assigned: list[Taken] | None = None,
) -> None:
    """Dead-letter each entry with its bytes and why (``kind``), and acknowledge it; an
    ``assigned`` one's credit is returned with the acknowledgement (where there is none,
    nothing is freed)."""
    if not entries:
        return
    queue = conn.keys.queue(instance_id)
    letters = [
        command
        for entry_id, fields, why in entries
        for command in dead_letter_commands(
            conn,
            Letter(
                id="",
                reason=f"{kind}: {why}",
                raw=fields_as_bytes((field_bytes(k), v) for k, v in fields.items()),
                source=f"{queue} {entry_id}",
                ts_ms=now_ms(),
            ),
        )
    ]
    ack: Command = ("XACK", queue, SIDECAR_GROUP, *(e for e, _, _ in entries))
    if assigned is not None:
        ack = release_of(conn, instance_id, [Finished(t, []) for t in assigned])
    # the letters first: one Redis cannot write now (out of memory, say) holds the entries
    # pending, to be dropped again, rather than acknowledged with nothing to show for them;
    # one refused for good (a spoiled count, a poisoned stream) is said, and the entries go
    await write_letters(conn, letters, f"{kind} of {queue}")
    await conn.run_all([ack])
    log.warning("dropped %d entries from %s (%s)", len(entries), queue, kind)
