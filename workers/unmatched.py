"""Work no instance can take at all, set aside in its capability's unmatched set
(``P:u:{cap}``) so it does not stand in front of work that can be served: reviewed at each
sweep, and put back in line once some instance can take it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from broker.envelope import load_envelope
from broker.errors import errors_in_place
from broker.records import MessageRecord
from broker.routing import Outcome
from broker.stages import QUEUED, Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from broker.waiting_sets import restore_commands

from .assignment import route_request
from .routing_table import RoutingTable

# the outcomes that say no instance at all can take the work, credits or not
EXPLAINED = (Outcome.NO_CAPABILITY_MATCH, Outcome.NO_SELECTOR_MATCH, Outcome.ALL_CANDIDATES_DOWN)


def may_wait(record: MessageRecord | None) -> bool:
    return record is not None and record.stage in QUEUED  # may come back to WAITING: leave it


class UnmatchedReview:
    def __init__(self, store: MessageStore, table: RoutingTable, *, batch: int) -> None:
        self.store = store
        self.table = table
        self.batch = batch
        self._review_from: dict[str, int] = {}  # where the next review of a set starts

    def forget(self, capability: str) -> None:
        self._review_from.pop(capability, None)

    async def reconsider(self, capabilities: Iterable[str]) -> int:
        """Put back in their waiting sets the set-aside messages some instance can now take
        (it registered, came back up, gained a tag). A window of each unmatched set per call,
        moving on from where the last one ended, so a deep set is reviewed in turn. Returns
        how many went back."""
        now = now_ms()
        windows = {c: (self._review_from.get(c, 0), self.batch) for c in capabilities}
        if not windows:
            return 0
        heads = await self.store.waiting.unmatched_heads(windows)
        ids = [i for head in heads.values() for i in head]
        records = dict(zip(ids, await self.store.get_records(ids), strict=True))
        commands: list[tuple[Any, ...]] = []
        restored = 0
        for capability, head in heads.items():
            self._review_from[capability] = (
                0 if len(head) < self.batch else sum(windows[capability])
            )
            stale = [i for i in head if not may_wait(records[i])]
            back = []
            for i in head:
                record = records[i]
                if record is None or record.stage is not Stage.WAITING:
                    continue
                request = route_request(load_envelope(record.envelope), {})
                decision = self.table.evaluate(request, now_ms=now)
                if decision.outcome not in EXPLAINED:
                    back.append(record)
            if stale:
                commands.append(("ZREM", self.store.keys.unmatched(capability), *stale))
            commands += restore_commands(self.store.keys, capability, back)
            restored += len(back)
        errors_in_place(await self.store.conn.call_many(commands))  # a spoiled set: see heads
        return restored
