"""The callback desk of a sidecar whose agent answers later (``http-async``).

It serves the callback endpoint (:mod:`adapters.callbacks`: tokens, size, depth, time), keeps
the messages awaited (the agent answered 202: PROCESSING, credit held) and those a callback
is finishing. A callback is checked against its token — before its body is read — and the
record, written as CALLBACK_RECEIVED *before* it is answered (write-ahead), then finished by
the finisher: SUCCEEDED / FAILED, the producer told, the credit returned. A watch lets go of
what was awaited in vain (the reaper or an operator settled it) and finishes a recorded
callback whose finishing was lost.
"""

from __future__ import annotations

import logging
import secrets
import time

import anyio
import msgspec
from anyio.abc import TaskStatus
from starlette.routing import Route

from broker import failpoints
from broker.connection import Connection
from broker.due_clock import due_at_most_command
from broker.envelope import Envelope, load_envelope
from broker.errors import RedisReplyError, RedisUnavailable
from broker.records import MessageRecord
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore, Move
from broker.timekeeping import now_ms
from broker.usage import Charge, charge, charged, stored_usage, usage_in_result

from .asgi import serve_app
from .callbacks import Answer, CallbackTokens, callback_app
from .finisher import Finisher
from .holdings import Finished, Holdings, Taken
from .outcome import Failed, Succeeded
from .vitals import Vitals

log = logging.getLogger("agent_reach.sidecar")

Bind = tuple[str, int, str | None]  # host, port, public URL


