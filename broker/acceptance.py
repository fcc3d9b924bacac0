"""A message record's creation: what ``lua/accept.lua`` (and the scripts that assign with it,
``lua/accept_assign.lua`` and ``lua/accept_direct.lua``) is given, built in one place for the
dispatcher's admission and the producer's direct lane (:mod:`broker.direct`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .connection import Connection
from .credits import assign_keys
from .envelope import Envelope, encode_envelope
from .keyspace import due_for
from .scripts import ScriptName
from .stages import TERMINAL, Stage
from .timekeeping import now_ms

ACCEPT_ARGS = 12  # accept.lua's ARGV before the record's further fields


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Everything ``lua/accept.lua`` needs to create one record and take its first step."""

    message_id: str
    envelope_json: bytes
    capability: str
    deadline_ms: int
    reply_to: str
    priority: int
    next_stage: Stage
    accepted_ms: int
    instance: str = ""
    reason: str = ""
    fields: Mapping[str, str | bytes] | None = None
    # On a single server, a record ROUTED to ``instance`` may be assigned there in the same
    # script (``lua/accept_assign.lua``), its deadline entry written at this time (ms)
    assign_due_ms: int = 0
    # ``reply_to`` is the accepted envelope's own: the record stores no copy of it (read back
    # by broker.record_codec) — unless REJECTED: a rejected record keeps the reply_to it was
    # answered on (an invalid envelope's checked, salvaged one), never the envelope's
    reply_to_in_envelope: bool = False


def acceptance_of(
    envelope: Envelope,
    now: int,
    deadline_ms: int,
    next_stage: Stage,
    reason: str,
    fields: Mapping[str, str | bytes],
    *,
    instance: str = "",
    envelope_json: bytes | None = None,
    assign_due_ms: int = 0,
) -> Acceptance:
    """The acceptance of an envelope as the ingress gave it (``envelope_json``: its bytes
    already encoded; ``assign_due_ms``: see :attr:`Acceptance.assign_due_ms`)."""
    return Acceptance(
        message_id=envelope.message_id,
        envelope_json=encode_envelope(envelope) if envelope_json is None else envelope_json,
        capability=envelope.capability,
        deadline_ms=deadline_ms,
        reply_to=envelope.reply_to or "",
        priority=envelope.priority,
        next_stage=next_stage,
        accepted_ms=now,
        instance=instance,
        reason=reason,
        fields=fields,
        assign_due_ms=assign_due_ms,
        reply_to_in_envelope=True,
    )


def accept_args(
    conn: Connection,
    a: Acceptance,
    *,
    timeline_max: int | None = None,
    max_series: int | None = None,
) -> tuple[Any, ...]:
    """``lua/accept.lua``'s ARGV: :data:`ACCEPT_ARGS` of them, then the further fields. The
    timeline's cap and the counters' are this connection's settings unless given (another
    process's: a direct lane's)."""
    assert a.next_stage in (Stage.ROUTED, Stage.WAITING, Stage.REJECTED, Stage.FANNED_OUT)
    ttl = conn.settings.record_ttl_s if a.next_stage in TERMINAL else ""
    if timeline_max is None:
        timeline_max = conn.settings.timeline_max
    if max_series is None:
        max_series = conn.counting().max_series
    return (
        a.envelope_json,
        a.capability,
        a.accepted_ms,
        a.deadline_ms,
        "" if a.reply_to_in_envelope and a.next_stage is not Stage.REJECTED else a.reply_to,
        a.priority,
        timeline_max,
        a.next_stage.value,
        a.instance,
        a.reason,
        ttl,
        max_series,
        *(item for pair in (a.fields or {}).items() for item in pair),
    )


def accept_command(conn: Connection, a: Acceptance) -> tuple[Any, ...]:
    args = accept_args(conn, a)
    counting = conn.counting()
    record = conn.keys.record(a.message_id)
    if a.assign_due_ms:
        assert a.next_stage is Stage.ROUTED and not conn.cluster
        down_after_ms = int(conn.settings.down_after_s * 1000)
        keys = (
            record,
            *assign_keys(conn, a.instance),
            due_for(conn.keys, a.message_id),
            *counting.keys(record),
        )
        first, fields = args[:ACCEPT_ARGS], args[ACCEPT_ARGS:]
        fused = (*first, a.message_id, down_after_ms, a.assign_due_ms, now_ms(), *fields)
        return conn.script_command(ScriptName.ACCEPT_ASSIGN, keys, fused)
    keys = (record, *counting.keys(record))
    return conn.script_command(ScriptName.ACCEPT, keys, args)
