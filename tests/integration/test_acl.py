"""Least privilege on Redis: each role runs as the ACL user ``agent-reach acl`` prints, on the
suite's Redis 6.2 and on a Redis 7, and is refused what it must not touch.

The users are made from the command's own output, fed to redis-cli; the broker, the sidecar
and the producer run as those users; operators run the real CLI as theirs.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from broker.client import Client
from broker.config import Settings
from broker.embedded import RedisServer
from broker.envelope import Envelope
from broker.errors import RedisReplyError
from broker.keyspace import Keyspace, direct_lane
from broker.resp import RespConnection
from broker.scripts import ScriptName, load_scripts
from broker.stages import Stage
from tests.support.agents import RunningAgent, http_agent
from tests.support.harness import (
    connected,
    eventually,
    running_dispatcher,
    running_notifier,
    running_sidecar,
)
from tests.support.processes import AGENT_REACH, process_env
from tests.support.repair import reaches, record_in, stage_of
from tests.support.webhooks import SECRET, Receiver, serving

# Marked here, not only by the conftest's hook: anyio rebuilds the items it marks late
# without their other parameters (the server's version, here).
pytestmark = pytest.mark.anyio

AGENT = "echo"
ROLES = ("producer", "sidecar", "broker", "operator-read", "operator")


# -- servers and users ---------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    version: str  # the rule set: "6.2" or "7"
    port: int

    @property
    def admin_url(self) -> str:  # the default user: every right
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def redis7(tmp_path_factory: pytest.TempPathFactory, redis7_binary: Path) -> Iterator[RedisServer]:
    # DEBUG refused by configuration would hide whether the ACL refuses it: allow it locally
    server = RedisServer.start(
        tmp_path_factory.mktemp("redis7"),
        binary=redis7_binary,
        extra_args=["--enable-debug-command", "local"],
    )
    yield server
    server.stop()


@pytest.fixture(params=["6.2", "7"])
def server(request: pytest.FixtureRequest, redis_server: RedisServer) -> Server:
    if request.param == "6.2":
        return Server("6.2", redis_server.port)
    return Server("7", request.getfixturevalue("redis7").port)


def redis_cli() -> str:
    found = shutil.which("redis-cli")
    if found is None:
        pytest.fail("this test needs redis-cli on PATH (Debian's redis-tools, as .ci/run installs)")
    return found


@dataclass(frozen=True)
class Users:
    """The users of one test, made from ``agent-reach acl``'s lines."""

    server: Server
    base: Settings  # the test's settings: its prefix, fast clocks
    password: str
    producer: str

    def name(self, role: str) -> str:
        prefix = self.base.prefix
        names = {"producer": self.producer, "sidecar": f"{prefix}-sidecar-{AGENT}"}
        return names.get(role, f"{prefix}-{role}")

    def url(self, role: str) -> str:
        if role == "admin":
            return self.server.admin_url
        return f"redis://{self.name(role)}:{self.password}@127.0.0.1:{self.server.port}/0"

    def settings(self, role: str, **changes: Any) -> Settings:
        return msgspec.structs.replace(self.base, redis_url=self.url(role), **changes)

    @property
    def keys(self) -> Keyspace:
        return Keyspace(self.base.prefix)


