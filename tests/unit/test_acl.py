"""``agent-reach acl``: the generator (:mod:`broker.acl`) is a pure function; these tests read
its lines as redis-cli would, and check that every Redis command in the code is granted to a
role."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from broker.acl import (
    PLACEHOLDER,
    ROLES,
    User,
    acl_lines,
    operator,
    operator_read,
    producer,
    quote,
    role_user,
    rules_version,
    sidecar,
)
from broker.acl_commands import BROKER_COMMANDS
from broker.keyspace import Keyspace
from workers.cli import main

ROOT = Path(__file__).resolve().parents[2]


def setuser_lines(lines: list[str]) -> list[list[str]]:
    """The command lines, split into arguments (redis-cli and a POSIX shell agree on them)."""
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def by_user(lines: list[str]) -> dict[str, list[str]]:
    return {words[2]: words[3:] for words in setuser_lines(lines)}


def everything(version: str, **options: str) -> dict[str, list[str]]:
    return by_user(acl_lines(ROLES, prefix="reach", version=version, agent="echo", **options))


@pytest.mark.parametrize("version", ["6.2", "7"])
def test_every_role_is_one_setuser_line_of_explicit_commands_on_the_prefix(version: str) -> None:
    lines = acl_lines(ROLES, prefix="reach", version=version, agent="echo", password="pw")
    commands = setuser_lines(lines)
    assert [words[:2] for words in commands] == [["ACL", "SETUSER"]] * len(ROLES)
    users = [words[2] for words in commands]
    assert users == [
        "producer",
        "reach-sidecar-echo",
        "reach-broker",
        "reach-operator-read",
        "reach-operator",
    ]
    for words in commands:
        # made anew, on, with its password, no channel and no command before its own
        assert words[3:8] == ["reset", "on", ">pw", "resetchannels", "-@all"], words
        rules = [w for word in words[8:] for w in word.strip("()").split()]
        assert not {"+@all", "allkeys", "allcommands", "allchannels", "~*", "&*"} & set(rules)
        assert all(not r.startswith("+@") for r in rules), rules
        for rule in rules:
            if "~" in rule or rule.startswith("&"):
                pattern = rule.split("~", 1)[-1].lstrip("&")
                assert pattern.startswith("reach:"), rule


def test_redis_7_producer_writes_the_ingress_and_reads_only_its_own_replies() -> None:
    rules = everything("7", name="alice")["alice"]
    assert rules == [
        "reset",
        "on",
        f">{PLACEHOLDER}",
        "resetchannels",
        "-@all",
        "+ping",
        "+select",
        "+cluster|slots",
        "+asking",
        "+info",
        "+wait",
        "+time",
        "+xadd",
        "%W~reach:in",
        "(+xread +xdel +del ~reach:reply:alice-*)",
    ]


def test_redis_6_2_rules_have_no_key_permissions_nor_selectors_and_say_what_is_left_open() -> None:
    lines = acl_lines(ROLES, prefix="reach", version="6.2", agent="echo")
    for user, rules in by_user(lines).items():
        assert not any(r.startswith(("%", "(")) for r in rules), (user, rules)
    producer_rules = by_user(lines)["producer"]
    assert "+xread" in producer_rules and "~reach:in" in producer_rules
    assert "+xdel" not in producer_rules and "+del" not in producer_rules  # P:in stays whole
    text = "\n".join(lines)
    assert "Redis 6.2 cannot tell reading a key from writing it" in text
    assert "Redis 6.2 cannot make keys write-only" in text  # the sidecar's
    assert "Redis 6.2 cannot make keys read-only" in text  # the operator's


def test_redis_7_sidecar_deletes_and_trims_only_its_own_keys() -> None:
    user = sidecar(Keyspace("reach"), "7", "echo")
    for grant in (user.root, *user.selectors):
        destructive = {"del", "xtrim", "zrem", "srem"} & set(grant.commands)
        if destructive - {"zrem"}:
            assert all("{echo-*}" in key for key in grant.keys), grant
        if "zrem" in destructive:
            assert grant.keys == ("%W~reach:agents",), grant
    assert user.root.channels == ()  # channels only beside the instance's own keys


def test_operator_read_grants_no_write_command() -> None:
    for version in ("6.2", "7"):
        user = operator_read(Keyspace("reach"), version)
        granted = {c for g in (user.root, *user.selectors) for c in g.commands}
        writes = {"hset", "hdel", "xadd", "del", "zadd", "zrem", "sadd", "publish", "expire"}
        assert not granted & writes, granted
        assert not user.root.channels


def test_the_placeholder_is_named_and_a_given_password_replaces_it() -> None:
    lines = acl_lines(["broker"], prefix="p1", version="7")
    assert any(f"Replace every {PLACEHOLDER}" in line for line in lines[:3])
    assert by_user(lines)["p1-broker"][2] == f">{PLACEHOLDER}"
    given_pw = acl_lines(["broker"], prefix="p1", version="7", password="s3cr$t>x")
    assert by_user(given_pw)["p1-broker"][2] == ">s3cr$t>x"
    assert PLACEHOLDER not in "\n".join(given_pw)


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"name": "a-b"}, "--name"),
        ({"name": "a*"}, "--name"),
        ({"name": "default"}, "default"),
        ({"name": ""}, "--name"),
        ({"agent": "a}b"}, "--agent"),
        ({"agent": "a*"}, "--agent"),
        ({"password": "has space"}, "--password"),
        ({"password": "it's"}, "--password"),
        ({"password": ""}, "--password"),
    ],
)
def test_names_agents_and_passwords_that_would_break_a_rule_are_refused(
    options: dict[str, str], problem: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        acl_lines(ROLES, prefix="reach", version="7", **{"agent": "echo", **options})


def test_without_an_agent_every_role_but_the_sidecar_is_printed() -> None:
    lines = acl_lines(ROLES, prefix="reach", version="7")
    assert "reach-sidecar-echo" not in by_user(lines)
    assert len(by_user(lines)) == len(ROLES) - 1
    assert any("give --agent" in line for line in lines)
    with pytest.raises(ValueError, match="--agent"):
        acl_lines(["sidecar"], prefix="reach", version="7")


@pytest.mark.parametrize(
    ("version", "rules"),
    [((7, 2, 4), "7"), ((7,), "7"), ((8, 0), "7"), ((6, 2, 14), "6.2"), ((6, 2), "6.2")],
)
def test_the_rule_set_follows_the_server_version(version: tuple[int, ...], rules: str) -> None:
    assert rules_version(version) == rules


def test_a_server_without_channel_rules_is_refused() -> None:
    with pytest.raises(ValueError, match=r"6\.0\.9 has no ACL rules for pub/sub channels"):
        rules_version((6, 0, 9))


@given(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1))
def test_a_password_reads_back_as_one_argument_or_is_refused(password: str) -> None:
    try:
        lines = acl_lines(["broker"], prefix="reach", version="7", password=password)
    except ValueError:
        assert "'" in password
        return
    assert by_user(lines)["reach-broker"][2] == f">{password}"


@given(st.text(max_size=80))
def test_any_name_or_agent_is_refused_or_stays_inside_its_own_pattern(text: str) -> None:
    try:
        lines = acl_lines(ROLES, prefix="reach", version="7", name=text, agent=text)
    except ValueError:
        return
    assert not set(text) & set("*?[]\\-'\" "), text  # no glob, no '-' overlap, no quoting
    rules = by_user(lines)[text]
    assert rules[-1] == f"(+xread +xdel +del ~reach:reply:{text}-*)"


def test_quote_keeps_plain_words_bare() -> None:
    assert quote("+xadd") == "+xadd"
    assert quote("%W~reach:in") == "'%W~reach:in'"
    assert shlex.split(quote("(+xread ~a:*)")) == ["(+xread ~a:*)"]


# -- every command the code sends is granted ---------------------------------------------------

# A command in Python: the first string of a tuple or list, or of a `call(...)`; in Lua, the
# first argument of redis.call. XINFO GROUPS, XGROUP CREATE, SCRIPT LOAD are subcommands.
_PY_COMMAND = re.compile(
    r'(?:(?<![\w.])[(\[]|\bcall\()\s*"([A-Z][A-Z_]+)"(?:\s*,\s*"([A-Z]+)")?\s*[,)]'
)
_LUA_COMMAND = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?")
_CONTAINERS = {"xinfo", "xgroup", "script", "config", "client", "object", "function", "cluster"}
# words the pattern also finds: arguments, and a name in an __all__ list
_NOT_COMMANDS = {"block", "streams", "terminal"}
# sent without a grant: every client may AUTH
_UNGRANTED = {"auth"}


def commands_in(paths: list[Path]) -> dict[str, set[str]]:
    """Command (``xinfo|groups`` for a subcommand) -> the files that send it."""
    found: dict[str, set[str]] = {}
    for path in paths:
        pattern = _LUA_COMMAND if path.suffix == ".lua" else _PY_COMMAND
        for match in pattern.finditer(path.read_text(encoding="utf-8")):
            command, sub = match.group(1).lower(), (match.group(2) or "").lower()
            name = f"{command}|{sub}" if command in _CONTAINERS and sub else command
            if name not in _NOT_COMMANDS | _UNGRANTED:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def granted(*users: User) -> set[str]:
    return {c for u in users for g in (u.root, *u.selectors) for c in g.commands}


LUA = sorted((ROOT / "broker" / "lua").glob("*.lua"))


def test_the_scanner_finds_commands() -> None:
    found = commands_in([*LUA, ROOT / "broker" / "acks.py", ROOT / "broker" / "streams.py"])
    assert {"hset", "xinfo|groups", "xreadgroup", "xtrim", "zadd"} <= set(found)


def test_every_redis_command_in_the_code_is_granted_to_a_role() -> None:
    keys = Keyspace("reach")
    users = [role_user(r, keys, "7", name="p", agent="a") for r in ROLES]
    paths = [
        *LUA,
        *(ROOT / "broker").glob("*.py"),
        *(ROOT / "adapters").glob("*.py"),
        *(ROOT / "workers").glob("*.py"),
        *(ROOT / "workers" / "cli").glob("*.py"),
    ]
    # the demo runs on the embedded server as its owner; the acl command's own INFO and the
    # ACL SETUSER lines it prints
    tooling = {
        ROOT / "workers" / "demo.py",
        ROOT / "workers" / "cli" / "acl.py",
        ROOT / "broker" / "acl.py",
    }
    found = commands_in([p for p in paths if p not in tooling])
    missing = {c: sorted(f) for c, f in found.items() if c not in granted(*users)}
    assert not missing


def test_the_broker_role_runs_its_processes_and_every_script() -> None:
    workers = [p for p in (ROOT / "workers").glob("*.py") if p.name != "demo.py"]
    broker_side = [
        ROOT / "broker" / name
        for name in ("store.py", "registry.py", "results.py", "deadletters.py", "timeline.py")
    ]
    found = commands_in([*LUA, *workers, *broker_side, ROOT / "broker" / "connection.py"])
    missing = {c: sorted(f) for c, f in found.items() if c not in BROKER_COMMANDS}
    assert not missing


def test_the_sidecar_role_runs_the_sidecar_and_its_scripts() -> None:
    scripts = [
        ROOT / "broker" / "lua" / f"{name}.lua"
        for name in (
            "heartbeat",
            "card_set",
            "release",
            "transition",
            "receive_process",
            "take",
            "move_record",
            "timeline",
            "count",
            "child_done",
        )
    ]
    # and the blocking reads it sends (broker/streams.py: XREADGROUP, XREAD before take.lua)
    reads = ROOT / "broker" / "streams.py"
    found = commands_in([*scripts, *(ROOT / "adapters").glob("*.py"), reads])
    user = sidecar(Keyspace("reach"), "7", "a")
    missing = {c: sorted(f) for c, f in found.items() if c not in granted(user)}
    assert not missing


def test_the_operator_runs_what_the_operator_read_does_and_more() -> None:
    keys = Keyspace("reach")
    assert granted(operator_read(keys, "7")) < granted(operator(keys, "7"))
    connect = {"ping", "select", "cluster|slots", "asking", "info", "wait", "time"}
    assert granted(producer(keys, "7", "p")) == connect | {"xadd", "xread", "xdel", "del"}


# -- the command -------------------------------------------------------------------------------


def test_the_command_prints_the_lines_for_the_asked_roles() -> None:
    argv = ["acl", "--role", "producer", "--role", "operator", "--name", "bob", "--prefix", "q1"]
    result = CliRunner().invoke(main, [*argv, "--for-redis", "6.2", "--password", "pw"])
    assert result.exit_code == 0, result.output
    assert list(by_user(result.output.splitlines())) == ["bob", "q1-operator"]
    assert "Redis 6.2 rules" in result.output


def test_the_command_defaults_to_redis_7_without_a_server() -> None:
    no_server = {"AGENT_REACH_REDIS_URL": None, "AGENT_REACH_CONFIG": None}
    result = CliRunner().invoke(main, ["acl", "--role", "producer"], env=no_server)
    assert result.exit_code == 0, result.output
    assert "'%W~reach:in'" in result.output


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--for-redis", "7", "--role", "sidecar"], "--agent"),
        (["--for-redis", "7", "--name", "a-b"], "--name"),
        (["--for-redis", "7", "--agent", "bad}{"], "--agent"),
        (["--for-redis", "7", "--password", "two words"], "--password"),
        (["--for-redis", "6.0"], "--for-redis"),
    ],
)
def test_the_command_refuses_bad_arguments_with_a_usage_error(argv: list[str], said: str) -> None:
    result = CliRunner().invoke(main, ["acl", *argv])
    assert result.exit_code == 2, result.output
    assert said in result.output


def test_a_partitioned_ingress_is_granted_by_name_and_nothing_beside_it() -> None:
    lines = acl_lines(["producer"], prefix="reach", version="7", name="p", partitions=3)
    rules = by_user(lines)["p"]
    ingress = [r for r in rules if r.startswith("%W~reach:in")]

    # a stream no dispatcher reads (reach:in:{7}) is not writable: nothing written is ignored
    assert ingress == ["%W~reach:in", "%W~reach:in:{1}", "%W~reach:in:{2}"]
