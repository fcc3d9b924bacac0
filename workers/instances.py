"""What the reaper knows of the instances: a registry snapshot, refreshed every tick, and the
one rule of when an instance's work is no longer its own."""

from __future__ import annotations

from broker.records import InstanceView
from broker.registry import Registry

from .routing_table import RoutingTable


class Instances:
    def __init__(self, registry: Registry, table: RoutingTable) -> None:
        self.registry = registry
        self.table = table
        self.views: dict[str, InstanceView] = {}

    async def refresh(self) -> None:
        views = await self.registry.snapshot()
        self.table.load(views)
        self.views = {v.instance_id: v for v in views}

    def view(self, instance_id: str) -> InstanceView | None:
        return self.views.get(instance_id)

    def down(self, instance_id: str, now: int) -> bool:
        """Its sidecar is gone: deregistered, or silent past ``down_after_s``. Only the
        heartbeat counts — a live sidecar reporting DOWN (errors) or DRAINING still owns its
        work; a dead one that was DRAINING does not."""
        view = self.views.get(instance_id)
        return view is None or now - view.heartbeat_ms > self.table.policy.down_after_ms

    def dead(self, now: int) -> list[str]:
        """The instances whose work the reaper takes over now."""
        return [i for i in self.views if self.down(i, now)]
