"""Invariants of the lifecycle table, the single definition of every stage move."""

from __future__ import annotations

import itertools
import re
from collections import deque
from pathlib import Path

import pytest

from broker.errors import IllegalTransition
from broker.stages import (
    AGENT_UNTOUCHED,
    PARKED,
    TERMINAL,
    TRANSITIONS,
    Stage,
    can_move,
    check_move,
    is_terminal,
    sources_for,
)

ALL_PAIRS = list(itertools.product(Stage, Stage))
LEGAL = [(a, b) for a, b in ALL_PAIRS if b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if b not in TRANSITIONS[a]]
HAPPY_PATH = [Stage.ACCEPTED, Stage.ROUTED, Stage.RECEIVED, Stage.PROCESSING, Stage.SUCCEEDED]
TRANSITION_LUA = Path(__file__).resolve().parents[2] / "broker" / "lua" / "transition.lua"


def reachable(start: Stage) -> set[Stage]:
    seen = {start}
    todo = deque([start])
    while todo:
        for nxt in TRANSITIONS[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_stage_has_exactly_one_entry() -> None:
    assert set(TRANSITIONS) == set(Stage)
    assert len(TRANSITIONS) == len(Stage)
    for targets in TRANSITIONS.values():
        assert isinstance(targets, frozenset)
        assert targets <= set(Stage)


def test_stage_values_are_their_names() -> None:
    for stage in Stage:
        assert stage.value == stage.name


def test_terminal_stages_have_no_outgoing_moves() -> None:
    assert TERMINAL
    for stage in TERMINAL:
        assert TRANSITIONS[stage] == frozenset(), stage
        assert is_terminal(stage)


def test_stages_without_moves_are_terminal() -> None:
    assert {s for s in Stage if not TRANSITIONS[s]} == TERMINAL
    for stage in set(Stage) - TERMINAL:
        assert not is_terminal(stage)


@pytest.mark.parametrize("stage", sorted(set(Stage) - TERMINAL))
def test_every_live_stage_can_reach_a_terminal_stage(stage: Stage) -> None:
    assert reachable(stage) & TERMINAL


def test_every_stage_is_reachable_from_accepted() -> None:
    assert reachable(Stage.ACCEPTED) == set(Stage)


def test_accepted_is_the_only_entry_point() -> None:
    assert {s for s in Stage if not sources_for(s)} == {Stage.ACCEPTED}
    assert sources_for(Stage.REJECTED) == {Stage.ACCEPTED}


def test_parked_and_untouched_sets_are_live_stages() -> None:
    assert not PARKED & TERMINAL
    assert not AGENT_UNTOUCHED & TERMINAL
    assert Stage.PROCESSING not in AGENT_UNTOUCHED


@pytest.mark.parametrize(("source", "target"), ALL_PAIRS)
def test_sources_for_is_the_inverse_of_the_table(source: Stage, target: Stage) -> None:
    assert (source in sources_for(target)) == (target in TRANSITIONS[source])
    assert can_move(source, target) == (target in TRANSITIONS[source])


def test_sources_for_rebuilds_the_table() -> None:
    rebuilt: dict[Stage, set[Stage]] = {s: set() for s in Stage}
    for target in Stage:
        for source in sources_for(target):
            rebuilt[source].add(target)
    assert rebuilt == {s: set(t) for s, t in TRANSITIONS.items()}


@pytest.mark.parametrize(("source", "target"), ILLEGAL)
def test_check_move_rejects_every_pair_outside_the_table(source: Stage, target: Stage) -> None:
    with pytest.raises(IllegalTransition) as info:
        check_move(source, target)
    assert info.value.current == source
    assert info.value.target == target
    assert f"{source} -> {target}" in str(info.value)


@pytest.mark.parametrize(("source", "target"), LEGAL)
def test_check_move_allows_every_pair_in_the_table(source: Stage, target: Stage) -> None:
    check_move(source, target)


def test_the_enumeration_covers_both_kinds() -> None:
    assert len(LEGAL) + len(ILLEGAL) == len(Stage) ** 2
    assert LEGAL
    assert ILLEGAL


def test_happy_path_is_legal() -> None:
    for source, target in itertools.pairwise(HAPPY_PATH):
        check_move(source, target)
    assert is_terminal(HAPPY_PATH[-1])


def test_processing_cannot_go_back_to_received() -> None:
    # Write-ahead: once PROCESSING is recorded the agent may have been contacted.
    assert not can_move(Stage.PROCESSING, Stage.RECEIVED)
    with pytest.raises(IllegalTransition):
        check_move(Stage.PROCESSING, Stage.RECEIVED)


def test_no_stage_returns_to_accepted() -> None:
    assert sources_for(Stage.ACCEPTED) == frozenset()


def test_transition_script_hard_codes_no_stage() -> None:
    text = TRANSITION_LUA.read_text()
    assert "ARGV[1]" in text  # the allowed sources come from the caller
    found = [s.value for s in Stage if re.search(rf"\b{s.value}\b", text)]
    assert found == []
