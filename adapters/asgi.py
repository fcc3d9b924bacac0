"""Serving a small ASGI app (Starlette) with uvicorn inside the caller's event loop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import ClassVar

import anyio
import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from broker.errors import CannotListen
from broker.redis_url import url_host


@asynccontextmanager
async def serve_app(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    header_timeout_s: float | None = None,
    max_connections: int | None = None,
) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn in this event loop; yields its URL (``port`` 0: any).

    With ``header_timeout_s``, a connection whose request headers are not complete within
    that long — of its opening, or of the previous response — is closed (for endpoints open
    to clients we do not run: a client that never finishes its headers holds a connection
    for good otherwise). Without it, uvicorn's own protocol serves, as it chooses it. With
    ``max_connections``, past that many connections at once uvicorn answers 503."""
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=3,
        limit_concurrency=max_connections,
    )
    if header_timeout_s is not None:
        config.http = header_deadline_protocol(header_timeout_s)
    server = uvicorn.Server(config)

    async def serve() -> None:
        # Shielded: cancelled, uvicorn would leave its listener in the event loop's selector
        # and the next server on that port (a restart) would never see its connections.
        # It stops on `should_exit` instead, closing its listener and connections.
        with anyio.CancelScope(shield=True):
            await server.serve(sockets=[sock])

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        try:
            with anyio.fail_after(10):
                while not server.started:  # noqa: ASYNC110 - uvicorn offers no started event
                    await anyio.sleep(0.01)
            yield f"http://{url_host(host)}:{bound}/"
        finally:
            server.should_exit = True


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port``, of the family ``host`` names: an IPv6 address
    (``::1``; ``::``, every interface, takes IPv4 clients too) or a name that resolves to one
    first, else IPv4. What cannot be bound is :class:`CannotListen`, saying why."""
    where = f"{url_host(host)}:{port}"
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise CannotListen(f"cannot listen on {where}: {exc}") from exc
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and accepted sockets inherit it. Without it, a response written in two parts waits on
    # the client's delayed ACK: 40 ms a call.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise CannotListen(f"cannot listen on {where}: {why}") from exc
    return sock


# bytes a client may send ahead while its request is being answered (HTTP/1.1 pipelining)
PIPELINED_MAX = 64 * 1024
# the client's states while its request is answered (an Upgrade or CONNECT: might switch)
_ANSWERING = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)  # type: ignore[attr-defined]


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers.

    uvicorn times only the idle gap after a response (``timeout_keep_alive``, cancelled by
    the first byte that comes): a connection that opens and never completes its first
    request's headers — or sends half the next one — is held open for as long as its client
    likes. Here, whenever the connection waits for a request's headers (h11's client state
    is IDLE), a timer runs from when the wait began; it is stopped once the headers are in,
    and closes the connection when it fires. Bytes trickling in do not restart it."""

    header_timeout_s: ClassVar[float] = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    # at most this many bytes are in h11's buffer while a request is answered (None: not
    # known; see _read_on_while_answering)
    _buffered_at_most: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()
        self._read_on_while_answering(data)

    def _read_on_while_answering(self, data: bytes) -> None:
        """Bytes that come while a request is being answered (a pipelined request, or just
        junk) make uvicorn stop reading the socket until the answer is out, and with it the
        client's hang-up: an app that waits long for its answer (a blocking A2A send) would
        then wait on for no one. Reading goes on; what comes is kept in h11's buffer, up to
        :data:`PIPELINED_MAX` bytes; past them reading stays paused (as uvicorn left it: the
        answer under way is still given, the requests sent ahead served after it).

        h11 only adds to its buffer while it answers, so the bytes that came bound it from
        above; its exact length (``trailing_data`` copies the buffer) is read only when that
        bound passes the limit: a client dribbling bytes a few at a time would otherwise cost
        the server a copy of all it sent ahead for every few."""
        if self.conn.their_state not in _ANSWERING or self.transport.is_closing():
            self._buffered_at_most = None  # h11 reads its buffer between answers
            return
        at_most = self._buffered_at_most
        if at_most is not None:
            at_most += len(data)
        if at_most is None or at_most > PIPELINED_MAX:
            buffered, _ = self.conn.trailing_data
            at_most = len(buffered)
        self._buffered_at_most = at_most
        if at_most <= PIPELINED_MAX:
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        self._buffered_at_most = None  # the next request is read from the buffer
        super().on_response_complete()  # may start the next request's wait
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting:
            self._stop_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn instantiates per connection, with this deadline."""
    return type(
        "HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s}
    )