def make_users(server: Server, settings: Settings) -> tuple[Users, list[str]]:
    users = Users(server, settings, secrets.token_hex(12), f"{settings.prefix}p")
    argv = ["acl", "--redis", server.admin_url, "--prefix", settings.prefix]
    argv += ["--name", users.producer, "--agent", AGENT, "--password", users.password]
    env = {k: v for k, v in process_env(settings).items() if k != "AGENT_REACH_REDIS_URL"}
    printed = subprocess.run(
        [AGENT_REACH, *argv], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert f"with Redis {server.version} rules" in printed  # asked the server its version
    commands = [line for line in printed.splitlines() if line and not line.startswith("#")]
    assert len(commands) == len(ROLES)
    return users, commands


def run_redis_cli(port: int, lines: list[str]) -> list[str]:
    done = subprocess.run(
        [redis_cli(), "-p", str(port)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()


@pytest.fixture
def users(server: Server, settings: Settings) -> Iterator[Users]:
    made, commands = make_users(server, settings)
    assert run_redis_cli(server.port, commands) == ["OK"] * len(ROLES)  # as printed
    yield made
    run_redis_cli(server.port, [f"ACL DELUSER {' '.join(made.name(r) for r in ROLES)}"])


@asynccontextmanager
async def broker_and_sidecar(users: Users) -> AsyncIterator[RunningAgent]:
    """The dispatcher, reaper and notifier as the broker user; an echo agent's sidecar as
    its sidecar user: the whole broker, each process under its own role."""
    webhooks = {"webhook_secret": SECRET, "callback_hosts": ["127.0.0.1"]}
    async with (
        connected(users.settings("broker", **webhooks)) as broker,
        running_dispatcher(broker),
        running_notifier(broker),
        http_agent(AGENT) as agent,
        connected(users.settings("sidecar")) as sidecar,
        running_sidecar(sidecar, f"{AGENT}-1", ("text.echo",), url=agent.url),
    ):
        # the sidecar's role lets it heartbeat (else its card falls silent, and DOWN)
        card = broker.keys.card(f"{AGENT}-1")
        first = await broker.call("HGET", card, "hb_ms")

        async def beat() -> bool:
            return bool(await broker.call("HGET", card, "hb_ms") != first)

        await eventually(beat, timeout_s=15)
        yield agent


async def cli(settings: Settings, *argv: str) -> tuple[int, str]:
    done = await anyio.run_process([AGENT_REACH, *argv], env=process_env(settings), check=False)
    return done.returncode, (done.stdout + done.stderr).decode()


def refused(reply: Any) -> bool:
    """Redis refused the command to this user: ``NOPERM``, or the same check inside a script
    (Redis 6.2 reports that one as a script error, code ``ERR``)."""
    return isinstance(reply, RedisReplyError) and (
        reply.code == "NOPERM" or "The user executing the script can't" in reply.message
    )


async def replies_as(url: str, commands: list[tuple[Any, ...]]) -> list[Any]:
    conn = await RespConnection.open(url)
    try:
        return await conn.execute(commands)
    finally:
        await conn.close()


# -- each role does its work -----------------------------------------------------------------


async def test_a_producer_with_only_its_role_submits_and_requests(users: Users) -> None:
    receiver = Receiver()
    async with (
        broker_and_sidecar(users),
        serving(receiver) as hook,
        connected(users.settings("admin")) as admin,
        connected(users.settings("producer")) as produce,
    ):
        sent = await Client(produce).submit(Envelope(capability="text.echo"))
        await reaches(admin, sent, Stage.SUCCEEDED)
        async with Client(produce) as client:
            answered = await client.request("text.echo", {"x": 1}, timeout=30)
            hooked = await client.request("text.echo", {"x": 2}, timeout=30, callback_url=hook)
            stream = client.reply_stream
            assert stream is not None and stream.startswith(users.keys.reply(f"{users.producer}-"))
        with pytest.raises(RedisReplyError) as caught:  # records are not a producer's
            await Client(produce).result(sent)
        assert caught.value.code == "NOPERM"

        async def delivered() -> bool:
            return len(receiver.accepted) == 1

        await eventually(delivered)
        left = int(await admin.call("EXISTS", stream))
        ttl = int(await admin.call("TTL", stream))
    assert answered.ok and answered.result["echo"] == {"x": 1}
    assert hooked.ok and json.loads(receiver.accepted[0].body)["id"] == hooked.id
    if users.server.version == "7":
        assert left == 0  # the client deleted its stream on closing
    else:  # Redis 6.2 cannot grant DEL on some keys only: the stream goes with its TTL
        assert left == 1 and 0 < ttl <= users.base.reply_ttl_s


async def test_a_producer_user_takes_no_direct_lane_and_submits_to_the_ingress(
    users: Users,
) -> None:
    """A producer's role grants the ingress only: where the dispatcher publishes a direct
    lane, its user may not even read it, and the client sends every envelope the old way."""
    async with (
        connected(users.settings("broker", direct_lane=True)) as broker,
        running_dispatcher(broker),
        http_agent(AGENT) as agent,
        connected(users.settings("sidecar")) as sidecar,
        running_sidecar(sidecar, f"{AGENT}-1", ("text.echo",), url=agent.url),
        connected(users.settings("admin")) as admin,
        connected(users.settings("producer")) as produce,
    ):

        async def published() -> bool:
            return await admin.call("GET", direct_lane(admin.keys, "text.echo")) is not None

        await eventually(published, timeout_s=15)
        client = Client(produce)
        sent = [await client.submit(Envelope(capability="text.echo")) for _ in range(2)]
        for message_id in sent:
            await reaches(admin, message_id, Stage.SUCCEEDED)
        through_ingress = int(await admin.call("XLEN", admin.keys.ingress))
    assert not client.direct.usable and through_ingress == 2


async def test_a_sidecar_user_made_before_the_one_wake_up_read_takes_work_the_plain_way(
    server: Server, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Rules printed before the sidecar read and took in one wake-up (``lua/take.lua``) lack
    ``XREAD``, ``XREVRANGE`` and ``TIME``: its sidecar reads the plain way, and says why,
    instead of failing every read."""
    users, commands = make_users(server, settings)
    new_commands = ("+xread", "+xrevrange", "+time")
    sidecar_line = f"ACL SETUSER {users.name('sidecar')} "
    older = []
    for line in commands:
        if line.startswith(sidecar_line):
            words = line.split(" ")
            assert all(c in words for c in new_commands)
            line = " ".join(w for w in words if w not in new_commands)
        older.append(line)
    assert run_redis_cli(server.port, older) == ["OK"] * len(ROLES)
    try:
        async with (
            broker_and_sidecar(users),
            connected(users.settings("admin")) as admin,
            connected(users.settings("producer")) as produce,
        ):
            sent = await Client(produce).submit(Envelope(capability="text.echo"))
            await reaches(admin, sent, Stage.SUCCEEDED)
    finally:
        run_redis_cli(server.port, [f"ACL DELUSER {' '.join(users.name(r) for r in ROLES)}"])
    said = [r.getMessage() for r in caplog.records if "one-wake-up" in r.getMessage()]
    assert len(said) == 1 and "agent-reach acl" in said[0]
    assert not [r for r in caplog.records if "read failed" in r.getMessage()]  # no back-off


async def test_send_and_request_run_as_a_producer(users: Users) -> None:
    produce = users.settings("producer")
    async with broker_and_sidecar(users), connected(users.settings("admin")) as admin:
        code, out = await cli(produce, "send", "text.echo", "--payload", '{"x": 1}')
        assert code == 0, out
        await reaches(admin, out.split()[-1], Stage.SUCCEEDED)
        code, out = await cli(produce, "request", "text.echo", "--payload", '{"x": 2}')
        assert code == 0, out
        assert json.loads(out.splitlines()[-1])["result"]["echo"] == {"x": 2}
        code, out = await cli(produce, "send", "text.echo", "--payload", '{"x": 3}', "--wait")
        assert code == 0, out
        result = json.loads(out.splitlines()[-1])
        assert result["stage"] == "SUCCEEDED" and result["result"]["echo"] == {"x": 3}
        assert await stage_of(admin, result["id"]) is Stage.SUCCEEDED


async def test_operators_read_and_repair_with_their_roles(users: Users) -> None:
    async with (
        broker_and_sidecar(users),
        connected(users.settings("admin")) as admin,
        Client(admin) as client,
    ):
        done = await client.request("text.echo", {"x": 1}, timeout=30)
        reader = users.settings("operator-read")
        code, out = await cli(reader, "trace", done.id, "--json")
        assert code == 0 and json.loads(out)["stage"] == "SUCCEEDED", out
        code, out = await cli(reader, "agents", "--json")
        assert code == 0 and [a["instance_id"] for a in json.loads(out)] == [f"{AGENT}-1"], out
        code, out = await cli(reader, "stats", "--json")  # backlog.lua, as the broker loaded it
        assert code == 0, out
        assert [i["instance_id"] for i in json.loads(out)["instances"]] == [f"{AGENT}-1"]
        code, out = await cli(reader, "dlq", "--json")
        assert code == 0 and json.loads(out) == [], out
        code, out = await cli(reader, "stuck", "--json")
        assert code == 0 and json.loads(out) == [], out

        waiting = await client.submit(Envelope(capability="text.nobody"))
        await reaches(admin, waiting, Stage.WAITING)
        code, out = await cli(reader, "cancel", waiting)  # a reader changes nothing
        assert code != 0 and ("NOPERM" in out or "executing the script can't" in out), out
        assert await stage_of(admin, waiting) is Stage.WAITING

        operate = users.settings("operator")
        code, out = await cli(operate, "cancel", waiting)
        assert code == 0, out
        assert await stage_of(admin, waiting) is Stage.CANCELLED
        dead = await record_in(admin, Stage.DEAD, reason="gave up")
        code, out = await cli(operate, "replay", dead, "--yes")
        assert code == 0, out
        await reaches(admin, dead, Stage.SUCCEEDED)  # replayed, then run by the echo agent
        code, out = await cli(operate, "weight", f"{AGENT}-1", "0.5")
        assert code == 0, out


# -- what each role must not touch -------------------------------------------------------------


def forbidden(users: Users, shas: dict[str, str]) -> dict[str, list[tuple[Any, ...]]]:
    """Per role, commands its user must be refused. ``shas``: scripts the admin loaded."""
    keys, version = users.keys, users.server.version
    other = "other-1"  # an instance of another agent
    mine = keys.reply(f"{users.producer}-1")
    unsafe = [("FLUSHALL", "BOGUS"), ("CONFIG", "GET", "maxmemory"), ("SCRIPT", "FLUSH", "BOGUS")]
    return {
        "producer": [
            ("HGETALL", keys.record("m1")),
            ("HGETALL", keys.card(f"{AGENT}-1")),
            ("HSET", keys.card(f"{AGENT}-1"), "weight", 9),
            ("XREAD", "STREAMS", keys.reply("someone-1"), "0"),
            ("XREAD", "STREAMS", keys.reply(f"{users.producer}x-1"), "0"),
            ("SCRIPT", "LOAD", "return 1"),
            ("DEL", keys.ingress),
            ("XDEL", keys.ingress, "1-1"),
            ("XTRIM", keys.ingress, "MAXLEN", 0),
            *unsafe,
            *(
                [
                    ("XREAD", "STREAMS", keys.ingress, "0"),
                    ("XRANGE", keys.ingress, "-", "+"),
                    ("XADD", mine, "*", "id", "forged"),
                ]
                if version == "7"
                else []
            ),
        ],
        "sidecar": [
            ("HGETALL", keys.card(other)),
            ("HSET", keys.card(other), "state", "DOWN"),
            ("DEL", keys.card(other)),
            ("XADD", keys.queue(other), "*", "id", "x"),
            ("XREADGROUP", "GROUP", "sidecar", "c", "STREAMS", keys.queue(other), ">"),
            ("SREM", keys.inflight(other), "x"),
            ("GET", keys.callback_key(other)),
            ("EVALSHA", shas["heartbeat"], 1, keys.card(other), other, 1, "UP", "c", 0),
            ("XADD", keys.ingress, "*", "envelope", "{}"),
            *unsafe,
            *(
                [
                    ("DEL", keys.outbox),
                    ("XTRIM", keys.dlq, "MAXLEN", 0),
                    ("ZREM", keys.due, "m1"),
                    ("XRANGE", keys.outbox, "-", "+"),
                    ("XREAD", "STREAMS", keys.reply("someone-1"), "0"),
                ]
                if version == "7"
                else []
            ),
        ],
        "operator-read": [
            ("SCRIPT", "LOAD", "while true do end"),  # its own Lua: it could stop Redis
            ("HSET", keys.record("m1"), "stage", "DONE"),
            ("XADD", keys.ingress, "*", "envelope", "{}"),
            ("DEL", keys.dlq),
            ("ZADD", keys.due, 1, "m1"),
            ("PUBLISH", keys.registry_channel, "x"),
            ("EVALSHA", shas["writer"], 1, keys.record("m1")),
            ("EVALSHA", shas["writer"], 1, keys.queue(f"{AGENT}-1")),
            *unsafe,
        ],
        "operator": [
            ("DEL", keys.dlq),
            ("XTRIM", keys.ingress, "MAXLEN", 0),
            *unsafe,
            *(
                [
                    ("XADD", keys.ingress, "*", "envelope", "{}"),
                    ("EVALSHA", shas["writer"], 1, keys.queue(f"{AGENT}-1")),
                ]
                if version == "7"
                else []
            ),
        ],
        "broker": [
            *unsafe,
            ("SHUTDOWN", "ABORT"),  # refused, or an error: never a shutdown
            ("DEBUG", "OBJECT", keys.ingress),
            ("ACL", "WHOAMI"),
            ("KEYS", "*"),
            ("GET", "elsewhere:key"),
            ("SUBSCRIBE", "elsewhere:channel"),
        ],
    }


def allowed(users: Users) -> dict[str, list[tuple[Any, ...]]]:
    """Per role, a neighbour of what it is refused that it may run: the refusals above are
    the rules, not a wrong password or a broken user."""
    keys = users.keys
    return {
        "producer": [
            ("XADD", keys.ingress, "*", "envelope", "{}"),
            ("XREAD", "STREAMS", keys.reply(f"{users.producer}-1"), "0"),
        ],
        "sidecar": [("HGETALL", keys.card(f"{AGENT}-1")), ("HGETALL", keys.record("m1"))],
        "operator-read": [("HGETALL", keys.record("m1")), ("XLEN", keys.dlq)],
        "operator": [("HSET", keys.record("m1"), "note", "x"), ("XLEN", keys.ingress)],
        "broker": [("HGETALL", keys.record("m1")), ("ZCARD", keys.due)],
    }


async def test_what_each_role_must_not_touch_is_refused(users: Users) -> None:
    sources = {
        "heartbeat": load_scripts()[ScriptName.HEARTBEAT].source,
        "writer": "return redis.call('XADD', KEYS[1], '*', 'forged', '1')",
    }
    loaded = await replies_as(
        users.url("admin"), [("SCRIPT", "LOAD", source) for source in sources.values()]
    )
    shas = {name: sha.decode() for name, sha in zip(sources, loaded, strict=True)}
    for role in ROLES:
        commands = forbidden(users, shas)[role]
        replies = await replies_as(users.url(role), commands)
        for command, reply in zip(commands, replies, strict=True):
            assert refused(reply), (role, command, reply)
        for command in allowed(users)[role]:
            (reply,) = await replies_as(users.url(role), [command])
            assert not isinstance(reply, Exception), (role, command, reply)


async def test_on_redis_6_2_what_the_rules_leave_open_is_what_the_output_says(
    users: Users,
) -> None:
    """The caveats are true: on 6.2 a producer can read the ingress stream; on 7 it cannot."""
    keys = users.keys
    (reply,) = await replies_as(users.url("producer"), [("XLEN", keys.ingress)])
    assert refused(reply)  # XLEN is granted to no producer
    (reply,) = await replies_as(users.url("producer"), [("XREAD", "STREAMS", keys.ingress, "0")])
    assert refused(reply) is (users.server.version == "7")
