"""The console in a real browser: headless Chromium (Debian's ``chromium``, as ``.ci/run``
installs it) driven by Playwright, against a real ``agent-reach up --console``, real
sidecars and an agent on loopback, with traffic.

Each page is loaded and looked at; an instance turns DOWN on the open agents page when its
sidecar is stopped (SIGSTOP), with no reload; an instance is drained by a click; a dead
letter is replayed by clicks (through the confirmation a non-idempotent agent needs) and its
message page shows it succeed. Screenshots of each page go to ``$AGENT_REACH_SCREENSHOTS``
when set (the README's, in ``docs/images/``), else to the test's own directory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import pytest
from playwright.async_api import Browser, Page, Playwright, async_playwright, expect

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import eventually
from tests.support.processes import process_env, start, stop
from tests.support.repair import record_in

# The flags a root, offline, GPU-less machine needs: without the background-networking
# ones Chromium keeps dialling out, and every dial is refused here.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LIVE_S = 20_000  # ms a live change may take to show: down_after_s (5) plus a sample or two


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("the console's browser tests need Chromium: `apt-get install -y chromium`")
    return found


async def announced(log: Path, what: str) -> str:
    found: list[str] = []

    async def said() -> bool:
        text = await anyio.Path(log).read_text(errors="replace")
        found[:] = re.findall(rf"{what} at (http://\S+)", text)
        return bool(found)

    await eventually(said, timeout_s=30)
    return found[0]


async def shoot(page: Page, name: str, into: Path) -> None:
    await page.screenshot(path=str(into / f"console-{name}.png"), full_page=True)


def shots_dir(tmp_path: Path) -> Path:
    chosen = Path(os.environ.get("AGENT_REACH_SCREENSHOTS") or tmp_path / "screens")
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


async def open_browser(playwright: Playwright) -> Browser:
    return await playwright.chromium.launch(
        executable_path=chromium(), headless=True, args=CHROMIUM_FLAGS
    )


@pytest.mark.timeout(240)
async def test_the_console_in_a_browser(settings: Settings, tmp_path: Path) -> None:
    assert settings.redis_url is not None
    env = process_env(settings)
    shots = shots_dir(tmp_path)
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("writer") as agent,
        async_playwright() as playwright,
    ):
        up = start(["up", "--console", "--console-port", "0"], env, tmp_path / "up.log")
        sidecars = {
            name: start(
                [
                    *("sidecar", "--agent-id", "writer", "--instance-id", name),
                    *("--capability", "text.write", "--http", agent.url),
                    *("--tag", "zone=eu", "--version", "1.4.2"),
                ],
                env,
                tmp_path / f"{name}.log",
            )
            for name in ("writer-1", "writer-2", "writer-3")
        }
        browser = await open_browser(playwright)
        try:
            url = await announced(tmp_path / "up.log", "console")
            done = await traffic(conn)
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await every_page(page, url, done, shots)
            await turns_down_live(page, url, sidecars["writer-3"], shots)
            await drain_by_click(page, url, conn)
            await replay_by_click(page, url, conn, shots)
        finally:
            await browser.close()
            sidecars["writer-3"].send_signal(signal.SIGCONT)
            codes = [stop(p) for p in sidecars.values()] + [stop(up)]
    assert codes[-1] == 0, "up stops cleanly, its console with it"


async def traffic(conn: Connection) -> str:
    """Messages the pages show: a dozen done, one waiting for an operator; a done one's id."""
    async with Client(conn) as client:
        done = [await client.request("text.write", {"n": i}, timeout=30) for i in range(12)]
    assert all(r.ok for r in done)
    await record_in(conn, Stage.NEEDS_CONFIRMATION, capability="text.write", reason="no answer")
    return done[-1].id


async def every_page(page: Page, url: str, done: str, shots: Path) -> None:
    await page.goto(url)
    await expect(page.locator("#total-accepted")).to_have_text("13")  # and the parked one
    await expect(page.locator("#needs-confirmation")).to_have_text("1")
    await expect(page.locator("#live-status")).to_have_text("live")
    await shoot(page, "overview", shots)

    await page.goto(f"{url}agents")
    for name in ("writer-1", "writer-2", "writer-3"):
        row = page.locator(f'tr[data-instance="{name}"]')
        await expect(row.locator(".state")).to_have_text("UP")
        await expect(row).to_contain_text("zone=eu")
    await shoot(page, "agents", shots)

    await page.goto(f"{url}messages")
    await page.select_option('select[name="stage"]', "NEEDS_CONFIRMATION")
    await page.fill('input[name="older_than"]', "0")
    await page.click('button:has-text("Filter")')
    await expect(page.locator("#stuck")).to_contain_text("no answer")
    await shoot(page, "messages", shots)

    await page.fill('input[name="id"]', done)
    await page.click('button:has-text("Find")')
    await expect(page.locator("#stage")).to_have_text("SUCCEEDED")
    await expect(page.locator("#timeline")).to_contain_text("PROCESSING")
    await expect(page.locator("#funnel")).to_contain_text("capability")
    await shoot(page, "message", shots)


async def turns_down_live(
    page: Page, url: str, sidecar: subprocess.Popen[bytes], shots: Path
) -> None:
    await page.goto(f"{url}agents")
    state = page.locator('tr[data-instance="writer-3"] .state')
    await expect(state).to_have_text("UP")
    loaded_at = await page.evaluate("performance.timeOrigin")
    sidecar.send_signal(signal.SIGSTOP)
    await expect(state).to_have_text("DOWN", timeout=LIVE_S)
    assert await page.evaluate("performance.timeOrigin") == loaded_at, "not reloaded"
    await shoot(page, "agents-down", shots)


async def drain_by_click(page: Page, url: str, conn: Connection) -> None:
    await page.goto(f"{url}agents")
    row = page.locator('tr[data-instance="writer-2"]')
    await row.locator('button[name="drain"]').click()
    await expect(page.locator("#notice")).to_contain_text("writer-2: draining")

    async def drained() -> bool:
        views = {v.instance_id: v for v in await Registry(conn).snapshot()}
        return "writer-2" not in views or views["writer-2"].state.value == "DRAINING"

    await eventually(drained, timeout_s=30)


async def replay_by_click(page: Page, url: str, conn: Connection, shots: Path) -> None:
    dead = await record_in(conn, Stage.DEAD, capability="text.write", reason="gave up")
    await page.goto(f"{url}dlq")
    row = page.locator(f'tr[data-message="{dead}"]')
    await expect(row).to_contain_text("gave up")
    await shoot(page, "dead-letters", shots)
    await row.locator('button[name="replay"]').click()
    # writer is not idempotent: the console asks, as the CLI does
    await expect(page.locator("#unsafe")).to_contain_text("non-idempotent")
    await page.click('button[name="confirm-replay"]')
    await expect(page.locator("#notice")).to_contain_text("replayed")
    await page.goto(f"{url}messages/{dead}")
    await expect(page.locator("#stage")).to_have_text("SUCCEEDED", timeout=LIVE_S)
    assert await MessageStore(conn).stages([dead]) == [Stage.SUCCEEDED]
    await expect(page.locator("#timeline")).to_contain_text("replayed by console@127.0.0.1")
