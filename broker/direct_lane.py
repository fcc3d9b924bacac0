"""The direct lane's rules, without I/O: which capabilities a dispatcher publishes a lane
for, which envelopes a producer may send down one, and the lane's text.

A lane is published (``P:direct:{<capability>}``, expiring) for a capability exactly one
instance serves, with no rate limit or budget to check and no work of it waiting: there is
then one decision to make, the same for every plain envelope, and it is made once, with its
fields as the dispatcher records them. A producer that finds the lane creates the record
ROUTED to that instance and assigns it there, in one script (``lua/accept_direct.lua``) that
checks the lane, the waiting sets and the credit first and does nothing otherwise: the
envelope then goes to the ingress, as every envelope did before. What the lane saves is the
dispatcher's hop: its wake-up, intake and routing (``python -m bench.latency_path``).

The lane's text is the instance id, a line break, and as JSON the decision's two record
fields and the dispatcher's settings the record must follow (:class:`Lane`); the script
compares the instance part only, so two dispatchers whose snapshots differ in a figure do
not turn each other's lanes stale. The record's times are Redis's (``TIME`` in the script),
not the producer's clock.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .envelope import Envelope

# how long a producer trusts what it read (a lane, or that there is none) before it reads again
LANE_READ_EVERY_S = 1.0


ReasonText = Annotated[str, msgspec.Meta(max_length=16_384)]
Millis = Annotated[int, msgspec.Meta(ge=1, le=365 * 86_400_000)]


class Lane(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A capability's lane: the instance to assign to (written before the JSON, not in it),
    the decision's record fields, and the publishing dispatcher's settings a record made
    down the lane must follow, whatever the producer's own are: the largest envelope it
    takes, the reaper's first look and the heartbeat age of a lapsed instance (ms), the
    timeline's cap, where it counts (``""``: nowhere) with its cap, and the due set's
    partitions (``ingress_partitions``): a deadline entry in a partition the reapers do not
    scan would never come due."""

    instance: str
    route_from: ReasonText
    route_reason: ReasonText
    max_bytes: Annotated[int, msgspec.Meta(ge=1)]
    delivery_ms: Millis
    down_after_ms: Millis
    timeline_max: Annotated[int, msgspec.Meta(ge=1, le=100_000)]
    counters_key: Annotated[str, msgspec.Meta(max_length=256)]
    counters_max: Annotated[int, msgspec.Meta(ge=0)]
    partitions: Annotated[int, msgspec.Meta(ge=1, le=256)]

    @property
    def fields(self) -> dict[str, str]:
        """The decision's fields, as the record keeps them: no other field comes from a lane
        (anyone who may write the key may write anything there)."""
        return {"route_from": self.route_from, "route_reason": self.route_reason}


_TERMS = msgspec.json.Encoder()


def lane_text(lane: Lane) -> bytes:
    terms = msgspec.structs.asdict(lane)
    del terms["instance"]
    return lane.instance.encode() + b"\n" + _TERMS.encode(terms)


def read_lane(raw: bytes) -> Lane | None:
    """The lane ``raw`` holds, or ``None`` where it holds none that can be used."""
    instance, newline, text = raw.partition(b"\n")
    if not newline or not instance:
        return None
    try:
        terms = msgspec.json.decode(text, type=dict[str, Any])
        if "instance" in terms:  # the line before names it, and only it
            return None
        return msgspec.convert({**terms, "instance": instance.decode()}, Lane)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return None


def lane_ttl_ms(sweep_interval_s: float) -> int:
    """How long a published lane lives unless published again: three sweeps (a dispatcher
    publishes at every one), and at least 5 s."""
    return int(max(5.0, 3 * sweep_interval_s) * 1000)


def plain(envelope: Envelope) -> bool:
    """Whether the dispatcher would route ``envelope`` as the lane says: one decision for any
    envelope of its capability, with nothing of its own to check (no session, selector,
    target, budget per task, intent, callback, broadcast, or parent)."""
    return (
        envelope.mode != "broadcast"
        and envelope.session_id is None
        and not envelope.tags
        and envelope.target is None
        and envelope.budget_per_task is None
        and envelope.budget is None
        and envelope.intent is None
        and envelope.callback_url is None
        and envelope.parent is None
    )
