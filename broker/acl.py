"""A Redis user for each role, as ``ACL SETUSER`` lines for redis-cli (``agent-reach acl``).

Each role is granted the commands its processes run, listed one by one (never ``+@all``), on
the keys and channels of the configured prefix ``P`` only. Redis checks the commands a script
runs against its caller's rules too, so a role that calls a script is granted what it runs.

=============  ==========================================================================
role           may
=============  ==========================================================================
producer       ``XADD`` to ``P:in``; read, and on Redis 7 delete, its own reply streams
               ``P:reply:<name>-*`` (``Client`` names them after the URL's user): what
               ``agent-reach send`` and ``Client.submit`` / ``request`` need
sidecar        its agent's instance keys (``P:a:``, ``P:q:``, ``P:f:``, ``P:k:{<agent>-*}``)
               and what finishing a message takes: records, timelines, broadcast outcomes,
               reply streams, the outbox, the due index, waiting sets, dead letters, events,
               the credit and registry channels
broker         the dispatcher, reaper and notifier: every ``P:*`` key and channel, with the
               commands they run
operator-read  reads only: ``trace``, ``agents``, ``stats``, ``stuck``, ``dlq``, ``events``
operator       those, and ``replay``, ``resolve``, ``cancel``, ``drain``, ``weight``,
               ``subscribe``, ``unsubscribe``,
               ``feedback`` (a rating on ``P:fb:{<agent>}``)
=============  ==========================================================================

Redis 7 has key permissions (``%R~`` read, ``%W~`` write) and selectors (rules that hold
together: these commands on those keys). With them a producer writes the ingress stream but
cannot read or delete it, and a sidecar may ``DEL`` its own card but not the outbox. Redis
6.2 has neither: its lines carry the closest rules, and a comment says what they leave open.

:func:`acl_lines` is the whole output, a pure function of its arguments; the commands each
role runs are listed in :mod:`broker.acl_commands`.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .acl_commands import (
    BROKER_COMMANDS,
    CONNECT,
    INSTANCE_COMMANDS,
    OPERATOR_READS,
    OPERATOR_WRITES,
    PARK_COMMANDS,
    PRODUCER_REPLIES,
    PRODUCER_SUBMIT,
    RECORD_COMMANDS,
    REGISTER_COMMANDS,
    SINCE_7,
    TELL_COMMANDS,
)
from .envelope import MESSAGE_ID_PATTERN
from .keyspace import FleetKeys, Keyspace, due_sets, ingress_streams, outboxes

ROLES = ("producer", "sidecar", "broker", "operator-read", "operator")
REDIS_VERSIONS = ("6.2", "7")
PLACEHOLDER = "<password>"

# A producer's name, which names its reply streams `P:reply:<name>-*`: no `-` in it, or one
# producer's pattern would match another's streams (`a-*` matches `a-b-...`).
PRODUCER_NAME = re.compile(r"[A-Za-z0-9_.]{1,64}")
_PASSWORD = re.compile(r"[\x21-\x26\x28-\x7e]{1,256}")  # printable ASCII, no space, no '
_BARE = re.compile(r"[A-Za-z0-9_.:@+=,/-]+")  # an argument that needs no quotes


@dataclass(frozen=True, slots=True)
class Grant:
    """Commands and the keys and channels they may touch: a user's root rules, or one
    selector. A key rule is ``~pattern`` (read and write), ``%R~pattern`` or ``%W~pattern``."""

    commands: tuple[str, ...]
    keys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()

    def rules(self) -> list[str]:
        commands = [f"+{c}" for c in dict.fromkeys(self.commands)]
        return [*commands, *self.keys, *(f"&{c}" for c in self.channels)]


@dataclass(frozen=True, slots=True)
class User:
    """One role's Redis user: its root rules, its selectors (Redis 7), what it may do, and
    what the server version cannot restrict."""

    role: str
    name: str
    says: str
    root: Grant
    selectors: tuple[Grant, ...] = ()
    caveats: tuple[str, ...] = ()


# -- checks ----------------------------------------------------------------------------------


def producer_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a producer (its user and its reply streams), or ``None``.
    A ``-`` would let one producer's pattern (``P:reply:a-*``) match another's (``a-b``)."""
    if not PRODUCER_NAME.fullmatch(name):
        return f"{name!r}: use 1-64 letters, digits, _ and . (no -: it ends the stream's owner)"
    if name == "default":
        return "'default' is Redis' own user: give the producer a name of its own"
    return None


