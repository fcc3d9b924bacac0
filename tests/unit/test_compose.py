"""compose.yaml: valid per the Compose Specification, and every command one our CLI accepts.

The schema is the upstream draft-07 Compose Specification (see ``tests/data/README.md``).
Commands are parsed by the real click group, so a renamed subcommand or option fails here
rather than in a crash-looping container.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from jsonschema import Draft7Validator
from jsonschema.exceptions import ValidationError

from workers.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
SCHEMA_FILE = ROOT / "tests" / "data" / "compose-spec.json"
REDIS_URL = "redis://redis:6379/0"
CLUSTER_URL = "redis://redis-c1:6379"
# The services run from the project image; a new one must be added here (and is then checked).
PROJECT_SERVICES = (
    "dispatcher",
    "demo-agent",
    "demo-sidecar",
    "cluster-dispatcher",
    "cluster-sidecar",
)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(document, dict), "compose.yaml is not a mapping"
    return document


@pytest.fixture(scope="module")
def validator() -> Draft7Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema)


def describe(error: ValidationError) -> str:
    """One line per error; a failed oneOf/anyOf adds its deepest cause, usually the real one."""
    line = f"  {error.json_path}: {error.message}"
    if error.context:
        cause = max(error.context, key=lambda e: len(e.absolute_path))
        line += f"\n    because {cause.json_path}: {cause.message}"
    return line


def schema_errors(validator: Draft7Validator, document: dict[str, Any]) -> list[str]:
    return [describe(e) for e in sorted(validator.iter_errors(document), key=lambda e: e.json_path)]


def uses_project_image(service: dict[str, Any]) -> bool:
    """Built from this repository's Dockerfile (``build: .`` or the long form)."""
    build = service.get("build")
    if build is None:
        return False
    if isinstance(build, str):
        build = {"context": build}
    dockerfile = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
    return dockerfile.resolve() == (ROOT / "Dockerfile").resolve()


def service_environment(service: dict[str, Any]) -> dict[str, str]:
    """``environment`` in either Compose form (mapping, or list of KEY=VALUE) as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def command_words(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def parse_cli(argv: list[str]) -> click.Context:
    """Parse ``agent-reach ARGV`` as the CLI would; only parses, never runs the command."""
    name, *args = argv
    command = main.commands.get(name)
    if command is None:
        raise click.UsageError(f"no such command {name!r}; have {sorted(main.commands)}")
    return command.make_context(name, args, resilient_parsing=False)


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No AGENT_REACH_* from the test runner's environment leaks into option defaults."""
    for key in list(os.environ):
        if key.startswith("AGENT_REACH_"):
            monkeypatch.delenv(key)
    return monkeypatch


def parse_service_command(service: dict[str, Any], env: pytest.MonkeyPatch) -> click.Context:
    """Parse a service's command with the service's environment, as in its container."""
    words = command_words(service["command"])
    assert words[0] == "agent-reach", f"command starts with {words[0]!r}, not agent-reach"
    for key, value in service_environment(service).items():
        env.setenv(key, value)
    return parse_cli(words[1:])


def test_compose_file_matches_the_compose_specification(
    compose: dict[str, Any], validator: Draft7Validator
) -> None:
    errors = schema_errors(validator, compose)
    if errors:
        pytest.fail(
            "compose.yaml does not match the Compose Specification:\n" + "\n".join(errors),
            pytrace=False,
        )


def test_schema_check_rejects_an_invalid_compose_file(
    compose: dict[str, Any], validator: Draft7Validator
) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["dispatcher"]["depends_on"]["redis"]["condition"] = "service_ready"
    broken["services"]["dispatcher"]["restart_policy"] = "always"
    report = "\n".join(schema_errors(validator, broken))
    assert "$.services.dispatcher: 'restart_policy' does not match" in report
    expected = "$.services.dispatcher.depends_on.redis.condition: 'service_ready' is not one of"
    assert expected in report


def test_project_services_are_built_from_the_dockerfile(compose: dict[str, Any]) -> None:
    built = {name for name, svc in compose["services"].items() if uses_project_image(svc)}
    assert built == set(PROJECT_SERVICES)
    assert (ROOT / "Dockerfile").is_file()


@pytest.mark.parametrize("name", PROJECT_SERVICES)
def test_project_service_command_is_a_valid_cli_invocation(
    compose: dict[str, Any], cli_env: pytest.MonkeyPatch, name: str
) -> None:
    service = compose["services"][name]
    assert isinstance(service.get("command"), list), f"{name}: command must be a YAML list"
    ctx = parse_service_command(service, cli_env)
    if "redis_url" in ctx.params:
        on_cluster = name.startswith("cluster-")
        expected = CLUSTER_URL if on_cluster else REDIS_URL
        assert ctx.params["redis_url"] == expected, f"{name} would start an embedded Redis"
        waits_for = "cluster-create" if on_cluster else "redis"
        condition = "service_completed_successfully" if on_cluster else "service_healthy"
        assert service["depends_on"][waits_for]["condition"] == condition


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["up", "--no-such-flag"], click.NoSuchOption),
        (["no-such-command"], click.UsageError),
        (["sidecar", "--capability", "demo.echo", "--http", "http://x/"], click.MissingParameter),
        (
            ["sidecar", "--agent-id", "a", "--capability", "c", "--max-inflight", "0"],
            click.BadParameter,
        ),
        (["demo-agent", "--port", "eighty"], click.BadParameter),
    ],
)
def test_parse_cli_rejects_what_the_cli_rejects(
    cli_env: pytest.MonkeyPatch, argv: list[str], error: type[click.UsageError]
) -> None:
    with pytest.raises(error):
        parse_cli(argv)


