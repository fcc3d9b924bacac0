"""Broadcast as data: who a broadcast goes to, its children, and how they are named.

An envelope with ``mode: "broadcast"`` becomes a *parent* record (ACCEPTED -> FANNED_OUT)
and one *child* per healthy instance of its capability. A child is an ordinary unicast
message pinned to its instance (``target``): its own record, stages, credit, timeouts and
retries; it has no ``reply_to`` or ``callback_url`` of its own and names its ``parent``. When
a child ends, its outcome is recorded on the parent (``lua/child_done.lua``, sent with the
other delivery commands, :mod:`broker.results`); the last one moves the parent to SUCCEEDED
with the map instance id -> outcome, and the parent's producer is told like any other.

Names are deterministic, so a dispatcher that dies mid-fan-out and handles the ingress entry
again re-creates exactly the missing children: child ``n`` (from 1, instances in id order)
of parent ``P`` is ``P.n``. A parent id longer than :data:`MAX_PARENT_ID` is refused, so
every child id fits the message-id pattern (128 characters).

Pure: no I/O; time is an argument.
"""

from __future__ import annotations

import logging

import msgspec

from .envelope import Envelope
from .routing import RegistryIndex, RouteRequest, RoutingPolicy
from .routing import _selector_miss as selector_miss  # the funnel's own rule, one definition

log = logging.getLogger("agent_reach.broadcast")

MAX_PARENT_ID = 120  # + "." + up to 7 digits = 128, the message-id limit

Children = list[tuple[str, str]]  # (child id, instance id), in child order

_children = msgspec.json.Decoder(list[tuple[str, str]])
_encoder = msgspec.json.Encoder()


def id_problem(parent_id: str) -> str | None:
    """Why ``parent_id`` cannot name a broadcast, or ``None`` when it can."""
    if len(parent_id) > MAX_PARENT_ID:
        return (
            f"invalid envelope: a broadcast id is at most {MAX_PARENT_ID} characters "
            f"(its children are named `<id>.<n>`); this one has {len(parent_id)}"
        )
    return None


def members(
    request: RouteRequest, index: RegistryIndex, policy: RoutingPolicy, *, now_ms: int
) -> list[str]:
    """The instances a broadcast goes to, in id order: those serving the capability (through
    the aliases in ``loose`` mode) that pass the funnel's selectors (tags, target, budget,
    weight) and are healthy — UP or DEGRADED, heartbeat within ``down_after_ms``, credits
    above zero. DOWN, DRAINING and silent instances are left out.

    Unlike a unicast route, load and ejections do not choose here: a busy instance's child
    waits for a credit, and a child pinned to an instance in cooldown or with an open circuit
    is still routed to it (the funnel's panic rule keeps a lone candidate), because a
    broadcast has nowhere else to go. An instance backing off (``Retry-After``) gets its
    child once the back-off has passed."""
    capability = policy.resolve(request.capability)
    silent_before = now_ms - policy.down_after_ms
    return sorted(
        c.instance_id
        for c in index.candidates.get(capability, [])
        if c.alive
        and c.credits > 0
        and c.heartbeat_ms >= silent_before
        and not selector_miss(request, c)
    )


def child_id(parent_id: str, n: int) -> str:
    return f"{parent_id}.{n}"


def fan_out(parent_id: str, instances: list[str]) -> Children:
    """``(child id, instance id)`` for each instance, numbered from 1 in the given order."""
    return [(child_id(parent_id, n), inst) for n, inst in enumerate(instances, start=1)]


def child_envelope(parent: Envelope, child: str, instance_id: str) -> Envelope:
    """The child of ``parent`` for one instance: same payload, priority, timeout, attempts,
    trace context and headers; pinned by ``target``; no reply of its own.

    Its idempotency key is the parent's plus the instance (``<key>.<instance>``): each
    instance is asked to do the work once — instances of one agent that de-duplicate through
    a shared store must not take a sibling's execution for their own — while every retry of
    the same child carries the same key. A producer's retry of the whole broadcast is
    de-duplicated by the parent's id."""
    return msgspec.structs.replace(
        parent,
        id=child,
        mode="unicast",
        target=instance_id,
        parent=parent.message_id,
        idempotency_key=f"{parent.idempotency}.{instance_id}",
        reply_to=None,
        callback_url=None,
        session_id=None,  # pinned: affinity has nothing to choose
        tags={},  # chosen already; a tag changed later must not strand the child
        budget_per_task=None,
    )


def encode_children(children: Children) -> bytes:
    """The fan-out as the parent record keeps it (field ``children``)."""
    return _encoder.encode(children)


def decode_children(raw: bytes) -> Children:
    """The fan-out a parent record keeps; none where the field is not one (whoever may write
    records may write anything there): logged, and the parent is left to its deadline."""
    try:
        return _children.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        log.warning("a broadcast's children unreadable, taken as none: %s", exc)
        return []


def no_members_reason(why: str) -> str:
    """The REJECTED reason of a broadcast nobody can take; ``why`` is the funnel's own."""
    return f"broadcast: no healthy instance to send it to ({why})"
