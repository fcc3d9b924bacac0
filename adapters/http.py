"""The ``http`` adapter: POST the envelope, a 2xx JSON body is the result; and ``http-async``:
a 202 means the agent took the work and will POST the result to the sidecar's callback
endpoint (:mod:`adapters.callbacks`).

Errors are sorted by what they prove: a failure to connect means the agent never saw the
request (safe to retry anywhere); a timeout or a broken connection after sending is
ambiguous; 429 and 503 are back-pressure (with ``Retry-After``), not failure; any other 4xx
or 5xx answer is a final failure from the agent.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import zlib
from dataclasses import dataclass

import anyio
import httpx
import msgspec

from broker.envelope import Envelope, encode_envelope
from broker.usage import usage_from_headers, usage_in_result

from .callbacks import TOKEN_HEADER, URL_HEADER, CallbackTokens
from .outcome import Accepted, Ambiguous, Backoff, Failed, NotReached, Outcome, Succeeded
from .transport import reach_headers

# errors that prove a request never left: not reached, a retry is always safe
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


DEFAULT_MAX_RESULT_BYTES = 1024 * 1024


class HttpTransport:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        max_connections: int,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> None:
        self.url = url
        self.max_result_bytes = max_result_bytes
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=agent_limits(max_connections),
        )

    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        try:
            request = self._client.build_request(
                "POST",
                self.url,
                content=encode_envelope(envelope.for_agent()),
                headers=self.headers(envelope, attempt),
            )
        except Exception as exc:  # whatever it was, it happened before anything was sent
            # The agent never saw it, and the same envelope would fail the
            # same way on every retry. Accepted envelopes are checked against this
            # (broker/headers.py); this is the line behind that one.
            reason = f"cannot build the request to {self.url}: {type(exc).__name__}: {exc}"
            return Failed(reason, fault=False)
        try:
            response, body = await exchange(self._client, request, self.max_result_bytes)
        except NOT_SENT as exc:
            return NotReached(f"agent unreachable at {self.url}: {type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            return Ambiguous(f"no answer from {self.url}: {type(exc).__name__}: {exc}")
        status = response.status_code
        if body is None and (not 200 <= status < 300 or self.outcome_without_body(status)):
            # what the status says holds whatever the body: a 429 is back-pressure, a 202
            # taken work, however much text came with it
            return self.outcome(AgentAnswer(status, response.headers, b""))
        if body is None:
            why = f"agent answered {status} with a body over the {self.max_result_bytes}-byte limit"
            return Failed(why)
        return self.outcome(AgentAnswer(status, response.headers, body))

    def outcome_without_body(self, status: int) -> bool:
        """Whether a 2xx ``status`` says all there is to say without its body."""
        return False

    def outcome(self, answer: AgentAnswer) -> Outcome:
        return _from_answer(answer)

    def headers(self, envelope: Envelope, attempt: int) -> dict[str, str]:
        headers = reach_headers(envelope, attempt)
        headers["Content-Type"] = "application/json"
        return headers

    async def aclose(self) -> None:
        await self._client.aclose()


class HttpAsyncTransport(HttpTransport):
    """POST the envelope with where and how to call back; 202 is "taken, will call back"
    (its JSON body may name the agent's own ``task_id``). Any other answer means what it means
    to the ``http`` adapter: an agent may still answer at once."""

    wants_callbacks = True

    def __init__(self, url: str, *, timeout_s: float, max_connections: int) -> None:
        super().__init__(url, timeout_s=timeout_s, max_connections=max_connections)
        self._base = ""
        self._tokens: CallbackTokens | None = None

    def bind_callbacks(self, base_url: str, tokens: CallbackTokens) -> None:
        """Where the sidecar's callback endpoint listens, and its tokens (known at its start)."""
        self._base = base_url.rstrip("/")
        self._tokens = tokens

    def headers(self, envelope: Envelope, attempt: int) -> dict[str, str]:
        assert self._tokens is not None, "callbacks not bound: the sidecar binds them at start"
        headers = super().headers(envelope, attempt)
        headers[URL_HEADER] = f"{self._base}/callbacks/{envelope.message_id}"
        headers[TOKEN_HEADER] = self._tokens.token(envelope.message_id, attempt)
        return headers

    def outcome(self, answer: AgentAnswer) -> Outcome:
        if answer.status == 202:  # whatever the body: "Accepted" as text is common
            return Accepted(_task_id(answer.body))
        return _from_answer(answer)

    def outcome_without_body(self, status: int) -> bool:
        return status == 202  # taken: the agent calls back, whatever it wrote beside it


def _task_id(body: bytes) -> str:
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return ""
    task = data.get("task_id") if isinstance(data, dict) else None
    return str(task)[:200] if task is not None else ""


DEFAULT_RETRY_AFTER_S = 1.0
# The longest wait a Retry-After may ask for: past it, the value is taken as this. An answer
# of "inf" or 1e400 must not stop the process that reads it.
MAX_RETRY_AFTER_S = 3600.0


def retry_after_s(value: str | None) -> float:
    """``Retry-After`` as seconds: a number of seconds or an HTTP date (RFC 9110 §10.2.3),
    between 0 and ``MAX_RETRY_AFTER_S`` whatever the text (not a number: the default)."""
    if not value:
        return DEFAULT_RETRY_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = _seconds_until(value)
    if math.isnan(seconds):
        return DEFAULT_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def _seconds_until(value: str) -> float:
    try:
        when = email.utils.parsedate_to_datetime(value)
        return (when - datetime.datetime.now(datetime.UTC)).total_seconds()
    except (TypeError, ValueError, OverflowError):
        return DEFAULT_RETRY_AFTER_S


# An idle pooled connection is given up before a server would close it: a request sent on a
# connection the server is closing at that moment fails unanswered (ReadError), and for an
# agent that is not idempotent that is a call nobody can say ran or not (NEEDS_CONFIRMATION).
# Servers close idle connections after 2 s (gunicorn), 5 s (uvicorn, Node), 75 s (nginx);
# httpx's own expiry is 5 s, the same as uvicorn's: the race was there to lose.
KEEPALIVE_EXPIRY_S = 1.5


def agent_limits(max_connections: int) -> httpx.Limits:
    """The connection pool of an adapter that calls an agent over HTTP."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )


@dataclass(frozen=True, slots=True)
class AgentAnswer:
    """An agent's HTTP answer, its body read (within the limit)."""

    status: int
    headers: httpx.Headers
    body: bytes

    @property
    def snippet(self) -> str:
        return self.body[:200].decode(errors="replace")


async def exchange(
    client: httpx.AsyncClient, request: httpx.Request, max_bytes: int
) -> tuple[httpx.Response, bytes | None]:
    """Send ``request`` and read its answer (:func:`read_limited`), the whole exchange within
    the client's read timeout. httpx's timeouts bound each connect, write and read, not the
    call: an agent that sends a byte every few seconds would hold the call, and its credit,
    for good. Past the deadline, :class:`httpx.ReadTimeout` once the request had begun to
    leave (an answer that did not come: ambiguous), else :class:`httpx.ConnectTimeout`
    (nothing sent: :class:`SendWatch`)."""
    within_s = client.timeout.read or DEFAULT_EXCHANGE_S
    sending = SendWatch()
    request.extensions["trace"] = sending.trace
    with anyio.move_on_after(within_s):
        response = await client.send(request, stream=True)
        try:
            return response, await read_limited(response, max_bytes)
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
    raise sending.timed_out(within_s, request)


class SendWatch:
    """Whether a request has begun to leave (httpcore's trace: its headers being sent), so
    that a deadline past before then — a connect that never completed, a wait for a pooled
    connection — is told as what it is: nothing sent, a retry safe (:data:`NOT_SENT`)."""

    def __init__(self) -> None:
        self.started = False

    async def trace(self, event: str, info: dict[str, object]) -> None:
        if event.endswith("send_request_headers.started"):
            self.started = True

    def timed_out(self, within_s: float, request: httpx.Request) -> httpx.TimeoutException:
        if not self.started:
            return httpx.ConnectTimeout(f"not connected within {within_s:g} s", request=request)
        return httpx.ReadTimeout(f"no whole answer within {within_s:g} s", request=request)


DEFAULT_EXCHANGE_S = 30.0  # for a client made without a read timeout


async def read_limited(response: httpx.Response, max_bytes: int) -> bytes | None:
    """The body of a streamed response, or ``None`` as soon as it passes ``max_bytes``
    (declared or read: inflated bytes count, so a compressed bomb is cut off too)."""
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and len(declared) < 20:
        if int(declared) > max_bytes:
            return None
    body = bytearray()
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding in _Inflate.ENCODINGS:
        inflate = _Inflate(encoding)
        async for chunk in response.aiter_raw():
            inflated = inflate.feed(chunk, max_bytes - len(body))
            if inflated is None:
                return None
            body += inflated
        return bytes(body)
    async for chunk in response.aiter_bytes():  # identity (or what httpx alone can undo)
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)


