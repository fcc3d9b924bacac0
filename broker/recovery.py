"""The recovery policy as data: what becomes of a message after each thing that can happen
to it. Pure — the sidecar, the reaper and the waiting room ask it and only carry out the
answer. Everything that decides between retrying, failing, parking and waiting lives here.

A *signal* is what just happened (an agent's outcome, a status endpoint's answer, a timeout,
a restart); the *facts* are what is known of the message and its agent. :data:`RULES` gives,
per signal, rules tried in order; the first whose condition holds is the :class:`Action`.

===================  ==========================================================================
signal               rules, first match wins
===================  ==========================================================================
SUCCEEDED            SUCCEED
FAILED               FAIL
BACKPRESSURE         REQUEUE (the agent did not take it: back to waiting, no error, no back-off)
ACCEPTED             AWAIT_CALLBACK (an async agent took it; its credit stays held)
NEEDS_INPUT          PARK (the agent asks a question: an operator answers it)
NOT_REACHED          attempts left: RETRY — else GIVE_UP (the agent never saw it: always safe)
AMBIGUOUS            a status endpoint not yet asked: ASK_STATUS — idempotent with attempts
                     left: RETRY — not idempotent: PARK — else GIVE_UP
STATUS_DONE          SUCCEED (with the result the endpoint gave)
STATUS_RUNNING       extensions left: EXTEND — else as STATUS_UNKNOWN
STATUS_FAILED        idempotent with attempts left: RETRY — else FAIL
STATUS_UNKNOWN       idempotent with attempts left: RETRY — not idempotent: PARK — else GIVE_UP
RESTARTED            never called (written by a round trip of this sidecar's that went
                     unanswered): CALL — awaiting a callback: AWAIT_CALLBACK — a status
                     endpoint: ASK_STATUS — idempotent: RUN_AGAIN (same idempotency key) —
                     else PARK
LATE                 by stage: ACCEPTED: REROUTE (its dispatcher stopped) — ROUTED, RECEIVED:
                     past the deadline EXPIRE, else REROUTE (never asked) — PROCESSING:
                     ASK_STATUS — CALLBACK_RECEIVED: FINISH (its result is on the record)
DEADLINE             WAITING: EXPIRE (never dispatched late)
===================  ==========================================================================

"Attempts left" is ``attempt < max_attempts``. A PROCESSING message is never EXPIRED: the
agent may still be working, so past its deadline its producer is told so instead
(:func:`deadline_notice_due`). Who asks decides what "extensions left" means: the reaper can
look again later (``MAX_EXTENSIONS`` times); a sidecar whose call already timed out cannot.
``tests/unit/test_recovery.py`` walks the whole table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from .stages import AT_THE_DOOR, Stage

MAX_EXTENSIONS = 5  # "running" answers before the agent is taken as not knowing


class Signal(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NOT_REACHED = "not reached"
    AMBIGUOUS = "ambiguous"
    BACKPRESSURE = "back-pressure"
    ACCEPTED = "accepted"
    NEEDS_INPUT = "needs input"  # the agent asks for input or authorisation
    STATUS_DONE = "status: done"
    STATUS_RUNNING = "status: running"
    STATUS_FAILED = "status: failed"
    STATUS_UNKNOWN = "status: unknown"
    RESTARTED = "restarted"  # a sidecar found the attempt PROCESSING, not held (a restart)
    LATE = "late"  # its time in its stage is up, or its instance is dead
    DEADLINE = "deadline"  # waiting, and its deadline has come


class Action(StrEnum):
    SUCCEED = "succeed"  # SUCCEEDED with the result
    FAIL = "fail"  # FAILED with the error
    RETRY = "retry"  # WAITING again after a back-off, elsewhere if possible; same key
    REQUEUE = "requeue"  # WAITING again at once, elsewhere if possible; no error charged
    REROUTE = "reroute"  # WAITING again at once: the agent was never asked
    RUN_AGAIN = "run again"  # call the agent again now, same idempotency key
    CALL = "call"  # call the agent now: it never was
    ASK_STATUS = "ask status"  # ask the agent's status endpoint, then decide on its answer
    AWAIT_CALLBACK = "await callback"  # keep the credit; the agent will call back
    EXTEND = "extend"  # let it run on; look again later
    PARK = "park"  # NEEDS_CONFIRMATION: an operator decides
    EXPIRE = "expire"  # EXPIRED
    GIVE_UP = "give up"  # DEAD, dead-lettered
    FINISH = "finish"  # SUCCEEDED / FAILED with the result a callback left on the record


@dataclass(frozen=True, slots=True)
class Facts:
    """What is known when a signal comes."""

    stage: Stage = Stage.PROCESSING
    idempotent: bool = False
    attempts_left: bool = True
    deadline_passed: bool = False
    status_endpoint: bool = False
    status_asked: bool = False  # the endpoint has been asked about this very signal
    awaiting_callback: bool = False
    extensions_left: bool = False  # the asker can look again later, and has not too often
    # PROCESSING was written by a round trip of this very sidecar process whose answer never
    # came (adapters/holdings.py): it calls the agent only after the answer, so it never did
    never_called: bool = False


def _always(f: Facts) -> bool:
    return True


def _never_called(f: Facts) -> bool:
    return f.never_called


def _attempts_left(f: Facts) -> bool:
    return f.attempts_left


def _safe_retry(f: Facts) -> bool:
    return f.idempotent and f.attempts_left


def _not_idempotent(f: Facts) -> bool:
    return not f.idempotent


def _endpoint_to_ask(f: Facts) -> bool:
    return f.status_endpoint and not f.status_asked


def _status_endpoint(f: Facts) -> bool:
    return f.status_endpoint


def _awaiting(f: Facts) -> bool:
    return f.awaiting_callback


def _idempotent(f: Facts) -> bool:
    return f.idempotent


def _extensions_left(f: Facts) -> bool:
    return f.extensions_left


def _accepted(f: Facts) -> bool:
    return f.stage is Stage.ACCEPTED


def _at_the_door(f: Facts) -> bool:
    return f.stage in AT_THE_DOOR


def _processing(f: Facts) -> bool:
    return f.stage is Stage.PROCESSING


def _callback_received(f: Facts) -> bool:
    return f.stage is Stage.CALLBACK_RECEIVED


def _never_asked_past_deadline(f: Facts) -> bool:
    return _at_the_door(f) and f.deadline_passed


def _waiting(f: Facts) -> bool:
    return f.stage is Stage.WAITING


@dataclass(frozen=True, slots=True)
class Rule:
    action: Action
    when: Callable[[Facts], bool] = _always

    def holds(self, facts: Facts) -> bool:
        return self.when(facts)


_UNKNOWN = (
    Rule(Action.RETRY, _safe_retry),
    Rule(Action.PARK, _not_idempotent),
    Rule(Action.GIVE_UP),
)

RULES: dict[Signal, tuple[Rule, ...]] = {
    Signal.SUCCEEDED: (Rule(Action.SUCCEED),),
    Signal.FAILED: (Rule(Action.FAIL),),
    Signal.BACKPRESSURE: (Rule(Action.REQUEUE),),
    Signal.ACCEPTED: (Rule(Action.AWAIT_CALLBACK),),
    Signal.NEEDS_INPUT: (Rule(Action.PARK),),
    Signal.NOT_REACHED: (Rule(Action.RETRY, _attempts_left), Rule(Action.GIVE_UP)),
    Signal.AMBIGUOUS: (Rule(Action.ASK_STATUS, _endpoint_to_ask), *_UNKNOWN),
    Signal.STATUS_DONE: (Rule(Action.SUCCEED),),
    Signal.STATUS_RUNNING: (Rule(Action.EXTEND, _extensions_left), *_UNKNOWN),
    Signal.STATUS_FAILED: (Rule(Action.RETRY, _safe_retry), Rule(Action.FAIL)),
    Signal.STATUS_UNKNOWN: _UNKNOWN,
    Signal.RESTARTED: (
        Rule(Action.CALL, _never_called),
        Rule(Action.AWAIT_CALLBACK, _awaiting),
        Rule(Action.ASK_STATUS, _status_endpoint),
        Rule(Action.RUN_AGAIN, _idempotent),
        Rule(Action.PARK),
    ),
    Signal.LATE: (
        Rule(Action.REROUTE, _accepted),
        Rule(Action.EXPIRE, _never_asked_past_deadline),
        Rule(Action.REROUTE, _at_the_door),
        Rule(Action.ASK_STATUS, _processing),
        Rule(Action.FINISH, _callback_received),
    ),
    Signal.DEADLINE: (Rule(Action.EXPIRE, _waiting),),
}


class NoRule(Exception):
    """Raised when no rule of a signal holds for the facts: a signal the table does not
    expect in that stage (a caller's defect, never an input's)."""


def decide(signal: Signal, facts: Facts) -> Action:
    """The action for ``signal`` given ``facts``: the first rule of the signal that holds."""
    for rule in RULES[signal]:
        if rule.holds(facts):
            return rule.action
    raise NoRule(f"no rule for {signal} in {facts.stage}")


STATUS_SIGNALS: dict[str, Signal] = {
    "done": Signal.STATUS_DONE,
    "running": Signal.STATUS_RUNNING,
    "failed": Signal.STATUS_FAILED,
    "unknown": Signal.STATUS_UNKNOWN,
}


def deadline_notice_due(facts: Facts) -> bool:
    """Whether the producer is to be told its deadline passed while the agent may still
    work: PROCESSING past the deadline (once; the reaper keeps the mark)."""
    return facts.stage is Stage.PROCESSING and facts.deadline_passed
