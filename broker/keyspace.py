"""Every Redis key name Agent-Reach uses, built in one place.

========================  ======  ==========================================================
key                       type    holds
========================  ======  ==========================================================
``P:in``                  stream  ingress envelopes; consumer group ``dispatch``
``P:in:{<n>}``            stream  ingress partition n (``ingress_partitions`` > 1), likewise
``P:e:<stream>:<entry>``  string  the message id minted for an ingress entry without one
                                  whose entry time is ahead of the clock; until acknowledged
``P:idkey``               string  the key of the hash in ids derived from ingress entries
``P:m:{<id>}``            hash    message record: envelope, stage, attempt, instance, ...,
                                  and its timeline (capped; field ``timeline``)
``P:t:{<id>}``            list    a timeline as records kept it before it moved into them:
                                  read (first) while such a record lives, never written
``P:b:{<id>}``            hash    a broadcast's ended children: child id -> outcome JSON
``P:a:{<inst>}``          hash    instance card, live stats and state
``P:q:{<inst>}``          stream  work for one instance; consumer group ``sidecar``
``P:f:{<inst>}``          set     in-flight ``id:attempt`` members = credits in use
``P:k:{<inst>}``          string  the key of the instance's callback tokens (async agents)
``P:agents``              zset    instance -> last heartbeat (ms); the registry index
``P:w:{<capability>}``    zset    WAITING message ids, by priority then age
``P:x:{<capability>}``    zset    WAITING ids no instance can take at all (same scores)
``P:waiting``             set     capabilities that have had waiting work
``P:due``                 zset    message id -> deadline (ms): waiting work that may expire
``P:due:{<n>}``           zset    due set partition n (``ingress_partitions`` > 1), likewise
``P:s:{<session>}``        string  session -> instance (affinity), with a TTL
``P:n:{<capability>}:<w>``  string  assignments in 10-second window ``w`` (expires)
``P:direct:{<capability>}``  string  the capability's direct lane: its one instance and the
                                  decision to record (expires; ``broker/direct_lane.py``)
``P:direct``              set     the capabilities a dispatcher published a lane for
``P:dlq``                 stream  dead letters with their reason
``P:counters``            hash    cluster-wide counters: "kind, labels" (tab-separated) -> count
``P:outbox``              stream  webhook deliveries; consumer group ``notify``
``P:outbox:{<n>}``        stream  outbox partition n (``ingress_partitions`` > 1), likewise
``P:reply:<name>``        stream  results for one producer
``P:credit``              pubsub  instance ids whose credits were just released
``P:credit:{<inst>}``     spubsub  likewise, one instance's, sharded (a Redis 7 cluster)
``P:registry``            pubsub  instance ids whose card just changed
``P:events``              stream  fleet events (capped): type, subject, ts, detail
``P:subs``                hash    event subscription id -> JSON (url, event types)
``P:usage:<day>``         hash    usage of a UTC day: "dimension, name, figure" -> amount
``P:r:<scope>:{<name>}``  string  a rate limit's GCRA state (its theoretical arrival time)
``P:fb:{<agent>}``        list    an agent's recent feedback ratings (capped)
========================  ======  ==========================================================

Record, timeline and a broadcast's outcomes share the ``{<id>}`` hash tag; card, work stream
and in-flight set share ``{<inst>}``, so each Lua script touches a single cluster slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from .slots import crc16

DISPATCH_GROUP = "dispatch"
SIDECAR_GROUP = "sidecar"
NOTIFY_GROUP = "notify"


@dataclass(frozen=True, slots=True)
class Keyspace:
    prefix: str = "reach"
    partitions: int = 1  # ``ingress_partitions``: of the ingress, and of the due set

    @property
    def ingress(self) -> str:
        return f"{self.prefix}:in"

    def ingress_partition(self, n: int) -> str:
        """Partition ``n`` of the ingress: ``P:in`` for 0 (the name without partitions), else
        ``P:in:{n}`` (its own slot on a cluster)."""
        return self.ingress if n == 0 else f"{self.prefix}:in:{{{n}}}"

    @property
    def counters(self) -> str:
        """The cluster-wide counters (``lua/count.lua``, :mod:`broker.metric_fields`)."""
        return f"{self.prefix}:counters"

    @property
    def id_key(self) -> str:
        """The key of the keyed hash in message ids derived from ingress entries: made once
        (``SET NX``), readable by the broker's roles only."""
        return f"{self.prefix}:idkey"

    def entry_name(self, stream: str, entry_id: str) -> str:
        """The message id minted for ingress entry ``entry_id`` of ``stream`` (see
        :func:`broker.ids.entry_message_id`)."""
        return f"{self.prefix}:e:{stream.removeprefix(self.prefix + ':')}:{entry_id}"

    def record(self, message_id: str) -> str:
        return f"{self.prefix}:m:{{{message_id}}}"

    def timeline(self, message_id: str) -> str:
        """The list older records kept their timeline in (now the record's ``timeline``
        field): read while such a record lives, never written."""
        return f"{self.prefix}:t:{{{message_id}}}"

    def outcomes(self, parent_id: str) -> str:
        """A broadcast parent's children that have ended: child id -> outcome JSON."""
        return f"{self.prefix}:b:{{{parent_id}}}"

    def card(self, instance_id: str) -> str:
        return f"{self.prefix}:a:{{{instance_id}}}"

    def queue(self, instance_id: str) -> str:
        return f"{self.prefix}:q:{{{instance_id}}}"

    def inflight(self, instance_id: str) -> str:
        return f"{self.prefix}:f:{{{instance_id}}}"

    def callback_key(self, instance_id: str) -> str:
        return f"{self.prefix}:k:{{{instance_id}}}"

    @property
    def agents(self) -> str:
        return f"{self.prefix}:agents"

    def waiting(self, capability: str) -> str:
        return f"{self.prefix}:w:{{{capability}}}"

    def unmatched(self, capability: str) -> str:
        return f"{self.prefix}:x:{{{capability}}}"

    @property
    def waiting_index(self) -> str:
        return f"{self.prefix}:waiting"

    @property
    def due(self) -> str:
        return f"{self.prefix}:due"

    def assigned(self, capability: str, window: int) -> str:
        return f"{self.prefix}:n:{{{capability}}}:{window}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}:s:{{{session_id}}}"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}:dlq"

    @property
    def outbox(self) -> str:
        return f"{self.prefix}:outbox"

    @property
    def reply_prefix(self) -> str:
        return f"{self.prefix}:reply:"

    def reply(self, name: str) -> str:
        return f"{self.reply_prefix}{name}"

    @property
    def credit_channel(self) -> str:
        return f"{self.prefix}:credit"

    @property
    def registry_channel(self) -> str:
        return f"{self.prefix}:registry"


