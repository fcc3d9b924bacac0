"""Endpoints listen on IPv6 as well as IPv4 addresses (adapters/asgi.py), on loopback."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from adapters.asgi import serve_app
from broker.config import Settings
from broker.errors import CannotListen
from tests.support.harness import eventually
from tests.support.processes import process_env, start, stop


async def who(request: Request) -> PlainTextResponse:
    return PlainTextResponse(request.client.host if request.client else "")


APP = Starlette(routes=[Route("/", who)])


def port_of(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


@pytest.mark.anyio
async def test_an_ipv6_loopback_address_is_served_and_named_in_brackets() -> None:
    async with serve_app(APP, "::1", 0) as url, httpx.AsyncClient() as client:
        assert re.fullmatch(r"http://\[::1\]:\d+/", url)
        answer = await client.get(url)
        assert answer.text == "::1"
        with pytest.raises(httpx.ConnectError):  # not on IPv4
            await client.get(f"http://127.0.0.1:{port_of(url)}/")


@pytest.mark.anyio
async def test_every_ipv6_interface_takes_ipv4_clients_too() -> None:
    async with serve_app(APP, "::", 0) as url, httpx.AsyncClient() as client:
        port = port_of(url)
        assert (await client.get(f"http://[::1]:{port}/")).text == "::1"
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "::ffff:127.0.0.1"


@pytest.mark.anyio
async def test_a_taken_ipv6_port_is_refused_with_its_address() -> None:
    taken = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    taken.bind(("::1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(CannotListen, match=rf"cannot listen on \[::1\]:{port}: "):
            async with serve_app(APP, "::1", port):
                pass
    finally:
        taken.close()


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_up_serves_its_metrics_on_ipv6_loopback(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    up = start(["up", "--metrics-host", "::1", "--metrics-port", "0"], process_env(settings), log)
    try:
        found: list[str] = []

        async def told() -> bool:
            assert up.poll() is None, log.read_text()
            found[:] = re.findall(r"metrics at (http://\[::1\]:\d+/metrics)", log.read_text())
            return bool(found)

        await eventually(told, timeout_s=30)
        async with httpx.AsyncClient() as client:
            answer = await client.get(found[0])
        assert answer.status_code == 200
        assert "agent_reach_" in answer.text
    finally:
        stop(up)
