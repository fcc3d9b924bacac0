"""What a sidecar holds: the entries of its instance's stream it has taken and not let go of.

An entry is *held* from the moment the sidecar takes it until its outcome is recorded, its
producer told and its credit returned (the finisher lets go of it). After an error the hold
*slips*: the entry stays pending in Redis and is taken again from the pending list — the
pending list minus what is held is what fell through the cracks. Unexpected errors are
counted per entry, so one that keeps failing can be given up on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.entries import Assignment
from broker.results import Command
from broker.store import Move

Taken = Assignment  # one entry read from the instance's stream


@dataclass(frozen=True, slots=True)
class Finished:
    """An entry done with the agent: its outcome to record, reply to send, credit to return."""

    taken: Taken
    replies: list[Command]
    settle: Move | None = None
    capability: str = ""  # for the end-to-end time, once the outcome is on the record


@dataclass(slots=True)
class Holdings:
    held: set[str] = field(default_factory=set)  # entry ids
    by_message: dict[str, Taken] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # entry id -> unexpected errors
    recheck_pending: bool = False

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
