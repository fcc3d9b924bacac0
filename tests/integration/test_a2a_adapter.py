"""The ``a2a`` adapter (adapters/a2a.py) against agents built with the official ``a2a-sdk``
(tests/support/a2a_agents.py), behind a real sidecar, dispatcher and reaper on real Redis."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from a2a.helpers import (
    get_data_parts,
    new_data_part,
    new_task,
    new_task_from_user_message,
    new_text_message,
    new_text_part,
)
from a2a.server.agent_execution import RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import (
    TaskUpdater,
)
from a2a.types import TaskState
from click.testing import CliRunner

from adapters.a2a import (
    A2A_PATH,
    MAX_NOTED_UPDATES,
    A2ATransport,
    CardError,
    fetch_card,
    status_url,
)
from adapters.a2a_tasks import TOKEN_HEADER
from adapters.callbacks import CallbackTokens
from adapters.factory import SidecarOptionError, a2a_card_parts
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.embedded import free_port
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.a2a_agents import A2AAgent, Executor, a2a_agent
from tests.support.harness import connected, eventually, running_dispatcher, running_sidecar
from tests.support.usage_days import usage_lately
from workers.cli import main

CAPABILITY = "text.echo"


@asynccontextmanager
async def behind_a_sidecar(
    conn: Connection, agent: A2AAgent, *, idempotent: bool = False
) -> AsyncIterator[tuple[Client, Sidecar]]:
    card = await fetch_card(agent.url)
    transport = A2ATransport(card, timeout_s=10.0, max_connections=8)
    async with (
        running_sidecar(
            conn,
            "echo-1",
            (CAPABILITY,),
            transport=transport,
            status_url=status_url(card),
            idempotent=idempotent,
        ) as sidecar,
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        yield client, sidecar


async def stages(conn: Connection, message_id: str) -> list[str]:
    return [str(e.stage) for e in await MessageStore(conn).get_timeline(message_id)]


async def test_a_completed_task_succeeds_with_its_artifacts_and_our_metadata(
    conn: Connection,
) -> None:
    async with a2a_agent() as agent, behind_a_sidecar(conn, agent) as (client, _):
        result = await client.request(CAPABILITY, {"do": "complete", "n": 7}, timeout=20)
        text = await client.request(CAPABILITY, "hello there", timeout=20)

    assert result.ok, result
    (artifact,) = result.result["artifacts"]
    assert artifact["name"] == "result"
    assert artifact["parts"] == [{"data": {"echo": {"do": "complete", "n": 7.0}}}]
    assert text.ok and text.result == {"parts": [{"text": "echo: hello there"}]}
    # messageId from message id and attempt; our idempotency key and attempt in metadata
    assert set(agent.executions) == {f"{result.id}.1", f"{text.id}.1"}
    reach = agent.metadata[0]["reach"]
    assert reach["message_id"] == result.id and reach["idempotency_key"] == result.id
    assert reach["attempt"] == 1


async def test_failed_and_question_tasks_end_as_failed_and_parked(conn: Connection) -> None:
    async with a2a_agent() as agent, behind_a_sidecar(conn, agent) as (client, _):
        failed = await client.request(CAPABILITY, {"do": "fail"}, timeout=20)
        asked = await client.submit_many(
            [Envelope(capability=CAPABILITY, payload=msgspec.Raw(b'{"do":"ask"}'))]
        )

        async def parked() -> bool:
            record = await MessageStore(conn).get_record(asked[0])
            return record is not None and record.stage is Stage.NEEDS_CONFIRMATION

        await eventually(parked, timeout_s=20)
        timeline = await MessageStore(conn).get_timeline(asked[0])

    assert failed.stage is Stage.FAILED
    assert failed.error is not None and "ended failed: something went wrong" in failed.error
    assert "the agent asks (input-required): Which city?" in timeline[-1].reason


async def test_a_slow_task_is_accepted_then_ended_by_its_push_notification(
    conn: Connection,
) -> None:
    await slow_task(conn, push=True)


async def test_a_slow_task_of_an_agent_without_push_is_ended_by_asking_get_task(
    conn: Connection,
) -> None:
    await slow_task(conn, push=False)


async def slow_task(conn: Connection, *, push: bool) -> None:
    async with a2a_agent(push=push) as agent, behind_a_sidecar(conn, agent) as (client, _):
        result = await client.request(CAPABILITY, {"do": "slow", "s": 1.0}, timeout=30)
        record = await MessageStore(conn).get_record(result.id)

    assert result.ok and result.result["artifacts"][0]["parts"][0]["data"]["echo"]["do"] == "slow"
    walked = await stages(conn, result.id)
    assert walked[-3:] == ["PROCESSING", "CALLBACK_RECEIVED", "SUCCEEDED"], walked
    assert record is not None and record.agent_task  # the A2A task id, for the reaper
    assert sum(agent.executions.values()) == 1


async def test_an_agent_that_forgets_a_task_is_asked_by_the_reaper_and_the_message_parked(
    settings: Settings,
) -> None:
    """The agent restarts mid-task (its in-memory tasks gone): the reaper's GetTask finds no
    such task, and a non-idempotent agent's message is parked for an operator."""
    quick = msgspec.structs.replace(settings, callback_timeout_s=2.0)
    port = free_port()
    async with connected(quick) as conn:
        async with a2a_agent(push=False, port=port) as agent:
            card = await fetch_card(agent.url)
            async with (
                running_sidecar(
                    conn,
                    "echo-1",
                    (CAPABILITY,),
                    transport=A2ATransport(card, timeout_s=5.0, max_connections=4),
                    status_url=status_url(card),
                ),
                running_dispatcher(conn),
                Client(conn) as client,
            ):
                envelope = Envelope(
                    capability=CAPABILITY, payload=msgspec.Raw(b'{"do":"slow","s":60}')
                )
                (message_id,) = await client.submit_many([envelope])

                async def accepted() -> bool:
                    record = await MessageStore(conn).get_record(message_id)
                    return record is not None and bool(record.agent_task)

                await eventually(accepted, timeout_s=20)
        async with a2a_agent(push=False, port=port):  # back, knowing nothing
            async with running_dispatcher(conn):

                async def parked() -> bool:
                    record = await MessageStore(conn).get_record(message_id)
                    return record is not None and record.stage is Stage.NEEDS_CONFIRMATION

                await eventually(parked, timeout_s=30)
            timeline = await MessageStore(conn).get_timeline(message_id)
    assert "GetTask: task not found" in timeline[-1].reason, timeline[-1]


