"""The instance registry in Redis: cards, heartbeats, state, and snapshots for routing."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, NamedTuple

import msgspec

from .connection import Connection
from .envelope import MESSAGE_ID_PATTERN
from .errors import RedisReplyError, errors_in_place
from .event_log import emit, event_command, run_with_events
from .events import heartbeat_events
from .keyspace import SIDECAR_GROUP
from .record_codec import pairs
from .records import (
    MAX_DESCRIPTION_CHARS,
    MAX_EXAMPLE_CHARS,
    MAX_EXAMPLES,
    CircuitState,
    InstanceCard,
    InstanceState,
    InstanceStats,
    InstanceView,
)
from .scripts import ScriptName
from .timekeeping import now_ms

log = logging.getLogger("agent_reach.registry")
_tags_decoder = msgspec.json.Decoder(dict[str, str])
# a card's words for the intent router are cut on reading (a card is the sidecar's say only)
_examples_decoder = msgspec.json.Decoder(tuple[str, ...])


STAT_FIELDS = InstanceStats.__struct_fields__


def stats_fields(stats: InstanceStats) -> list[str | int | float]:
    """The stats as flat field/value pairs for a hash."""
    flat: list[str | int | float] = []
    for name in STAT_FIELDS:
        value = getattr(stats, name)
        flat += [name, value.value if isinstance(value, CircuitState) else value]
    return flat


def card_fields(
    card: InstanceCard, *, credits: int, state: InstanceState, hb_ms: int
) -> dict[str, Any]:
    return {
        "agent_id": card.agent_id,
        "instance_id": card.instance_id,
        "capabilities": ",".join(card.capabilities),
        "endpoint": card.endpoint,
        "max_inflight": card.max_inflight,
        "credits": credits,
        "idempotent": int(card.idempotent),
        "version": card.version,
        "tags": msgspec.json.encode(card.tags),
        "weight": card.weight,
        "cost": card.cost,
        "status_url": card.status_url,
        "description": card.description,
        "examples": msgspec.json.encode(card.examples),
        "rate_ms": card.rate_ms,
        "burst": card.burst,
        "state": state.value,
        "hb_ms": hb_ms,
    }


def view_from_hash(raw: dict[bytes, bytes], inflight: int) -> InstanceView:
    """An instance's view from its card hash; :class:`ValueError` saying why when the card
    does not read as one (a card is written by a sidecar, which is trusted with its own
    card only: whatever is there must not stop a dispatcher, a reaper or ``agents``)."""
    try:
        view = _view(raw, inflight)
    except (ValueError, UnicodeDecodeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"card not readable: {exc}") from exc
    if problem := _card_problem(view):
        raise ValueError(f"card not usable: {problem}")
    return view


def _view(raw: dict[bytes, bytes], inflight: int) -> InstanceView:
    def text(name: str) -> str:
        return raw.get(name.encode(), b"").decode()

    card = InstanceCard(
        agent_id=text("agent_id"),
        instance_id=text("instance_id"),
        capabilities=tuple(c for c in text("capabilities").split(",") if c),
        endpoint=text("endpoint"),
        max_inflight=int(text("max_inflight") or 0),
        idempotent=text("idempotent") == "1",
        version=text("version") or "0",
        tags=_tags_decoder.decode(raw.get(b"tags") or b"{}"),
        weight=float(text("weight") or 1.0),
        cost=float(text("cost") or 0.0),
        status_url=text("status_url"),
        description=text("description")[:MAX_DESCRIPTION_CHARS],
        examples=tuple(
            e[:MAX_EXAMPLE_CHARS]
            for e in _examples_decoder.decode(raw.get(b"examples") or b"[]")[:MAX_EXAMPLES]
        ),
        rate_ms=float(text("rate_ms") or 0.0),
        burst=int(text("burst") or 1),
    )
    stats = InstanceStats(
        error_rate=float(text("error_rate") or 0.0),
        p95_ms=float(text("p95_ms") or 0.0),
        requests=int(text("requests") or 0),
        successes=int(text("successes") or 0),
        cooldown_until_ms=int(text("cooldown_until_ms") or 0),
        circuit=CircuitState(text("circuit") or "closed"),
        circuit_until_ms=int(text("circuit_until_ms") or 0),
        backoff_until_ms=int(text("backoff_until_ms") or 0),
    )
    return InstanceView(
        card=card,
        state=InstanceState(text("state") or "DOWN"),
        credits=int(text("credits") or 0),
        inflight=inflight,
        heartbeat_ms=int(text("hb_ms") or 0),
        stats=stats,
    )


_ID = re.compile(MESSAGE_ID_PATTERN)


def _card_problem(view: InstanceView) -> str | None:
    """What in a card that parsed routing cannot use: an id that breaks hash tags, a count
    below zero, a weight, cost or stat that is not a finite number."""
    card, stats = view.card, view.stats
    if not (_ID.match(card.agent_id) and _ID.match(card.instance_id)):
        return f"ids {card.agent_id!r}/{card.instance_id!r} are not ids"
    numbers = (card.weight, card.cost, stats.error_rate, stats.p95_ms, card.rate_ms)
    if not all(math.isfinite(n) and n >= 0 for n in numbers):
        return "weight, cost, error rate, p95 and rate must be finite and not negative"
    if card.burst < 1:
        return "burst must be at least 1"
    if min(card.max_inflight, view.credits, stats.requests, stats.successes) < 0:
        return "counts must not be negative"
    return None


class Beat(NamedTuple):
    """A heartbeat's answer: the state on the card (DRAINING wins), and the incarnation of
    another process that wrote the card since this one's last beat (``""``: none did)."""

    state: InstanceState
    other_writer: str


