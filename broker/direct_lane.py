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

The lane's text is the instance id, a line break, and as JSON the decision's fields and the
dispatcher's ``max_envelope_bytes`` (what it would refuse, the producer refuses to take down
the lane); the script compares the instance part only, so two dispatchers whose snapshots
differ in a figure do not turn each other's lanes stale.
"""

from __future__ import annotations

import msgspec

from .envelope import Envelope

# how long a producer trusts what it read (a lane, or that there is none) before it reads again
LANE_READ_EVERY_S = 1.0


class LaneTerms(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a lane carries beside its instance: the decision's record fields, and the
    largest envelope the publishing dispatcher takes."""

    fields: dict[str, str]
    max_bytes: int


class Lane(msgspec.Struct, frozen=True):
    """A capability's lane: the instance to assign to, and its terms."""

    instance: str
    fields: dict[str, str]
    max_bytes: int


def lane_text(lane: Lane) -> bytes:
    terms = LaneTerms(lane.fields, lane.max_bytes)
    return lane.instance.encode() + b"\n" + msgspec.json.encode(terms)


def read_lane(raw: bytes) -> Lane | None:
    """The lane ``raw`` holds, or ``None`` where it holds none that can be used (anyone who
    may write the key may write anything there)."""
    instance, newline, text = raw.partition(b"\n")
    if not newline or not instance:
        return None
    try:
        terms = msgspec.json.decode(text, type=LaneTerms)
        return Lane(instance.decode(), terms.fields, terms.max_bytes)
    except (msgspec.DecodeError, UnicodeDecodeError):
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
