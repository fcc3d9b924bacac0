"""Settings: defaults < TOML file < AGENT_REACH_* environment < explicit overrides."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.config import (
    FIELDS,
    NON_SETTING_ENV,
    Settings,
    build_settings,
    env_layer,
    file_layer,
    load_settings,
)
from broker.errors import ConfigError
from broker.redaction import hide_secrets, url_without_password


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "reach.toml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(**kwargs: Any) -> ConfigError:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)
    return info.value


def test_defaults() -> None:
    settings = load_settings(environ={})

    assert settings == Settings()
    assert settings.redis_url is None
    assert settings.prefix == "reach"
    assert settings.heartbeat_s == 5.0
    assert settings.down_after_s == 15.0
    assert settings.dispatch_batch == 256
    assert settings.ingress_batch == 32
    assert settings.max_envelope_bytes == 1024 * 1024
    assert settings.record_ttl_s == 7 * 86400
    assert settings.timeline_max == 200


def test_every_default_is_itself_valid() -> None:
    defaults = msgspec.structs.asdict(Settings())
    assert build_settings([defaults]) == Settings()
    assert set(defaults) == set(FIELDS)


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(AttributeError):
        settings.prefix = "other"  # type: ignore[misc]


def test_file_overrides_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, 'prefix = "file"\nheartbeat_s = 2.5\ndispatch_batch = 10\n')
    settings = load_settings(config_file=path, environ={})

    assert settings.prefix == "file"
    assert settings.heartbeat_s == 2.5
    assert settings.dispatch_batch == 10
    assert settings.sidecar_batch == 256


def test_env_overrides_file_and_overrides_win(tmp_path: Path) -> None:
    path = write(tmp_path, 'prefix = "file"\nheartbeat_s = 2.5\ndispatch_batch = 10\n')
    environ = {"AGENT_REACH_PREFIX": "env", "AGENT_REACH_HEARTBEAT_S": "3", "PATH": "/bin"}
    settings = load_settings(config_file=path, environ=environ, overrides={"prefix": "flag"})

    assert settings.prefix == "flag"
    assert settings.heartbeat_s == 3.0
    assert settings.dispatch_batch == 10


def test_none_override_does_not_mask_lower_layers(tmp_path: Path) -> None:
    path = write(tmp_path, 'prefix = "file"\n')
    settings = load_settings(config_file=path, environ={}, overrides={"prefix": None})
    assert settings.prefix == "file"


def test_env_strings_are_converted() -> None:
    environ = {
        "AGENT_REACH_DISPATCH_BATCH": "32",
        "AGENT_REACH_SWEEP_INTERVAL_S": "0.25",
        "AGENT_REACH_REDIS_URL": "redis://h:1/0",
    }
    settings = load_settings(environ=environ)

    assert settings.dispatch_batch == 32
    assert settings.sweep_interval_s == 0.25
    assert settings.redis_url == "redis://h:1/0"


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "timeline_max = 50\n")
    settings = load_settings(environ={"AGENT_REACH_CONFIG": str(path)})
    assert settings.timeline_max == 50


def test_explicit_config_file_wins_over_environment(tmp_path: Path) -> None:
    explicit = write(tmp_path, "timeline_max = 50\n")
    settings = load_settings(
        config_file=explicit, environ={"AGENT_REACH_CONFIG": str(tmp_path / "absent.toml")}
    )
    assert settings.timeline_max == 50


@pytest.mark.parametrize("name", sorted(NON_SETTING_ENV))
def test_non_setting_variables_are_ignored(name: str) -> None:
    value = "a=kill" if name == "FAILPOINTS" else "anything"  # that one is checked
    assert env_layer({f"AGENT_REACH_{name}": value}) == {}


def test_config_and_failpoints_are_not_settings(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    environ = {"AGENT_REACH_CONFIG": str(path), "AGENT_REACH_FAILPOINTS": "a=kill"}
    assert load_settings(environ=environ) == Settings()


def test_unrelated_variables_are_ignored() -> None:
    assert env_layer({"HOME": "/root", "REACH_PREFIX": "x", "agent_reach_prefix": "y"}) == {}


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, 'prefix = "ok"\nhartbeat_s = 2\n')
    error = config_error(config_file=path)
    assert error.key == "hartbeat_s"
    assert "hartbeat_s" in str(error)
    assert "unknown key" in error.problem


def test_table_in_file_is_an_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[broker]\nprefix = 'x'\n")
    assert config_error(config_file=path).key == "broker"


def test_unknown_environment_variable_is_named() -> None:
    error = config_error(environ={"AGENT_REACH_HEARTBEAT": "1"})
    assert error.key == "AGENT_REACH_HEARTBEAT"
    assert "AGENT_REACH_HEARTBEAT" in str(error)
    assert "unknown environment variable" in error.problem


def test_unknown_override_is_named() -> None:
    assert config_error(overrides={"bogus": 1}).key == "bogus"


def test_redis_pool_size_is_gone_and_named_when_given() -> None:
    """No pool is sized any more: every connection is a dedicated one of ours (the
    pipeliner's, a blocking reader's, the subscriber's). A file that still sets it is told."""
    assert "redis_pool_size" not in Settings.__struct_fields__
    assert config_error(overrides={"redis_pool_size": 64}).key == "redis_pool_size"
    error = config_error(environ={"AGENT_REACH_REDIS_POOL_SIZE": "64"})
    assert error.key == "AGENT_REACH_REDIS_POOL_SIZE"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("heartbeat_s", 0),
        ("heartbeat_s", -1.0),
        ("heartbeat_s", 86401),
        ("dispatch_batch", 0),
        ("dispatch_batch", 10_001),
        ("ingress_batch", 0),
        ("ingress_batch", 10_001),
        ("max_envelope_bytes", 255),
        ("record_ttl_s", 59),
        ("timeline_max", 9),
        ("prefix", "has space"),
        ("prefix", ""),
        ("prefix", "x" * 65),
        ("prefix", "a{b}"),
        ("dispatch_batch", "many"),
        ("dispatch_batch", True),
    ],
)
def test_out_of_range_values_name_the_key(key: str, value: Any) -> None:
    error = config_error(overrides={key: value})
    assert error.key == key
    assert key in str(error)