class _Inflate:
    """A gzip or deflate body undone a bounded piece at a time. httpx inflates each chunk it
    reads whole: 64 KiB of zeros on the wire came out as 64 MiB before a size check saw
    them (a 200 MB bomb peaked at 140 MiB for a 1 MiB limit)."""

    ENCODINGS = frozenset({"gzip", "x-gzip", "deflate"})

    def __init__(self, encoding: str) -> None:
        self._gzip = encoding != "deflate"
        self._inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if self._gzip else zlib.MAX_WBITS)
        self._first = True

    def feed(self, data: bytes, room: int) -> bytes | None:
        """What ``data`` inflates to; ``None`` once that is more than ``room`` bytes."""
        try:
            out = self._inflater.decompress(data, room + 1)
        except zlib.error as exc:
            if self._gzip or not self._first:
                kind = "gzip" if self._gzip else "deflate"
                raise httpx.DecodingError(f"answer not {kind}") from exc
            # "deflate" sent raw, without its zlib wrapper (as httpx reads it too)
            self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            try:
                out = self._inflater.decompress(data, room + 1)
            except zlib.error:
                raise httpx.DecodingError("answer not deflate") from exc
        self._first = False
        return None if len(out) > room else out


def refusal(answer: AgentAnswer, who: str = "agent") -> Outcome | None:
    """What an HTTP status other than 2xx says, for every adapter over HTTP; ``None`` for a
    2xx, whose body the adapter reads. 429, or 503 *with* Retry-After: ``who`` refused the work
    for now (DESIGN §7); a bare 503 may come from a proxy after it acted: not proof of
    anything; any other status is a failure (its fault when 5xx)."""
    status = answer.status
    retry_after = answer.headers.get("retry-after")
    if status == 429 or (status == 503 and retry_after):
        wait = retry_after_s(retry_after)
        return Backoff(f"{who} answered {status}: busy, retry after {wait:g} s", wait)
    if status == 503:
        return Ambiguous(f"{who} answered 503 without Retry-After: {answer.snippet}")
    if 200 <= status < 300:
        return None
    snippet = answer.snippet
    reason = f"{who} answered {status}: {snippet}" if snippet else f"{who} answered {status}"
    return Failed(reason, fault=status >= 500)


