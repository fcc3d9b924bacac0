"""The command line, through click's runner and as real subprocesses."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import tomllib
from pathlib import Path

import anyio
import click
import jsonschema
import msgspec
import pytest
from click.testing import CliRunner

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import Gate, http_agent
from tests.support.harness import (
    collect_replies,
    connected,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from tests.support.processes import AGENT_REACH, printed_by, process_env
from workers.cli import COMMANDS, main
from workers.cli.common import FiniteRange, ListenHost


def all_commands() -> list[list[str]]:
    return [[]] + [[name] for name in main.commands]


def test_every_command_is_found_under_its_own_name() -> None:
    """The command line imports a command's module only when it runs (``COMMANDS``): each
    name there finds a command that calls itself by it, and a mistyped one is refused with
    the names it is near."""
    context = click.Context(main)
    assert len(COMMANDS) == 31
    for name in COMMANDS:
        command = main.get_command(context, name)
        assert isinstance(command, click.Command) and command.name == name, name
    assert sorted(main.commands) == sorted(COMMANDS) == main.list_commands(context)
    result = CliRunner().invoke(main, ["stat"])
    assert result.exit_code == 2
    assert "No such command 'stat'. Did you mean 'stats'?" in result.output


def test_every_command_the_modules_define_is_listed() -> None:
    """A command defined in ``workers/cli/`` and left out of ``COMMANDS`` would never run."""
    package = Path(__file__).resolve().parents[2] / "workers" / "cli"
    defined = set()
    for path in package.glob("[!_]*.py"):  # not __init__.py, whose one command is the group
        module = importlib.import_module(f"workers.cli.{path.stem}")
        defined |= {
            (path.stem, attribute)
            for attribute, value in vars(module).items()
            if isinstance(value, click.Command)
            and value.callback is not None
            and value.callback.__module__ == module.__name__
        }
    assert defined == set(COMMANDS.values())


def test_a_command_imports_only_what_it_runs() -> None:
    """``agent-reach stats`` does not import the processes it does not run."""
    printed = printed_by(
        "import sys",
        "from workers.cli import main",
        "main(['stats', '--help'], standalone_mode=False)",
        "print(sorted(m for m in sys.modules if m in "
        "('workers.dispatcher', 'workers.cli.processes', 'adapters.sidecar')))",
    )
    assert printed[-1] == "[]"


def test_up_imports_the_roles_it_runs_only_when_it_runs_them() -> None:
    """``up --help`` imports no role, no console, gateway or metrics page, and no sidecar:
    each is imported where ``up`` runs it (``up`` without ``--console`` never imports the
    console's pages)."""
    printed = printed_by(
        "import sys",
        "from workers.cli import main",
        "main(['up', '--help'], standalone_mode=False)",
        "print(sorted(m for m in sys.modules if m in "
        "('workers.dispatcher', 'workers.reaper', 'workers.notifier', 'workers.console.app', "
        "'workers.a2a_gateway', 'workers.metrics_page', 'adapters.sidecar', 'adapters.http')))",
        "print('workers.cli.processes' in sys.modules)",
    )
    assert printed[-2:] == ["[]", "True"]


def test_the_adapters_package_gives_each_name_from_its_module_when_asked() -> None:
    printed = printed_by(
        "import sys, adapters",
        "print(set(adapters.__all__) <= set(dir(adapters)))",
        "import adapters.http",
        "print('adapters.sidecar' in sys.modules, 'adapters.python' in sys.modules)",
        "from adapters import Agent, Sidecar, Succeeded",
        "print(Agent.__module__, Sidecar.__module__, Succeeded.__module__)",
        "print(all(getattr(adapters, name) is not None for name in adapters.__all__))",
        "try:",
        "    adapters.Nothing",
        "except AttributeError as exc:",
        "    print(exc)",
    )
    assert printed == [
        "True",
        "False False",
        "adapters.python adapters.sidecar adapters.outcome",
        "True",
        "module 'adapters' has no attribute 'Nothing'",
    ]


def test_the_workers_package_lists_and_gives_the_dispatcher_it_imports_late() -> None:
    printed = printed_by(
        "import sys, workers",
        "print('Dispatcher' in dir(workers), 'workers.dispatcher' in sys.modules)",
        "from workers import Dispatcher",
        "print(Dispatcher.__module__)",
    )
    assert printed == ["True False", "workers.dispatcher"]


@pytest.mark.parametrize("argv", all_commands(), ids=lambda a: " ".join(a) or "agent-reach")
def test_every_command_has_help(argv: list[str]) -> None:
    result = CliRunner().invoke(main, [*argv, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output


def test_commands_that_talk_to_redis_take_a_redis_url() -> None:
    names = "up dispatcher reaper sidecar send trace agents stats demo"
    names += " stuck replay resolve dlq cancel acl"
    for name in names.split():
        assert "--redis URL" in CliRunner().invoke(main, [name, "--help"]).output, name


def test_schema_prints_the_envelope_json_schema() -> None:
    result = CliRunner().invoke(main, ["schema"])
    schema = json.loads(result.output)
    good = {"capability": "text.echo", "payload": {"x": 1}}
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(good))
    assert list(validator.iter_errors({"payload": 1}))  # capability is required


def test_bad_config_fails_with_the_key_name(tmp_path: Path) -> None:
    config = tmp_path / "reach.toml"
    config.write_text("heartbeat_s = 0\n")
    result = CliRunner().invoke(main, ["agents", "--config", str(config)])
    assert result.exit_code == 2
    assert "heartbeat_s" in result.output and ">= 0.01" in result.output
    result = CliRunner().invoke(main, ["agents"], env={"AGENT_REACH_HEARTBEAT": "1"})
    assert result.exit_code == 2 and "AGENT_REACH_HEARTBEAT" in result.output


def test_an_unknown_event_loop_is_refused_with_the_variable_name() -> None:
    result = CliRunner().invoke(main, ["agents"], env={"AGENT_REACH_EVENT_LOOP": "trio"})
    assert result.exit_code == 2
    assert "AGENT_REACH_EVENT_LOOP" in result.output and "auto, uvloop, asyncio" in result.output


def test_sidecar_rejects_a_malformed_capability() -> None:
    argv = ["sidecar", "--agent-id", "a", "--capability", "Bad", "--http", "http://127.0.0.1:9/"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and "domain.action" in result.output


def test_sidecar_needs_exactly_one_adapter() -> None:
    result = CliRunner().invoke(main, ["sidecar", "--agent-id", "a", "--capability", "a.b"])
    assert result.exit_code == 2 and "exactly one of --http" in result.output


async def cli(settings: Settings, *argv: str) -> tuple[int, str]:
    done = await anyio.run_process([AGENT_REACH, *argv], env=process_env(settings), check=False)
    return done.returncode, (done.stdout + done.stderr).decode()


async def test_send_wait_trace_and_agents(conn: Connection, settings: Settings) -> None:
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=3),
        running_dispatcher(conn),
    ):
        code, out = await cli(settings, "send", "text.echo", "--payload", '{"x": 5}', "--wait")
        assert code == 0, out
        result = json.loads(out)
        assert result["stage"] == "SUCCEEDED" and result["result"]["echo"] == {"x": 5}

        code, out = await cli(settings, "trace", result["id"], "--json")
        assert code == 0, out
        traced = json.loads(out)
        assert traced["stage"] == "SUCCEEDED"
        assert [s["stage"] for s in traced["stages"]] == [
            "ACCEPTED",
            "ROUTED",
            "RECEIVED",
            "PROCESSING",
            "SUCCEEDED",
        ]

        code, out = await cli(settings, "trace", result["id"])
        assert code == 0 and "PROCESSING" in out and "a-1" in out

        code, out = await cli(settings, "agents", "--json")
        (listed,) = json.loads(out)
        assert listed["instance_id"] == "a-1" and listed["credits"] == 3
        assert listed["state"] == "UP" and listed["capabilities"] == ["text.echo"]

        code, out = await cli(settings, "send", "text.echo")
        assert code == 0 and len(out.strip()) == 26  # prints the new id


async def test_send_wait_reports_a_failed_message_with_a_non_zero_exit(
    conn: Connection, settings: Settings
) -> None:
    async def refuse(envelope: object, request: object) -> object:
        from starlette.responses import JSONResponse

        return JSONResponse({"detail": "order not found"}, status_code=404)

    async with (
        http_agent("a", behaviour=refuse) as agent,  # type: ignore[arg-type]
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        code, out = await cli(settings, "send", "text.echo", "--wait")
    assert code == 1
    result = json.loads(out)
    assert result["stage"] == Stage.FAILED and "404" in result["error"]


async def test_trace_of_an_unknown_id_says_so(settings: Settings) -> None:
    code, out = await cli(settings, "trace", "no-such-id")
    assert code == 1 and "unknown message id 'no-such-id'" in out


async def test_trace_of_an_unreadable_record_says_so(settings: Settings) -> None:
    """A record key of another type, or a hash that is no record, read as "unknown message
    id": an operator looked for a message that was not there when something was."""
    async with connected(settings) as conn:
        await conn.call("SET", conn.keys.record("m-string"), "junk")
        await conn.call("HSET", conn.keys.record("m-hash"), "stage", "NOT-A-STAGE")
    for message_id in ("m-string", "m-hash"):
        code, out = await cli(settings, "trace", message_id)
        assert code == 1 and f"{message_id!r}: its record cannot be read" in out, out


async def test_unreachable_redis_is_a_clear_error(settings: Settings) -> None:
    stale = settings.__class__(**{**_fields(settings), "redis_url": "redis://127.0.0.1:9/0"})
    code, out = await cli(stale, "agents")
    assert code == 1 and "cannot connect" in out and "Traceback" not in out


def _fields(settings: Settings) -> dict[str, object]:
    return {name: getattr(settings, name) for name in settings.__struct_fields__}


@pytest.mark.timeout(240)
async def test_demo_exits_zero_and_reports_nothing_lost(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_REACH_")}
    env["AGENT_REACH_STATE_DIR"] = str(tmp_path)  # its own embedded Redis
    done = await anyio.run_process([AGENT_REACH, "demo", "--messages", "300"], env=env, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    assert "submitted" in out and "300" in out
    lost_line = next(line for line in out.splitlines() if "lost" in line)
    assert lost_line.replace("│", " ").split() == ["lost", "0"]
    # the embedded Redis ran with AOF (one file before Redis 7, a directory of parts since)
    assert any(p.name.startswith("appendonly") for p in (tmp_path / "redis").iterdir())


@pytest.mark.parametrize("flag", ["--agent-id", "--instance-id"])
def test_sidecar_refuses_ids_that_would_break_hash_tags(flag: str) -> None:
    argv = ["sidecar", "--agent-id", "a", "--capability", "a.b", "--http", "http://127.0.0.1:9/"]
    argv += [flag, "bad}{id"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and flag in result.output


async def test_weight_drain_and_agents_show_the_reach_factors(
    conn: Connection, settings: Settings
) -> None:
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=4) as sidecar,
    ):
        code, out = await cli(settings, "weight", "a-1", "0.25")
        assert code == 0, out
        code, out = await cli(settings, "agents", "--json")
        (listed,) = json.loads(out)
        assert listed["weight"] == 0.25
        assert set(listed["reach"]) == {
            "reach",
            "alive",
            "health",
            "load",
            "latency",
            "confidence",
            "weight",
        }
        assert listed["reach"]["weight"] == 0.25 and listed["reach"]["confidence"] == 0.8
        code, out = await cli(settings, "agents")
        assert "alive 1.0 × health" in out and "a-1" in out
        code, out = await cli(settings, "drain", "a-1")
        assert code == 0 and "DRAINING" in out
        with anyio.fail_after(10):
            await sidecar.stopped.wait()  # it saw DRAINING on its heartbeat and stopped
    code, out = await cli(settings, "weight", "nobody-1", "1")
    assert code == 1 and "unknown instance 'nobody-1'" in out
    code, out = await cli(settings, "weight", "a-1", "-1")  # a value, not an option
    assert code == 2 and "-1.0 is not in the range 0<=x<=1000" in out
    code, out = await cli(settings, "drain", "nobody-1")
    assert code == 1 and "unknown instance 'nobody-1'" in out


def test_config_prints_the_effective_configuration(tmp_path: Path) -> None:
    config_file = tmp_path / "reach.toml"
    config_file.write_text('load_cut = 0.75\n[capability_aliases]\n"order.make" = "order.create"\n')
    result = CliRunner().invoke(
        main,
        ["config", "--config", str(config_file), "--json"],
        env={"AGENT_REACH_TOP_RATIO": "0.5"},
    )
    assert result.exit_code == 0, result.output
    values = json.loads(result.output)
    assert values["load_cut"] == 0.75 and values["top_ratio"] == 0.5
    assert values["capability_aliases"] == {"order.make": "order.create"}
    assert values["heartbeat_s"] == 5.0  # a default
    text = CliRunner().invoke(main, ["config"], env={"AGENT_REACH_REDIS_URL": None}).output
    assert "load_cut = 0.9" in text and "# redis_url is not set" in text


def test_send_refuses_bad_selectors() -> None:
    result = CliRunner().invoke(main, ["send", "a.b", "--tag", "novalue"])
    assert result.exit_code == 2 and "KEY=VALUE" in result.output
    result = CliRunner().invoke(main, ["send", "a.b", "--priority", "12"])
    assert result.exit_code == 2 and "priority" in result.output.lower()


async def test_stats_shows_waiting_work_and_credits(conn: Connection, settings: Settings) -> None:
    held = Gate()
    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=held) as agent,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=agent.url, max_inflight=2, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        envelopes = [
            msgspec.convert({"capability": "text.echo", "reply_to": reply_to}, Envelope)
            for _ in range(10)
        ]
        await client.submit_many(envelopes)

        async def backlog() -> bool:
            return await MessageStore(conn).waiting.depth("text.echo") == 8

        await eventually(backlog)
        code, out = await cli(settings, "stats", "--json")
        assert code == 0, out
        found = json.loads(out)
        (echo,) = found["capabilities"]
        assert echo["capability"] == "text.echo" and echo["waiting"] == 8
        assert echo["oldest_waiting_s"] is not None and echo["oldest_waiting_s"] >= 0
        assert echo["assigned_per_s"] > 0 and echo["instances"] == 1
        (inst,) = found["instances"]
        assert (inst["in_use"], inst["effective"], inst["declared"], inst["stream"]) == (2, 2, 2, 2)
        code, out = await cli(settings, "stats")
        assert code == 0 and "text.echo" in out and "a-1" in out and "EFFECTIVE" in out
        held.open()
        results = await collect_replies(conn, reply_to, 10)
    assert {r.stage for r in results.values()} == {Stage.SUCCEEDED}
    assert agent.log.peak_concurrent == 2


async def test_an_error_inside_a_command_is_one_line_not_a_traceback(settings: Settings) -> None:
    code, out = await cli(settings, "weight", "nobody-1", "1")
    assert code == 1 and "unknown instance 'nobody-1'" in out
    code, out = await cli(settings, "weight", "a-1", "-1")  # a value, not an option
    assert code == 2 and "-1.0 is not in the range 0<=x<=1000" in out
    code, out = await cli(settings, "weight", "--bogus", "5")  # an option, not an instance
    assert code == 2 and "No such option '--bogus'" in out
    assert "Traceback" not in out and "ExceptionGroup" not in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["weight", "x-1", "nan"], "'nan' is not a number"),
        (["send", "a.b", "--id", "{x}"], "Invalid value for --id"),
        (["send", "a.b", "--payload", "\udcff"], "argument 4 (\\xff) is not UTF-8 text"),
        (["send", "a.b", "--timeout", "nan"], "is not a number"),
        (["send", "--payload", "1"], "give a CAPABILITY, or an --intent"),
        (["send", "a.b", "--budget-per-task", "-1"], "Invalid value for '--budget-per-task'"),
        (["send", "a.b", "--budget-per-task", "inf"], "Invalid value for '--budget-per-task'"),
        (["send", "a.b", "--tenant", "-"], "tenant"),
        (["send", "a.b", "--tenant", "two words"], "tenant"),
        (["send", "--intent", ""], "intent"),
        (["send", "a.b", "--callback-url", "ftp://x"], "must be an http:// or https:// URL"),
        (["send", "a.b", "--callback-url", "http://h:99999/"], "is not a valid URL"),
        (["send", "a.b", "--broadcast", "--id", "a" * 128], "a broadcast id is at most 120"),
        (["send", "--intent", "caf\udce9"], "argument 3 (caf\\xe9) is not UTF-8 text"),
        (["send", "a.b", "--session", "s\udcff"], "argument 4 (s\\xff) is not UTF-8 text"),
        (["send", "a.b", "--tag", "a=\udcff"], "argument 4 (a=\\xff) is not UTF-8 text"),
        # refused before any connection: no Redis answers at this address
        (["send", "a.b", "--tenant", "two words", "--redis", "redis://127.0.0.1:9"], "tenant"),
    ],
)
def test_odd_command_line_values_are_usage_errors(argv: list[str], says: str) -> None:
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "\udcff"],
        ["resolve", "x\udcff", "--failed", "gone"],
        ["sidecar", "--agent-id", "a", "--tag", "k=\udcfe"],
        ["up", "--consumer", "\udcff"],
        ["demo-agent", "--host", "\udcff"],
    ],
)
def test_arguments_not_utf8_are_a_usage_error_naming_them(argv: list[str]) -> None:
    """Bytes of the command line that are not UTF-8 reached Redis's encoder (or a socket's)
    and ended in a traceback, from about twenty commands."""
    result = CliRunner().invoke(main, argv)

    assert result.exit_code == 2, result.output
    assert "is not UTF-8 text" in result.output
    assert "\\xff" in result.output or "\\xfe" in result.output  # the bytes, shown


