"""The instance registry in Redis: cards, heartbeats, state, and snapshots for routing."""

from __future__ import annotations

from typing import Any

import msgspec

from .connection import Connection
from .keyspace import SIDECAR_GROUP
from .records import CircuitState, InstanceCard, InstanceState, InstanceStats, InstanceView
from .scripts import ScriptName
from .store import now_ms, pairs

_tags_decoder = msgspec.json.Decoder(dict[str, str])


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
        "state": state.value,
        "hb_ms": hb_ms,
    }


def view_from_hash(raw: dict[bytes, bytes], inflight: int) -> InstanceView:
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


class Registry:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys

    async def register(self, card: InstanceCard, *, credits: int) -> None:
        """Write the card as UP and announce it, so dispatchers see it at once."""
        hb = now_ms()
        fields = card_fields(card, credits=credits, state=InstanceState.UP, hb_ms=hb)
        inst = card.instance_id
        flat = [item for pair in fields.items() for item in pair]
        await self._all(
            [
                ("HSET", self.keys.card(inst), *flat),
                ("ZADD", self.keys.agents, hb, inst),
                ("PUBLISH", self.keys.registry_channel, inst),
            ]
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
    ) -> InstanceState | None:
        """Record a heartbeat at ``hb_ms`` (default now); returns the card's state (DRAINING
        wins), or ``None`` when the card is gone."""
        hb = now_ms() if hb_ms is None else hb_ms
        args = [instance_id, hb, state.value, self.keys.registry_channel, int(announce)]
        fields = stats_fields(stats) + (["credits", credits] if credits is not None else [])
        script = self.conn.script_command(
            ScriptName.HEARTBEAT, (self.keys.card(instance_id),), [*args, *fields]
        )
        replies = await self._all([script, ("ZADD", self.keys.agents, hb, instance_id)])
        return InstanceState(replies[0].decode()) if replies[0] else None

    async def set_weight(self, instance_id: str, weight: float) -> bool:
        """Change an instance's routing weight at run time; false for an unknown instance."""
        key = self.keys.card(instance_id)
        if not await self.conn.call("EXISTS", key):
            return False
        await self._all(
            [("HSET", key, "weight", weight), ("PUBLISH", self.keys.registry_channel, instance_id)]
        )
        return True

    async def drain(self, instance_id: str) -> bool:
        """Mark an instance DRAINING (its sidecar then finishes its work and deregisters)."""
        key = self.keys.card(instance_id)
        if not await self.conn.call("EXISTS", key):
            return False
        await self.set_state(instance_id, InstanceState.DRAINING)
        return True

    async def set_state(self, instance_id: str, state: InstanceState) -> None:
        await self.conn.call("HSET", self.keys.card(instance_id), "state", state.value)
        await self.conn.call("PUBLISH", self.keys.registry_channel, instance_id)

    async def deregister(self, instance_id: str) -> None:
        await self._all(
            [
                ("ZREM", self.keys.agents, instance_id),
                ("DEL", self.keys.card(instance_id)),
                ("PUBLISH", self.keys.registry_channel, instance_id),
            ]
        )

    async def snapshot(self) -> list[InstanceView]:
        """Every registered instance with its credits in use: two round trips in all."""
        ids = [i.decode() for i in await self.conn.call("ZRANGE", self.keys.agents, 0, -1)]
        if not ids:
            return []
        commands: list[tuple[Any, ...]] = []
        for inst in ids:
            commands += [("HGETALL", self.keys.card(inst)), ("SCARD", self.keys.inflight(inst))]
        replies = await self._all(commands)
        views = []
        for i in range(len(ids)):
            flat, inflight = replies[2 * i], replies[2 * i + 1]
            if flat:
                views.append(view_from_hash(pairs(flat), int(inflight)))
        return views

    async def stream_backlogs(self, instance_ids: list[str]) -> list[int]:
        """Entries not yet finished on each instance's stream (pending + never delivered)."""
        return [
            int(n)
            for n in await self._all(
                [
                    self.conn.script_command(
                        ScriptName.BACKLOG, (self.keys.queue(i),), (SIDECAR_GROUP,)
                    )
                    for i in instance_ids
                ]
            )
        ]

    async def _all(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        replies = await self.conn.call_many(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies
