"""A2A agents built with the official ``a2a-sdk`` (its Starlette JSON-RPC server), served on
loopback for the adapter's tests. The executor does what the message's data part says:

- ``{"do": "complete", ...}``: a COMPLETED task, the data echoed in a ``result`` artifact;
- ``{"do": "fail"}``: FAILED with "something went wrong";
- ``{"do": "ask"}``: INPUT_REQUIRED, asking "Which city?";
- ``{"do": "slow", "s": 0.5}``: WORKING at once, COMPLETED after ``s`` seconds (with
  ``"steps": n`` status updates on the way, 2 by default);
- ``{"do": "message"}``: a direct message, no task.

A text part is echoed as a direct message. Every execution is counted by message id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from a2a.helpers import (
    get_data_parts,
    new_data_part,
    new_task,
    new_task_from_user_message,
    new_text_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import (
    create_agent_card_routes,
    create_jsonrpc_routes,
    create_rest_routes,
)
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
    TaskUpdater,
)
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TaskState
from starlette.applications import Starlette

from adapters.asgi import serve_app
from broker.embedded import free_port


@dataclass
class A2AAgent:
    url: str
    executions: Counter[str] = field(default_factory=Counter)  # A2A messageId -> runs
    metadata: list[dict[str, Any]] = field(default_factory=list)


class Executor(AgentExecutor):
    def __init__(self, agent: A2AAgent) -> None:
        self.agent = agent

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None
        self.agent.executions[message.message_id] += 1
        self.agent.metadata.append(dict(message.metadata.items()) if message.metadata else {})
        data = get_data_parts(list(message.parts))
        order: dict[str, Any] = data[0] if data and isinstance(data[0], dict) else {}
        what = order.get("do")
        if what is None or what == "message":
            said = context.get_user_input() or str(order)
            await event_queue.enqueue_event(new_text_message(f"echo: {said}"))
            return
        working = TaskState.TASK_STATE_WORKING if what == "slow" else None
        task = (
            new_task(context.task_id, context.context_id, working, history=[message])
            if working
            else new_task_from_user_message(message)
        )
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if what == "fail":
            await updater.failed(updater.new_agent_message([new_text_part("something went wrong")]))
        elif what == "ask":
            await updater.requires_input(updater.new_agent_message([new_text_part("Which city?")]))
        else:
            if what == "slow":
                steps = int(order.get("steps", 2))
                for step in range(steps):  # progress a streaming client sees
                    await anyio.sleep(float(order.get("s", 0.5)) / steps)
                    words = f"step {step + 1} of {steps}"
                    said = updater.new_agent_message([new_text_part(words)])
                    await updater.update_status(TaskState.TASK_STATE_WORKING, said)
            await updater.add_artifact([new_data_part({"echo": order})], name="result")
            await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.cancel(updater.new_agent_message([new_text_part("cancelled by request")]))


def agent_card(
    base_url: str, *, push: bool, streaming: bool = False, protocol: str = "1.0"
) -> AgentCard:
    return AgentCard(
        name="Echo Agent",
        description="Echoes what it is given, slowly when asked",
        version="2.1.0",
        supported_interfaces=[
            AgentInterface(
                url=base_url,
                protocol_binding="HTTP+JSON" if protocol == "rest" else "JSONRPC",
                protocol_version="1.0" if protocol == "rest" else protocol,
            )
        ],
        capabilities=AgentCapabilities(streaming=streaming, push_notifications=push),
        default_input_modes=["application/json", "text/plain"],
        default_output_modes=["application/json"],
        skills=[
            AgentSkill(id="echo", name="Echo", description="Echoes data", tags=["echo"]),
            AgentSkill(id="other", name="Other", description="Not served", tags=["x"]),
        ],
    )


@asynccontextmanager
async def a2a_agent(
    *,
    push: bool = True,
    port: int = 0,
    streaming: bool = False,
    protocol: str = "1.0",
    executor: Callable[[A2AAgent], AgentExecutor] | None = None,
) -> AsyncIterator[A2AAgent]:
    """An SDK-built A2A agent on loopback for the block's life (``port``: the same one again,
    to restart an agent that forgot its tasks; ``protocol`` "0.3": a card and an endpoint of
    that version; "rest": protocol 1.0 over the HTTP+JSON binding only; ``executor``: what
    runs its tasks, :class:`Executor` by default)."""
    port = port or free_port()
    base = f"http://127.0.0.1:{port}/"
    agent = A2AAgent(base)
    card = agent_card(base, push=push, streaming=streaming, protocol=protocol)
    store = InMemoryPushNotificationConfigStore()
    async with httpx.AsyncClient() as pusher:
        handler = DefaultRequestHandler(
            agent_executor=(executor or Executor)(agent),
            task_store=InMemoryTaskStore(),
            agent_card=card,
            push_config_store=store if push else None,
            push_sender=BasePushNotificationSender(pusher, store) if push else None,
        )
        compat = protocol == "0.3"  # the SDK serves 0.3 clients when asked to
        rpc = (
            create_rest_routes(handler)
            if protocol == "rest"
            else create_jsonrpc_routes(handler, rpc_url="/", enable_v0_3_compat=compat)
        )
        routes = [*create_agent_card_routes(card), *rpc]
        async with serve_app(Starlette(routes=routes), "127.0.0.1", port):
            yield agent
