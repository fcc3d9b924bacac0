"""A real webhook receiver on loopback, and the README's signature check, verbatim."""

from __future__ import annotations

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

SECRET = "s3cret-for-tests"

# The README's receiver snippet, verbatim: the test runs exactly this text.
README_VERIFY = """\
import hashlib, hmac, time


def verify(secret: bytes, body: bytes, timestamp: str, signature: str) -> bool:
    mac = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature, "sha256=" + mac) and time.time() - int(timestamp) < 300
"""


def readme_verify() -> Callable[[bytes, bytes, str, str], bool]:
    namespace: dict[str, Any] = {}
    exec(README_VERIFY, namespace)
    verify: Callable[[bytes, bytes, str, str], bool] = namespace["verify"]
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
    hits: list[Hit] = field(default_factory=list)
    release: anyio.Event = field(default_factory=anyio.Event)

    async def handle(self, request: Request) -> Response:
        hit = Hit(time.monotonic(), time.time(), dict(request.headers), await request.body())
        self.hits.append(hit)
        if self.hang:
            await self.release.wait()  # until the test ends: the notifier gives up first
        hit.status = self.answers.pop(0) if self.answers else 200
        headers = (
            {"Retry-After": self.retry_after} if self.retry_after and hit.status >= 400 else {}
        )
        return Response(status_code=hit.status, headers=headers)

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


def signature_ok(hit: Hit) -> bool:
    return readme_verify()(
        SECRET.encode(),
        hit.body,
        hit.headers["x-reach-timestamp"],
        hit.headers["x-reach-signature"],
    )
