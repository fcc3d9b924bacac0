"""An A2A agent's long tasks: ended by its push notifications, or by asking ``GetTask``.

A task the agent left SUBMITTED or WORKING is awaited as an ``http-async`` agent's callback is
(PROCESSING, its credit held, the task id on the record as ``agent_task``). It ends one of
two ways, both recorded through the callback desk (CALLBACK_RECEIVED, then SUCCEEDED /
FAILED; a question — INPUT_REQUIRED, AUTH_REQUIRED — parks the message for an operator):

- a push notification at ``POST <callback base>/a2a/<message id>`` whose
  ``X-A2A-Notification-Token`` is the callback token handed out with the request (checked
  before the body is read, as callbacks are). Its body (a task, or a status update, in the
  A2A 1.0 JSON) says only that the task changed: the task itself, with its artifacts, is
  read with ``GetTask`` — when it is the task the record names (another is 409). A
  notification that does not end the task is answered 200 and noted nowhere;
- asking ``GetTask`` for every awaited task, at every sweep for an agent without push
  notifications, with a back-off per task from 0.2 s up to 5 s — and, as a safety net for a
  lost notification, every 30 s for one with them.
"""

from __future__ import annotations

import logging

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from broker.envelope import load_envelope
from broker.errors import RedisReplyError, RedisUnavailable
from broker.stages import Stage
from broker.timekeeping import now_ms
from broker.timeline import note_command

from .a2a import A2A_PATH, A2ATransport
from .a2a_wire import PARKED_STATES, TERMINAL_STATES, RpcError, TaskView, outcome_of, push_state
from .callback_desk import CallbackDesk
from .callbacks import Answer, read_body
from .outcome import Failed, NeedsInput, Succeeded, held_to_depth

log = logging.getLogger("agent_reach.sidecar")

TOKEN_HEADER = "X-A2A-Notification-Token"
AGENT_UPDATE = "AGENT_UPDATE"  # the timeline event of a streaming agent's status update
FIRST_ASK_S = 0.2
LAST_ASK_S = 5.0
SAFETY_NET_S = 30.0  # with push notifications: a lost one costs at most this