async def test_skills_map_to_capabilities_and_a_bad_card_stops_start_up() -> None:
    async with a2a_agent() as agent:
        card = await fetch_card(agent.url)
    assert (card.name, card.version, card.protocol) == ("Echo Agent", "2.1.0", "1.0")
    served, tags = a2a_card_parts(card, ["echo=text.echo"], [])
    assert served == ["text.echo"] and tags["a2a.name"] == "Echo Agent"
    with pytest.raises(SidecarOptionError, match="the card has no such skill"):
        a2a_card_parts(card, ["nope=text.echo"], [])
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CardError, match="cannot read the agent card"):
        await fetch_card(closed)
    result = await anyio.to_thread.run_sync(
        lambda: CliRunner().invoke(
            main,
            [
                *("sidecar", "--redis", "redis://127.0.0.1:1", "--agent-id", "echo"),
                *("--adapter", "a2a", "--url", closed),
            ],
        )
    )
    assert result.exit_code == 1 and "cannot read the agent card" in result.output


async def test_cancel_of_a_processing_message_asks_the_agent_to_cancel_its_task(
    conn: Connection,
) -> None:
    async with a2a_agent() as agent, behind_a_sidecar(conn, agent) as (client, _):
        reply_to = client.new_reply_stream()
        slow = msgspec.Raw(b'{"do":"slow","s":60}')
        (message_id,) = await client.submit_many(
            [Envelope(capability=CAPABILITY, payload=slow, reply_to=reply_to)]
        )

        async def accepted() -> bool:
            record = await MessageStore(conn).get_record(message_id)
            return record is not None and bool(record.agent_task)

        await eventually(accepted, timeout_s=20)
        url = conn.settings.redis_url
        assert url is not None
        said = await anyio.to_thread.run_sync(
            lambda: CliRunner().invoke(
                main,
                ["cancel", message_id, "--redis", url, "--prefix", conn.keys.prefix, "--by", "ops"],
            )
        )
        result = await client.wait_reply(reply_to, message_id, timeout_s=20)

    assert said.exit_code == 0, said.output
    assert result is not None
    assert "cancel asked by ops" in said.output and "task now canceled" in said.output
    assert result.stage is Stage.FAILED
    assert result.error is not None and "ended canceled: cancelled by request" in result.error
    assert "CANCEL_ASKED" in await stages(conn, message_id)


