"""``Move.landed``: a move's answer, or an earlier try's, read off the record."""

from __future__ import annotations

import pytest

from broker.records import Moved
from broker.stages import Stage
from broker.store import Move

MOVE = Move("m1", Stage.WAITING, expect_attempt=2, expect_instance="a-1")


def test_a_move_made_now_has_landed() -> None:
    assert MOVE.landed(Moved(True, Stage.WAITING, 2, "a-1"))


def test_a_record_already_at_the_target_at_its_attempt_on_its_instance_has_landed() -> None:
    """An earlier try was made and its answer lost (Redis went away on the way back)."""
    assert MOVE.landed(Moved(False, Stage.WAITING, 2, "a-1"))


@pytest.mark.parametrize(
    "moved",
    [
        Moved(False, Stage.PROCESSING, 2, "a-1"),  # not moved
        Moved(False, Stage.WAITING, 3, "a-1"),  # a later attempt
        Moved(False, Stage.WAITING, 2, "b-1"),  # another instance's
        Moved(False, None, 0, ""),  # no record
    ],
)
def test_anything_else_has_not(moved: Moved) -> None:
    assert not MOVE.landed(moved)
