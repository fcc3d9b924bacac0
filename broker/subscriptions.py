"""Event subscriptions: which events go to which URL. Pure.

A subscription is stored in ``P:subs`` (id -> JSON ``{url, events, created_ms}``) by
``agent-reach subscribe``, or listed in config (``event_subscriptions``; its id is derived
from its URL and types, so it stays the same across restarts). One naming no types receives
every event. A URL is held to what result webhooks are held to
(:func:`broker.webhooks.callback_problem`): http(s), a host on ``callback_hosts``, and a
``webhook_secret`` to sign with.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Collection, Mapping

import msgspec

from .events import types_problem
from .governance import EventSubscription
from .webhooks import Allowlist, callback_problem

STATIC_PREFIX = "cfg-"


class Subscription(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    events: tuple[str, ...] = ()
    created_ms: int = 0

    def matches(self, kind: str) -> bool:
        """Whether an event of type ``kind`` goes to this subscription."""
        return not self.events or kind in self.events


def new_subscription_id() -> str:
    return "s" + secrets.token_hex(6)


def static_subscription_id(subscription: EventSubscription) -> str:
    """The id of a config subscription: a digest of its URL and types."""
    text = subscription.url + "\n" + ",".join(sorted(subscription.events))
    return STATIC_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:12]


def static_subscriptions(configured: Collection[EventSubscription]) -> dict[str, Subscription]:
    return {
        static_subscription_id(s): Subscription(url=s.url, events=tuple(s.events))
        for s in configured
    }


def encode_subscription(subscription: Subscription) -> bytes:
    return msgspec.json.encode(subscription)


def decode_subscriptions(raw: Mapping[bytes, bytes]) -> tuple[dict[str, Subscription], list[str]]:
    """The stored subscriptions (``HGETALL P:subs`` as a mapping) that read as one, and a
    line for each that does not (written by hand, or by a newer version): skipped, never
    raised."""
    found: dict[str, Subscription] = {}
    problems: list[str] = []
    for key, value in raw.items():
        name = key.decode(errors="replace")
        try:
            found[name] = msgspec.json.decode(value, type=Subscription)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            problems.append(f"subscription {name!r} left out: {exc}")
    return found, problems


def subscription_problem(
    url: str, events: Collection[str], hosts: Allowlist | Collection[str], secret: str | None
) -> str | None:
    """Why a subscription to ``events`` at ``url`` cannot be made, or ``None``."""
    if problem := types_problem(events):
        return problem
    if problem := callback_problem(url, hosts, secret):
        return problem.replace("callback_url", "subscription url", 1)
    return None
