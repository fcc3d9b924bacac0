"""The sidecar's elastic worker pool: bounded concurrency, reuse, drain."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from adapters.workpool import WorkPool


async def test_concurrency_never_exceeds_the_limit_and_every_job_runs() -> None:
    running, peak, done = 0, 0, []

    def job(n: int):  # type: ignore[no-untyped-def]
        async def run() -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await anyio.sleep(0.001 * (n % 3))
            running -= 1
            done.append(n)

        return run

    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=4)
        for n in range(50):
            pool.submit(job(n))
        await pool.join()
        pool.close()
    assert sorted(done) == list(range(50))
    assert peak == 4


async def test_fast_jobs_reuse_workers_instead_of_spawning_one_each() -> None:
    spawned = 0
    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=1000)
        original = tg.start_soon

        def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal spawned
            spawned += 1
            return original(*args, **kwargs)

        tg.start_soon = counting  # type: ignore[method-assign]
        for _ in range(20):
            for _ in range(10):
                pool.submit(anyio.lowlevel.checkpoint)
            await pool.join()
        pool.close()
    assert spawned <= 10  # one wave of workers, then reused


async def test_waiting_jobs_get_their_own_worker_up_to_the_limit() -> None:
    release = anyio.Event()
    started = 0

    async def blocked() -> None:
        nonlocal started
        started += 1
        await release.wait()

    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=8)
        for _ in range(5):
            pool.submit(blocked)
        with anyio.fail_after(5):
            while started < 5:
                await anyio.lowlevel.checkpoint()
        assert pool.unfinished == 5
        release.set()
        await pool.join()
        pool.close()
    assert pool.unfinished == 0


async def test_a_closed_pool_refuses_work() -> None:
    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=2)
        pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            pool.submit(anyio.lowlevel.checkpoint)


def left_behind(pool: WorkPool) -> tuple[int, int, int]:
    """What a pool still counts once its workers are gone: idle workers waiting, workers woken
    and not back, workers — all 0 after a clean exit."""
    return len(pool._sleepers), pool._woken, pool._workers


async def test_a_job_submitted_as_the_idle_workers_are_cancelled_raises_nothing() -> None:
    """A cancellation reaches an idle worker's wait at once, and the worker leaves a turn
    later: a job handed over in between passes it by, and the worker leaves cleanly."""
    ran = []

    async def job() -> None:
        ran.append(1)

    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=2)
        pool.submit(job)
        await pool.join()  # its worker is idle now
        tg.cancel_scope.cancel()
        pool.submit(job)  # the idle worker's wait is cancelled: not woken, no error
    assert ran == [1] and pool.unfinished == 1
    assert left_behind(pool) == (0, 0, 0)


async def test_idle_workers_cancelled_leave_nothing_behind() -> None:
    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=4)
        for _ in range(3):
            pool.submit(anyio.lowlevel.checkpoint)
        await pool.join()
        assert left_behind(pool)[0] > 0  # idle workers waiting
        tg.cancel_scope.cancel()
    assert left_behind(pool) == (0, 0, 0)


async def test_a_worker_woken_then_cancelled_is_counted_out() -> None:
    """Set, then cancelled before it ran: the worker was woken, and is no longer."""
    async with anyio.create_task_group() as tg:
        pool = WorkPool(tg, limit=1)
        pool.submit(anyio.lowlevel.checkpoint)
        await pool.join()
        pool.submit(anyio.lowlevel.checkpoint)  # wakes the idle worker ...
        tg.cancel_scope.cancel()  # ... which is cancelled before it takes the job
    assert left_behind(pool)[1:] == (0, 0)
