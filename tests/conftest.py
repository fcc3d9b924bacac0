"""Fixtures shared by every test layer: a real redis-server per session, a key prefix per test."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from broker.config import Settings, build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer

_prefixes = itertools.count()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.add_marker(pytest.mark.anyio)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def settings(redis_server: RedisServer) -> Settings:
    """Fast clocks and a fresh key prefix, so tests share one server without seeing each other."""
    return build_settings(
        [
            {
                "redis_url": redis_server.url,
                "prefix": f"t{next(_prefixes)}",
                "heartbeat_s": 0.5,
                "down_after_s": 5.0,
                "sweep_interval_s": 0.2,
                "registry_refresh_s": 0.5,
                # Test agents share one busy process with the broker: a thousand requests in
                # flight there can take seconds each, which must not read as a timeout.
                "sync_call_timeout_s": 60.0,
            }
        ]
    )


@pytest.fixture
async def conn(settings: Settings) -> AsyncIterator[Connection]:
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as connection:
        yield connection


@pytest.fixture
def data_dir() -> Path:
    return Path(__file__).parent / "data"
