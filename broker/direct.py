"""The producer's side of the direct lane (rules and lane text: :mod:`broker.direct_lane`).

:meth:`DirectLane.submit` assigns a plain envelope to its capability's lane instance in one
script, ``lua/accept_direct.lua``, as a dispatcher would have: the record created ROUTED with
the decision the lane carries, its deadline entry, the stream entry and the credit. It
answers ``False`` whenever that is not certain to be right, having written nothing: no lane,
an envelope the dispatcher would look at more closely (:func:`~broker.direct_lane.plain`) or
refuse (the dispatcher's own decoding, run here on the same bytes), work waiting, no free
credit, an id that names a record already. The caller then sends the envelope to the
ingress, where it is judged as before.

Lanes are read at most once a second per capability (``GET``; that there is none, too),
kept meanwhile. A user that
may not run the script (``NOPERM``: a producer's ACL, which grants the ingress only) turns the
lane off for this connection, said once: such a producer never writes records. Off where
the producer's own settings say ``direct_lane = false``, on a
cluster (the record, the instance's keys and the lane are on other slots) and where writes
wait for replicas (the dispatcher's round trips carry the ``WAIT``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .acceptance import ACCEPT_ARGS, accept_args, acceptance_of
from .connection import Connection
from .credits import assign_keys
from .direct_lane import LANE_READ_EVERY_S, Lane, plain, read_lane
from .envelope import Envelope, decode_envelope
from .errors import InvalidEnvelope, RedisReplyError
from .keyspace import DISPATCH_GROUP, direct_lane, due_for
from .scripts import ScriptName
from .stages import Stage
from .waiting_sets import ASSIGNED_KEEP_S, RATE_WINDOW_MS, assigned_counter_stem

log = logging.getLogger("agent_reach.client")

MAX_LANES_KEPT = 1024  # capabilities whose lane (or its absence) a client remembers


class DirectLane:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        settings = conn.settings
        self.usable = settings.direct_lane and not conn.cluster and not settings.replica_acks
        self._read: dict[str, tuple[float, Lane | None]] = {}  # capability -> (when, lane)

    async def submit(self, envelope: Envelope, raw: bytes, ingress: str) -> str | None:
        """Assign ``envelope`` (``raw``: its bytes, as ``ingress`` would get them) down its
        capability's lane: the instance it went to, or ``None``, having written nothing."""
        if not (self.usable and plain(envelope)):
            return None
        lane = await self._lane(envelope.capability)
        if lane is None or not self._decodes(raw, lane.max_bytes):
            return None
        try:
            answer = await self.conn.call(*self._command(envelope, raw, lane, ingress))
        except RedisReplyError as exc:
            self._refused(exc)
            return None
        # withdrawn, changed, or deleted by the script: read it again; a lane held back only
        # by what the ingress still holds is kept as it is (no GET per message meanwhile)
        if answer[0] == -1 and answer[1] != b"ingress":
            self._read.pop(envelope.capability, None)
        return lane.instance if answer[0] == 1 else None

    def _decodes(self, raw: bytes, max_bytes: int) -> bool:
        """Whether the dispatcher would take these bytes: its own decoding, with the largest
        envelope it takes (the lane says)."""
        try:
            decode_envelope(raw, max_bytes=max_bytes, reply_prefix=self.conn.keys.reply_prefix)
        except InvalidEnvelope:
            return False
        return True

    async def _lane(self, capability: str) -> Lane | None:
        """The capability's lane, read (and its text decoded) at most once a second."""
        now = time.monotonic()
        if capability in self._read:
            when, lane = self._read[capability]
            if now - when < LANE_READ_EVERY_S:
                return lane
        try:
            found = await self.conn.call("GET", direct_lane(self.conn.keys, capability))
        except RedisReplyError as exc:  # a key of another type, or a user who may not read it
            self._refused(exc)
            found = None
        lane = read_lane(found) if isinstance(found, bytes) else None
        self._read.pop(capability, None)
        self._read[capability] = (now, lane)  # the newest last: the oldest go first
        while len(self._read) > MAX_LANES_KEPT:  # a gateway's callers name any capabilities
            del self._read[next(iter(self._read))]
        return lane

    def _command(self, envelope: Envelope, raw: bytes, lane: Lane, ingress: str) -> tuple[Any, ...]:
        """``lua/accept_direct.lua``'s call: the record as the lane's dispatcher would make
        it (its settings, Redis's clock: the script sets the times)."""
        keys, capability = self.conn.keys, envelope.capability
        acceptance = acceptance_of(
            envelope,
            0,  # accepted and deadline: set by the script
            0,
            Stage.ROUTED,
            lane.route_reason,
            lane.fields,
            instance=lane.instance,
            envelope_json=raw,
        )
        args = accept_args(
            self.conn, acceptance, timeline_max=lane.timeline_max, max_series=lane.counters_max
        )
        record = keys.record(envelope.message_id)
        script_keys = (
            record,
            *assign_keys(self.conn, lane.instance),
            due_for(keys, envelope.message_id, lane.partitions),
            direct_lane(keys, capability),
            keys.waiting(capability),
            keys.unmatched(capability),
            ingress,
            *((lane.counters_key,) if lane.counters_key else ()),
        )
        first, fields = args[:ACCEPT_ARGS], args[ACCEPT_ARGS:]
        direct = (
            envelope.message_id,
            lane.down_after_ms,
            int(envelope.timeout_s * 1000),
            lane.delivery_ms,
            lane.instance,
            assigned_counter_stem(keys, capability),
            RATE_WINDOW_MS,
            ASSIGNED_KEEP_S,
            DISPATCH_GROUP,
        )
        return self.conn.script_command(
            ScriptName.ACCEPT_DIRECT, script_keys, (*first, *direct, *fields)
        )

    def _refused(self, exc: RedisReplyError) -> None:
        """A user that may not take the lane never will: off for this connection."""
        if exc.permission_refused and self.usable:
            self.usable = False
            log.info("the direct lane is not for this Redis user (%s): the ingress only", exc)
