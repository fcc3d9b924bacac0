"""A sidecar's intake: reading its instance's stream and taking what it holds.

Entries are read in batches (at start, first this instance's own pending list: a restart
finishes what it had taken). Taking one writes RECEIVED where its record is ROUTED here at its
attempt (the fence: a stale delivery is never executed) and PROCESSING — written before the
request leaves for the agent — where RECEIVED was made; then each goes to the work pool.

On a single server new entries are read and taken in one wake-up (:meth:`take_next`): a
blocking ``XREAD`` and ``lua/take.lua`` (which reads the group and makes both moves) leave in
one write and answer together. On a cluster, or with the failpoint between the two moves
armed, a read is answered first, then the batch is taken in one more round trip, one
``lua/receive_process.lua`` a message (:meth:`take`). The pending list after a restart takes
two round trips. An entry that is not an assignment (someone else wrote to the stream) is
dead-lettered and acknowledged.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from functools import partial
from typing import Any

import anyio

from broker import failpoints
from broker.config import Settings, processing_lateness_s
from broker.connection import Connection
from broker.entries import parse_assignment
from broker.errors import RedisReplyError, RedisUnavailable
from broker.keyspace import SIDECAR_GROUP
from broker.records import Moved
from broker.scripts import ScriptName, script_source
from broker.stages import Stage
from broker.store import MessageStore, Move, Took, take_command, take_stamped, took
from broker.streams import GroupReader, StreamEntry, fields_of

from .callback_desk import CallbackDesk
from .dropping import drop_entries, drop_unusable
from .finisher import Finisher
from .holdings import Holdings, Taken
from .runner import Runner
from .workpool import WorkPool
from .write_ahead import processing_move

log = logging.getLogger("agent_reach.sidecar")


def permission_refused(reply: Any) -> bool:
    """Whether ``reply`` is Redis refusing a command to this user
    (:attr:`RedisReplyError.permission_refused`)."""
    return isinstance(reply, RedisReplyError) and reply.permission_refused


def _parsed(entries: list[StreamEntry]) -> list[tuple[str, dict[str, bytes], Taken | str]]:
    """Each entry with the assignment it holds, or why it holds none."""
    return [(entry_id, f, parse_assignment(entry_id, f)) for entry_id, f in entries]


READ_BLOCK_MS = 1000
PENDING_AT_ONCE = 100_000


def read_silence_s(settings: Settings) -> float:
    """How long past its block the intake's read waits for Redis before it takes the
    connection as lost. A take whose answer was lost (a partition during the read) is run by
    its own sidecar once found again (adapters/holdings.py); the reaper asks after a
    PROCESSING message ``sync_call_timeout_s + processing_grace_s`` after it was written, and
    parks it where the agent cannot say. So the read gives up within the grace: 5 s past the
    block by default, never less than 1 s nor more than 10 s."""
    return min(10.0, max(1.0, settings.processing_grace_s))


class SidecarIntake:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        instance_id: str,
        *,
        holdings: Holdings,
        finisher: Finisher,
        runner: Runner,
        desk: CallbackDesk | None,
    ) -> None:
        self.conn = conn
        self.store = store
        self.instance_id = instance_id
        self.queue = conn.keys.queue(instance_id)
        self.holdings = holdings
        self.finisher = finisher
        self.runner = runner
        self.desk = desk
        self.one_wake_up = True  # until Redis says this user may not (take_next)
        self._after = "0-0"  # where take_next's blocking read waits past (lua/take.lua)
        self._take: tuple[Any, ...] | None = None  # lua/take.lua's call (_take_command)
        self._lateness_s = processing_lateness_s(conn.settings)  # Holdings.look_again
        self._silence_s = read_silence_s(conn.settings)

    async def read(self, reader: GroupReader, *, pending: bool = False) -> list[StreamEntry]:
        """New entries, or (at start) this instance's own pending list: a restart after a crash
        first finishes what it had taken."""
        entries = await reader.read(
            self.queue,
            SIDECAR_GROUP,
            self.instance_id,
            count=PENDING_AT_ONCE if pending else self.conn.settings.sidecar_batch,
            block_ms=None if pending else READ_BLOCK_MS,
            pending=pending,
        )
        if pending and entries:
            log.info("resuming %d pending entries", len(entries))
        return entries

    async def consume(self, reader: GroupReader, pool: WorkPool, stopping: anyio.Event) -> None:
        """Read and take until the sidecar stops; after a failure (or a slipped hold), first
        take again what fell through the cracks of the pending list (and for a while after
        an unanswered round trip: :meth:`Holdings.look_again`)."""
        backoff = 0.1
        while not stopping.is_set():
            try:
                if self.holdings.look_again(self._lateness_s, self._silence_s):
                    pending = await self.read(reader, pending=True)
                    await self.take(pool, [e for e in pending if e[0] not in self.holdings.held])
                # no new work while outcomes pile up unrecorded (a stop is still heard); the
                # wait's timer only when there is one (6 µs a read otherwise)
                if self.finisher.crowded:
                    with anyio.move_on_after(READ_BLOCK_MS / 1000) as crowded:
                        await self.finisher.room()
                    if crowded.cancelled_caught:
                        continue
                if self._in_one_wake_up():
                    await self.take_next(pool, reader)
                else:
                    await self.take(pool, await self.read(reader), fresh=True)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("read failed, retrying in %.1fs: %s", backoff, exc)
                self.holdings.read_failed()
                with anyio.move_on_after(backoff):
                    await stopping.wait()  # a stop is heard at once, Redis away or not
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1

    def _in_one_wake_up(self) -> bool:
        """Whether new entries are read and taken at once (:meth:`take_next`): on a single
        server (on a cluster the records are on other slots than the stream), and not where
        writes wait for replicas (``replica_acks``: the pipeliner's ``WAIT`` must hold
        PROCESSING before the call), nor with the failpoint between the two moves armed."""
        return (
            self.one_wake_up
            and not self.conn.cluster
            and not self.conn.settings.replica_acks
            and not failpoints.armed("sidecar.after_received")
        )

    async def take(
        self, pool: WorkPool, entries: list[StreamEntry], *, fresh: bool = False
    ) -> None:
        """RECEIVED and PROCESSING (write-ahead) for a whole batch, then one job per message
        in the pool. Entries read for the first time (``fresh``) get both moves in one script
        each, all in one round trip: PROCESSING only where RECEIVED was just made. Entries
        found again (this instance's pending list, after a
        restart) get RECEIVED first and PROCESSING only where it applied: one of them may be
        RECEIVED already, and is then resumed (:meth:`Runner.resume`)."""
        taken = await self._sort_out(entries)
        if not taken:
            return
        if fresh and not failpoints.armed("sidecar.after_received"):
            await self._start(pool, *await self._receive_and_process(taken))
        else:
            await self._start(pool, *await self._receive_then_process(taken))

    async def take_next(self, pool: WorkPool, reader: GroupReader) -> None:
        """New entries read and taken in one wake-up, on a single server (:meth:`take`'s
        moves, made by ``lua/take.lua`` as the entries are read: one round trip where a read
        and then the moves take two: ``python -m bench.latency_path``). The script takes only
        what is plainly an assignment; what it leaves (or failed to move) is taken the way of
        :meth:`take`, after it. A group the script could not read is read the way of
        :meth:`read`. A Redis user without this way's commands (rules older than it) is
        read the plain way from then on."""
        token = self.holdings.call_token()
        command = take_stamped(self._take_command(), token)
        # a Redis that cannot be reached is told apart from a call that went out: only the
        # latter may have run, and only its token is kept (a long outage would fill the list)
        await reader.connect()
        try:
            read_reply, reply = await reader.read_then_run(
                self.queue, self._after, READ_BLOCK_MS, command
            )
        except BaseException:
            # the script may have run (a partition while the read waited), but nothing it
            # wrote was acted on: what it moved to PROCESSING is run when found again
            self.holdings.unanswered_call(token)
            raise
        refused = next((e for e in (reply, read_reply) if permission_refused(e)), None)
        if refused is not None:
            self._read_plainly(refused)
        if isinstance(reply, RedisReplyError) and reply.code == "NOSCRIPT":
            await self.conn.run_all([("SCRIPT", "LOAD", script_source(ScriptName.TAKE))])
        elif isinstance(reply, Exception):
            self.holdings.unanswered_call(token)  # an error after a write is not acted on
            self.holdings.recheck_pending = True  # it may have read entries it did not take
            if refused is None:
                raise reply
        elif (read := took(reply)).error is not None:  # nothing was read
            if refused is None:
                log.warning("the take script could not read, reading plainly: %s", read.error)
                await self.take(pool, await self.read(reader), fresh=True)
        else:  # the script ran, even where the read before it was refused: take what it took
            self._after = read.after
            await self._take_read(pool, read)
        # the read's own error, after what the script took: a back-off, not a spin
        if isinstance(read_reply, Exception) and refused is None:
            raise read_reply

    def _read_plainly(self, refused: Exception) -> None:
        """This sidecar's Redis user may not read the one-wake-up way (``XREAD``,
        ``XREVRANGE``, ``TIME``: rules made before it): it reads the plain way from now on,
        and first takes again what the script may have read."""
        self.holdings.recheck_pending = True
        if not self.one_wake_up:
            return
        self.one_wake_up = False
        log.warning(
            "this sidecar's Redis user may not read the one-wake-up way (%s): reading the "
            "plain way; give it the sidecar role's rules again (agent-reach acl)",
            refused,
        )

    async def _take_read(self, pool: WorkPool, read: Took) -> None:
        """What the script read: what it moved starts first, before any other round trip;
        then the entries that are no assignment are dead-lettered and what the script left
        is taken. Where an entry it received has copies in the batch (an assignment written
        again, in a form the script leaves), it is the one taken, and they are refused."""
        received = read.received
        entries = sorted(read.entries, key=lambda e: e[0] not in received)  # stable
        parsed = _parsed([(entry_id, fields_of(flat)) for entry_id, flat in entries])
        taken, refused = self._sorted(parsed, received)
        moved = [t for t in taken if t.entry_id in read.moves]
        pairs = [read.moves[t.entry_id] for t in moved]
        await self._start(pool, moved, [r for r, _ in pairs], [p for _, p in pairs])
        await drop_entries(self.conn, self.instance_id, refused)
        rest = [t for t in taken if t.entry_id not in read.moves]
        if rest:
            await self._start(pool, *await self._receive_and_process(rest))

    def _take_command(self) -> tuple[Any, ...]:
        """``lua/take.lua``'s call: the same every time (the script sets each entry's attempt
        and the time), so made once."""
        if self._take is None:  # the script writes each call's token (take_stamped)
            receiving, first = self._moves(Taken("", "", 1), token=None)
            moves = (receiving, first, self._moves(Taken("", "", 2), token=None)[1])
            batch = self.conn.settings.sidecar_batch
            self._take = take_command(
                self.conn, self.queue, SIDECAR_GROUP, self.instance_id, batch, moves
            )
        return self._take

    async def _sort_out(self, entries: list[StreamEntry]) -> list[Taken]:
        """The assignments among ``entries`` to take; the others dead-lettered (:meth:`_sorted`)."""
        if not entries:
            return []
        taken, refused = self._sorted(_parsed(entries))
        await drop_entries(self.conn, self.instance_id, refused)
        return taken

    async def _start(
        self, pool: WorkPool, taken: list[Taken], received: list[Moved], processing: list[Moved]
    ) -> None:
        """One job per message taken, by how its moves went."""
        if not taken:
            return
        failpoints.hit("sidecar.after_processing")
        ready = {
            t.entry_id: (r.value, p.ok)
            for t, r, p in zip(taken, received, processing, strict=True)
            if r.ok and r.value
        }
        for t, m in zip(taken, received, strict=True):
            if self.desk is not None:
                self.desk.supersede(t)
            self.holdings.take(t)
            if t.entry_id not in ready:
                pool.submit(partial(self.runner.guarded, t, partial(self.runner.resume, t, m)))
            elif ready[t.entry_id][1]:
                stored = ready[t.entry_id][0]
                step = partial(self.runner.run_stored, t, stored, m.accepted_ms)
                pool.submit(partial(self.runner.guarded, t, step))
            else:
                self.finisher.done(t)  # lost the PROCESSING race: someone else owns it now
        # the jobs start (up to their agent call) before this task reads again: the next read
        # is a write and a wake-up that would otherwise come first (79 µs a message at 200/s)
        await anyio.lowlevel.checkpoint()

    def _sorted(
        self,
        parsed: list[tuple[str, dict[str, bytes], Taken | str]],
        received: Container[str] = (),
    ) -> tuple[list[Taken], list[tuple[str, dict[str, bytes], str]]]:
        """The entries to take, and those not to, with why: entries that are no assignment,
        and copies of an assignment this instance already holds or meets earlier in the batch
        (only someone writing to the stream by hand makes one: ``lua/assign.lua`` adds an
        attempt once). A copy taken would find its message PROCESSING and judge it a crash's
        leftover. An entry already ``received`` (``lua/take.lua`` made its RECEIVED: its
        record was ROUTED here at its attempt, so it is the assignment) is no copy of one
        held: it is taken, and must come first in ``parsed`` to be no copy of the batch's
        either."""
        taken: list[Taken] = []
        refused: list[tuple[str, dict[str, bytes], str]] = []
        seen: dict[tuple[str, int], str] = {}
        for entry_id, fields, t in parsed:
            if isinstance(t, str):
                refused.append((entry_id, fields, t))
                continue
            held = None if entry_id in received else self.holdings.holding(t.message_id)
            first = held.entry_id if held and held.attempt == t.attempt else entry_id
            first = seen.setdefault((t.message_id, t.attempt), first)
            if first == entry_id:
                taken.append(t)
            else:
                why = f"a copy of entry {first}: {t.message_id} attempt {t.attempt} is taken"
                refused.append((entry_id, fields, why))
        return taken, refused

    def _moves(self, t: Taken, *, token: str | None) -> tuple[Move, Move]:
        """RECEIVED, and PROCESSING written with the round trip's ``token`` (None: set by
        the script, lua/take.lua)."""
        fenced = self.finisher.fenced
        return (
            fenced(t, Stage.RECEIVED, Stage.ROUTED, return_field="envelope"),
            processing_move(fenced, t, Stage.RECEIVED, token=token),
        )

    async def _receive_and_process(
        self, taken: list[Taken]
    ) -> tuple[list[Taken], list[Moved], list[Moved]]:
        """Both moves of each, and what was taken with them; an entry whose record Redis
        could not move is dead-lettered and left out (:func:`~adapters.dropping.drop_unusable`)."""
        token = self.holdings.call_token()
        try:
            answers = await self.store.receive_and_process(
                [self._moves(t, token=token) for t in taken]
            )
            await drop_unusable(self.conn, self.instance_id, taken, answers)
        except BaseException:
            self.holdings.unanswered_call(token)  # the moves may be made; no call was
            raise
        moved = [(t, a) for t, a in zip(taken, answers, strict=True) if isinstance(a, tuple)]
        return [t for t, _ in moved], [a[0] for _, a in moved], [a[1] for _, a in moved]

    async def _receive_then_process(
        self, taken: list[Taken]
    ) -> tuple[list[Taken], list[Moved], list[Moved]]:
        """RECEIVED of each, then PROCESSING of those whose RECEIVED was just made (the
        pending list: one may be RECEIVED or further already). An unusable record is
        dead-lettered, as in :meth:`_receive_and_process`."""
        token = self.holdings.call_token()
        moves = [self._moves(t, token=token) for t in taken]
        answers = await self.store.try_moves([receive for receive, _ in moves])
        await drop_unusable(self.conn, self.instance_id, taken, answers)
        received = [
            (t, process, a)
            for t, (_, process), a in zip(taken, moves, answers, strict=True)
            if isinstance(a, Moved)
        ]
        failpoints.hit("sidecar.after_received")
        fresh = [(t, process) for t, process, a in received if a.ok and a.value]
        try:
            processed = await self.store.try_moves([p for _, p in fresh]) if fresh else []
            await drop_unusable(self.conn, self.instance_id, [t for t, _ in fresh], processed)
        except BaseException:
            self.holdings.unanswered_call(token)  # the moves may be made; no call was
            raise
        by_entry = dict(zip((t.entry_id for t, _ in fresh), processed, strict=True))
        skipped = Moved(False, Stage.RECEIVED, 0, "")
        out: list[tuple[Taken, Moved, Moved]] = []
        for t, _, r in received:
            p = by_entry.get(t.entry_id, skipped)
            if isinstance(p, Moved):  # else dead-lettered: its PROCESSING move failed
                out.append((t, r, p))
        return [t for t, _, _ in out], [r for _, r, _ in out], [p for _, _, p in out]