class CallbackDesk:
    def __init__(
        self,
        conn: Connection,
        store: MessageStore,
        instance_id: str,
        *,
        holdings: Holdings,
        finisher: Finisher,
        vitals: Vitals,
        bind: Bind,
        agent_id: str = "",
    ) -> None:
        self.conn = conn
        self.store = store
        self.instance_id = instance_id
        self.holdings = holdings
        self.finisher = finisher
        self.vitals = vitals
        self.bind = bind
        self.agent_id = agent_id
        self.tokens: CallbackTokens | None = None
        self.url = ""
        self.awaiting: dict[str, float] = {}  # message id -> since (time.perf_counter)
        self.finishing: set[str] = set()  # message ids a callback is finishing
        self.routes: list[Route] = []  # more endpoints (adapters.a2a_tasks: push notifications)
        finisher.on_let_go.append(self._let_go)

    @property
    def busy(self) -> bool:
        """Callbacks still to come in, or being finished."""
        return bool(self.awaiting or self.finishing)

    def _let_go(self, taken: Taken) -> None:
        self.finishing.discard(taken.message_id)

    # -- the endpoint ----------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[str]) -> None:
        """The callback endpoint, on an ASGI server, for as long as the sidecar runs; starts
        with the URL agents call back at."""
        key = self.conn.keys.callback_key(self.instance_id)
        await self.conn.call("SET", key, secrets.token_hex(32), "NX")
        self.tokens = CallbackTokens(await self.conn.call("GET", key))
        host, port, public_url = self.bind
        settings = self.conn.settings
        app = callback_app(
            self.authorize,
            self.on_callback,
            max_bytes=settings.max_callback_bytes,
            body_timeout_s=settings.callback_body_timeout_s,
            more=self.routes,
        )
        async with serve_app(
            app,
            host,
            port,
            header_timeout_s=settings.callback_header_timeout_s,
            max_connections=settings.callback_max_connections,
        ) as url:
            self.url = (public_url or url).rstrip("/")
            log.info("instance %s takes callbacks at %s", self.instance_id, self.url)
            task_status.started(self.url)
            await anyio.sleep_forever()

    async def authorize(self, message_id: str, token: str) -> Answer | None:
        """The token's check, before a body is read: a token made here for this id (a bare
        hex one of an earlier version is checked against the record's attempts)."""
        assert self.tokens is not None
        latest = 0
        if "." not in token:  # bare hex: which attempts it may be for, the record says
            record = await self.store.get_record(message_id)
            latest = record.attempt if record is not None else 0
        if self.tokens.attempt_of(token, message_id, latest) is None:
            return Answer(401, {"error": "callback token does not match"})
        return None

    async def on_callback(self, message_id: str, token: str, outcome: Succeeded | Failed) -> Answer:
        """An agent's callback: checked against the token and the record, then recorded
        (CALLBACK_RECEIVED, write-ahead) before it is answered; the outcome follows."""
        record = await self.store.get_record(message_id)
        checked = self._check(message_id, token, record)
        if isinstance(checked, Answer):
            return checked
        assert record is not None
        refused = await self._write(record, checked, outcome)
        if refused is not None:
            return refused
        failpoints.hit("sidecar.after_callback_recorded")
        since = self.awaiting.pop(message_id, None)
        latency_ms = 0.0
        if since is not None:
            latency_ms = (time.perf_counter() - since) * 1000
            self.vitals.record(outcome, latency_ms=latency_ms, now_ms=now_ms())
        envelope = load_envelope(record.envelope)
        taken = self.holdings.holding(message_id)
        if taken is not None and taken.attempt == checked:
            self.finish(taken, envelope, outcome, busy_ms=latency_ms)
        else:  # parked for an operator, its entry long released: settle it here
            await self._settle_unheld(envelope, checked, outcome)
        return Answer(200, {"id": message_id, "stage": Stage.CALLBACK_RECEIVED.value})

    def _check(self, message_id: str, token: str, record: MessageRecord | None) -> Answer | int:
        """The attempt a callback settles, or the answer that refuses it. The token comes
        first: without a good one, an unknown id and a known one get the same 401."""
        assert self.tokens is not None
        latest = record.attempt if record is not None else 0
        attempt = self.tokens.attempt_of(token, message_id, latest)
        if attempt is None:
            return Answer(401, {"error": "callback token does not match"})
        if record is None or record.attempt < 1:
            return Answer(404, {"error": f"unknown message {message_id}"})
        if record.stage in TERMINAL or record.stage is Stage.CALLBACK_RECEIVED:
            return _duplicate(message_id, record.stage)
        if attempt != record.attempt or record.instance != self.instance_id:
            why = f"attempt {attempt} is no longer current (now {record.attempt})"
            return Answer(409, {"error": why, "stage": record.stage.value})
        if record.stage not in (Stage.PROCESSING, Stage.NEEDS_CONFIRMATION):
            why = f"message is {record.stage.value}, not awaiting a result"
            return Answer(409, {"error": why, "stage": record.stage.value})
        return attempt

    async def _write(
        self, record: MessageRecord, attempt: int, outcome: Succeeded | Failed
    ) -> Answer | None:
        """CALLBACK_RECEIVED with the result on the record, and the usage the agent reported
        beside it (what finishes it after a restart charges that too: :func:`callback_outcome`);
        an answer when a race lost it."""
        late = now_ms() - record.updated_ms
        fields: dict[str, str | bytes] = (
            {"result": outcome.result}
            if isinstance(outcome, Succeeded)
            else {"error": outcome.reason}
        )
        if outcome.usage is not None:
            fields[f"usage:{attempt}"] = msgspec.json.encode(outcome.usage)
        moved = await self.store.apply(
            Move(
                record.id,
                Stage.CALLBACK_RECEIVED,
                expect_attempt=attempt,
                expect_instance=self.instance_id,
                reason=f"callback from the agent, {late / 1000:.1f} s after the last step",
                fields=fields,
            )
        )
        if moved.ok:  # should this sidecar stop before it finishes, the reaper does, soon
            soon = now_ms() + int(self.conn.settings.delivery_timeout_s * 1000)
            await self.conn.call(*due_at_most_command(self.store.keys, record.id, soon))
            return None
        if moved.stage in TERMINAL or moved.stage is Stage.CALLBACK_RECEIVED:
            assert moved.stage is not None
            return _duplicate(record.id, moved.stage)  # raced: another callback, the reaper
        return Answer(409, {"error": f"message is {moved.stage}", "stage": str(moved.stage)})

    # -- awaiting and finishing ------------------------------------------------------------

    async def await_callback(self, taken: Taken, task_id: str) -> None:
        """The agent took the work (202): it stays PROCESSING, its credit held, until the
        callback comes (or the reaper, asking the status endpoint, settles it)."""
        since = time.perf_counter()
        reason = "accepted by the agent (202)" + (f", task {task_id}" if task_id else "")
        moved = await self.store.apply(
            self.finisher.fenced(
                taken,
                Stage.PROCESSING,
                Stage.PROCESSING,
                reason=f"{reason}; awaiting its callback",
                fields={"awaiting_callback": 1, "agent_task": task_id},
            )
        )
        if moved.ok and taken.message_id not in self.finishing:
            self.awaiting[taken.message_id] = since
        elif not moved.ok and moved.stage is not Stage.CALLBACK_RECEIVED:
            self.finisher.done(taken)  # settled meanwhile by someone else: let go of it
        # CALLBACK_RECEIVED: the callback beat the 202 here, and is finishing it

    def resume_awaiting(self, taken: Taken) -> None:
        """A restart found the message awaiting its callback: it still is."""
        self.awaiting[taken.message_id] = time.perf_counter()

    def forget(self, taken: Taken) -> None:
        """An error stopped its handling here (it will be taken again)."""
        self.awaiting.pop(taken.message_id, None)

    def supersede(self, taken: Taken) -> None:
        """A new attempt of a message this sidecar still awaits a callback for (the reaper
        retried it here): the old attempt's entry and credit are let go of now — its callback
        can no longer settle it — not left held until a restart."""
        old = self.holdings.holding(taken.message_id)
        if old is not None and old != taken and taken.message_id in self.awaiting:
            del self.awaiting[taken.message_id]
            self.finisher.done(old)

    def finish(
        self,
        taken: Taken,
        envelope: Envelope,
        outcome: Succeeded | Failed,
        busy_ms: float = 0.0,
    ) -> None:
        """CALLBACK_RECEIVED -> SUCCEEDED / FAILED in the next finishing round trip, with the
        producer told, the credit returned, the entry acknowledged and the call charged
        (``busy_ms``: from the agent's acceptance to its callback, when this desk saw both)."""
        if taken.message_id in self.finishing:
            return  # queued already (the endpoint and the watch both saw it)
        self.finishing.add(taken.message_id)
        self.awaiting.pop(taken.message_id, None)
        stage, result, error = _ending(outcome)
        fields: dict[str, str | bytes] = {"result": result} if result is not None else {}
        settle = self.finisher.fenced(
            taken,
            stage,
            Stage.CALLBACK_RECEIVED,
            reason="result from the agent's callback",
            fields=fields,
            charge=self._charge(taken.attempt, envelope, outcome, busy_ms),
        )
        replies = self.finisher.replies(taken, envelope, stage, result, error)
        self.finisher.queue(Finished(taken, replies, settle))

    def _charge(
        self, attempt: int, envelope: Envelope, outcome: Succeeded | Failed, busy_ms: float
    ) -> Charge:
        return callback_charge(self.agent_id, attempt, envelope, outcome, busy_ms)

    async def _settle_unheld(
        self, envelope: Envelope, attempt: int, outcome: Succeeded | Failed
    ) -> None:
        """Settle a callback whose stream entry is long released (the message was parked for
        an operator). No entry keeps the telling pending, so the record does
        (``reply_pending``, as the reaper's endings do): a stop before the telling leaves it
        to the reaper."""
        stage, result, error = _ending(outcome)
        options = {
            "reason": "result from the agent's callback",
            "fields": {"reply_pending": 1},
            "charge": self._charge(attempt, envelope, outcome, 0.0),  # its time is unknown
        }
        moved = await self.store.apply(
            Move(
                envelope.message_id,
                stage,
                only_from=Stage.CALLBACK_RECEIVED,
                expect_attempt=attempt,
                expect_instance=self.instance_id,
                **charged(options, attempt),
            )
        )
        if moved.ok:
            await self.store.delivery.deliver(envelope, stage, result, error, attempt=attempt)
            record_key = self.conn.keys.record(envelope.message_id)
            await self.conn.call("HDEL", record_key, "reply_pending")

    async def watch(self) -> None:
        while True:
            await anyio.sleep(self.conn.settings.sweep_interval_s)
            try:
                await self.check_awaited()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("callback watch failed (the next one retries): %s", exc)

    async def check_awaited(self) -> None:
        """Let go of messages awaited in vain: the reaper (asking the status endpoint) or an
        operator settled them, and told their producers."""
        ids = [m for m in self.awaiting if m not in self.finishing]
        if not ids:
            return
        states = await self.conn.call_many(
            [("HMGET", self.conn.keys.record(m), "stage", "attempt", "instance") for m in ids]
        )
        received: list[Taken] = []
        for message_id, state in zip(ids, states, strict=True):
            taken = self.holdings.holding(message_id)
            if taken is None or message_id not in self.awaiting or isinstance(state, Exception):
                continue
            stage, attempt, instance = (v.decode() if v else "" for v in state)
            mine = attempt == str(taken.attempt) and instance == self.instance_id
            if mine and stage == Stage.PROCESSING.value:
                continue
            if mine and stage == Stage.CALLBACK_RECEIVED.value:
                received.append(taken)  # recorded, but its finishing was lost
                continue
            del self.awaiting[message_id]
            self.finisher.done(taken)
        for taken in received:
            record = await self.store.get_record(taken.message_id)
            if record is not None and record.stage is Stage.CALLBACK_RECEIVED:
                self.finish(taken, load_envelope(record.envelope), callback_outcome(record))