def agent_problem(agent: str) -> str | None:
    if not re.match(MESSAGE_ID_PATTERN, agent):
        return f"{agent!r}: use 1-128 of letters, digits and _ . : - (as agent-reach sidecar)"
    return None


def password_problem(password: str) -> str | None:
    if not _PASSWORD.fullmatch(password):
        return "use 1-256 printable ASCII characters, without spaces or single quotes"
    return None


def arguments_problem(
    roles: Sequence[str], *, name: str, agent: str | None, password: str | None
) -> str | None:
    """What is wrong with the arguments of :func:`acl_lines`, or ``None``."""
    unknown = [role for role in roles if role not in ROLES]
    if unknown:
        return f"unknown role {unknown[0]!r}; roles: {', '.join(ROLES)}"
    if "producer" in roles and (problem := producer_name_problem(name)):
        return f"--name {problem}"
    if agent is not None and (problem := agent_problem(agent)):
        return f"--agent {problem}"
    if password is not None and (problem := password_problem(password)):
        return f"--password: {problem}"
    return None


def rules_version(version: Sequence[int]) -> str:
    """The rule set (``"7"`` or ``"6.2"``) for a server of ``version``; older servers have
    no channel rules, which every role needs: :class:`ValueError`."""
    if tuple(version[:1]) >= (7,):
        return "7"
    if tuple(version[:2]) >= (6, 2):
        return "6.2"
    raise ValueError(
        f"redis {'.'.join(map(str, version))} has no ACL rules for pub/sub channels; "
        "6.2 or later is needed"
    )


# -- the roles -------------------------------------------------------------------------------


def _rw(patterns: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"~{p}" for p in patterns)


def _w(patterns: Iterable[str], version: str) -> tuple[str, ...]:
    """Write-only key rules on Redis 7; read and write on 6.2 (all it has)."""
    return tuple(f"%W~{p}" if version == "7" else f"~{p}" for p in patterns)


def _flat(root: Grant, selectors: Sequence[Grant]) -> Grant:
    """Root and selectors merged into one set of rules: what Redis 6.2 can express."""
    grants = [root, *selectors]
    return Grant(
        commands=tuple(c for g in grants for c in g.commands),
        keys=tuple(dict.fromkeys(k for g in grants for k in g.keys)),
        channels=tuple(dict.fromkeys(c for g in grants for c in g.channels)),
    )


def _trim_caveat(stream: str) -> str:
    return (
        f"XADD accepts MAXLEN and MINID, which trim the stream written to, and an explicit "
        f"entry id: no ACL rule refuses an option or an id, so this user can trim {stream}, "
        f"or add the last possible id there, after which Redis refuses every XADD * to it "
        f"until the stream is made again."
    )


def producer(keys: Keyspace, version: str, name: str) -> User:
    replies = keys.reply(f"{name}-*")
    says = f"producer {name!r}: XADD to {keys.ingress}; reads its own reply streams {replies}"
    if version == "7":
        # the partitions that are read, by name: an entry written elsewhere would never be
        ingress = tuple(f"%W~{stream}" for stream in ingress_streams(keys, keys.partitions))
        root = Grant((*CONNECT, *PRODUCER_SUBMIT), ingress)
        own = Grant(PRODUCER_REPLIES, (f"~{replies}",))
        says += " and deletes their entries"
        return User("producer", name, says, root, (own,), (_trim_caveat(keys.ingress),))
    ingress_keys = ingress_streams(keys, keys.partitions)
    root = Grant((*CONNECT, *PRODUCER_SUBMIT, "xread"), _rw([*ingress_keys, replies]))
    caveat = (
        f"Redis 6.2 cannot tell reading a key from writing it, nor grant a command on some "
        f"keys only: this user can also read {keys.ingress} (every producer's envelopes) "
        f"and add entries to its own reply streams. XDEL and DEL are left out so that it "
        f"cannot delete from {keys.ingress}: the client leaves its reply streams whole, to "
        f"expire reply_ttl_s after their last answer."
    )
    return User("producer", name, says, root, (), (caveat, _trim_caveat(keys.ingress)))


