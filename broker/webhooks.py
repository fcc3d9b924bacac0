"""Webhooks, pure: which ``callback_url`` may be called, which addresses a delivery may connect
to, and how a delivery is signed.

Signing follows the Standard Webhooks specification (https://www.standardwebhooks.com/), so a
receiver verifies with the ``standardwebhooks`` library or any of its ports:

- ``webhook-id``: the answer's id (``<message id>.<attempt>``, :func:`broker.results.webhook_id`):
  the same on every resend of one ending, so receivers de-duplicate on it;
- ``webhook-timestamp``: Unix seconds when this try was sent (receivers refuse old ones);
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>``.

The key: a ``webhook_secret`` of the form ``whsec_<base64>`` is the base64 after the prefix,
decoded (what ``standardwebhooks.Webhook("whsec_...")`` does); any other secret is its UTF-8
bytes (a receiver passes those bytes: ``Webhook(secret.encode())``).

The older ``X-Reach-*`` headers are still sent so that existing receivers keep working —
``X-Reach-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`` — but they sign
neither the id nor the attempt: only the ``webhook-*`` headers count.

The allow-list (``callback_hosts``) is parsed once into an :class:`Allowlist`. An entry is a
host name (any port), ``host:port`` (that port only), an IP address (``127.0.0.1``, ``::1``,
``[::1]:8080``) or a network in CIDR notation (``10.0.0.0/8``, ``fd00::/8``). A URL is allowed
by its host (:func:`callback_problem`); at connect time every address the host resolves to is
checked again (:func:`address_problem`): a loopback, link-local, private, unspecified,
multicast or otherwise reserved address is refused unless an IP or CIDR entry covers it, so a
name on the list cannot be pointed at the broker's own network (SSRF).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import SplitResult, urlsplit

from .errors import quoted
from .redaction import split_problem, url_without_password

# Standard Webhooks: what counts
WEBHOOK_ID_HEADER = "webhook-id"
WEBHOOK_TIMESTAMP_HEADER = "webhook-timestamp"
WEBHOOK_SIGNATURE_HEADER = "webhook-signature"
# kept for existing receivers; not signed together with the id
SIGNATURE_HEADER = "X-Reach-Signature"
TIMESTAMP_HEADER = "X-Reach-Timestamp"
MESSAGE_ID_HEADER = "X-Reach-Message-Id"
ATTEMPT_HEADER = "X-Reach-Delivery-Attempt"

SECRET_PREFIX = "whsec_"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


# -- signing ---------------------------------------------------------------------------------


def webhook_key(secret: str) -> bytes:
    """The HMAC key of ``secret``: the base64 after ``whsec_`` decoded, else its UTF-8 bytes.
    Raises ``ValueError`` (saying why, never showing the secret) for a ``whsec_`` secret that
    is not strict base64 (padding optional) or decodes to nothing."""
    if not secret.startswith(SECRET_PREFIX):
        return secret.encode()
    encoded = secret[len(SECRET_PREFIX) :].rstrip("=")
    try:
        # strict: the library skips characters outside the alphabet, which would make its key
        # differ from ours without a word; refuse those instead
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except ValueError as exc:  # binascii.Error, or a character that is not ASCII
        raise ValueError(
            f"a {SECRET_PREFIX} secret must be base64 after the prefix: {exc}"
        ) from exc
    if not key:
        raise ValueError(f"a {SECRET_PREFIX} secret must have a key after the prefix")
    return key


def webhook_secret_problem(secret: str) -> str | None:
    """Why ``secret`` cannot sign webhooks, or ``None`` when it can."""
    try:
        webhook_key(secret)
    except ValueError as exc:
        return str(exc)
    return None


def standard_signature(key: bytes, webhook_id: str, timestamp: str, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,`` and the base64 HMAC-SHA256 of
    ``<id>.<timestamp>.<body>``."""
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The older ``X-Reach-Signature`` value for ``body`` sent at ``timestamp`` (the secret's
    UTF-8 bytes are the key, whatever its form)."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def signature_valid(secret: str, timestamp: str, body: bytes, header: str) -> bool:
    return hmac.compare_digest(signature(secret, timestamp, body), header)


@dataclass(frozen=True, slots=True)
class Signer:
    """Signs deliveries under one ``webhook_secret``; its key is derived once."""

    secret: str
    key: bytes

    @classmethod
    def from_secret(cls, secret: str) -> Signer:
        """Raises ``ValueError`` as :func:`webhook_key` does."""
        return cls(secret, webhook_key(secret))

    def headers(
        self, *, webhook_id: str, message_id: str, timestamp: int, body: bytes, attempt: int
    ) -> dict[str, str]:
        """Every header of one POST of ``body``: the signed Standard Webhooks ones, and the
        ``X-Reach-*`` ones kept for older receivers."""
        stamp = str(timestamp)
        return {
            "Content-Type": "application/json",
            WEBHOOK_ID_HEADER: webhook_id,
            WEBHOOK_TIMESTAMP_HEADER: stamp,
            WEBHOOK_SIGNATURE_HEADER: standard_signature(self.key, webhook_id, stamp, body),
            MESSAGE_ID_HEADER: message_id,
            TIMESTAMP_HEADER: stamp,
            SIGNATURE_HEADER: signature(self.secret, stamp, body),
            ATTEMPT_HEADER: str(attempt),
        }


