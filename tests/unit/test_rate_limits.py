"""The GCRA rule, the routing step that keeps work off an instance over its rate, and the
``--rate`` option."""

from __future__ import annotations

import random

from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from broker.gcra import EPSILON_MS, gcra, ready_at
from broker.governance import parse_rate
from broker.records import InstanceCard, InstanceState, InstanceStats, InstanceView
from broker.routing import Outcome, RegistryIndex, RouteRequest, RoutingPolicy, route
from workers.cli import main
from workers.routing_table import RoutingTable


@given(
    interval=st.floats(1, 1000),
    burst=st.integers(1, 20),
    gaps=st.lists(st.floats(0, 500), min_size=1, max_size=200),
)
def test_no_window_lets_more_than_burst_plus_window_over_interval(
    interval: float, burst: int, gaps: list[float]
) -> None:
    tat, now, allowed = 0.0, 10_000.0, []
    for gap in gaps:
        now += gap
        verdict = gcra(tat, now, interval, burst)
        if verdict.allowed:
            tat = verdict.tat
            allowed.append(now)
        else:
            assert verdict.wait_ms > 0
            assert gcra(tat, now + verdict.wait_ms, interval, burst).allowed
    # a call within EPSILON_MS of conforming conforms (the state is kept to the microsecond):
    # the window is that much wider, once — the state itself moves by exactly one interval
    for i, start in enumerate(allowed):
        for j in range(i, len(allowed)):
            window = allowed[j] - start
            assert j - i + 1 <= burst + (window + EPSILON_MS) / interval + 1e-9


def test_a_burst_passes_at_once_then_one_per_interval() -> None:
    tat = 0.0
    for _ in range(3):
        verdict = gcra(tat, 1000, 100, 3)
        assert verdict.allowed
        tat = verdict.tat
    refused = gcra(tat, 1000, 100, 3)
    assert not refused.allowed and refused.wait_ms == 100
    assert ready_at(tat, 100, 3) == 1100
    assert gcra(tat, 1100, 100, 3).allowed


def test_rates_read_as_people_write_them() -> None:
    assert parse_rate("10/s") == 100.0
    assert parse_rate("600/min") == 100.0
    assert parse_rate("1/h") == 3_600_000.0
    assert parse_rate(" 2.5 / s ") == 400.0
    for bad in ("10", "10/x", "0/s", "-1/s", "1/0", "s/10", "10000000/s", ""):
        try:
            parse_rate(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def _view(instance_id: str, rate_ms: float = 0.0) -> InstanceView:
    card = InstanceCard(
        agent_id=instance_id.split("-")[0],
        instance_id=instance_id,
        capabilities=("text.echo",),
        endpoint="x",
        max_inflight=100,
        rate_ms=rate_ms,
        burst=2,
    )
    return InstanceView(
        card=card,
        state=InstanceState.UP,
        credits=100,
        inflight=0,
        heartbeat_ms=10_000,
        stats=InstanceStats(successes=50),
    )


def test_routing_keeps_work_off_an_instance_over_its_rate() -> None:
    index = RegistryIndex([_view("slow-1", 100.0), _view("fast-1")])
    policy = RoutingPolicy()
    request = RouteRequest("text.echo")
    held = {"slow-1": 10_050.0}
    for seed in range(20):
        decision = route(
            request, index, {}, now_ms=10_000, rng=random.Random(seed), policy=policy, held=held
        )
        assert decision.instance is not None and decision.instance.instance_id == "fast-1"
    [rate_step] = [s for s in decision.steps if s.name == "rate"]
    assert rate_step.excluded == [("slow-1", "rate limited for 50 ms")]
    alone = RegistryIndex([_view("slow-1", 100.0)])
    decision = route(
        request, alone, {}, now_ms=10_000, rng=random.Random(1), policy=policy, held=held
    )
    assert decision.outcome is Outcome.RATE_LIMITED
    assert decision.reason.startswith("rate_limited:") and "50 ms" in decision.reason


def test_the_table_holds_an_instance_after_its_burst() -> None:
    table = RoutingTable(RoutingPolicy(), random.Random(3))
    table.load([_view("slow-1", 100.0)])
    request = RouteRequest("text.echo")
    chosen = [table.decide(request, now_ms=10_000).outcome for _ in range(3)]
    assert chosen == [Outcome.ROUTED, Outcome.ROUTED, Outcome.RATE_LIMITED]
    assert table.next_ready_ms(10_000) == 10_100
    assert table.decide(request, now_ms=10_100).outcome is Outcome.ROUTED
    table.rate_refused("slow-1", 10_100)  # another dispatcher took it: held one interval
    assert table.decide(request, now_ms=10_150).outcome is Outcome.RATE_LIMITED


def test_the_sidecar_refuses_a_rate_it_cannot_read() -> None:
    result = CliRunner().invoke(
        main, ["sidecar", "--capability", "a.b", "--http", "http://127.0.0.1:9", "--rate", "lots"]
    )
    assert result.exit_code == 2
    assert "a rate is `<count>/<unit>`" in result.output


def test_a_state_written_by_a_clock_ahead_holds_at_most_one_burst() -> None:
    ahead = 3_600_000.0  # an hour ahead of ours
    assert gcra(10_000 + ahead, 10_000, 100, 3).allowed