def sidecar(keys: Keyspace, version: str, agent: str) -> User:
    instances = f"{agent}-*"
    own = [keys.card(instances), keys.queue(instances), keys.inflight(instances)]
    own.append(keys.callback_key(instances))
    # its instances' sharded credit channels P:credit:{<agent>-*} (a Redis 7 cluster)
    channels = (
        keys.credit_channel,
        f"{keys.credit_channel}:{{{instances}}}",
        keys.registry_channel,
    )
    records = [keys.record("*"), keys.timeline("*"), keys.outcomes("*"), f"{keys.counters}*"]
    records.append(FleetKeys(keys.prefix).usage("*"))  # charged with an attempt's outcome
    root = Grant((*CONNECT, "script|load", *RECORD_COMMANDS), _rw(records))
    events = FleetKeys(keys.prefix).events  # what it registers, beats, parks, dead-letters
    selectors = (
        Grant(INSTANCE_COMMANDS, _rw(own), channels),
        Grant(TELL_COMMANDS, _w([keys.reply("*"), *outboxes(keys), keys.dlq, events], version)),
        Grant(
            PARK_COMMANDS,
            _w([*due_sets(keys), keys.waiting("*"), keys.waiting_index], version),
        ),
        Grant(REGISTER_COMMANDS, _w([keys.agents], version)),
    )
    says = (
        f"sidecar of agent {agent!r}: the keys of its instances {agent}-* (card, work "
        f"stream, credits, callback key), and what finishing a message takes"
    )
    caveats = [
        f"An instance id must start with '{agent}-' (agent-reach sidecar's default does); "
        f"instances of an agent whose id starts with '{agent}-' match too.",
        _trim_caveat(f"{keys.outbox}, {keys.dlq} and reply streams"),
    ]
    if version == "7":
        return User("sidecar", f"{keys.prefix}-sidecar-{agent}", says, root, selectors, (*caveats,))
    caveats.insert(
        1,
        "Redis 6.2 cannot make keys write-only nor grant a command on some keys only: this "
        "user can also read reply streams, the outbox, dead letters and the due index, and "
        "run DEL, XTRIM, ZREM and EXPIRE on any key it has (the outbox and the due index "
        "too).",
    )
    flat = _flat(root, selectors)
    return User("sidecar", f"{keys.prefix}-sidecar-{agent}", says, flat, (), (*caveats,))


def broker(keys: Keyspace, version: str) -> User:
    says = "broker: the dispatcher, reaper and notifier, on every key and channel of the prefix"
    everything = f"{keys.prefix}:*"
    root = Grant(BROKER_COMMANDS, (f"~{everything}",), (everything,))
    return User("broker", f"{keys.prefix}-broker", says, root)


def operator_read(keys: Keyspace, version: str) -> User:
    says = "operator-read: reads only (trace, agents, stats, stuck, dlq)"
    everything = f"{keys.prefix}:*"
    name = f"{keys.prefix}-operator-read"
    # no SCRIPT LOAD: a reader runs only the scripts the broker loaded (stats' backlog.lua),
    # never one of its own (an endless loop in Lua would stop Redis for everyone)
    reads = (*CONNECT, *OPERATOR_READS)
    if version == "7":
        root = Grant(reads, (f"%R~{everything}",))
        # EVALSHA asks read and write access to the keys it is given (Redis cannot tell
        # what a script does): backlog.lua's are work streams; inside, only reads are granted
        backlog = Grant(("evalsha",), (f"~{keys.queue('*')}",))
        return User("operator-read", name, says, root, (backlog,))
    return User("operator-read", name, says, Grant((*reads, "evalsha"), (f"~{everything}",)))


def operator(keys: Keyspace, version: str) -> User:
    says = "operator: reads, and replay, resolve, cancel, drain, weight, feedback"
    everything = f"{keys.prefix}:*"
    name = f"{keys.prefix}-operator"
    commands = (*CONNECT, "script|load", *OPERATOR_READS, *OPERATOR_WRITES)
    channels = (keys.registry_channel,)
    if version == "7":
        moved = [keys.record("*"), keys.timeline("*"), keys.outcomes("*"), keys.card("*")]
        moved.append(f"{keys.counters}*")  # and, on a cluster, every slot's
        told = [keys.reply("*"), *outboxes(keys), keys.dlq, FleetKeys(keys.prefix).events]
        moved.append(FleetKeys(keys.prefix).subscriptions)  # subscribe, unsubscribe
        told.append(FleetKeys(keys.prefix).feedback("*"))  # agent-reach feedback
        indexed = [*due_sets(keys), keys.waiting("*"), keys.unmatched("*")]
        indexed.append(keys.waiting_index)
        root = Grant(
            commands,
            (f"%R~{everything}", *_rw(moved), *_w([*indexed, *told], version)),
            channels,
        )
        backlog = Grant(("evalsha",), (f"~{keys.queue('*')}",))
        return User("operator", name, says, root, (backlog,))
    caveat = (
        f"Redis 6.2 cannot make keys read-only: this user's write commands reach every key "
        f"under {keys.prefix}: (the ingress and instance streams too)."
    )
    return User(
        "operator", name, says, Grant(commands, (f"~{everything}",), channels), (), (caveat,)
    )


