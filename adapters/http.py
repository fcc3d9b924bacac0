"""The ``http`` adapter: POST the envelope, a 2xx JSON body is the result.

Errors are sorted by what they prove: a failure to connect means the agent never saw the
request (safe to retry anywhere); a timeout or a broken connection after sending is
ambiguous; a 4xx or 5xx answer is a final failure from the agent.
"""

from __future__ import annotations

import httpx
import msgspec

from broker.envelope import Envelope, encode_envelope

from .outcome import Ambiguous, Failed, NotReached, Outcome, Succeeded
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


def _from_response(response: httpx.Response) -> Outcome:
    status = response.status_code
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
