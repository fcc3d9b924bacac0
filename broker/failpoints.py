"""Named fault-injection points for the chaos and crash tests.

``AGENT_REACH_FAILPOINTS="sidecar.after_received=kill"`` makes the process SIGKILL itself the
moment it reaches that point, so a test can crash a real process at an exact step of the
protocol (the technique of FreeBSD's and TiKV's fail points). Unset, :func:`hit` is one dict
lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "AGENT_REACH_FAILPOINTS"


def parse(spec: str) -> dict[str, str]:
    """``"a=kill,b=kill"`` -> ``{"a": "kill", "b": "kill"}``."""
    points: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        if action != "kill":
            raise ValueError(f"failpoint {name!r}: unknown action {action!r} (known: kill)")
        points[name] = action
    return points


def _from_environment() -> dict[str, str]:
    try:
        return parse(os.environ.get(ENV, ""))
    except ValueError:  # refused, with its reason, where the settings are read (broker.config)
        return {}


_ACTIVE = _from_environment()


def armed(name: str) -> bool:
    """Whether the failpoint ``name`` is set: a step that fuses two writes takes them apart
    again, so the crash between them can still be tested."""
    return name in _ACTIVE


def hit(name: str) -> None:
    """Trigger the failpoint ``name`` if it is armed."""
    if _ACTIVE.get(name) == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