async def test_a_streaming_agent_is_read_to_its_end_with_its_updates_noted(
    conn: Connection,
) -> None:
    async with (
        a2a_agent(push=False, streaming=True) as agent,
        behind_a_sidecar(conn, agent) as (client, sidecar),
    ):
        result = await client.request(CAPABILITY, {"do": "slow", "s": 1.0}, timeout=30)
        quick = await client.request(CAPABILITY, {"do": "complete"}, timeout=30)
        failed = await client.request(CAPABILITY, {"do": "fail"}, timeout=30)
    timeline = await MessageStore(conn).get_timeline(result.id)

    assert result.ok and result.result["artifacts"][0]["parts"][0]["data"]["echo"]["do"] == "slow"
    notes = [e.reason for e in timeline if e.stage == "AGENT_UPDATE"]
    assert notes == ["working: step 1 of 2", "working: step 2 of 2"], notes
    assert [str(e.stage) for e in timeline][-1] == "SUCCEEDED"  # no callback: the stream ended it
    assert quick.ok and failed.stage is Stage.FAILED
    assert sidecar.a2a_tasks is not None and sidecar.a2a_tasks.ended_by == {"push": 0, "asking": 0}


async def test_a_stream_of_many_updates_notes_a_bounded_number(conn: Connection) -> None:
    """Each status update a streaming agent sends was a write to Redis, however many it
    sent. The first MAX_NOTED_UPDATES are noted, then one note says the rest were not."""
    steps = MAX_NOTED_UPDATES + 150
    async with (
        a2a_agent(push=False, streaming=True) as agent,
        behind_a_sidecar(conn, agent) as (client, _),
    ):
        result = await client.request(
            CAPABILITY, {"do": "slow", "s": 0.5, "steps": steps}, timeout=30
        )
    timeline = await MessageStore(conn).get_timeline(result.id)

    assert result.ok
    notes = [e.reason for e in timeline if e.stage == "AGENT_UPDATE"]
    assert len(notes) == MAX_NOTED_UPDATES + 1, len(notes)
    assert notes[0] == f"working: step 1 of {steps}"
    assert notes[-1] == f"more status updates: not noted past {MAX_NOTED_UPDATES}"


async def test_an_agent_with_a_0_3_card_is_spoken_to_in_0_3(conn: Connection) -> None:
    async with (
        a2a_agent(protocol="0.3") as agent,
        behind_a_sidecar(conn, agent) as (client, _),
    ):
        card = await fetch_card(agent.url)
        done = await client.request(CAPABILITY, {"do": "complete", "n": 1}, timeout=20)
        failed = await client.request(CAPABILITY, {"do": "fail"}, timeout=20)

    assert card.protocol == "0.3"
    assert done.ok and done.result["artifacts"][0]["parts"] == [
        {"data": {"echo": {"do": "complete", "n": 1.0}}}
    ]
    assert failed.stage is Stage.FAILED and "something went wrong" in (failed.error or "")


async def test_an_agent_that_prefers_http_json_is_reached_over_it(conn: Connection) -> None:
    async with (
        a2a_agent(protocol="rest", push=False) as agent,
        behind_a_sidecar(conn, agent) as (client, _),
    ):
        card = await fetch_card(agent.url)
        done = await client.request(CAPABILITY, {"do": "complete", "n": 2}, timeout=20)
        slow = await client.request(CAPABILITY, {"do": "slow", "s": 0.5}, timeout=20)
        failed = await client.request(CAPABILITY, {"do": "fail"}, timeout=20)

    assert card.protocol == "1.0+http"
    assert done.ok and done.result["artifacts"][0]["parts"] == [
        {"data": {"echo": {"do": "complete", "n": 2.0}}}
    ]
    assert slow.ok  # accepted, then ended by GetTask over the same binding
    assert failed.stage is Stage.FAILED and "something went wrong" in (failed.error or "")


# -- usage reported in the metadata of a task or a message ------------------------------------


