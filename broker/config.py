"""Validated settings: defaults, then a TOML file, then ``AGENT_REACH_*`` environment variables,
then explicit overrides (command-line flags). Unknown keys and out-of-range values fail with the
key's name and the allowed range.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect

from . import failpoints
from .envelope import TENANT_PATTERN, capability_problem
from .errors import ConfigError, quoted
from .events import EVENT_TYPES
from .governance import (
    BudgetMode,
    EventSubscription,
    IntentRule,
    RateLimits,
    TenantBudget,
    rate_problem,
    rule_problem,
)
from .jsondepth import decode_error_text, depth_problem
from .redaction import url_without_password
from .redis_url import parse_redis_url
from .subscriptions import subscription_problem
from .webhooks import Allowlist, webhook_secret_problem

ENV_PREFIX = "AGENT_REACH_"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few kilobytes; a megabyte is no config file
# Variables under the prefix that are read elsewhere, not settings: secrets that stay out of
# the settings (the console's token, workers/console/security.py; the A2A gateway's API key,
# workers/cli/gateway.py) and what the tests read (tests/conftest.py, the console's tests).
NON_SETTING_ENV = frozenset(
    {
        "CONFIG",
        "FAILPOINTS",
        "CHAOS",
        "STATE_DIR",
        "EVENT_LOOP",
        "CONSOLE_TOKEN",
        "A2A_API_KEY",
        "SCREENSHOTS",
        "TEST_REDIS",
    }
)

# Durations: from a hundredth of a second (a smaller one would make a loop spin) to a day.
Positive = Annotated[float, msgspec.Meta(ge=0.01, le=86400)]
Ratio = Annotated[float, msgspec.Meta(ge=0, le=1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


class Settings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Every tunable of the broker, with its default (DESIGN §5, §8)."""

    redis_url: str | None = None
    prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}(?!\n)$")] = "reach"
    heartbeat_s: Positive = 5.0
    down_after_s: Positive = 15.0
    # waiting messages a drain reads past a pinned head, unmatched ones restored per sweep,
    # abandoned ingress entries claimed at once
    dispatch_batch: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 256
    # ingress entries a dispatcher reads at once, and waiting messages a drain pass claims.
    # One read is a pipeline of as many scripts, which holds Redis while a sidecar's outcomes
    # and the credit drain wait: 32 ran 13-19 % faster under saturation than 256 (README,
    # "Benchmarks")
    ingress_batch: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 32
    # ingress streams: P:in, P:in:{1}, ... (more than one spreads them over a cluster's nodes)
    ingress_partitions: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    # the dispatcher publishes a direct lane for each capability one instance serves, with no
    # limit, budget or waiting work: producers assign to it themselves (broker/direct.py).
    # On by default: it takes the dispatcher's hop off the light-load path (README,
    # "Benchmarks"); off, every message passes a dispatcher and its spans and /metrics
    direct_lane: bool = True
    # WAIT for this many replicas after each round trip that writes (broker/durability.py)
    replica_acks: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    replica_ack_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    sidecar_batch: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 256
    sweep_interval_s: Positive = 1.0
    registry_refresh_s: Positive = 1.0
    max_envelope_bytes: Annotated[int, msgspec.Meta(ge=256, le=64 * 1024 * 1024)] = 1024 * 1024
    sync_call_timeout_s: Positive = 5.0
    record_ttl_s: Annotated[int, msgspec.Meta(ge=60, le=365 * 86400)] = 7 * 86400
    timeline_max: Annotated[int, msgspec.Meta(ge=10, le=10_000)] = 200
    # routing (DESIGN §5)
    capability_mode: Literal["strict", "loose"] = "strict"
    capability_aliases: dict[str, str] = msgspec.field(default_factory=dict)
    load_cut: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    top_ratio: Ratio = 0.3
    cold_start_successes: Count = 20
    cold_start_confidence: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    panic_threshold: Ratio = 0.5
    session_ttl_s: Positive = 1800.0
    # health
    degrade_error_rate: Ratio = 0.10
    down_error_rate: Ratio = 0.50
    degrade_load: Ratio = 0.80
    sustain_heartbeats: Annotated[int, msgspec.Meta(ge=1, le=100)] = 2
    recover_heartbeats: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    stats_window_s: Positive = 60.0
    allowed_fails: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    cooldown_s: Positive = 30.0
    circuit_min_requests: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 10
    circuit_fail_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    circuit_open_s: Positive = 30.0
    circuit_probes: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    drain_grace_s: Positive = 40.0
    # retries and timeouts (used by the reaper)
    retry_limit: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
    retry_backoff_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 200
    retry_jitter: Ratio = 0.2
    delivery_timeout_s: Positive = 30.0
    # ingress entries pending this long with a dispatcher are taken over by another one
    claim_idle_s: Positive = 30.0
    # past the sidecar's own call timeout, before the reaper asks after a PROCESSING message
    processing_grace_s: Positive = 5.0
    callback_timeout_s: Positive = 600.0
    # async agents: the largest result an agent may POST to a sidecar's callback endpoint
    max_callback_bytes: Annotated[int, msgspec.Meta(ge=256, le=64 * 1024 * 1024)] = 1024 * 1024
    # the largest answer an agent (or its status endpoint) may give a sidecar's call
    max_result_bytes: Annotated[int, msgspec.Meta(ge=256, le=64 * 1024 * 1024)] = 1024 * 1024
    # result delivery (the notifier): webhooks to `callback_url`
    webhook_secret: str | None = None  # HMAC-SHA256 key; no secret, no webhooks
    callback_hosts: list[str] = msgspec.field(default_factory=list)  # allowed webhook hosts
    webhook_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 6
    webhook_backoff_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 500
    webhook_backoff_max_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 60_000
    webhook_timeout_s: Positive = 10.0
    # async agents: a connection to the callback endpoint that has not sent its request's
    # headers within this long is closed (a slow-headers client holds no slot for long)
    callback_header_timeout_s: Positive = 10.0
    # ... and one whose body has not arrived this long after its headers gets 408
    callback_body_timeout_s: Positive = 30.0
    # connections the callback endpoint serves at once; past them it answers 503
    callback_max_connections: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 256
    # caps: nothing grows without bound (README, "Caps")
    dlq_max_entries: Annotated[int, msgspec.Meta(ge=100, le=100_000_000)] = 10_000
    dlq_entry_max_bytes: Annotated[int, msgspec.Meta(ge=256, le=64 * 1024 * 1024)] = 16 * 1024
    # the cluster-wide counters behind /metrics (P:counters), written by the scripts that end
    # a message; off, those scripts count nothing (a benchmark's baseline)
    metrics_counters: bool = True
    # distinct counter series (capability x stage, ...) before new ones count as "_other"
    metrics_max_series: Annotated[int, msgspec.Meta(ge=10, le=1_000_000)] = 5_000
    route_from_max_listed: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 20
    reply_ttl_s: Annotated[int, msgspec.Meta(ge=60, le=365 * 86400)] = 86400
    instance_gone_after_s: Annotated[float, msgspec.Meta(gt=0, le=365 * 86400)] = 86400.0
    orphan_sweep_s: Annotated[float, msgspec.Meta(ge=0, le=365 * 86400)] = 3600.0
    # governance (README "Govern the fleet"): usage per UTC day, kept this many days
    usage_keep_days: Annotated[int, msgspec.Meta(ge=2, le=3660)] = 400
    budgets: dict[str, TenantBudget] = msgspec.field(default_factory=dict)
    budget_mode: BudgetMode = "reject"
    # how stale a dispatcher's view of what each tenant has spent may be
    budget_refresh_s: Positive = 1.0
    rate_limits: RateLimits = msgspec.field(default_factory=RateLimits)
    # the event stream P:events, trimmed to about this many entries
    events_max: Annotated[int, msgspec.Meta(ge=100, le=100_000_000)] = 10_000
    event_subscriptions: list[EventSubscription] = msgspec.field(default_factory=list)
    # intent routing: rules first, then the semantic layer
    intent_rules: list[IntentRule] = msgspec.field(default_factory=list)
    intent_hit: Ratio = 0.85
    intent_reject: Ratio = 0.55
    # candidates within this much of the best score count as close: the cheapest wins
    intent_close: Ratio = 0.05
    intent_feedback_weight: Ratio = 0.1
    embedding_url: str | None = None
    embedding_model: str = "text-embedding-3-small"
    embedding_timeout_s: Positive = 5.0