class A2ATasks:
    def __init__(self, desk: CallbackDesk, transport: A2ATransport) -> None:
        self.desk = desk
        self.transport = transport
        self._next_ask: dict[str, tuple[float, float]] = {}  # message id -> (when, gap)
        self.ended_by = {"push": 0, "asking": 0}  # tasks ended, by how the sidecar learnt it
        transport.on_update = self.note

    async def note(self, message_id: str, words: str) -> None:
        """A streaming agent's status update on the way: a note on the message's timeline."""
        command = note_command(self.desk.conn, message_id, AGENT_UPDATE, words, now_ms=now_ms())
        try:
            await self.desk.conn.call(*command)
        except (RedisUnavailable, RedisReplyError) as exc:  # a note: the work goes on
            log.warning("message %s: update not noted: %s", message_id, exc)

    def routes(self) -> list[Route]:
        return [Route(A2A_PATH + "{message_id}", self.push, methods=["POST"])]

    async def push(self, request: Request) -> Response:
        """A push notification: the token first, then the body, then ``GetTask``."""
        message_id = request.path_params["message_id"]
        token = request.headers.get(TOKEN_HEADER)
        if not token:
            return _json(Answer(401, {"error": f"missing {TOKEN_HEADER} header"}))
        refused = await self.desk.authorize(message_id, token)
        if refused is not None:
            return _json(refused)
        settings = self.desk.conn.settings
        body: bytes | Answer = Answer(408, {"error": "the body did not arrive in time"})
        with anyio.move_on_after(settings.callback_body_timeout_s):
            body = await read_body(request, settings.max_callback_bytes)
        if isinstance(body, Answer):
            return _json(body)
        said = push_state(body)
        if isinstance(said, str):
            return _json(Answer(400, {"error": said}))
        task_id, state = said
        if state not in TERMINAL_STATES | PARKED_STATES:
            return _json(Answer(200, {"id": message_id, "state": state}))
        if not await self._is_current_task(message_id, task_id):
            # another task's outcome (an earlier attempt's, another message's) is not this
            # message's: the token proves who sends, not which task it speaks of
            error = f"task {task_id[:200]!r} is not the message's current task"
            return _json(Answer(409, {"error": error}))
        view = await self.transport.task(task_id)
        if not isinstance(view, TaskView):
            return _json(Answer(502, {"error": f"GetTask {task_id}: {view}"}))
        self.ended_by["push"] += 1
        return _json(await self._ended(message_id, token, view))

    async def _is_current_task(self, message_id: str, task_id: str) -> bool:
        """Whether ``task_id`` is the task the message's record names (``agent_task``); a
        record that names none yet (the agent's answer still on its way) takes any."""
        keys = self.desk.conn.keys
        recorded = await self.desk.conn.call("HGET", keys.record(message_id), "agent_task")
        return not recorded or recorded == task_id.encode()

    async def ask_loop(self) -> None:
        """Ask ``GetTask`` for the awaited tasks that are due, at every sweep."""
        while True:
            await anyio.sleep(self.desk.conn.settings.sweep_interval_s)
            try:
                await self.ask_due()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("A2A task check failed (the next one retries): %s", exc)

    async def ask_due(self) -> None:
        now = anyio.current_time()
        awaited = [m for m in self.desk.awaiting if m not in self.desk.finishing]
        for gone in set(self._next_ask) - set(awaited):
            del self._next_ask[gone]
        due = [m for m in awaited if self._next_ask.get(m, (0.0, 0.0))[0] <= now]
        if not due:
            return
        keys = self.desk.conn.keys
        fields = await self.desk.conn.call_many(
            [("HMGET", keys.record(m), "agent_task", "attempt") for m in due]
        )
        for message_id, got in zip(due, fields, strict=True):
            self._later(message_id, now)
            if isinstance(got, Exception) or not got[0] or not got[1]:
                continue
            task_id, attempt = got[0].decode(), int(got[1])
            view = await self.transport.task(task_id)
            if isinstance(view, TaskView) and view.state in TERMINAL_STATES | PARKED_STATES:
                assert self.desk.tokens is not None
                self.ended_by["asking"] += 1
                await self._ended(message_id, self.desk.tokens.token(message_id, attempt), view)
            elif isinstance(view, RpcError):
                log.warning("message %s: GetTask %s: %s", message_id, task_id, view)

    def _later(self, message_id: str, now: float) -> None:
        _, gap = self._next_ask.get(message_id, (0.0, 0.0))
        if self.transport.pushes:  # asking is only the safety net
            gap = SAFETY_NET_S
        else:
            gap = min(LAST_ASK_S, gap * 2 if gap else FIRST_ASK_S)
        self._next_ask[message_id] = (now + gap, gap)

    async def _ended(self, message_id: str, token: str, view: TaskView) -> Answer:
        """The task ended (or asks a question): recorded as a callback is, or parked."""
        outcome = held_to_depth(outcome_of(view))  # as a call's or a callback's result
        if isinstance(outcome, Succeeded | Failed):
            return await self.desk.on_callback(message_id, token, outcome)
        if isinstance(outcome, NeedsInput):
            return await self._park(message_id, token, view.task_id, outcome.reason)
        return Answer(200, {"id": message_id, "state": view.state})

    async def _park(self, message_id: str, token: str, task_id: str, reason: str) -> Answer:
        """Park the attempt the token was made for, when it is the one held here and the
        question is its own task's (a retried attempt's old task may still ask)."""
        taken = self.desk.holdings.holding(message_id)
        record = await self.desk.store.get_record(message_id)
        if taken is None or record is None or record.stage is not Stage.PROCESSING:
            return Answer(409, {"error": "not awaited here"})
        assert self.desk.tokens is not None
        attempt = self.desk.tokens.attempt_of(token, message_id, record.attempt)
        current = attempt == taken.attempt == record.attempt
        if not current or (record.agent_task and record.agent_task != task_id):
            return Answer(409, {"error": "that task is no longer the message's current one"})
        self.desk.awaiting.pop(message_id, None)
        envelope = load_envelope(record.envelope)
        self.desk.finisher.settle(taken, envelope, Stage.NEEDS_CONFIRMATION, reason)
        return Answer(200, {"id": message_id, "stage": Stage.NEEDS_CONFIRMATION.value})


def _json(answer: Answer) -> Response:
    return JSONResponse(answer.body, status_code=answer.status)
