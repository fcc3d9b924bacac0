"""OpenTelemetry traces, following the messaging semantic conventions — when they are asked for.

Installed with the optional extra (``pip install agent-reach[otel]``) and configured by the
standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_TRACES_EXPORTER=otlp``, ``OTEL_SERVICE_NAME``, ``OTEL_BSP_*``, …), each process we start
exports its spans over OTLP/HTTP (:func:`setup`). A producer's own application may install its
own tracer provider instead: the client uses whichever is installed.

One message's trace:

- ``send <ingress>`` (PRODUCER), in the client: its context goes into the envelope's
  ``traceparent`` / ``tracestate``;
- ``process <ingress>`` (CONSUMER), in the dispatcher: the batch's time, *linked* to the
  producer's context (a batch serves many traces);
- ``process <capability>`` (CONSUMER), in the sidecar, *parented* on the envelope's context,
  with the agent call as its CLIENT child ``call <agent>``, whose context is what the agent
  receives as ``traceparent``.

Attributes: ``messaging.system = agent_reach``, ``messaging.operation.type``,
``messaging.message.id``, ``messaging.destination.name``, and ours: ``agent_reach.instance``,
``agent_reach.attempt``, ``agent_reach.stage`` (how the attempt ended); an outcome other than
SUCCEEDED sets the span's status to ERROR.

Without the extra, or without the configuration, every function here returns at once: the
module imports nothing from OpenTelemetry until a process turns tracing on.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, TypeVar

import msgspec

from .envelope import Envelope

log = logging.getLogger("agent_reach.tracing")

SYSTEM = "agent_reach"
_INSTRUMENTATION = "agent_reach"
_state: dict[str, Any] = {}  # "trace", "propagate", "tracer" once on; empty: off
T = TypeVar("T")


class _Given(Generic[T]):
    """A span's stand-in while tracing is off: enters as ``value``, does nothing else. A
    generator's context manager cost a busy sidecar about 3 % of its CPU for nothing."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __enter__(self) -> T:
        return self.value

    def __exit__(self, *exc: object) -> None:
        return None


