"""Taking over the work of a dead instance, at once rather than at each message's timeout.

Every credit a dead instance holds names a message attempt (``<id>:<attempt>``): each is
resolved through its record's stage — an attempt the agent was never asked about goes back
to WAITING now, one the agent may be working on is made due now (the reaper asks its status
endpoint), one that ended is told again (its sidecar may have died before the reply left).
Then the entries its sidecar read and never acknowledged are claimed (``XAUTOCLAIM``),
resolved the same way, and acknowledged. Credits no live attempt holds are taken back.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from broker.connection import Connection
from broker.credits import return_command
from broker.due_clock import due_at_most_command, due_command
from broker.entries import parse_assignment
from broker.errors import RedisReplyError, RedisUnavailable
from broker.event_log import emit, event_command
from broker.idle_claims import Claimed, IdleClaim
from broker.keyspace import SIDECAR_GROUP
from broker.records import MessageRecord, taken_over_mark
from broker.stages import AT_THE_DOOR, HOLDS_CREDIT, IN_FLIGHT, TERMINAL
from broker.store import MessageStore
from broker.streams import parse_entries

from .instances import Instances
from .resolver import Resolver, Verdict

log = logging.getLogger("agent_reach.reaper")

CLAIM_BATCH = 200
CLAIM_BATCHES = 50  # batches of a dead sidecar's pending entries a pass takes at most

Judge = Callable[[str, MessageRecord | None, int], Awaitable[Verdict]]


class Takeover:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        instances: Instances,
        resolver: Resolver,
        judge: Judge,
        handled: dict[str, int],
    ) -> None:
        self.conn = conn
        self.store = store
        self.instances = instances
        self.resolver = resolver
        self.judge = judge  # the reaper's guarded resolve: one message's defect stays its own
        self.handled = handled
        self._noticed: set[str] = set()  # instances found dead at the last look

    async def dead_instances(self, now: int) -> int:
        """Resolve the work of every instance that is down. Returns how many messages (and
        claimed entries) were looked at."""
        total = 0
        dead = self.instances.dead(now)
        await self._report_silent([i for i in dead if i not in self._noticed], now)
        self._noticed = set(dead)
        for instance_id in dead:
            raw = await self.conn.call("SMEMBERS", self.conn.keys.inflight(instance_id))
            members = {m.decode(errors="replace") for m in raw}
            ids = sorted({m.rpartition(":")[0] for m in members})
            total += await self._resolve_now(ids, instance_id, now, members)
            total += await self._claim_pending(instance_id, now)
        return total

    async def _report_silent(self, instance_ids: list[str], now: int) -> None:
        """``instance.state_changed`` to DOWN for each instance this reaper has just found
        silent past ``down_after_s`` (its card still says what its sidecar last wrote):
        once per death as this reaper sees it — another reaper, or a restarted one, may say
        it again."""
        commands = []
        for instance_id in instance_ids:
            view = self.instances.view(instance_id)
            if view is None:
                continue  # deregistered: its sidecar said instance.gone
            commands.append(
                event_command(
                    self.conn,
                    "instance.state_changed",
                    instance_id,
                    **{"from": view.state.value, "to": "DOWN", "reason": "silent"},
                    last_heartbeat_ms=view.heartbeat_ms,
                )
            )
        await emit(self.conn, commands)

    async def _resolve_now(
        self,
        ids: list[str],
        instance_id: str,
        now: int,
        members: set[str] | None = None,
        acknowledging: dict[str, int] | None = None,
    ) -> int:
        """Resolve the messages ``ids`` of dead ``instance_id`` (above). ``acknowledging``:
        the attempts whose entries are acknowledged next; a record still holding such an
        attempt's credit is marked first (``taken_over``): its credit is the reaper's to
        return, even if the sidecar comes back under the same instance id before the
        message ends (its pending list will no longer name it)."""
        if not ids:
            return 0
        commands: list[tuple[Any, ...]] = []
        leaked: list[str] = []  # returned in one call, announced once
        by_id = credits_by_message(members or set())
        for message_id, record in zip(ids, await self.store.get_records(ids), strict=True):
            leaked += stale_credits(message_id, record, instance_id, by_id.get(message_id, set()))
            if record is None or record.instance != instance_id:
                continue
            if (acknowledging or {}).get(message_id) == record.attempt and (
                record.stage in IN_FLIGHT  # AT_THE_DOOR: judged below, while it is down
            ):
                mark = taken_over_mark(record.attempt, instance_id)
                commands.append(("HSET", self.conn.keys.record(message_id), "taken_over", mark))
            if record.stage in AT_THE_DOOR:
                verdict = await self.judge(message_id, record, now)
                self.handled[verdict.action] = self.handled.get(verdict.action, 0) + 1
                if verdict.next_due_ms is not None:
                    commands.append(due_command(self.store.keys, message_id, verdict.next_due_ms))
            elif record.stage in IN_FLIGHT:  # PROCESSING, CALLBACK_RECEIVED (RECEIVED is above)
                # due now: this tick's claim asks the agent (or finishes a received callback)
                commands.append(due_at_most_command(self.store.keys, message_id, now))
            elif record.stage in TERMINAL:
                # finished, but the sidecar died before it returned the credit — and maybe
                # before the reply left: send it (at least once; it carries the id)
                await self.resolver.release(record)
                await self._retell(record)
        if leaked:
            commands.append(return_command(self.conn, instance_id, sorted(leaked)))
        await self.store.conn.run_all(commands)
        return len(ids)

    async def _retell(self, record: MessageRecord) -> None:
        try:
            await self.resolver.reply(record, record.stage, record.result, record.error)
        except RedisUnavailable:
            raise
        except Exception:  # one unreadable record must not stop the take-over of the rest
            log.exception("message %s: its ending could not be told again", record.id)

    async def _claim_pending(self, instance_id: str, now: int) -> int:
        """Entries a dead sidecar read and never acknowledged: claim, resolve, acknowledge, a
        batch at a time (up to :data:`CLAIM_BATCHES` a pass). An entry that holds no
        assignment (garbage an attacker wrote) is only acknowledged."""
        queue = self.conn.keys.queue(instance_id)
        idle_ms = self.instances.table.policy.down_after_ms
        pending = IdleClaim(self.conn, queue, SIDECAR_GROUP, "reaper")
        total = 0
        for _ in range(CLAIM_BATCHES):
            try:
                claimed = await pending.batch(idle_ms, CLAIM_BATCH)
            except RedisReplyError:
                return total  # no stream or no group: nothing was ever assigned there
            total += await self._resolve_claimed(queue, instance_id, claimed, now)
            if pending.wrapped:
                break
        return total

    async def _resolve_claimed(
        self, queue: str, instance_id: str, claimed: Claimed, now: int
    ) -> int:
        if not claimed.ids:
            return 0
        attempts: dict[str, int] = {}
        for entry_id, fields in parse_entries(claimed.entries):  # without deleted entries
            assignment = parse_assignment(entry_id, fields)
            if isinstance(assignment, str):
                log.warning("%s: entry %s holds no assignment: %s", queue, entry_id, assignment)
            else:
                attempts[assignment.message_id] = assignment.attempt
        await self._resolve_now(sorted(attempts), instance_id, now, acknowledging=attempts)
        await self.conn.call("XACK", queue, SIDECAR_GROUP, *claimed.ids)
        return len(claimed.ids)


def credits_by_message(members: set[str]) -> dict[str, set[str]]:
    """An instance's credits (``<id>:<attempt>``) by message id: one pass over them, where
    asking :func:`stale_credits` of all of them for each message took the square."""
    by_id: dict[str, set[str]] = {}
    for member in members:
        by_id.setdefault(member.rpartition(":")[0], set()).add(member)
    return by_id


def stale_credits(
    message_id: str, record: MessageRecord | None, instance_id: str, members: set[str]
) -> list[str]:
    """The message's credits on the instance that no live attempt there holds any more."""
    live = (
        f"{message_id}:{record.attempt}"
        if record is not None and record.instance == instance_id and record.stage in HOLDS_CREDIT
        else None
    )
    return [m for m in members if m.rpartition(":")[0] == message_id and m != live]