@pytest.mark.parametrize(
    ("name", "value", "key"),
    [
        ("AGENT_REACH_HEARTBEAT_S", "0", "heartbeat_s"),
        ("AGENT_REACH_DISPATCH_BATCH", "0", "dispatch_batch"),
        ("AGENT_REACH_PREFIX", "two words", "prefix"),
        ("AGENT_REACH_HEARTBEAT_S", "nan", "heartbeat_s"),
    ],
)
def test_out_of_range_environment_values_name_the_key(name: str, value: str, key: str) -> None:
    assert config_error(environ={name: value}).key == key


def test_out_of_range_file_value_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "dispatch_batch = 0\n")
    assert config_error(config_file=path).key == "dispatch_batch"


@pytest.mark.parametrize(("key", "value"), [("down_after_s", 86400), ("dispatch_batch", 1)])
def test_range_bounds_are_inclusive(key: str, value: Any) -> None:
    assert getattr(load_settings(environ={}, overrides={key: value}), key) == value


def test_down_after_must_cover_a_heartbeat() -> None:
    error = config_error(overrides={"heartbeat_s": 20, "down_after_s": 15})
    assert error.key == "down_after_s" and "heartbeat_s" in str(error)


def test_capability_aliases_from_file_and_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[capability_aliases]\n"order.make" = "order.create"\n')
    assert load_settings(path, environ={}).capability_aliases == {"order.make": "order.create"}
    env = {"AGENT_REACH_CAPABILITY_ALIASES": '{"a.b": "c.d"}'}
    assert load_settings(environ=env).capability_aliases == {"a.b": "c.d"}
    assert config_error(environ={"AGENT_REACH_CAPABILITY_ALIASES": "{"}).key == (
        "capability_aliases"
    )
    assert config_error(overrides={"capability_aliases": {"Bad": "a.b"}}).key == (
        "capability_aliases"
    )


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "prefix = \n")
    error = config_error(config_file=path)
    assert error.key == str(path)
    assert "invalid TOML" in error.problem


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    error = config_error(config_file=path)
    assert error.key == str(path)
    assert "not found" in error.problem