FIELDS: tuple[str, ...] = Settings.__struct_fields__


def answer_grace_s(settings: Settings) -> float:
    """How long after a message's deadline its final answer may still take to arrive: the
    reaper ends a message that waited past its deadline at its next tick (a sweep interval),
    with room for a lease taken just before and for the reply's own round trips. Whoever
    waits for an answer (``send --wait``, ``request``) waits the deadline plus this, so an
    EXPIRED message shows its reason rather than a local timeout."""
    return 3 * settings.sweep_interval_s + 2.0


def processing_lateness_s(settings: Settings) -> float:
    """How long after PROCESSING is written the reaper leaves the message to its sidecar
    before it asks after it: the sidecar's own call timeout, and the grace past it."""
    return settings.sync_call_timeout_s + settings.processing_grace_s


def build_settings(layers: list[Mapping[str, Any]]) -> Settings:
    """Merge layers (later wins) and validate; raise :class:`ConfigError` naming the key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in FIELDS:
                raise ConfigError(key, f"unknown key; known keys: {', '.join(FIELDS)}")
            merged[key] = value
    for key, value in merged.items():
        if problem := _text_problem(value):
            raise ConfigError(key, problem)
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        key = _key_of(str(exc))
        raise ConfigError(key, f"{exc}{_choices(key)}") from exc
    if found := _problem(settings):
        raise ConfigError(*found)
    return settings


def _text_problem(value: Any) -> str | None:
    """Why ``value`` holds no text UTF-8 can carry, or ``None``: a byte that is no UTF-8 in
    an environment variable reaches Python as a lone surrogate (``$'\\xff'``), which every
    later step would raise on."""
    try:
        msgspec.json.encode(value)
    except UnicodeEncodeError as exc:
        return f"not valid UTF-8 text (a byte that is no character, at {exc.start})"
    except (TypeError, OverflowError):  # not JSON at all (a TOML date, say): the types say
        return None
    return None


def _problem(settings: Settings) -> tuple[str, str] | None:
    """``(key, problem)`` for what the types alone cannot check, or ``None``."""
    if settings.redis_url:  # none, or empty: the embedded Redis
        try:
            parse_redis_url(settings.redis_url)
        except ConfigError as exc:  # said before anything connects (or prints the URL)
            return "redis_url", exc.problem
    if settings.down_after_s < settings.heartbeat_s:
        why = f"must be at least heartbeat_s ({settings.heartbeat_s}), got {settings.down_after_s}"
        return "down_after_s", why
    for alias, canonical in settings.capability_aliases.items():
        for name in (alias, canonical):
            if problem := capability_problem(name):
                return "capability_aliases", problem
    if settings.webhook_secret and (problem := webhook_secret_problem(settings.webhook_secret)):
        return "webhook_secret", problem
    if unusable := Allowlist.parse(settings.callback_hosts).unusable:
        listed = ", ".join(map(repr, unusable))
        return "callback_hosts", f"{listed}: not a host, host:port, IP address or network"
    return _governance_problem(settings)


_TENANT = re.compile(TENANT_PATTERN)


def _governance_problem(settings: Settings) -> tuple[str, str] | None:
    return (
        _limits_problem(settings)
        or _intent_problem(settings)
        or _subscriptions_problem(settings)
        or _tenants_problem(settings)
    )


def _limits_problem(settings: Settings) -> tuple[str, str] | None:
    for kind, limits in (
        ("agent", settings.rate_limits.agent),
        ("capability", settings.rate_limits.capability),
        ("tenant", settings.rate_limits.tenant),
    ):
        for name, limit in limits.items():
            if problem := rate_problem(limit):
                return f"rate_limits.{kind}.{name}", problem
    return None


def _intent_problem(settings: Settings) -> tuple[str, str] | None:
    for i, rule in enumerate(settings.intent_rules):
        if problem := rule_problem(rule) or capability_problem(rule.capability):
            return f"intent_rules[{i}]", problem
    if settings.intent_reject > settings.intent_hit:
        why = f"must not be above intent_hit ({settings.intent_hit})"
        return "intent_reject", f"{why}, got {settings.intent_reject}"
    if settings.embedding_url and not settings.embedding_url.startswith(("http://", "https://")):
        shown = quoted(url_without_password(settings.embedding_url))  # said back: no secret
        return "embedding_url", f"{shown}: an http:// or https:// URL"
    return None


def _subscriptions_problem(settings: Settings) -> tuple[str, str] | None:
    hosts, secret = settings.callback_hosts, settings.webhook_secret
    for i, subscription in enumerate(settings.event_subscriptions):
        if unknown := sorted(set(subscription.events) - set(EVENT_TYPES)):
            return f"event_subscriptions[{i}]", (
                f"unknown events {', '.join(unknown)}; known: {', '.join(EVENT_TYPES)}"
            )
        if problem := subscription_problem(subscription.url, subscription.events, hosts, secret):
            return f"event_subscriptions[{i}]", problem
    return None


def _tenants_problem(settings: Settings) -> tuple[str, str] | None:
    for key, tenants in (
        ("budgets", settings.budgets),
        ("rate_limits", settings.rate_limits.tenant),
    ):
        for tenant in tenants:
            if not _TENANT.match(tenant):
                return key, (
                    f"{tenant!r}: a tenant is 1-128 printable ASCII characters, no spaces, "
                    "and not '-' (no tenant, in usage)"
                )
    return None


def _choices(key: str) -> str:
    """``"; one of: a, b"`` for a key that takes one of a few words, else ``""``."""
    info = msgspec.inspect.type_info(Settings)
    assert isinstance(info, msgspec.inspect.StructType)
    for found in info.fields:
        if found.name == key and isinstance(found.type, msgspec.inspect.LiteralType):
            return f"; one of: {', '.join(map(str, found.type.values))}"
    return ""


def _key_of(message: str) -> str:
    marker = "at `$."
    if marker in message:
        return message.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0]
    return "?"


def env_layer(environ: Mapping[str, str]) -> dict[str, str]:
    """Settings from ``AGENT_REACH_<KEY>`` variables; an unknown one is a :class:`ConfigError`."""
    layer = {}
    for name, value in environ.items():
        if name == failpoints.ENV:
            try:
                failpoints.parse(value)
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from exc
        if not name.startswith(ENV_PREFIX) or name[len(ENV_PREFIX) :] in NON_SETTING_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in FIELDS:
            raise ConfigError(
                name, f"unknown environment variable; known keys: {', '.join(FIELDS)}"
            )
        if problem := _text_problem(value):  # before any decoding: each would raise on it
            raise ConfigError(name, problem)
        layer[key] = _env_value(key, value)
    return layer


_JSON_KEYS = frozenset(
    {"capability_aliases", "budgets", "rate_limits", "event_subscriptions", "intent_rules"}
)


def _env_value(key: str, value: str) -> Any:
    """Maps come as JSON: ``AGENT_REACH_CAPABILITY_ALIASES='{"a.b": "c.d"}'``; lists as
    comma-separated words: ``AGENT_REACH_CALLBACK_HOSTS=hooks.example.com,127.0.0.1``."""
    if key == "callback_hosts":
        return [host.strip() for host in value.split(",") if host.strip()]
    if key in _JSON_KEYS:
        if too_deep := depth_problem(value):  # before decoding: the decoder recurses
            raise ConfigError(key, too_deep)
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise ConfigError(key, f"expected JSON: {decode_error_text(exc, value)}") from exc
    return value


def _read_at_most(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``: a file, or a pipe (``--config <(…)``). Opened
    without waiting for a writer, which a FIFO nobody writes to would do for ever (it then
    reads as empty); read to the limit, so a device that never ends (``/dev/zero``) does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        os.set_blocking(fd, True)
        return file.read(limit)


def file_layer(path: Path) -> dict[str, Any]:
    """Settings from a TOML file; a missing or malformed file is a :class:`ConfigError`."""
    try:
        raw = _read_at_most(path, MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(str(path), f"over {MAX_CONFIG_BYTES} bytes: not a config file")
        data = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(str(path), "config file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), f"cannot read config file: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"invalid TOML: {exc}") from exc
    except RecursionError as exc:  # tomllib recurses into nested arrays and tables
        raise ConfigError(str(path), "invalid TOML: nested too deeply") from exc
    except ValueError as exc:  # int() past 4,300 digits: not a TOMLDecodeError
        raise ConfigError(str(path), "invalid TOML: a number of more than 4,300 digits") from exc
    return data


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Defaults < config file (``--config`` or ``AGENT_REACH_CONFIG``) < environment < flags."""
    environ = os.environ if environ is None else environ
    layers: list[Mapping[str, Any]] = []
    path = config_file
    if path is None and environ.get("AGENT_REACH_CONFIG"):
        path = Path(environ["AGENT_REACH_CONFIG"])
    if path is not None:
        layers.append(file_layer(path))
    layers.append(env_layer(environ))
    layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
    return build_settings(layers)
