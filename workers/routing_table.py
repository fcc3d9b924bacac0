"""The dispatcher's local view for routing: a registry snapshot plus its own credit count.

Routing decisions never cost a Redis round trip: the snapshot is refreshed on registry
notifications and sweeps, and credits taken since are counted here. The Lua assignment stays
the real check; this only keeps the dispatcher from offering work it knows cannot fit.
"""

from __future__ import annotations

from broker.records import InstanceView
from broker.routing import candidates, choose


class RoutingTable:
    def __init__(self, *, down_after_ms: int) -> None:
        self.down_after_ms = down_after_ms
        self.instances: list[InstanceView] = []
        self.inflight: dict[str, int] = {}

    def load(self, instances: list[InstanceView]) -> None:
        self.instances = instances
        self.inflight = {v.instance_id: v.inflight for v in instances}

    def pick(self, capability: str, *, now_ms: int) -> InstanceView | None:
        """Choose an instance and count one credit taken on it."""
        pool = candidates(
            self.instances, capability, now_ms=now_ms, down_after_ms=self.down_after_ms
        )
        chosen = choose(pool, self.inflight)
        if chosen is not None:
            self.inflight[chosen.instance_id] = self.inflight.get(chosen.instance_id, 0) + 1
        return chosen

    def unreserve(self, instance_id: str) -> None:
        """Give back a credit counted by :meth:`pick` that was not used."""
        if instance_id and self.inflight.get(instance_id, 0) > 0:
            self.inflight[instance_id] -= 1

    def credits_released(self, instance_id: str, in_use: int) -> tuple[str, ...]:
        """A sidecar announced its credits in use; returns the capabilities it serves."""
        for view in self.instances:
            if view.instance_id == instance_id:
                self.inflight[instance_id] = in_use
                return view.card.capabilities
        return ()

    def mark_full(self, instance_id: str) -> None:
        for view in self.instances:
            if view.instance_id == instance_id:
                self.inflight[instance_id] = view.credits

    def free_credits(self, capability: str, *, now_ms: int) -> int:
        pool = candidates(
            self.instances, capability, now_ms=now_ms, down_after_ms=self.down_after_ms
        )
        return sum(max(0, v.credits - self.inflight.get(v.instance_id, 0)) for v in pool)
