"""Asking an agent what became of a message: ``GET {status_url}/{message id}``.

The answer is JSON ``{"state": "done" | "running" | "failed" | "unknown", "result": ...,
"error": ...}``; 404 means unknown. Anything else — no status endpoint, a connection error, a
malformed answer — is ``unknown`` too: the reaper then falls back to what is safe without
knowing (retry an idempotent agent, park the message for an operator otherwise). An A2A agent
(status URL ``a2a:<version>:<url>``) is asked ``GetTask`` instead (:mod:`adapters.a2a_rpc`).
"""

from __future__ import annotations

import httpx
import msgspec

from broker.jsondepth import decode_error_text, depth_problem

from .a2a_rpc import STATUS_SCHEME, a2a_status
from .http import DEFAULT_MAX_RESULT_BYTES, exchange
from .outcome import Status

_decoder = msgspec.json.Decoder(Status)


class StatusClient:
    def __init__(
        self, *, timeout_s: float = 5.0, max_answer_bytes: int = DEFAULT_MAX_RESULT_BYTES
    ) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
        self.max_answer_bytes = max_answer_bytes

    async def query(self, status_url: str, message_id: str, task_id: str = "") -> Status:
        """What the agent says of ``message_id`` (an A2A agent: of its task ``task_id``); a
        result nested too deeply is not taken, as a call's is not (:func:`held_to_depth`)."""
        status = await self._asked(status_url, message_id, task_id)
        if (problem := depth_problem(status.result_json)) is not None:
            return Status("unknown", why=f"status endpoint answer: {problem}")
        try:  # as every reader will: an integer of 5,000 digits is JSON no reader builds
            msgspec.json.decode(status.result_json)
        except msgspec.DecodeError as exc:
            why = (
                f"status endpoint result not readable: {decode_error_text(exc, status.result_json)}"
            )
            return Status("unknown", why=why)
        return status

    async def _asked(self, status_url: str, message_id: str, task_id: str) -> Status:
        if not status_url:
            return Status("unknown", why="the agent has no status endpoint")
        if status_url.startswith(STATUS_SCHEME):
            return await a2a_status(
                self._client, status_url, task_id, max_bytes=self.max_answer_bytes
            )
        url = f"{status_url.rstrip('/')}/{message_id}"
        headers = {"X-Reach-Message-Id": message_id}
        try:
            request = self._client.build_request("GET", url, headers=headers)
            response, body = await exchange(self._client, request, self.max_answer_bytes)
        except Exception as exc:  # any failure to ask is "unknown", never a crash
            return Status("unknown", why=f"status query failed: {type(exc).__name__}")
        if response.status_code == 404:
            return Status("unknown", why="status endpoint: 404, message not known")
        if response.status_code != 200:
            return Status("unknown", why=f"status endpoint answered {response.status_code}")
        if body is None:
            why = f"status endpoint answer over the {self.max_answer_bytes}-byte limit"
            return Status("unknown", why=why)
        try:
            status = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            why = f"status endpoint answer not understood: {decode_error_text(exc, body)}"
            return Status("unknown", why=why)
        except RecursionError:  # msgspec gives up on very deep nesting
            return Status("unknown", why="status endpoint answer nested too deeply to read")
        return msgspec.structs.replace(status, why=f"status endpoint: {status.state}")

    async def aclose(self) -> None:
        await self._client.aclose()
