"""The console over real HTTP on loopback, against a real Redis: who is let in, what a form
needs, what each action does and how it is recorded; and the live stream."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import pytest

from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore, Move
from broker.timekeeping import now_ms
from broker.usage import Usage, charge
from tests.conftest import suite_redis_binary
from tests.support.harness import card, eventually
from tests.support.repair import record_in
from tests.support.usage_days import day_turned
from workers.console.app import console_endpoint
from workers.console.security import COOKIE

TOKEN = "a-console-token-of-some-length"


@asynccontextmanager
async def console(conn: Connection, token: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        console_endpoint(conn, "127.0.0.1", 0, token) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        yield http


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "every page with a form carries its CSRF token"
    return found.group(1)


async def timeline_reasons(conn: Connection, message_id: str) -> list[str]:
    return [e.reason for e in await MessageStore(conn).get_timeline(message_id)]


async def test_every_page_answers_with_the_brokers_state(conn: Connection) -> None:
    await Registry(conn).register(card("seen-1", ("text.echo",)), credits=4)
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reason="no answer")
    dead = await record_in(conn, Stage.DEAD, reason="gave up after 3 attempts")
    async with console(conn) as http:
        overview = await http.get("/")
        agents = await http.get("/agents")
        stuck = await http.get("/messages", params={"older_than": "0"})
        one = await http.get(f"/messages/{parked}")
        letters = await http.get("/dlq")
        found = await http.get("/messages", params={"id": dead})
    assert overview.status_code == 200 and 'id="needs-confirmation"' in overview.text
    assert re.search(r'id="needs-confirmation"><a [^>]*>1</a>', overview.text)
    assert agents.status_code == 200 and "seen-1" in agents.text and "state-UP" in agents.text
    assert parked in stuck.text and "NEEDS_CONFIRMATION" in stuck.text
    assert one.status_code == 200 and "no answer" in one.text
    assert dead in letters.text and "gave up after 3 attempts" in letters.text
    assert found.status_code == 303 and found.headers["location"] == f"/messages/{dead}"


async def test_unknown_and_hostile_ids_get_a_404_page(conn: Connection) -> None:
    async with console(conn) as http:
        unknown = await http.get("/messages/NOPE-0001")
        hostile = await http.get("/messages/%3Cscript%3Ealert(1)%3C%2Fscript%3E")
        searched = await http.get("/messages", params={"id": "<b>x</b>"})
    assert unknown.status_code == 404 and "No message NOPE-0001" in unknown.text
    assert hostile.status_code == 404 and "<script>alert" not in hostile.text
    assert searched.status_code == 404 and "&lt;b&gt;x&lt;/b&gt;" in searched.text


async def test_an_action_needs_the_pages_csrf_token_and_a_same_site_origin(
    conn: Connection,
) -> None:
    waiting = await record_in(conn, Stage.CANCELLED)  # any record: the action is refused early
    async with console(conn) as http:
        token = csrf_of((await http.get("/dlq")).text)
        url = f"/messages/{waiting}/cancel"
        without = await http.post(url, data={})
        wrong = await http.post(url, data={"csrf": "0" * 64})
        other_site = await http.post(
            url, data={"csrf": token}, headers={"Origin": "https://evil.example"}
        )
        fetched_cross = await http.post(
            url, data={"csrf": token}, headers={"Sec-Fetch-Site": "cross-site"}
        )
        too_big = await http.post(url, content=b"x" * (2 << 20))
    assert [r.status_code for r in (without, wrong, other_site, fetched_cross)] == [403] * 4
    assert too_big.status_code == 413
    assert all(not r.startswith("cancelled by") for r in await timeline_reasons(conn, waiting))


async def test_a_foreign_host_name_is_refused_without_a_token(conn: Connection) -> None:
    """A page elsewhere that re-points its own name at 127.0.0.1 (DNS rebinding) sends that
    name as Host: without a token, only loopback names are answered."""
    async with console(conn) as http:
        rebound = await http.get("/", headers={"Host": "attacker.example:8700"})
        local = await http.get("/", headers={"Host": "localhost:8700"})
    assert rebound.status_code == 400
    assert local.status_code == 200


async def test_with_a_token_nothing_is_shown_or_done_without_it(conn: Connection) -> None:
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION)
    async with console(conn, TOKEN) as http:
        page = await http.get("/")
        stream = await http.get("/events/overview")
        scraped = await http.get("/metrics")
        action = await http.post(f"/messages/{parked}/cancel", data={"csrf": "x"})
        bad_login = await http.post(
            "/login", data={"token": "guess", "csrf": csrf_of((await http.get("/login")).text)}
        )
        bearer = await http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        login_form = (await http.get("/login")).text
        logged_in = await http.post("/login", data={"token": TOKEN, "csrf": csrf_of(login_form)})
        cookie = http.cookies.get(COOKIE)
        after = await http.get("/")
    assert page.status_code == 303 and page.headers["location"] == "/login"
    assert (stream.status_code, scraped.status_code, action.status_code) == (401, 401, 401)
    assert bad_login.status_code == 401 and "not the console's token" in bad_login.text
    assert bearer.status_code == 200 and "agent_reach_build_info" in bearer.text
    assert logged_in.status_code == 303 and cookie and TOKEN not in cookie
    assert after.status_code == 200 and "Overview" in after.text
    assert (await MessageStore(conn).stages([parked])) == [Stage.NEEDS_CONFIRMATION]


async def test_resolve_and_cancel_are_recorded_with_who_did_them(conn: Connection) -> None:
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION)
    queued = await record_in(conn, Stage.NEEDS_CONFIRMATION)
    async with console(conn) as http:
        token = csrf_of((await http.get(f"/messages/{parked}")).text)
        not_json = await http.post(
            f"/messages/{parked}/resolve",
            data={"csrf": token, "outcome": "succeeded", "value": "{oops"},
        )
        not_json_page = await http.get(not_json.headers["location"])
        resolved = await http.post(
            f"/messages/{parked}/resolve",
            data={"csrf": token, "outcome": "succeeded", "value": '{"done": true}'},
        )
        resolved_page = await http.get(resolved.headers["location"])
        refused = await http.post(f"/messages/{queued}/cancel", data={"csrf": token})
        refused_page = await http.get(refused.headers["location"])
    assert not_json.status_code == 303 and "not resolved: not JSON" in not_json_page.text
    assert resolved_page.status_code == 200 and "SUCCEEDED" in resolved_page.text
    assert "resolved by console@127.0.0.1: succeeded" in await timeline_reasons(conn, parked)
    assert "it cannot be cancelled" in refused_page.text and "not cancelled:" in refused_page.text
    assert await MessageStore(conn).stages([queued]) == [Stage.NEEDS_CONFIRMATION]


async def test_replay_asks_first_where_work_may_repeat(conn: Connection) -> None:
    dead = await record_in(conn, Stage.DEAD, reason="gave up")  # no instance serves it: unsafe
    async with console(conn) as http:
        token = csrf_of((await http.get("/dlq")).text)
        asked = await http.post("/dlq/replay", data={"csrf": token, "id": dead})
        unchanged = await MessageStore(conn).stages([dead])
        confirmed = await http.post(
            "/dlq/replay", data={"csrf": token, "id": dead, "confirm": "yes"}
        )
    assert asked.status_code == 200 and "Replay anyway" in asked.text
    assert "no instance serving it is registered" in asked.text
    assert unchanged == [Stage.DEAD]
    assert confirmed.status_code == 303
    assert await MessageStore(conn).stages([dead]) == [Stage.WAITING]
    assert "replayed by console@127.0.0.1" in await timeline_reasons(conn, dead)


async def test_weight_and_drain_change_the_instance(conn: Connection) -> None:
    registry = Registry(conn)
    await registry.register(card("steer-1", ("text.echo",)), credits=4)
    async with console(conn) as http:
        token = csrf_of((await http.get("/agents")).text)
        for bad in ("nan", "-1", "1e9", "heavy"):
            refused = await http.post("/agents/steer-1/weight", data={"csrf": token, "weight": bad})
            assert (
                "a weight is a number from 0 to 1000"
                in (await http.get(refused.headers["location"])).text
            )
        await http.post("/agents/steer-1/weight", data={"csrf": token, "weight": "2.5"})
        drained = await http.post("/agents/steer-1/drain", data={"csrf": token})
        missing = await http.post("/agents/gone-9/drain", data={"csrf": token})
        missing_page = await http.get(missing.headers["location"])
    (view,) = [v for v in await registry.snapshot() if v.instance_id == "steer-1"]
    assert view.card.weight == 2.5
    assert drained.status_code == 303 and view.state.value == "DRAINING"
    assert "no instance gone-9" in missing_page.text


@pytest.mark.timeout(60)
async def test_the_live_stream_sends_the_pages_region(conn: Connection) -> None:
    await Registry(conn).register(card("live-1", ("text.echo",)), credits=4)
    async with console(conn) as http, http.stream("GET", "/events/agents") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                update = json.loads(line.removeprefix("data: "))
                break
    assert update["id"] == "live" and 'data-instance="live-1"' in update["html"]


async def test_the_usage_page_shows_what_was_charged(conn: Connection) -> None:
    store = MessageStore(conn)
    charged_ms = now_ms()  # one time for the three charges: one day
    for i, tenant in enumerate(("team-a", "team-a", "team-b")):
        message_id = await record_in(conn, Stage.PROCESSING, reason="")
        bill = charge(
            "billing",
            "text.echo",
            tenant,
            attempt=1 + i % 2,
            answered=True,
            busy_ms=1500,
            usage=Usage(input_tokens=10, output_tokens=5, cost=0.5),
            ms=charged_ms,
        )
        assert (await store.apply(Move(message_id, Stage.SUCCEEDED, charge=bill))).ok
    async with console(conn) as http:
        by_tenant = await http.get("/usage", params={"by": "tenant", "since": "7d"})
        hostile = await http.get("/usage", params={"by": "<script>", "since": "forever"})
    assert by_tenant.status_code == 200
    rows = re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td>", by_tenant.text)
    assert rows == [("team-a", "2"), ("team-b", "1")]
    assert "1.0000" in by_tenant.text and "1 of these requests were retries" in by_tenant.text
    assert hostile.status_code == 200 and "<script>" not in hostile.text
    # by agent, today: the charges are yesterday's if the UTC day has turned since
    assert ("<tr><td>billing</td><td>3</td>" in hostile.text) is not day_turned(charged_ms)


async def test_redis_away_is_a_503_and_a_gap_in_the_chart_never_the_end_of_the_console(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stops under a running console: a page says so with a 503, the sampler says so
    in the log and goes on, and the pages answer again once Redis is back on its port."""
    binary = suite_redis_binary()
    server = RedisServer.start(tmp_path / "redis", binary=binary)
    own = msgspec.structs.replace(settings, redis_url=server.url)
    try:
        async with open_connection(own, server.url) as conn, console(conn) as http:
            before = await http.get("/dlq")
            with caplog.at_level(logging.WARNING, logger="agent_reach.console"):
                server.stop()

                async def sample_failed() -> bool:
                    return any("reading the overview" in r.getMessage() for r in caplog.records)

                await eventually(sample_failed, timeout_s=10)
                away = await http.get("/dlq")
            server = RedisServer.start(tmp_path / "redis", binary=binary, port=server.port)

            async def answers() -> bool:
                return (await http.get("/dlq")).status_code == 200

            await eventually(answers, timeout_s=20)
            overview = await http.get("/")
    finally:
        server.stop()
    assert before.status_code == 200 and overview.status_code == 200
    assert away.status_code == 503 and away.text.startswith("Redis is unavailable (")


async def test_stored_text_past_what_the_broker_writes_is_cut_on_the_page(
    conn: Connection,
) -> None:
    """A sidecar's user may write a record's timeline and error, and add dead letters, past
    the caps the broker's own writes keep: a 13 MB timeline made a 31 MB page, re-sent
    every second to an open tab."""
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reason="no answer")
    line = json.dumps([str(now_ms()), "NEEDS_CONFIRMATION", "", "1", "x" * 100_000])
    await conn.call("HSET", conn.keys.record(parked), "timeline", "\n".join([line] * 300))
    await conn.call("HSET", conn.keys.record(parked), "error", "e" * 1_000_000)
    await conn.call(
        "XADD", conn.keys.dlq, "*", "id", parked, "stage", "DEAD", "reason", "r" * 2_000_000
    )
    async with console(conn) as http:
        one = await http.get(f"/messages/{parked}")
        letters = await http.get("/dlq")
    assert one.status_code == 200 and len(one.text) < 600_000  # 200 entries of 2,000 at most
    assert f"and {300 - conn.settings.timeline_max} older entries not shown" in one.text
    assert letters.status_code == 200 and len(letters.text) < 100_000
    assert "rrr… (agent-reach dlq shows it whole)" in letters.text
