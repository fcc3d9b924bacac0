"""The message lifecycle as data: every stage and every allowed move lives in this table.

Everything that changes a message's stage must go through :data:`TRANSITIONS`. The Lua
compare-and-set (``lua/transition.lua``) is not a second copy of the rules: callers pass it
the allowed source stages computed here (:func:`sources_for`), so the table is the single
definition. ``tests/unit/test_stages.py`` checks the table's own invariants.
"""

from __future__ import annotations

from enum import StrEnum

from .errors import IllegalTransition


class Stage(StrEnum):
    ACCEPTED = "ACCEPTED"
    WAITING = "WAITING"
    ROUTED = "ROUTED"
    RECEIVED = "RECEIVED"
    PROCESSING = "PROCESSING"
    CALLBACK_RECEIVED = "CALLBACK_RECEIVED"
    FANNED_OUT = "FANNED_OUT"
    NEEDS_CONFIRMATION = "NEEDS_CONFIRMATION"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    DEAD = "DEAD"
    EXPIRED = "EXPIRED"
    CANCELLED = "CANCELLED"
    REJECTED = "REJECTED"


# -- stage groups: every group of stages any rule speaks of, defined here and nowhere else ---

TERMINAL: frozenset[Stage] = frozenset(
    {Stage.SUCCEEDED, Stage.FAILED, Stage.DEAD, Stage.EXPIRED, Stage.CANCELLED, Stage.REJECTED}
)
PARKED: frozenset[Stage] = frozenset({Stage.WAITING, Stage.NEEDS_CONFIRMATION})
# The agent has not been contacted in these stages: redelivery is always safe.
AGENT_UNTOUCHED: frozenset[Stage] = frozenset(
    {Stage.ACCEPTED, Stage.WAITING, Stage.ROUTED, Stage.RECEIVED}
)
# Waiting to be run: no sidecar has taken it. A waiting-set entry of a message in one of these
# may still be needed (it can come back to WAITING); an operator may cancel it.
QUEUED: frozenset[Stage] = frozenset({Stage.ACCEPTED, Stage.WAITING, Stage.ROUTED})
# At an instance's door: assigned, and the agent not asked yet (a reroute is safe).
AT_THE_DOOR: frozenset[Stage] = frozenset({Stage.ROUTED, Stage.RECEIVED})
# A sidecar has it: taken, being worked on, or its result just called back.
IN_FLIGHT: frozenset[Stage] = frozenset({Stage.RECEIVED, Stage.PROCESSING, Stage.CALLBACK_RECEIVED})
# An attempt in these holds a credit on its instance (``P:f:{inst}``).
HOLDS_CREDIT: frozenset[Stage] = AT_THE_DOOR | IN_FLIGHT
# Replay starts here: waiting for an operator, or given up (DEAD). Messages that ended with an
# answer their producer has had only when the operator says so (``--include-ended``).
REPLAYABLE: frozenset[Stage] = frozenset({Stage.NEEDS_CONFIRMATION, Stage.DEAD})
ENDED_REPLAYABLE: frozenset[Stage] = frozenset({Stage.FAILED, Stage.EXPIRED, Stage.CANCELLED})
CANCELLABLE: frozenset[Stage] = QUEUED
RESOLVABLE: frozenset[Stage] = frozenset({Stage.NEEDS_CONFIRMATION})

_ENDINGS = frozenset({Stage.EXPIRED, Stage.CANCELLED})

TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    # ACCEPTED -> FANNED_OUT: a broadcast, its children created (broker/broadcast.py).
    Stage.ACCEPTED: frozenset({Stage.WAITING, Stage.ROUTED, Stage.REJECTED, Stage.FANNED_OUT})
    | _ENDINGS,
    Stage.WAITING: frozenset({Stage.ROUTED}) | _ENDINGS,
    # ROUTED -> WAITING: the credit was gone by the time the assignment ran.
    # ROUTED -> ROUTED: rerouted to another instance under a new attempt.
    Stage.ROUTED: frozenset({Stage.RECEIVED, Stage.WAITING, Stage.ROUTED}) | _ENDINGS,
    # RECEIVED -> WAITING/ROUTED: the agent was never contacted, so a reroute is safe.
    Stage.RECEIVED: frozenset({Stage.PROCESSING, Stage.WAITING, Stage.ROUTED}) | _ENDINGS,
    # PROCESSING -> WAITING/ROUTED: a retry, only where the adapter proved the agent was not
    # reached or the agent is idempotent; that policy lives with the caller, not here.
    Stage.PROCESSING: frozenset(
        {
            Stage.SUCCEEDED,
            Stage.FAILED,
            Stage.CALLBACK_RECEIVED,
            Stage.NEEDS_CONFIRMATION,
            Stage.WAITING,
            Stage.ROUTED,
            Stage.DEAD,
            # PROCESSING -> PROCESSING: resumed after a restart, or a deadline extended.
            Stage.PROCESSING,
        }
    ),
    Stage.CALLBACK_RECEIVED: frozenset({Stage.SUCCEEDED, Stage.FAILED}),
    # A broadcast parent: SUCCEEDED once every child has ended (lua/child_done.lua), whatever
    # their outcomes. FAILED / CANCELLED are left to an operator's hand (no command yet).
    Stage.FANNED_OUT: frozenset({Stage.SUCCEEDED, Stage.FAILED, Stage.CANCELLED}),
    # NEEDS_CONFIRMATION -> CALLBACK_RECEIVED: an async agent's late callback settles it.
    Stage.NEEDS_CONFIRMATION: frozenset(
        {
            Stage.SUCCEEDED,
            Stage.FAILED,
            Stage.CALLBACK_RECEIVED,
            Stage.WAITING,
            Stage.ROUTED,
            Stage.CANCELLED,
        }
    ),
    Stage.SUCCEEDED: frozenset(),
    Stage.FAILED: frozenset(),
    Stage.DEAD: frozenset(),
    Stage.EXPIRED: frozenset(),
    Stage.CANCELLED: frozenset(),
    Stage.REJECTED: frozenset(),
}


class Repair(StrEnum):
    """An operator's move: the only moves out of a terminal stage (``Move.any_of``)."""

    REPLAY = "replay"
    REPLAY_ENDED = "replay an ended message"
    CANCEL = "cancel"
    RESOLVE_SUCCEEDED = "resolve as succeeded"
    RESOLVE_FAILED = "resolve as failed"


# An operator's repair: the stages it may start from, and where it takes the message.
REPAIRS: dict[Repair, tuple[frozenset[Stage], Stage]] = {
    Repair.REPLAY: (REPLAYABLE, Stage.WAITING),
    Repair.REPLAY_ENDED: (REPLAYABLE | ENDED_REPLAYABLE, Stage.WAITING),
    Repair.CANCEL: (CANCELLABLE, Stage.CANCELLED),
    Repair.RESOLVE_SUCCEEDED: (RESOLVABLE, Stage.SUCCEEDED),
    Repair.RESOLVE_FAILED: (RESOLVABLE, Stage.FAILED),
}


def can_move(current: Stage, target: Stage) -> bool:
    """Whether the table allows ``current -> target``."""
    return target in TRANSITIONS[current]


def check_move(current: Stage, target: Stage) -> None:
    """Raise :class:`IllegalTransition` unless the table allows ``current -> target``."""
    if not can_move(current, target):
        raise IllegalTransition(current, target)


def sources_for(target: Stage) -> frozenset[Stage]:
    """Every stage from which ``target`` may be entered."""
    return frozenset(stage for stage, targets in TRANSITIONS.items() if target in targets)


def is_terminal(stage: Stage) -> bool:
    return stage in TERMINAL
