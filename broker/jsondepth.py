"""How deeply a JSON text nests arrays and objects, measured before anything decodes it;
and what is wrong with a JSON text that does not decode, in words that name the fault.

A JSON decoder walks nested values by recursion: msgspec raises ``RecursionError`` on a
thousand nested brackets, and a 1 MB body holds half a million. So text from outside (an
agent's callback, ``resolve --succeeded``, ``send --payload``) is measured first and refused
past :data:`MAX_JSON_DEPTH` with a reason, rather than crashing the decoder.

The measure needs no recursion and no Python loop over characters: strings are cut out
(their brackets are text), every byte but a bracket is deleted, openers become +1 and
closers -1, and the depth is the highest running sum — every step a C-speed pass over the
bytes, tens of milliseconds for the worst 1 MB. The text need not be valid JSON: an opener
never closed counts (the decoder recurses into it before it finds the text broken), an
unterminated string runs to the end (as the decoder reads it), and the decoder judges
validity afterwards.
"""

from __future__ import annotations

import re
from itertools import accumulate

import msgspec

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects accepted from outside: ``[]`` is 1 deep,
``{"a": [1]}`` 2. Real results nest a handful of levels; 64 leaves room for any of them."""

# A JSON string, escapes included, or an unterminated one up to the end: every quote it
# meets outside a string starts a match that succeeds, so the scan never backtracks over
# the text (a million stray quotes would otherwise cost a quadratic search).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
# Openers to 0x01 (+1 as a signed byte), closers to 0xff (-1).
_SIGNED = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def json_depth(text: bytes | str) -> int:
    """The nesting depth of ``text``: the most arrays and objects open at any point (0 for
    a scalar)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    steps = _STRING.sub(b"", data).translate(_SIGNED, _NOT_BRACKETS)
    return max(accumulate(memoryview(steps).cast("b"), initial=0))


def depth_problem(text: bytes | str, *, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``text`` nests too deeply to be decoded, or ``None`` when it does not."""
    depth = json_depth(text)
    if depth > limit:
        return f"JSON nested {depth} levels deep; at most {limit} levels of arrays and objects"
    return None


def json_problem(text: bytes | str) -> str | None:
    """Why ``text`` is not JSON the broker keeps (too deep, or not JSON), or ``None``."""
    too_deep = depth_problem(text)
    if too_deep is not None:  # before decoding: the decoder recurses
        return too_deep
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return f"not JSON: {decode_error_text(exc, text)}"
    return None


# A high surrogate escape (\ud800-\udbff) not followed by another \u
# escape, after an even number of backslashes (an odd one is a literal backslash's escape).
_LONE_HIGH_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u)")


def decode_error_text(exc: msgspec.DecodeError, text: bytes | str) -> str:
    """What msgspec's ``exc`` says of ``text``, in words that name the fault: msgspec reports
    a lone high surrogate escape (``"\\ud800"``, which no UTF-8 text can hold) as "Input data
    was truncated", and a producer would look for a cut-off body."""
    said = str(exc)
    if not said.startswith("Input data was truncated"):
        return said
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    lone = _LONE_HIGH_SURROGATE.search(data)
    if lone is None:
        return said
    escape = lone.group(1).decode("ascii")
    return (
        f"JSON is malformed: a lone UTF-16 surrogate {escape} at byte {lone.start(1)}"
        " (a high surrogate needs a low one, \\udc00-\\udfff, right after it)"
    )
