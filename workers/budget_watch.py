"""The dispatcher's view of tenant budgets: spending read at most every ``budget_refresh_s``,
the verdict per envelope, and one ``budget.exceeded`` event per tenant and period.

The event is claimed with ``SET NX`` on a key of the tenant's period, so however many
dispatchers see the overrun, one event is written (the key expires with the period)."""

from __future__ import annotations

import logging

from broker.budgets import Overrun, overrun
from broker.connection import Connection
from broker.errors import RedisReplyError, RedisUnavailable
from broker.event_log import event_command
from broker.timekeeping import now_ms
from broker.usage import utc_day, utc_month
from broker.usage_reader import tenant_spending

log = logging.getLogger("agent_reach.dispatcher")

_PERIOD_S = {"daily": 2 * 86400, "monthly": 32 * 86400}


class BudgetWatch:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.budgets = conn.settings.budgets
        self.refresh_ms = int(conn.settings.budget_refresh_s * 1000)
        self.today: dict[str, float] = {}
        self.month: dict[str, float] = {}
        self.read_ms = 0
        self.told: set[tuple[str, str, str]] = set()

    @property
    def active(self) -> bool:
        return bool(self.budgets)

    @property
    def cheapest(self) -> bool:
        return self.conn.settings.budget_mode == "cheapest"

    async def refresh(self, now: int) -> None:
        """Read spending again if the last read is older than ``budget_refresh_s``. A Redis
        that does not answer keeps the last view (the round trips after this one fail too,
        and the batch is handled again)."""
        if not self.budgets or now - self.read_ms < self.refresh_ms:
            return
        try:
            self.today, self.month = await tenant_spending(self.conn, now)
        except (RedisUnavailable, RedisReplyError) as exc:
            log.warning("tenant spending not read: %s", exc)
            return
        self.read_ms = now

    def verdict(self, tenant: str | None) -> Overrun | None:
        return overrun(tenant, self.budgets, self.today, self.month) if self.budgets else None

    async def announce(self, found: Overrun) -> None:
        """``budget.exceeded``, once per tenant and period across dispatchers."""
        now = now_ms()
        period = utc_day(now) if found.period == "daily" else utc_month(now)
        mark = (found.tenant, found.period, period)
        if mark in self.told:
            return
        claim = f"{self.conn.fleet.events}:budget:{{{found.tenant}}}:{period}"
        try:
            if await self.conn.call("SET", claim, "1", "NX", "EX", _PERIOD_S[found.period]):
                event = event_command(
                    self.conn,
                    "budget.exceeded",
                    found.tenant,
                    period=found.period,
                    spent=found.spent,
                    budget=found.budget,
                    mode=self.conn.settings.budget_mode,
                )
                await self.conn.call(*event)
        except (RedisUnavailable, RedisReplyError) as exc:
            log.warning("budget.exceeded for %s not written: %s", found.tenant, exc)
            return
        self.told.add(mark)