def _duplicate(message_id: str, stage: Stage) -> Answer:
    return Answer(200, {"id": message_id, "stage": stage.value, "duplicate": True})


def _ending(outcome: Succeeded | Failed) -> tuple[Stage, bytes | None, str | None]:
    if isinstance(outcome, Succeeded):
        return Stage.SUCCEEDED, outcome.result, None
    return Stage.FAILED, None, outcome.reason


def callback_charge(
    agent_id: str, attempt: int, envelope: Envelope, outcome: Succeeded | Failed, busy_ms: float
) -> Charge:
    """What a callback's outcome charges its attempt: the usage the agent reported beside it,
    else the usage inside its result."""
    usage = outcome.usage
    if usage is None and isinstance(outcome, Succeeded):
        usage = usage_in_result(outcome.result)
    return charge(
        agent_id,
        envelope.capability,
        envelope.tenant,
        attempt=attempt,
        answered=isinstance(outcome, Succeeded),
        busy_ms=busy_ms,
        usage=usage,
        ms=now_ms(),
    )


def callback_outcome(record: MessageRecord) -> Succeeded | Failed:
    """The outcome a callback left on the record (CALLBACK_RECEIVED), with the usage the agent
    reported beside it."""
    usage = stored_usage(record.usage)
    if record.result is not None:
        return Succeeded(record.result, usage)
    return Failed(record.error or "the agent reported failure", usage=usage)
