"""Usage and cost: what an agent reports, what each attempt is charged, how days add up. Pure.

An agent may report what a call used: ``usage: {"input_tokens", "output_tokens", "cost"}`` in
its JSON result, or the ``X-Reach-Usage`` (JSON, or ``input_tokens=12, output_tokens=30``)
and ``X-Reach-Cost`` response headers of the ``http`` adapters. It is untrusted: a figure
that is not a finite, non-negative number within bounds is ignored, never raised.

Every attempt whose outcome the sidecar records is *charged* in the script that records it
(``lua/transition.lua``): one request to the (agent, capability, tenant) of the call in the
UTC day's hash ``P:usage:<day>``, with whether it succeeded or failed, the time the agent was
busy with it and what it reported. A retried message is charged once per attempt — each did
run — and ``retried`` counts the attempts after the first, so totals say so. The tenant's
spending is kept beside the combinations (``spend\\t<tenant>``) in the day's hash and in the
month's (``P:usage:<YYYY-MM>``), which is what budgets read.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

SEP = "\t"
NO_TENANT = "-"
OTHER = "~other"  # lua/transition.lua: a new combination past the cap
SPEND = "spend"
FIGURES = (
    "requests",
    "succeeded",
    "failed",
    "retried",
    "busy_ms",
    "reported",
    "input_tokens",
    "output_tokens",
    "cost",
)
# the figures that count (whole numbers: a charge sends them as digits, lua/move_record.lua
# adds them with HINCRBY); the cost is the one that is not
COUNTS = frozenset(FIGURES) - {"cost"}
DIMENSIONS = ("agent", "capability", "tenant")
_MAX_TOKENS = 10**12
_MAX_COST = 1e12
_PAIR = re.compile(r"\s*([a-z_]+)\s*=\s*([0-9.eE+-]+)\s*\Z")


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one call used, as the agent reported it."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0

    def describe(self) -> str:
        return f"usage in={self.input_tokens} out={self.output_tokens} cost={self.cost:g}"


def _within(value: Any, most: float) -> float | None:
    """``value`` when it is a number from 0 to ``most``. Compared before any conversion: a
    JSON integer of 400 digits is a Python int no float can hold."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= most else None


def _count(value: Any) -> int | None:
    found = _within(value, _MAX_TOKENS)
    return int(found) if found is not None and found == int(found) else None


def _money(value: Any) -> float | None:
    return _within(value, _MAX_COST)


def usage_from_mapping(value: Any, cost: Any = None) -> Usage | None:
    """``{"input_tokens", "output_tokens", "cost"}`` read without trusting it; ``cost`` given
    apart (a header) wins. ``None`` when nothing usable is in it."""
    found: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for name in ("input_tokens", "output_tokens"):
            if (n := _count(value.get(name))) is not None:
                found[name] = n
        if (c := _money(value.get("cost"))) is not None:
            found["cost"] = c
    if (c := _money(cost)) is not None:
        found["cost"] = c
    return Usage(**found) if found else None


def usage_in_result(result: bytes) -> Usage | None:
    """The ``usage`` object at the top of a JSON result, if there is one (most results have
    none: they are not decoded unless the word is in them)."""
    if b'"usage"' not in result:
        return None
    try:
        decoded = msgspec.json.decode(result)
    except (msgspec.DecodeError, RecursionError):
        return None
    return usage_from_mapping(decoded.get("usage")) if isinstance(decoded, dict) else None


def stored_usage(raw: bytes | None) -> Usage | None:
    """A record's ``usage:<attempt>`` read back (written from a :class:`Usage`, but a record
    is anyone's to write who can reach Redis: read without trusting it)."""
    if not raw:
        return None
    try:
        return usage_from_mapping(msgspec.json.decode(raw))
    except (msgspec.DecodeError, RecursionError):
        return None