# -- rendering -------------------------------------------------------------------------------


def quote(argument: str) -> str:
    """``argument`` as redis-cli (and a POSIX shell) reads it back as one argument."""
    return argument if _BARE.fullmatch(argument) else f"'{argument}'"


def setuser_line(user: User, password: str) -> str:
    """The ``ACL SETUSER`` line that makes ``user`` anew (``reset`` first: running it again
    replaces the rules instead of adding to them)."""
    words = ["ACL", "SETUSER", user.name, "reset", "on", f">{password}", "resetchannels", "-@all"]
    words += user.root.rules()
    words += [f"({' '.join(grant.rules())})" for grant in user.selectors]
    return " ".join(quote(w) for w in words)


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, width=98, initial_indent="# ", subsequent_indent="#   ")


def role_user(role: str, keys: Keyspace, version: str, *, name: str, agent: str | None) -> User:
    user = _role_user(role, keys, version, name=name, agent=agent)
    if version == "7":
        return user
    # Redis 6.2 refuses a rule naming a command it does not have
    # (the 6.2 rules have no selectors: everything is in the root)
    commands = tuple(c for c in user.root.commands if c not in SINCE_7)
    return replace(user, root=replace(user.root, commands=commands))


def _role_user(role: str, keys: Keyspace, version: str, *, name: str, agent: str | None) -> User:
    if role == "producer":
        return producer(keys, version, name)
    if role == "sidecar":
        if agent is None:
            raise ValueError("the sidecar role needs its agent's id (--agent)")
        return sidecar(keys, version, agent)
    makers = {"broker": broker, "operator-read": operator_read, "operator": operator}
    return makers[role](keys, version)


def acl_lines(
    roles: Sequence[str],
    *,
    prefix: str,
    version: str,
    name: str = "producer",
    agent: str | None = None,
    password: str | None = None,
    partitions: int = 1,
) -> list[str]:
    """Comment lines and one ``ACL SETUSER`` line per role, for ``prefix`` on a Redis of
    rule set ``version`` (``"6.2"`` or ``"7"``). Without ``password`` every user gets the
    placeholder ``<password>``, which the output says to replace. The sidecar role is left
    out, with a comment, when every role is asked for and no ``agent`` is given; a bad
    name, agent or password is a :class:`ValueError`."""
    problem = arguments_problem(roles, name=name, agent=agent, password=password)
    if problem is not None:
        raise ValueError(problem)
    keys = Keyspace(prefix, partitions)  # ingress_partitions: the streams and sets granted
    lines = _header(prefix, version, password)
    for role in roles:
        if role == "sidecar" and agent is None and len(roles) > 1:
            lines += ["", *_comment("sidecar: left out; give --agent AGENT_ID for its user.")]
            continue
        user = role_user(role, keys, version, name=name, agent=agent)
        lines += ["", *_comment(user.says)]
        lines += [line for caveat in user.caveats for line in _comment(caveat)]
        lines.append(setuser_line(user, password or PLACEHOLDER))
    return [*lines, "", *_footer()]


def _header(prefix: str, version: str, password: str | None) -> list[str]:
    text = f"Agent-Reach users for key prefix {prefix!r}, with Redis {version} rules."
    if password is None:
        text += f" Replace every {PLACEHOLDER} with the user's own password first."
    else:
        text += " Every user below has the password given."
    text += (
        " Lines starting with # are comments, not commands: grep -v '^#' FILE | redis-cli."
        " Commands a script runs are checked against its caller's rules too."
    )
    return _comment(text)


def _footer() -> list[str]:
    return _comment(
        "Connect each process as its user: redis://USER:PASSWORD@HOST:PORT/DB (or rediss://)."
        " Keep the users with ACL SAVE (an aclfile) or CONFIG REWRITE, and once every process"
        " has its own, turn the default user off: ACL SETUSER default off."
    )
