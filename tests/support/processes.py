"""Real ``agent-reach`` processes for end-to-end tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from broker.config import Settings

AGENT_REACH = shutil.which("agent-reach", path=str(Path(sys.executable).parent)) or "agent-reach"


def process_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment that points a child process at the test's Redis and key prefix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_REACH_")}
    env.update(
        AGENT_REACH_REDIS_URL=settings.redis_url or "",
        AGENT_REACH_PREFIX=settings.prefix,
        AGENT_REACH_HEARTBEAT_S=str(settings.heartbeat_s),
        AGENT_REACH_DOWN_AFTER_S=str(settings.down_after_s),
        AGENT_REACH_SWEEP_INTERVAL_S=str(settings.sweep_interval_s),
    )
    env.update(extra)
    return env


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [AGENT_REACH, *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int | None:
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()
    return process.returncode


def printed_by(*lines: str) -> list[str]:
    """The lines a fresh interpreter prints running ``lines``: what it imports, and any state
    a module keeps, are its own, not the suite process's."""
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, timeout=60, check=True
    )
    return done.stdout.decode().splitlines()
