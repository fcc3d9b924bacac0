"""The offer order of waiting work: priority first, then capabilities take turns."""

from __future__ import annotations

from broker.fairness import Rotation, fair_order, split_score, waiting_score


def test_scores_order_by_priority_then_age_and_split_back() -> None:
    assert waiting_score(9, 2_000) < waiting_score(0, 1_000)
    assert waiting_score(5, 1_000) < waiting_score(5, 1_001)
    assert split_score(waiting_score(7, 1_764_000_000_123)) == (7, 1_764_000_000_123)


def test_within_a_priority_capabilities_take_turns() -> None:
    heads = {"flood": [("f1", 0), ("f2", 0), ("f3", 0)], "trickle": [("t1", 0)]}
    offer = fair_order(heads, ["flood", "trickle"])
    assert offer == [("flood", "f1"), ("trickle", "t1"), ("flood", "f2"), ("flood", "f3")]


def test_higher_priority_anywhere_goes_first() -> None:
    heads = {"a": [("a9", 9), ("a0", 0)], "b": [("b5", 5), ("b0", 0)]}
    offer = fair_order(heads, ["b", "a"])
    assert [i for _, i in offer] == ["a9", "b5", "b0", "a0"]


def test_rotation_puts_the_least_recently_served_first() -> None:
    rotation = Rotation()
    assert rotation.order(["b", "a"]) == ["a", "b"]  # never served: by name
    rotation.served("a")
    rotation.served("b")
    assert rotation.order(["a", "b", "c"]) == ["c", "a", "b"]
    rotation.served("a")
    assert rotation.order(["a", "b"]) == ["b", "a"]
    rotation.forget("b")
    assert rotation.order(["a", "b"]) == ["b", "a"]  # forgotten is as never served
