"""What every command shares: running a coroutine, the Redis options, parameter parsing."""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import anyio
import click

from broker.config import load_settings
from broker.envelope import MESSAGE_ID_PATTERN
from broker.errors import ConfigError, ReachError

from .event_loop import loop_factory

P = ParamSpec("P")
T = TypeVar("T")


def run(main: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a coroutine on asyncio (uvloop's loop where installed: :mod:`.event_loop`); our
    errors become one clear line and a non-zero exit."""
    try:
        options = {"loop_factory": loop_factory()}
        return anyio.run(lambda: main(*args, **kwargs), backend="asyncio", backend_options=options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except ReachError as exc:
        raise click.ClickException(str(exc)) from exc
    except BaseExceptionGroup as group:
        # a task group wraps what a command raised inside it: show the one clear error
        lone = _lone(group)
        if isinstance(lone, click.ClickException):
            raise lone from None
        if isinstance(lone, ReachError):
            raise click.ClickException(str(lone)) from None
        raise


def _lone(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The single exception at the bottom of nested groups, if there is exactly one."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup):
        if len(inner.exceptions) != 1:
            return None
        inner = inner.exceptions[0]
    return inner


def redis_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--redis``, ``--config`` and ``--prefix`` for every command that talks to Redis."""

    @click.option(
        "--redis",
        "redis_url",
        envvar="AGENT_REACH_REDIS_URL",
        metavar="URL",
        help="Redis URL; without one an embedded redis-server is started.",
    )
    @click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        envvar="AGENT_REACH_CONFIG",
        help="TOML configuration file.",
    )
    @click.option("--prefix", default=None, help="Key prefix (default: reach).")
    @wraps(command)
    def wrapper(
        redis_url: str | None, config_file: Path | None, prefix: str | None, **kwargs: Any
    ) -> Any:
        try:
            settings = load_settings(config_file, {"redis_url": redis_url, "prefix": prefix})
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        return command(settings=settings, **kwargs)

    return wrapper


def parse_tags(values: tuple[str, ...], hint: str = "--tag") -> dict[str, str]:
    """``KEY=VALUE`` pairs (repeatable option) as a dict."""
    tags = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r}: expected KEY=VALUE", param_hint=hint)
        tags[key] = val
    return tags


def check_id(value: str | None, hint: str) -> None:
    if value is not None and not re.match(MESSAGE_ID_PATTERN, value):
        raise click.BadParameter(
            f"{value!r}: use 1-128 of letters, digits and _ . : -", param_hint=hint
        )


class FiniteRange(click.FloatRange):
    """A float range that also refuses ``nan`` (which every comparison lets through)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


class ListenHost(click.types.StringParamType):
    """An address to listen on, named: an empty one would listen on every interface (a
    server binds ``""`` to all of them), which must be asked for as such."""

    name = "address"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = super().convert(value, param, ctx)
        if not text.strip():
            self.fail("give an address (0.0.0.0 or :: to listen on every interface)", param, ctx)
        if not text.isprintable() or " " in text or len(text) > 255:
            self.fail(f"{text[:60]!r} is no host name or IP address", param, ctx)
        return text


def host_option(name: str, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An address to listen on: loopback unless asked, and a named one (:class:`ListenHost`)."""
    return click.option(name, type=ListenHost(), default="127.0.0.1", show_default=True, help=help)


def utc_text(ms: int, fmt: str | None = "%Y-%m-%d %H:%M:%S") -> str:
    """A time in ms since the epoch as UTC text (``fmt`` ``None``: ISO 8601 to the ms); one
    no calendar holds (anyone who may write a dead letter or an event writes its time) as
    the number itself, not a traceback."""
    try:
        when = datetime.fromtimestamp(ms / 1000, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return f"@{ms}"
    return when.isoformat(timespec="milliseconds") if fmt is None else when.strftime(fmt)
