"""Which capabilities a dispatcher knows may have work waiting: what a credit release drains.

At a light load most releases free a credit nothing waits for, and reading the waiting sets
for each cost a round trip and a turn of the dispatcher's loop per message. So a release
drains only the capabilities (or their aliases) this dispatcher parked work for, found in
the waiting index at a sweep or a registry change, or heard of: every park by any process
tells the dispatchers (:func:`broker.waiting_sets.park_commands`). A drain that finds a set
empty forgets it — unless work was heard of since the drain's read began, counted per
capability, so a park that lands between the read and the forgetting is never lost. On a
cluster parks carry no hint (:func:`broker.waiting_sets.parks_hint`) and a release drains
all its instance's capabilities. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class MayWait:
    def __init__(self, *, drains_all: bool, resolve: Callable[[str], str]) -> None:
        """``resolve``: an alias to the capability it names (the routing policy's)."""
        self.drains_all = drains_all
        self._resolve = resolve
        # what may have work waiting, by the capability it resolves to: a release looks up
        # only its instance's names, however many capabilities have work waiting
        self._by_name: dict[str, set[str]] = {}
        self._heard: dict[str, int] = {}  # per capability, how often work was heard of

    def heard(self, capabilities: Iterable[str] | None = None) -> dict[str, int]:
        """How often work was heard of, per capability (all, or ``capabilities``): to give
        back to :meth:`found_empty` or :meth:`forget` after a look at the sets."""
        if capabilities is None:
            return dict(self._heard)
        return {c: self._heard.get(c, 0) for c in capabilities}

    def add(self, capabilities: Iterable[str]) -> None:
        """Work was parked for these: a release drains them until a drain finds nothing."""
        for capability in capabilities:
            self._by_name.setdefault(self._resolve(capability), set()).add(capability)
            self._heard[capability] = self._heard.get(capability, 0) + 1

    def found_empty(self, capability: str, heard: dict[str, int]) -> None:
        """A drain found the set empty; ``heard``: :meth:`heard` from before its read."""
        if self._heard.get(capability, 0) == heard.get(capability, 0):
            self._discard(capability)

    def forget(self, capabilities: Iterable[str], heard: dict[str, int] | None = None) -> list[str]:
        """Forget what nothing waits for any more — unless work was heard of since ``heard``.
        Returns those forgotten."""
        gone = [
            c for c in capabilities if heard is None or self._heard.get(c, 0) == heard.get(c, 0)
        ]
        for capability in gone:
            self._discard(capability)
            self._heard.pop(capability, None)
        return gone

    def worth_draining(self, freed: Iterable[str]) -> set[str]:
        """What a credit release for ``freed`` (an instance's capabilities) drains: those of
        them, and of their aliases, that may have work waiting; on a cluster, all of them."""
        if self.drains_all:
            return set(freed)
        return {c for name in freed for c in self._by_name.get(name, ())}

    def _discard(self, capability: str) -> None:
        name = self._resolve(capability)
        same = self._by_name.get(name)
        if same is not None:
            same.discard(capability)
            if not same:
                del self._by_name[name]
