"""What a Redis URL may say, decided once for every connection any process opens
(:meth:`broker.resp.RespConnection.open`), and for the settings before anything connects:

- ``redis://[[user]:password@]host[:port][/db]``, ``unix:///path/to/socket``;
- ``rediss://...`` for TLS, with the query parameters ``ssl_ca_certs`` (the CA bundle that
  signs the server's certificate; default: the system's), ``ssl_certfile`` and
  ``ssl_keyfile`` (our certificate and key, for a server that checks clients), and
  ``ssl_cert_reqs``: ``required`` (the default: the certificate chain and the host name are
  verified), ``optional`` (the chain is verified, the host name is not: a certificate
  issued to a name, reached by its address) or ``none`` (nothing is verified: encrypted,
  not authenticated).

Any other query parameter, an ``ssl_*`` one on a URL that is not ``rediss://``, a port of 0,
or (when :func:`broker.resp.tls_context` reads them) a file that cannot be read is a
:class:`~broker.errors.ConfigError` naming it: a process with a wrong URL stops at start-up
with that sentence instead of retrying for ever.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import ConfigError, quoted
from .redaction import split_problem

DEFAULT_PORT = 6379
MAX_DB = 2**31 - 1  # SELECT takes an int; the server counts its databases in one
CertReqs = Literal["required", "optional", "none"]
CERT_REQS: tuple[CertReqs, ...] = ("required", "optional", "none")
_CERT_REQS: dict[str, CertReqs] = {name: name for name in CERT_REQS}
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


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
    if blank := next((c for c in url if c.isspace() or not c.isprintable()), None):
        # urlsplit drops tabs and line breaks wherever they are: refused, not read around
        raise _url_error(
            f"a URL holds no spaces nor control characters (percent-encode them: a space is"
            f" %20); found {blank!r}"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number, a malformed IPv6 host
        raise _url_error(f"not a usable Redis URL: {split_problem(exc)}") from exc
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
    if port == 0:
        raise _url_error("port 0 is no server's port (leave the port out for 6379)")
    return RedisAddress(
        host=parts.hostname or "127.0.0.1",
        port=DEFAULT_PORT if port is None else port,
        unix_path=unix_path,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        db=_db(parts.path) if scheme != "unix" else 0,
        tls=tls,
    )


def _query(query: str) -> dict[str, str]:
    """The query parameters; an unknown or repeated one is an error naming it."""
    pairs = parse_qsl(query, keep_blank_values=True)
    counts = Counter(name for name, _ in pairs)
    unknown = sorted(name for name in counts if name not in TLS_PARAMETERS)
    if unknown:
        raise _url_error(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} "
            f"{_names(unknown)}; known: {', '.join(TLS_PARAMETERS)}"
        )
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise _url_error(f"query parameter {_names(repeated)} given twice")
    empty = sorted(name for name, value in pairs if not value)
    if empty:
        raise _url_error(f"query parameter {', '.join(map(repr, empty))} has no value")
    return dict(pairs)


def _names(names: list[str]) -> str:
    """Parameter names for a message: the first few, quoted, and how many more."""
    shown = ", ".join(quoted(name) for name in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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
        raise _url_error(f"the database (the URL's path) must be a number, got {quoted(name)}")
    if len(name) > 9 or int(name) > MAX_DB:  # a server's databases are counted in an int
        raise _url_error(f"the database (the URL's path) must be at most {MAX_DB}")
    return int(name)


def url_host(host: str) -> str:
    """``host`` as a URL names it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
