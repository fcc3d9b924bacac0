"""The egress guard (``workers/egress.py``) with real sockets: real HTTP and TLS servers on
127.0.0.1, httpcore's real network backend underneath. Names other than ``localhost`` are
resolved by a resolver the test passes (no query leaves the machine); what it answers stands
for a DNS answer, including one that changes between two lookups (rebinding)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import anyio
import httpcore
import httpx
import pytest
import trustme
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.tls import TLSListener
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from adapters.asgi import serve_app
from broker.webhooks import Allowlist
from workers.egress import EgressRefused, GuardedBackend, guarded_client

TIMEOUT = httpx.Timeout(5.0)
LIMITS = httpx.Limits(max_connections=4)


class Answers:
    """A resolver that answers from a list, one answer per lookup (the last one repeats), and
    counts the lookups."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class Recording(httpcore.AnyIOBackend):
    """httpcore's own backend, noting every host it is asked to connect to."""

    def __init__(self) -> None:
        self.hosts: list[str] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        self.hosts.append(host)
        return await super().connect_tcp(host, port, timeout, local_address, socket_options)


@asynccontextmanager
async def http_server() -> AsyncIterator[int]:
    """A real HTTP server on 127.0.0.1 answering ``hello``; yields its port."""

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    app = Starlette(routes=[Route("/", hello)])
    async with serve_app(app) as url:
        port = httpx.URL(url).port
        assert port is not None
        yield port


