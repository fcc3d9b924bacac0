"""Which event loop every command runs on: uvloop where it is installed, else asyncio's own.

Each message costs a handful of round trips to Redis, and with two cores shared by Redis and
the workers, how soon a process runs again after its reply arrives is most of the latency.
uvloop (libuv) wakes and dispatches in C what asyncio's default loop does in Python: the
dispatcher and sidecar processes spend less CPU per round trip. ``AGENT_REACH_EVENT_LOOP``
chooses: ``auto`` (the default: uvloop when installed — Linux and macOS installs have it),
``uvloop`` (an error without it) or ``asyncio``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Mapping

from broker.errors import ConfigError

VARIABLE = "AGENT_REACH_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(environ: Mapping[str, str] | None = None) -> LoopFactory | None:
    """The loop to run on (``None``: asyncio's own), as ``AGENT_REACH_EVENT_LOOP`` says."""
    environ = os.environ if environ is None else environ
    choice = environ.get(VARIABLE, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(VARIABLE, f"must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return None
    if importlib.util.find_spec("uvloop") is None:
        if choice == "uvloop":
            raise ConfigError(VARIABLE, "uvloop is not installed (pip install uvloop)")
        return None
    import uvloop

    factory: LoopFactory = uvloop.new_event_loop
    return factory
