"""The sidecar runtime and the transports it reaches agents through."""

from .http import HttpAsyncTransport, HttpTransport
from .outcome import Accepted, Ambiguous, Failed, NotReached, Outcome, Succeeded
from .python import Agent
from .sidecar import Sidecar
from .transport import Transport

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