class BillingExecutor(Executor):
    """The support agent's executor, and for an order with a ``bill`` (``{"do": "complete" |
    "slow" | "fail" | "message", "bill": {...}}``) what the run used, in the ``metadata.usage``
    of the task it ends (on its last status update, which the SDK merges into the task's
    metadata) or of the direct message it answers."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None
        data = get_data_parts(list(message.parts))
        order: dict[str, Any] = data[0] if data and isinstance(data[0], dict) else {}
        if "bill" not in order:
            await super().execute(context, event_queue)
            return
        self.agent.executions[message.message_id] += 1
        used = {"usage": order["bill"]}
        what = order.get("do")
        if what == "message":
            answer = new_text_message("billed")
            answer.metadata.update(used)
            await event_queue.enqueue_event(answer)
            return
        if what == "slow":
            assert context.task_id is not None and context.context_id is not None
            working = TaskState.TASK_STATE_WORKING
            task = new_task(context.task_id, context.context_id, working, history=[message])
        else:
            task = new_task_from_user_message(message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if what == "fail":
            said = updater.new_agent_message([new_text_part("over budget")])
            await updater.update_status(TaskState.TASK_STATE_FAILED, said, metadata=used)
            return
        if what == "slow":
            await anyio.sleep(float(order.get("s", 0.5)))  # the agent's own work time
        await updater.add_artifact([new_data_part({"echo": order})], name="result")
        await updater.update_status(TaskState.TASK_STATE_COMPLETED, metadata=used)


@asynccontextmanager
async def billing_agent(*, push: bool = True, streaming: bool = False) -> AsyncIterator[A2AAgent]:
    """:func:`tests.support.a2a_agents.a2a_agent` with the :class:`BillingExecutor`."""
    async with a2a_agent(push=push, streaming=streaming, executor=BillingExecutor) as agent:
        yield agent


def bill(input_tokens: int, output_tokens: int, cost: float) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cost": cost}


def described(used: dict[str, Any]) -> str:
    """How the timeline says what an attempt used (broker.usage.Usage.describe)."""
    return f"usage in={used['input_tokens']} out={used['output_tokens']} cost={used['cost']:g}"


async def usage_on_record(conn: Connection, message_id: str, attempt: int = 1) -> Any:
    stored = await conn.call("HGET", conn.keys.record(message_id), f"usage:{attempt}")
    return None if stored is None else json.loads(stored)


async def todays(conn: Connection, by: str) -> dict[str, dict[str, Any]]:
    return {row.name: row.as_json() for row in await usage_lately(conn, by)}


async def test_usage_in_a_tasks_or_messages_metadata_is_recorded_and_charged(
    conn: Connection,
) -> None:
    """Tasks that complete (at once, or after working a while) or fail, and a direct message,
    each report usage in their metadata: it is on the record and the timeline of the ending,
    and charged to the agent, the capability and the tenant; a call that reports nothing is
    charged a request and no usage. (Sent non-blocking, the SDK answers even a quick task as
    submitted: tasks end on the callback desk, by push notification or GetTask; the direct
    message is the answer to the send itself.)"""
    bills = {
        "complete": bill(100, 10, 0.5),
        "message": bill(20, 2, 0.25),
        "slow": bill(3000, 300, 2.0),
        "fail": bill(7, 1, 0.125),
    }
    async with billing_agent(push=True) as agent, behind_a_sidecar(conn, agent) as (client, _):
        results = {
            what: await client.request(
                CAPABILITY, {"do": what, "bill": used, "s": 0.2}, tenant="team-a", timeout=20
            )
            for what, used in bills.items()
        }
        plain = await client.request(CAPABILITY, {"do": "complete"}, timeout=20)

    assert [results[w].stage for w in bills] == [Stage.SUCCEEDED] * 3 + [Stage.FAILED]
    assert "ended failed: over budget" in (results["fail"].error or "")
    assert results["message"].result == {"parts": [{"text": "billed"}]}
    assert plain.ok
    ending = {"complete": "SUCCEEDED", "message": "SUCCEEDED", "slow": "SUCCEEDED"}
    for what, used in bills.items():
        message_id = results[what].id
        assert await usage_on_record(conn, message_id) == used, what
        timeline = await MessageStore(conn).get_timeline(message_id)
        last = timeline[-1]
        assert str(last.stage) == ending.get(what, "FAILED"), (what, timeline)
        assert described(used) in last.reason, (what, last)
        assert sum(described(used) in e.reason for e in timeline) == 1, timeline  # once
    # the slow task was accepted, then ended on the callback desk; the message at once
    assert "CALLBACK_RECEIVED" in await stages(conn, results["slow"].id)
    assert "CALLBACK_RECEIVED" not in await stages(conn, results["message"].id)
    assert await usage_on_record(conn, plain.id) is None
    assert not any("usage in=" in e.reason for e in await MessageStore(conn).get_timeline(plain.id))

    expected = {
        "requests": 5,
        "succeeded": 4,
        "failed": 1,
        "retried": 0,
        "reported": 4,
        "input_tokens": 3127,
        "output_tokens": 313,
        "cost": 2.875,
    }
    by_agent, by_capability = await todays(conn, "agent"), await todays(conn, "capability")
    assert set(by_agent) == {"echo"} and set(by_capability) == {CAPABILITY}
    for row in (by_agent["echo"], by_capability[CAPABILITY]):
        assert {name: row[name] for name in expected} == expected, row
    by_tenant = await todays(conn, "tenant")
    assert by_tenant["team-a"]["cost"] == 2.875 and by_tenant["team-a"]["requests"] == 4
    assert by_tenant["-"]["reported"] == 0 and by_tenant["-"]["requests"] == 1


async def test_usage_in_the_metadata_of_a_streamed_task_is_charged(conn: Connection) -> None:
    """A streaming agent: the task read to its end (then its artifacts asked with
    ``GetTask``), and a direct message on the stream, charged with what their metadata
    says."""
    slow, said = bill(40, 4, 0.75), bill(5, 50, 0.0625)
    async with (
        billing_agent(push=False, streaming=True) as agent,
        behind_a_sidecar(conn, agent) as (client, _),
    ):
        streamed = await client.request(
            CAPABILITY, {"do": "slow", "s": 0.2, "bill": slow}, timeout=20
        )
        message = await client.request(CAPABILITY, {"do": "message", "bill": said}, timeout=20)

    assert streamed.ok and message.ok
    assert await usage_on_record(conn, streamed.id) == slow
    assert await usage_on_record(conn, message.id) == said
    timeline = await MessageStore(conn).get_timeline(streamed.id)
    assert str(timeline[-1].stage) == "SUCCEEDED" and described(slow) in timeline[-1].reason
    assert "CALLBACK_RECEIVED" not in [str(e.stage) for e in timeline]  # the stream ended it
    [row] = (await todays(conn, "capability")).values()
    assert (row["requests"], row["succeeded"], row["reported"]) == (2, 2, 2)
    assert (row["input_tokens"], row["output_tokens"], row["cost"]) == (45, 54, 0.8125)


async def test_a_push_naming_another_task_does_not_end_the_message(conn: Connection) -> None:
    """A push notification's token proves who sends it, not which task it speaks of: one
    for message A naming message B's completed task ended A with B's result. It is 409 now,
    and A ends with its own."""
    async with (
        a2a_agent(push=True) as agent,
        behind_a_sidecar(conn, agent) as (client, sidecar),
        httpx.AsyncClient() as http,
    ):
        reply_to = client.new_reply_stream()
        payload = msgspec.Raw(b'{"do":"slow","s":3.0,"n":1}')
        first = await client.submit(
            Envelope(capability=CAPABILITY, payload=payload, reply_to=reply_to)
        )
        second = await client.request(CAPABILITY, {"do": "slow", "s": 0.2, "n": 2}, timeout=20)
        store = MessageStore(conn)

        async def awaited() -> bool:
            record = await store.get_record(first)
            return record is not None and bool(record.agent_task)

        await eventually(awaited)
        other = await store.get_record(second.id)
        assert other is not None and other.agent_task and second.ok
        tokens = CallbackTokens(await conn.call("GET", conn.keys.callback_key("echo-1")))
        forged = await http.post(
            f"{sidecar.callback_url}{A2A_PATH}{first}",
            json={"task": {"id": other.agent_task, "status": {"state": "TASK_STATE_COMPLETED"}}},
            headers={TOKEN_HEADER: tokens.token(first, 1)},
        )
        assert forged.status_code == 409, forged.text
        assert "is not the message's current task" in forged.json()["error"]
        ended = await client.wait_reply(reply_to, first, timeout_s=20)

    assert ended is not None and ended.ok
    assert ended.result["artifacts"][0]["parts"][0]["data"]["echo"]["n"] == 1
