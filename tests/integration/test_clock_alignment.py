"""A process's clock measured against Redis's (broker/connection.py, keep_clock_aligned)."""

from __future__ import annotations

import logging
import secrets

import pytest

from broker import connection, timekeeping
from broker.config import Settings
from broker.connection import Connection, align_clock, open_connection


@pytest.mark.anyio
async def test_one_host_keeps_its_own_clock(conn: Connection) -> None:
    """Redis on this host: the offset measured is within the tolerance, so none is applied."""
    assert await align_clock(conn.url) is True
    assert timekeeping.offset_ms() == 0


@pytest.mark.one_server
@pytest.mark.anyio
async def test_a_user_who_may_not_ask_the_time_keeps_its_clock_and_is_told_once(
    conn: Connection,
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rules made before TIME joined every role: the connection opens and serves, the
    process keeps its own clock, and says so once however many connections it opens."""
    assert settings.redis_url is not None
    name, password = f"old-{secrets.token_hex(4)}", secrets.token_hex(16)
    await conn.call("ACL", "SETUSER", name, "on", f">{password}", "~*", "&*", "+@all", "-time")
    url = settings.redis_url.replace("redis://", f"redis://{name}:{password}@", 1)
    monkeypatch.setattr(connection, "_told", set())  # as in a fresh process
    try:
        with caplog.at_level(logging.WARNING, logger="agent_reach.connection"):
            for _ in range(2):
                async with open_connection(settings, url) as theirs:
                    assert await align_clock(url) is False
                    assert await theirs.call("PING") == b"PONG"
        refused = [r for r in caplog.records if "may not run TIME" in r.getMessage()]
        assert len(refused) == 1
        assert timekeeping.offset_ms() == 0
    finally:
        await conn.call("ACL", "DELUSER", name)
