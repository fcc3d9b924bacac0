"""The Lua scripts, loaded as package data; one file per atomic operation."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class ScriptName(StrEnum):
    ACCEPT = "accept"
    ACCEPT_ASSIGN = "accept_assign"
    ACCEPT_DIRECT = "accept_direct"
    ASSIGN = "assign"
    TRANSITION = "transition"
    TRANSITION_IF = "transition_if"
    RECEIVE_PROCESS = "receive_process"
    TAKE = "take"
    CLAIM_ASSIGN = "claim_assign"
    RELEASE = "release"
    RETURN_CREDITS = "return_credits"
    FINISH = "finish"
    HEARTBEAT = "heartbeat"
    BACKLOG = "backlog"
    CLAIM_DUE = "claim_due"
    RESCHEDULE_DUE = "reschedule_due"
    CHILD_DONE = "child_done"
    NOTE = "note"
    FORGET_INSTANCE = "forget_instance"
    UNLIST_GONE = "unlist_gone"
    GCRA = "gcra"
    CARD_SET = "card_set"
    RENEW_OWN = "renew_own"


@dataclass(frozen=True, slots=True)
class Script:
    name: ScriptName
    source: str
    sha: str


def _script(name: ScriptName, source: str) -> Script:
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


_ROOT = Path(__file__).parent / "lua"  # package data, shipped beside this module
# These count what they do (lua/count.lua, prepended): the scripts that end or retry a message.
COUNTING = frozenset(
    {
        ScriptName.ACCEPT,
        ScriptName.ACCEPT_ASSIGN,
        ScriptName.ACCEPT_DIRECT,
        ScriptName.TRANSITION,
        ScriptName.TRANSITION_IF,
        ScriptName.RECEIVE_PROCESS,
        ScriptName.TAKE,
        ScriptName.CLAIM_ASSIGN,
        ScriptName.CHILD_DONE,
    }
)
# These write a message's timeline (lua/timeline.lua, prepended: the field and its cap).
TIMELINE = COUNTING | {ScriptName.NOTE}
# The functions shared by scripts, each prepended to those that use it, in this order.
PRELUDES: tuple[tuple[str, frozenset[ScriptName]], ...] = (
    ("count", COUNTING),
    ("timeline", TIMELINE),
    (
        "accept_record",
        frozenset({ScriptName.ACCEPT, ScriptName.ACCEPT_ASSIGN, ScriptName.ACCEPT_DIRECT}),
    ),
    (
        "move_record",
        frozenset(
            {
                ScriptName.TRANSITION,
                ScriptName.TRANSITION_IF,
                ScriptName.RECEIVE_PROCESS,
                ScriptName.TAKE,
                ScriptName.CLAIM_ASSIGN,
            }
        ),
    ),
    ("fence", frozenset({ScriptName.TRANSITION_IF, ScriptName.CLAIM_ASSIGN})),
    ("group_backlog", frozenset({ScriptName.BACKLOG, ScriptName.ACCEPT_DIRECT})),
    (
        "free_credits",
        frozenset({ScriptName.RELEASE, ScriptName.FINISH, ScriptName.RETURN_CREDITS}),
    ),
    (
        "assign_credit",
        frozenset(
            {
                ScriptName.ASSIGN,
                ScriptName.ACCEPT_ASSIGN,
                ScriptName.CLAIM_ASSIGN,
                ScriptName.ACCEPT_DIRECT,
            }
        ),
    ),
)


def script_source(name: ScriptName) -> str:
    preludes = [part for part, uses in PRELUDES if name in uses]
    return "".join((_ROOT / f"{part}.lua").read_text() for part in [*preludes, name])


def load_scripts() -> dict[ScriptName, Script]:
    """Every script shipped in ``broker/lua``, by name."""
    return {name: _script(name, script_source(name)) for name in ScriptName}
