"""Agent-Reach core library: envelope, lifecycle, key space, stores, routing, client.

``broker`` holds no process entry points and imports nothing from ``workers`` or
``adapters``; ``tests/unit/test_layering.py`` checks both.
"""

from .client import Client, Result, SyncClient, Trace
from .config import Settings, load_settings
from .connection import Connection, open_connection
from .envelope import Envelope, decode_envelope, envelope_schema
from .errors import (
    ClientNotOpen,
    ConfigError,
    DeliveryError,
    EmbeddedRedisError,
    IllegalTransition,
    InvalidEnvelope,
    ReachError,
    RedisReplyError,
    RedisUnavailable,
    RequestTimeout,
    UnknownMessage,
)
from .keyspace import Keyspace
from .records import InstanceCard, InstanceState, InstanceView, MessageRecord, TimelineEntry
from .stages import TERMINAL, TRANSITIONS, Stage

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "Client",
    "ClientNotOpen",
    "ConfigError",
    "Connection",
    "DeliveryError",
    "EmbeddedRedisError",
    "Envelope",
    "IllegalTransition",
    "InstanceCard",
    "InstanceState",
    "InstanceView",
    "InvalidEnvelope",
    "Keyspace",
    "MessageRecord",
    "ReachError",
    "RedisReplyError",
    "RedisUnavailable",
    "RequestTimeout",
    "Result",
    "Settings",
    "Stage",
    "SyncClient",
    "TimelineEntry",
    "Trace",
    "UnknownMessage",
    "decode_envelope",
    "envelope_schema",
    "load_settings",
    "open_connection",
]
