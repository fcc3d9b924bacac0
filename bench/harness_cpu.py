"""The CPU one task costs each process of the anchors harness's throughput stage.

The anchors harness (``../shared/bench/anchors``) times each system end to end; this bench
runs the same stage (``bench.py SYSTEM throughput``, each system from its own venv, as
``run.sh`` installs them) and reads, from ``/proc``, the CPU time of every process the stage
starts and of its redis-server. Each run is made twice, with ``--small`` and ``--large``
tasks: the difference over the difference in tasks is what a task costs, with every fixed
cost (imports, start-up, warm-up, shutdown) cancelled out. Processes are named by their
command line (``agent-reach up``, ``agent-reach sidecar``, ``taskiq worker``, the producer is
``bench.py``); those with the same name are added up.

The figures say where a system's CPU goes, and what its total allows: a stage that keeps
every core busy runs at most ``cores / total`` tasks a second. The task body (one pipelined
round trip with redis-py, the same for every system) runs in the process that calls it: the
sidecar, or the anchor's worker. The producer's figure includes the harness's own wait for
the last completion (a ``GET`` every 20 ms). Polling ``/proc`` 20 times a second costs this
bench a few per cent of one core, outside the figures but on the same machine.

Usage: ``python -m bench.harness_cpu [--systems agentreach taskiq] [--small 5000]
[--large 20000] [--reps 2] [--harness ../shared/bench/anchors]
[--venv-prefix /tmp/anchors-venv]``: run ``run.sh`` once first (it makes the venvs and
installs this checkout into the ``agentreach`` one). Uses 127.0.0.1:6390, as the harness
does. Figures only, no threshold: CI never runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import threading
from collections import Counter
from pathlib import Path

from .servers import discard, throwaway_server

PORT = 6390  # the harness's
TICKS = os.sysconf("SC_CLK_TCK")
POLL_S = 0.05


def cpu_s(pid: int) -> float:
    """The CPU time ``pid`` has spent, user and system (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def label(pid: int) -> str:
    """A process's name for the table, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    argv = [a for a in argv if a]
    if argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
    if not argv:
        return "?"
    name = Path(argv[0]).name
    if name == "bench.py":
        return "producer (bench.py)"
    rest = [a for a in argv[1:] if not a.startswith("-")][:1]
    return " ".join([name, *rest]) if name != "bash" else "shell"


class Sampler:
    """Polls the CPU time of ``root`` and every process below it, and of ``extra`` pids,
    until stopped; keeps the last reading of each (a process's time only grows)."""

    def __init__(self, root: int, extra: dict[int, str]) -> None:
        self.root, self.extra = root, extra
        self.seen: dict[int, tuple[str, float]] = {}
        self.start: dict[int, float] = {pid: cpu_s(pid) for pid in extra}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(POLL_S)

    def _sample(self) -> None:
        below = {self.root}
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        parents = {pid: parent_of(pid) for pid in pids}
        grew = True
        while grew:
            more = {pid for pid, parent in parents.items() if parent in below} - below
            below |= more
            grew = bool(more)
        for pid in below | set(self.extra):
            spent = cpu_s(pid)
            if spent:
                name = self.extra.get(pid) or self.seen.get(pid, ("", 0.0))[0] or label(pid)
                self.seen[pid] = (name, spent)

    def stop(self) -> Counter[str]:
        self._stop.set()
        self._thread.join()
        spent: Counter[str] = Counter()
        for pid, (name, total) in self.seen.items():
            spent[name] += total - self.start.get(pid, 0.0)
        return spent


def one_stage(
    args: argparse.Namespace, system: str, tasks: int, redis_pid: int
) -> tuple[float, Counter[str]]:
    """One throughput stage of ``tasks``: its tasks a second and CPU seconds by process."""
    python = f"{args.venv_prefix}-{system}/bin/python"
    argv = [python, "bench.py", system, "throughput", "--reps", "1", "--n", str(tasks)]
    argv += ["--out", os.devnull, "--tag", "harness_cpu"]
    stage = subprocess.Popen(
        argv, cwd=args.harness, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    sampler = Sampler(stage.pid, {redis_pid: "redis-server"})
    out, _ = stage.communicate(timeout=600)
    spent = sampler.stop()
    found = re.search(r"'tasks_per_s': ([0-9.]+)", out)
    if stage.returncode != 0 or found is None:
        raise SystemExit(f"{system}: the stage failed:\n{out[-2000:]}")
    return float(found.group(1)), spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["agentreach", "taskiq"])
    parser.add_argument("--small", type=int, default=5_000)
    parser.add_argument("--large", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--harness", type=Path, default=Path("../shared/bench/anchors"))
    parser.add_argument("--venv-prefix", default="/tmp/anchors-venv")
    args = parser.parse_args()
    if args.large <= args.small:
        parser.error("--large must be more than --small")
    args.harness = args.harness.resolve()
    # as run.sh starts it: no persistence, Redis's own listpack limit
    harness_redis = ("--appendonly", "no", "--hash-max-ziplist-value", "64")
    server = throwaway_server("reach-harness-cpu-", port=PORT, extra_args=harness_redis)
    rates: dict[str, list[float]] = {s: [] for s in args.systems}
    costs: dict[str, list[Counter[str]]] = {s: [] for s in args.systems}
    try:
        for rep in range(1, args.reps + 1):
            for system in args.systems:  # interleaved: the machine's drift hits each alike
                _, small = one_stage(args, system, args.small, server.process.pid)
                rate, large = one_stage(args, system, args.large, server.process.pid)
                rates[system].append(rate)
                extra = args.large - args.small
                cost = Counter({k: (large[k] - small[k]) / extra for k in large})
                costs[system].append(cost)
                each = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in cost.most_common() if v > 5e-7)
                print(f"rep {rep} {system}: {rate:,.0f} tasks/s; µs a task: {each}", flush=True)
    finally:
        discard(server)
    report(args, rates, costs)


def report(
    args: argparse.Namespace, rates: dict[str, list[float]], costs: dict[str, list[Counter[str]]]
) -> None:
    cores = os.cpu_count() or 1
    extra = args.large - args.small
    print(
        f"\nCPU a task costs, by process: (CPU at {args.large:,} tasks - at {args.small:,}) / "
        f"{extra:,}, median of {args.reps}; {cores} cores"
    )
    for system in args.systems:
        names = sorted({k for c in costs[system] for k in c}, key=lambda k: -costs[system][0][k])
        medians = {k: statistics.median(c[k] for c in costs[system]) * 1e6 for k in names}
        total = sum(medians.values())
        rate = statistics.median(rates[system])
        print(f"  {system}: {rate:,.0f} tasks/s at {args.large:,} tasks")
        for name in names:
            if medians[name] >= 0.5:
                print(f"    {name:28} {medians[name]:6.0f} µs")
        print(
            f"    {'total':28} {total:6.0f} µs: at most {cores / total * 1e6:,.0f} tasks/s "
            f"with every core busy ({rate * total / 1e6 / cores:.0%} of them busy at the rate run)"
        )


if __name__ == "__main__":
    main()
