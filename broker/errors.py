"""The one exception tree of Agent-Reach.

::

    ReachError
    ├── ConfigError              a configuration key is unknown or its value is out of range
    ├── InvalidEnvelope          an envelope cannot be decoded or fails validation
    ├── IllegalTransition        a stage change the lifecycle table does not allow
    ├── UnknownMessage           no record exists for a message id
    ├── RedisUnavailable         Redis cannot be reached, or cannot serve now (``LOADING``, …)
    ├── RedisReplyError          Redis answered a command with an error reply (``.code``)
    ├── EmbeddedRedisError       the embedded redis-server could not be found or started
    ├── DeliveryError            an adapter could not deliver a message to its agent
    ├── RequestTimeout           no result reached ``Client.request`` within its timeout
    └── ClientNotOpen            a client was used outside ``async with Client(...)`` (request)
                                 or ``with SyncClient(...)``

Outside ``broker``, two more are ``ReachError`` too: ``workers.egress.EgressRefused`` (a
webhook host resolves only to addresses the allow-list does not let a delivery reach) and
``adapters.factory.SidecarOptionError`` (a sidecar's options cannot make an instance;
``.option`` names the one at fault).

Redis errors are translated into these in one place, :mod:`broker.resp`: an error reply is
a :class:`RedisReplyError` carrying its code (the reply's first word), except the codes that
mean "retry later" (:data:`broker.resp.TRANSIENT`), which are :class:`RedisUnavailable` with
that code, and so is a lost or silent connection (the original kept in ``__cause__``).
Code elsewhere tells replies apart by ``.code``, never by their text.
"""

from __future__ import annotations

import re
from typing import Any


def quoted(value: str, *, length: int | None = None) -> str:
    """``value`` as a message quotes it: its ``repr``, cut to 120 characters past 130, with
    its length (a refusal repeats what it refuses; an attacker chooses how long that is).
    ``length``: the length to state, where ``value`` stands for a longer text (one with a
    secret hidden)."""
    if len(value) <= 130:
        return repr(value)
    return f"{value[:120]!r}… ({len(value) if length is None else length} characters)"


class ReachError(Exception):
    """Root of every error raised by Agent-Reach."""


class ConfigError(ReachError):
    """Raised when a configuration key is unknown or its value is out of range."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key {key!r}: {problem}")
        self.key = key
        self.problem = problem


class CannotListen(ReachError):
    """An endpoint of ours cannot take its address (in use, not ours to bind): start-up
    stops with this reason, in one line."""


class InvalidEnvelope(ReachError):
    """Raised when raw bytes cannot become an envelope; carries the bytes and the reason."""

    def __init__(self, reason: str, raw: bytes) -> None:
        super().__init__(reason)
        self.reason = reason
        self.raw = raw


class IllegalTransition(ReachError):
    """Raised when a stage change is not in the lifecycle table."""

    def __init__(self, current: str, target: str) -> None:
        super().__init__(f"illegal transition {current} -> {target}")
        self.current = current
        self.target = target


class UnknownMessage(ReachError):
    """Raised when no record exists for a message id."""

    def __init__(self, message_id: str) -> None:
        super().__init__(f"unknown message id {message_id!r}")
        self.message_id = message_id


class UnreadableRecord(UnknownMessage):
    """Raised where a message id's record key holds what does not read as a record (a key
    of another type, or fields that are no record): there is something, and it is not a
    message an operator can follow."""

    def __init__(self, message_id: str) -> None:
        ReachError.__init__(
            self,
            f"message id {message_id!r}: its record cannot be read (a key of another type, or"
            " fields that are no record)",
        )
        self.message_id = message_id


class RedisUnavailable(ReachError):
    """Raised when Redis cannot be reached, drops the connection, stays silent, or answers that
    it cannot serve now; ``code`` is that answer's code (``LOADING``, ``OOM``, ``READONLY``,
    …), ``None`` when Redis said nothing. Retrying later is the remedy."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class SetUpDropped(RedisUnavailable):
    """Raised where a server took the connection and dropped it during the set-up (its
    ``__cause__`` the ``OSError``): over TLS, often a server that wants a client
    certificate and says nothing but a reset."""


