"""What a sidecar holds: the entries of its instance's stream it has taken and not let go of.

An entry is *held* from the moment the sidecar takes it until its outcome is recorded, its
producer told and its credit returned (the finisher lets go of it). After an error the hold
*slips*: the entry stays pending in Redis and is taken again from the pending list — the
pending list minus what is held is what fell through the cracks. Unexpected errors are
counted per entry, so one that keeps failing can be given up on.

Unanswered calls. Every round trip in which the sidecar writes PROCESSING (before it calls
the agent) writes its own token with it (field ``take_call``). When no answer comes back
(Redis went silent, the connection broke: a partition while the sidecar waited in its
blocking read, say), the writes may still have been made, and the agent was certainly not
called with them: it is called only after the answer. The token is kept, and a record found
PROCESSING with it is run, not judged a crash's leftover (``Runner._restarted``). A new
process knows no tokens: after a restart such a record is judged as before.

Late writes. A round trip given up on may still reach Redis after the sidecar has read its
pending list again (a partition that held its bytes): what it took then sits in that list,
PROCESSING with an unanswered token, and no read brings it back (a plain read that lands
late leaves its entries there too). So after a round trip went unanswered, or a read failed,
the pending list is read again every read silence for as long as the reaper leaves such a
record to its sidecar (:meth:`Holdings.look_again`).
"""

from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from broker.connection import Connection
from broker.credits import release_command
from broker.entries import Assignment
from broker.envelope import Envelope
from broker.keyspace import SIDECAR_GROUP
from broker.results import Command
from broker.store import Move

Taken = Assignment  # one entry read from the instance's stream

MAX_UNANSWERED = 1024  # call tokens kept: a partition, or a replica falling behind, leaves a few
MAX_CALLED_AGAIN = 65_536  # messages called after an unanswered round trip (a take's batch)


@dataclass(frozen=True, slots=True)
class Finished:
    """An entry done with the agent: its outcome to record, reply to send, credit to return."""

    taken: Taken
    replies: list[Command]
    settle: Move | None = None
    capability: str = ""  # for the end-to-end time, once the outcome is on the record
    envelope: Envelope | None = None  # whose producer to tell, if the record cannot be moved


@dataclass(slots=True)
class Holdings:
    held: set[str] = field(default_factory=set)  # entry ids
    by_message: dict[str, Taken] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # entry id -> unexpected errors
    recheck_pending: bool = False
    unanswered: OrderedDict[str, None] = field(default_factory=OrderedDict)  # call tokens
    # (message id, attempt) called after being found PROCESSING: never uncalled again
    called_again: OrderedDict[tuple[str, int], None] = field(default_factory=OrderedDict)
    unanswered_at: float = -math.inf  # when a round trip last went so (time.monotonic())
    _process: str = field(default_factory=lambda: secrets.token_hex(8) + ".")
    _calls: int = 0
    _next_look: float = 0.0  # the pending list is read again no sooner (look_again)

    def call_token(self) -> str:
        """A new round trip's token, to write with each PROCESSING it makes: this process's
        own random prefix and a count, so never one another process (or this one) wrote
        before (a counter, not a random read per round trip: no system call per read)."""
        self._calls += 1
        return f"{self._process}{self._calls:x}"

    def unanswered_call(self, token: str) -> None:
        """The round trip of ``token`` ended without an answer acted on: none of the
        PROCESSING it may have written was followed by a call to the agent."""
        self.unanswered[token] = None
        self.unanswered_at = time.monotonic()
        while len(self.unanswered) > MAX_UNANSWERED:  # the oldest: judged as after a restart
            self.unanswered.popitem(last=False)

    def read_failed(self) -> None:
        """A read (or a take) failed. It may have reached Redis, or may still (a partition
        that holds its bytes), and taken entries this sidecar never heard of — a plain read
        writes no token, but leaves them pending all the same: the pending list is read
        again at once, and for a while (:meth:`look_again`)."""
        self.recheck_pending = True
        self.unanswered_at = time.monotonic()

    def look_again(self, lateness_s: float, every_s: float) -> bool:
        """Whether to read the pending list again now: after an error (``recheck_pending``),
        and every ``every_s`` until ``lateness_s`` (how long the reaper leaves a PROCESSING
        record to its sidecar) and one more look have passed since a round trip last went
        unanswered: one of its writes landing that late is still this sidecar's to run."""
        now = time.monotonic()
        late = now - self.unanswered_at < lateness_s + every_s and now >= self._next_look
        if not (self.recheck_pending or late):
            return False
        self.recheck_pending = False
        self._next_look = now + every_s
        return True

    def calling_again(self, taken: Taken) -> None:
        """``taken``, found PROCESSING, is called now: whatever token its record shows later
        (a Redis that lost writes it had acknowledged can give back an older one), it is
        never taken as uncalled again."""
        self.called_again[(taken.message_id, taken.attempt)] = None
        while len(self.called_again) > MAX_CALLED_AGAIN:
            self.called_again.popitem(last=False)

    def never_called(self, token: str, taken: Taken) -> bool:
        """Whether ``taken``'s PROCESSING, written with ``token``, was written by a round trip
        of this process that went unanswered, and this process has not called it since (so
        the agent was never called with it)."""
        return (
            bool(token)
            and token in self.unanswered
            and (taken.message_id, taken.attempt) not in self.called_again
        )

    def take(self, taken: Taken) -> None:
        self.held.add(taken.entry_id)
        self.by_message[taken.message_id] = taken

    def holding(self, message_id: str) -> Taken | None:
        """The entry held for ``message_id``, if any."""
        return self.by_message.get(message_id)

    def slip(self, taken: Taken) -> None:
        """An error stopped its handling: not held any more, to be taken again."""
        self.held.discard(taken.entry_id)
        self._forget(taken)
        self.recheck_pending = True

    def let_go(self, taken: Taken) -> None:
        """Finished with: its credit returned, its entry acknowledged."""
        self.held.discard(taken.entry_id)
        self._forget(taken)
        self.errors.pop(taken.entry_id, None)

    def failed(self, taken: Taken) -> int:
        """Count one more unexpected error handling ``taken``; returns how many so far."""
        count = self.errors[taken.entry_id] = self.errors.get(taken.entry_id, 0) + 1
        return count

    def _forget(self, taken: Taken) -> None:
        if self.by_message.get(taken.message_id) == taken:
            del self.by_message[taken.message_id]


def release_of(conn: Connection, instance_id: str, batch: list[Finished]) -> Command:
    """``lua/release.lua`` for these entries: their credits back, their entries acked."""
    pairs = [(f"{i.taken.message_id}:{i.taken.attempt}", i.taken.entry_id) for i in batch]
    return release_command(conn, instance_id, SIDECAR_GROUP, pairs)
