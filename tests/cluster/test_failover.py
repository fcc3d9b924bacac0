"""A master SIGKILLed mid-run and its replica promoted (bench/failover.py), on a real cluster
of three masters with a replica each. The victim's replica is held back (SIGSTOP) for a
second before the kill, as a replica behind under load would be: with asynchronous
replication what the master acknowledged in that second is gone; with ``replica_acks = 1``
nothing acknowledged is lost and the non-idempotent agent runs nothing twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.failover import FailoverResult, failover_run, report
from tests.support.cluster import start_cluster

MESSAGES = 600
RATE = 150.0
STALL_S = 1.0
QUIET_S = 10.0


async def one_run(tmp_path: Path, binary: Path, replica_acks: int) -> FailoverResult:
    cluster = start_cluster(tmp_path, binary, replicas=True, appendfsync="always")
    try:
        return await failover_run(
            cluster,
            binary,
            replica_acks=replica_acks,
            messages=MESSAGES,
            rate=RATE,
            prefix=f"fo{replica_acks}",
            stall_s=STALL_S,
            quiet_s=QUIET_S,
        )
    finally:
        cluster.stop()


@pytest.mark.timeout(240)
async def test_replica_acks_1_loses_nothing_a_failover_would_take_and_0_loses_it(
    tmp_path: Path, redis7_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    waited = await one_run(tmp_path / "acks1", redis7_binary, 1)
    unwaited = await one_run(tmp_path / "acks0", redis7_binary, 0)
    with capsys.disabled():
        print(f"\n{report(unwaited)}\n{report(waited)}")

    assert waited.submitted == MESSAGES and waited.waits > 0
    assert waited.lost == [] and waited.twice == {}, report(waited)
    assert waited.unavailable_s > 0
    # the same schedule without WAIT: acknowledged writes of that second are gone
    assert unwaited.submitted == MESSAGES and unwaited.waits == 0
    assert unwaited.lost or unwaited.twice, report(unwaited)
