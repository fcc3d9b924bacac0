"""The long-running broker processes (dispatcher, and the ``agent-reach`` command line).

``Dispatcher`` is imported when first asked for: every ``agent-reach`` command starts by
importing this package, and most of them never run a dispatcher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

__all__ = ["Dispatcher"]


def __getattr__(name: str) -> Any:
    if name == "Dispatcher":
        from .dispatcher import Dispatcher

        return Dispatcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
