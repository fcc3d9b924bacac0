"""Where the work is: waiting depth, oldest wait and assignment rate per capability; credits in
use against the effective and declared limits per instance. What ``agent-reach stats`` shows."""

from __future__ import annotations

import msgspec

from .connection import Connection
from .registry import Registry
from .store import MessageStore
from .timekeeping import now_ms


class CapabilityStats(msgspec.Struct, frozen=True):
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


async def backlog_stats(conn: Connection) -> BacklogStats:
    store = MessageStore(conn)
    registry = Registry(conn)
    views = await registry.snapshot()
    streams = await registry.stream_backlogs([v.instance_id for v in views])
    served: dict[str, int] = {}
    for view in views:
        for capability in view.card.capabilities:
            served[capability] = served.get(capability, 0) + 1
    capabilities = sorted(set(served) | set(await store.waiting.capabilities()))
    now = now_ms()
    rates = await store.waiting.assignment_rates(capabilities, now)
    rows = []
    for capability in capabilities:
        depth, unmatched, oldest_ms = await store.waiting.oldest(capability)
        rows.append(
            CapabilityStats(
                capability=capability,
                waiting=depth,
                unmatched=unmatched,
                oldest_waiting_s=None if oldest_ms is None else max(0, now - oldest_ms) / 1000,
                assigned_per_s=round(rates[capability], 3),
                instances=served.get(capability, 0),
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
