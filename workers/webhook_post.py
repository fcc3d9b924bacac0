"""One POST of a webhook delivery: signed, through the egress guard, within its time.

The notifier (:mod:`workers.notifier`) decides what to deliver and what an attempt's end
means for the outbox; this module makes the attempt and says what it came to
(:class:`Attempt`), never raising for anything the receiver or the network does.

A POST is signed as the Standard Webhooks specification says (:mod:`broker.webhooks`):
``webhook-id`` (the entry's ``webhook_id``, the same on every retry, so receivers de-duplicate
on it), ``webhook-timestamp`` and ``webhook-signature``; the older ``X-Reach-Message-Id``,
``X-Reach-Timestamp``, ``X-Reach-Signature`` and ``X-Reach-Delivery-Attempt`` are sent too,
unsigned as a whole. Where it may go is checked twice: the URL's host against
``callback_hosts`` (:func:`broker.webhooks.callback_problem`), then, at connect time, every
address that host resolves to (:mod:`workers.egress`). Redirects are not followed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import TracebackType

import anyio
import httpx

from adapters.http import retry_after_s
from broker.config import Settings
from broker.errors import ConfigError
from broker.redaction import url_without_password
from broker.webhooks import Allowlist, Signer, callback_problem
from broker.wire import OutboxEntry

from .egress import EgressRefused, guarded_client

log = logging.getLogger("agent_reach.notifier")

CONCURRENCY = 64  # POSTs in flight at once (an entry waiting out a back-off takes no slot)


READ_AT_MOST_BYTES = 64 * 1024
READ_AT_MOST_S = 0.5


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one try came to. ``posted``: the request left (it counts as an attempt);
    ``final``: retrying cannot help (the URL is refused); ``retry_after_ms``: the receiver's
    own ``Retry-After``, a floor for the next wait."""

    delivered: bool
    detail: str
    posted: bool = True
    final: bool = False
    retry_after_ms: int = 0


class WebhookPoster:
    """POSTs deliveries, at most :data:`CONCURRENCY` at once; its HTTP client lives while the
    poster is entered (``async with poster:``). A ``webhook_secret`` that cannot sign is a
    :class:`ConfigError` when it is made; without a secret every attempt is refused, final."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.allowlist = Allowlist.parse(settings.callback_hosts)
        self.signer = _signer(settings.webhook_secret)
        self._limit = anyio.CapacityLimiter(CONCURRENCY)
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> WebhookPoster:
        for entry in self.allowlist.unusable:
            log.warning(
                "callback_hosts entry %r is no host, host:port, IP address or network: it"
                " allows nothing",
                entry,
            )
        timeout_s = self.settings.webhook_timeout_s
        self._http = guarded_client(
            self.allowlist,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=httpx.Limits(max_connections=CONCURRENCY),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        http, self._http = self._http, None
        if http is not None:
            with anyio.CancelScope(shield=True):
                await http.aclose()

    async def attempt(self, delivery: OutboxEntry) -> Attempt:
        """Try ``delivery`` once, if its URL may be reached and there is a secret to sign it."""
        signer = self.signer
        problem = callback_problem(delivery.url, self.allowlist, signer.secret if signer else None)
        if problem or not signer:
            return Attempt(False, problem or "no webhook_secret", posted=False, final=True)
        async with self._limit:
            return await self._post(delivery, signer)

    async def _post(self, delivery: OutboxEntry, signer: Signer) -> Attempt:
        assert self._http is not None, "WebhookPoster used outside `async with`"
        headers = signer.headers(
            webhook_id=delivery.webhook_id,
            message_id=delivery.message_id,
            timestamp=int(time.time()),
            body=delivery.body,
            attempt=delivery.attempt,
        )
        timeout_s = self.settings.webhook_timeout_s
        with anyio.move_on_after(timeout_s):  # in all: a receiver trickling bytes counts too
            try:
                stream = self._http.stream(
                    "POST", delivery.url, content=delivery.body, headers=headers
                )
                async with stream as response:
                    answered = _answered(response)
                    await _read_a_little(response)
                    return answered
            except EgressRefused as exc:  # nothing was sent, and nothing else would change
                return Attempt(False, str(exc), posted=False, final=True)
            except httpx.ReadTimeout:
                return Attempt(False, f"no answer within {timeout_s:g} s")
            except httpx.HTTPError as exc:
                return Attempt(False, f"{type(exc).__name__}: {exc}".rstrip(": "))
            except (httpx.InvalidURL, ValueError) as exc:  # a URL httpx cannot send to: final
                return Attempt(
                    False,
                    f"cannot POST to {url_without_password(delivery.url)!r}: {exc}",
                    posted=False,
                    final=True,
                )
        return Attempt(False, f"no answer within {timeout_s:g} s")


async def _read_a_little(response: httpx.Response) -> None:
    """The status and headers say all a delivery needs; the body is read only so that a
    short one leaves the connection for the next delivery: at most
    :data:`READ_AT_MOST_BYTES` as they came (never inflated: a receiver's 600 KB of gzip
    was 1.7 GB in this process, read whole), for at most :data:`READ_AT_MOST_S`, and never
    past the delivery's own deadline. A longer one closes the connection."""
    deadline = min(anyio.current_time() + READ_AT_MOST_S, anyio.current_effective_deadline())
    read = 0
    with anyio.move_on_after(max(0.0, deadline - anyio.current_time() - 0.05)):
        async for chunk in response.aiter_raw():
            read += len(chunk)
            if read > READ_AT_MOST_BYTES:
                return


def _answered(response: httpx.Response) -> Attempt:
    """What the receiver's answer means: 2xx delivered; 429 and 503 may say when to retry."""
    status = response.status_code
    if 200 <= status < 300:
        return Attempt(True, f"answered {status}")
    wait_ms = 0
    if status in (429, 503) and "retry-after" in response.headers:
        wait_ms = int(retry_after_s(response.headers["retry-after"]) * 1000)
    return Attempt(False, f"answered {status}", retry_after_ms=wait_ms)


def _signer(secret: str | None) -> Signer | None:
    """The signer of ``secret`` (``None``: webhooks are off). A ``whsec_`` secret that is not
    base64 is refused when settings are built; settings made some other way meet it here."""
    if not secret:
        return None
    try:
        return Signer.from_secret(secret)
    except ValueError as exc:
        raise ConfigError("webhook_secret", str(exc)) from exc
