"""What may travel in the HTTP headers an agent receives. Pure.

A producer's ``headers``, ``traceparent`` and ``idempotency_key`` reach the agent as HTTP
header fields, so they are held to what HTTP can carry — checked at acceptance, where a bad
one is REJECTED naming the field, never later in a sidecar, where it would fail every retry:

- a field name is an RFC 9110 token (§5.1), a value visible ASCII, space or tab (§5.5): no CR,
  LF or NUL that could split a request, no non-ASCII that a client cannot encode;
- a producer may not set hop-by-hop or framing fields (``Host``, ``Content-Length``,
  ``Transfer-Encoding``, ``Connection``, ... — RFC 9110 §7.6.1, RFC 9112 §6), the
  ``Content-Type`` of our JSON body, ``traceparent`` (it has its own envelope field), nor
  anything in the ``X-Reach-*`` namespace, which is ours: our own fields are set last and
  appear once (:func:`agent_headers`);
- ``traceparent`` is a W3C Trace Context header (§3.2); ``idempotency_key`` bounded
  printable ASCII.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_HEADERS = 64
MAX_NAME_CHARS = 128
MAX_VALUE_CHARS = 4096
MAX_IDEMPOTENCY_KEY_CHARS = 256
MAX_TRACESTATE_CHARS = 512

REACH_PREFIX = "x-reach-"
# Lower-case names a producer may not set: hop-by-hop, framing, and fields we own.
RESERVED = frozenset(
    {
        "connection",
        "content-encoding",
        "content-length",
        "content-type",
        "expect",
        "host",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "traceparent",
        "transfer-encoding",
        "upgrade",
    }
)

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_VALUE = re.compile(r"[\t\x20-\x7e]*\Z")
_PRINTABLE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?\Z")
# version 00 exactly; a later version may append fields after a dash (W3C Trace Context §3.2)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z")


def is_reserved(name: str) -> bool:
    """Whether ``name`` is one a producer may not set (any case)."""
    lowered = name.lower()
    return lowered in RESERVED or lowered.startswith(REACH_PREFIX)


def header_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` may not be forwarded to an agent, or ``None``."""
    if len(name) > MAX_NAME_CHARS or not _TOKEN.match(name):
        return f"header name {name[:MAX_NAME_CHARS]!r} is not an HTTP token (RFC 9110 §5.1)"
    if is_reserved(name):
        why = (
            "X-Reach-* headers are set by the broker"
            if name.lower().startswith(REACH_PREFIX)
            else "a hop-by-hop, framing or broker-owned header"
        )
        return f"header {name!r} may not be set by a producer ({why})"
    if len(value) > MAX_VALUE_CHARS:
        return f"header {name!r} value is over {MAX_VALUE_CHARS} characters"
    if not _VALUE.match(value):
        return (
            f"header {name!r} value holds a control character (CR, LF, NUL, ...) or non-ASCII "
            "text: only visible ASCII, space and tab travel in an HTTP header"
        )
    return None


def headers_problem(headers: Mapping[str, str]) -> str | None:
    """Why a producer's ``headers`` may not be forwarded, or ``None``."""
    if len(headers) > MAX_HEADERS:
        return f"headers: {len(headers)} given, at most {MAX_HEADERS}"
    seen: set[str] = set()
    for name, value in headers.items():
        if problem := header_problem(name, value):
            return f"headers: {problem}"
        if name.lower() in seen:
            return f"headers: {name!r} is given twice (header names are case-insensitive)"
        seen.add(name.lower())
    return None


def traceparent_problem(value: str) -> str | None:
    """Why ``value`` is not a W3C ``traceparent``, or ``None``."""
    match = _TRACEPARENT.match(value)
    if match is None:
        return (
            f"traceparent {value[:80]!r} is not W3C Trace Context "
            "(version-traceid-parentid-flags, lower-case hex: 00-<32>-<16>-<2>)"
        )
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return f"traceparent {value[:80]!r}: version {version} is not valid in this form"
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return f"traceparent {value[:80]!r}: an all-zero trace id or parent id is invalid"
    if rest is not None and not _VALUE.match(rest):
        return f"traceparent {value[:80]!r} holds characters an HTTP header cannot carry"
    return None


def tracestate_problem(value: str) -> str | None:
    """Why ``value`` is not a ``tracestate`` we pass on (W3C Trace Context §3.3: at most 512
    characters in practice, visible ASCII and spaces), or ``None``."""
    if len(value) > MAX_TRACESTATE_CHARS or not _VALUE.match(value) or "\t" in value:
        return f"tracestate must be at most {MAX_TRACESTATE_CHARS} characters of printable ASCII"
    return None


def idempotency_key_problem(value: str) -> str | None:
    """Why ``value`` is not a usable idempotency key, or ``None``."""
    if len(value) > MAX_IDEMPOTENCY_KEY_CHARS or not _PRINTABLE.match(value):
        return (
            f"idempotency_key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII "
            "characters, without leading or trailing spaces"
        )
    return None


def agent_headers(producer: Mapping[str, str], ours: Mapping[str, str]) -> dict[str, str]:
    """The header fields an agent gets: the producer's, less any a producer may not set
    (accepted envelopes have none; this is the second line), then ours — last, once each."""
    headers = {name: value for name, value in producer.items() if not is_reserved(name)}
    headers.update(ours)
    return headers