def test_redis_keeps_an_append_only_file_on_a_named_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    words = command_words(redis["command"])
    assert words[0] == "redis-server"
    assert words[words.index("--appendonly") + 1] == "yes"
    assert words[words.index("--appendfsync") + 1] == "everysec"
    volume = next(v for v in redis["volumes"] if v.endswith(":/data"))
    assert volume.split(":")[0] in compose["volumes"], "the /data volume is not a named volume"


def test_redis_healthcheck_pings(compose: dict[str, Any]) -> None:
    check = compose["services"]["redis"]["healthcheck"]
    assert not check.get("disable", False)
    test = check["test"]
    if isinstance(test, str):
        words = shlex.split(test)
    elif test[0] == "CMD-SHELL":
        words = shlex.split(test[1])
    else:
        assert test[0] == "CMD", test
        words = test[1:]
    assert words == ["redis-cli", "ping"]


def test_services_wait_for_a_healthy_redis(compose: dict[str, Any]) -> None:
    dependents = {}
    for name, service in compose["services"].items():
        depends_on = service.get("depends_on", {})
        # The short (list) form means condition: service_started, which does not wait for ping.
        assert not (isinstance(depends_on, list) and "redis" in depends_on), name
        if "redis" in depends_on:
            dependents[name] = depends_on["redis"]["condition"]
    assert {"dispatcher", "demo-sidecar"} <= dependents.keys()
    assert set(dependents.values()) == {"service_healthy"}, dependents


def test_dispatcher_scales_out(compose: dict[str, Any]) -> None:
    broker = compose["services"]["dispatcher"]
    # Replicas need distinct names and no shared host port; the consumer name defaults to
    # hostname-pid, so a fixed hostname or --consumer would give every replica the same one.
    for key in ("container_name", "ports", "hostname"):
        assert key not in broker, f"broker sets {key}: --scale dispatcher=N would clash"
    assert "--consumer" not in command_words(broker["command"])
    assert broker["restart"] == "unless-stopped"


def test_sidecar_calls_a_service_it_waits_for(
    compose: dict[str, Any], cli_env: pytest.MonkeyPatch
) -> None:
    sidecar = compose["services"]["demo-sidecar"]
    ctx = parse_service_command(sidecar, cli_env)
    host = urlsplit(ctx.params["http_url"]).hostname
    assert host in compose["services"]
    assert sidecar["depends_on"][host]["condition"] == "service_started"


def test_the_observe_profile_scrapes_what_the_broker_serves(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["prometheus"]["profiles"] == ["observe"]
    assert services["grafana"]["profiles"] == ["observe"]
    for name, port in (("dispatcher", "9464"), ("demo-sidecar", "9465")):
        words = command_words(services[name]["command"])
        assert words[words.index("--metrics-port") + 1] == port, name
        assert words[words.index("--metrics-host") + 1] == "0.0.0.0", name
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["agent-reach"]["dns_sd_configs"][0] == {
        "names": ["dispatcher"],
        "type": "A",
        "port": 9464,
    }
    assert jobs["agent-reach-sidecars"]["static_configs"][0]["targets"] == ["demo-sidecar:9465"]
    mounted = [v.split(":")[0] for v in services["grafana"]["volumes"]]
    for source in mounted:
        assert (ROOT / source).exists(), source


def test_the_cluster_profile_creates_a_cluster_the_broker_runs_on(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nodes = [name for name in services if name.startswith("redis-c")]
    assert len(nodes) == 6
    for name in nodes:
        words = command_words(services[name]["command"])
        assert services[name]["profiles"] == ["cluster"]
        assert words[words.index("--cluster-enabled") + 1] == "yes", name
        assert words[words.index("--appendonly") + 1] == "yes", name
    create = services["cluster-create"]
    script = " ".join(command_words(create["command"]))
    assert "--cluster-replicas 1" in script and "--cluster-yes" in script
    assert set(create["depends_on"]) == set(nodes)  # every node, healthy, before it runs
    for name in ("cluster-dispatcher", "cluster-sidecar"):
        waits = services[name]["depends_on"]["cluster-create"]["condition"]
        assert waits == "service_completed_successfully", name
        assert services[name]["profiles"] == ["cluster"]
