"""Redis's time inside each script, from a replay of a real burst: what each stage's script
costs, and what each part of a script costs.

Capture: one fresh redis-server, ``agent-reach up`` and one sidecar (as ``bench.cpu_cost
--burst --inflight 100`` runs them), and a ``MONITOR`` connection that records every command
from before the processes start; ``--messages`` envelopes in a burst. Replay: the captured
top-level commands (not those the scripts ran), in their order, on another fresh
redis-server, pipelined, blocking reads made non-blocking, with ``SLOWLOG`` logging every
command; each script's server time summed over its calls. A replay has the live run's data
and order and none of its processes: nothing else wants the cores, so a script's time is
its own, where the live run's ``SLOWLOG`` also counts the time Redis waited for a core.

``--swap NAME=FILE`` replays with a script's source replaced by FILE (the whole text Redis
runs, preludes included: ``--dump NAME`` prints it, to edit): per repetition one replay of
the captured sources and one with the swap. Each script's time is read as a ratio to the
time of the most called script not swapped, in the same replay, so the machine's speed
cancels out; a part of a script costs what a source without it saves.

Limits: the entries a replay adds with ``*`` get new ids, so commands that name the live
run's ids (acknowledgements) find nothing. A read that blocked shows where it was sent,
before the entries that woke it: replayed there, it finds none, and the next read takes
them. In a burst every script still takes its usual path (the answers are printed: a
script's first answer element, counted); at a light load the direct lane's check of the
ingress group does not, so capture a burst. All the connections' commands go down one in
the replay: a burst has no ``MULTI``, whose overlap that would change.

Usage: ``python -m bench.script_replay [--messages 3000] [--reps 3] [--swap NAME=FILE]``, or
``python -m bench.script_replay --dump transition > transition.lua``. Figures only; CI never
runs it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import re
import statistics
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import anyio

from broker.client import Client
from broker.config import build_settings
from broker.connection import open_connection
from broker.embedded import RedisServer
from broker.errors import RedisReplyError
from broker.resp import RespConnection
from broker.scripts import ScriptName, load_scripts, script_source

from .cpu_cost import all_succeeded, burst, finished, paced, spawn_both, stop, succeeded
from .latency_path import monitor
from .servers import discard, throwaway_server

# commands of the live run's connections that a replay does not send again
NOT_REPLAYED = {
    b"MONITOR",
    b"CLIENT",
    b"HELLO",
    b"AUTH",
    b"SELECT",
    b"CLUSTER",
    b"INFO",
    b"CONFIG",
    b"SUBSCRIBE",
    b"PSUBSCRIBE",
    b"SSUBSCRIBE",
    b"UNSUBSCRIBE",
}
ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", '"': b'"', "\\": b"\\"}
# "<time> [<db> <client>] <args>": the client "lua" for a script's command, an address
# otherwise (an IPv6 one in brackets: "[::1]:6379"); each argument is quoted
_LINE = re.compile(r'^\d+\.\d+ \[\d+ (\S+)\] (".*)$', re.S)
CHUNK = 500  # commands a pipeline of the replay
END = "script_replay: the capture ends here"
Command = tuple[bytes, ...]


def parse_line(line: str) -> Command | None:
    """The command a ``MONITOR`` line shows (its quoted arguments, unescaped), or None for a
    line that is not one, or one a script ran (its source says ``lua``)."""
    match = _LINE.match(line)
    if match is None or match.group(1) == "lua":
        return None
    text, args, i = match.group(2), list[bytes](), 0
    while i < len(text):
        if text[i] != '"':
            return None
        i += 1
        arg = bytearray()
        while text[i] != '"':
            if text[i] != "\\":
                arg += text[i].encode("utf-8", "surrogateescape")
                i += 1
            elif text[i + 1] == "x":
                arg.append(int(text[i + 2 : i + 4], 16))
                i += 4
            else:
                arg += ESCAPES[text[i + 1]]
                i += 2
        args.append(bytes(arg))
        i += 2  # the closing quote and the space after it
    return tuple(args)


def replayable(lines: list[str]) -> list[Command]:
    """The captured commands a replay sends, blocking reads made non-blocking."""
    commands = []
    for line in lines:
        command = parse_line(line)
        if not command or command[0].upper() in NOT_REPLAYED:
            continue
        if command[0].upper() in (b"XREAD", b"XREADGROUP"):
            upper = [a.upper() for a in command]
            if b"BLOCK" in upper:
                at = upper.index(b"BLOCK")
                command = (*command[:at], *command[at + 2 :])
        commands.append(command)
    return commands


@contextlib.contextmanager
def fresh_server() -> Iterator[RedisServer]:
    """A redis-server of its own, its data directory removed after it stops."""
    server = throwaway_server("reach-replay-")
    try:
        yield server
    finally:
        discard(server)


async def read_past(lines: list[str], marker: Awaitable[object]) -> None:
    """Until the monitor has read the line of ``marker`` (an ``ECHO`` of :data:`END`), and
    so every line before it."""
    seen = len(lines)
    await marker
    with anyio.fail_after(30):
        while not any(END in line for line in lines[seen:]):
            seen = len(lines)  # no await since the look: nothing came in between
            await anyio.sleep(0.01)


async def capture(messages: int) -> list[str]:
    """Every command a burst of ``messages`` through ``up`` and one sidecar ran."""
    lines: list[str] = []
    with fresh_server() as server:
        async with anyio.create_task_group() as tg:
            started = anyio.Event()
            tg.start_soon(monitor, server.url, lines, started)
            await started.wait()
            up, sidecar = spawn_both(server.url, 100)
            try:
                settings = build_settings([{"redis_url": server.url}])
                async with open_connection(settings, server.url) as conn:
                    client = Client(conn)
                    await succeeded(conn, await paced(client, 20, 200))
                    done = await finished(conn)
                    await burst(client, messages)
                    await all_succeeded(conn, done + messages)
                    await read_past(lines, conn.call("ECHO", END))
            finally:
                stop(sidecar)
                stop(up)
            tg.cancel_scope.cancel()
    return lines


class Replay:
    """One replay's figures: by script, its calls, server µs, and first answer elements."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.usec: collections.Counter[str] = collections.Counter()
        self.answers: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def per_call(self, script: str) -> float:
        return self.usec[script] / self.calls[script] if self.calls[script] else 0.0


