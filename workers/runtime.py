"""Process plumbing shared by the commands: settings, the Redis connection (given or
embedded), and graceful shutdown on SIGTERM / SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import anyio
from anyio import CancelScope

from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.embedded import embedded_redis


@contextmanager
def redis_url(settings: Settings) -> Iterator[str]:
    """The configured Redis URL, else the embedded server's (started if none is running)."""
    if settings.redis_url:
        yield settings.redis_url
        return
    with embedded_redis(announce=_to_stderr) as url:
        yield url


def _to_stderr(sentence: str) -> None:
    print(f"agent-reach: {sentence}", file=sys.stderr, flush=True)


@asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[Connection]:
    with redis_url(settings) as url:
        async with open_connection(settings, url) as conn:
            yield conn


async def stop_on_signals(on_signal: Callable[[], None], scope: CancelScope) -> None:
    """First SIGTERM/SIGINT: ``on_signal`` (a graceful stop). A second: cancel ``scope``."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        count = 0
        async for _ in signals:
            count += 1
            if count == 1:
                on_signal()
            else:
                scope.cancel()


def configure_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
