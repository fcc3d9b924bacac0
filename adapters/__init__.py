"""The sidecar runtime and the transports it reaches agents through.

Each name is imported from its module when first asked for: a process that needs one module
of this package (the notifier needs :mod:`adapters.http`'s client, say) does not import the
sidecar, the A2A and MCP transports and the callback server with it (about 60 ms)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .http import HttpAsyncTransport, HttpTransport
    from .outcome import Accepted, Ambiguous, Failed, NotReached, Outcome, Succeeded
    from .python import Agent
    from .sidecar import Sidecar
    from .transport import Transport

# each name given here, and the module of this package that defines it
_MODULE_OF = {
    "Accepted": "outcome",
    "Agent": "python",
    "Ambiguous": "outcome",
    "Failed": "outcome",
    "HttpAsyncTransport": "http",
    "HttpTransport": "http",
    "NotReached": "outcome",
    "Outcome": "outcome",
    "Sidecar": "sidecar",
    "Succeeded": "outcome",
    "Transport": "transport",
}

__all__ = [
    "Accepted",
    "Agent",
    "Ambiguous",
    "Failed",
    "HttpAsyncTransport",
    "HttpTransport",
    "NotReached",
    "Outcome",
    "Sidecar",
    "Succeeded",
    "Transport",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
