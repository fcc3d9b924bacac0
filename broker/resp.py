"""A lean RESP connection for pipelined commands: hiredis packs and parses, nothing else.

The coalescing pipeliner sends hundreds of short commands per round trip; through redis-py's
pipeline each reply costs a timeout context and a response callback, which profiled as the
largest cost of the dispatch path. This connection writes one packed buffer and reads the
replies straight out of a hiredis reader, so the broker depends on ``hiredis`` alone, not on
redis-py (only ``bench/pipeline.py`` uses redis-py, for its baseline: the ``bench`` extra).

This is the one Redis boundary: what Redis or the network says becomes our own errors here,
and nowhere else (the tree is drawn in :mod:`broker.errors`).

- Replies are raw RESP values (bytes, ints, lists); an error reply is returned in its place
  (not raised) as a :class:`~broker.errors.RedisReplyError` whose ``code`` is the reply's
  first word (``NOGROUP``, ``BUSYGROUP``, ``NOSCRIPT``, ``WRONGTYPE``, ``NOPERM``, ``ERR``, …),
  or, for the codes in :data:`TRANSIENT` ("cannot serve now"), a
  :class:`~broker.errors.RedisUnavailable` with that ``code``.
- A connection that cannot be opened, is dropped, or stays silent past its timeout raises
  :class:`~broker.errors.RedisUnavailable`, the original exception in ``__cause__``; the
  connection is then unusable and its owner drops it.

Every connection any process opens comes through :meth:`RespConnection.open`, so what a Redis
URL may say is decided once, in :mod:`broker.redis_url`; the files a ``rediss://`` URL names
are read here (:func:`tls_context`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from pathlib import Path
from typing import Any, NoReturn

import hiredis

from .errors import (
    ConfigError,
    RedisReplyError,
    RedisUnavailable,
    SetUpDropped,
    script_error_code,
)
from .redis_url import RedisAddress, TlsOptions, parse_redis_url

Command = tuple[Any, ...]
_READ_CHUNK = 1 << 16

# Error replies that mean "Redis cannot serve now" (loading its AOF, over maxmemory, a
# script running, a replica or a cluster in failover): retry later, like a lost connection.
TRANSIENT = frozenset(
    {
        "LOADING",
        "BUSY",
        "OOM",
        "READONLY",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "MISCONF",  # writes refused while the snapshot cannot be saved
        "NOREPLICAS",  # writes refused while too few replicas are connected
    }
)
_UNAVAILABLE = "redis unavailable: "
# A deadline this close is due: uvloop's timers fire on whole milliseconds, early too, and
# the watchdog would otherwise re-arm until the clock ticked over (resp.RespConnection).
_TIMER_SLACK_S = 0.001
# SO_LINGER on, 0 s: a close resets the connection and drops what is still unsent
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def error_reply(message: str) -> RedisReplyError | RedisUnavailable:
    """The error an error reply stands for (hiredis calls this for each one it parses); one
    met inside a script by its own code (:func:`~broker.errors.script_error_code`)."""
    error = RedisReplyError(message, code=script_error_code(message))
    if error.code in TRANSIENT:  # the code exactly: BUSYGROUP is no BUSY
        return RedisUnavailable(f"{_UNAVAILABLE}{message}", code=error.code)
    return error


def _lost(exc: Exception) -> RedisUnavailable:
    """A connection that failed under a command (closed, reset, a TLS alert)."""
    return RedisUnavailable(f"{_UNAVAILABLE}{describe(exc)}")


def tls_context(tls: TlsOptions) -> ssl.SSLContext:
    """The client TLS context of ``tls``; a file that cannot be read, or a certificate and
    key that do not load, is a :class:`ConfigError` naming the parameter and the file."""
    for parameter, path in (
        ("ssl_ca_certs", tls.ca_certs),
        ("ssl_certfile", tls.certfile),
        ("ssl_keyfile", tls.keyfile),
    ):
        if path is not None:
            _check_readable(parameter, path)
    try:
        context = ssl.create_default_context(cafile=tls.ca_certs)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(
            "redis_url", f"ssl_ca_certs {tls.ca_certs}: not a PEM CA bundle ({exc})"
        ) from exc
    if tls.certfile is not None:
        try:
            context.load_cert_chain(tls.certfile, tls.keyfile)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                "redis_url",
                f"ssl_certfile {tls.certfile}"
                + (f" with ssl_keyfile {tls.keyfile}" if tls.keyfile else "")
                + f": not a PEM certificate and matching key ({exc})",
            ) from exc
    if tls.cert_reqs != "required":
        context.check_hostname = False  # must go before verify_mode may drop to CERT_NONE
    if tls.cert_reqs == "none":
        context.verify_mode = ssl.CERT_NONE
    # "optional" keeps CERT_REQUIRED: a client always gets a certificate from the server,
    # and one it cannot verify is refused (Python's CERT_OPTIONAL means the same for a client)
    return context


def _check_readable(parameter: str, path: str) -> None:
    try:
        with Path(path).open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(
            "redis_url", f"{parameter} {path}: cannot read it ({exc.strerror or exc})"
        ) from exc


def describe(exc: BaseException) -> str:
    """A connection failure as a short reason; a TLS one says what to check."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"TLS: the server's certificate was not accepted ({exc.verify_message or exc}); "
            "check ssl_ca_certs, or ssl_cert_reqs"
        )
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or str(exc)
        if "CERTIFICATE_REQUIRED" in reason.upper():
            return "TLS: the server wants a client certificate (ssl_certfile, ssl_keyfile)"
        return f"TLS: {reason}"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__


