"""The write-ahead PROCESSING: what a sidecar writes on a record before it calls the agent.

Which callback fields it clears (:func:`not_awaiting`), and the token of the round trip that
writes it (field ``take_call``): a round trip left unanswered is known by its token
(:mod:`adapters.holdings`), and a move from PROCESSING to PROCESSING is fenced on the token
it was decided on (``lua/transition_if.lua``). Pure.
"""

from __future__ import annotations

from collections.abc import Callable

from broker.stages import Stage
from broker.store import Move

from .holdings import Taken

TAKE_CALL = "take_call"
# Written with a PROCESSING that is about to call the agent: a retry's attempt awaits no
# callback until its own agent answers 202 (see not_awaiting).
NOT_AWAITING: dict[str, str | bytes | int] = {"awaiting_callback": "", "agent_task": ""}

Fenced = Callable[..., Move]  # Finisher.fenced: a move fenced on the entry's attempt, here


def not_awaiting(source: Stage, attempt: int) -> dict[str, str | bytes | int] | None:
    """The fields a move from ``source`` to PROCESSING clears, if any. A callback's fields
    are set only in PROCESSING, and every way back to ROUTED starts a new attempt, so the
    first attempt coming from RECEIVED has nothing to clear — and its record stores no empty
    fields (``python -m bench.memory``)."""
    return None if source is Stage.RECEIVED and attempt == 1 else NOT_AWAITING


def processing_move(
    fenced: Fenced,
    taken: Taken,
    source: Stage,
    *,
    token: str | None,
    reason: str = "",
    last_call: str | None = None,
) -> Move:
    """PROCESSING from ``source`` (RECEIVED, or PROCESSING again), written with the round
    trip's ``token`` (None: ``lua/take.lua`` writes its own); from PROCESSING fenced on
    ``last_call``, the token the record held when the move was decided."""
    assert (source is Stage.PROCESSING) == (last_call is not None)
    fields = not_awaiting(source, taken.attempt)
    if token is not None:
        fields = {**(fields or {}), TAKE_CALL: token}
    fence = None if last_call is None else (TAKE_CALL, last_call)
    return fenced(taken, Stage.PROCESSING, source, reason=reason, fields=fields, expect_field=fence)
