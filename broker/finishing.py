"""A sidecar's finishing round in one round trip, on one server (``lua/finish.lua``).

The outcomes' moves (``lua/transition.lua``, one script each) and then ``finish.lua`` go in
one pipeline: the script reads each record to see whether its move was made, tells the
producers of those that were, and frees every credit it may. What took three round trips —
record, then tell, then release — takes one, and the order stays what it was: no reply for an
outcome that is not on the record, no credit back before its replies are out or, where Redis
refused one, before it is dead-lettered (the caller does that, then releases the entry with
``lua/release.lua``).

Only plain replies fit (``XADD`` and ``EXPIRE``: a reply stream, a webhook's outbox entry). A
broadcast child's outcome is a script of its own (``lua/child_done.lua``, which a script
cannot call), and on a cluster the keys live on several nodes: those rounds take the three
round trips (:func:`fits`). So do they where writes wait for replicas (``replica_acks``,
:mod:`broker.durability`): the one ``WAIT`` would come after the replies, and a producer could
be told of an outcome a failover then takes back.

One difference from three round trips: a record that moves on in the moment between its
outcome's move and this script (an operator's replay of a message that has just ended) is
released untold — its replay ends it again, and that answer is told.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .connection import Connection
from .errors import RedisReplyError, RedisUnavailable, script_error_text
from .notifications import credit_announcement
from .resp import Command, error_reply
from .scripts import ScriptName
from .store import Move, move_command, move_sources

TELLING = frozenset({"XADD", "EXPIRE"})  # the commands finish.lua runs for a producer


@dataclass(frozen=True, slots=True)
class Ending:
    """One finished entry: its credit, its outcome's move (or none), its producer's replies."""

    member: str  # "<message id>:<attempt>", in the instance's in-flight set
    entry_id: str
    settle: Move | None
    replies: list[Command]


@dataclass(frozen=True, slots=True)
class FinishAnswer:
    """What ``finish.lua`` did not release, by index in the endings: those whose move was not
    made; the one whose reply Redis refused (the script stops there), with the command's index
    and the refusal (:class:`RedisUnavailable` for "not now": OOM, READONLY, …); and those the
    script did not reach after it."""

    freed: int
    unmoved: frozenset[int]
    refused: dict[int, tuple[int, RedisReplyError | RedisUnavailable]]
    unreached: frozenset[int]


def fits(conn: Connection, instance_id: str, endings: list[Ending]) -> bool:
    """Whether these endings can finish in one round trip (see the module's docstring)."""
    if conn.cluster or conn.settings.replica_acks:
        return False
    return all(_fits(instance_id, e) for e in endings)


def _fits(instance_id: str, e: Ending) -> bool:
    if any(command[0] not in TELLING for command in e.replies):
        return False
    m = e.settle
    return m is None or (
        m.expect_attempt is not None
        and m.expect_instance == instance_id
        and m.new_attempt is None
        and m.new_instance is None
        and not m.assign_look_ms
        and m.target.value not in move_sources(m).split(",")
    )


def finish_commands(
    conn: Connection, instance_id: str, group: str, endings: list[Ending]
) -> list[Command]:
    """The moves of the outcomes, then ``finish.lua`` (whose reply is the last)."""
    moves = [move_command(conn, e.settle) for e in endings if e.settle is not None]
    return [*moves, finish_command(conn, instance_id, group, endings)]


def finish_command(
    conn: Connection, instance_id: str, group: str, endings: list[Ending]
) -> Command:
    channel, sharded = credit_announcement(conn, instance_id)
    keys = (conn.keys.inflight(instance_id), conn.keys.queue(instance_id))
    args: list[Any] = [group, channel, instance_id, sharded]
    for e in endings:
        m = e.settle
        if m is None:
            args += [e.member, e.entry_id, "", "", "", "", len(e.replies)]
        else:
            record = conn.keys.record(m.message_id)
            sources = move_sources(m)
            args += [e.member, e.entry_id, record, sources, m.expect_attempt, m.target.value]
            args.append(len(e.replies))
        for name, key, *rest in e.replies:
            args += [len(rest), name, key, *rest]
    return conn.script_command(ScriptName.FINISH, keys, args)


def finish_answer(reply: list[Any]) -> FinishAnswer:
    """Read ``finish.lua``'s reply."""
    held: dict[int, set[int]] = {0: set(), 2: set()}
    refused: dict[int, tuple[int, RedisReplyError | RedisUnavailable]] = {}
    for entry in reply[1:]:
        index, kind = int(entry[0]) - 1, int(entry[1])
        if kind == 1:
            refused[index] = (int(entry[2]) - 1, error_reply(refusal_text(entry[3])))
        else:
            held[kind].add(index)
    return FinishAnswer(int(reply[0]), frozenset(held[0]), refused, frozenset(held[2]))


def refusal_text(value: Any) -> str:
    """An error a script's ``redis.pcall`` met, as Redis would answer it to a client."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return script_error_text(text)