def test_a_real_command_line_not_utf8_is_refused_the_same() -> None:
    done = subprocess.run(
        [AGENT_REACH.encode(), b"trace", b"\xff"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert b"argument 2 (\\xff) is not UTF-8 text" in done.stderr
    assert b"Traceback" not in done.stderr


def commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, click.Command]]:
    found: list[tuple[str, click.Command]] = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += commands(command, (*path, name))
        else:
            found.append((" ".join((*path, name)), command))
    return found


def test_every_number_an_option_takes_is_bounded_and_finite() -> None:
    """`sidecar --grace nan` was taken, and its SIGTERM then raised instead of draining;
    `demo --timeout nan`, `demo-agent --port 99999` ended in tracebacks; `stats --watch
    1e308` slept for good. Every number is now checked against finite bounds on both sides."""
    unbounded = [
        f"{name} {param.name}"
        for name, command in commands(main)
        for param in command.params
        if isinstance(param.type, click.types.FloatParamType | click.types.IntParamType)
        and not (
            isinstance(param.type, FiniteRange | click.IntRange)
            and param.type.min is not None
            and param.type.max is not None
        )
    ]
    assert not unbounded, unbounded


def test_every_address_to_listen_on_is_named() -> None:
    """`demo-agent --host ''` listened on every interface: a server binds an empty address
    to all of them. Each listening address refuses one that names nothing."""
    hosts = [
        (name, param.name)
        for name, command in commands(main)
        for param in command.params
        if param.name is not None and param.name.endswith("host")
    ]
    # console, a2a-gateway, demo-agent, sidecar's callbacks, up's console and gateway, every
    # metrics endpoint
    assert len(hosts) >= 8, hosts
    assert [h for h in hosts if not isinstance(param_of(*h).type, ListenHost)] == []
    for argv in (
        ["demo-agent", "--host", ""],
        ["console", "--host", " "],
        ["up", "--metrics-host", ""],
        ["up", "--console-host", ""],
    ):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2
        assert "0.0.0.0 or :: to listen on every interface" in result.output
    result = CliRunner().invoke(main, ["a2a-gateway", "--host", "a\nb"])
    assert result.exit_code == 2 and "is no host name or IP address" in result.output


