"""The janitor: finds what no index points at any more, one ``SCAN`` page per reaper tick.

Every live message is indexed in ``P:due`` and every live instance in ``P:agents``; the
reaper works from those. What falls out of them would stay in Redis for ever:

- a live (non-terminal) record missing from ``P:due`` — its ingress entry deleted while it
  was pending, say, so no dispatcher ever finished its writes — is indexed again, due at
  once, and the reaper resolves it by its stage like any other;
- a timeline an older version kept as a list (``P:t:{id}``, now the record's field) whose
  record has ended or gone: it was given an expiry only when its message ended, so one still
  live at the upgrade would stay; it now leaves with its record;
- the keys of an instance gone for good — silent for ``instance_gone_after_s``, holding no
  credit and no entry its sidecar read and never finished — are removed: card, work stream,
  in-flight set, callback key (``lua/forget_instance.lua``, atomic on the instance's slot)
  and its ``P:agents`` entry. Sidecars started without ``--instance-id`` get a fresh id each
  time, so without this every restart would leave a stream behind;
- a credit held for an attempt that no longer holds it, whose entry no sidecar holds either
  (a process stopped between its move and its return), is returned
  (:mod:`workers.credit_audit`).

A pass over the key space starts every ``orphan_sweep_s`` (0: never); several reapers may
sweep at once, which only repeats idempotent work.
"""

from __future__ import annotations

import logging
from typing import Any

from broker.connection import Connection
from broker.errors import RedisUnavailable
from broker.event_log import emit, event_command
from broker.keyspace import SIDECAR_GROUP, due_for
from broker.scripts import ScriptName
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore

from .credit_audit import return_orphaned_credits

log = logging.getLogger("agent_reach.janitor")

PAGE = 1000
_LIVE = frozenset(stage.value.encode() for stage in Stage if stage not in TERMINAL)