def ingress_streams(keys: Keyspace, partitions: int) -> list[str]:
    """Every partition of the ingress (``ingress_partitions``)."""
    return [keys.ingress_partition(n) for n in range(partitions)]


def ingress_for(keys: Keyspace, key: str, partitions: int) -> str:
    """The partition a producer writes to: by session id (one session's requests keep their
    order), else by message id: CRC16 of the key modulo ``partitions``."""
    return keys.ingress_partition(crc16(key.encode()) % partitions if partitions > 1 else 0)


def due_for(keys: Keyspace, message_id: str, partitions: int | None = None) -> str:
    """The due set holding ``message_id``'s next deadline: ``P:due`` (partition 0, the name
    without partitions) or ``P:due:{n}``, by the message id, as the ingress is chosen; among
    ``partitions`` (default: the keyspace's; a direct lane names its dispatcher's)."""
    partitions = keys.partitions if partitions is None else partitions
    n = crc16(message_id.encode()) % partitions if partitions > 1 else 0
    return keys.due if n == 0 else f"{keys.due}:{{{n}}}"


def due_sets(keys: Keyspace) -> list[str]:
    """Every partition of the due set: each reaper claims from all of them."""
    return [keys.due, *(f"{keys.due}:{{{n}}}" for n in range(1, keys.partitions))]


def outbox_for(keys: Keyspace, message_id: str) -> str:
    """The outbox partition of ``message_id``'s webhook deliveries (its retries stay there):
    ``P:outbox`` or ``P:outbox:{n}``, by the message id, as the due set is chosen."""
    n = crc16(message_id.encode()) % keys.partitions if keys.partitions > 1 else 0
    return keys.outbox if n == 0 else f"{keys.outbox}:{{{n}}}"


def direct_lane(keys: Keyspace, capability: str) -> str:
    """The capability's direct lane (``broker/direct_lane.py``)."""
    return f"{keys.prefix}:direct:{{{capability}}}"


def direct_lanes_index(keys: Keyspace) -> str:
    """The capabilities that may have a direct lane (``workers/direct_publisher.py``)."""
    return f"{keys.prefix}:direct"


def outboxes(keys: Keyspace) -> list[str]:
    """Every partition of the outbox: each notifier reads all of them."""
    return [keys.outbox, *(f"{keys.outbox}:{{{n}}}" for n in range(1, keys.partitions))]


@dataclass(frozen=True, slots=True)
class FleetKeys:
    """The keys of governance: events, subscriptions, usage, rate limits, feedback."""

    prefix: str = "reach"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def subscriptions(self) -> str:
        return f"{self.prefix}:subs"

    def usage(self, day: str) -> str:
        """One UTC day's usage (``day`` as ``YYYY-MM-DD``); per slot on a cluster."""
        return f"{self.prefix}:usage:{day}"

    def rate(self, scope: str, name: str) -> str:
        """A limit's GCRA state; an instance's shares the instance's slot (``assign.lua``)."""
        return f"{self.prefix}:r:{scope}:{{{name}}}"

    def feedback(self, agent: str) -> str:
        return f"{self.prefix}:fb:{{{agent}}}"
