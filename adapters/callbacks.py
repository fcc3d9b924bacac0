"""The callback endpoint of a sidecar whose agent answers later (the ``http-async`` adapter).

The agent got, with the request, ``X-Reach-Callback-Url`` (``<base>/callbacks/<message id>``)
and ``X-Reach-Callback-Token``; it POSTs ``{"result": ...}`` or ``{"error": "..."}`` there with
the token in ``X-Reach-Callback-Token``. The token is an HMAC of the message id and attempt
under a key kept in Redis per instance (``P:k:{<inst>}``), so a restarted sidecar still knows
the tokens it handed out, and nothing per message has to be stored before the request leaves.

Answers: 200 for the first result, 200 with ``duplicate: true`` for a repeat, 400 for a body
that is neither, 401 for a bad token, 404 for an unknown id, 409 for an attempt that is no
longer current, 413 over ``max_callback_bytes``. What the answer does to the message is the
sidecar's business (:meth:`adapters.sidecar.Sidecar.on_callback`); this module is HTTP only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .outcome import Failed, Succeeded

TOKEN_HEADER = "X-Reach-Callback-Token"
URL_HEADER = "X-Reach-Callback-Url"
CALLBACK_PATH = "/callbacks/"


class CallbackTokens:
    """Per-message tokens: HMAC-SHA256 of ``<message id>:<attempt>`` under the instance key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def token(self, message_id: str, attempt: int) -> str:
        return hmac.new(self._key, f"{message_id}:{attempt}".encode(), hashlib.sha256).hexdigest()

    def attempt_of(self, token: str, message_id: str, latest: int) -> int | None:
        """The attempt (1..``latest``) the token was made for, or ``None``: forged."""
        for attempt in range(latest, 0, -1):
            if hmac.compare_digest(self.token(message_id, attempt), token):
                return attempt
        return None


class Answer(msgspec.Struct, frozen=True):
    """What the endpoint answers: a status and a JSON body."""

    status: int
    body: dict[str, Any]


def parse_callback(body: bytes) -> Succeeded | Failed | str:
    """The agent's result from a callback body, or why the body is not one."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return f"body is not JSON: {exc}"
    if not isinstance(data, dict) or ("result" in data) == ("error" in data):
        return 'body must be a JSON object with exactly one of "result" or "error"'
    if "result" in data:
        return Succeeded(msgspec.json.encode(data["result"]))
    error = data["error"]
    if not isinstance(error, str) or not error:
        return '"error" must be a non-empty string'
    return Failed(error)


Receiver = Callable[[str, str, Succeeded | Failed], Awaitable[Answer]]


def callback_app(receive: Receiver, *, max_bytes: int) -> Starlette:
    """``POST /callbacks/{message_id}``: checks size and body, then ``receive`` decides."""

    async def callback(request: Request) -> Response:
        message_id = request.path_params["message_id"]
        token = request.headers.get(TOKEN_HEADER)
        if not token:
            return _json(Answer(401, {"error": f"missing {TOKEN_HEADER} header"}))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            return _too_large(max_bytes)
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    return _too_large(max_bytes)
        except ClientDisconnect:
            return Response(status_code=400)
        outcome = parse_callback(bytes(body))
        if isinstance(outcome, str):
            return _json(Answer(400, {"error": outcome}))
        return _json(await receive(message_id, token, outcome))

    return Starlette(routes=[Route(CALLBACK_PATH + "{message_id}", callback, methods=["POST"])])


def _too_large(max_bytes: int) -> Response:
    return _json(Answer(413, {"error": f"callback body over the {max_bytes}-byte limit"}))


def _json(answer: Answer) -> Response:
    return JSONResponse(answer.body, status_code=answer.status)
