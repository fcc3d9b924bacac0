"""Usage read as a test must read it: across a UTC midnight.

A charge goes to the hashes of its own UTC day and month; a test reads them a moment later,
by then perhaps the next day (or month). Each test has a key prefix of its own, so the day
before holds nothing but its charges: reading both days is reading exactly the test's."""

from __future__ import annotations

from broker.connection import Connection
from broker.timekeeping import now_ms
from broker.usage import Totals, utc_month
from broker.usage_reader import tenant_spending, usage_totals

DAY_MS = 86_400_000


async def usage_lately(conn: Connection, by: str) -> list[Totals]:
    """The figures of today and yesterday (UTC), by ``by``."""
    return await usage_totals(conn, by, 2, now_ms())


def _summed(*spent: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for each in spent:
        for tenant, cost in each.items():
            total[tenant] = total.get(tenant, 0.0) + cost
    return total


async def spending_lately(conn: Connection) -> tuple[dict[str, float], dict[str, float]]:
    """What each tenant has spent today and yesterday, and this month and, when yesterday
    was in another, that one (UTC)."""
    now = now_ms()
    day_before, month_before = await tenant_spending(conn, now - DAY_MS)
    day, month = await tenant_spending(conn, now)
    if utc_month(now - DAY_MS) != utc_month(now):
        month = _summed(month_before, month)
    return _summed(day_before, day), month
