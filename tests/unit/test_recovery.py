"""The recovery policy, walked whole with no I/O (broker/recovery.py)."""

from __future__ import annotations

import itertools

import pytest

from broker.recovery import RULES, Action, Facts, NoRule, Signal, deadline_notice_due, decide
from broker.stages import Stage

A = Action
S = Signal


def facts(**values: object) -> Facts:
    return Facts(**values)  # type: ignore[arg-type]


# (signal, facts, the action) — every rule of the table, and the ones each falls through to
CASES: list[tuple[Signal, dict[str, object], Action]] = [
    (S.SUCCEEDED, {}, A.SUCCEED),
    (S.FAILED, {"idempotent": True}, A.FAIL),
    (S.BACKPRESSURE, {"attempts_left": False}, A.REQUEUE),
    (S.ACCEPTED, {}, A.AWAIT_CALLBACK),
    (S.NEEDS_INPUT, {}, A.PARK),
    # the agent provably never saw it: a retry is always safe, while attempts remain
    (S.NOT_REACHED, {"idempotent": False}, A.RETRY),
    (S.NOT_REACHED, {"attempts_left": False}, A.GIVE_UP),
    # sent, no answer: ask first; then only an idempotent agent runs it again
    (S.AMBIGUOUS, {"status_endpoint": True}, A.ASK_STATUS),
    (S.AMBIGUOUS, {"status_endpoint": True, "status_asked": True, "idempotent": True}, A.RETRY),
    (S.AMBIGUOUS, {"idempotent": True}, A.RETRY),
    (S.AMBIGUOUS, {"idempotent": True, "attempts_left": False}, A.GIVE_UP),
    (S.AMBIGUOUS, {"idempotent": False}, A.PARK),
    (S.AMBIGUOUS, {"idempotent": False, "attempts_left": False}, A.PARK),
    (S.STATUS_DONE, {"idempotent": False}, A.SUCCEED),
    (S.STATUS_RUNNING, {"extensions_left": True}, A.EXTEND),
    (S.STATUS_RUNNING, {"idempotent": True}, A.RETRY),
    (S.STATUS_RUNNING, {"idempotent": False}, A.PARK),
    (S.STATUS_RUNNING, {"idempotent": True, "attempts_left": False}, A.GIVE_UP),
    (S.STATUS_FAILED, {"idempotent": True}, A.RETRY),
    (S.STATUS_FAILED, {"idempotent": True, "attempts_left": False}, A.FAIL),
    (S.STATUS_FAILED, {"idempotent": False}, A.FAIL),
    (S.STATUS_UNKNOWN, {"idempotent": True}, A.RETRY),
    (S.STATUS_UNKNOWN, {"idempotent": True, "attempts_left": False}, A.GIVE_UP),
    (S.STATUS_UNKNOWN, {"idempotent": False}, A.PARK),
    # a restarted sidecar finds the attempt PROCESSING
    (S.RESTARTED, {"never_called": True, "status_endpoint": True}, A.CALL),
    (S.RESTARTED, {"never_called": True, "idempotent": False}, A.CALL),
    (S.RESTARTED, {"awaiting_callback": True, "status_endpoint": True}, A.AWAIT_CALLBACK),
    (S.RESTARTED, {"status_endpoint": True, "idempotent": True}, A.ASK_STATUS),
    (S.RESTARTED, {"idempotent": True, "attempts_left": False}, A.RUN_AGAIN),
    (S.RESTARTED, {"idempotent": False}, A.PARK),
    # late in its stage, or its instance dead
    (S.LATE, {"stage": Stage.ACCEPTED}, A.REROUTE),
    (S.LATE, {"stage": Stage.ROUTED}, A.REROUTE),
    (S.LATE, {"stage": Stage.RECEIVED}, A.REROUTE),
    (S.LATE, {"stage": Stage.ROUTED, "deadline_passed": True}, A.EXPIRE),
    (S.LATE, {"stage": Stage.RECEIVED, "deadline_passed": True}, A.EXPIRE),
    (S.LATE, {"stage": Stage.PROCESSING, "deadline_passed": True}, A.ASK_STATUS),
    (S.LATE, {"stage": Stage.CALLBACK_RECEIVED}, A.FINISH),
    (S.DEADLINE, {"stage": Stage.WAITING}, A.EXPIRE),
]


@pytest.mark.parametrize(
    ("signal", "known", "action"),
    CASES,
    ids=[f"{s.value}-{'-'.join(f'{k}={v}' for k, v in f.items())}" for s, f, _ in CASES],
)
def test_the_table(signal: Signal, known: dict[str, object], action: Action) -> None:
    assert decide(signal, facts(**known)) is action


def test_every_rule_of_the_table_is_walked_by_a_case() -> None:
    walked = {(signal, decide(signal, facts(**known))) for signal, known, _ in CASES}
    written = {(signal, rule.action) for signal, rules in RULES.items() for rule in rules}
    assert written <= walked


BOOLEANS = ("idempotent", "attempts_left", "deadline_passed", "status_endpoint", "status_asked")
BOOLEANS += ("awaiting_callback", "extensions_left", "never_called")
# what each signal can meet: an agent's answer or a status answer comes in PROCESSING
STAGES = {
    S.LATE: (
        Stage.ACCEPTED,
        Stage.ROUTED,
        Stage.RECEIVED,
        Stage.PROCESSING,
        Stage.CALLBACK_RECEIVED,
    ),
    S.DEADLINE: (Stage.WAITING,),
}


def every_facts(signal: Signal) -> list[Facts]:
    stages = STAGES.get(signal, (Stage.PROCESSING,))
    return [
        Facts(stage, **dict(zip(BOOLEANS, values, strict=True)))  # type: ignore[arg-type]
        for stage in stages
        for values in itertools.product((False, True), repeat=len(BOOLEANS))
    ]


RUNS_AGAIN = {A.RETRY, A.RUN_AGAIN}


@pytest.mark.parametrize("signal", list(Signal))
def test_for_any_facts_there_is_one_answer_and_it_is_safe(signal: Signal) -> None:
    for f in every_facts(signal):
        action = decide(signal, f)
        # a non-idempotent agent never runs a message twice: it is run again only when it
        # provably never saw it
        if not f.idempotent and action in RUNS_AGAIN:
            assert signal is S.NOT_REACHED, (signal, f, action)
        # a retry only while attempts remain (RUN_AGAIN resumes the attempt that stopped)
        if action is A.RETRY:
            assert f.attempts_left, (signal, f)
        # called without a run again's rules only when this process knows it never was
        if action is A.CALL:
            assert signal is S.RESTARTED and f.never_called, (signal, f)
        # never EXPIRED once the agent may have it
        if action is A.EXPIRE:
            assert f.stage in (Stage.WAITING, Stage.ROUTED, Stage.RECEIVED), (signal, f)


def test_a_signal_in_a_stage_the_table_does_not_expect_is_a_defect() -> None:
    with pytest.raises(NoRule):
        decide(S.DEADLINE, facts(stage=Stage.PROCESSING))
    with pytest.raises(NoRule):
        decide(S.LATE, facts(stage=Stage.WAITING))


def test_the_producer_is_told_its_deadline_passed_only_while_the_agent_may_work() -> None:
    assert deadline_notice_due(facts(stage=Stage.PROCESSING, deadline_passed=True))
    assert not deadline_notice_due(facts(stage=Stage.PROCESSING))
    assert not deadline_notice_due(facts(stage=Stage.WAITING, deadline_passed=True))