def test_missing_file_named_by_environment_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    assert config_error(environ={"AGENT_REACH_CONFIG": str(path)}).key == str(path)


def test_file_layer_returns_the_table(tmp_path: Path) -> None:
    assert file_layer(write(tmp_path, "a = 1\nb = 'x'\n")) == {"a": 1, "b": "x"}


def test_later_layers_win() -> None:
    assert build_settings([{"prefix": "a"}, {"prefix": "b"}, {}]).prefix == "b"


def test_an_unreadable_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path, environ={})  # a directory
    binary = tmp_path / "bad.toml"
    binary.write_bytes(b"\xff\xfe prefix = 1")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(binary, environ={})


def test_a_prefix_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(environ={"AGENT_REACH_PREFIX": "reach\n"})
    assert excinfo.value.key == "prefix"


def test_callback_hosts_come_from_the_environment_as_a_comma_separated_list() -> None:
    settings = load_settings(
        environ={
            "AGENT_REACH_CALLBACK_HOSTS": " hooks.example.com, 127.0.0.1 ,",
            "AGENT_REACH_WEBHOOK_SECRET": "s3cret",
        }
    )

    assert settings.callback_hosts == ["hooks.example.com", "127.0.0.1"]
    assert settings.webhook_secret == "s3cret"
    assert Settings().callback_hosts == [] and Settings().webhook_secret is None


def test_governance_keys_load_from_toml_and_print_back(tmp_path: Path) -> None:
    import tomllib

    from click.testing import CliRunner

    from workers.cli import main

    path = tmp_path / "c.toml"
    path.write_text(
        'budgets = {"team-a" = {daily = 20.0, monthly = 300}, "team-b" = {daily = 5.0}}\n'
        'budget_mode = "cheapest"\n'
        'rate_limits = {tenant = {"team-a" = {rate = "600/min", burst = 5}}}\n'
        'intent_rules = [{match = "refund|reimburs", capability = "payment.refund", '
        'priority = 99}, {match = "\\U0001F4B8|caf\u00e9\\u007f", '
        'capability = "payment.refund"}]\n'
        'event_subscriptions = [{url = "http://127.0.0.1:9/h", events = ["message.dead"]}]\n'
        'webhook_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"\n'
        'callback_hosts = ["127.0.0.1"]\n'
    )
    settings = load_settings(path, environ={})
    assert settings.budgets["team-a"].daily == 20.0
    assert settings.rate_limits.tenant["team-a"].burst == 5
    assert settings.intent_rules[0].priority == 99
    assert settings.intent_rules[1].match == "\U0001f4b8|caf\u00e9\x7f"  # past U+FFFF, DEL
    printed = CliRunner().invoke(main, ["config", "--config", str(path), "--show-secrets"], env={})
    assert printed.exit_code == 0, printed.output
    shown = tomllib.loads(
        "\n".join(line for line in printed.output.splitlines() if not line.startswith("#"))
    )
    assert shown["budgets"] == {
        "team-a": {"daily": 20.0, "monthly": 300.0},
        "team-b": {"daily": 5.0},  # an unset period is left out: TOML has no null
    }
    assert shown["intent_rules"][0]["match"] == "refund|reimburs"
    assert shown["intent_hit"] == 0.85 and shown["intent_reject"] == 0.55
    # what `config` prints is a config file that loads back to the same settings
    again = tmp_path / "again.toml"
    again.write_text(printed.output)
    assert load_settings(again, environ={}) == settings


