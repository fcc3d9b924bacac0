"""The ``http`` adapter: POST the envelope, a 2xx JSON body is the result.

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

from .outcome import Ambiguous, Backoff, Failed, NotReached, Outcome, Succeeded
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
        headers = reach_headers(envelope, attempt)
        headers["Content-Type"] = "application/json"
        try:
            response = await self._client.post(
                self.url, content=encode_envelope(envelope), headers=headers
            )
        except _NOT_SENT as exc:
            return NotReached(f"agent unreachable at {self.url}: {type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            return Ambiguous(f"no answer from {self.url}: {type(exc).__name__}: {exc}")
        return _from_response(response)

    async def aclose(self) -> None:
        await self._client.aclose()


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
        return Succeeded(body)
    snippet = response.text[:200]
    reason = f"agent answered {status}: {snippet}" if snippet else f"agent answered {status}"
    return Failed(reason, fault=status >= 500)
