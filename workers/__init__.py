"""The long-running broker processes (dispatcher, and the ``agent-reach`` command line)."""

from .dispatcher import Dispatcher

__all__ = ["Dispatcher"]