@pytest.mark.parametrize(
    ("layer", "key", "words"),
    [
        ({"rate_limits": {"agent": {"x": {"rate": "ten/s"}}}}, "rate_limits.agent.x", "rate is"),
        ({"rate_limits": {"agent": {"x": {"rate": "0/s"}}}}, "rate_limits.agent.x", "above zero"),
        ({"intent_rules": [{"match": "[", "capability": "a.b"}]}, "intent_rules[0]", "match"),
        ({"intent_rules": [{"match": "[[", "capability": "a.b"}]}, "intent_rules[0]", "nested"),
        ({"intent_rules": [{"match": "x", "capability": "Bad"}]}, "intent_rules[0]", "lower-case"),
        ({"intent_hit": 0.5}, "intent_reject", "intent_hit"),
        ({"embedding_url": "ftp://x"}, "embedding_url", "http"),
        ({"embedding_url": "ftp://u:hunter2@h/"}, "embedding_url", "'ftp://u:<hidden>@h/'"),
        ({"budgets": {"t": {"daily": -1}}}, "budgets", ">= 0"),
        ({"budget_mode": "free"}, "budget_mode", "reject"),
        ({"event_subscriptions": [{"url": "http://h", "events": ["x.y"]}]}, "event_", "known"),
        ({"event_subscriptions": [{"url": "http://127.0.0.1/h"}]}, "event_", "not allowed"),
        ({"budgets": {"team a": {"daily": 1}}}, "budgets", "printable"),
        ({"budgets": {"acme\n": {"daily": 1}}}, "budgets", "printable"),
        ({"budgets": {"-": {"daily": 1}}}, "budgets", "printable"),
        ({"rate_limits": {"tenant": {"": {"rate": "1/s"}}}}, "rate_limits", "printable"),
    ],
)
def test_governance_mistakes_name_their_key(layer: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_settings([layer])
    assert key in str(caught.value) and words in str(caught.value)


def test_governance_maps_come_from_the_environment_as_json() -> None:
    env = {"AGENT_REACH_BUDGETS": '{"t": {"daily": 1.5}}', "AGENT_REACH_INTENT_RULES": "[]"}
    assert load_settings(environ=env).budgets["t"].daily == 1.5
    with pytest.raises(ConfigError, match=r"budgets"):
        load_settings(environ={"AGENT_REACH_BUDGETS": "{nope"})


ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_the_project_reads_is_a_setting_or_known_to_be_none() -> None:
    """The console's token and the gateway's API key, documented as AGENT_REACH_* variables,
    were refused as unknown settings: with either set, no command started."""
    sources = [*ROOT.glob("broker/**/*.py"), *ROOT.glob("workers/**/*.py")]
    sources += [*ROOT.glob("adapters/**/*.py"), ROOT / "tests" / "conftest.py"]
    named = {
        match.removeprefix("AGENT_REACH_")
        for path in sources
        for match in re.findall(r'"(AGENT_REACH_[A-Z0-9_]+)"', path.read_text(encoding="utf-8"))
    }
    assert {"CONSOLE_TOKEN", "A2A_API_KEY", "TEST_REDIS"} <= named  # the scan finds them
    environ = {f"AGENT_REACH_{name}": "x" for name in named - {n.upper() for n in FIELDS}}
    environ["AGENT_REACH_FAILPOINTS"] = "a=kill"  # that one is checked

    assert env_layer(environ) == {}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://[::1", "a malformed IPv6 host"),
        ("redis://127.0.0.1:0/0", "port 0 is no server's port"),
        ("redis://h:99999", "the port is out of range 0-65535"),
        ("ftp://h", "unsupported scheme ftp://"),
    ],
)
def test_a_redis_url_that_names_no_server_is_refused_with_the_settings(url: str, says: str) -> None:
    """A malformed URL ended in a traceback when it was first printed (its password
    hidden), before anything parsed it; port 0 quietly meant 6379."""
    error = config_error(overrides={"redis_url": url})

    assert error.key == "redis_url" and says in error.problem


def test_an_empty_redis_url_is_the_embedded_redis() -> None:
    assert load_settings(environ={"AGENT_REACH_REDIS_URL": ""}).redis_url == ""


def test_a_failpoint_spec_that_does_not_parse_is_a_config_error_not_a_crash() -> None:
    """It raised at import: every command ended in a traceback before it began."""
    error = config_error(environ={"AGENT_REACH_FAILPOINTS": "bogus"})

    assert error.key == "AGENT_REACH_FAILPOINTS" and "unknown action" in error.problem


