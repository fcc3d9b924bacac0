"""Who may use the console, and proof that a form came from one of its own pages.

- **Where it listens.** Loopback by default; any other address needs a token (``--token`` or
  ``AGENT_REACH_CONSOLE_TOKEN``), checked before the server starts (:func:`bind_refusal`).
- **Who is let in.** Without a token, only requests whose ``Host`` names the loopback
  address the console serves: a web page elsewhere that re-points its own name at
  127.0.0.1 (DNS rebinding) sends its own name as ``Host`` and is refused. With a token, a
  request carries it as ``Authorization: Bearer <token>`` (scrapers, scripts) or holds the
  cookie the login form sets, which is a keyed hash of the token, never the token.
- **What a form may do.** Every action is a POST carrying the page's CSRF token, a keyed hash
  of the visitor's session (so a token from one session does not serve another), and a
  request from another site (``Origin`` or ``Sec-Fetch-Site`` says so) is refused as well.

Pure: the Starlette middleware in :mod:`workers.console.app` asks these functions.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

COOKIE = "reach_console"
TOKEN_ENV = "AGENT_REACH_CONSOLE_TOKEN"
_ANONYMOUS = "loopback"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, token: str | None) -> str | None:
    """Why the console may not listen on ``host`` (``None``: it may)."""
    if is_loopback(host) or token:
        return None
    return (
        f"the console would listen on {host}, off loopback, for anyone who reaches it: "
        f"give --token (or set {TOKEN_ENV}) to require one"
    )


def token_problem(token: str) -> str | None:
    if len(token) < 16:
        return "the console token must be at least 16 characters"
    if not token.isprintable() or any(c.isspace() for c in token):
        return "the console token must be printable, without spaces"
    return None


def _host_name(host_header: str) -> str:
    """The host a ``Host`` header names; "" for one that does not parse (``[::1``): it is
    no loopback name, and never a 500."""
    try:
        return urlsplit(f"//{host_header}").hostname or ""
    except ValueError:
        return ""


@dataclass(frozen=True, slots=True)
class Guard:
    token: str | None
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def _mac(self, purpose: str, value: str) -> str:
        message = f"{purpose}\x00{value}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    @property
    def cookie_value(self) -> str:
        """What the login cookie holds: proves the token was given, without being it."""
        return self._mac("session", self.token or _ANONYMOUS)

    def host_allowed(self, host_header: str) -> bool:
        """Without a token only loopback names; with one, the token decides."""
        return bool(self.token) or is_loopback(_host_name(host_header))

    def session(self, authorization: str | None, cookie: str | None) -> str | None:
        """The session a request belongs to, or ``None`` when it is not let in."""
        if not self.token:
            return _ANONYMOUS
        if authorization and authorization.startswith("Bearer "):
            given = authorization.removeprefix("Bearer ").strip()
            if hmac.compare_digest(given.encode(), self.token.encode()):
                return self.cookie_value
        if cookie and hmac.compare_digest(cookie.encode(), self.cookie_value.encode()):
            return cookie
        return None

    def login(self, given: str) -> str | None:
        """The cookie value for a correct token, else ``None``."""
        if self.token and hmac.compare_digest(given.encode(), self.token.encode()):
            return self.cookie_value
        return None

    def csrf(self, session: str) -> str:
        return self._mac("csrf", session)

    def csrf_ok(self, session: str, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(str(given).encode(), self.csrf(session).encode())


def cross_site(origin: str | None, fetch_site: str | None, host_header: str) -> bool:
    """Whether the browser says the request comes from another site than the console's."""
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return True
    if origin is None:
        return False
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:  # an Origin that does not parse comes from no site of ours
        return True
    return origin == "null" or netloc != host_header
