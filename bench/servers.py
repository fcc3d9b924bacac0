"""The benches' throwaway redis-servers: each in a data directory of its own, removed once
the server stops, so repeated runs leave nothing behind in the temporary directory."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from broker.embedded import RedisServer


def throwaway_server(
    prefix: str, *, port: int | None = None, extra_args: Sequence[str] = ()
) -> RedisServer:
    """A fresh redis-server in a new temporary directory named ``prefix…`` (on a free port,
    unless ``port`` is given)."""
    data = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return RedisServer.start(data, port=port, extra_args=extra_args)
    except BaseException:  # it did not start (the port taken, say): nothing is left behind
        shutil.rmtree(data, ignore_errors=True)
        raise


def discard(server: RedisServer) -> None:
    """Stop ``server`` and remove its data directory."""
    try:
        server.stop()
    finally:
        shutil.rmtree(server.data_dir, ignore_errors=True)