class Registry:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self._unreadable: set[str] = set()  # cards already reported: said once, not per sweep

    async def register(self, card: InstanceCard, *, credits: int, incarnation: str = "") -> None:
        """Write the card as UP and announce it, so dispatchers see it at once; with the
        sidecar process's ``incarnation``, which its heartbeats check (:meth:`heartbeat`)."""
        hb = now_ms()
        fields = card_fields(card, credits=credits, state=InstanceState.UP, hb_ms=hb)
        if incarnation:
            fields["incarnation"] = incarnation
        inst = card.instance_id
        flat = [item for pair in fields.items() for item in pair]
        registered = event_command(
            self.conn,
            "instance.registered",
            inst,
            agent=card.agent_id,
            capabilities=list(card.capabilities),
            endpoint=card.endpoint,
            max_inflight=card.max_inflight,
        )
        await run_with_events(
            self.conn,
            [
                ("HSET", self.keys.card(inst), *flat),
                ("ZADD", self.keys.agents, hb, inst),
                ("PUBLISH", self.keys.registry_channel, inst),
            ],
            [registered],
        )

    async def heartbeat(
        self,
        instance_id: str,
        state: InstanceState,
        stats: InstanceStats,
        *,
        announce: bool = False,
        hb_ms: int | None = None,
        credits: int | None = None,
        incarnation: str = "",
    ) -> Beat | None:
        """Record a heartbeat at ``hb_ms`` (default now), and the sidecar process's
        ``incarnation``; ``None`` when the card is gone. Another incarnation found on the card
        is another process under the same instance id that wrote it since this one's last
        beat: a process that had died before writes nothing, so one restarted in its place
        never meets it here."""
        hb = now_ms() if hb_ms is None else hb_ms
        channel = self.keys.registry_channel
        args = [instance_id, hb, state.value, channel, int(announce), incarnation]
        fields = stats_fields(stats) + (["credits", credits] if credits is not None else [])
        script = self.conn.script_command(
            ScriptName.HEARTBEAT, (self.keys.card(instance_id),), [*args, *fields]
        )
        # XX: a beat never adds an instance (registering does): a late beat of a sidecar that
        # has just deregistered must not list it again, with no card
        beat = ("ZADD", self.keys.agents, "XX", hb, instance_id)
        replies = await self._all([script, beat])
        if not replies[0]:
            return None
        now, before, circuit_before = (value.decode() for value in replies[0][:3])
        written_by = replies[0][3].decode(errors="replace")  # whatever another process wrote
        changes = heartbeat_events(before, now, circuit_before, stats)
        await emit(
            self.conn, [event_command(self.conn, kind, instance_id, **d) for kind, d in changes]
        )
        other = written_by if incarnation and written_by not in ("", incarnation) else ""
        return Beat(InstanceState(now), other)

    async def set_weight(self, instance_id: str, weight: float) -> bool:
        """Change an instance's routing weight at run time; false for an unknown instance."""
        return await self._set_on_card(instance_id, "weight", weight)

    async def drain(self, instance_id: str) -> bool:
        """Mark an instance DRAINING (its sidecar then finishes its work and deregisters);
        false for an unknown instance."""
        return await self.set_state(instance_id, InstanceState.DRAINING)

    async def set_state(self, instance_id: str, state: InstanceState) -> bool:
        """The card's state; false, and nothing written, when there is no card."""
        return await self._set_on_card(instance_id, "state", state.value)

    async def _set_on_card(self, instance_id: str, field: str, value: Any) -> bool:
        """One field written only while the card exists (``lua/card_set.lua``): a check and a
        write apart would leave a card of one field behind a deregistration between them.
        Dispatchers are told of a change made."""
        key = self.keys.card(instance_id)
        if not await self.conn.evalsha(ScriptName.CARD_SET, (key,), (field, value)):
            return False
        await self.conn.call("PUBLISH", self.keys.registry_channel, instance_id)
        return True

    async def deregister(self, instance_id: str) -> None:
        """Remove the card, after a drain (a sidecar always drains before it deregisters):
        ``instance.drained``, then ``instance.gone``."""
        await run_with_events(
            self.conn,
            [
                ("ZREM", self.keys.agents, instance_id),
                ("DEL", self.keys.card(instance_id)),
                ("PUBLISH", self.keys.registry_channel, instance_id),
            ],
            [
                event_command(self.conn, "instance.drained", instance_id),
                event_command(self.conn, "instance.gone", instance_id, reason="deregistered"),
            ],
        )

    async def snapshot(self) -> list[InstanceView]:
        """Every registered instance with its credits in use: two round trips in all."""
        listed = await self.conn.call("ZRANGE", self.keys.agents, 0, -1)
        ids = [i.decode(errors="replace") for i in listed]
        if not ids:
            return []
        commands: list[tuple[Any, ...]] = []
        for inst in ids:
            commands += [("HGETALL", self.keys.card(inst)), ("SCARD", self.keys.inflight(inst))]
        replies = errors_in_place(await self.conn.call_many(commands))
        views = []
        for i, inst in enumerate(ids):
            flat, inflight = replies[2 * i], replies[2 * i + 1]
            if flat:
                view = self._readable(inst, flat, inflight)
                if view is not None:
                    views.append(view)
        return views

    def _readable(self, inst: str, flat: Any, inflight: Any) -> InstanceView | None:
        """The instance's view, or ``None`` for one whose keys do not read as an instance's
        (a key of another type, a card that does not parse or names another instance): left
        out of routing (said once in the log), never a failure of whoever reads the
        registry. A sidecar's user may write its own instances' keys, not anyone's routing."""
        try:
            for reply in (flat, inflight):
                if isinstance(reply, RedisReplyError):
                    raise ValueError(f"its keys cannot be read: {reply}")
            view = view_from_hash(pairs(flat), int(inflight))
            if view.card.instance_id != inst:
                raise ValueError(f"its card names another instance, {view.card.instance_id!r}")
        except ValueError as exc:
            if inst not in self._unreadable:
                self._unreadable.add(inst)
                log.error("instance %r left out of routing: %s", inst, exc)
            return None
        self._unreadable.discard(inst)
        return view

    async def stream_backlogs(self, instance_ids: list[str]) -> list[int]:
        """Entries not yet finished on each instance's stream (pending + never delivered); 0
        for a stream that cannot be read (a sidecar's user may make its own another type)."""
        commands = [
            self.conn.script_command(ScriptName.BACKLOG, (self.keys.queue(i),), (SIDECAR_GROUP,))
            for i in instance_ids
        ]
        replies = errors_in_place(await self.conn.call_many(commands))
        return [n if isinstance(n, int) else 0 for n in replies]

    async def _all(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        replies = await self.conn.call_many(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies
