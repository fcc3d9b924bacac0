"""The dispatcher's side of the direct lane (:mod:`broker.direct_lane`): with ``direct_lane``
on, each capability one instance serves, with no limit or budget to check and no work of it
waiting here, gets a lane naming that instance and the decision this dispatcher would
record; every other capability's lane is withdrawn. Published after every registry snapshot
(at start, at every sweep, on a card's change), each lane expiring unless published again:
a dispatcher that stops leaves none behind for long.

Off on a cluster, where writes wait for replicas, and where budgets are configured (a
tenant's spending is checked on the way in); an instance with a rate limit of its own, or
any configured rate limit, gets no lane either. What the lane is not told at once (work that
started waiting, a second instance) its script checks itself or the next snapshot withdraws.
"""

from __future__ import annotations

from broker.connection import Connection
from broker.direct_lane import Lane, lane_text, lane_ttl_ms
from broker.keyspace import direct_lane, direct_lanes_index
from broker.resp import Command
from broker.routing import RouteRequest
from broker.timekeeping import now_ms

from .assignment import Assigner, decision_fields, routed_instance
from .routing_table import RoutingTable
from .waiting import WaitingRoom


class DirectPublisher:
    def __init__(
        self, conn: Connection, table: RoutingTable, waiting: WaitingRoom, assigner: Assigner
    ) -> None:
        self.conn = conn
        self.table = table
        self.waiting = waiting
        self.gate = assigner.gate
        settings = conn.settings
        self.enabled = (
            settings.direct_lane
            and not conn.cluster
            and not settings.replica_acks
            and not settings.budgets
        )
        self._published: set[str] | None = None  # None: not known (a start; see publish)

    async def publish(self) -> None:
        """Each capability's lane as the current snapshot has it, or none. At a start every
        lane the index lists that this dispatcher does not publish is deleted, not only the
        ones it published: its own before a restart with other settings (a rate limit, a
        budget, the lane off) must not outlive what made it wrong."""
        lanes = self._lanes()
        keys, ttl_ms = self.conn.keys, lane_ttl_ms(self.conn.settings.sweep_interval_s)
        index = direct_lanes_index(keys)
        commands: list[Command] = [
            ("SET", direct_lane(keys, capability), text, "PX", ttl_ms)
            for capability, text in lanes.items()
        ]
        if lanes:
            commands.append(("SADD", index, *lanes))
        if self._published is None:  # whoever published them: the index lists every lane
            listed = await self.conn.call("SMEMBERS", index)
            self._published = {m.decode(errors="replace") for m in listed}
        gone = sorted(self._published - set(lanes))
        commands += [("DEL", direct_lane(keys, c)) for c in gone]
        if gone:
            commands.append(("SREM", index, *gone))
        self._published = set(lanes)
        if commands:
            await self.conn.run_all(commands)

    def _lanes(self) -> dict[str, bytes]:
        if not self.enabled or self.gate.active:
            return {}
        now = now_ms()
        return {
            capability: text
            for capability in self.table.index.candidates
            if (text := self.lane(capability, now)) is not None
        }

    def lane(self, capability: str, now: int) -> bytes | None:
        """The capability's lane: its one instance, routed to as this dispatcher would route
        any plain envelope now, with the decision's record fields; ``None`` for none. Not
        for a name routing reads as another (an alias): the lane is the name's own."""
        if (
            capability in self.waiting.backlogged
            or self.table.policy.resolve(capability) != capability
            or len(self.table.index.candidates[capability]) != 1  # the pool routing counts
        ):
            return None  # (no funnel run at every sweep for a capability many serve)
        decision = self.table.evaluate(RouteRequest(capability=capability), now_ms=now)
        instance = routed_instance(decision)
        pool = decision.steps[0] if decision.steps else None
        if instance is None or pool is None or pool.kept != 1 or instance in self.table.rates:
            return None  # the router's own pool: one candidate, and no rate of its own
        fields = decision_fields(decision)
        route_from = fields["route_from"]
        settings, counting = self.conn.settings, self.conn.counting()
        return lane_text(
            Lane(
                instance=instance,
                route_from=route_from.decode() if isinstance(route_from, bytes) else route_from,
                route_reason=str(fields["route_reason"]),
                max_bytes=settings.max_envelope_bytes,
                delivery_ms=int(settings.delivery_timeout_s * 1000),
                down_after_ms=int(settings.down_after_s * 1000),
                timeline_max=settings.timeline_max,
                counters_key=counting.key or "",
                counters_max=counting.max_series,
                partitions=settings.ingress_partitions,
            )
        )
