"""Rate limits from config, per agent (across its instances), per capability and per tenant:
checked by the dispatcher before an attempt is assigned (``lua/gcra.lua``, on the slot of
the limited key). An instance's own limit (``sidecar --rate``) is checked with its credit, in
``lua/assign.lua``.

A message over a limit waits — WAITING, reason ``rate_limited``, ``retry_at_ms`` at the time
the limit would let it through — and never fails for it. The limits are checked one after
another (tenant, capability, agent), each only if the one before let the call through, so a
refusal spends no later limit's allowance; a call let through by every limit and then refused
a credit has spent them: a limit errs on the side of fewer calls. A refusal is remembered
until its time, so the work behind it costs no round trip; and ``rate_limit.saturated`` is
written once a minute per limit that refuses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from broker.connection import Connection
from broker.event_log import emit, event_command
from broker.governance import parse_rate
from broker.scripts import ScriptName

from .routing_table import RoutingTable

log = logging.getLogger("agent_reach.dispatcher")

SATURATION_EVERY_MS = 60_000
Scope = tuple[str, str]  # ("tenant" | "capability" | "agent" | "instance", name)


@dataclass(frozen=True, slots=True)
class Limited:
    """Why an attempt waits, and until when."""

    scope: Scope
    retry_at_ms: int

    @property
    def reason(self) -> str:
        kind, name = self.scope
        return f"rate_limited: {kind} {name!r} over its rate limit"


class RateGate:
    def __init__(self, conn: Connection, table: RoutingTable) -> None:
        self.conn = conn
        self.table = table
        limits = conn.settings.rate_limits
        self.limits: dict[Scope, tuple[float, int]] = {}
        for kind, named in (
            ("tenant", limits.tenant),
            ("capability", limits.capability),
            ("agent", limits.agent),
        ):
            for name, limit in named.items():
                self.limits[(kind, name)] = (parse_rate(limit.rate), limit.burst)
        self.held: dict[Scope, int] = {}
        self._said: dict[Scope, int] = {}

    @property
    def active(self) -> bool:
        return bool(self.limits)

    def scopes(self, capability: str, instance_id: str, tenant: str | None) -> list[Scope]:
        wanted: list[Scope] = [("capability", capability)]
        if tenant is not None:
            wanted.insert(0, ("tenant", tenant))
        if agent := self.table.agent_of(instance_id):
            wanted.append(("agent", agent))
        return [s for s in wanted if s in self.limits]

    async def check(self, calls: list[list[Scope]], now: int) -> list[Limited | None]:
        """For each call (its limits, in order): ``None`` if every limit let it through,
        else the refusal. One round trip per limit in the longest list, for all calls."""
        verdicts: list[Limited | None] = [None] * len(calls)
        for depth in range(max(map(len, calls), default=0)):
            asked: list[tuple[int, Scope]] = []
            for i, scopes in enumerate(calls):
                if verdicts[i] is not None or depth >= len(scopes):
                    continue
                scope = scopes[depth]
                if self.held.get(scope, 0) > now:  # refused earlier: no round trip
                    verdicts[i] = Limited(scope, self.held[scope])
                else:
                    asked.append((i, scope))
            replies = await self.conn.call_many([self._take(s, now) for _, s in asked])
            for (i, scope), wait in zip(asked, replies, strict=True):
                if isinstance(wait, Exception):
                    raise wait
                if wait:
                    self.held[scope] = now + int(wait)
                    verdicts[i] = Limited(scope, now + int(wait))
        await self.saturated([v for v in verdicts if v is not None], now)
        return verdicts

    def holds(self, capability: str, tenant: str | None, now: int) -> int:
        """Until when a tenant's or capability's limit is known to refuse (0: not held)."""
        if not self.held:
            return 0
        until = self.held.get(("capability", capability), 0)
        if tenant is not None:
            until = max(until, self.held.get(("tenant", tenant), 0))
        return until if until > now else 0

    def _take(self, scope: Scope, now: int) -> tuple[object, ...]:
        interval, burst = self.limits[scope]
        key = self.conn.fleet.rate(*scope)
        return self.conn.script_command(ScriptName.GCRA, (key,), (now, interval, burst))

    def next_ready_ms(self, now: int) -> int | None:
        for scope in [s for s, t in self.held.items() if t <= now]:
            del self.held[scope]
        return min(self.held.values(), default=None)

    async def saturated(self, refused: list[Limited], now: int) -> None:
        """``rate_limit.saturated`` for each limit that refused, at most once a minute."""
        commands = []
        for limited in refused:
            if now - self._said.get(limited.scope, -SATURATION_EVERY_MS) < SATURATION_EVERY_MS:
                continue
            self._said[limited.scope] = now
            kind, name = limited.scope
            interval, burst = self.limits.get(limited.scope) or self.table.rates.get(name, (0.0, 1))
            commands.append(
                event_command(
                    self.conn,
                    "rate_limit.saturated",
                    f"{kind}:{name}",
                    per_second=round(1000 / interval, 3) if interval else None,
                    burst=burst,
                    retry_in_ms=max(0, limited.retry_at_ms - now),
                )
            )
        await emit(self.conn, commands)
