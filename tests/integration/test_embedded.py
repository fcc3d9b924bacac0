"""The embedded Redis: a real redis-server, AOF on, shared by local processes."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from broker.embedded import (
    RedisServer,
    embedded_redis,
    find_redis_server,
    free_port,
    ping,
    running_embedded_url,
)
from broker.errors import EmbeddedRedisError


def test_a_free_port_is_one_no_outgoing_connection_takes_meanwhile() -> None:
    """Below the kernel's ephemeral range, where a server's restart finds its port again:
    an outgoing connection's local end is taken from that range, never from below it."""
    ephemeral_from, _ = (
        int(p) for p in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    )
    ports = {free_port() for _ in range(20)}
    if ephemeral_from > 11_000:  # room below it (Linux's default range starts at 32768)
        assert all(10_000 <= p < ephemeral_from for p in ports)
    assert len(ports) > 1  # chosen at random, not the same one each time
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # and nothing holds it


def test_a_redis_server_binary_is_found() -> None:
    binary = find_redis_server()
    assert binary.name == "redis-server"
    assert binary.stat().st_mode & stat.S_IXUSR


def test_embedded_server_runs_with_aof_and_is_shared(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    with embedded_redis(data) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert url.startswith("redis://127.0.0.1:") and ping(port)
        assert running_embedded_url(data) == url
        with embedded_redis(data) as again:  # a second process finds the running server
            assert again == url
        assert ping(port)  # the second user did not stop it
        config = (data / "server.json").read_text()
        assert str(port) in config
    assert not ping(port)  # the owner stopped it on exit
    assert running_embedded_url(data) is None
    assert any(p.name.startswith("appendonly") for p in data.iterdir())


def test_data_survives_a_restart(tmp_path: Path) -> None:
    import socket

    def command(port: int, *args: str) -> bytes:
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(payload.encode())
            return sock.recv(1024)

    server = RedisServer.start(tmp_path, appendfsync="always")
    try:
        assert command(server.port, "SET", "k", "kept") == b"+OK\r\n"
    finally:
        server.kill()  # a crash, not a clean shutdown
    again = RedisServer.start(tmp_path)
    try:
        assert command(again.port, "GET", "k") == b"$4\r\nkept\r\n"
    finally:
        again.stop()


def test_a_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(EmbeddedRedisError, match="pip install 'agent-reach\\[embedded\\]'"):
        find_redis_server()


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    blocker = RedisServer.start(tmp_path / "a")
    try:
        with pytest.raises(EmbeddedRedisError, match="did not start"):
            RedisServer.start(tmp_path / "b", port=blocker.port, startup_timeout_s=3)
    finally:
        blocker.stop()
    assert os.path.isdir(tmp_path / "b")


def test_a_state_dir_that_is_a_file_is_said_in_a_sentence(tmp_path: Path) -> None:
    """AGENT_REACH_STATE_DIR naming a file ended in NotADirectoryError, a traceback."""
    taken = tmp_path / "state"
    taken.write_text("a file")

    with pytest.raises(EmbeddedRedisError, match="cannot use the embedded Redis's directory"):
        with embedded_redis(taken / "redis"):
            pass


@pytest.mark.parametrize("written", ['{"port": 1e400, "pid": 1}', '{"port": "x"}', "[1]", "{"])
def test_a_server_file_that_does_not_read_names_no_running_server(
    tmp_path: Path, written: str
) -> None:
    (tmp_path / "server.json").write_text(written)

    assert running_embedded_url(tmp_path) is None
