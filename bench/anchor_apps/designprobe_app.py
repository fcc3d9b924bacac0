"""The design's core work (``bench/design_probe.py``) as a system of the anchors harness.

Run from the ``agentreach`` venv with this folder on ``PYTHONPATH`` (``bench.harness_cpu``
does both for ``--systems ... designprobe``): the same producer loop, Redis and task body as
every system. Worker = the probe's dispatcher and sidecar processes. By hand, from the
harness's folder: ``PYTHONPATH=<this folder> /tmp/anchors-venv-agentreach/bin/python bench.py
designprobe throughput`` (or ``latency``).
"""

import contextlib
import os
import shlex
import sys

from common import HERE, REDIS_URL

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.design_probe import CREDITS, producer  # noqa: E402 - after the repository's path

KIND = "async"
CONCURRENCY = f"design probe: a dispatcher and a sidecar process, {CREDITS} credits"

_stack = None
_producer = None


def worker_cmd(variant):
    python, repo = shlex.quote(sys.executable), shlex.quote(REPO)
    roles = " & ".join(
        f"{python} -m bench.design_probe {role} {shlex.quote(REDIS_URL)}"
        for role in ("dispatcher", "sidecar")
    )
    path = shlex.quote(f"{REPO}:{HERE}")
    # from the repository's folder: the harness's own bench.py would be ``bench`` elsewhere;
    # one process gone takes the other with it (the harness then sees the worker exit)
    script = f"cd {repo} && export PYTHONPATH={path} && {{ {roles} & wait -n; kill 0; }}"
    return ["bash", "-c", script]


async def producer_setup():
    global _stack, _producer
    _stack = contextlib.AsyncExitStack()
    _producer = await _stack.enter_async_context(producer(REDIS_URL))


async def enqueue(p):
    await _producer.enqueue(p)


async def producer_close():
    await _stack.aclose()


def versions():
    import redis

    return {"design probe": "this checkout", "redis-py": redis.__version__}