async def replay(commands: list[Command], swaps: dict[bytes, tuple[bytes, str]]) -> Replay:
    """``commands`` on a fresh server; ``swaps``: captured sha -> (new sha, new source)."""
    names = {s.sha.encode(): s.name.value for s in load_scripts().values()}
    names.update({new: f"{names[old]} (swapped)" for old, (new, _) in swaps.items()})
    figures = Replay()
    with fresh_server() as server:
        conn = await RespConnection.open(server.url)
        setup: list[tuple[str, ...]] = [("SCRIPT", "LOAD", src) for _, src in swaps.values()]
        setup += [("CONFIG", "SET", "slowlog-max-len", "10000000")]
        await conn.execute([*setup, ("CONFIG", "SET", "slowlog-log-slower-than", "0")])
        for start in range(0, len(commands), CHUNK):
            chunk = [_swapped(c, swaps) for c in commands[start : start + CHUNK]]
            for command, reply in zip(chunk, await conn.execute(chunk), strict=True):
                if command[0].upper() == b"EVALSHA":
                    figures.answers[names.get(command[1], "?")][_answer(reply)] += 1
        await conn.execute([("CONFIG", "SET", "slowlog-log-slower-than", "-1")])
        (log,) = await conn.execute([("SLOWLOG", "GET", "-1")])
        for entry in log:
            args = entry[3]
            if args and args[0].upper() == b"EVALSHA":
                name = names.get(args[1], "?")
                figures.calls[name] += 1
                figures.usec[name] += entry[2]
        await conn.close()
    return figures


def _swapped(command: Command, swaps: dict[bytes, tuple[bytes, str]]) -> Command:
    if command[0].upper() == b"EVALSHA" and command[1] in swaps:
        return (command[0], swaps[command[1]][0], *command[2:])
    return command


def _answer(reply: Any) -> str:
    if isinstance(reply, RedisReplyError):
        return f"error {str(reply)[:40]}"
    if isinstance(reply, list) and reply:
        return repr(reply[0])
    return type(reply).__name__


def load_swaps(specs: list[str]) -> dict[bytes, tuple[bytes, str]]:
    scripts = load_scripts()
    swaps = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        source = Path(path).read_text()
        new = hashlib.sha1(source.encode()).hexdigest().encode()  # Redis names a script so
        swaps[scripts[ScriptName(name)].sha.encode()] = (new, source)
    return swaps


def report(runs: list[tuple[Replay, Replay | None]], swapped: list[str], messages: int) -> None:
    """Per script: calls a message, µs a call, its ratio to the control's (medians); then
    each swapped script's ratio as captured and swapped."""
    first = runs[0][0]
    control = next(n for n, _ in first.calls.most_common() if n not in swapped)
    scale = statistics.median(r.per_call(control) for r, _ in runs)
    print(f"script time in the replay; ratios to {control}'s µs a call in the same replay")
    for name, calls in first.calls.most_common():
        per_call = statistics.median(r.per_call(name) for r, _ in runs)
        ratio = statistics.median(r.per_call(name) / r.per_call(control) for r, _ in runs)
        answers = ", ".join(f"{a} x{n}" for a, n in first.answers[name].most_common(3))
        print(
            f"  {name:16} {calls / messages:6.3f} calls/msg {per_call:7.1f} µs/call "
            f"{per_call * calls / messages:6.1f} µs/msg  ratio {ratio:5.2f}  answers {answers}"
        )
    for name in swapped:
        before = statistics.median(r.per_call(name) / r.per_call(control) for r, _ in runs)
        each = [s.per_call(f"{name} (swapped)") / s.per_call(control) for _, s in runs if s]
        after = statistics.median(each)
        print(
            f"  {name} swapped: ratio {before:.3f} -> {after:.3f} "
            f"({' '.join(f'{x:.2f}' for x in each)}), {(before - after) * scale:+.1f} µs a call"
        )


async def main_async(args: argparse.Namespace) -> None:
    lines = await capture(args.messages)
    commands = replayable(lines)
    swaps = load_swaps(args.swap)
    scripted = sum(c[0].upper() == b"EVALSHA" for c in commands)
    print(f"captured {len(commands)} commands, {scripted} script calls, {args.messages} messages")
    runs: list[tuple[Replay, Replay | None]] = []
    for _ in range(args.reps):  # interleaved: as captured, then swapped
        as_captured = await replay(commands, {})
        runs.append((as_captured, await replay(commands, swaps) if swaps else None))
    report(runs, [spec.partition("=")[0] for spec in args.swap], args.messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--swap", action="append", default=[], metavar="NAME=FILE")
    parser.add_argument("--dump", metavar="NAME", help="print a script's whole source")
    args = parser.parse_args()
    if args.dump:
        print(script_source(ScriptName(args.dump)), end="")
        return
    anyio.run(main_async, args)


if __name__ == "__main__":
    main()
