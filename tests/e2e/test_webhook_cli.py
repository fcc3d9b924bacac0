"""Webhooks through the command line: ``agent-reach up`` runs the notifier, configured from
the environment, and ``agent-reach send --callback-url`` asks for one; a receiver verifies the
delivery with the README's snippet (the ``standardwebhooks`` library)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio

from broker.config import Settings
from broker.connection import Connection
from broker.store import MessageStore
from broker.timeline import CALLBACK_DELIVERED
from tests.support.agents import http_agent
from tests.support.harness import eventually, running_sidecar
from tests.support.processes import AGENT_REACH, process_env, start, stop
from tests.support.webhooks import README_VERIFY, SECRET, Receiver, serving, signature_ok

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_shows_the_verification_the_tests_run() -> None:
    assert f"```python\n{README_VERIFY}```" in README.read_text(encoding="utf-8")


async def test_a_whsec_secret_that_is_not_base64_stops_the_notifier_at_start(
    settings: Settings,
) -> None:
    env = process_env(settings, AGENT_REACH_WEBHOOK_SECRET="whsec_not*base64")

    with anyio.fail_after(30):
        done = await anyio.run_process([AGENT_REACH, "notifier"], env=env, check=False)

    assert done.returncode == 2
    stderr = done.stderr.decode()
    assert "config key 'webhook_secret': a whsec_ secret must be base64" in stderr
    assert "not*base64" not in stderr


async def test_send_callback_url_is_delivered_signed_by_up(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    receiver = Receiver()
    env = process_env(
        settings,
        AGENT_REACH_WEBHOOK_SECRET=SECRET,
        AGENT_REACH_CALLBACK_HOSTS="127.0.0.1",
    )
    async with (
        serving(receiver) as hook,
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
    ):
        broker = start(["up"], env, tmp_path / "up.log")
        try:
            argv = ["send", "text.echo", "--payload", '{"x": 7}', "--callback-url"]
            done = await anyio.run_process([AGENT_REACH, *argv, hook], env=env, check=False)
            assert done.returncode == 0, done.stderr
            message_id = done.stdout.decode().strip()

            async def delivered() -> bool:
                return bool(receiver.accepted)

            await eventually(delivered, timeout_s=30)
            elsewhere = [*argv, "http://elsewhere.example/hook", "--wait"]
            refused = await anyio.run_process([AGENT_REACH, *elsewhere], env=env, check=False)
        finally:
            assert stop(broker) == 0

    (hit,) = receiver.accepted
    assert hit.headers["x-reach-message-id"] == message_id
    assert hit.headers["webhook-id"] == f"{message_id}.1"
    assert signature_ok(hit)
    assert json.loads(hit.body) == {
        "id": message_id,
        "stage": "SUCCEEDED",
        "attempt": 1,
        "result": {"agent": "a", "echo": {"x": 7}},
    }
    timeline = await MessageStore(conn).get_timeline(message_id)
    assert timeline[-1].stage == CALLBACK_DELIVERED
    assert "notifying from" in (tmp_path / "up.log").read_text()
    assert refused.returncode == 1
    rejected = json.loads(refused.stdout)
    assert rejected["stage"] == "REJECTED"
    assert "host 'elsewhere.example' is not allowed" in rejected["error"]