class RedisReplyError(ReachError):
    """Raised when Redis answers a command with an error reply. ``code`` is the reply's first
    word (``NOGROUP``, ``BUSYGROUP``, ``NOSCRIPT``, ``WRONGTYPE``, ``NOPERM``, ``ERR``, …; for
    an error met inside a script, its own: :func:`script_error_code`),
    ``message`` the whole reply, as Redis wrote it; retrying the same command will not help."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = message.split(" ", 1)[0] if code is None else code

    @property
    def permission_refused(self) -> bool:
        """Whether Redis refused a command to this user: ``NOPERM``, or, for a command a
        script runs, the ``ERR`` each version answers with instead."""
        return self.code == "NOPERM" or any(words in self.message for words in _REFUSED_IN_SCRIPT)


_WRAPPED = "ERR Error running script"  # Redis 6.2, an error a script did not catch
_WHERE_IN_SCRIPT = re.compile(r"(?:@user_script: ?\d+|=\[C\]: -1): ")


def script_error_code(message: str) -> str:
    """The code of an error reply: its first word, or for one Redis 6.2 wrapped as met
    inside a script, the code of what the script met where it has one (``OOM``,
    ``WRONGTYPE``; a Lua error has none and stays ``ERR``)."""
    own = message.split(" ", 1)[0]
    if own != "ERR" and _WHERE_IN_SCRIPT.match(message) is None:
        return own
    inner = script_error_text(message).split(" ", 1)[0]
    return inner if inner.isalpha() and inner.isupper() else own


def script_error_text(message: str) -> str:
    """An error met inside a script, as Redis 7 answers it: its own code first. Redis 6.2
    wraps one the script did not catch (``ERR Error running script (call to f_…):
    @user_script:1: @user_script: 1: -OOM …``) and prefixes one ``redis.pcall`` caught with
    where it happened (``@user_script: 12: -OOM …``; from ``pcall(redis.call, …)``:
    ``=[C]: -1: -OOM …``): read by its ``ERR`` alone, a script refused for memory, or on a
    replica, would look like a command's own error."""
    if message.startswith(_WRAPPED) and "): " in message:
        message = message.split("): ", 1)[1]
    while (where := _WHERE_IN_SCRIPT.match(message)) is not None:
        message = message[where.end() :]
    return message.removeprefix("-").strip()


# what Redis says, in an ERR, of a command it refuses to the user running a script: 6.2 and
# 7.0 ("The user executing the script can't run this command or subcommand"), 7.2 and later
# ("ACL failure in script: User ... has no permissions to run the ... command")
_REFUSED_IN_SCRIPT = ("can't run this command", "ACL failure in script")


class EmbeddedRedisError(ReachError):
    """Raised when the embedded redis-server cannot be found or started."""


class DeliveryError(ReachError):
    """Raised when an adapter cannot deliver a message; says whether a retry is safe."""

    def __init__(self, reason: str, *, retry_safe: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_safe = retry_safe


class RequestTimeout(ReachError):
    """Raised when no result reaches ``Client.request`` in time; the message may still finish,
    so it carries the id to ask ``Client.result`` later."""

    def __init__(self, message_id: str, timeout_s: float) -> None:
        super().__init__(
            f"no result for message {message_id!r} within {timeout_s:g}s "
            "(it may still finish: ask Client.result with its id)"
        )
        self.message_id = message_id
        self.timeout_s = timeout_s


class ClientNotOpen(ReachError):
    """Raised when ``Client.request`` is called outside ``async with Client(conn)`` (its reply
    stream and reader live only there), or a ``SyncClient`` is used outside ``with``."""


def raised(reply: Any) -> Any:
    """A pipelined reply, or the error reply in its place raised (pipelines return error
    replies as exceptions in place, so one bad command does not hide the others' answers)."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def errors_in_place(replies: list[Any]) -> list[Any]:
    """Pipelined replies, each an answer or the error reply Redis gave that command alone
    (:class:`RedisReplyError`, left in place); anything else among them (Redis unavailable,
    a lost connection) concerns them all, and is raised."""
    for reply in replies:
        if isinstance(reply, Exception) and not isinstance(reply, RedisReplyError):
            raise reply
    return replies


def first_leaf(error: BaseException) -> BaseException:
    """The first exception at the bottom of nested exception groups (``error`` itself when it
    is no group): what a task group's failure was, said as the callers of one call expect."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
