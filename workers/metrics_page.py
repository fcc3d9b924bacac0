"""``GET /metrics``: the Prometheus text page of ``agent-reach up`` and of each sidecar.

A broker's page holds the cluster's figures, read from Redis at scrape time — the counters
the scripts keep (:mod:`broker.metric_fields`), the waiting sets, the registry, the dead
letters — so one scrape of any ``up`` gives totals that survive restarts; and the
histograms this process measured (:mod:`broker.process_metrics`). A sidecar's page holds its
own histograms only. Rendered by ``prometheus_client``; served by uvicorn in the process's
own loop (:func:`adapters.asgi.serve_app`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.asgi import serve_app
from broker import process_metrics
from broker.connection import Connection
from broker.health import observed_state
from broker.metric_fields import (
    COUNTERS,
    NEEDS_CONFIRMATION_LEVEL,
    OTHER,
    count_value,
    read_counters,
)
from broker.process_metrics import REGISTRY
from broker.records import CircuitState, InstanceState, InstanceView
from broker.registry import Registry
from broker.routing import factors
from broker.stats import BacklogStats, backlog_stats
from broker.timekeeping import now_ms
from broker.usage import FIGURES, by_combination, utc_day
from broker.usage_reader import day_hashes

from .routing_table import routing_policy

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_version() -> str:
    try:
        return version("agent-reach")
    except PackageNotFoundError:
        return "unknown"


class _Families(Collector):
    """Families made before the scrape renders them (the reads are async; rendering is not)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


async def cluster_families(conn: Connection) -> list[Metric]:
    """Every cluster-wide family, read from Redis now."""
    counters, dlq = await conn.read_counters(), await conn.call("XLEN", conn.keys.dlq)
    stats = await backlog_stats(conn, most=conn.settings.metrics_max_series)
    views = await Registry(conn).snapshot()
    families = list(_counter_families(counters))
    families += _waiting_families(stats)
    families += _instance_families(conn, views)
    today = await day_hashes(conn, [utc_day(now_ms())])
    families += _usage_families(by_combination(today, most=conn.settings.metrics_max_series))
    entries = dlq if isinstance(dlq, int) else 0
    families.append(
        GaugeMetricFamily("agent_reach_dlq_entries", "Entries on the dead-letter stream", entries)
    )
    level = counters.get(NEEDS_CONFIRMATION_LEVEL, b"0")
    waiting_for_operator = max(0, count_value(level) or 0)
    families.append(
        GaugeMetricFamily(
            "agent_reach_needs_confirmation_messages",
            "Messages waiting for an operator (NEEDS_CONFIRMATION)",
            waiting_for_operator,
        )
    )
    return families


def _counter_families(counters: dict[bytes, bytes]) -> Iterator[Metric]:
    for kind, samples in read_counters(counters).items():
        spec = COUNTERS[kind]
        family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
        for labels, value in sorted(samples.items()):
            family.add_metric(list(labels), value)
        yield family


def _usage_families(today: dict[tuple[str, str, str], dict[str, float]]) -> list[Metric]:
    """Today's usage (UTC), per agent, capability and tenant (``agent-reach usage``)."""
    labels = ("agent", "capability", "tenant")
    families: list[Metric] = []
    for figure in FIGURES:
        scale = 1000.0 if figure == "busy_ms" else 1.0
        name = "busy_seconds" if figure == "busy_ms" else figure
        family = GaugeMetricFamily(
            f"agent_reach_usage_{name}_today",
            f"Agent calls' {name.replace('_', ' ')} today (UTC), as charged per attempt",
            labels=labels,
        )
        for combination, figures in sorted(today.items()):
            family.add_metric(list(combination), figures[figure] / scale)
        families.append(family)
    return families


def _waiting_families(stats: BacklogStats) -> list[Metric]:
    waiting = GaugeMetricFamily(
        "agent_reach_waiting_messages", "Messages waiting for a credit", labels=("capability",)
    )
    oldest = GaugeMetricFamily(
        "agent_reach_oldest_waiting_age_seconds",
        "How long the oldest waiting message has waited",
        labels=("capability",),
    )
    for row in stats.capabilities:
        waiting.add_metric([row.capability], row.waiting)
        if row.capability != OTHER:  # the folded rows' oldest waits are not looked at
            oldest.add_metric([row.capability], row.oldest_waiting_s or 0.0)
    return [waiting, oldest]


def _instance_families(conn: Connection, views: list[InstanceView]) -> list[Metric]:
    labels = ("agent", "instance")
    in_use = GaugeMetricFamily("agent_reach_credits_in_use", "Credits in use", labels=labels)
    limit = GaugeMetricFamily(
        "agent_reach_credits_limit",
        "Credit limit: effective (adaptive) and declared (--max-inflight)",
        labels=(*labels, "kind"),
    )
    state = GaugeMetricFamily(
        "agent_reach_instance_state",
        "1 for the instance's current state",
        labels=(*labels, "state"),
    )
    score = GaugeMetricFamily(
        "agent_reach_instance_reach_score", "The instance's reach score now", labels=labels
    )
    circuit = GaugeMetricFamily(
        "agent_reach_circuit_open", "1 while the instance's circuit is open", labels=labels
    )
    policy = routing_policy(conn.settings)
    now = now_ms()
    for view in views:
        ids = [view.card.agent_id, view.instance_id]
        current = observed_state(view, now_ms=now, down_after_ms=policy.down_after_ms)
        in_use.add_metric(ids, view.inflight)
        limit.add_metric([*ids, "effective"], view.credits)
        limit.add_metric([*ids, "declared"], view.card.max_inflight)
        for each in InstanceState:
            state.add_metric([*ids, each.value], 1 if each is current else 0)
        score.add_metric(ids, factors(view, current, view.inflight, policy).reach)
        circuit.add_metric(ids, 1 if view.stats.circuit is CircuitState.OPEN else 0)
    return [in_use, limit, state, score, circuit]


def _build_info() -> Metric:
    info = GaugeMetricFamily("agent_reach_build_info", "The running version", labels=("version",))
    info.add_metric([build_version()], 1)
    return info


async def render(conn: Connection | None) -> bytes:
    """The page: this process's histograms, and with ``conn`` the cluster's figures."""
    families = [_build_info()]
    if conn is not None:
        families += await cluster_families(conn)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry) + generate_latest(REGISTRY)


def metrics_app(conn: Connection | None) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(await render(conn), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


@asynccontextmanager
async def metrics_endpoint(conn: Connection | None, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``/metrics`` while the block runs, with this process's histograms measured
    from now on (:func:`broker.process_metrics.enable`); yields its URL."""
    process_metrics.enable(True)
    async with serve_app(metrics_app(conn), host, port, header_timeout_s=10.0) as url:
        yield f"{url}metrics"
