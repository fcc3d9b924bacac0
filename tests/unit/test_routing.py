"""Routing over a registry snapshot: who is a candidate, and who gets the message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.records import InstanceCard, InstanceState, InstanceView
from broker.routing import candidates, choose, is_healthy

PROPERTY = settings(database=None)
NOW = 1_000_000
DOWN_AFTER = 15_000


def view(
    instance_id: str,
    *,
    capabilities: tuple[str, ...] = ("text.echo",),
    state: InstanceState = InstanceState.UP,
    credits: int = 4,
    inflight: int = 0,
    heartbeat_ms: int = NOW,
) -> InstanceView:
    card = InstanceCard(
        agent_id=instance_id.split("-")[0],
        instance_id=instance_id,
        capabilities=capabilities,
        endpoint=f"http://127.0.0.1/{instance_id}",
        max_inflight=credits,
    )
    return InstanceView(
        card=card, state=state, credits=credits, inflight=inflight, heartbeat_ms=heartbeat_ms
    )


def ids(views: list[InstanceView]) -> list[str]:
    return [v.instance_id for v in views]


def pick(views: list[InstanceView], capability: str = "text.echo") -> list[str]:
    return ids(candidates(views, capability, now_ms=NOW, down_after_ms=DOWN_AFTER))


# -- candidates -------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [InstanceState.UP, InstanceState.DEGRADED])
def test_accepting_states_are_candidates(state: InstanceState) -> None:
    assert pick([view("a-1", state=state)]) == ["a-1"]


@pytest.mark.parametrize("state", [InstanceState.DOWN, InstanceState.DRAINING])
def test_down_and_draining_are_excluded(state: InstanceState) -> None:
    assert pick([view("a-1", state=state), view("b-1")]) == ["b-1"]


def test_stale_heartbeat_is_excluded() -> None:
    views = [
        view("stale-1", heartbeat_ms=NOW - DOWN_AFTER - 1),
        view("edge-1", heartbeat_ms=NOW - DOWN_AFTER),
        view("fresh-1", heartbeat_ms=NOW - 1),
    ]
    assert pick(views) == ["edge-1", "fresh-1"]


def test_instances_without_the_capability_are_excluded() -> None:
    views = [
        view("a-1", capabilities=("text.echo", "text.upper")),
        view("b-1", capabilities=("text.upper",)),
        view("c-1", capabilities=()),
        view("d-1", capabilities=("text.echo.v2", "text")),
    ]
    assert pick(views) == ["a-1"]
    assert pick(views, "text.upper") == ["a-1", "b-1"]
    assert pick(views, "image.resize") == []


def test_candidates_keep_the_input_order() -> None:
    views = [view("c-1"), view("a-1"), view("b-1")]
    assert pick(views) == ["c-1", "a-1", "b-1"]


def test_is_healthy_combines_state_and_heartbeat() -> None:
    assert is_healthy(view("a-1"), now_ms=NOW, down_after_ms=DOWN_AFTER)
    stale = view("a-1", heartbeat_ms=0)
    assert not is_healthy(stale, now_ms=NOW, down_after_ms=DOWN_AFTER)
    down = view("a-1", state=InstanceState.DOWN)
    assert not is_healthy(down, now_ms=NOW, down_after_ms=DOWN_AFTER)


# -- choose -----------------------------------------------------------------------------------


def test_choose_picks_the_most_free_credits() -> None:
    pool = [view("a-1", credits=4, inflight=3), view("b-1", credits=8, inflight=2)]
    chosen = choose(pool, {})
    assert chosen is not None
    assert chosen.instance_id == "b-1"


def test_choose_uses_the_live_inflight_count() -> None:
    pool = [view("a-1", credits=4, inflight=3), view("b-1", credits=8, inflight=2)]
    chosen = choose(pool, {"b-1": 8, "a-1": 0})
    assert chosen is not None
    assert chosen.instance_id == "a-1"


def test_choose_returns_none_when_all_are_full() -> None:
    pool = [view("a-1", credits=2, inflight=2), view("b-1", credits=3, inflight=0)]
    assert choose(pool, {"b-1": 3}) is None
    assert choose([view("c-1", credits=0)], {}) is None
    assert choose([view("d-1", credits=2, inflight=5)], {}) is None


def test_choose_on_an_empty_pool() -> None:
    assert choose([], {}) is None


def test_ties_go_to_the_lowest_load_then_the_id() -> None:
    # Both have 2 free credits; a-1 is less loaded in proportion (2/4 against 8/10).
    pool = [view("a-1", credits=4, inflight=2), view("b-1", credits=10, inflight=8)]
    chosen = choose(pool, {})
    assert chosen is not None
    assert chosen.instance_id == "a-1"
    same = [view("z-1"), view("m-1"), view("q-1")]
    chosen = choose(same, {})
    assert chosen is not None
    assert chosen.instance_id == "m-1"


instance_views = st.builds(
    lambda n, credits, inflight: view(f"i-{n}", credits=credits, inflight=inflight),
    st.integers(0, 1000),
    st.integers(0, 16),
    st.integers(0, 20),
)
pools = st.lists(instance_views, max_size=8, unique_by=lambda v: v.instance_id)


@PROPERTY
@given(pool=pools, data=st.data())
def test_chosen_has_a_free_credit_and_no_one_has_more(
    pool: list[InstanceView], data: st.DataObject
) -> None:
    live = data.draw(
        st.dictionaries(
            st.sampled_from([v.instance_id for v in pool] or ["none"]), st.integers(0, 20)
        )
    )

    def free(v: InstanceView) -> int:
        return v.credits - live.get(v.instance_id, v.inflight)

    chosen = choose(pool, live)
    if chosen is None:
        assert all(free(v) <= 0 for v in pool)
    else:
        assert chosen in pool
        assert free(chosen) > 0
        assert all(free(v) <= free(chosen) for v in pool)
