"""Where the work is: waiting depth, oldest wait and assignment rate per capability; credits in
use against the effective and declared limits per instance. What ``agent-reach stats`` shows."""

from __future__ import annotations

import msgspec

from .connection import Connection
from .metric_fields import OTHER
from .registry import Registry
from .store import MessageStore
from .timekeeping import now_ms


class CapabilityStats(msgspec.Struct, frozen=True):
    """A capability's backlog; or, named ``_other`` (no capability's name: one starts with a
    letter), the sums of those :func:`backlog_stats` did not show by name."""

    capability: str
    waiting: int
    unmatched: int  # of those waiting, how many no registered instance can take at all
    oldest_waiting_s: float | None
    assigned_per_s: float
    instances: int


class InstanceCredits(msgspec.Struct, frozen=True):
    instance_id: str
    capabilities: tuple[str, ...]
    state: str
    in_use: int
    effective: int
    declared: int
    stream: int  # entries on its stream not yet finished: never more than its credits


class BacklogStats(msgspec.Struct, frozen=True):
    at_ms: int
    capabilities: list[CapabilityStats]
    instances: list[InstanceCredits]


async def backlog_stats(conn: Connection, *, most: int | None = None) -> BacklogStats:
    """Where the work is now. With ``most``, at most that many capabilities are shown by
    name, those served first, then those with the most waiting, and the rest in one row
    named ``_other``:
    anyone who may send work may name any number of capabilities, and every capability
    shown costs its own looks (the oldest wait, the assignment rate) at every reading."""
    store = MessageStore(conn)
    registry = Registry(conn)
    views = await registry.snapshot()
    streams = await registry.stream_backlogs([v.instance_id for v in views])
    served: dict[str, int] = {}
    for view in views:
        for capability in view.card.capabilities:
            served[capability] = served.get(capability, 0) + 1
    capabilities = sorted(set(served) | set(await store.waiting.capabilities()))
    depths = await store.waiting.depths(capabilities)
    shown, folded = _deepest(capabilities, depths, most, served=set(served))
    now = now_ms()
    rates = await store.waiting.assignment_rates(shown, now)
    oldest = await store.waiting.oldest_accepted(shown)
    rows = [
        CapabilityStats(
            capability=c,
            waiting=depths[c][0],
            unmatched=depths[c][1],
            oldest_waiting_s=_age_s(now, oldest[c]),
            assigned_per_s=round(rates[c], 3),
            instances=served.get(c, 0),
        )
        for c in shown
    ]
    if folded:
        rows.append(
            CapabilityStats(
                capability=OTHER,
                waiting=sum(depths[c][0] for c in folded),
                unmatched=sum(depths[c][1] for c in folded),
                oldest_waiting_s=None,  # not looked at: that is the point of folding them
                assigned_per_s=0.0,
                instances=sum(served.get(c, 0) for c in folded),
            )
        )
    instances = [
        InstanceCredits(
            instance_id=v.instance_id,
            capabilities=v.card.capabilities,
            state=v.state.value,
            in_use=v.inflight,
            effective=v.credits,
            declared=v.card.max_inflight,
            stream=stream,
        )
        for v, stream in zip(views, streams, strict=True)
    ]
    return BacklogStats(at_ms=now, capabilities=rows, instances=instances)


def _deepest(
    capabilities: list[str],
    depths: dict[str, tuple[int, int]],
    most: int | None,
    *,
    served: set[str],
) -> tuple[list[str], list[str]]:
    """The capabilities to show by name (in name order, at most ``most``) and those to fold
    into one row: served ones first (a card may list any number: they rank by depth too),
    then the deepest of the rest."""
    if most is None or len(capabilities) <= most:
        return capabilities, []
    ranked = sorted(capabilities, key=lambda c: (c not in served, -depths[c][0], c))
    return sorted(ranked[:most]), ranked[most:]


def _age_s(now: int, since_ms: int | None) -> float | None:
    return None if since_ms is None else max(0, now - since_ms) / 1000
