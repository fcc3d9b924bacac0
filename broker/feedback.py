"""Ratings of finished work: ``agent-reach feedback ID --good|--bad`` and ``Client.feedback``.

A rating is kept per agent, newest first, in ``P:fb:{<agent>}`` (``LPUSH``, trimmed to the
last ``KEPT_RATINGS``, expiring ``KEPT_S`` after the last one): ``"good <id> <ms>"`` or
``"bad <id> <ms>"``. The agent is the one that ran the message: the record's ``agent``,
written with the outcome, else its ``instance``'s card's ``agent_id``. Dispatchers read
every agent's list with each registry refresh (:func:`approvals`); the share of good
ratings enters the intent router's score (:mod:`broker.intent`). The rating is noted on
the message's timeline as well (``RATED``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .connection import Connection
from .errors import ReachError, RedisReplyError, UnknownMessage
from .intent import approval_rate
from .timekeeping import now_ms
from .timeline import note_command

KEPT_RATINGS = 100
KEPT_S = 30 * 86400
RATED = "RATED"
"""The timeline event of a rating: its reason is ``good`` or ``bad``."""


class FeedbackError(ReachError):
    """Raised when a message cannot be rated: it never reached an agent, or its agent is no
    longer known (its instance's card is gone)."""


async def record_feedback(conn: Connection, message_id: str, *, good: bool) -> str:
    """Rate the agent that ran ``message_id``; returns that agent's id. Raises
    :class:`UnknownMessage` for an id with no record, :class:`FeedbackError` when no agent
    can be named."""
    keys = conn.keys
    instance, stage, agent = await conn.call(
        "HMGET", keys.record(message_id), "instance", "stage", "agent"
    )
    if stage is None:
        raise UnknownMessage(message_id)
    if not instance:
        raise FeedbackError(f"message {message_id!r} never reached an agent: nothing to rate")
    inst = instance.decode(errors="replace")
    if not agent:  # recorded with the outcome; before that, the instance's card names it
        agent = await conn.call("HGET", keys.card(inst), "agent_id")
    if not agent:
        raise FeedbackError(
            f"message {message_id!r} ran on instance {inst!r}, whose card is gone: "
            "its agent cannot be named"
        )
    agent_id: str = agent.decode(errors="replace")
    rating = "good" if good else "bad"
    now = now_ms()
    key = conn.fleet.feedback(agent_id)
    commands: list[tuple[Any, ...]] = [
        ("LPUSH", key, f"{rating} {message_id} {now}"),
        ("LTRIM", key, 0, KEPT_RATINGS - 1),
        ("EXPIRE", key, KEPT_S),
    ]
    for reply in await conn.call_many(commands):
        if isinstance(reply, Exception):
            raise reply
    try:  # the timeline note is a courtesy: a user refused the script still rates
        await conn.call(*note_command(conn, message_id, RATED, rating, now_ms=now))
    except RedisReplyError:
        pass
    return agent_id


async def approvals(conn: Connection, agents: Iterable[str]) -> dict[str, float | None]:
    """Each agent's approval rate over its kept ratings (``None``: not rated): one round trip."""
    names = sorted(set(agents))
    if not names:
        return {}
    fleet = conn.fleet
    replies = await conn.call_many([("LRANGE", fleet.feedback(a), 0, -1) for a in names])
    rates: dict[str, float | None] = {}
    for agent, reply in zip(names, replies, strict=True):
        if isinstance(reply, Exception):
            raise reply
        rates[agent] = approval_rate(reply or [])
    return rates
