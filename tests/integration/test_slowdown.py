"""The incident adaptive credits exist for: one of two instances slows from 20 ms to 2 s."""

from __future__ import annotations

from bench.incident import FAST, IncidentPlan, IncidentRun, percentile, run_incident
from broker.connection import Connection

IN_FLIGHT_GRACE_S = 2.5  # work already on the stream when the limit fell takes 2 s to finish


def over_limit(run: IncidentRun) -> list[tuple[float, int, int]]:
    """Samples whose stream held more than the instance's limit: the declared one at any
    time, and — once work taken before a drop has had time to finish — the highest
    effective limit of the last few seconds."""
    bad = []
    for s in run.samples:
        recent = [r.effective for r in run.samples if s.t_s - IN_FLIGHT_GRACE_S <= r.t_s <= s.t_s]
        settled = s.t_s - run.samples[0].t_s >= IN_FLIGHT_GRACE_S
        limit = max(recent) if settled else run.plan.max_inflight
        if s.stream > min(limit, run.plan.max_inflight):
            bad.append((s.t_s, s.stream, limit))
    return bad


async def test_a_slowing_agent_sheds_load_to_its_healthy_peer(conn: Connection) -> None:
    run = await run_incident(conn, IncidentPlan(adaptive=True))

    fell = run.limit_fell_after_s()
    assert fell is not None and fell <= 5.0, fell
    assert min(s.effective for s in run.samples) < run.plan.max_inflight
    assert over_limit(run) == []
    assert run.peak_stream() >= 1  # the slow instance did hold work: the check saw something
    assert run.share_after()[FAST] >= 0.9
    # The healthy peer's latency is untouched: its p90 stays within twice its own before the
    # slowdown, and no request it served waited behind the slow agent (that would cost ~2 s).
    # p90, not p99: a single 100 ms stall of a shared 2-core machine reaches the ~4 slowest
    # of 300 requests and says nothing about routing.
    before = run.latencies(instance=FAST, after=False)
    after = run.latencies(instance=FAST, after=True)
    p90_before, p90_after = percentile(before, 90), percentile(after, 90)
    assert p90_after <= 2 * p90_before, (p90_before, p90_after)
    assert max(after) < run.plan.slow_ms / 2, sorted(after)[-5:]
    assert len(run.served) == int(run.plan.rate_per_s * (run.plan.before_s + run.plan.after_s))
