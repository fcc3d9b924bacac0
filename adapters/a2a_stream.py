"""An A2A agent whose card offers streaming: ``SendStreamingMessage``, consumed to the end.

The events (server-sent, one JSON-RPC answer per ``data:`` line) are read as they come: a
status update that does not end the task is told to ``on_update`` (the sidecar notes it on
the message's timeline, ``AGENT_UPDATE``); the first state that ends the task (or asks a
question) ends the reading, and the task itself — with its artifacts, which came as separate
events — is read with ``GetTask``. A direct message is the result at once.

A stream that closes before its end, or that outlasts the call's time, is not a failure: the
task goes on at the agent, so the attempt is accepted (its push notification or ``GetTask``
ends it, as for a non-streaming agent); only a stream that never named its task is ambiguous.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from .a2a_wire import (
    PARKED_STATES,
    TERMINAL_STATES,
    RpcError,
    TaskView,
    outcome_of,
    rpc_answer,
    sent_task,
    state_name,
    wrapped,
)
from .outcome import Accepted, Ambiguous, Failed, Outcome
from .sse import sse_data

Update = Callable[[str], Awaitable[None]]


@dataclass
class StreamReading:
    """What the events said so far."""

    task_id: str = ""
    ended: TaskView | None = None  # a direct message, or the task's first event if final
    final_state: str = ""
    failure: str = ""
    updates: list[str] = field(default_factory=list)


def read_event(data: bytes, reading: StreamReading) -> str | None:
    """Read one event into ``reading``; the words of a status update that goes on, if any."""
    result = rpc_answer(data)
    if isinstance(result, RpcError):
        reading.failure = str(result)
        return None
    if not isinstance(result, dict):
        return None
    result = wrapped(result)
    if isinstance(result.get("message"), dict) or isinstance(result.get("task"), dict):
        view = sent_task(result)
        if isinstance(view, TaskView):
            reading.task_id = reading.task_id or view.task_id
            if not view.task_id or view.state in TERMINAL_STATES | PARKED_STATES:
                reading.ended, reading.final_state = view, view.state
        return None
    update = result.get("statusUpdate")
    if isinstance(update, dict):
        reading.task_id = reading.task_id or str(update.get("taskId", ""))
        status = update.get("status")
        status = status if isinstance(status, dict) else {}
        state = state_name(status.get("state"))
        if state in TERMINAL_STATES | PARKED_STATES:
            reading.final_state = state
            return None
        words = _words(status.get("message"))
        return f"{state}: {words}" if words else state
    return None


def _words(message: Any) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        return ""
    texts = [p.get("text") for p in message["parts"] if isinstance(p, dict)]
    return " ".join(t for t in texts if isinstance(t, str))[:500]


async def consume(
    response: httpx.Response, reading: StreamReading, on_update: Update | None, time_s: float
) -> None:
    """Read the events until one ends the task, the stream closes, or ``time_s`` passes."""
    with anyio.move_on_after(time_s):
        async with aclosing(sse_data(response)) as events:  # let go of it on leaving
            async for data in events:
                said = read_event(data, reading)
                if said and on_update is not None and reading.task_id:
                    await on_update(said)
                if reading.failure or reading.final_state:
                    return


def stream_outcome(reading: StreamReading) -> Outcome | str:
    """What the stream settled; a task id to ask ``GetTask`` about (it ended); or accepted."""
    if reading.failure:
        return Failed(reading.failure)
    if reading.ended is not None and not reading.ended.task_id:
        return outcome_of(reading.ended)  # a direct message
    if reading.final_state and reading.task_id:
        return reading.task_id
    if reading.task_id:
        return Accepted(reading.task_id)  # the task goes on: its push or GetTask ends it
    return Ambiguous("the agent's event stream ended before naming its task")
