"""A sidecar's stop and its one deadline (``adapters.lifecycle.by_the_deadline``): Redis away
costs a wait until the deadline, never more, whatever Redis does. Real time, short graces."""

from __future__ import annotations

import anyio
import pytest

from adapters.lifecycle import STOP_LAST_TRY_S, by_the_deadline
from broker.errors import RedisReplyError, RedisUnavailable


async def test_a_step_redis_lets_through_after_a_while_is_done_once() -> None:
    tries: list[float] = []

    async def step() -> None:
        tries.append(anyio.current_time())
        if len(tries) < 3:
            raise RedisUnavailable("redis unavailable: refused")

    await by_the_deadline(step, anyio.current_time() + 5.0, "testing")
    assert len(tries) == 3
    assert tries[2] - tries[0] < 1.0  # 0.1 s, then 0.2 s: not a second each


async def test_redis_away_for_good_raises_its_error_after_a_last_try_at_the_deadline() -> None:
    tries: list[float] = []

    async def step() -> None:
        tries.append(anyio.current_time())
        raise RedisUnavailable("redis unavailable: refused")

    deadline = anyio.current_time() + 0.5
    with pytest.raises(RedisUnavailable, match="refused"):
        await by_the_deadline(step, deadline, "testing")
    assert tries[-1] >= deadline  # the last try is at the deadline, not a pause before it
    assert tries[-1] < deadline + 1.0
    assert 2 <= len(tries) <= 6  # paused in between: no busy loop


async def test_a_redis_that_never_answers_cannot_stretch_the_stop() -> None:
    async def step() -> None:
        await anyio.sleep_forever()  # a connection taken, an answer never sent

    began = anyio.current_time()
    deadline = began + 0.2
    with pytest.raises(RedisUnavailable, match="no answer testing"):
        await by_the_deadline(step, deadline, "testing")
    took = anyio.current_time() - began
    assert deadline - began + STOP_LAST_TRY_S <= took < deadline - began + STOP_LAST_TRY_S + 1


async def test_an_error_reply_is_not_waited_out() -> None:
    tries = 0

    async def step() -> None:
        nonlocal tries
        tries += 1
        raise RedisReplyError("NOPERM this user has no permissions")

    with pytest.raises(RedisReplyError):
        await by_the_deadline(step, anyio.current_time() + 5.0, "testing")
    assert tries == 1  # retrying would not help
