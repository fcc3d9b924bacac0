"""An elastic pool of worker tasks: at most ``limit`` jobs run at once, workers are reused.

Spawning a task per message cost more than handling a fast message itself. Here a worker is
spawned only when a job would otherwise wait for one (queued jobs outnumber idle workers and
the pool is below its limit); otherwise an idle worker takes it. A fast agent is served by a
handful of workers; a slow one grows the pool up to its credits.

An idle worker sleeps on a future of the event loop's own, not an ``anyio.Event``: the event
(an asyncio event and a future under it, each made through anyio's backend lookup) was about
4 % of a saturated sidecar's CPU (py-spy, ``bench.cpu_cost --burst``), for one hand-off a job.
The sidecar runs on asyncio only (``workers/cli/common.py``), as the pipeliner does.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

Job = Callable[[], Awaitable[None]]


class WorkPool:
    def __init__(self, tg: TaskGroup, limit: int) -> None:
        self._tg = tg
        self._limit = limit
        self._queue: deque[Job] = deque()
        self._workers = 0
        # one future per idle worker: a job wakes one, not every idle worker (a pool grown to
        # thousands by slow calls would otherwise stir them all for every fast job)
        self._sleepers: deque[asyncio.Future[None]] = deque()
        self._woken = 0  # woken and not yet back at the queue: idle all the same
        self._unfinished = 0
        self._closed = False
        self._drained: anyio.Event | None = None

    @property
    def unfinished(self) -> int:
        """Jobs submitted and not yet finished."""
        return self._unfinished

    def submit(self, job: Job) -> None:
        if self._closed:
            raise RuntimeError("the pool is closed")
        self._queue.append(job)
        self._unfinished += 1
        if len(self._queue) > len(self._sleepers) + self._woken and self._workers < self._limit:
            self._workers += 1
            self._tg.start_soon(self._work)
        elif self._sleepers:
            self._wake_one()

    def _wake_one(self) -> None:
        while self._sleepers:
            wake = self._sleepers.popleft()
            if not wake.done():  # one cancelled while idle is on its way out: not a worker
                wake.set_result(None)
                self._woken += 1
                return

    def close(self) -> None:
        """No more jobs: workers leave once the queue is empty."""
        self._closed = True
        while self._sleepers:
            self._wake_one()

    async def join(self) -> None:
        """Wait until every submitted job has finished."""
        while self._unfinished:
            self._drained = anyio.Event()
            await self._drained.wait()

    async def _work(self) -> None:
        try:
            while True:
                while not self._queue:
                    if self._closed:
                        return
                    wake = asyncio.get_running_loop().create_future()
                    self._sleepers.append(wake)
                    try:
                        await wake
                    finally:
                        if not wake.cancelled():
                            self._woken -= 1
                        elif wake in self._sleepers:  # cancelled while idle, not passed over
                            self._sleepers.remove(wake)
                job = self._queue.popleft()
                try:
                    await job()
                finally:
                    self._unfinished -= 1
                    if not self._unfinished and self._drained is not None:
                        self._drained.set()
        finally:
            self._workers -= 1
