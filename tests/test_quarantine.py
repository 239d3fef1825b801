"""Memory that reads outlived (:mod:`kvkern.xfer.quarantine`): held until every read and
call into it has ended, then freed once; reads not tracked keep it for good."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from kvkern.xfer import quarantine
from kvkern.xfer.quarantine import Outstanding, Quarantine
from kvkern.xfer.read_lanes import _Stuck

from .rma_helpers import until


class Batch:
    """A read batch: stuck until its lane retires it after ``end()``."""

    def __init__(self) -> None:
        self.stuck, self._ended = True, False

    def end(self) -> None:
        self._ended = True


class Lane:
    """A lane that retires its ended batches when nudged (as on its own thread)."""

    def __init__(self, *batches: Batch) -> None:
        self.batches, self.nudged = list(batches), 0

    def retire_later(self) -> None:
        self.nudged += 1
        for b in self.batches:
            b.stuck = b.stuck and not b._ended


def test_outstanding_ends_only_when_every_call_has_returned_and_every_read_is_retired():
    b1, b2 = Batch(), Batch()
    lane1, lane2 = Lane(b1), Lane(b2)
    call = concurrent.futures.Future()
    buf = bytearray(8)
    held = Outstanding(batches=[(lane1, b1)], calls=[call], kept=[buf])
    assert not held.ended()
    held.nudge()
    assert lane1.nudged == 1 and not held.ended()
    # the call returns, its own reads still running (they arrive with its exception)
    call.set_exception(_Stuck("reads outlived the drain", Outstanding(batches=[(lane2, b2)])))
    b1.end()
    held.nudge()
    assert not b1.stuck and not held.ended() and held.kept == [buf]
    held.nudge()
    assert lane1.nudged == 2 and lane2.nudged == 1  # (b1 retired: its lane is left alone)
    b2.end()
    assert not held.ended()  # ended, not yet retired by its lane
    held.nudge()
    assert held.ended() and not held.kept and not held.batches and not held.calls


def test_a_call_that_returned_cleanly_or_was_withdrawn_ends_its_part():
    done, withdrawn = concurrent.futures.Future(), concurrent.futures.Future()
    done.set_result(None)
    withdrawn.cancel()
    assert Outstanding(calls=[done, withdrawn]).ended()


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(quarantine, "QUARANTINE_POLL_S", 0.01)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_quarantine_frees_each_lot_once_its_reads_end_and_never_an_untracked_one(fast):
    async def main():
        freed, released = [], []
        q = Quarantine(freed.append, released=released.append)
        b = Batch()
        lane = Lane(b)
        q.hold([1, 2], [Outstanding(batches=[(lane, b)])])
        q.hold([3], None)  # reads not tracked: held for good
        q.hold([4, 5, 6], [Outstanding()])  # nothing outstanding: freed at the next check
        assert q.blocks == 6 and lane.nudged == 1
        await until(lambda: freed == [[4, 5, 6]])
        await asyncio.sleep(0.05)
        assert freed == [[4, 5, 6]] and q.blocks == 3 and lane.nudged > 2
        b.end()
        await until(lambda: len(freed) == 2)
        assert freed[1] == [1, 2] and released == [3, 2] and q.blocks == 1
        await asyncio.sleep(0.05)
        assert len(freed) == 2 and q._timer is None  # (nothing tracked left: no more checks)
        q.close()

    run(main())


def test_a_closed_quarantine_checks_no_more_and_a_failed_free_holds_for_good(fast):
    async def main():
        def refuse(ids):
            raise ValueError("not private")

        q = Quarantine(refuse)
        q.hold([7], [Outstanding()])
        await asyncio.sleep(0.05)
        assert q.blocks == 1 and q._timer is None
        freed = []
        q2 = Quarantine(freed.append)
        q2.hold([8], [Outstanding()])
        q2.close()
        await asyncio.sleep(0.05)
        assert not freed and q2.blocks == 1

    run(main())


class FailingLane(Lane):
    """A lane that fails when asked to retire (a poll or progress call that raises)."""

    def retire_later(self) -> None:
        self.nudged += 1
        raise OSError("progress failed")


def test_a_lane_that_fails_to_retire_frees_nothing_twice_and_checking_goes_on(fast):
    async def main():
        freed = []
        q = Quarantine(freed.append)
        b = Batch()
        lane = FailingLane(b)
        q.hold([1, 2, 3], [Outstanding()])  # ended: freed at the next check
        q.hold([9], [Outstanding(batches=[(lane, b)])])  # its lane fails every nudge
        await until(lambda: lane.nudged >= 3)
        assert freed == [[1, 2, 3]] and q.blocks == 1 and q._timer is not None
        q.hold([7], [Outstanding()])
        await until(lambda: len(freed) == 2)
        await asyncio.sleep(0.05)
        assert freed == [[1, 2, 3], [7]] and q.blocks == 1
        q.close()

    run(main())


def test_a_busy_lane_holds_one_retire_however_often_it_is_asked():
    """A lane whose thread is busy (a call that does not return) is asked to retire at
    every check of every lot: one retire waits on its thread, never more."""
    import threading

    from kvkern.xfer.read_lanes import _Lane

    lane = _Lane(1, name="kvkern-test-lane")
    release = threading.Event()
    lane.submit(release.wait, 10)
    try:
        for _ in range(100):
            lane.retire_later()
        assert lane.executor._work_queue.qsize() == 1
    finally:
        release.set()
        lane.executor.shutdown(wait=True)
    assert not lane._retiring


def test_reads_untracked_once_keep_later_buffers_for_good():
    """Once a pull's stuck reads were not tracked its blocks are held for good; a tracked
    ReadsStuck after that must not let the caller drop the buffers its reads may write."""
    from types import SimpleNamespace

    from kvkern.xfer.pulljob import PullJob
    from kvkern.xfer.transport import ReadsStuck

    job = SimpleNamespace(quarantined=False, outstanding=[])
    assert not PullJob.outlived(job, ReadsStuck("untracked"))
    assert not PullJob.outlived(job, ReadsStuck("tracked", Outstanding()), [bytearray(8)])
    assert job.quarantined and job.outstanding is None