# error replies to the set-up's PING that still say the server is there and serving: for want
# of a password or a right, or for a while (loading its data, running a long script)
_PING_ANSWERS = frozenset({"NOAUTH", "NOPERM", "LOADING", "BUSY"})


class RespConnection:
    """One connection to Redis: commands out in one write, replies back in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stream = reader
        self._writer = writer
        self._parser = hiredis.Reader(replyError=error_reply)
        self._loop = asyncio.get_running_loop()
        # the silence watchdog (execute): when the commands out must be answered by (loop
        # time; None while none is out), the one timer that checks it, and the timeout it
        # found run out (the connection is then closed under the read)
        self._deadline: float | None = None
        self._timeout_s = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._silent_for: float | None = None

    @classmethod
    async def open(cls, url: str, *, timeout_s: float = 10.0) -> RespConnection:
        """Connect to a ``redis://``, ``rediss://`` or ``unix://`` URL (see the module's
        docstring), then AUTH and SELECT as it says. A URL that says something wrong is a
        :class:`ConfigError`; a server that cannot be reached, or refuses the handshake or
        the set-up, is :class:`RedisUnavailable`. ``timeout_s`` bounds the whole open: the
        connection (with its TLS handshake) and the set-up together."""
        address = parse_redis_url(url)
        context = tls_context(address.tls) if address.tls is not None else None
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                reader, writer = await _connect(address, context)
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable(f"cannot connect to {address.where}: {describe(exc)}") from exc
        conn = cls(reader, writer)
        try:
            await conn._set_up(address, timeout_s, deadline)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _set_up(self, address: RedisAddress, timeout_s: float, deadline: float) -> None:
        """AUTH and SELECT as the URL says, or a PING: a server that takes the connection
        and never answers (a hung process, a port some other service holds) fails the open
        by its ``deadline`` (loop time; ``timeout_s`` after it began), not the first call's
        30 s later."""
        setup: list[Command] = []
        if address.password:
            user = address.username
            setup.append(("AUTH", user, address.password) if user else ("AUTH", address.password))
        if address.db:
            setup.append(("SELECT", address.db))
        try:
            left_s = max(_TIMER_SLACK_S, deadline - self._loop.time())
            replies = await self.execute(setup or [("PING",)], timeout_s=left_s)
        except RedisUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, TimeoutError):
                raise RedisUnavailable(
                    f"redis at {address.where} did not answer within {timeout_s:g} s"
                ) from cause
            if not isinstance(cause, OSError):
                raise
            raise SetUpDropped(
                f"redis at {address.where} dropped the connection set-up: {describe(cause)}"
            ) from cause
        # a PING refused for want of a password or a right, or for a while (_PING_ANSWERS),
        # is an answer all the same: the first call says what is wrong (or is retried, as
        # any call the server refuses for a while), as it did before there was a PING. Any
        # other refusal (protected mode, too many clients) is said now: the server closes
        # the connection after it.
        for reply in replies:
            if isinstance(reply, Exception) and (
                setup or getattr(reply, "code", None) not in _PING_ANSWERS
            ):
                raise RedisUnavailable(f"redis refused the connection set-up: {reply}")

    async def execute(self, commands: list[Command], *, timeout_s: float = 30.0) -> list[Any]:
        """Send every command in one write and return their replies in order (error replies
        in place, see the module's docstring). A dropped connection, or a silent peer (a
        partition: no FIN, no RST) after ``timeout_s``, raises :class:`RedisUnavailable`
        instead of hanging forever; the caller must then drop this connection.

        The silence is watched by one timer per connection, not one per call: a call sets
        its deadline, and the timer, armed once and moved on to the deadline of the call out
        when it fires, closes the connection under a call past its own. An ``asyncio.timeout``
        per call (a timer made, queued and cancelled every time, the cancelled ones left in
        the loop's heap) made a ``PING`` round trip 60 µs where this takes 37, and at 200
        messages a second the dispatcher and the sidecar spent 6-10 % more CPU a message
        (``bench.cpu_cost``, three interleaved runs each)."""
        if self._silent_for is not None:
            self._silent()
        self._deadline = self._loop.time() + timeout_s
        self._timeout_s = timeout_s
        if self._watchdog is None or self._watchdog.when() > self._deadline:
            self._watch(self._deadline)
        try:
            return await self._execute(commands)
        except (OSError, hiredis.ProtocolError) as exc:
            if self._silent_for is not None:
                self._silent()
            raise _lost(exc) from exc
        finally:
            self._deadline = None

    def _silent(self) -> NoReturn:
        """What a call is told once the watchdog found Redis silent: a timeout (in
        ``__cause__`` too, where a caller's own words for it read "no answer in time"), not
        the close that ended the read."""
        said = f"redis did not answer within {self._silent_for:g} s"
        raise RedisUnavailable(said) from TimeoutError(said)

    def _watch(self, when: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self._loop.call_at(when, self._check_silence)

    def _check_silence(self) -> None:
        """The watchdog's turn: nothing out, it rests until the next call; a call out whose
        deadline is later, it waits for that; a call out past its deadline, the connection
        is closed under it (its read ends at once, :meth:`execute` says why)."""
        self._watchdog = None
        if self._deadline is None:
            return
        if self._deadline - self._loop.time() > _TIMER_SLACK_S:  # a timer may fire early
            self._watch(self._deadline)
            return
        self._silent_for = self._timeout_s
        self._abandon()

    def _abandon(self) -> None:
        """Close the connection under a call out, with a reset: what the call wrote that the
        peer's host has not acknowledged (a partition: the kernel would go on sending it for
        minutes) is dropped, not delivered after the caller gave up on it and decided. What
        the peer's host already took is beyond recall: Redis still reads it."""
        sock = self._writer.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        self._writer.transport.abort()

    async def _execute(self, commands: list[Command]) -> list[Any]:
        self._writer.write(b"".join(hiredis.pack_command(c) for c in commands))
        await self._writer.drain()
        replies: list[Any] = []
        parser = self._parser
        while len(replies) < len(commands):
            reply = parser.gets()
            if reply is False:
                await self._feed()
                continue
            replies.append(reply)
        return replies

    async def read_one(self) -> Any:
        """The next reply or push message (for a subscribed connection); a dropped
        connection raises :class:`RedisUnavailable`."""
        try:
            while (reply := self._parser.gets()) is False:
                await self._feed()
        except (OSError, hiredis.ProtocolError) as exc:
            raise _lost(exc) from exc
        return reply

    async def _feed(self) -> None:
        data = await self._stream.read(_READ_CHUNK)
        if not data:
            raise ConnectionError("redis closed the connection")
        self._parser.feed(data)

    async def close(self) -> None:
        """Close the connection; a call still out on it ends at once (unavailable), rather
        than wait, unwatched, for a write to a peer that stopped reading."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._deadline is not None:
            self._abandon()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass


async def _connect(
    address: RedisAddress, context: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if address.unix_path is not None:
        return await asyncio.open_unix_connection(address.unix_path)
    return await asyncio.open_connection(address.host, address.port, ssl=context)
