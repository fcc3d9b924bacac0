"""A dispatcher's hints (broker/notifications.py) on a real server: where some may have been
lost, the next one says so, so the dispatcher reads the registry and waiting work again
instead of waiting for its sweep."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from broker.connection import Connection
from broker.notifications import _QUEUED, MISSED, Notifications


@asynccontextmanager
async def listening(conn: Connection) -> AsyncIterator[Notifications]:
    notifications = Notifications(conn)
    async with anyio.create_task_group() as tg:
        await tg.start(notifications.run)
        yield notifications
        tg.cancel_scope.cancel()


async def heard(conn: Connection, notifications: Notifications, data: bytes) -> list[bytes]:
    """Publish ``data`` on the registry channel until it is heard; what was heard on the way
    (the subscription is made in the background)."""
    got: list[bytes] = []
    with anyio.fail_after(10):
        while data not in got:
            await conn.call("PUBLISH", conn.keys.registry_channel, data)
            while (hint := await notifications.next(timeout_s=0.05)) is not None:
                got.append(hint[1])
    return got


async def test_after_the_subscription_drops_the_next_hint_says_some_were_missed(
    conn: Connection,
) -> None:
    async with listening(conn) as notifications:
        first = await heard(conn, notifications, b"a-1")
        assert MISSED not in first  # subscribed once: nothing missed
        await conn.call("CLIENT", "KILL", "TYPE", "pubsub")
        again = await heard(conn, notifications, b"a-2")
    assert again[0] == MISSED  # before anything heard on the new subscription


async def test_hints_past_what_is_kept_unread_make_the_next_one_say_some_were_missed(
    conn: Connection,
) -> None:
    notifications = Notifications(conn)
    for i in range(_QUEUED + 5):  # as they arrive from the subscription, none read yet
        notifications._hint(conn.keys.registry_channel, b"b-%d" % i)
    kept = []
    while (hint := await notifications.next(timeout_s=0)) is not None:
        kept.append(hint[1])
    assert kept[0] == MISSED  # the five oldest went
    assert kept[1:] == [b"b-%d" % i for i in range(5, _QUEUED + 5)]