# -- the allow-list --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allowlist:
    """``callback_hosts`` parsed: host names allowed on any port, ``(host, port)`` pairs, and
    networks (an IP entry is a one-address network) with the port they allow (``None``: any).
    ``unusable`` keeps the entries that name nothing (``10.0.0.0/33``, ``host:http``), so that
    a process can say so at start; they allow nothing."""

    entries: tuple[str, ...]
    hosts: frozenset[str]
    host_ports: frozenset[tuple[str, int]]
    networks: tuple[tuple[IPNetwork, int | None], ...]
    unusable: tuple[str, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Allowlist:
        return _parse_allowlist(tuple(entries))

    def allows_host(self, host: str, port: int) -> bool:
        """Whether a URL's host (as ``urlsplit`` gives it: no brackets) and port are listed,
        by name or, for an IP literal, by an IP or CIDR entry."""
        host = host.lower()
        if host in self.hosts or (host, port) in self.host_ports:
            return True
        address = parse_address(host)
        return address is not None and self.covers(address, port)

    def covers(self, address: IPAddress, port: int) -> bool:
        """Whether an IP or CIDR entry covers ``address`` on ``port``. An IPv4 address inside
        IPv6 (``::ffff:10.0.0.1``) is also covered by the entries of that IPv4 address."""
        candidates = [address]
        if (inner := embedded_ipv4(address)) is not None:
            candidates.append(inner)
        return any(
            candidate.version == network.version
            and candidate in network
            and allowed in (None, port)
            for candidate in candidates
            for network, allowed in self.networks
        )

    def describe(self) -> str:
        return ", ".join(sorted(self.entries)) or "none configured"


@lru_cache(maxsize=64)
def _parse_allowlist(entries: tuple[str, ...]) -> Allowlist:
    hosts: set[str] = set()
    host_ports: set[tuple[str, int]] = set()
    networks: list[tuple[IPNetwork, int | None]] = []
    unusable: list[str] = []
    for entry in entries:
        match parse_entry(entry):
            case str() as host:
                hosts.add(host)
            case (str() as host, int() as port):
                host_ports.add((host, port))
            case (network, port):
                networks.append((network, port))
            case None:
                unusable.append(entry)
    return Allowlist(
        entries, frozenset(hosts), frozenset(host_ports), tuple(networks), tuple(unusable)
    )


Entry = str | tuple[str, int] | tuple[IPNetwork, int | None] | None


def parse_entry(entry: str) -> Entry:
    """One allow-list entry: a host name (lower case), ``(host, port)``, ``(network, port or
    None)`` for an IP or CIDR entry, or ``None`` when it names nothing."""
    text = entry.strip().lower()
    if not text or any(c.isspace() for c in text):
        return None
    if "/" in text:
        try:
            return ipaddress.ip_network(text, strict=False), None
        except ValueError:
            return None
    if (address := parse_address(text)) is not None:
        return _one_address(address), None
    return _host_and_port(text)


def _host_and_port(text: str) -> Entry:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (an IP host becomes a network)."""
    host, port = text, None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")) or parse_address(host) is None:
            return None
        port = rest[1:] if rest else None
    elif ":" in text:
        host, port = text.rsplit(":", 1)
    if port is not None and not (
        port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536
    ):
        return None
    if not host or (":" in host and parse_address(host) is None):
        return None
    number = int(port) if port is not None else None
    if (address := parse_address(host)) is not None:
        return _one_address(address), number
    return host if number is None else (host, number)


def _one_address(address: IPAddress) -> IPNetwork:
    return ipaddress.ip_network(address.compressed.split("%", 1)[0])


def parse_address(text: str) -> IPAddress | None:
    """``text`` as an IP address (an IPv6 zone ``%eth0`` allowed), or ``None``."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


# -- addresses -------------------------------------------------------------------------------

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")

# (what to call it, whether an address is one); the first that holds names the refusal
_KINDS: tuple[tuple[str, Callable[[IPAddress], bool]], ...] = (
    ("unspecified", lambda a: a.is_unspecified),
    ("loopback", lambda a: a.is_loopback),
    ("link-local", lambda a: a.is_link_local),
    ("multicast", lambda a: a.is_multicast),
    ("private", lambda a: a.is_private),
    ("reserved", lambda a: a.is_reserved),
    ("non-global", lambda a: not a.is_global),
)

# the ranges a refusal suggests allowing, when the address is in one
_SUGGESTED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "100.64.0.0/10",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
    )
)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries and reaches: IPv4-mapped (``::ffff:a.b.c.d``,
    the same host on a dual-stack socket), 6to4 (``2002::/16``) or NAT64 (``64:ff9b::/96``,
    which a NAT64 gateway translates to that IPv4 address)."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    return None


