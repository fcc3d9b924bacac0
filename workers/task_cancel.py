"""``agent-reach cancel`` of a message its agent is working on, where the agent can be asked
to stop: an A2A agent's task (``CancelTask``).

The broker cannot take a PROCESSING message back from an agent; an A2A agent can be asked to
cancel its task. The request is sent to the agent the record names (the instance's card has
its JSON-RPC URL in its status URL, ``a2a:<version>:<url>``; the record has the task id) and
recorded on the timeline with who asked. The message then ends as the agent's task does: the
sidecar hears the task CANCELED (push, or ``GetTask``) and the message FAILS with the agent's
words — or, if the agent finished first, it ends as the agent says.
"""

from __future__ import annotations

import httpx

from adapters.a2a_rpc import STATUS_SCHEME, a2a_cancel
from broker.connection import Connection
from broker.operator import Action
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.timekeeping import now_ms
from broker.timeline import note_command

CANCEL_ASKED = "CANCEL_ASKED"


async def cancel_agent_task(conn: Connection, message_id: str, *, by: str) -> Action | None:
    """Ask the agent to cancel ``message_id``'s task: the action taken, or ``None`` when the
    message is not PROCESSING on an agent that can be asked."""
    record = await MessageStore(conn).get_record(message_id)
    if record is None or record.stage is not Stage.PROCESSING or not record.agent_task:
        return None
    views = {v.instance_id: v for v in await Registry(conn).snapshot()}
    view = views.get(record.instance)
    if view is None or not view.card.status_url.startswith(STATUS_SCHEME):
        return None
    async with httpx.AsyncClient(timeout=10.0) as client:
        said = await a2a_cancel(client, view.card.status_url, record.agent_task)
    reason = f"cancel asked by {by}: the agent's task {record.agent_task}: {said}"
    await conn.call(*note_command(conn, message_id, CANCEL_ASKED, reason, now_ms=now_ms()))
    return Action(message_id, True, Stage.PROCESSING, f"{message_id}: {reason}")