def test_a_config_pipe_is_read_and_one_nobody_writes_to_is_empty_not_a_hang(
    tmp_path: Path,
) -> None:
    """A FIFO nobody writes to, or /dev/zero, was read without end: the command hung. A pipe
    with a writer (`--config <(...)`) is a config file like any other."""
    fifo = tmp_path / "reach.toml"
    os.mkfifo(fifo)
    assert load_settings(fifo, environ={}) == load_settings(environ={})

    read_end, write_end = os.pipe()  # as `--config <(...)` hands a pipe over
    os.write(write_end, b"timeline_max = 50\n")
    os.close(write_end)
    try:
        assert load_settings(Path(f"/dev/fd/{read_end}"), environ={}).timeline_max == 50
    finally:
        os.close(read_end)
    assert "over 1048576 bytes" in config_error(config_file=Path("/dev/zero")).problem


def test_a_config_file_over_a_megabyte_or_nested_too_deeply_is_refused(tmp_path: Path) -> None:
    big = write(tmp_path, "# " + "x" * (1 << 20) + "\n")
    assert "over 1048576 bytes" in config_error(config_file=big).problem
    deep = write(tmp_path, "intent_rules = " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert config_error(config_file=deep).problem == "invalid TOML: nested too deeply"
    # tomllib's int() raises ValueError past 4,300 digits, no TOMLDecodeError
    long = write(tmp_path, "heartbeat_s = " + "1" * 4301 + "\n")
    assert (
        config_error(config_file=long).problem == "invalid TOML: a number of more than 4,300 digits"
    )


@pytest.mark.parametrize(
    "where",
    [
        {"environ": {"AGENT_REACH_HEARTBEAT_S": "\udcff"}},  # the byte 0xff, as os.environ has it
        {"environ": {"AGENT_REACH_BUDGETS": '{"\udcff": {"daily": 1}}'}},
        {"overrides": {"heartbeat_s": "\udcff"}},  # a flag's value
    ],
)
def test_a_value_that_is_no_utf8_text_is_refused_naming_its_key(where: dict[str, Any]) -> None:
    """A byte that is no UTF-8 reaches Python as a lone surrogate; every step after raised
    UnicodeEncodeError on it: a traceback."""
    error = config_error(**where)
    assert "heartbeat" in error.key.lower() or "budgets" in error.key.lower()
    assert error.problem.startswith("not valid UTF-8 text")


def test_an_intent_rule_nested_too_deeply_is_refused() -> None:
    """re's parser recurses into each group: 512 of them raised RecursionError."""
    rules = msgspec.json.encode([{"match": "(" * 512 + ")" * 512, "capability": "a.b"}])
    error = config_error(environ={"AGENT_REACH_INTENT_RULES": rules.decode()})
    assert error.key == "intent_rules[0]" and "groups nested more than 50 deep" in error.problem


def test_json_in_an_environment_variable_nested_too_deeply_is_refused() -> None:
    """It raised RecursionError while the settings were read: a traceback."""
    error = config_error(environ={"AGENT_REACH_INTENT_RULES": "[" * 30_000 + "]" * 30_000})

    assert error.key == "intent_rules" and "nested 30000 levels deep" in error.problem
    said = config_error(environ={"AGENT_REACH_BUDGETS": "{"}).problem
    assert said.startswith("expected JSON: ")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ("redis://user@h:1", "redis://user@h:1"),
        ("redis://:pw@h:1/2?x=1", "redis://:<hidden>@h:1/2?x=1"),
        ("rediss://u:p:w@h", "rediss://u:<hidden>@h"),
        ("https://u:key@[::1", "https://u:<hidden>@[::1"),  # does not split: hidden all the same
        ("not a url", "not a url"),
        # a password with an unencoded / ? or # ends the authority for a URL parser
        ("redis://u:pa/ss@h:1/0", "redis://u:<hidden>@h:1/0"),
        ("redis://u:pa#ss@h", "redis://u:<hidden>@h"),
        ("https://u:pa?ss@h/v1", "https://u:<hidden>@h/v1"),
        # query parameters named as secrets: their values, not their names nor the others
        ("https://h/e?api_key=abc&x=1", "https://h/e?api_key=<hidden>&x=1"),
        ("https://h/e?x=1&access_token=t#top", "https://h/e?x=1&access_token=<hidden>#top"),
        (
            "https://h/e?X-Amz-Signature=s&sig=2",
            "https://h/e?X-Amz-Signature=<hidden>&sig=<hidden>",
        ),
        ("https://u:pw@h/e?token=t", "https://u:<hidden>@h/e?token=<hidden>"),
        ("https://h/e?api%5Fkey=abc", "https://h/e?api%5Fkey=<hidden>"),
        ("https://h/e?keyboard=qwerty&monkey=1", "https://h/e?keyboard=qwerty&monkey=1"),
        (
            "rediss://h/0?ssl_keyfile=/k&ssl_certfile=/c",
            "rediss://h/0?ssl_keyfile=/k&ssl_certfile=/c",
        ),
        ("https://h/e?token", "https://h/e?token"),  # no value to hide
        ("https://h/e?to=a@b&token=t", "https://h/e?to=a@b&token=<hidden>"),
        # names in camelCase, ; as a separator, a fragment's parameters (OAuth's implicit flow)
        (
            "https://h/e?accessToken=t&clientSecret=s",
            "https://h/e?accessToken=<hidden>&clientSecret=<hidden>",
        ),
        ("https://h/e?a=1;api+key=k", "https://h/e?a=1;api+key=<hidden>"),
        ("https://h/cb#access_token=t&state=1", "https://h/cb#access_token=<hidden>&state=1"),
        # mistyped: no :// (a refused URL is said back all the same)
        ("https//user:pw@h/x", "https//user:<hidden>@h/x"),
        ("//user:pw@h/x", "//user:<hidden>@h/x"),
        ("https:user:pw@h", "https:<hidden>@h"),
        ("user:pw@h:80", "user:<hidden>@h:80"),
        # a tab or line break, which a URL parser drops: dropped here too, then read
        ("redis:/\t/user:pw@localhost//0", "redis://user:<hidden>@localhost//0"),
        # an @ in a secret's value, a ? or ; in it: what either reading hides is hidden
        ("https://h.example:8443/cb?password=pw@horse", "https://h.example:<hidden>"),
        ("https://h/?access_token=AAAA?BBBB", "https://h/?access_token=<hidden>"),
        ("https://h/?access_token=AAAA;BBBB", "https://h/?access_token=<hidden>"),
        ("https://u:pa?token=x@h/", "https://u:<hidden>"),
        # run-together names: the long words anywhere, the short ones as words only
        (
            "https://h/?ACCESSTOKEN=a&sessionid=b&apikeyid=c",
            "https://h/?ACCESSTOKEN=<hidden>&sessionid=<hidden>&apikeyid=<hidden>",
        ),
        ("https://h/e?author=me&monkey=1", "https://h/e?author=me&monkey=1"),
    ],
)
def test_url_without_password(url: str, shown: str) -> None:
    assert url_without_password(url) == shown


