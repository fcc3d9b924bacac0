"""TLS on every connection: ``rediss://`` URLs with ``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile`` and ``ssl_cert_reqs``, against a Redis >= 7 that listens only on TLS and
checks client certificates (certificates from ``trustme``). And what a Redis URL may not say.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import anyio
import anyio.abc
import msgspec
import pytest
import trustme
from anyio.streams.tls import TLSStream
from hypothesis import given
from hypothesis import strategies as st

from broker.client import Client
from broker.config import Settings
from broker.connection import open_connection, wait_until_ready
from broker.embedded import RedisServer, free_port
from broker.errors import ConfigError, RedisUnavailable
from broker.redis_url import TlsOptions, parse_redis_url
from broker.resp import RespConnection, tls_context
from broker.stages import Stage
from tests.support.agents import http_agent
from tests.support.harness import running_dispatcher, running_sidecar
from tests.support.processes import AGENT_REACH, process_env

# Marked here, not only by the conftest's hook: anyio rebuilds the items it marks late
# without their other parameters.
pytestmark = pytest.mark.anyio


@pytest.fixture(
    params=[("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """On both loops a command may run on (``workers/cli/event_loop.py``): TLS is where
    uvloop's transports differ most from asyncio's."""
    params: tuple[str, dict[str, bool]] = request.param
    return params


# -- a Redis that speaks only TLS ----------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate and a client certificate, as files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def write_pki(directory: Path, ca: trustme.CA, *server_names: str) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    server = ca.issue_cert(*server_names)
    client = ca.issue_cert("agent-reach-client")
    pki = Pki(*(directory / name for name in ("ca.pem", "s.pem", "s.key", "c.pem", "c.key")))
    ca.cert_pem.write_to_path(str(pki.ca))
    server.cert_chain_pems[0].write_to_path(str(pki.server_cert))
    server.private_key_pem.write_to_path(str(pki.server_key))
    client.cert_chain_pems[0].write_to_path(str(pki.client_cert))
    client.private_key_pem.write_to_path(str(pki.client_key))
    return pki


@dataclass(frozen=True)
class TlsRedis:
    port: int
    pki: Pki

    def url(self, *, host: str = "127.0.0.1", client_cert: bool = True, **more: str) -> str:
        query = {"ssl_ca_certs": str(self.pki.ca)}
        if client_cert:
            query |= {"ssl_certfile": str(self.pki.client_cert)}
            query |= {"ssl_keyfile": str(self.pki.client_key)}
        return f"rediss://{host}:{self.port}/0?{urlencode(query | more)}"


def start_tls_redis(binary: Path, directory: Path, pki: Pki) -> RedisServer:
    """``redis-server --port 0 --tls-port P --tls-auth-clients yes``: TLS only, client
    certificates required. Ready once its TLS port accepts connections."""
    port = free_port()
    args = [str(binary), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
    args += ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)]
    args += ["--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "yes"]
    args += ["--dir", str(directory), "--save", "", "--appendonly", "no"]
    args += ["--logfile", str(directory / "redis.log"), "--daemonize", "no"]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    server = RedisServer(process, port, directory)
    deadline = time.monotonic() + 10
    while not _accepts(port):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            log = (
                (directory / "redis.log").read_text() if (directory / "redis.log").exists() else ""
            )
            pytest.fail(f"redis-server with TLS did not start on port {port}: {log[-2000:]}")
        time.sleep(0.02)
    return server


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory, redis7_binary: Path) -> Iterator[TlsRedis]:
    directory = tmp_path_factory.mktemp("tls")
    pki = write_pki(directory / "pki", trustme.CA(), "127.0.0.1")
    server = start_tls_redis(redis7_binary, directory, pki)
    yield TlsRedis(server.port, pki)
    server.stop()


def tls_settings(settings: Settings, url: str) -> Settings:
    return msgspec.structs.replace(settings, redis_url=url)


# -- end to end over TLS -------------------------------------------------------------------


async def test_broker_sidecar_and_client_end_to_end_over_mutual_tls(
    tls_redis: TlsRedis, settings: Settings
) -> None:
    secure = tls_settings(settings, tls_redis.url())
    assert secure.redis_url is not None
    async with (
        open_connection(secure, secure.redis_url) as broker,
        running_dispatcher(broker),  # and a reaper
        http_agent("a") as agent,
        open_connection(secure, secure.redis_url) as sidecar,
        running_sidecar(sidecar, "a-1", ("text.echo",), url=agent.url),
        open_connection(secure, secure.redis_url) as produce,
        Client(produce) as client,
    ):
        result = await client.request("text.echo", {"x": 1}, timeout=30)
        timeline = (await client.trace(result.id)).timeline
    assert result.ok and result.result["echo"] == {"x": 1}
    assert [e.stage for e in timeline][-1] is Stage.SUCCEEDED
    with pytest.raises(RedisUnavailable, match="cannot connect"):  # nothing but TLS there
        await wait_until_ready(f"redis://127.0.0.1:{tls_redis.port}/0")


async def test_a_wrong_ca_is_a_clear_redis_unavailable(
    tls_redis: TlsRedis, settings: Settings, tmp_path: Path
) -> None:
    other = write_pki(tmp_path, trustme.CA(), "127.0.0.1")
    url = tls_redis.url(ssl_ca_certs=str(other.ca))
    with pytest.raises(RedisUnavailable) as caught:
        async with open_connection(tls_settings(settings, url), url):
            pass
    said = str(caught.value)
    assert f"cannot connect to redis at rediss://127.0.0.1:{tls_redis.port}/0" in said
    assert "certificate was not accepted" in said and "ssl_ca_certs" in said
    # not verifying at all connects (encrypted, not authenticated), as documented
    unverified = tls_redis.url(ssl_ca_certs=str(other.ca), ssl_cert_reqs="none")
    conn = await RespConnection.open(unverified)
    assert await conn.execute([("PING",)]) == [b"PONG"]
    await conn.close()


async def test_without_a_client_certificate_a_server_that_wants_one_refuses_clearly(
    tls_redis: TlsRedis, settings: Settings
) -> None:
    url = tls_redis.url(client_cert=False)
    with pytest.raises(RedisUnavailable) as caught:
        async with open_connection(tls_settings(settings, url), url):
            pass
    said = str(caught.value)
    assert "cannot connect to redis at" in said
    assert "client certificate" in said and "ssl_certfile" in said


async def test_one_timeout_bounds_the_open_handshake_and_set_up_together(tmp_path: Path) -> None:
    """A server slow to finish its TLS handshake that then never answers: the open fails
    once its timeout has passed since it began, not the handshake's time plus a whole
    timeout more for the set-up."""
    pki = write_pki(tmp_path, trustme.CA(), "127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    handshake_delay_s, timeout_s = 1.0, 1.5

    async def slow_then_silent(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep(handshake_delay_s)  # the fault: a slow handshake
            tls = await TLSStream.wrap(stream, server_side=True, ssl_context=context)
            await tls.receive()  # the set-up's PING, never answered
            await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    url = f"rediss://127.0.0.1:{port}/0?{urlencode({'ssl_ca_certs': str(pki.ca)})}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, slow_then_silent)
        started = time.monotonic()
        with anyio.fail_after(10), pytest.raises(RedisUnavailable) as silent:
            await RespConnection.open(url, timeout_s=timeout_s)
        took_s = time.monotonic() - started
        tg.cancel_scope.cancel()
    assert "did not answer within 1.5 s" in str(silent.value)
    # the set-up had what was left of 1.5 s (0.5 s), not 1.5 s more (2.5 s in all)
    assert timeout_s <= took_s < handshake_delay_s + timeout_s - 0.3


async def test_optional_verifies_the_chain_but_not_the_host_name(
    tmp_path: Path, redis7_binary: Path
) -> None:
    ca = trustme.CA()
    pki = write_pki(tmp_path / "pki", ca, "redis.internal.example")  # not 127.0.0.1
    server = start_tls_redis(redis7_binary, tmp_path, pki)
    try:
        named = TlsRedis(server.port, pki)
        with pytest.raises(RedisUnavailable, match="certificate was not accepted"):
            await RespConnection.open(named.url())  # required: the name is checked
        conn = await RespConnection.open(named.url(ssl_cert_reqs="optional"))
        assert await conn.execute([("PING",)]) == [b"PONG"]
        await conn.close()
        stranger = write_pki(tmp_path / "other", trustme.CA(), "127.0.0.1")
        with pytest.raises(RedisUnavailable, match="certificate was not accepted"):
            await RespConnection.open(
                named.url(ssl_cert_reqs="optional", ssl_ca_certs=str(stranger.ca))
            )  # optional still checks who signed it
    finally:
        server.stop()


# -- what a URL may say --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("rediss://h:1/0?ssl_ca_cert=/x", "unknown query parameter 'ssl_ca_cert'"),
        ("redis://h:1/0?db=1&timeout=3", "unknown query parameters 'db', 'timeout'"),
        ("redis://h:1/0?ssl_ca_certs=/x", "only apply to TLS: use a rediss:// URL"),
        ("unix:///tmp/r.sock?ssl_certfile=/x", "only apply to TLS"),
        ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe': use required, optional"),
        ("rediss://h/0?ssl_keyfile=/k", "ssl_keyfile needs ssl_certfile"),
        ("rediss://h/0?ssl_ca_certs=a&ssl_ca_certs=b", "'ssl_ca_certs' given twice"),
        ("rediss://h/0?ssl_ca_certs=", "'ssl_ca_certs' has no value"),
        ("http://h:1/0", "unsupported scheme http://"),
        ("127.0.0.1:6379", "unsupported scheme"),
        ("redis://h:notaport/0", "not a usable Redis URL"),
        ("redis://h:1/zero", "must be a number, got 'zero'"),
        ("redis://h:1/" + "1" * 4301, "must be at most 2147483647"),  # int() raised
        ("redis://h:1/2147483648", "must be at most 2147483647"),
        ("redis:/\t/u:pw@h:1/0", "no spaces nor control characters"),  # urlsplit drops tabs
        ("redis://h:1/0\n", "no spaces nor control characters"),
        ("unix://", "needs the socket's path"),
    ],
)
def test_a_url_that_says_something_wrong_is_a_config_error_naming_it(url: str, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_redis_url(url)
    assert caught.value.key == "redis_url"
    assert said in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "rediss://user:hunter2@h:1/0?nope=1",
        # an unencoded / ends the authority: urllib then takes "hunter2" for the port
        "redis://user:hunter2/x@h:1/0",
        "redis://user:hunter2:99999999/x@h/0",  # ... or 99999999, out of range
    ],
)
def test_a_url_error_never_repeats_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_redis_url(url)
    assert "hunter2" not in str(caught.value) and "99999999" not in str(caught.value)


def test_a_url_is_read_as_it_says() -> None:
    address = parse_redis_url(
        "rediss://al%40ice:p%3Ass@[::1]:7000/3?ssl_cert_reqs=OPTIONAL&ssl_ca_certs=%2Fca.pem"
    )
    assert (address.host, address.port, address.db) == ("::1", 7000, 3)
    assert (address.username, address.password) == ("al@ice", "p:ss")
    assert address.tls == TlsOptions(ca_certs="/ca.pem", cert_reqs="optional")
    plain = parse_redis_url("redis://127.0.0.1")
    assert (plain.port, plain.db, plain.tls, plain.password) == (6379, 0, None, None)
    assert parse_redis_url("unix:///run/redis.sock").unix_path == "/run/redis.sock"


def test_a_file_that_cannot_be_read_is_a_config_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=f"ssl_ca_certs {missing}: cannot read it"):
        tls_context(TlsOptions(ca_certs=str(missing)))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"ssl_ca_certs .*not a PEM CA bundle"):
        tls_context(TlsOptions(ca_certs=str(garbage)))
    with pytest.raises(ConfigError, match=r"ssl_certfile .*not a PEM certificate"):
        tls_context(TlsOptions(certfile=str(garbage)))
    with pytest.raises(ConfigError, match=f"ssl_keyfile {missing}: cannot read it"):
        tls_context(TlsOptions(certfile=str(garbage), keyfile=str(missing)))


async def test_a_process_with_a_bad_url_stops_with_the_sentence(settings: Settings) -> None:
    url = "rediss://127.0.0.1:1/0?ssl_verify=no"
    with pytest.raises(ConfigError, match="unknown query parameter 'ssl_verify'"):
        async with open_connection(settings, url):
            pass
    env = process_env(settings, AGENT_REACH_REDIS_URL=url)
    done = await anyio.run_process([AGENT_REACH, "agents"], env=env, check=False)
    out = (done.stdout + done.stderr).decode()
    assert done.returncode == 2 and "ssl_verify" in out and "Traceback" not in out


_QUERY_WORDS = st.sampled_from(
    ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "db", "x", "", "&", "="]
)


@given(
    st.sampled_from(["redis", "rediss", "unix", "http", ""]),
    st.text(max_size=40),
    st.lists(st.tuples(_QUERY_WORDS, st.text(max_size=8)), max_size=4),
)
def test_any_url_parses_or_is_a_config_error(
    scheme: str, rest: str, query: list[tuple[str, str]]
) -> None:
    url = f"{scheme}://{rest}?{'&'.join(f'{k}={v}' for k, v in query)}"
    try:
        address = parse_redis_url(url)
    except ConfigError as exc:
        assert exc.key == "redis_url"
        return
    assert 0 < address.port < 65536 and address.db >= 0
    assert (address.tls is not None) == (scheme == "rediss")