class Janitor:
    def __init__(self, conn: Connection, store: MessageStore) -> None:
        self.conn = conn
        self.store = store
        self.keys = conn.keys
        self.interval_ms = int(conn.settings.orphan_sweep_s * 1000)
        self.gone_after_ms = int(conn.settings.instance_gone_after_s * 1000)
        self._pass: list[tuple[str, str]] | None = None  # a pass under way: (node, cursor)
        self._next_pass_ms = 0
        self.reindexed = 0  # records put back in P:due, over this janitor's life
        self.forgotten = 0  # instances forgotten
        self.credits_returned = 0  # credits no attempt and no entry held (credit_audit)

    async def step(self, now: int) -> None:
        """One page of the current pass (starting a pass when one is due)."""
        if self.interval_ms <= 0:
            return
        if not self._pass:
            if now < self._next_pass_ms:
                return
            self._next_pass_ms = now + self.interval_ms
            self._pass = [(node, "0") for node in self.conn.nodes]  # each master of a cluster
            await self._forget(await self._silent_registered(now), now)
        node, cursor = self._pass[0]
        try:
            reply = await self.conn.call_on(
                node, "SCAN", cursor, "MATCH", f"{self.keys.prefix}:*", "COUNT", PAGE
            )
        except RedisUnavailable:
            self._pass = None  # a node gone (a failover?): the next pass starts on the nodes now
            raise
        if reply[0] == b"0":
            self._pass.pop(0)
        else:
            self._pass[0] = (node, reply[0].decode())
        keys = [key.decode(errors="replace") for key in reply[1]]
        await self._reindex(_tagged(keys, self.keys.record("")), now)
        await self._expire_old_timelines(_tagged(keys, self.keys.timeline("")))
        await self._forget(_tagged(keys, self.keys.queue("")), now)
        instances = _tagged(keys, self.keys.inflight(""))
        self.credits_returned += await return_orphaned_credits(self.conn, self.store, instances)

    async def _silent_registered(self, now: int) -> list[str]:
        silent = await self.conn.call(
            "ZRANGEBYSCORE", self.keys.agents, "-inf", f"({now - self.gone_after_ms}"
        )
        return [member.decode(errors="replace") for member in silent]

    async def _reindex(self, message_ids: list[str], now: int) -> None:
        if not message_ids:
            return
        stages = await self.conn.call_many(
            [("HGET", self.keys.record(i), "stage") for i in message_ids]
        )
        live = [i for i, stage in zip(message_ids, stages, strict=True) if stage in _LIVE]
        if not live:
            return
        scores = await self.conn.call_many([("ZSCORE", due_for(self.keys, i), i) for i in live])
        lost = [i for i, score in zip(live, scores, strict=True) if score is None]
        if lost:
            await self.store.conn.run_all(
                [("ZADD", due_for(self.keys, i), "NX", now, i) for i in lost]
            )
            self.reindexed += len(lost)
            log.warning("indexed %d live messages the due index had lost", len(lost))

    async def _expire_old_timelines(self, message_ids: list[str]) -> None:
        """Old timeline lists without an expiry whose record has ended (they leave when it
        does) or is gone (deleted now); a live record's is left until it ends."""
        commands: list[tuple[Any, ...]] = []
        for message_id in message_ids:
            commands += [
                ("TTL", self.keys.timeline(message_id)),
                ("PTTL", self.keys.record(message_id)),
                ("HGET", self.keys.record(message_id), "stage"),
            ]
        replies = await self.conn.call_many(commands) if commands else []
        fixes: list[tuple[Any, ...]] = []
        for n, message_id in enumerate(message_ids):
            ttl, record_ms, stage = replies[3 * n : 3 * n + 3]
            key = self.keys.timeline(message_id)
            if ttl != -1 or stage in _LIVE:
                continue
            if record_ms == -2:  # no record
                fixes.append(("DEL", key))
            elif record_ms > 0:
                fixes.append(("PEXPIRE", key, record_ms))
            else:
                fixes.append(("EXPIRE", key, self.conn.settings.record_ttl_s))
        if fixes:
            await self.store.conn.run_all(fixes)

    async def _forget(self, instance_ids: list[str], now: int) -> None:
        await self._unlist(await self._remove_keys(instance_ids, now), now)

    async def _remove_keys(self, instance_ids: list[str], now: int) -> list[str]:
        """The keys of each instance gone for good removed; the instances so forgotten."""
        if not instance_ids:
            return []
        commands: list[tuple[Any, ...]] = [
            self.conn.script_command(
                ScriptName.FORGET_INSTANCE,
                (
                    self.keys.card(i),
                    self.keys.inflight(i),
                    self.keys.queue(i),
                    self.keys.callback_key(i),
                ),
                (now, self.gone_after_ms, SIDECAR_GROUP),
            )
            for i in instance_ids
        ]
        replies = await self.conn.call_many(commands)
        return [i for i, reply in zip(instance_ids, replies, strict=True) if reply == 1]

    async def _unlist(self, forgotten: list[str], now: int) -> None:
        """Take the forgotten instances off ``P:agents``, save one listed again meanwhile (a
        sidecar registered under the same id since its keys were removed)."""
        if not forgotten:
            return
        reply = await self.conn.evalsha(
            ScriptName.UNLIST_GONE, (self.keys.agents,), (now - self.gone_after_ms, *forgotten)
        )
        gone = [i.decode(errors="replace") for i in reply]
        if gone:
            told = [event_command(self.conn, "instance.gone", i, reason="forgotten") for i in gone]
            await emit(self.conn, told)
            self.forgotten += len(gone)
            log.info("forgot %d instances gone for good: %s", len(gone), ", ".join(gone[:10]))


def _tagged(keys: list[str], empty: str) -> list[str]:
    """The hash tags of the keys shaped like ``empty`` (a key built for an empty tag,
    ``P:m:{}``): ``P:m:{abc}`` -> ``abc``."""
    head = empty[:-1]  # "P:m:{"
    return [key[len(head) : -1] for key in keys if key.startswith(head) and key.endswith("}")]
