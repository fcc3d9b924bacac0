"""Waiting sets: per capability, the messages waiting for a credit (``P:w:{cap}``), those no
instance can take at all (``P:u:{cap}``), the index of capabilities with work
(``P:waiting``), and the per-capability assignment counters that pace the drain."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from .cluster_map import ORDER_BARRIER
from .connection import Connection
from .envelope import CAPABILITY_PATTERN, MESSAGE_ID_PATTERN
from .errors import RedisReplyError, errors_in_place
from .fairness import PRIORITY_BANDS, PRIORITY_SPAN, split_score, waiting_score
from .keyspace import Keyspace
from .records import MessageRecord

Command = tuple[Any, ...]
RATE_WINDOW_MS = 10_000
# On the registry channel, "waiting <capability>": work was parked for it. Instance ids (the
# channel's other messages) have no spaces, so the two never meet.
WAITING_HINT = b"waiting "
RATE_SPAN_WINDOWS = 6  # the assignment rate is averaged over the last minute
WARN_AGAIN_S = 60.0  # how often an unreadable waiting set is named in the log again

log = logging.getLogger("agent_reach.waiting")
_CAPABILITY = re.compile(CAPABILITY_PATTERN.encode())
_ID = re.compile(MESSAGE_ID_PATTERN.encode())


def stand_aside_commands(keys: Keyspace, items: list[tuple[str, str, int, int]]) -> list[Command]:
    """``(capability, message_id, priority, until_ms)``: a waiting message that may not go
    before ``until_ms`` (a retry's back-off, a rate limit) takes the place of one that came
    then, so it does not stand at the head in front of work that may go now (``XX``: only
    if still waiting)."""
    return [
        ("ZADD", keys.waiting(capability), "XX", waiting_score(priority, until), message_id)
        for capability, message_id, priority, until in items
    ]


def parks_hint(conn: Connection) -> bool:
    """Whether a park tells the dispatchers (:func:`park_commands`), and so whether a credit
    release drains only what a dispatcher knows may have work: on one server. On a cluster a
    keyless ``PUBLISH`` goes to one master, whose failover would fail every park; there a
    release drains all its instance's capabilities, hint or not."""
    return not conn.cluster


def park_commands(
    keys: Keyspace, items: list[tuple[str, str, int, int]], *, hint: bool
) -> list[Command]:
    """``(capability, message_id, priority, accepted_ms)``: the waiting-set entries, then the
    capability index — in that order, so that a prune of the index
    (:meth:`WaitingSets.prune_index`) never drops a capability that has just been given work
    — then, with ``hint`` (:func:`parks_hint`), a hint to the dispatchers
    (:func:`heard_waiting`): a credit release drains only capabilities a dispatcher knows
    may have work waiting, and this is how it knows of work parked by anyone else (a sidecar
    sending work back, the reaper, an operator's replay).
    The deadline index (``P:due``) is written by admission (:mod:`workers.admission`)."""
    commands: list[Command] = [
        ("ZADD", keys.waiting(capability), waiting_score(priority, accepted), message_id)
        for capability, message_id, priority, accepted in items
    ]
    if not items:
        return commands
    commands.append(ORDER_BARRIER)  # on a cluster: other slots, so the entries land first
    capabilities = sorted({i[0] for i in items})
    commands += [("SADD", keys.waiting_index, capability) for capability in capabilities]
    if hint:
        commands += [("PUBLISH", keys.registry_channel, waiting_hint(c)) for c in capabilities]
    return commands


def waiting_hint(capability: str) -> bytes:
    return WAITING_HINT + capability.encode()


def heard_waiting(data: bytes) -> str | None:
    """The capability a registry-channel message says was given waiting work; ``None`` for
    any other message (an instance's id: its card changed)."""
    if not data.startswith(WAITING_HINT):
        return None
    return data[len(WAITING_HINT) :].decode("utf-8", "replace")


def unpark_commands(keys: Keyspace, removals: Mapping[str, list[str]]) -> list[Command]:
    """Remove waiting entries, wherever they are: the waiting set or the unmatched one."""
    commands: list[Command] = []
    for capability, ids in removals.items():
        if ids:
            commands += [
                ("ZREM", keys.waiting(capability), *ids),
                ("ZREM", keys.unmatched(capability), *ids),
            ]
    return commands


def set_aside_commands(
    keys: Keyspace, capability: str, records: list[MessageRecord]
) -> list[Command]:
    """Move waiting messages no instance can take at all out of the waiting set, so they
    do not stand in front of work that could be served (same score, other set)."""
    return _move_between(keys.waiting(capability), keys.unmatched(capability), records)


def restore_commands(
    keys: Keyspace, capability: str, records: list[MessageRecord]
) -> list[Command]:
    """Put set-aside messages back in the waiting set, in their place by priority and age."""
    return _move_between(keys.unmatched(capability), keys.waiting(capability), records)


def _move_between(source: str, target: str, records: list[MessageRecord]) -> list[Command]:
    if not records:
        return []
    scored: list[Any] = []
    for r in records:
        scored += [waiting_score(r.priority, r.accepted_ms), r.id]
    return [("ZADD", target, *scored), ("ZREM", source, *(r.id for r in records))]


def count_assigned_commands(keys: Keyspace, counts: Mapping[str, int], now: int) -> list[Command]:
    """Add to each capability's assignment counter for the current window."""
    window = now // RATE_WINDOW_MS
    commands: list[Command] = []
    for capability, n in counts.items():
        key = keys.assigned(capability, window)
        commands += [("INCRBY", key, n), ("EXPIRE", key, ASSIGNED_KEEP_S)]
    return commands


# an assignment counter is kept this long: the rate's span and two windows more
ASSIGNED_KEEP_S = (RATE_SPAN_WINDOWS + 2) * RATE_WINDOW_MS // 1000


def assigned_counter_stem(keys: Keyspace, capability: str) -> str:
    """The name of the capability's assignment counters but for the window's number (a
    script that reads its own clock names the window, ``lua/accept_direct.lua``)."""
    return keys.assigned(capability, 0).removesuffix("0")


def _first_of_band(key: str, band: int) -> Command:
    """The first member of a waiting set in a priority band, with its score."""
    low, high = band * PRIORITY_SPAN, f"({(band + 1) * PRIORITY_SPAN}"
    return ("ZRANGEBYSCORE", key, low, high, "WITHSCORES", "LIMIT", 0, 1)


class WaitingSets:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self._warned_at: dict[str, float] = {}  # unreadable key -> when it was last named
        self.index_unreadable = False  # the last read of the index was refused

    async def park(
        self,
        capability: str,
        message_id: str,
        priority: int,
        accepted_ms: int,
        *,
        hint: bool = True,
    ) -> None:
        """Index a WAITING message in its capability's waiting set (idempotent). ``hint``:
        tell the dispatchers (where :func:`parks_hint`); not for a look that indexes again
        what is most likely indexed already."""
        await self.park_many([(capability, message_id, priority, accepted_ms)], hint=hint)

    async def park_many(self, items: list[tuple[str, str, int, int]], *, hint: bool = True) -> None:
        """``(capability, message_id, priority, accepted_ms)`` tuples, in one round trip."""
        hinted = hint and parks_hint(self.conn)
        await self.conn.run_all(park_commands(self.keys, items, hint=hinted))

    async def unpark_many(self, capability: str, message_ids: list[str]) -> None:
        await self.conn.run_all(unpark_commands(self.keys, {capability: message_ids}))

    async def prune_index(self, capabilities: list[str]) -> list[str]:
        """Drop from ``P:waiting`` the capabilities with nothing waiting, so the index — and
        every sweep's work — does not grow with each capability name a producer ever sent.
        Removed, then checked again and put back if work arrived meanwhile: work is parked
        before its capability is indexed (:func:`park_commands`), so whichever order the two
        run in, a capability with waiting work ends up indexed. Returns those dropped."""
        empty = await self._empty(capabilities)
        if not empty:
            return []
        await self.conn.call("SREM", self.keys.waiting_index, *empty)
        still = set(await self._empty(empty))
        back = [c for c in empty if c not in still]
        if back:
            await self.conn.call("SADD", self.keys.waiting_index, *back)
        return [c for c in empty if c in still]

    async def _empty(self, capabilities: list[str]) -> list[str]:
        keys = [(self.keys.waiting(c), self.keys.unmatched(c)) for c in capabilities]
        commands = [("ZCARD", k) for pair in keys for k in pair]
        replies = errors_in_place(await self.conn.call_many(commands))
        # a set that cannot be read (another type) is not known empty: it stays indexed
        return [c for i, c in enumerate(capabilities) if replies[2 * i] == replies[2 * i + 1] == 0]

    async def heads(
        self, windows: Mapping[str, tuple[int, int]]
    ) -> dict[str, list[tuple[str, int]]]:
        """``(message_id, priority)`` in each capability's waiting set from ``(start, count)``,
        in waiting order: one round trip. A set that cannot be read is left out
        (:meth:`_readable`), and a member no park writes (no message id, or a score that is
        not finite) is removed."""
        replies = await self._windows(self.keys.waiting, windows, "WITHSCORES")
        heads: dict[str, list[tuple[str, int]]] = {}
        junk: list[tuple[str, bytes]] = []
        for capability, flat in replies.items():
            head = heads[capability] = []
            for member, score in zip(flat[::2], map(float, flat[1::2]), strict=True):
                if math.isfinite(score) and _ID.match(member):
                    head.append((member.decode(), split_score(score)[0]))
                else:
                    junk.append((capability, member))
        await self._remove(self.keys.waiting, junk)
        return heads

    async def unmatched_heads(self, windows: Mapping[str, tuple[int, int]]) -> dict[str, list[str]]:
        """Ids in each capability's unmatched set from ``(start, count)``: one round trip. A set
        that cannot be read is left out (:meth:`_readable`), and a member no park writes is
        removed (:meth:`_sorted_out`)."""
        replies = await self._windows(self.keys.unmatched, windows)
        junk: list[tuple[str, bytes]] = []
        heads = {c: self._sorted_out(c, members, junk) for c, members in replies.items()}
        await self._remove(self.keys.unmatched, junk)
        return heads

    @staticmethod
    def _sorted_out(
        capability: str, members: list[bytes], junk: list[tuple[str, bytes]]
    ) -> list[str]:
        """The members that are message ids, decoded; the others go to ``junk``. Parks write
        only ids, with finite scores; anyone who may park (a sidecar's user) may write any."""
        ids = [m.decode() for m in members if _ID.match(m)]
        junk += [(capability, m) for m in members if not _ID.match(m)]
        return ids

    async def _remove(self, key: Callable[[str], str], junk: list[tuple[str, bytes]]) -> None:
        if junk:
            log.error("%d members of waiting sets no park wrote: removed", len(junk))
            errors_in_place(await self.conn.call_many([("ZREM", key(c), m) for c, m in junk]))

    async def _windows(
        self, key: Callable[[str], str], windows: Mapping[str, tuple[int, int]], *options: str
    ) -> dict[str, list[bytes]]:
        """``ZRANGE`` of each capability's ``key`` over its window, by capability."""
        capabilities = list(windows)
        commands = [
            ("ZRANGE", key(c), windows[c][0], sum(windows[c]) - 1, *options) for c in capabilities
        ]
        replies = errors_in_place(await self.conn.call_many(commands))
        return self._readable({key(c): (c, r) for c, r in zip(capabilities, replies, strict=True)})

    def _readable(self, replies: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
        """The replies by capability, less those Redis refused: a set someone made a key of
        another type (a sidecar's user may write waiting sets) fails only its own
        capability's drain, named in the log once a minute, and not every capability's."""
        readable: dict[str, Any] = {}
        now = time.monotonic()
        for key, (capability, reply) in replies.items():
            if not isinstance(reply, RedisReplyError):
                readable[capability] = reply
            elif now - self._warned_at.get(key, -WARN_AGAIN_S) >= WARN_AGAIN_S:
                if len(self._warned_at) > 1000:  # a memory, not a record: kept small
                    self._warned_at.clear()
                self._warned_at[key] = now
                log.warning(
                    "%s cannot be read (%s): waiting work (of %s) is not drained until the key "
                    "is deleted (DEL %s); the reaper then indexes its messages again",
                    key,
                    reply,
                    capability,
                    key,
                )
        return readable

    async def depths(self, capabilities: list[str]) -> dict[str, tuple[int, int]]:
        """``(waiting, unmatched)`` of each capability: all its waiting messages, and those
        of them no instance can take at all. One round trip; a set that cannot be read
        (another type) counts as empty."""
        keys = [k for c in capabilities for k in (self.keys.waiting(c), self.keys.unmatched(c))]
        replies = errors_in_place(await self.conn.call_many([("ZCARD", k) for k in keys]))
        n = [r if isinstance(r, int) else 0 for r in replies]
        return {c: (n[2 * i] + n[2 * i + 1], n[2 * i + 1]) for i, c in enumerate(capabilities)}

    async def oldest_accepted(self, capabilities: list[str]) -> dict[str, int | None]:
        """When each capability's oldest waiting message was accepted (ms), or ``None``. The
        oldest is the first of some priority band in one of its two sets: a look per band,
        one round trip in all."""
        looks: list[Command] = [
            _first_of_band(key, band)
            for c in capabilities
            for key in (self.keys.waiting(c), self.keys.unmatched(c))
            for band in range(PRIORITY_BANDS)
        ]
        replies = errors_in_place(await self.conn.call_many(looks))
        per = 2 * PRIORITY_BANDS
        oldest: dict[str, int | None] = {}
        for i, capability in enumerate(capabilities):
            firsts = [f for f in replies[i * per : (i + 1) * per] if isinstance(f, list) and f]
            ages = [split_score(float(f[1]))[1] for f in firsts]
            oldest[capability] = min(ages) if ages else None
        return oldest

    async def capabilities(self) -> list[str]:
        """The capabilities the index lists. Anyone who may park work (a sidecar's user) may
        add to it: a member that names no capability is passed over, not decoded. An index
        that cannot be read lists none (and :attr:`index_unreadable` says so)."""
        [members] = errors_in_place(
            await self.conn.call_many([("SMEMBERS", self.keys.waiting_index)])
        )
        readable = self._readable({self.keys.waiting_index: ("every capability", members)})
        self.index_unreadable = not readable
        return sorted(
            m.decode() for m in readable.get("every capability", []) if _CAPABILITY.match(m)
        )

    async def remove_index(self) -> None:
        """Delete an index someone made another type: every park fails on it until then
        (parks, and the reaper's looks at what waits, index again)."""
        log.error("%s is not a set: deleted, the parks index again", self.keys.waiting_index)
        errors_in_place(await self.conn.call_many([("DEL", self.keys.waiting_index)]))

    async def depth(self, capability: str) -> int:
        """Messages waiting for ``capability``: for a credit, and for any instance at all."""
        keys = (self.keys.waiting(capability), self.keys.unmatched(capability))
        return sum(int(n) for n in await self.conn.call_many([("ZCARD", k) for k in keys]))

    async def assignment_rates(self, capabilities: list[str], now: int) -> dict[str, float]:
        """Assignments per second over the last minute (the current window counts for the
        part of it that has passed)."""
        window = now // RATE_WINDOW_MS
        first = window - RATE_SPAN_WINDOWS
        elapsed_s = (now - first * RATE_WINDOW_MS) / 1000
        replies = await self.conn.call_many(
            [
                ("MGET", *(self.keys.assigned(c, w) for w in range(first, window + 1)))
                for c in capabilities
            ]
        )
        return {
            c: sum(int(v) for v in counts if v) / elapsed_s
            for c, counts in zip(capabilities, replies, strict=True)
        }