def usage_from_headers(usage: str | None, cost: str | None) -> Usage | None:
    """``X-Reach-Usage`` (a JSON object, or ``name=number`` pairs separated by commas) and
    ``X-Reach-Cost`` (a number)."""
    fields: dict[str, Any] = {}
    if usage:
        text = usage.strip()
        if text.startswith("{"):
            try:
                decoded = msgspec.json.decode(text[:4096])
            except (msgspec.DecodeError, RecursionError):
                decoded = None
            fields = decoded if isinstance(decoded, dict) else {}
        else:
            for part in text[:4096].split(","):
                if found := _PAIR.match(part):
                    fields[found.group(1)] = _number(found.group(2))
    return usage_from_mapping(fields, _number(cost) if cost else None)


_STORED_MAX = 1e18  # far past any day's sum the scripts write; sums of such stay finite


def _number(text: str) -> float | None:
    """A stored figure, or ``None`` for one no script writes: a sidecar's user may write a
    day's hash, and ``1e308`` twice sums to infinity, which no page can show as a count."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and abs(value) <= _STORED_MAX else None


@dataclass(frozen=True, slots=True)
class Charge:
    """What one attempt adds to its day (``lua/transition.lua``): the combination's figures,
    and the tenant's spending. ``ms`` is when, which names the day and the month."""

    agent: str
    capability: str
    tenant: str
    ms: int
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def combination(self) -> str:
        return SEP.join(
            label.replace(SEP, " ") for label in (self.agent, self.capability, self.tenant)
        )

    @property
    def spend(self) -> float:
        return self.figures.get("cost", 0.0)


def charge(
    agent: str,
    capability: str,
    tenant: str | None,
    *,
    attempt: int,
    answered: bool | None,
    busy_ms: float,
    usage: Usage | None,
    ms: int,
) -> Charge:
    """The charge of one recorded attempt. ``answered``: True succeeded, False failed (the
    agent failed, or no answer came), None neither (never reached, or it declined the work)."""
    figures: dict[str, float] = {"requests": 1, "busy_ms": max(0, round(busy_ms))}
    if answered is not None:
        figures["succeeded" if answered else "failed"] = 1
    if attempt > 1:
        figures["retried"] = 1
    if usage is not None:
        figures["reported"] = 1
        for name in ("input_tokens", "output_tokens", "cost"):
            if value := getattr(usage, name):
                figures[name] = value
    return Charge(agent, capability, tenant or NO_TENANT, ms, figures)


def reported(c: Charge) -> Usage | None:
    """What the charged call reported, if it reported anything."""
    if not c.figures.get("reported"):
        return None
    f = c.figures
    return Usage(int(f.get("input_tokens", 0)), int(f.get("output_tokens", 0)), f.get("cost", 0.0))


def utc_day(ms: int) -> str:
    return _day(ms // 86_400_000)


def utc_month(ms: int) -> str:
    return _day(ms // 86_400_000)[:7]


@functools.lru_cache(maxsize=64)
def _day(days: int) -> str:
    """``YYYY-MM-DD`` of a day number: formatted once a day, not once per recorded attempt."""
    return time.strftime("%Y-%m-%d", time.gmtime(days * 86_400))


def days_back(now_ms: int, days: int) -> list[str]:
    """The UTC days from ``days - 1`` days ago to today, oldest first."""
    return [utc_day(now_ms - back * 86_400_000) for back in range(days - 1, -1, -1)]


def parse_since(text: str) -> int:
    """``7d``, ``24h``... as a number of whole days (at least 1); ``ValueError`` says why."""
    found = re.fullmatch(r"\s*(\d{1,4})\s*(d|h|w)\s*", text)
    if not found:
        raise ValueError(f"{text!r}: a span like 7d, 24h or 2w")
    n, unit = int(found.group(1)), found.group(2)
    days = {"d": n, "w": 7 * n, "h": math.ceil(n / 24)}[unit]
    if not 1 <= days <= 3660:
        raise ValueError(f"{text!r}: between 1 day and 3660 days")
    return days


@dataclass(slots=True)
class Totals:
    """One row of ``agent-reach usage``: the figures of one agent, capability or tenant."""

    name: str
    figures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIGURES, 0.0))

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        for name, value in self.figures.items():
            out[name] = value if name == "cost" else int(value)
        return out


