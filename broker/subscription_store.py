"""Event subscriptions in ``P:subs`` (``agent-reach subscribe``), with config's beside them."""

from __future__ import annotations

import logging

from .connection import Connection
from .record_codec import pairs
from .subscriptions import (
    Subscription,
    decode_subscriptions,
    encode_subscription,
    new_subscription_id,
    static_subscriptions,
)
from .timekeeping import now_ms

log = logging.getLogger("agent_reach.events")


class SubscriptionStore:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.key = conn.fleet.subscriptions
        self._reported: set[str] = set()  # unreadable ones already logged

    async def add(self, url: str, events: tuple[str, ...]) -> tuple[str, Subscription]:
        """Store a subscription (checked by the caller); returns its new id."""
        subscription = Subscription(url=url, events=events, created_ms=now_ms())
        sub_id = new_subscription_id()
        await self.conn.call("HSET", self.key, sub_id, encode_subscription(subscription))
        return sub_id, subscription

    async def remove(self, sub_id: str) -> bool:
        """Delete a stored subscription; false when there is none by that id."""
        return bool(await self.conn.call("HDEL", self.key, sub_id))

    async def stored(self) -> dict[str, Subscription]:
        found, problems = decode_subscriptions(pairs(await self.conn.call("HGETALL", self.key)))
        for problem in problems:
            if problem not in self._reported:
                self._reported.add(problem)
                log.error(problem)
        return found

    async def all(self) -> dict[str, Subscription]:
        """Every subscription: config's (``event_subscriptions``) and the stored ones."""
        return static_subscriptions(self.conn.settings.event_subscriptions) | await self.stored()
