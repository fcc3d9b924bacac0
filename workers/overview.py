"""The broker at a glance, as data: what ``agent-reach top`` and the console show.

:func:`read_overview` reads it from Redis; :func:`rates` turns two readings into per-second
rates. The counters are the cluster-wide ones behind ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from broker.broadcast import decode_children
from broker.connection import Connection
from broker.health import observed_state
from broker.metric_fields import NEEDS_CONFIRMATION_LEVEL, count_value, read_counters
from broker.records import InstanceView
from broker.registry import Registry
from broker.routing import factors
from broker.stats import CapabilityStats, backlog_stats
from broker.store import MessageStore
from broker.timekeeping import now_ms

from .routing_table import routing_policy

TOTALS = ("accepted", "SUCCEEDED", "FAILED")
SHOWN_CAPABILITIES = 100  # rows of the waiting table by name; the rest in one `_other` row


@dataclass(frozen=True, slots=True)
class AgentRow:
    instance: str
    agent: str
    state: str
    reach: float
    in_use: int
    effective: int
    declared: int
    error_rate: float
    p95_ms: float
    circuit: str
    heartbeat_age_s: float
    version: str
    weight: float
    factors: dict[str, float] = field(default_factory=dict)  # the reach, factor by factor
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Overview:
    at_ms: int
    totals: dict[str, int]  # accepted, and finished by stage
    capabilities: list[CapabilityStats]
    agents: list[AgentRow]
    dlq_entries: int
    needs_confirmation: int
    rates: dict[str, float] = field(default_factory=dict)  # per second, since the last reading


async def read_overview(conn: Connection) -> Overview:
    flat, dlq = await conn.read_counters(), await conn.call("XLEN", conn.keys.dlq)
    counted = read_counters(flat)
    totals = {"accepted": sum(counted["accepted"].values())}
    for (_, stage), n in counted["finished"].items():
        totals[stage] = totals.get(stage, 0) + n
    level = flat.get(NEEDS_CONFIRMATION_LEVEL, b"0")
    stats = await backlog_stats(conn, most=SHOWN_CAPABILITIES)
    views = await Registry(conn).snapshot()
    return Overview(
        at_ms=stats.at_ms,
        totals=totals,
        capabilities=stats.capabilities,
        agents=[agent_row(conn, v) for v in views],
        dlq_entries=dlq if isinstance(dlq, int) else 0,
        needs_confirmation=max(0, count_value(level) or 0),
    )


def agent_row(conn: Connection, view: InstanceView) -> AgentRow:
    policy = routing_policy(conn.settings)
    now = now_ms()
    state = observed_state(view, now_ms=now, down_after_ms=policy.down_after_ms)
    reach = factors(view, state, view.inflight, policy)
    return AgentRow(
        instance=view.instance_id,
        agent=view.card.agent_id,
        state=state.value,
        reach=reach.reach,
        in_use=view.inflight,
        effective=view.credits,
        declared=view.card.max_inflight,
        error_rate=view.stats.error_rate,
        p95_ms=view.stats.p95_ms,
        circuit=view.stats.circuit.value,
        heartbeat_age_s=max(0.0, (now - view.heartbeat_ms) / 1000),
        version=view.card.version,
        weight=view.card.weight,
        factors=reach.to_builtins(),
        tags=dict(view.card.tags),
    )


def rates(before: Overview | None, now: Overview) -> dict[str, float]:
    """Per-second rates of the totals between two readings (none for the first)."""
    if before is None:
        return {}
    return rates_between(before.at_ms, before.totals, now.at_ms, now.totals)


def rates_between(
    t0_ms: int, before: Mapping[str, int], t1_ms: int, after: Mapping[str, int]
) -> dict[str, float]:
    """Per-second rates of the totals from one reading to a later one: none where the later
    is not later, nor where a total fell (Redis came back with older data, or none: the
    counts started again)."""
    if t1_ms <= t0_ms:
        return {}
    grown = {name: after.get(name, 0) - before.get(name, 0) for name in TOTALS}
    if any(n < 0 for n in grown.values()):
        return {}
    seconds = (t1_ms - t0_ms) / 1000
    return {name: n / seconds for name, n in grown.items()}


class Readings:
    """The readings a live view shows: the last one, and rates only between two readings with
    no outage between them — rates across one would average the outage in."""

    def __init__(self) -> None:
        self.last: Overview | None = None
        self._since: Overview | None = None

    def read(self, current: Overview) -> Overview:
        """``current`` with its rates since the reading before (none after an outage)."""
        current.rates.update(rates(self._since, current))
        self.last = self._since = current
        return current

    def lost(self) -> None:
        """Redis was away: the next reading gets no rates, the one after it gets them again."""
        self._since = None


async def broadcast_children(conn: Connection, message_id: str) -> list[dict[str, str]]:
    """A broadcast parent's children (id, instance, stage now); none for any other message."""
    raw = await conn.call("HGET", conn.keys.record(message_id), "children")
    if not raw:
        return []
    children = decode_children(raw)
    stages = await MessageStore(conn).stages([child for child, _ in children])
    return [
        {"id": child, "instance": inst, "stage": stage.value if stage else "MISSING"}
        for (child, inst), stage in zip(children, stages, strict=True)
    ]