def param_of(command_name: str, param_name: str | None) -> click.Parameter:
    command = dict(commands(main))[command_name]
    return next(p for p in command.params if p.name == param_name)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["sidecar", "--agent-id", "a", "--capability", "a.b", "--grace", "nan"], "--grace"),
        (["demo", "--timeout", "nan"], "--timeout"),
        (["demo-agent", "--port", "99999"], "99999 is not in the range 0<=x<=65535"),
        (["demo-agent", "--delay-ms", "-5"], "--delay-ms"),
        (["stats", "--watch", "1e308"], "--watch"),
    ],
)
def test_numbers_out_of_bounds_are_usage_errors(argv: list[str], says: str) -> None:
    result = CliRunner().invoke(main, argv)

    assert result.exit_code == 2, result.output
    assert says in result.output


def test_a_bad_failpoint_spec_is_one_line_from_a_fresh_process() -> None:
    env = {**os.environ, "AGENT_REACH_FAILPOINTS": "bogus"}
    done = subprocess.run(
        [AGENT_REACH, "config"], capture_output=True, timeout=60, check=False, env=env
    )
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert b"'AGENT_REACH_FAILPOINTS': failpoint 'bogus': unknown action" in done.stderr


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--http", "ftp://x"], "Invalid value for --http: 'ftp://x': an http:// or https:// URL"),
        (["--http", "http://h/", "--status-url", "garbage"], "Invalid value for --status-url"),
        (
            ["--adapter", "http-async", "--http", "http://h/", "--callback-public-url", "x"],
            "Invalid value for --callback-public-url",
        ),
        (["--http", "http://h/", "--version", "1\nfake"], "Invalid value for --version: 1\\nfake"),
        # said back without the password (an unencoded / in it: urllib took "hunter2" for
        # the port, and said so)
        (["--http", "http://agent:hunter2/x@h/"], "not a URL (what stands for the port"),
        (["--http", "htp://agent:hunter2@h/"], "'htp://agent:<hidden>@h/': an http://"),
    ],
)
def test_a_sidecar_refuses_addresses_and_words_it_cannot_use(extra: list[str], says: str) -> None:
    result = CliRunner().invoke(main, ["sidecar", "--agent-id", "a", "--capability", "a.b", *extra])

    assert result.exit_code == 2, result.output
    assert says in result.output and "hunter2" not in result.output


