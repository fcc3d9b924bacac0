"""The waiting room: assigning waiting work when credits free, and ending it at its deadline.

Several dispatchers may drain the same waiting set at once: the WAITING -> ROUTED
compare-and-set lets exactly one win each message, and a waiting-set entry is removed only
after a successful assignment (a stale one only once its record can no longer return to
WAITING). A waiting message whose deadline passes is ended by the reaper through
:meth:`WaitingRoom.expire`: EXPIRED, with the reason it could not be served
(``no_capability_match`` and the nearest registered capabilities, ``all_candidates_down``, or
``waited_past_deadline``), and its producer is told.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from broker.cluster_map import ORDER_BARRIER
from broker.due_clock import due_at_most_command
from broker.envelope import Envelope, load_envelope
from broker.errors import raised
from broker.fairness import Rotation, fair_order
from broker.records import AssignResult, MessageRecord
from broker.resp import Command
from broker.sessions import bind_session_commands, bound_instances
from broker.stages import Stage
from broker.store import MessageStore, Move, stages_read
from broker.timekeeping import now_ms
from broker.waiting_sets import (
    parks_hint,
    set_aside_commands,
    stand_aside_commands,
    unpark_commands,
)

from .assignment import Assigner, Routed, decision_fields, route_request, routed_instance
from .may_wait import MayWait
from .parked_envelopes import UNMOVED, Kept, ParkedEnvelopes
from .routing_table import RoutingTable
from .unmatched import EXPLAINED, UnmatchedReview, may_wait

log = logging.getLogger("agent_reach.waiting")


@dataclass(frozen=True, slots=True)
class Pick:
    capability: str
    message_id: str
    envelope: Envelope
    instance_id: str
    fields: dict[str, bytes | str]
    accepted_ms: int = 0
    kept: bool = False  # its envelope this room's own (ParkedEnvelopes): the claim is fenced


class WaitingRoom:
    def __init__(
        self,
        store: MessageStore,
        table: RoutingTable,
        *,
        batch: int,
        pass_size: int | None = None,
        assigner: Assigner | None = None,
    ) -> None:
        self.store = store
        self.table = table
        # the dispatcher's own, so admission and drain share what the rate limits said
        self.assigner = assigner or Assigner(store, table)
        self.batch = batch
        # messages a drain pass assigns at once: one pipeline of claims, like an ingress read
        self.pass_size = min(pass_size or batch, batch)
        self.rotation = Rotation()
        self.delivery_timeout_ms = int(store.conn.settings.delivery_timeout_s * 1000)
        # Capabilities this dispatcher last saw with work waiting for a credit: new arrivals
        # for them wait their turn behind it instead of taking a credit that just freed.
        self.backlogged: set[str] = set()
        self.assigned = 0  # messages this room has assigned, over its life
        self.unmatched = UnmatchedReview(store, table, batch=batch)
        self._pass_from: dict[str, int] = {}  # where the next wide pass starts
        # what a credit release drains (workers/may_wait.py)
        self.may_wait = MayWait(drains_all=not parks_hint(store.conn), resolve=table.policy.resolve)
        # (capability, id, priority, until): met at the head but not to go before `until`
        self._stand_aside: list[tuple[str, str, int, int]] = []
        # envelopes this dispatcher parked itself: drained without reading their records
        self.parked = ParkedEnvelopes()

    async def drain(self, capabilities: Iterable[str]) -> int:
        """Assign waiting messages of ``capabilities`` to free credits: the highest priority
        first; capabilities waiting at the same priority take turns (see
        :func:`broker.fairness.fair_order`). Returns how many were assigned.

        Each capability's window is as many messages as it has free credits: a record read
        and not assigned is work for nothing, and credits come back a few at a time, so under
        a backlog most of a wider window would be. A pass assigns at most ``pass_size``: its
        claims are one pipeline, which Redis runs through before it serves anyone else (the
        sidecars recording outcomes), so more credits than that take pass after pass. Where
        that window was full and still left credits unused (head messages no free instance
        takes: they name a busy one, say, or none at all), wide passes look further on: 4 x
        the credits + 16, then twice as wide each time, up to ``batch`` records a drain, so
        they do not block the ones behind them. A drain that ends blocked leaves its place,
        and the next one goes on from there: however long the line of such messages, what
        can be served is reached."""
        wanted = set(capabilities)
        now = now_ms()
        read_now = {c for c in wanted if self.table.free_credits(c, now_ms=now) > 0}
        assigned, blocked, again = await self._drain_once(wanted, {})
        passes = 1
        while again and passes < self.batch // self.pass_size:  # pass after pass, bounded
            more, more_blocked, again = await self._drain_once(again, {})
            assigned += more
            blocked |= more_blocked
            passes += 1
        for capability in read_now - blocked:  # the head took every credit it could: start over
            self._pass_from.pop(capability, None)
        width = dict.fromkeys(blocked, 0)
        read = dict.fromkeys(blocked, 0)
        while blocked:
            now = now_ms()
            for c in blocked:
                credits = self.table.free_credits(c, now_ms=now)
                width[c] = min(self.batch - read[c], max(4 * credits + 16, 2 * width[c]))
                read[c] += width[c]
            more, blocked, _ = await self._drain_once(blocked, {c: width[c] for c in blocked})
            assigned += more
            blocked = {c for c in blocked if read[c] < self.batch}
        return assigned

    async def _drain_once(
        self, capabilities: set[str], wide: dict[str, int]
    ) -> tuple[int, set[str], set[str]]:
        """One pass over windows of the free credits (at most ``pass_size``), or for a wide
        pass (``wide``: its width by capability) that many from where the last one left off.
        Returns how many were assigned; the capabilities whose full window left credits
        unused because messages in it could not use them (no free instance takes them, or
        they stood aside); and those whose full window was all assigned, credits left."""
        now = now_ms()
        free = {c: self.table.free_credits(c, now_ms=now) for c in capabilities}
        windows = {
            c: (self._pass_from.get(c, 0), wide[c]) if wide else (0, min(self.pass_size, n))
            for c, n in free.items()
            if n > 0
        }
        if not windows:
            return 0, set(), set()
        heard = self.may_wait.heard(windows)
        heads = await self.store.waiting.heads(windows)
        offer = fair_order(heads, self.rotation.order(heads))
        kept = {i: k for _, i in offer if (k := self.parked.get(i)) is not None}
        ids = [i for _, i in offer if i not in kept]
        records = dict(zip(ids, await self.store.get_records(ids), strict=True))
        records.update((i, k.record()) for i, k in kept.items())
        stale = {c: [i for c2, i in offer if c2 == c and not may_wait(records[i])] for c in heads}
        picks, unmatched, passed_over = await self._pick(_still_waiting(offer, records), now, kept)
        passed_over |= {c for c, i in offer if _elsewhere(records[i])}
        won, indexes, known = await self._claim(picks)
        done, after = await self.assigner.assign(won, ahead=indexes, known=known, counted=known)
        self.assigned += len(done)
        for a in done:
            self.rotation.served(a.capability)
        # Still indexed: the refused ones keep their waiting-set entry. Removed (assigned, or
        # no longer queued), set aside and stood aside are three sets apart: order is free.
        # Those assigned in their claim's script are removed (and counted) already
        # (lua/claim_assign.lua).
        removed = {c: [a.message_id for a in done if a.capability == c] + stale[c] for c in heads}
        removing = {c: [i for i in listed if i not in known] for c, listed in removed.items()}
        aside = {c: [r for c2, r in unmatched if c2 == c] for c in heads}
        aside_now, self._stand_aside = self._stand_aside, []
        aside_cmds = [
            x for c, rs in aside.items() for x in set_aside_commands(self.store.keys, c, rs)
        ]
        writes = after + stand_aside_commands(self.store.keys, aside_now) + aside_cmds
        returned = await self._unpark(writes, removing)
        stood = [c for c, *_ in aside_now]
        for c, head in heads.items():
            gone = len(removed[c]) + len(aside[c])  # and the stood aside moved back in the line
            counts = (len(head), gone, gone + stood.count(c), sum(a.capability == c for a in done))
            if self._passed(c, counts, windows[c], passed_over, wide=bool(wide)):
                self.may_wait.found_empty(c, heard)
        await self._repark_returned(returned)
        full = {c for c, head in heads.items() if len(head) == windows[c][1]}
        used = {c: sum(a.capability == c for a in done) for c in full}
        # whose credits the messages met could not use (set aside, too: the line behind them
        # is looked at in this drain); whose full window went, credits left
        met = passed_over | set(stood) | {c for c, rs in aside.items() if rs}
        blocked = {c for c in full if c in met and used[c] < free[c]}
        again = {c for c in full - blocked if used[c] == windows[c][1] < free[c] and not wide}
        return len(done), blocked, again

    def _passed(
        self,
        capability: str,
        counts: tuple[int, int, int, int],
        window: tuple[int, int],
        passed_over: set[str],
        *,
        wide: bool,
    ) -> bool:
        """After a pass over ``window`` (start, count), with ``counts``: how many it read, how
        many of those left the waiting set, how many left or moved back in it, and how many
        were assigned. Where the next wide pass starts, and whether new arrivals queue behind
        what waits. Returns whether the set was found emptied."""
        read, gone, moved, served = counts
        start, count = window
        if wide:
            # on past a full window that served nothing; once it served (credits may have run
            # out before the rest was looked at) or at the end, from the top: first offers
            # stay in age order
            self._pass_from[capability] = start + read - moved if read == count > 0 == served else 0
        if start == 0 and read < count and gone == read:
            self.backlogged.discard(capability)  # emptied: nothing waits any more
            return True
        if capability in passed_over:
            # free credits no waiting message could use: later arrivals may take them
            self.backlogged.discard(capability)
            self.note_waiting([capability])
        else:
            # work still waits, and what was met could go wherever a credit is free:
            # a credit that frees before the next drain is its, not a new arrival's
            self.backlogged.add(capability)
        return False

    async def _unpark(
        self, writes: list[Command], removed: dict[str, list[str]]
    ) -> list[tuple[str, str]]:
        """``writes`` and the removal of the ``removed`` waiting entries, then (a barrier across
        a cluster's nodes) their stages, in one round trip. Returns those read WAITING,
        ``(capability, id)``: they came back meanwhile (:meth:`_repark_returned`)."""
        unparked = [(c, i) for c, ids in removed.items() for i in ids]
        writes = writes + unpark_commands(self.store.keys, removed)
        if not writes:
            return []
        replies = await self.store.conn.call_many(
            [*writes, ORDER_BARRIER, *self.store.stage_commands([i for _, i in unparked])]
        )
        for reply in replies[: len(writes)]:
            raised(reply)
        stages = stages_read(replies[len(writes) + 1 :])
        return [ci for ci, stage in zip(unparked, stages, strict=True) if stage is Stage.WAITING]

    async def _repark_returned(self, returned: list[tuple[str, str]]) -> None:
        """Messages ``(capability, id)`` read WAITING after this room removed their waiting
        entries: they came back (the agent was not reached) between our assignment and that
        removal, and their own park may have gone first. Index them again."""
        if not returned:
            return
        records = await self.store.get_records([i for _, i in returned])
        back = [
            (c, r)
            for (c, _), r in zip(returned, records, strict=True)
            if r and r.stage is Stage.WAITING
        ]
        if back:
            await self.store.waiting.park_many(
                [(c, r.id, r.priority, r.accepted_ms) for c, r in back]
            )
            self.note_waiting(sorted({c for c, _ in back}))

    def forget(self, capabilities: Iterable[str], heard: dict[str, int] | None = None) -> None:
        """Capabilities with nothing waiting any more: what this room kept about them goes —
        unless work was heard of since ``heard`` (:meth:`MayWait.heard`, before looking)."""
        for capability in self.may_wait.forget(capabilities, heard):
            self.backlogged.discard(capability)
            self.rotation.forget(capability)
            self.unmatched.forget(capability)
            self._pass_from.pop(capability, None)

    def note_waiting(self, capabilities: Iterable[str]) -> None:
        """Work of these capabilities now waits. Those without a free credit are backlogged;
        where credits are free, what waits could not use them (no instance matches its
        selectors, say), and later arrivals must not queue behind it."""
        capabilities = list(capabilities)
        self.may_wait.add(capabilities)
        now = now_ms()
        self.backlogged.update(
            c for c in capabilities if self.table.free_credits(c, now_ms=now) <= 0
        )

    async def _pick(
        self, waiting: list[tuple[str, MessageRecord]], now: int, kept: dict[str, Kept]
    ) -> tuple[list[Pick], list[tuple[str, MessageRecord]], set[str]]:
        """Route each offered message in turn while its capability has free credits (those
        in ``kept``: by the envelope this room parked). Returns the picks, the messages no
        instance can take at all (to be set aside), and the capabilities with a message
        passed over while credits were free (no free instance takes it: its tags, say)."""
        envelopes = [
            (c, k.envelope if (k := kept.get(r.id)) else load_envelope(r.envelope))
            for c, r in waiting
        ]
        sessions = await bound_instances(
            self.store.conn, sorted({e.session_id for _, e in envelopes if e.session_id})
        )
        picks, unmatched = [], []
        passed_over: set[str] = set()
        gate, budgets = self.assigner.gate, self.assigner.budgets
        await budgets.refresh(now)
        for (capability, envelope), (_, record) in zip(envelopes, waiting, strict=True):
            until = max(record.retry_at_ms, gate.holds(capability, envelope.tenant, now))
            if until > now:  # backing off after a failure, or held by a rate limit
                self._stand_aside.append((capability, record.id, envelope.priority, until))
                continue
            if self.table.free_credits(capability, now_ms=now) <= 0:
                continue  # no credit for it now
            # a tenant over its budget in "cheapest" mode: the cheapest, drained as admitted
            cheapest = budgets.verdict(envelope.tenant) is not None and budgets.cheapest
            request = route_request(envelope, sessions, avoid=record.avoid, cheapest=cheapest)
            decision = self.table.decide(request, now_ms=now)
            instance_id = routed_instance(decision)
            if instance_id is None:
                if decision.outcome in EXPLAINED:  # no instance at all, credits or not
                    unmatched.append((capability, record))
                else:
                    passed_over.add(capability)
                continue  # this one cannot go anywhere now; the next one may
            picks.append(
                Pick(
                    capability,
                    envelope.message_id,
                    envelope,
                    instance_id,
                    decision_fields(decision),
                    record.accepted_ms,
                    record.id in kept,
                )
            )
            if envelope.session_id:
                sessions[envelope.session_id] = instance_id
        return picks, unmatched, passed_over

    async def _claim(
        self, picks: list[Pick]
    ) -> tuple[list[Routed], list[Command], dict[str, AssignResult]]:
        """WAITING -> ROUTED (a new attempt); the winners are this dispatcher's to assign, and
        the index writes to make before their assignments (in the same round trip): the
        sessions bound, and the reaper's next look brought forward to the delivery timeout.
        On one server with no configured rate limit, each claim is assigned in its script
        (``lua/claim_assign.lua``, the look and the count with it): the answers by message id,
        which need no counter of their own in the pass's last round trip. Elsewhere a
        stop before that round trip leaves the records ROUTED with their earlier look."""
        look = now_ms() + self.delivery_timeout_ms
        fused = not self.store.conn.cluster and not self.assigner.gate.active
        moved = await self.store.move_many(
            [
                Move(
                    p.message_id,
                    Stage.ROUTED,
                    only_from=Stage.WAITING,
                    new_attempt="+",
                    new_instance=p.instance_id,
                    reason=str(p.fields["route_reason"]),
                    fields=p.fields,
                    assign_look_ms=look if fused else 0,
                    unpark_from=p.capability if fused else "",
                    expect_field=UNMOVED if p.kept else None,
                )
                for p in picks
            ]
        )
        for p in picks:  # won, or the record moved on: read it the next time it is met
            self.parked.drop(p.message_id)
        won: list[Routed] = []
        known: dict[str, AssignResult] = {}
        for p, m in zip(picks, moved, strict=True):
            if not m.ok:
                self.table.unreserve(p.instance_id)
                continue
            if m.assigned is not None:
                known[p.message_id] = m.assigned
            won.append(
                Routed(
                    p.message_id,
                    p.capability,
                    p.instance_id,
                    m.attempt,
                    p.envelope.priority,
                    p.accepted_ms,
                    p.envelope.tenant,
                )
            )
        sessions = [(p.envelope.session_id, p.instance_id) for p in picks if p.envelope.session_id]
        indexes = bind_session_commands(self.store.conn, sessions)
        if not fused:
            indexes += [due_at_most_command(self.store.keys, r.message_id, look) for r in won]
        return won, indexes, known

    async def expire(self, record: MessageRecord, now: int) -> bool:
        """End a waiting message past its deadline: EXPIRED with why nothing served it."""
        reason = self._why_unserved(record, now)
        moved = await self.store.move(
            record.id,
            Stage.EXPIRED,
            only_from=Stage.WAITING,
            reason=reason,
            fields={"error": reason},
        )
        if not moved.ok:
            return False
        await self.reply_expired(record, reason)
        await self.store.waiting.unpark_many(record.capability, [record.id])
        log.info("message %s expired: %s", record.id, reason)
        return True

    async def reply_expired(self, record: MessageRecord, reason: str) -> None:
        await self.store.delivery.deliver(
            record.envelope, Stage.EXPIRED, None, reason, attempt=record.attempt
        )

    def _why_unserved(self, record: MessageRecord, now: int) -> str:
        """Why a message is still waiting at its deadline, asked of the funnel again now."""
        envelope = load_envelope(record.envelope)
        decision = self.table.evaluate(route_request(envelope, {}), now_ms=now)
        if decision.outcome in EXPLAINED:
            return decision.reason
        return "waited_past_deadline"


def _still_waiting(
    offer: list[tuple[str, str]], records: dict[str, MessageRecord | None]
) -> list[tuple[str, MessageRecord]]:
    """The offered messages whose records are WAITING, with their capabilities, in order."""
    return [(c, r) for c, i in offer if (r := records[i]) is not None and r.stage is Stage.WAITING]


def _elsewhere(record: MessageRecord | None) -> bool:
    """Still in a waiting set, but claimed by an assignment not yet finished (a crash may
    leave it so): like work passed over, it must not hold the credits or the line behind."""
    return may_wait(record) and record is not None and record.stage is not Stage.WAITING
