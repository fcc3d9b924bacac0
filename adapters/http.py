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

import httpx
import msgspec

from broker.envelope import Envelope, encode_envelope

from .callbacks import TOKEN_HEADER, URL_HEADER, CallbackTokens
from .outcome import Accepted, Ambiguous, Backoff, Failed, NotReached, Outcome, Succeeded
from .transport import reach_headers

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


class HttpTransport:
    def __init__(self, url: str, *, timeout_s: float, max_connections: int) -> None:
        self.url = url
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        try:
            request = self._client.build_request(
                "POST",
                self.url,
                content=encode_envelope(envelope),
                headers=self.headers(envelope, attempt),
            )
        except Exception as exc:  # whatever it was, it happened before anything was sent
            # The agent never saw it, and the same envelope would fail the
            # same way on every retry. Accepted envelopes are checked against this
            # (broker/headers.py); this is the line behind that one.
            reason = f"cannot build the request to {self.url}: {type(exc).__name__}: {exc}"
            return Failed(reason, fault=False)
        try:
            response = await self._client.send(request)
        except _NOT_SENT as exc:
            return NotReached(f"agent unreachable at {self.url}: {type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            return Ambiguous(f"no answer from {self.url}: {type(exc).__name__}: {exc}")
        return self.outcome(response)

    def outcome(self, response: httpx.Response) -> Outcome:
        return _from_response(response)

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

    def outcome(self, response: httpx.Response) -> Outcome:
        if response.status_code == 202:  # whatever the body: "Accepted" as text is common
            return Accepted(_task_id(response.content))
        return _from_response(response)


def _task_id(body: bytes) -> str:
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return ""
    task = data.get("task_id") if isinstance(data, dict) else None
    return str(task)[:200] if task is not None else ""


DEFAULT_RETRY_AFTER_S = 1.0


def retry_after_s(value: str | None) -> float:
    """``Retry-After`` as seconds: a number of seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return DEFAULT_RETRY_AFTER_S
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def _from_response(response: httpx.Response) -> Outcome:
    status = response.status_code
    retry_after = response.headers.get("retry-after")
    if status == 429 or (status == 503 and retry_after):
        # 429, or 503 *with* Retry-After: the agent refused the work for now (DESIGN §7). A
        # bare 503 may come from a proxy after the agent acted: not proof of anything.
        wait = retry_after_s(retry_after)
        return Backoff(f"agent answered {status}: busy, retry after {wait:g} s", wait)
    if status == 503:
        return Ambiguous(f"agent answered 503 without Retry-After: {response.text[:200]}")
    if 200 <= status < 300:
        body = response.content or b"null"
        try:
            msgspec.json.decode(body)
        except msgspec.DecodeError:
            return Failed(f"agent answered {status} with a body that is not JSON")
        except RecursionError:  # msgspec gives up on very deep nesting
            return Failed(f"agent answered {status} with JSON nested too deeply to read")
        return Succeeded(body)
    snippet = response.text[:200]
    reason = f"agent answered {status}: {snippet}" if snippet else f"agent answered {status}"
    return Failed(reason, fault=status >= 500)
