"""The cluster-wide counters: their fields in ``P:counters``, and what each becomes. Pure.

The scripts that end or retry a message count in the same call (``lua/count.lua``): a field
is ``"<kind>\\t<label>\\t..."``. :data:`COUNTERS` names each kind's Prometheus counter and
labels; :func:`read_counters` turns the hash back into samples. A field that does not read
(written by hand, or cut by the cap: ``"<kind>\\t~other"``) still counts, under ``_other``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from .slots import SLOTS, key_slot, slot_tag

SEP = "\t"
OTHER = "_other"
NEEDS_CONFIRMATION_LEVEL = b"level\tNEEDS_CONFIRMATION"  # lua/transition.lua, a level
CAPPED = "~other"  # lua/count.lua: a new field past the cap


@dataclass(frozen=True, slots=True)
class Counter:
    name: str
    help: str
    labels: tuple[str, ...]


COUNTERS: dict[str, Counter] = {
    "accepted": Counter(
        "agent_reach_messages_accepted", "Messages accepted (a record created)", ("capability",)
    ),
    "finished": Counter(
        "agent_reach_messages_finished",
        "Messages that reached a terminal stage",
        ("capability", "stage"),
    ),
    "retries": Counter(
        "agent_reach_retries", "Attempts sent back to be run again", ("capability", "reason")
    ),
    "dead_letters": Counter("agent_reach_dead_letters", "Entries dead-lettered", ("reason",)),
    "agent_calls": Counter(
        "agent_reach_agent_calls",
        "Calls of an agent, by how they ended",
        ("agent", "capability", "outcome"),
    ),
    "webhooks": Counter(
        "agent_reach_webhook_deliveries", "Webhook delivery attempts, by outcome", ("outcome",)
    ),
}


@dataclass(frozen=True, slots=True)
class Counting:
    """Where the scripts count (``None``: not at all) and the cap on distinct fields.

    On a Redis Cluster a script's keys must share a slot, so a script counts into the
    counters hash *of its record's slot*, ``<key>:{<tag of that slot>}``
    (:func:`counter_keys` lists them all for a reader); on a single server into ``key``."""

    key: str | None
    max_series: int
    per_slot: bool = False

    def keys(self, near: str) -> tuple[str, ...]:
        """The counters key a script with key ``near`` counts into (none, or one)."""
        if not self.key:
            return ()
        if not self.per_slot:
            return (self.key,)
        return (f"{self.key}:{{{slot_tag(key_slot(near))}}}",)


def counter_keys(key: str, per_slot: bool) -> list[str]:
    """Every hash that holds counts: ``key`` (counts sent beside a write, not in a script)
    and, on a cluster, the one of each slot."""
    return [key, *(f"{key}:{{{slot_tag(s)}}}" for s in range(SLOTS))] if per_slot else [key]


def field(kind: str, *labels: str) -> str:
    assert kind in COUNTERS and len(labels) == len(COUNTERS[kind].labels), (kind, labels)
    return SEP.join((kind, *(label.replace(SEP, " ") for label in labels)))


def retry(capability: str, reason: str) -> str:
    return field("retries", capability, reason)


@functools.lru_cache(maxsize=1024)  # one a call: a sidecar's few agents, capabilities, outcomes
def agent_call(agent: str, capability: str, outcome: str) -> str:
    return field("agent_calls", agent, capability, outcome)


def capped(total: dict[bytes, int], max_series: int) -> dict[bytes, int]:
    """At most ``max_series`` fields (the largest counts), the rest folded into their kind's
    ``~other``, as ``lua/count.lua`` does in one hash: on a cluster each slot's hash is capped
    on its own, so the sum of them is capped again here."""
    folded = f"{SEP}{CAPPED}".encode()
    series = {name: n for name, n in total.items() if not name.endswith(folded)}
    if len(series) <= max_series:
        return total
    ranked = sorted(series.items(), key=lambda item: (-item[1], item[0]))
    kept = {name: n for name, n in total.items() if name.endswith(folded)}
    kept.update(ranked[:max_series])
    for name, count in ranked[max_series:]:
        other = name.split(SEP.encode(), 1)[0] + folded
        kept[other] = kept.get(other, 0) + count
    return kept


def count_value(value: bytes) -> int | None:
    """A count as the broker's scripts write one (``-`` and at most 18 digits), or ``None``:
    anyone who may write counters (a sidecar's user) may write anything, and a number of
    thousands of digits fails ``int`` and, summed into a rate, ``float``."""
    digits = value[1:] if value.startswith(b"-") else value
    return int(value) if 0 < len(digits) <= 18 and digits.isdigit() else None


def read_counters(
    raw: Mapping[bytes, bytes],
) -> dict[str, dict[tuple[str, ...], int]]:
    """``P:counters`` as kind -> label values -> count."""
    out: dict[str, dict[tuple[str, ...], int]] = {kind: {} for kind in COUNTERS}
    for name, value in raw.items():
        kind, *labels = name.decode(errors="replace").split(SEP)
        counter, count = COUNTERS.get(kind), count_value(value)
        if counter is None or count is None:
            continue
        if len(labels) != len(counter.labels) or labels == [CAPPED]:
            labels = [OTHER] * len(counter.labels)
        samples = out[kind]
        key = tuple(labels)
        samples[key] = samples.get(key, 0) + count
    return out
