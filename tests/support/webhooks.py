"""A real webhook receiver on loopback, and the README's verification (through the
``standardwebhooks`` library), verbatim."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.asgi import serve_app

SECRET = "s3cret-for-tests"  # a plain secret: its UTF-8 bytes are the key
# a Standard Webhooks secret: the key is the base64 after the prefix
WHSEC_SECRET = "whsec_" + base64.b64encode(b"a 24-byte key for tests!").decode()

# The README's receiver snippet, verbatim: the test runs exactly this text.
README_VERIFY = """\
from standardwebhooks import Webhook, WebhookVerificationError


def verify(secret: str, body: bytes, headers: dict[str, str]) -> dict | None:
    \"\"\"The body as JSON, or None when `secret` did not sign it (or it is stale).\"\"\"
    key = secret if secret.startswith("whsec_") else secret.encode()
    try:
        return Webhook(key).verify(body, headers)  # signature, and at most 5 minutes old
    except (WebhookVerificationError, ValueError):  # ValueError: a mangled signature header
        return None
"""


def readme_verify() -> Callable[[str, bytes, dict[str, str]], Any]:
    namespace: dict[str, Any] = {}
    exec(README_VERIFY, namespace)
    verify: Callable[[str, bytes, dict[str, str]], Any] = namespace["verify"]
    return verify


# -- a webhook receiver ----------------------------------------------------------------------


@dataclass
class Hit:
    at: float  # monotonic, on arrival
    wall: float  # time.time(), on arrival
    headers: dict[str, str]  # lower-case names
    body: bytes
    status: int | None = None  # what it answered; None while it hangs


@dataclass
class Receiver:
    """Answers each POST with the next of ``answers`` (then 200), or never (``hang``)."""

    answers: list[int] = field(default_factory=list)
    hang: bool = False
    retry_after: str | None = None  # sent with every refusal
    location: str | None = None  # sent with every redirect (3xx)
    hits: list[Hit] = field(default_factory=list)
    release: anyio.Event = field(default_factory=anyio.Event)

    async def handle(self, request: Request) -> Response:
        hit = Hit(time.monotonic(), time.time(), dict(request.headers), await request.body())
        self.hits.append(hit)
        if self.hang:
            await self.release.wait()  # until the test ends: the notifier gives up first
        hit.status = self.answers.pop(0) if self.answers else 200
        return Response(status_code=hit.status, headers=self._headers(hit.status))

    def _headers(self, status: int) -> dict[str, str]:
        if self.retry_after and status >= 400:
            return {"Retry-After": self.retry_after}
        if self.location and 300 <= status < 400:
            return {"Location": self.location}
        return {}

    @property
    def accepted(self) -> list[Hit]:
        return [h for h in self.hits if h.status is not None and 200 <= h.status < 300]


@asynccontextmanager
async def serving(receiver: Receiver) -> AsyncIterator[str]:
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    async with serve_app(app) as url:
        try:
            yield f"{url}hook"
        finally:
            receiver.release.set()


def signature_ok(hit: Hit, secret: str = SECRET) -> bool:
    """Whether the README's verification accepts ``hit`` as signed with ``secret``, and it
    carries the body it was sent."""
    return readme_verify()(secret, hit.body, hit.headers) is not None


def legacy_signature_ok(hit: Hit, secret: str = SECRET) -> bool:
    """The older ``X-Reach-Signature``, as receivers written before Standard Webhooks check it:
    HMAC-SHA256 of ``<timestamp>.<body>`` under the secret's bytes."""
    stamp = hit.headers["x-reach-timestamp"]
    mac = hmac.new(secret.encode(), stamp.encode() + b"." + hit.body, hashlib.sha256)
    fresh = time.time() - int(stamp) < 300
    return fresh and hmac.compare_digest(
        hit.headers["x-reach-signature"], f"sha256={mac.hexdigest()}"
    )
