"""What one process measures where the time is spent: Prometheus histograms, per process.

The cluster-wide counters live in Redis (:mod:`broker.metric_fields`); these are the figures
only the process that saw them has: how long a message waited for its sidecar, how long the
agent took, how long the whole trip was, how long a routing decision took. Observing costs a
lock and an add; nothing is sent anywhere until ``/metrics`` is scraped.

Only a process that serves ``/metrics`` observes (:func:`enable`, called by the endpoint as it
opens): elsewhere no one could read the figures, and observing the queue wait alone cost a
sidecar about 6 µs of the path to each call at 200 msg/s (cold caches).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_DECISION = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)

QUEUE_WAIT = Histogram(
    "agent_reach_queue_wait_seconds",
    "From acceptance to RECEIVED at a sidecar",
    ("capability",),
    buckets=_SECONDS,
    registry=REGISTRY,
)
AGENT_CALL = Histogram(
    "agent_reach_agent_call_duration_seconds",
    "One call of an agent, as its sidecar timed it",
    ("agent", "capability"),
    buckets=_SECONDS,
    registry=REGISTRY,
)
END_TO_END = Histogram(
    "agent_reach_end_to_end_seconds",
    "From acceptance to the outcome recorded",
    ("capability",),
    buckets=_SECONDS,
    registry=REGISTRY,
)
ROUTING_DECISION = Histogram(
    "agent_reach_routing_decision_seconds",
    "One routing decision in a dispatcher",
    buckets=_DECISION,
    registry=REGISTRY,
)


_enabled = False


def enable(on: bool) -> None:
    """Measure or not (the default): the metrics endpoint turns the histograms on, a
    benchmark's baseline off."""
    global _enabled
    _enabled = on


# The labelled children, kept: ``labels()`` costs a lock and a few allocations per call,
# a per-message cost the profile shows; a dictionary lookup does not.
_children: dict[tuple[Histogram, tuple[str, ...]], Histogram] = {}
MAX_CHILDREN = 10_000  # label sets kept; past it, ``labels()`` as usual


def _child(histogram: Histogram, labels: tuple[str, ...]) -> Histogram:
    key = (histogram, labels)
    child = _children.get(key)
    if child is None:
        child = histogram.labels(*labels)
        if len(_children) < MAX_CHILDREN:
            _children[key] = child
    return child


def queue_wait(capability: str, seconds: float) -> None:
    if _enabled:
        _child(QUEUE_WAIT, (capability,)).observe(seconds)


def agent_call(agent: str, capability: str, seconds: float) -> None:
    if _enabled:
        _child(AGENT_CALL, (agent, capability)).observe(seconds)


def end_to_end(capability: str, seconds: float) -> None:
    if _enabled:
        _child(END_TO_END, (capability,)).observe(seconds)


def routing_decision(seconds: float) -> None:
    if _enabled:
        ROUTING_DECISION.observe(seconds)


def since_ms(start_ms: int, now_ms: int) -> float:
    """Seconds between two wall-clock readings in ms, never negative (clocks differ)."""
    return max(0.0, (now_ms - start_ms) / 1000)
