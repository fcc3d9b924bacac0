"""``agent-reach acl``: print the ``ACL SETUSER`` lines of :mod:`broker.acl` for the configured
prefix, asking the server its version when ``--for-redis`` does not say it."""

from __future__ import annotations

import re

import click

from broker.acl import REDIS_VERSIONS, ROLES, acl_lines, arguments_problem, rules_version
from broker.config import Settings
from broker.errors import RedisUnavailable
from broker.resp import RespConnection

from .common import redis_options, run


async def ask_rules_version(url: str) -> str:
    """The rule set for the server at ``url``, from its ``INFO server``."""
    conn = await RespConnection.open(url)
    try:
        (info,) = await conn.execute([("INFO", "server")])
    finally:
        await conn.close()
    if isinstance(info, Exception):
        raise RedisUnavailable(f"cannot ask redis its version ({info}): give --for-redis")
    for line in info.decode(errors="replace").splitlines():
        if line.startswith("redis_version:"):
            version = [int(part) for part in re.findall(r"\d+", line.partition(":")[2])]
            try:
                return rules_version(version)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from exc
    raise RedisUnavailable("redis did not say its version (INFO server): give --for-redis")


@click.command()
@redis_options
@click.option(
    "--role",
    "roles",
    type=click.Choice(ROLES),
    multiple=True,
    help="A role to print (repeatable; default: every role).",
)
@click.option(
    "--name",
    default="producer",
    show_default=True,
    help="The producer's name: its Redis user, and the owner of its reply streams.",
)
@click.option("--agent", default=None, help="The sidecar's agent id (needed for its role).")
@click.option(
    "--password",
    default=None,
    help="The users' password (default: a placeholder the output says to replace).",
)
@click.option(
    "--for-redis",
    "for_redis",
    type=click.Choice(REDIS_VERSIONS),
    default=None,
    help="The server's version: 7 has key read/write rules and selectors, 6.2 does not "
    "(default: ask the server given by --redis, else 7).",
)
def acl(
    settings: Settings,
    roles: tuple[str, ...],
    name: str,
    agent: str | None,
    password: str | None,
    for_redis: str | None,
) -> None:
    """Print ACL SETUSER lines for redis-cli: a Redis user per role (producer, sidecar,
    broker, operator-read, operator), with the commands it runs on the prefix's keys only."""
    if "sidecar" in roles and agent is None:
        raise click.UsageError("--role sidecar needs --agent AGENT_ID")
    asked = roles or ROLES
    problem = arguments_problem(asked, name=name, agent=agent, password=password)
    if problem is not None:
        raise click.UsageError(problem)
    try:
        lines = acl_lines(
            asked,
            prefix=settings.prefix,
            version=for_redis or _server_rules(settings),
            name=name,
            agent=agent,
            password=password,
            partitions=settings.ingress_partitions,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo("\n".join(lines))


def _server_rules(settings: Settings) -> str:
    """The rule set of the server given by ``--redis`` (asked), else Redis 7's."""
    return run(ask_rules_version, settings.redis_url) if settings.redis_url else "7"
