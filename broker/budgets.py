"""Tenant budgets: whether a tenant has spent its day's or month's budget. Pure.

A tenant's spending is what its agents reported as cost, charged per attempt
(:mod:`broker.usage`). A dispatcher reads it at most every ``budget_refresh_s``, so a
tenant may overspend by what runs in that window: a budget is a brake, not an invoice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .governance import TenantBudget

BUDGET_EXHAUSTED = "budget_exhausted"


@dataclass(frozen=True, slots=True)
class Overrun:
    """A tenant at or over one of its budgets: which period, and the figures."""

    tenant: str
    period: str  # "daily" or "monthly"
    spent: float
    budget: float

    @property
    def reason(self) -> str:
        return (
            f"{BUDGET_EXHAUSTED}: tenant {self.tenant!r} has spent {self.spent:g} of its "
            f"{self.period} budget {self.budget:g}"
        )


def overrun(
    tenant: str | None,
    budgets: Mapping[str, TenantBudget],
    spent_today: Mapping[str, float],
    spent_this_month: Mapping[str, float],
) -> Overrun | None:
    """The budget ``tenant`` has used up (the day's first), or ``None``."""
    if tenant is None or (budget := budgets.get(tenant)) is None:
        return None
    for period, limit, spent in (
        ("daily", budget.daily, spent_today.get(tenant, 0.0)),
        ("monthly", budget.monthly, spent_this_month.get(tenant, 0.0)),
    ):
        if limit is not None and spent >= limit:
            return Overrun(tenant, period, spent, limit)
    return None
