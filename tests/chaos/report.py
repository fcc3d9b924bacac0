"""The chaos report: counted from the records, the agents' own execution logs, the reply
stream and the processes' logs — never assumed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from broker.stages import TERMINAL, Stage

from .run import Observed

EVERYSEC_NOTE = (
    "appendfsync everysec: Redis answers a write once it is in the AOF file (the page cache)\n"
    "  and fsyncs once a second. A SIGKILL of redis-server alone loses what it had not yet\n"
    "  written: writes it held back while a slow fsync was running (up to 2 s); an OS crash or\n"
    "  power loss also loses the last second. Messages XADDed or moved then come back without a\n"
    "  record or at an earlier stage, and an agent may be asked again for a step whose\n"
    "  write-ahead PROCESSING was lost. Use appendfsync always where that matters."
)


def _counts(counter: Counter[Stage]) -> str:
    return ", ".join(f"{stage} {n}" for stage, n in sorted(counter.items())) or "none"


def _roles(seen: Observed) -> str:
    """Kills per role; sidecars split by how they came back."""
    kills = seen.kills
    same = kills["sidecar"] - seen.fresh_ids
    sidecars = f"sidecar {kills['sidecar']} ({kills['sidecar, a call in flight']} while their "
    sidecars += f"agent was working on a call; back under the same instance id {same}, "
    sidecars += f"under a fresh one {seen.fresh_ids})"
    return f"dispatcher {kills['dispatcher']}, reaper {kills['reaper']}, {sidecars}"


def render(seen: Observed) -> str:
    plan = seen.plan
    stages = Counter(r.stage for r in seen.records.values() if r is not None)
    terminal = Counter({s: n for s, n in stages.items() if s in TERMINAL})
    parked: Counter[Stage] = Counter(
        {s: n for s, n in stages.items() if s is Stage.NEEDS_CONFIRMATION}
    )
    held = [i for i, r in seen.records.items() if r is not None and r.stage in parked]
    ran = sum(1 for i in held if any(a.executions.counts[i] for a in seen.agents))
    lost, twice = seen.lost(), seen.executed_twice()
    ended = [i for i, r in seen.records.items() if r is not None and r.stage in TERMINAL]
    unanswered = sum(1 for i in ended if not seen.replies[i])
    restarts = "; ".join(
        f"down {r['down_s']:.1f} s; every sidecar heartbeating and every dispatcher reading "
        f"again (or nothing left to read) {r['reconnected_s']:.1f} s after it was back"
        for r in seen.redis_restarts
    )
    rows = [
        ("submitted", str(len(seen.ids))),
        ("accepted (records found)", str(sum(1 for r in seen.records.values() if r))),
        ("terminal by stage", _counts(terminal)),
        ("parked by stage", f"{_counts(parked)} ({ran} of them executed by their agent)"),
        ("lost", str(len(lost))),
        (f"executed twice on {seen.non_idempotent.name} (not idempotent)", str(len(twice))),
        ("stale deliveries dropped by fencing", str(seen.stale_drops)),
        ("replies received", f"{len(seen.replies)} ({unanswered} terminal without a reply)"),
        ("executions by agent", ", ".join(f"{a.name} {a.executions.total}" for a in seen.agents)),
        ("kills by role", _roles(seen)),
        ("redis restarts", f"{len(seen.redis_restarts)} ({restarts})"),
        ("settled", f"{seen.settle_s:.1f} s after the last kill; run {seen.total_s:.0f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    where = "a 3-master Redis Cluster, 3 partitions" if plan.on_cluster else "one redis-server"
    lines = [
        f"chaos report: {where}, appendfsync {plan.appendfsync}, seed {plan.seed}, "
        f"{plan.messages} messages over {plan.produce_s:g} s",
        *(f"  {name:<{width}}  {value}" for name, value in rows),
    ]
    if lost:
        lines += ["", f"lost ({len(lost)}):", *_lost_lines(seen, lost)]
    if twice:
        lines += ["", f"executed twice on {seen.non_idempotent.name} ({len(twice)}):"]
        lines += [f"  {i}: {n} executions" for i, n in sorted(twice.items())]
        lines += _timelines(seen, twice)
    if (lost or twice) and plan.appendfsync != "always":
        lines += ["", "why: " + EVERYSEC_NOTE]
    return "\n".join(lines) + "\n"


def _lost_lines(seen: Observed, lost: list[str]) -> list[str]:
    """For each lost message, what the producer's side knew: when it was submitted (against
    the Redis SIGKILL), the stage seen just before the kill, and the stage now."""
    lines = []
    for message_id in lost:
        record = seen.records.get(message_id)
        at = seen.submitted_at.get(message_id, 0.0)
        when = f"submitted at {at:.2f} s"
        if seen.redis_killed_at is not None:
            when += f" ({seen.redis_killed_at - at:+.2f} s before the Redis SIGKILL)"
        before = seen.before_kill.get(message_id, "not yet submitted")
        now = record.stage if record else "no record"
        lines.append(
            f"  {message_id}: {when}; stage before the kill {before or 'no record'}; now {now};"
            f" replies {seen.replies[message_id]}"
        )
    return lines + _timelines(seen, lost)


def _timelines(seen: Observed, ids: Iterable[str]) -> list[str]:
    lines = []
    for message_id in ids:
        timeline = seen.timelines.get(message_id)
        if not timeline:
            continue
        lines.append(f"  timeline of {message_id}:")
        first = timeline[0].ts_ms
        lines += [
            f"    +{e.ts_ms - first:>6} ms  {e.stage:<18} {e.instance or '-':<10} "
            f"attempt {e.attempt}  {e.reason}"
            for e in timeline
        ]
    return lines
