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
URL may say is decided here, once (:func:`parse_redis_url`):

- ``redis://[[user]:password@]host[:port][/db]``, ``unix:///path/to/socket``;
- ``rediss://...`` for TLS, with the query parameters ``ssl_ca_certs`` (the CA bundle that
  signs the server's certificate; default: the system's), ``ssl_certfile`` and
  ``ssl_keyfile`` (our certificate and key, for a server that checks clients), and
  ``ssl_cert_reqs``: ``required`` (the default: the certificate chain and the host name are
  verified), ``optional`` (the chain is verified, the host name is not: a certificate
  issued to a name, reached by its address) or ``none`` (nothing is verified: encrypted,
  not authenticated).

Any other query parameter, an ``ssl_*`` one on a URL that is not ``rediss://``, or a file
that cannot be read is a :class:`~broker.errors.ConfigError` naming it: a process with a
wrong URL stops at start-up with that sentence instead of retrying for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn
from urllib.parse import parse_qsl, unquote, urlsplit

import hiredis

from .errors import ConfigError, RedisReplyError, RedisUnavailable, script_error_code

Command = tuple[Any, ...]
_READ_CHUNK = 1 << 16
_DEFAULT_PORT = 6379

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

CertReqs = Literal["required", "optional", "none"]
CERT_REQS: tuple[CertReqs, ...] = ("required", "optional", "none")
_CERT_REQS: dict[str, CertReqs] = {name: name for name in CERT_REQS}
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


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


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """The TLS query parameters of a ``rediss://`` URL."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: CertReqs = "required"


@dataclass(frozen=True, slots=True)
class RedisAddress:
    """What a Redis URL says, checked: where to connect, who to be, which database."""

    host: str
    port: int
    unix_path: str | None = None
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: TlsOptions | None = None

    @property
    def where(self) -> str:
        """The server, for messages: ``host:port`` or the socket's path (never a secret)."""
        return self.unix_path if self.unix_path is not None else f"{self.host}:{self.port}"


def _url_error(problem: str) -> ConfigError:
    return ConfigError("redis_url", problem)


def parse_redis_url(url: str) -> RedisAddress:
    """A ``redis://``, ``rediss://`` or ``unix://`` URL as a :class:`RedisAddress`; anything
    else it says is a :class:`ConfigError` naming what is wrong (the message never repeats
    the URL: it may hold a password)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number, a malformed IPv6 host
        raise _url_error(f"not a usable Redis URL: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise _url_error(
            f"unsupported scheme {parts.scheme + '://' if parts.scheme else '(none)'}; "
            "use redis://, rediss:// (TLS) or unix://"
        )
    tls = _tls_options(scheme, _query(parts.query))
    unix_path = unquote(parts.path) if scheme == "unix" else None
    if unix_path == "":
        raise _url_error("a unix:// URL needs the socket's path: unix:///path/to/redis.sock")
    return RedisAddress(
        host=parts.hostname or "127.0.0.1",
        port=port or _DEFAULT_PORT,
        unix_path=unix_path,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        db=_db(parts.path) if scheme != "unix" else 0,
        tls=tls,
    )


def _query(query: str) -> dict[str, str]:
    """The query parameters; an unknown or repeated one is an error naming it."""
    pairs = parse_qsl(query, keep_blank_values=True)
    names = [name for name, _ in pairs]
    unknown = sorted({name for name in names if name not in TLS_PARAMETERS})
    if unknown:
        raise _url_error(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; known: {', '.join(TLS_PARAMETERS)}"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise _url_error(f"query parameter {', '.join(map(repr, repeated))} given twice")
    empty = sorted(name for name, value in pairs if not value)
    if empty:
        raise _url_error(f"query parameter {', '.join(map(repr, empty))} has no value")
    return dict(pairs)


def _tls_options(scheme: str, query: dict[str, str]) -> TlsOptions | None:
    if scheme != "rediss":
        if query:
            names = ", ".join(sorted(query))
            raise _url_error(f"{names} only apply to TLS: use a rediss:// URL")
        return None
    cert_reqs = _CERT_REQS.get(query.get("ssl_cert_reqs", "required").lower())
    if cert_reqs is None:
        raise _url_error(f"ssl_cert_reqs={query['ssl_cert_reqs']!r}: use {', '.join(CERT_REQS)}")
    if "ssl_keyfile" in query and "ssl_certfile" not in query:
        raise _url_error("ssl_keyfile needs ssl_certfile (the certificate that goes with it)")
    return TlsOptions(
        ca_certs=query.get("ssl_ca_certs"),
        certfile=query.get("ssl_certfile"),
        keyfile=query.get("ssl_keyfile"),
        cert_reqs=cert_reqs,
    )


def _db(path: str) -> int:
    name = unquote(path).strip("/")
    if not name:
        return 0
    if not name.isdigit() or not name.isascii():
        raise _url_error(f"the database (the URL's path) must be a number, got {name!r}")
    return int(name)


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
        raise _url_error(f"ssl_ca_certs {tls.ca_certs}: not a PEM CA bundle ({exc})") from exc
    if tls.certfile is not None:
        try:
            context.load_cert_chain(tls.certfile, tls.keyfile)
        except (OSError, ValueError) as exc:
            raise _url_error(
                f"ssl_certfile {tls.certfile}"
                + (f" with ssl_keyfile {tls.keyfile}" if tls.keyfile else "")
                + f": not a PEM certificate and matching key ({exc})"
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
        raise _url_error(f"{parameter} {path}: cannot read it ({exc.strerror or exc})") from exc


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
        the set-up, is :class:`RedisUnavailable`."""
        address = parse_redis_url(url)
        context = tls_context(address.tls) if address.tls is not None else None
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await _connect(address, context)
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable(f"cannot connect to {address.where}: {describe(exc)}") from exc
        conn = cls(reader, writer)
        try:
            await conn._set_up(address)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _set_up(self, address: RedisAddress) -> None:
        setup: list[Command] = []
        if address.password:
            user = address.username
            setup.append(("AUTH", user, address.password) if user else ("AUTH", address.password))
        if address.db:
            setup.append(("SELECT", address.db))
        if not setup:
            return
        try:
            replies = await self.execute(setup)
        except RedisUnavailable as exc:
            if not isinstance(exc.__cause__, OSError):
                raise
            raise RedisUnavailable(
                f"redis at {address.where} dropped the connection set-up: {describe(exc.__cause__)}"
            ) from exc.__cause__
        for reply in replies:
            if isinstance(reply, Exception):
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