_SECRET_TEXT = st.text(
    st.characters(blacklist_characters="@&#=", blacklist_categories=("Cs",)), min_size=1
).map(lambda t: f"Z9{t}Q7")  # never a piece of the URL around it


@given(password=_SECRET_TEXT, token=_SECRET_TEXT, name=st.sampled_from(["token", "Api-Key"]))
def test_no_password_nor_secret_parameter_is_shown(password: str, token: str, name: str) -> None:
    url = f"https://user:{password}@h.example/e?x=1&{name}={token}"
    shown = url_without_password(url)
    assert password not in shown and token not in shown
    assert shown.startswith("https://user:<hidden>@")


def test_only_the_settings_that_hold_secrets_are_hidden() -> None:
    """A tenant called ``webhook_secret`` or an intent rule that reads like a URL is no
    secret: hidden, its whole line would be left out of what loads back."""
    values = {
        "webhook_secret": "whsec_x",
        "budgets": {"webhook_secret": {"daily": 1.0}},
        "intent_rules": [{"match": "//x:y@", "capability": "a.b"}],
        "event_subscriptions": [{"url": "https://hook:pw@h.example/e", "events": []}],
        "redis_url": "redis://127.0.0.1:6379",
    }
    shown, hidden = hide_secrets(values)
    assert hidden == {"webhook_secret", "event_subscriptions"}
    assert shown["event_subscriptions"][0]["url"] == "https://hook:<hidden>@h.example/e"
    assert {k: shown[k] for k in ("budgets", "intent_rules", "redis_url")} == {
        k: values[k] for k in ("budgets", "intent_rules", "redis_url")
    }