def test_config_hides_secrets_unless_asked() -> None:
    """The webhook secret and URL passwords never reach the output by default; a TOML line
    holding one is a comment (the output still loads back); --show-secrets prints them."""
    env = {
        "AGENT_REACH_REDIS_URL": "redis://app:s3cret-pw@127.0.0.1:6379/0",
        "AGENT_REACH_WEBHOOK_SECRET": "whsec_" + "k" * 32,
        "AGENT_REACH_EMBEDDING_URL": "http://:tok3n@127.0.0.1:8000/v1",
    }
    text = CliRunner().invoke(main, ["config"], env=env)
    assert text.exit_code == 0, text.output
    assert "s3cret-pw" not in text.output and "k" * 32 not in text.output
    assert "tok3n" not in text.output
    assert '# redis_url = "redis://app:<hidden>@127.0.0.1:6379/0"' in text.output
    assert "# webhook_secret = " in text.output
    loaded = tomllib.loads(text.output)
    assert "redis_url" not in loaded and "webhook_secret" not in loaded
    assert loaded["load_cut"] == 0.9
    as_json = json.loads(CliRunner().invoke(main, ["config", "--json"], env=env).output)
    assert as_json["redis_url"] == "redis://app:<hidden>@127.0.0.1:6379/0"
    assert as_json["webhook_secret"] == "<hidden>"
    shown = CliRunner().invoke(main, ["config", "--show-secrets", "--json"], env=env).output
    assert json.loads(shown)["redis_url"] == env["AGENT_REACH_REDIS_URL"]
    assert json.loads(shown)["webhook_secret"] == env["AGENT_REACH_WEBHOOK_SECRET"]
