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
from broker.keyspace import direct_lane
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
        self._published: set[str] = set()

    async def publish(self) -> None:
        """Each capability's lane as the current snapshot has it, or none."""
        if not self.enabled:
            return
        now = now_ms()
        lanes = {
            capability: text
            for capability in self.table.index.candidates
            if (text := self.lane(capability, now)) is not None
        }
        keys, ttl_ms = self.conn.keys, lane_ttl_ms(self.conn.settings.sweep_interval_s)
        commands: list[Command] = [
            ("SET", direct_lane(keys, capability), text, "PX", ttl_ms)
            for capability, text in lanes.items()
        ]
        commands += [("DEL", direct_lane(keys, c)) for c in sorted(self._published - set(lanes))]
        self._published = set(lanes)
        if commands:
            await self.conn.run_all(commands)

    def lane(self, capability: str, now: int) -> bytes | None:
        """The capability's lane: its one instance, routed to as this dispatcher would route
        any plain envelope now, with the decision's record fields; ``None`` for none."""
        if self.gate.active or capability in self.waiting.backlogged:
            return None
        pool = self.table.index.candidates.get(capability, [])
        if len(pool) != 1 or pool[0].instance_id in self.table.rates:
            return None
        decision = self.table.evaluate(RouteRequest(capability=capability), now_ms=now)
        instance = routed_instance(decision)
        if instance is None:
            return None
        fields = {
            name: value.decode() if isinstance(value, bytes) else str(value)
            for name, value in decision_fields(decision).items()
        }
        return lane_text(Lane(instance, fields, self.conn.settings.max_envelope_bytes))
