"""The callback endpoint of a sidecar whose agent answers later (the ``http-async`` adapter).

The agent got, with the request, ``X-Reach-Callback-Url`` (``<base>/callbacks/<message id>``)
and ``X-Reach-Callback-Token``; it POSTs ``{"result": ...}`` or ``{"error": "..."}`` there with
the token in ``X-Reach-Callback-Token``. The token is ``<attempt>.<hex HMAC>`` of the message
id and attempt under a key kept in Redis per instance (``P:k:{<inst>}``): a restarted sidecar
still knows the tokens it handed out, nothing per message is stored before the request
leaves, and a token is checked without reading any record.

Answers: 200 for the first result, 200 with ``duplicate: true`` for a repeat, 400 for a body
that is neither (or nests deeper than :data:`broker.jsondepth.MAX_JSON_DEPTH`), 401 for a
missing or bad token — whether or not the id exists, so only a token's holder learns
anything about its message — then 404 for an id with no record, 409 for an attempt that is no
longer current, 413 over ``max_callback_bytes`` (at most that many bytes are read, whatever
``Content-Length`` says). What the answer does to the message is the sidecar's business
(:meth:`adapters.sidecar.Sidecar.on_callback`); this module is HTTP only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from broker.jsondepth import decode_error_text, depth_problem
from broker.usage import usage_from_mapping

from .outcome import Failed, Succeeded

TOKEN_HEADER = "X-Reach-Callback-Token"
URL_HEADER = "X-Reach-Callback-Url"
CALLBACK_PATH = "/callbacks/"
# Attempts are few (the envelope caps them at 100): a longer number in a token is no
# attempt of ours, and int() is never handed a long string.
_ATTEMPT_DIGITS = 6


class CallbackTokens:
    """Per-message tokens, ``<attempt>.<hex HMAC-SHA256 of "<message id>:<attempt>">`` under
    the instance key: the attempt travels in the token, so checking one needs no record.

    Tokens handed out before this form — the bare hex HMAC — are still taken, checked
    against each attempt the message has had (which needs its record)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def token(self, message_id: str, attempt: int) -> str:
        return f"{attempt}.{self._mac(message_id, attempt)}"

    def attempt_of(self, token: str, message_id: str, latest: int) -> int | None:
        """The attempt the token was made for, or ``None``: forged or malformed. ``latest``,
        the record's attempt (0 when there is no record), matters only for a bare-hex token:
        with no record such a token proves nothing."""
        if not token.isascii():  # hmac.compare_digest refuses other text
            return None
        attempt_text, dot, mac = token.partition(".")
        if dot:
            return self._signed_attempt(attempt_text, mac, message_id)
        for attempt in range(latest, 0, -1):
            if hmac.compare_digest(self._mac(message_id, attempt), token):
                return attempt
        return None

    def _signed_attempt(self, attempt_text: str, mac: str, message_id: str) -> int | None:
        if not attempt_text.isdigit() or len(attempt_text) > _ATTEMPT_DIGITS:
            return None
        attempt = int(attempt_text)
        if attempt < 1 or not hmac.compare_digest(self._mac(message_id, attempt), mac):
            return None
        return attempt

    def _mac(self, message_id: str, attempt: int) -> str:
        message = f"{message_id}:{attempt}".encode("utf-8", "surrogatepass")
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


class Answer(msgspec.Struct, frozen=True):
    """What the endpoint answers: a status and a JSON body."""

    status: int
    body: dict[str, Any]


def parse_callback(body: bytes) -> Succeeded | Failed | str:
    """The agent's result from a callback body (``{"result": …}`` or ``{"error": "…"}``, with
    ``"usage"`` beside either), or why the body is not one."""
    too_deep = depth_problem(body)
    if too_deep is not None:  # before decoding: the decoder recurses
        return too_deep
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return f"body is not JSON: {decode_error_text(exc, body)}"
    if not isinstance(data, dict) or ("result" in data) == ("error" in data):
        return 'body must be a JSON object with exactly one of "result" or "error"'
    # what the work used, beside the result or the error (a failure may report it too); a
    # result without it may still carry it inside (broker.usage.usage_in_result)
    usage = usage_from_mapping(data.get("usage"))
    if "result" in data:
        return Succeeded(msgspec.json.encode(data["result"]), usage=usage)
    error = data["error"]
    if not isinstance(error, str) or not error:
        return '"error" must be a non-empty string'
    return Failed(error, usage=usage)


Receiver = Callable[[str, str, Succeeded | Failed], Awaitable[Answer]]
# Checks a callback's token before its body is read: None to go on, or the refusal (401).
Authorizer = Callable[[str, str], Awaitable[Answer | None]]


def callback_app(
    authorize: Authorizer,
    receive: Receiver,
    *,
    max_bytes: int,
    body_timeout_s: float,
    more: Sequence[Route] = (),
) -> Starlette:
    """``POST /callbacks/{message_id}``: the token first (``authorize``: nothing is read
    for a caller without a good one), then a body of at most ``max_bytes`` within
    ``body_timeout_s`` (408 past it), then ``receive`` decides."""

    async def callback(request: Request) -> Response:
        message_id = request.path_params["message_id"]
        token = request.headers.get(TOKEN_HEADER)
        if not token:
            return _json(Answer(401, {"error": f"missing {TOKEN_HEADER} header"}))
        refused = await authorize(message_id, token)
        if refused is not None:
            return _json(refused)
        body: bytes | Answer = Answer(408, {"error": "the body did not arrive in time"})
        with anyio.move_on_after(body_timeout_s):
            body = await read_body(request, max_bytes)
        if isinstance(body, Answer):
            return _json(body)
        outcome = parse_callback(body)
        if isinstance(outcome, str):
            return _json(Answer(400, {"error": outcome}))
        return _json(await receive(message_id, token, outcome))

    route = Route(CALLBACK_PATH + "{message_id}", callback, methods=["POST"])
    return Starlette(routes=[route, *more])  # more: an A2A agent's push notifications


async def read_body(request: Request, max_bytes: int) -> bytes | Answer:
    """The request's body, or 413 as soon as it would pass ``max_bytes``: never more than
    that is kept, whether the body is chunked or its ``Content-Length`` lies (the server
    reads no further than the length declared, and a declared length over the limit is
    refused before anything is read)."""
    if _declared_over(request.headers.get("content-length", ""), max_bytes):
        return _too_large(max_bytes)
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > max_bytes:
                return _too_large(max_bytes)
            body += chunk
    except ClientDisconnect:
        return Answer(400, {"error": "the client closed the connection before its body ended"})
    return bytes(body)


def _declared_over(content_length: str, max_bytes: int) -> bool:
    digits = content_length.lstrip("0")
    if not (content_length.isascii() and content_length.isdigit()):
        return False  # absent (chunked), or not a number: the streamed count decides
    return len(digits) > len(str(max_bytes)) or int(digits or "0") > max_bytes


def _too_large(max_bytes: int) -> Answer:
    return Answer(413, {"error": f"callback body over the {max_bytes}-byte limit"})


def _json(answer: Answer) -> Response:
    """The answer; a refusal of who is calling (401, 403) or of a body that did not come
    (408) closes the connection, whose unread body the server would otherwise go on reading
    for as long as the client trickles it in. A 413 does not: a client still sending its
    body would see the connection reset, not the answer."""
    close = {"Connection": "close"} if answer.status in (401, 403, 408) else None
    return JSONResponse(answer.body, status_code=answer.status, headers=close)
