"""The sidecar runtime and the transports it reaches agents through."""

from .http import HttpTransport
from .outcome import Ambiguous, Failed, NotReached, Outcome, Succeeded
from .python import Agent
from .sidecar import Sidecar
from .transport import Transport

__all__ = [
    "Agent",
    "Ambiguous",
    "Failed",
    "HttpTransport",
    "NotReached",
    "Outcome",
    "Sidecar",
    "Succeeded",
    "Transport",
]