def address_kind(address: IPAddress) -> str | None:
    """What makes ``address`` one a webhook must not reach unless allowed explicitly
    (``"loopback"``, ``"private"``, ...), or ``None`` for a globally routable address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address_kind(address.ipv4_mapped)  # the same host, over a dual-stack socket
    for kind, holds in _KINDS:
        if holds(address):
            return kind
    inner = embedded_ipv4(address)
    if inner is not None and (inner_kind := address_kind(inner)) is not None:
        return f"{inner_kind} (IPv4 {inner} inside IPv6)"
    return None


def address_problem(address: str, port: int, allowlist: Allowlist) -> str | None:
    """Why a delivery may not connect to ``address`` (an IP, as a resolver returns it) on
    ``port``, or ``None`` when it may: a globally routable address, or one an IP or CIDR
    entry covers."""
    parsed = parse_address(address)
    if parsed is None:
        return f"{address!r} is not an IP address"
    if allowlist.covers(parsed, port):
        return None
    kind = address_kind(parsed)
    if kind is None:
        return None
    return (
        f"{address} is a {kind} address and no callback_hosts entry covers it"
        f" (to allow it, add {_allow_hint(parsed)} to callback_hosts)"
    )


def _allow_hint(address: IPAddress) -> str:
    """The entries that would allow ``address``: itself, and the well-known range it is in."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # an IPv4 entry covers it, and reads better
    bare = address.compressed.split("%", 1)[0]
    network = next((n for n in _SUGGESTED if n.version == address.version and address in n), None)
    return bare if network is None else f"{bare} or {network}"


# -- callback URLs ---------------------------------------------------------------------------

# the longest URL results or events are POSTed to (an envelope's callback_url, a subscription)
MAX_URL_LENGTH = 2048


def http_url_parts(url: str) -> SplitResult | None:
    """``url`` split, when it is an ``http://`` or ``https://`` URL of a host whose port
    parses, else ``None``: every URL the broker and its sidecars call out to. What does not
    parse at all raises ``ValueError``."""
    parts = urlsplit(url)
    parts.port  # noqa: B018 - read only to be checked: a port out of range raises
    return parts if parts.scheme in ("http", "https") and parts.hostname else None


def callback_url_problem(url: str) -> str | None:
    """Why ``url`` is no http(s) URL with a host of at most :data:`MAX_URL_LENGTH`
    characters, or ``None``: the part of :func:`callback_problem` that needs no settings
    (``send`` checks it before it sends)."""
    # said back, kept, logged: no secret in it, and the length stated its own
    shown = quoted(url_without_password(url), length=len(url))
    if len(url) > MAX_URL_LENGTH:
        return f"callback_url {shown} is longer than {MAX_URL_LENGTH} characters"
    if any(c.isspace() or not c.isprintable() for c in url):
        # urlsplit reads around a tab or a line break; the HTTP client refuses them all,
        # so every delivery would fail: refused now (percent-encoded, they may be sent)
        return f"callback_url {shown} holds a space or a control character (percent-encode it)"
    try:
        parts = http_url_parts(url)
    except ValueError as exc:
        return f"callback_url {shown} is not a valid URL: {split_problem(exc)}"
    if parts is None:
        return f"callback_url {shown} must be an http:// or https:// URL with a host"
    return None


def callback_problem(
    url: str, allowed_hosts: Allowlist | Collection[str], secret: str | None
) -> str | None:
    """Why results may not be POSTed to ``url``, or ``None`` when they may: an http(s) URL
    whose host is on the allow-list (by name, ``host:port``, or — an IP literal — by an IP or
    CIDR entry), with a secret configured. Where the host's name resolves to is checked at
    connect time (:func:`address_problem`)."""
    allowlist = allowed_hosts if isinstance(allowed_hosts, Allowlist) else _parse(allowed_hosts)
    if problem := callback_url_problem(url):
        return problem
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not allowlist.allows_host(host, port):
        return (
            f"callback_url host {host!r} is not allowed (allowed: {allowlist.describe()}; set"
            " callback_hosts or AGENT_REACH_CALLBACK_HOSTS)"
        )
    if not secret:
        return "webhooks are off: no webhook_secret (or AGENT_REACH_WEBHOOK_SECRET) is configured"
    return None


def _parse(entries: Collection[str]) -> Allowlist:
    return _parse_allowlist(tuple(entries))
