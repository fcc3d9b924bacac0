"""The shapes of governance settings: tenant budgets, rate limits, intent rules. Pure.

They are config values (:mod:`broker.config`), checked once at load with the key named, so
no process meets a malformed rate or regex at run time. A rate is written as people say it:
``"10/s"``, ``"600/min"``, ``"5000/h"``, ``"2/d"``; it becomes an emission interval
(:func:`parse_rate`), the one number the GCRA needs (``lua/gcra.lua``).
"""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Literal

import msgspec

from .errors import quoted
from .webhooks import MAX_URL_LENGTH

Money = Annotated[float, msgspec.Meta(ge=0, le=1e12)]
Burst = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]

_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour|d|day)\s*\Z")
_UNIT_S = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60}
_UNIT_S |= {"h": 3600, "hour": 3600, "d": 86400, "day": 86400}
RATE_RULE = "a rate is `<count>/<unit>`, unit s, min, h or d (e.g. `10/s`, `600/min`)"
# a limit lower than one call a day, or faster than a million a second, is a typo
_MIN_INTERVAL_MS = 0.001
_MAX_INTERVAL_MS = 86_400_000.0


class TenantBudget(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a tenant may spend (in the agents' own cost unit) per UTC day and month."""

    daily: Money | None = None
    monthly: Money | None = None


class RateLimit(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``rate`` (``"10/s"``) with a ``burst`` (calls that may start at once; default 1)."""

    rate: str
    burst: Burst = 1


class RateLimits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Limits from config, by what they limit: an agent across its instances, a capability,
    a tenant. Instance limits are the sidecar's (``--rate``), carried on its card."""

    agent: dict[str, RateLimit] = msgspec.field(default_factory=dict)
    capability: dict[str, RateLimit] = msgspec.field(default_factory=dict)
    tenant: dict[str, RateLimit] = msgspec.field(default_factory=dict)


class IntentRule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An intent matching ``match`` (a regex, searched case-insensitively) goes to
    ``capability``; the highest ``priority`` among the matching rules wins."""

    match: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    capability: str
    priority: int = 0


class EventSubscription(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Events of the named types (all of them when none are named) POSTed to ``url`` as
    signed webhooks (:mod:`broker.events`)."""

    url: Annotated[str, msgspec.Meta(pattern=r"^https?://", max_length=MAX_URL_LENGTH)]
    events: list[str] = msgspec.field(default_factory=list)


BudgetMode = Literal["reject", "cheapest"]


def parse_rate(text: str) -> float:
    """The emission interval in ms of a rate like ``"10/s"`` (100.0); ``ValueError`` says why."""
    found = _RATE.match(text)
    if not found:
        raise ValueError(f"{text!r}: {RATE_RULE}")
    count, unit = float(found.group(1)), found.group(2)
    if count <= 0:
        raise ValueError(f"{text!r}: the count must be above zero")
    interval = _UNIT_S[unit] * 1000.0 / count
    if not _MIN_INTERVAL_MS <= interval <= _MAX_INTERVAL_MS:
        raise ValueError(f"{text!r}: between 1/d and 1000000/s")
    return interval


def rate_problem(limit: RateLimit) -> str | None:
    """Why ``limit`` cannot be used, or ``None``."""
    try:
        parse_rate(limit.rate)
    except ValueError as exc:
        return str(exc)
    return None


def rule_pattern(rule: IntentRule) -> re.Pattern[str]:
    """The rule's regex as intent routing matches it: case does not count."""
    return re.compile(rule.match, re.IGNORECASE)


def rule_problem(rule: IntentRule) -> str | None:
    """Why an intent rule cannot be used, or ``None``: a regex that does not compile, or one
    Python warns will mean something else in a later version (``[[``: a possible nested
    set), which would otherwise only log a warning where it is first used; or groups nested
    past :data:`MAX_GROUP_DEPTH` (``re``'s parser recurses into each: deep enough, it raises
    ``RecursionError`` wherever the pattern is first compiled)."""
    if _group_depth(rule.match) > MAX_GROUP_DEPTH:
        return f"match {quoted(rule.match)}: groups nested more than {MAX_GROUP_DEPTH} deep"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            rule_pattern(rule)
        except re.error as exc:
            return f"match {rule.match!r}: {exc}"
        except Warning as exc:
            return f"match {rule.match!r}: {exc} (escape it with a backslash to mean it as is)"
        except RecursionError:  # a deep stack here: as refused as too deep
            return f"match {quoted(rule.match)}: groups nested too deeply"
    return None


MAX_GROUP_DEPTH = 50


def _group_depth(pattern: str) -> int:
    """How deep the pattern's ``(`` nest, escapes skipped (a ``(`` in a set counts: over, not
    under)."""
    depth = deepest = 0
    escaped = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest
