"""The slow-agent incident with static and with adaptive credits, side by side.

Two instances of one capability; producers submit at a steady rate; mid-run one agent's
latency goes from 20 ms to 2 s. For each credit mode it prints: p50/p99 latency
(all requests, and those served by the healthy instance before and after the slowdown), the
slow agent's stream at its peak, how soon its effective limit fell, and each instance's share
of the traffic after the slowdown.

Two scenarios by default: 40 requests/s on 8 credits each (the healthy peer has room to
spare) and 120 requests/s on 4 credits each (it is near its limit); ``--rate`` and
``--credits`` run one of your own.

Usage: ``python -m bench.backpressure [--rate R] [--credits C] [--before 5] [--after 8]``.
One fresh redis-server on loopback; no threshold, CI never fails on a time.
"""

from __future__ import annotations

import argparse

import anyio

from broker.config import build_settings
from broker.connection import open_connection

from .incident import FAST, SLOW, IncidentPlan, IncidentRun, percentile, run_incident
from .servers import discard, throwaway_server


async def one_mode(url: str, plan: IncidentPlan, prefix: str) -> IncidentRun:
    settings = build_settings(
        [
            {
                "redis_url": url,
                "prefix": prefix,
                "heartbeat_s": 0.5,
                "down_after_s": 5.0,
                "sweep_interval_s": 0.2,
                "registry_refresh_s": 0.5,
            }
        ]
    )
    async with open_connection(settings, url) as conn:
        return await run_incident(conn, plan)


def report(name: str, run: IncidentRun) -> list[str]:
    every = run.latencies()
    fast_before = run.latencies(instance=FAST, after=False)
    fast_after = run.latencies(instance=FAST, after=True)
    share = run.share_after()
    fell = run.limit_fell_after_s()
    return [
        name,
        f"{percentile(every, 50):.0f} / {percentile(every, 99):.0f}",
        f"{percentile(fast_before, 99):.0f} -> {percentile(fast_after, 99):.0f}",
        f"{run.peak_stream()}",
        "never" if fell is None else f"{fell:.2f} s",
        f"{share[FAST]:.1%} / {share[SLOW]:.1%}",
    ]


HEADER = [
    "credits",
    "p50 / p99 ms (all)",
    "healthy p99 ms before -> after",
    "slow stream peak",
    "limit fell after",
    "share after: healthy / slow",
]
# (requests/s, credits per instance): the healthy peer with room to spare, and near its limit
SCENARIOS = [(40.0, 8), (120.0, 4)]


async def main(args: argparse.Namespace) -> None:
    if args.rate is None and args.credits is None:
        scenarios = SCENARIOS
    else:
        scenarios = [(args.rate or SCENARIOS[0][0], args.credits or SCENARIOS[0][1])]
    server = throwaway_server("reach-bench-")
    try:
        for k, (rate, credits) in enumerate(scenarios):
            rows = []
            for adaptive in (False, True):
                plan = IncidentPlan(
                    adaptive=adaptive,
                    rate_per_s=rate,
                    before_s=args.before,
                    after_s=args.after,
                    max_inflight=credits,
                )
                run = await one_mode(server.url, plan, f"bp{k}{int(adaptive)}")
                rows.append(report("adaptive" if adaptive else "static", run))
            print(
                f"slow-agent incident: 2 instances x {credits} credits, {rate:g} req/s, "
                f"20 ms -> 2 s at t={args.before:g} s, {args.after:g} s after"
            )
            widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
            for row in [HEADER, *rows]:
                print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
            print()
    finally:
        discard(server)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, help="requests per second (default: both scenarios)")
    parser.add_argument("--credits", type=int, help="max_inflight of each instance")
    parser.add_argument("--before", type=float, default=5.0, help="seconds before the slowdown")
    parser.add_argument("--after", type=float, default=8.0, help="seconds after it")
    return parser.parse_args()


if __name__ == "__main__":
    anyio.run(main, parse())
