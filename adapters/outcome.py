"""What a delivery attempt tells the sidecar, as data.

The kinds differ in what is known about the agent: it answered (``Succeeded``, ``Failed``),
it asked for time (``Backoff``: 429 / 503, it did not take the work), it took the work and
will call back (``Accepted``: 202, async agents), it was provably never
reached (``NotReached``: a retry is always safe), or the request left and no answer came back
(``Ambiguous``: only an idempotent agent may be retried), or it asked a question only a
person can answer (``NeedsInput``: parked for an operator).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from broker.jsondepth import MAX_JSON_DEPTH, depth_problem
from broker.usage import Usage


class Succeeded(msgspec.Struct, frozen=True, tag=True):
    result: bytes  # JSON
    usage: Usage | None = None  # reported apart from the result (headers, metadata)


class Failed(msgspec.Struct, frozen=True, tag=True):
    reason: str
    fault: bool = True  # the agent's own failure (5xx, an exception), not a refused request
    usage: Usage | None = None


class NotReached(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Ambiguous(msgspec.Struct, frozen=True, tag=True):
    reason: str
    usage: Usage | None = None  # what the answer reported spending, when one came


class Backoff(msgspec.Struct, frozen=True, tag=True):
    """The agent answered 429 / 503: too busy now, not failed; try again after a while."""

    reason: str
    retry_after_s: float
    usage: Usage | None = None  # what the refusal reported spending, if anything


class Accepted(msgspec.Struct, frozen=True, tag=True):
    """The agent took the work (202) and will call back with the result."""

    task_id: str = ""


class NeedsInput(msgspec.Struct, frozen=True, tag=True):
    """The agent asks for something before it can go on (an A2A task in INPUT_REQUIRED or
    AUTH_REQUIRED): the message waits for an operator, with the agent's question."""

    reason: str


Outcome = Succeeded | Failed | NotReached | Ambiguous | Backoff | Accepted | NeedsInput


State = Literal["done", "running", "failed", "unknown"]


class Status(msgspec.Struct, frozen=True):
    """What an agent's status endpoint (or an A2A agent's ``GetTask``) says of a message."""

    state: State
    result: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    error: str | None = None
    why: str = ""  # for the timeline: how the answer was obtained

    @property
    def result_json(self) -> bytes:
        return bytes(self.result)


def held_to_depth(outcome: Outcome) -> Outcome:
    """A result nested deeper than :data:`~broker.jsondepth.MAX_JSON_DEPTH` is the agent's
    failure, with the reason, as a callback's is: stored, it would fail each reader whose
    stack is deeper than the sidecar's (a trace, the console, a client) where it decoded."""
    if not isinstance(outcome, Succeeded):
        return outcome
    result = outcome.result
    if result.count(b"[") + result.count(b"{") <= MAX_JSON_DEPTH:  # cannot nest deeper
        return outcome
    problem = depth_problem(result)
    if problem is None:
        return outcome
    return Failed(f"the agent's result: {problem}", usage=outcome.usage)