def totals_by(hashes: Iterable[Mapping[bytes, bytes]], by: str) -> list[Totals]:
    """Day hashes (``P:usage:<day>``, field ``agent\\tcapability\\ttenant\\tfigure``) summed by
    one dimension, the largest spender first, then the busiest. Fields that do not read are
    skipped: the hash is ours, but nothing here trusts it."""
    index = DIMENSIONS.index(by)
    rows: dict[str, Totals] = {}
    for raw in hashes:
        for name, value in raw.items():
            parts = name.decode(errors="replace").split(SEP)
            if len(parts) != 4 or parts[3] not in FIGURES:
                continue
            amount = _number(value.decode(errors="replace"))
            if amount is None:
                continue
            label = parts[index]
            row = rows.setdefault(label, Totals(label))
            row.figures[parts[3]] += amount
    return sorted(rows.values(), key=lambda r: (-r.figures["cost"], -r.figures["requests"], r.name))


def by_combination(
    hashes: Iterable[Mapping[bytes, bytes]], *, most: int | None = None
) -> dict[tuple[str, str, str], dict[str, float]]:
    """(agent, capability, tenant) -> figures, summed over ``hashes`` (``/metrics``). With
    ``most``, the combinations past that many (the least spent, then the least busy) are
    summed into one, ``~other`` in each part, as the script that writes folds past its cap:
    a sidecar's user may write the hash itself."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for raw in hashes:
        for name, value in raw.items():
            parts = name.decode(errors="replace").split(SEP)
            amount = _number(value.decode(errors="replace"))
            if len(parts) != 4 or parts[3] not in FIGURES or amount is None:
                continue
            figures = out.setdefault((parts[0], parts[1], parts[2]), dict.fromkeys(FIGURES, 0.0))
            figures[parts[3]] += amount
    if most is None or len(out) <= most:
        return out
    ranked = sorted(out.items(), key=lambda item: (-item[1]["cost"], -item[1]["requests"], item[0]))
    kept = dict(ranked[:most])
    other = kept.setdefault((OTHER, OTHER, OTHER), dict.fromkeys(FIGURES, 0.0))
    for _, figures in ranked[most:]:
        for figure, amount in figures.items():
            other[figure] += amount
    return kept


def spending(raw: Mapping[bytes, bytes]) -> dict[str, float]:
    """Tenant -> cost from a day's or a month's hash (fields ``spend\\t<tenant>``)."""
    out: dict[str, float] = {}
    prefix = f"{SPEND}{SEP}".encode()
    for name, value in raw.items():
        if name.startswith(prefix):
            amount = _number(value.decode(errors="replace"))
            if amount is not None:
                tenant = name[len(prefix) :].decode(errors="replace")
                out[tenant] = out.get(tenant, 0.0) + amount
    return out


def charged(options: dict[str, Any], attempt: int) -> dict[str, Any]:
    """A move's options with what its charge puts on the record: the agent that ran it (for
    feedback after its card is gone) and, when usage was reported, the usage
    (``usage:<attempt>``) and its words on the timeline."""
    bill: Charge | None = options.get("charge")
    if bill is None:
        return options
    fields = {**(options.get("fields") or {}), "agent": bill.agent}
    if (usage := reported(bill)) is None:
        return {**options, "fields": fields}
    fields[f"usage:{attempt}"] = msgspec.json.encode(usage)
    reason = "; ".join(filter(None, (options.get("reason"), usage.describe())))
    return {**options, "fields": fields, "reason": reason}
