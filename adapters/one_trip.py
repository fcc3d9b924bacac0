"""The finisher's round in one round trip, on one server (:mod:`broker.finishing`; the
finisher sends only rounds of one outcome this way, ``ONE_TRIP_MAX``): the outcomes' moves and
``lua/finish.lua`` in one pipeline, which tells the producers of the
outcomes on the record and returns the credits. What it cannot release is answered here: a
reply Redis refused is dead-lettered and then its entry released; an outcome whose record
Redis could not move is dead-lettered and released too (:mod:`adapters.dropping`); another
move that failed is handed back to be recorded again."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from broker import process_metrics
from broker.connection import Connection
from broker.errors import RedisReplyError, RedisUnavailable, raised
from broker.event_log import emit
from broker.finishing import Ending, finish_answer, finish_commands, fits
from broker.keyspace import SIDECAR_GROUP
from broker.process_metrics import since_ms
from broker.record_codec import moved
from broker.records import Moved
from broker.stages import TERMINAL
from broker.store import MessageStore, parked_events
from broker.timekeeping import now_ms

from . import dropping
from .holdings import Finished, release_of

log = logging.getLogger("agent_reach.sidecar")


def time_ended(made: list[tuple[Finished, Moved]]) -> None:
    """The end-to-end time of each message whose outcome ended it just now."""
    now = now_ms()
    for item, m in made:
        if m.ok and m.stage in TERMINAL:
            process_metrics.end_to_end(item.capability, since_ms(m.accepted_ms, now))


def ending(item: Finished) -> Ending:
    taken = item.taken
    return Ending(f"{taken.message_id}:{taken.attempt}", taken.entry_id, item.settle, item.replies)


class OneTrip:
    def __init__(self, conn: Connection, store: MessageStore, instance_id: str) -> None:
        self.conn = conn
        self.store = store
        self.instance_id = instance_id

    def fits(self, batch: list[Finished]) -> bool:
        return fits(self.conn, self.instance_id, [ending(item) for item in batch])

    async def finish(self, batch: list[Finished]) -> tuple[list[Finished], Exception | None]:
        """Record, tell and release ``batch``. Returns the items to finish again, and why the
        next round must wait (a move that failed, a refusal that means "not now"), if it must;
        every other item is released."""
        commands = finish_commands(
            self.conn, self.instance_id, SIDECAR_GROUP, [ending(item) for item in batch]
        )
        replies = await self.conn.call_many(commands)
        settles = [item for item in batch if item.settle is not None]
        # a record Redis could not move (the script holds its entry): dead-lettered, released
        dropped = await dropping.drop_unusable(
            self.conn,
            self.instance_id,
            [item.taken for item in settles],
            replies[:-1],
            settles,
        )
        made = [
            (item, moved(reply))
            for item, reply in zip(settles, replies[:-1], strict=True)
            if not isinstance(reply, Exception)
        ]
        # what the moves made is told even if the script then failed: a retry finds them made
        time_ended(made)
        moves = [item.settle for item, _ in made if item.settle is not None]
        await emit(self.conn, parked_events(self.conn, moves, [m for _, m in made]))
        answer = finish_answer(raised(replies[-1]))
        kept = {k for k, item in enumerate(batch) if item.taken.entry_id not in dropped}
        problem: Exception | None = None
        if answer.unmoved & kept:
            failed = next((r for r in replies[:-1] if isinstance(r, Exception)), None)
            problem = failed or RedisReplyError(f"ERR {len(answer.unmoved)} moves not made")
            log.warning("outcomes not recorded, to be written again: %s", problem)
        later = {
            k for k, (_, error) in answer.refused.items() if isinstance(error, RedisUnavailable)
        }
        if later:
            problem = next(error for k, (_, error) in answer.refused.items() if k in later)
        refused = [(batch[k], c, e) for k, (c, e) in answer.refused.items() if k not in later]
        if refused:
            await self._dead_letter(refused)
        again = sorted((answer.unmoved | answer.unreached | later) & kept)
        return [batch[k] for k in again], problem

    async def _dead_letter(self, refused: Sequence[tuple[Finished, int, Exception]]) -> None:
        """Replies Redis refused for good inside ``finish.lua``: dead-lettered, then released."""
        owners = [item.taken.message_id for item, _, _ in refused]
        commands = [item.replies[c] for item, c, _ in refused]
        await self.store.delivery.after_delivery(owners, commands, [e for _, _, e in refused])
        await self.conn.call(*release_of(self.conn, self.instance_id, [i for i, _, _ in refused]))
