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
sidecar, or the anchor's worker. What grows with a stage's length rather than with its tasks
is counted as the tasks' too: the harness's own wait for the last completion (a ``GET``
every 10 ms, in the producer's figure), timers, Redis's housekeeping; under a microsecond a
task. Polling ``/proc`` 20 times a second costs this bench a few per cent of one core,
outside the figures but on the same machine.

Each stage starts on an empty Redis (``FLUSHALL`` before its baseline is read: the harness's
own flush at the start of a stage would otherwise charge it for deleting what the stage
before left). This checkout is installed into the ``agentreach`` venv first, as ``setup.sh``
does, so the figures are this code's.

System ``designprobe`` is the design's core work a task (:mod:`bench.design_probe`), run
by the same harness from the ``agentreach`` venv: the yardstick of what Agent-Reach's own
layers cost above it.

Usage: ``python -m bench.harness_cpu [--systems agentreach taskiq designprobe] [--small 5000]
[--large 20000] [--reps 2] [--harness ../shared/bench/anchors]
[--venv-prefix /tmp/anchors-venv]``: run ``run.sh`` once first (it makes the venvs). Uses
127.0.0.1:6390, or ``ANCHOR_REDIS_PORT``, as the harness does. Figures only, no threshold: CI
never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

import psutil
import redis

from .cpu_cost import cpu_s
from .servers import discard, throwaway_server

PORT = int(os.environ.get("ANCHOR_REDIS_PORT", "6390"))  # the harness's
REPO = Path(__file__).resolve().parent.parent
STAGE_TIMEOUT_S = 600
# the design's core work a message (bench/design_probe.py), run as a system of the harness
PROBE = "designprobe"
POLL_S = 0.05


def label(pid: int) -> str:
    """A process's name for the table, from its command line."""
    try:
        argv = [a for a in psutil.Process(pid).cmdline() if a]
    except psutil.Error:
        return "?"
    if argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
    if argv[:1] == ["-m"]:  # a module run as a program: bench.design_probe's processes
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
        with contextlib.suppress(psutil.Error):  # the stage has ended: nothing more below it
            below |= {p.pid for p in psutil.Process(self.root).children(recursive=True)}
        for pid in below | set(self.extra):
            try:
                spent = cpu_s(pid)
            except OSError:  # gone since it was listed: its last reading stands
                continue
            if spent:
                name = self.extra.get(pid) or self.seen.get(pid, ("", 0.0))[0] or label(pid)
                self.seen[pid] = (name, spent)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        spent: dict[str, float] = defaultdict(float)
        for pid, (name, total) in self.seen.items():
            spent[name] += total - self.start.get(pid, 0.0)
        return spent


def one_stage(
    args: argparse.Namespace, system: str, tasks: int, redis_pid: int
) -> tuple[float, dict[str, float]]:
    """One throughput stage of ``tasks``: its tasks a second and CPU seconds by process."""
    venv, env = system, dict(os.environ)
    if system == PROBE:  # this checkout's, not the harness's: from Agent-Reach's venv
        venv, env["PYTHONPATH"] = "agentreach", str(REPO / "bench" / "anchor_apps")
    python = f"{args.venv_prefix}-{venv}/bin/python"
    argv = [python, "bench.py", system, "throughput", "--reps", "1", "--n", str(tasks)]
    argv += ["--out", os.devnull, "--tag", "harness_cpu"]
    redis.Redis(port=PORT).flushall()
    stage = subprocess.Popen(
        argv,
        cwd=args.harness,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sampler = Sampler(stage.pid, {redis_pid: "redis-server"})
    try:
        out, _ = stage.communicate(timeout=STAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in sampler.seen:  # the stage and what it started (its worker's own session)
            if pid != redis_pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        raise SystemExit(f"{system}: the stage ran past {STAGE_TIMEOUT_S} s") from None
    finally:
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
    # as setup.sh does: the figures are this checkout's
    if {"agentreach", PROBE} & set(args.systems):
        pip = f"{args.venv_prefix}-agentreach/bin/pip"
        install = [pip, "install", "-q", "--force-reinstall", "--no-deps", str(REPO)]
        subprocess.run(install, check=True)
        commit = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        print(f"agentreach: this checkout, {commit or 'not a git checkout'}", flush=True)
    # as run.sh starts it: no persistence, Redis's own listpack limit
    harness_redis = ("--appendonly", "no", "--hash-max-ziplist-value", "64")
    server = throwaway_server("reach-harness-cpu-", port=PORT, extra_args=harness_redis)
    rates: dict[str, list[float]] = {s: [] for s in args.systems}
    costs: dict[str, list[dict[str, float]]] = {s: [] for s in args.systems}
    try:
        for rep in range(1, args.reps + 1):
            for system in args.systems:  # interleaved: the machine's drift hits each alike
                _, small = one_stage(args, system, args.small, server.process.pid)
                rate, large = one_stage(args, system, args.large, server.process.pid)
                rates[system].append(rate)
                extra = args.large - args.small
                cost = {k: (v - small.get(k, 0.0)) / extra for k, v in large.items()}
                costs[system].append(cost)
                ranked = sorted(cost.items(), key=lambda kv: -kv[1])
                each = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in ranked if v > 5e-7)
                print(f"rep {rep} {system}: {rate:,.0f} tasks/s; µs a task: {each}", flush=True)
    finally:
        discard(server)
    report(args, rates, costs)


def report(
    args: argparse.Namespace,
    rates: dict[str, list[float]],
    costs: dict[str, list[dict[str, float]]],
) -> None:
    cores = os.cpu_count() or 1
    extra = args.large - args.small
    print(
        f"\nCPU a task costs, by process: (CPU at {args.large:,} tasks - at {args.small:,}) / "
        f"{extra:,}, median of {args.reps}; {cores} cores"
    )
    for system in args.systems:
        seen = {k for c in costs[system] for k in c}
        medians = {k: statistics.median(c.get(k, 0.0) for c in costs[system]) * 1e6 for k in seen}
        names = sorted(seen, key=lambda k: -medians[k])
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
