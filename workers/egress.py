"""The egress guard of webhook deliveries: an HTTP client that connects only where the allow-list
says results may go.

The allow-list (``callback_hosts``) names hosts, but a name says nothing about where it leads:
``hooks.example.com`` may resolve to ``127.0.0.1`` or ``10.0.0.5`` (misconfigured, or pointed
there on purpose) and a webhook would then reach the broker's own network. So the guard sits
where the connection is made, in the HTTP client's network backend (httpcore's
``AsyncNetworkBackend``, wrapping the default one):

1. resolve the host (``anyio.getaddrinfo``);
2. check every address it resolves to (:func:`broker.webhooks.address_problem`): a loopback,
   link-local, private, unspecified, multicast or otherwise reserved address is refused unless
   an IP or CIDR entry of the allow-list covers it;
3. connect to the checked addresses themselves, in the resolver's order, never to the name
   again: a DNS answer that changes between the check and the connection (rebinding) cannot
   slip past it.

TLS is unaffected: the handshake above this layer still sends and verifies the URL's host
name. When no address the host resolves to may be reached, :class:`EgressRefused` is raised
(not an ``httpx`` error: retrying cannot help, and the notifier ends the delivery at once).
Redirects are not followed by the notifier's client, and proxies from the environment are not
used: both would make the connection go somewhere this check never saw.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable

import anyio
import httpcore
import httpx

from broker.errors import ReachError
from broker.webhooks import Allowlist, address_problem

Resolver = Callable[[str, int], Awaitable[list[str]]]


class EgressRefused(ReachError):
    """Raised when a webhook's host resolves only to addresses the allow-list does not let a
    delivery reach; says which addresses and why. Final: a retry meets the same refusal."""

    def __init__(self, host: str, port: int, problems: list[str]) -> None:
        super().__init__(f"refused to connect to {host}:{port}: {'; '.join(problems)}")
        self.host = host
        self.port = port
        self.problems = problems


async def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to for a TCP connection, each once, in the resolver's
    order (an IP literal resolves to itself)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def permitted(host: str, port: int, addresses: list[str], allowlist: Allowlist) -> list[str]:
    """The addresses a delivery to ``host`` may connect to; raises :class:`EgressRefused`
    (naming every address and why) when there is none."""
    problems = {address: address_problem(address, port, allowlist) for address in addresses}
    allowed = [address for address, problem in problems.items() if problem is None]
    if not allowed:
        reasons = [problem for problem in problems.values() if problem is not None]
        raise EgressRefused(host, port, reasons or [f"{host} resolves to no address"])
    return allowed


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the check above: only TCP, only to permitted addresses.
    ``inner`` makes the connections (default: httpcore's anyio backend); ``resolver`` turns a
    host into addresses (default: :func:`resolve`; tests pass their own)."""

    def __init__(
        self,
        allowlist: Allowlist,
        *,
        inner: httpcore.AsyncNetworkBackend | None = None,
        resolver: Resolver = resolve,
    ) -> None:
        self.allowlist = allowlist
        self.inner = inner or httpcore.AnyIOBackend()
        self.resolver = resolver

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with anyio.fail_after(timeout):  # resolving counts against the connect timeout
                addresses = await self._resolve(host, port)
                allowed = permitted(host, port, addresses, self.allowlist)
                return await self._connect_first(allowed, port, local_address, socket_options)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} took too long") from exc

    async def _resolve(self, host: str, port: int) -> list[str]:
        try:
            return await self.resolver(host, port)
        except OSError as exc:  # no such name, or no resolver: worth another try later
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc

    async def _connect_first(
        self,
        addresses: list[str],
        port: int,
        local_address: str | None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None,
    ) -> httpcore.AsyncNetworkStream:
        """A connection to the first of ``addresses`` that accepts one; the last failure when
        none does."""
        failure: httpcore.ConnectError | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(
                    address, port, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                failure = exc
        assert failure is not None  # `permitted` returns at least one address
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise EgressRefused(path, 0, ["webhooks are delivered over TCP only"])

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a :class:`GuardedBackend`. ``verify`` is httpx's (tests pass an
    ``ssl.SSLContext`` trusting their own certificate authority)."""

    def __init__(
        self,
        allowlist: Allowlist,
        *,
        limits: httpx.Limits,
        verify: ssl.SSLContext | bool = True,
        resolver: Resolver = resolve,
    ) -> None:
        ssl_context = httpx.create_ssl_context(verify=verify)
        super().__init__(verify=ssl_context, limits=limits)
        # httpx has no public way to give its transport a network backend: the pool it built
        # is replaced by one built alike (no connection is open yet), over the guard.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=GuardedBackend(allowlist, resolver=resolver),
        )


def guarded_client(
    allowlist: Allowlist,
    *,
    timeout: httpx.Timeout,
    limits: httpx.Limits,
    verify: ssl.SSLContext | bool = True,
    resolver: Resolver = resolve,
) -> httpx.AsyncClient:
    """The notifier's HTTP client: guarded connections, no redirects followed, no proxy or
    ``.netrc`` from the environment."""
    return httpx.AsyncClient(
        transport=GuardedTransport(allowlist, limits=limits, verify=verify, resolver=resolver),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
    )