@asynccontextmanager
async def tls_server(ca: trustme.CA, certified_name: str) -> AsyncIterator[int]:
    """A TLS server on 127.0.0.1 with a certificate for ``certified_name`` only, answering
    every request ``200 ok``; yields its port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(certified_name).configure_cert(context)
    tcp = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = tcp.extra(SocketAttribute.local_port)
    listener = TLSListener(tcp, context, standard_compatible=False, handshake_timeout=5)

    async def answer(stream: ByteStream) -> None:
        async with stream:
            request = b""
            with anyio.move_on_after(5):
                while b"\r\n\r\n" not in request and len(request) < 65536:
                    request += await stream.receive()
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
            )

    async with listener, anyio.create_task_group() as tg:  # closed after serving stopped
        tg.start_soon(listener.serve, answer)
        try:
            yield port
        finally:
            tg.cancel_scope.cancel()


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def get(
    url: str, allowlist: list[str], resolver: Answers, verify: ssl.SSLContext | bool = True
) -> httpx.Response:
    async with guarded_client(
        Allowlist.parse(allowlist), timeout=TIMEOUT, limits=LIMITS, resolver=resolver, verify=verify
    ) as client:
        return await client.get(url)


# -- the tests -------------------------------------------------------------------------------


async def test_tls_verifies_the_url_s_name_though_the_checked_address_is_dialled() -> None:
    ca = trustme.CA()
    resolver = Answers(["127.0.0.1"])
    with anyio.fail_after(20):
        async with tls_server(ca, "hooks.test") as port:
            response = await get(
                f"https://hooks.test:{port}/",
                ["hooks.test", "127.0.0.1"],
                resolver,
                verify=client_context(ca),
            )

    assert response.status_code == 200
    assert response.text == "ok"
    assert resolver.lookups == ["hooks.test"]


async def test_a_certificate_for_another_name_is_refused() -> None:
    ca = trustme.CA()
    with anyio.fail_after(20):
        async with tls_server(ca, "elsewhere.test") as port:
            with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
                await get(
                    f"https://hooks.test:{port}/",
                    ["hooks.test", "127.0.0.1"],
                    Answers(["127.0.0.1"]),
                    verify=client_context(ca),
                )


async def test_the_checked_address_is_dialled_never_the_name_again() -> None:
    # the second answer is what a rebinding DNS server would give a second lookup
    resolver = Answers(["127.0.0.1"], ["10.0.0.1"])
    inner = Recording()
    allowlist = Allowlist.parse(["hooks.test", "127.0.0.1"])
    backend = GuardedBackend(allowlist, inner=inner, resolver=resolver)
    with anyio.fail_after(20):
        async with http_server() as port:
            stream = await backend.connect_tcp("hooks.test", port, timeout=5)
            request = f"GET / HTTP/1.1\r\nHost: hooks.test:{port}\r\nConnection: close\r\n\r\n"
            await stream.write(request.encode())
            answer = b""
            while chunk := await stream.read(65536, timeout=5):
                answer += chunk
            await stream.aclose()

    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello")
    assert resolver.lookups == ["hooks.test"]  # one lookup, checked, then the address itself
    assert inner.hosts == ["127.0.0.1"]


async def test_of_a_mixed_answer_only_the_permitted_addresses_are_dialled() -> None:
    inner = Recording()
    backend = GuardedBackend(
        Allowlist.parse(["hooks.test", "127.0.0.0/8"]),
        inner=inner,
        resolver=Answers(["10.255.255.1", "169.254.169.254", "127.0.0.2", "127.0.0.1"]),
    )
    with anyio.fail_after(20):
        async with http_server() as port:
            # nothing listens on 127.0.0.2 at that port: refused, so the next one is tried
            stream = await backend.connect_tcp("hooks.test", port, timeout=5)
            await stream.aclose()

    assert inner.hosts == ["127.0.0.2", "127.0.0.1"]


async def test_no_permitted_address_is_refused_before_any_connection() -> None:
    inner = Recording()
    backend = GuardedBackend(
        Allowlist.parse(["hooks.test"]),
        inner=inner,
        resolver=Answers(["169.254.169.254", "fd00::1"]),
    )

    with pytest.raises(EgressRefused) as info:
        await backend.connect_tcp("hooks.test", 80, timeout=5)

    assert inner.hosts == []
    assert str(info.value) == (
        "refused to connect to hooks.test:80: 169.254.169.254 is a link-local address and no"
        " callback_hosts entry covers it (to allow it, add 169.254.169.254 or 169.254.0.0/16"
        " to callback_hosts); fd00::1 is a private address and no callback_hosts entry covers"
        " it (to allow it, add fd00::1 or fc00::/7 to callback_hosts)"
    )


async def test_a_refusal_leaves_the_http_client_as_itself_not_as_a_transport_error() -> None:
    with anyio.fail_after(20):
        async with http_server() as port:
            with pytest.raises(EgressRefused, match=r"127\.0\.0\.1 is a loopback address"):
                await get(f"http://localhost:{port}/", ["localhost"], Answers(["127.0.0.1"]))
            allowed = await get(
                f"http://localhost:{port}/", ["localhost", "127.0.0.0/8"], Answers(["127.0.0.1"])
            )

    assert allowed.text == "hello"


async def test_localhost_is_resolved_for_real_and_refused() -> None:
    backend = GuardedBackend(Allowlist.parse(["localhost"]), inner=(inner := Recording()))

    with pytest.raises(EgressRefused, match=r"^refused to connect to localhost:80: .*loopback"):
        await backend.connect_tcp("localhost", 80, timeout=5)
    assert inner.hosts == []


async def test_a_name_that_does_not_resolve_may_be_tried_again() -> None:
    async def no_such_name(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    backend = GuardedBackend(Allowlist.parse(["hooks.test"]), resolver=no_such_name)

    with pytest.raises(httpcore.ConnectError, match=r"cannot resolve hooks\.test"):
        await backend.connect_tcp("hooks.test", 80, timeout=5)


async def test_a_resolver_that_never_answers_is_a_connect_timeout() -> None:
    async def silent(host: str, port: int) -> list[str]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    backend = GuardedBackend(Allowlist.parse(["hooks.test"]), resolver=silent)

    with anyio.fail_after(5), pytest.raises(httpcore.ConnectTimeout):
        await backend.connect_tcp("hooks.test", 80, timeout=0.2)


async def test_unix_sockets_are_refused() -> None:
    backend = GuardedBackend(Allowlist.parse(["hooks.test"]))

    with pytest.raises(EgressRefused, match="over TCP only"):
        await backend.connect_unix_socket("/run/docker.sock")
