"""Usage read as a test must read it: across a UTC midnight.

A charge goes to the hashes of its own UTC day and month; a test reads them a moment later,
by then perhaps the next day (or month). Each test has a key prefix of its own, so the day
before holds nothing but its charges: reading both days is reading exactly the test's.

What is by definition today's (the ``usage`` command's and the console's default span, the
``..._today`` metrics) is checked for both cases instead: :func:`day_turned`. A budget is
enforced on its period's spending alone, and a test that spends up to one and expects the
refusal still needs the period not to turn meanwhile."""

from __future__ import annotations

from broker.connection import Connection
from broker.timekeeping import now_ms
from broker.usage import Totals, utc_day, utc_month
from broker.usage_reader import tenant_spending, usage_totals

DAY_MS = 86_400_000


def day_turned(since_ms: int) -> bool:
    """Whether the UTC day has changed since ``since_ms``."""
    return utc_day(since_ms) != utc_day(now_ms())


async def usage_lately(conn: Connection, by: str, now: int | None = None) -> list[Totals]:
    """The figures of the day of ``now`` (default: now) and the day before (UTC), by ``by``."""
    return await usage_totals(conn, by, 2, now_ms() if now is None else now)


def _summed(*spent: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for each in spent:
        for tenant, cost in each.items():
            total[tenant] = total.get(tenant, 0.0) + cost
    return total


async def spending_lately(
    conn: Connection, now: int | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """What each tenant has spent on the day of ``now`` (default: now) and the day before,
    and in the month of ``now`` and, when the day before was in another, that one (UTC)."""
    now = now_ms() if now is None else now
    day_before, month_before = await tenant_spending(conn, now - DAY_MS)
    day, month = await tenant_spending(conn, now)
    if utc_month(now - DAY_MS) != utc_month(now):
        month = _summed(month_before, month)
    return _summed(day_before, day), month