def configured(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint, or ``otlp`` exporter."""
    env = os.environ if environ is None else environ
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none" or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    return bool(endpoint) or exporter == "otlp"


def setup(service_name: str) -> bool:
    """Export this process's spans over OTLP/HTTP when the environment asks for it; whether
    tracing is on. Spans still queued are flushed at exit."""
    if _state or not configured():
        return bool(_state)
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for traces, but the otel extra is not installed: none sent")
        return False
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    return _use_installed()


def use_installed_provider() -> bool:
    """Trace with the provider the application installed, if any (the client's case). An
    application that has not imported OpenTelemetry has installed none: nothing is imported."""
    if _state:
        return True
    return "opentelemetry.trace" in sys.modules and _use_installed(require_sdk=True)


def use_provider(provider: Any) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``) without installing it globally."""
    from opentelemetry import propagate, trace

    _state.update(trace=trace, propagate=propagate, tracer=provider.get_tracer(_INSTRUMENTATION))


def _use_installed(*, require_sdk: bool = False) -> bool:
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return False
    if require_sdk and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False  # nobody installed one: spans would go nowhere
    _state.update(trace=trace, propagate=propagate, tracer=trace.get_tracer(_INSTRUMENTATION))
    return True


def off() -> None:
    """Stop tracing in this process (tests)."""
    _state.clear()


def _carrier(envelope: Envelope) -> dict[str, str]:
    carrier = {}
    if envelope.traceparent:
        carrier["traceparent"] = envelope.traceparent
    if envelope.tracestate:
        carrier["tracestate"] = envelope.tracestate
    return carrier


def _context_of(envelope: Envelope) -> Any:
    return _state["propagate"].extract(_carrier(envelope))


def _with_context(envelope: Envelope, context: Any | None = None) -> Envelope:
    carrier: dict[str, str] = {}
    _state["propagate"].inject(carrier, context=context)
    return msgspec.structs.replace(
        envelope,
        traceparent=carrier.get("traceparent", envelope.traceparent),
        tracestate=carrier.get("tracestate", envelope.tracestate),
    )


def _base(operation: str, destination: str, message_id: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation,
        "messaging.destination.name": destination,
    }
    if message_id:
        attributes["messaging.message.id"] = message_id
    return attributes


def sending(envelope: Envelope, ingress: str) -> AbstractContextManager[Envelope]:
    """The ``send`` span of one envelope; enters as the envelope carrying its context."""
    if not _state:
        return _Given(envelope)
    return _sending(envelope, ingress)


@contextmanager
def _sending(envelope: Envelope, ingress: str) -> Iterator[Envelope]:
    trace = _state["trace"]
    with _state["tracer"].start_as_current_span(
        f"send {ingress}",
        context=_context_of(envelope) if envelope.traceparent else None,
        kind=trace.SpanKind.PRODUCER,
        attributes=_base("send", ingress, envelope.id),
    ):
        yield _with_context(envelope)


def sent_directly(stream: str, instance: str) -> None:
    """The current ``send`` span's envelope went down a direct lane (:mod:`broker.direct`):
    its destination is the instance's stream, and no dispatcher's ``process`` span follows."""
    if not _state:
        return
    span = _state["trace"].get_current_span()
    span.update_name(f"send {stream}")
    span.set_attribute("messaging.destination.name", stream)
    span.set_attribute("agent_reach.instance", instance)


def dispatched(envelopes: Sequence[Envelope], ingress: str, start_ns: int, end_ns: int) -> None:
    """One ``process`` span per envelope of a batch the dispatcher handled, each linked to its
    producer's context."""
    if not _state:
        return
    trace = _state["trace"]
    for envelope in envelopes:
        links = []
        if envelope.traceparent:
            parent = trace.get_current_span(_context_of(envelope)).get_span_context()
            if parent.is_valid:
                links.append(trace.Link(parent))
        span = _state["tracer"].start_span(
            f"process {ingress}",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root: linked, not a child
            kind=trace.SpanKind.CONSUMER,
            attributes={
                **_base("process", ingress, envelope.id),
                "agent_reach.capability": envelope.capability,
            },
            links=links,
            start_time=start_ns,
        )
        span.end(end_time=end_ns)


class Processing:
    """A sidecar's ``process <capability>`` span for one attempt, and the agent call in it."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def calling(self, envelope: Envelope, agent: str) -> AbstractContextManager[Envelope]:
        """The agent call (CLIENT); enters as the envelope carrying the call's context, which
        the agent receives as ``traceparent``."""
        if self.span is None:
            return _Given(envelope)
        return self._calling(envelope, agent)

    @contextmanager
    def _calling(self, envelope: Envelope, agent: str) -> Iterator[Envelope]:
        trace = _state["trace"]
        context = trace.set_span_in_context(self.span)
        with _state["tracer"].start_as_current_span(
            f"call {agent}",
            context=context,
            kind=trace.SpanKind.CLIENT,
            attributes={"agent_reach.agent": agent},
        ):
            yield _with_context(envelope)

    def ended(self, stage: str, error: str | None = None) -> None:
        """How the attempt ended; anything but SUCCEEDED marks the span as an error."""
        if self.span is None:
            return
        trace = _state["trace"]
        self.span.set_attribute("agent_reach.stage", stage)
        if stage != "SUCCEEDED":
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, error or stage))


_UNTRACED = Processing(None)


def processing(
    envelope: Envelope, instance: str, attempt: int
) -> AbstractContextManager[Processing]:
    """A sidecar's span of one attempt (:class:`Processing`)."""
    if not _state:
        return _Given(_UNTRACED)
    return _processing(envelope, instance, attempt)


@contextmanager
def _processing(envelope: Envelope, instance: str, attempt: int) -> Iterator[Processing]:
    trace = _state["trace"]
    attributes = {
        **_base("process", envelope.capability, envelope.id),
        "agent_reach.instance": instance,
        "agent_reach.attempt": attempt,
    }
    with _state["tracer"].start_as_current_span(
        f"process {envelope.capability}",
        context=_context_of(envelope),
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
    ) as span:
        yield Processing(span)
