"""The Lua scripts, loaded as package data; one file per atomic operation."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class ScriptName(StrEnum):
    ACCEPT = "accept"
    ASSIGN = "assign"
    TRANSITION = "transition"
    RELEASE = "release"
    HEARTBEAT = "heartbeat"
    BACKLOG = "backlog"
    CLAIM_DUE = "claim_due"
    RESCHEDULE_DUE = "reschedule_due"
    CHILD_DONE = "child_done"
    NOTE = "note"
    FORGET_INSTANCE = "forget_instance"
    GCRA = "gcra"


@dataclass(frozen=True, slots=True)
class Script:
    name: ScriptName
    source: str
    sha: str


def _script(name: ScriptName, source: str) -> Script:
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


_ROOT = Path(__file__).parent / "lua"  # package data, shipped beside this module
# These count what they do (lua/count.lua, prepended): the scripts that end or retry a message.
COUNTING = frozenset({ScriptName.ACCEPT, ScriptName.TRANSITION, ScriptName.CHILD_DONE})


def script_source(name: ScriptName) -> str:
    source = (_ROOT / f"{name}.lua").read_text()
    return (_ROOT / "count.lua").read_text() + source if name in COUNTING else source


def load_scripts() -> dict[ScriptName, Script]:
    """Every script shipped in ``broker/lua``, by name."""
    return {name: _script(name, script_source(name)) for name in ScriptName}
