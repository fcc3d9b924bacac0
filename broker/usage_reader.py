"""Reading usage back: the day hashes summed for ``agent-reach usage``, ``/metrics`` and the
console, and the tenants' spending for budgets (:mod:`broker.usage` for the shapes).

On a Redis Cluster each slot keeps its own copy of a day's hash (a script writes the copy of
its record's slot), so a reader sums every slot's: one round trip per node, in a pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping

from .connection import Connection
from .usage import Totals, days_back, spending, totals_by, utc_day, utc_month


def _as_mapping(raw: object) -> Mapping[bytes, bytes]:
    if not isinstance(raw, list):
        return {}
    return {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}


async def day_hashes(conn: Connection, days: list[str]) -> list[Mapping[bytes, bytes]]:
    """Every copy of the usage hash of each of ``days``."""
    keys = [copy for day in days for copy in conn.every_slot(conn.fleet.usage(day))]
    replies = await conn.call_many([("HGETALL", key) for key in keys])
    return [found for found in map(_as_mapping, replies) if found]


async def usage_totals(conn: Connection, by: str, days: int, now_ms: int) -> list[Totals]:
    """The figures of the last ``days`` UTC days (today included), by ``by``."""
    return totals_by(await day_hashes(conn, days_back(now_ms, days)), by)


async def tenant_spending(
    conn: Connection, now_ms: int
) -> tuple[dict[str, float], dict[str, float]]:
    """What each tenant has spent today and this month (UTC)."""
    out: list[dict[str, float]] = []
    for name in (utc_day(now_ms), utc_month(now_ms)):
        total: dict[str, float] = {}
        for found in await day_hashes(conn, [name]):
            for tenant, cost in spending(found).items():
                total[tenant] = total.get(tenant, 0.0) + cost
        out.append(total)
    return out[0], out[1]
