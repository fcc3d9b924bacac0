"""Traces over OTLP/HTTP from a real ``up`` and sidecar, to a real receiver on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.asgi import serve_app
from broker import tracing
from broker.client import Client
from broker.config import Settings
from broker.connection import open_connection
from broker.keyspace import direct_lane as direct_lane_key
from tests.support.agents import http_agent
from tests.support.harness import eventually
from tests.support.processes import process_env, start, stop

PRODUCER, CONSUMER, CLIENT = 4, 5, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


class Receiver:
    """Spans as an OTLP/HTTP collector receives them, with the service that sent each."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []

    async def receive(self, request: Request) -> Response:
        batch = ExportTraceServiceRequest()
        batch.ParseFromString(await request.body())
        for resource_spans in batch.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope in resource_spans.scope_spans:
                self.spans += [(service, span) for span in scope.spans]
        return Response(b"", media_type="application/x-protobuf")

    def named(self, name: str) -> tuple[str, Any]:
        (found,) = [(s, span) for s, span in self.spans if span.name == name]
        return found


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[str, Receiver]]:
    receiver = Receiver()
    app = Starlette(routes=[Route("/v1/traces", receiver.receive, methods=["POST"])])
    async with serve_app(app) as url:
        yield url.rstrip("/"), receiver


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = value.string_value if value.HasField("string_value") else value.int_value
    return out


@pytest.mark.timeout(120)
@pytest.mark.anyio
@pytest.mark.parametrize("direct_lane", [False, True], ids=["through-dispatcher", "direct-lane"])
async def test_one_message_is_one_trace_across_its_processes(
    settings: Settings, tmp_path: Path, direct_lane: bool
) -> None:
    """Through the dispatcher, three processes; down the direct lane, the producer's send
    names the instance's stream and the sidecar's work is its child, with no dispatcher span."""
    assert settings.redis_url is not None
    seen_by_agent: list[str] = []

    async def keep_traceparent(envelope: dict[str, Any], request: Request) -> None:
        seen_by_agent.append(request.headers.get("traceparent", ""))

    async with (
        otlp_receiver() as (endpoint, receiver),
        open_connection(settings, settings.redis_url) as conn,
        http_agent("traced", behaviour=keep_traceparent) as agent,
    ):
        env = process_env(
            settings,
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
            AGENT_REACH_DIRECT_LANE=str(direct_lane).lower(),
        )
        up = start(["up"], env, tmp_path / "up.log")
        side = start(
            [
                *("sidecar", "--agent-id", "traced", "--instance-id", "traced-1"),
                *("--capability", "text.echo", "--http", agent.url),
            ],
            {**env, "OTEL_SERVICE_NAME": "echo-sidecar"},
            tmp_path / "sidecar.log",
        )
        ingress, queue = conn.keys.ingress, conn.keys.queue("traced-1")
        send_name = f"send {queue}" if direct_lane else f"send {ingress}"
        provider = TracerProvider(resource=Resource.create({"service.name": "producer"}))
        # batched: exported from the processor's thread, so the receiver in this loop answers
        exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
        tracing.use_provider(provider)
        try:
            if direct_lane:  # the lane is there before the message is sent

                async def lane_published() -> bool:
                    return bool(await conn.call("EXISTS", direct_lane_key(conn.keys, "text.echo")))

                await eventually(lane_published, timeout_s=30)
            async with Client(conn) as client:
                result = await client.request("text.echo", {"x": 1}, timeout=60)
            message_id = result.id
            wanted = {send_name, "process text.echo", "call traced"}
            if not direct_lane:
                wanted.add(f"process {ingress}")

            async def all_spans() -> bool:
                return wanted <= {span.name for _, span in receiver.spans}

            await eventually(all_spans, timeout_s=30)
        finally:
            tracing.off()
            await anyio.to_thread.run_sync(provider.shutdown)
            stop(side)
            stop(up)
    producer, send = receiver.named(send_name)
    sidecar, process = receiver.named("process text.echo")
    _, call = receiver.named("call traced")
    assert (producer, sidecar) == ("producer", "echo-sidecar")
    assert (send.kind, process.kind, call.kind) == (PRODUCER, CONSUMER, CLIENT)
    # one trace id end to end: the sidecar's work is the producer's send's child ...
    assert send.trace_id == process.trace_id == call.trace_id
    assert process.parent_span_id == send.span_id and call.parent_span_id == process.span_id
    if direct_lane:  # ... no dispatcher took part
        assert not [span for _, span in receiver.spans if span.name == f"process {ingress}"]
        assert attributes(send)["agent_reach.instance"] == "traced-1"
    else:  # ... the dispatcher's batch span links to it
        dispatcher, dispatch = receiver.named(f"process {ingress}")
        assert dispatcher == "agent-reach" and dispatch.kind == CONSUMER
        assert [(link.trace_id, link.span_id) for link in dispatch.links] == [
            (send.trace_id, send.span_id)
        ]
        assert attributes(dispatch)["messaging.destination.name"] == ingress
        assert attributes(dispatch)["messaging.message.id"] == message_id
    # and the agent got the call's context
    (received,) = seen_by_agent
    version, trace_id, parent_id, flags = received.split("-")
    assert (version, trace_id, parent_id) == ("00", call.trace_id.hex(), call.span_id.hex())
    assert int(flags, 16) & 1, "sampled"
    destination = queue if direct_lane else ingress
    for span, named in ((send, destination), (process, "text.echo")):
        found = attributes(span)
        assert found["messaging.system"] == "agent_reach"
        assert found["messaging.message.id"] == message_id
        assert found["messaging.destination.name"] == named
    found = attributes(process)
    assert found["agent_reach.instance"] == "traced-1" and found["agent_reach.attempt"] == 1
    assert found["agent_reach.stage"] == "SUCCEEDED"
    assert process.status.code != 2  # not ERROR


def test_without_the_extra_nothing_is_imported_and_nothing_breaks(tmp_path: Path) -> None:
    """A fresh interpreter where ``opentelemetry`` cannot be imported, configured anyway."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if the extra were not installed
from broker import tracing
from broker.envelope import Envelope
import adapters.runner, broker.client, workers.dispatcher
assert not tracing.setup("agent-reach"), "no tracing without the package"
assert not tracing.use_installed_provider()
envelope = Envelope(capability="text.echo", payload=b"1")
with tracing.sending(envelope, "reach:in") as sent:
    assert sent is envelope
with tracing.processing(envelope, "i-1", 1) as p:
    with p.calling(envelope, "a") as called:
        assert called is envelope
    p.ended("FAILED", "x")
tracing.dispatched([envelope], "reach:in", 0, 1)
print("ok")
"""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "otel extra is not installed" in done.stderr


def test_unconfigured_processes_import_no_opentelemetry() -> None:
    script = (
        "import sys, adapters.runner, broker.client, workers.dispatcher, workers.cli\n"
        "for name in workers.cli.COMMANDS: workers.cli.main.commands[name]\n"
        "from broker import tracing\n"
        "assert not tracing.setup('agent-reach')\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_environment_decides() -> None:
    assert not tracing.configured({})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x/v1/traces"})
    assert tracing.configured({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.configured(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}
    )
    assert not tracing.configured({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