USAGE_HEADER, COST_HEADER = "x-reach-usage", "x-reach-cost"


def _from_answer(answer: AgentAnswer) -> Outcome:
    """The outcome of an answer, with the usage it reported: in its headers, or, for an
    answer other than 2xx, in a ``usage`` object of its JSON body (a 2xx's result is read for
    it when the call is charged). Every answer that reported usage is charged for it, a
    failure or a refusal as well (:mod:`broker.usage`)."""
    outcome = _outcome_of(answer)
    usage = usage_from_headers(answer.headers.get(USAGE_HEADER), answer.headers.get(COST_HEADER))
    if usage is None and not 200 <= answer.status < 300:
        usage = usage_in_result(answer.body)
    if usage is not None and isinstance(outcome, Succeeded | Failed | Backoff | Ambiguous):
        return msgspec.structs.replace(outcome, usage=usage)
    return outcome


def _outcome_of(answer: AgentAnswer) -> Outcome:
    status = answer.status
    refused = refusal(answer)
    if refused is not None:
        return refused
    body = answer.body or b"null"  # a 2xx
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return Failed(f"agent answered {status} with a body that is not JSON")
    except RecursionError:  # msgspec gives up on very deep nesting
        return Failed(f"agent answered {status} with JSON nested too deeply to read")
    return Succeeded(body)
