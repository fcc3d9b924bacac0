"""Which event loop a command runs on (workers/cli/event_loop.py)."""

from __future__ import annotations

import pytest
import uvloop

from broker.errors import ConfigError
from workers.cli.event_loop import VARIABLE, loop_factory


@pytest.mark.parametrize("value", [None, "auto", "AUTO ", "", "uvloop"])
def test_uvloop_where_installed_unless_asked_otherwise(value: str | None) -> None:
    factory = loop_factory({} if value is None else {VARIABLE: value})
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_asyncio_when_asked() -> None:
    assert loop_factory({VARIABLE: "asyncio"}) is None


@pytest.mark.parametrize("value", ["trio", "uv loop", "1"])
def test_anything_else_is_refused_naming_the_choices(value: str) -> None:
    with pytest.raises(ConfigError, match="auto, uvloop, asyncio"):
        loop_factory({VARIABLE: value})
