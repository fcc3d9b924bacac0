"""``bench.profile.script_times``: Redis's log of calls, summed by script."""

from __future__ import annotations

from bench.profile import script_times
from broker.scripts import ScriptName, load_scripts


def entry(usec: int, *arguments: bytes) -> list[object]:
    """A ``SLOWLOG GET`` entry as Redis answers it: id, unix time, µs, arguments, client."""
    return [1, 1_700_000_000, usec, list(arguments), b"127.0.0.1:5000", b""]


def test_each_evalsha_is_summed_under_its_scripts_name() -> None:
    take = load_scripts()[ScriptName.TAKE].sha.encode()
    entries = [
        entry(500, b"EVALSHA", take, b"3", b"k"),
        entry(40, b"evalsha", take.upper(), b"1"),
        entry(7, b"HSET", b"k", b"f", b"v"),  # a command on its own, or a script's
        entry(9, b"EVALSHA", b"ab" * 20),  # a script that is not ours
        entry(3, b"EVALSHA"),  # cut short: no SHA1 to name
    ]
    assert script_times(entries) == {"take": (2, 540), "abababab": (1, 9)}


def test_no_script_call_is_no_figure() -> None:
    assert script_times([entry(2, b"GET", b"k"), entry(1, b"PING")]) == {}
