"""Memory that reads outlived: held out of reuse until every read into it has ended.

A one-sided read still running after its endpoint's forced close and the drain
(:data:`~kvkern.xfer.tuning.READ_DRAIN_S`), or a lane call still running when a second
cancellation cut the pull's wait short, may write its local memory later. The pull then
raises :class:`~kvkern.xfer.transport.ReadsStuck` carrying an :class:`Outstanding`: the UCX
requests still posted (with the lane that owns their worker), the lane calls still running,
and the buffers they target. The pull's private blocks go to the puller's
:class:`Quarantine`, which every :data:`QUARANTINE_POLL_S` asks those lanes to retire what
has completed (a worker is progressed only on its own thread) and frees the blocks once
every read and call has ended. Reads that never end keep their blocks for good, as before;
what a transport completes late is given back instead of leaking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Outstanding", "Quarantine", "QUARANTINE_POLL_S"]

log = logging.getLogger("kvkern.xfer")

# How often held blocks are checked: an aborted read that ends does so long after the
# drain's five seconds, so a second is soon enough, and costs one lane task per check.
QUARANTINE_POLL_S = 1.0


class Outstanding:
    """Reads and calls that outlived their abort, and the buffers they may still write.

    ``batches``: ``(lane, batch)`` pairs of UCX read batches whose requests were still
    posted (``batch.stuck``), retired on their lane's thread (``lane.retire_later()``);
    ``calls``: futures of lane calls still running (a finished one may report more
    outstanding reads through its exception's ``outstanding``); ``kept``: buffers held
    referenced until :meth:`ended`."""

    def __init__(self, batches: Sequence[tuple[Any, Any]] = (),
                 calls: Sequence[concurrent.futures.Future] = (),
                 kept: Sequence[object] = ()) -> None:
        self.batches = list(batches)
        self.calls = list(calls)
        self.kept = list(kept)

    def absorb(self, other: Outstanding | None) -> None:
        if other is not None and other is not self:
            self.batches += other.batches
            self.calls += other.calls
            self.kept += other.kept

    def ended(self) -> bool:
        """Whether nothing can write the memory any more (on the event loop's thread: of
        the batches it reads only what their lanes' threads retired)."""
        while self.calls:
            call = self.calls[-1]
            if not call.done():
                return False
            self.calls.pop()
            exc = None if call.cancelled() else call.exception()
            self.absorb(getattr(exc, "outstanding", None))
        self.batches = [(lane, b) for lane, b in self.batches if b.stuck]
        if self.batches:
            return False
        self.kept.clear()
        return True

    def nudge(self) -> None:
        """Ask the lanes of the batches still posted to retire those that completed (a lane
        that fails to is logged: its reads stay held)."""
        for lane in {id(lane): lane for lane, _ in self.batches}.values():
            try:
                lane.retire_later()
            except Exception:  # noqa: BLE001
                log.exception("a read lane was not asked to retire its stuck reads")


class Quarantine:
    """Private blocks that reads outlived, each lot freed (``free(ids)``, on the event
    loop's thread) once every :class:`Outstanding` of its pull has ended; a lot whose reads
    are not tracked (``None``) is held for good. ``released(n)``: called per lot freed."""

    def __init__(self, free: Callable[[list[int]], None], *,
                 released: Callable[[int], None] | None = None,
                 poll_s: float | None = None) -> None:
        self._free = free
        self._released = released
        self._poll_s = poll_s
        self._lots: list[tuple[list[int], list[Outstanding] | None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def blocks(self) -> int:
        """Blocks held now."""
        return sum(len(ids) for ids, _ in self._lots)

    def hold(self, ids: list[int], outstanding: Sequence[Outstanding] | None) -> None:
        """Hold ``ids`` until every one of ``outstanding`` has ended (on the loop's thread)."""
        tracked = list(outstanding) if outstanding is not None else None
        self._lots.append((list(ids), tracked))
        if tracked is not None:
            for o in tracked:
                o.nudge()
            self._arm()

    def close(self) -> None:
        """Stop checking: what is held stays held."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        if self._timer is None and not self._closed:
            poll = QUARANTINE_POLL_S if self._poll_s is None else self._poll_s
            self._timer = asyncio.get_running_loop().call_later(poll, self._check)

    def _check(self) -> None:
        self._timer = None
        lots, self._lots = self._lots, []  # (each lot is put back or freed exactly once)
        for ids, tracked in lots:
            self._check_lot(ids, tracked)
        if any(tracked is not None for _, tracked in self._lots):
            self._arm()

    def _check_lot(self, ids: list[int], tracked: list[Outstanding] | None) -> None:
        try:
            ended = tracked is not None and all(o.ended() for o in tracked)
        except Exception:  # noqa: BLE001 (not known to have ended: held, checked again)
            log.exception("quarantined blocks %s: their reads could not be checked", ids[:16])
            ended = False
        if not ended:
            self._lots.append((ids, tracked))
            for o in tracked or ():
                o.nudge()
            return
        try:
            self._free(ids)
        except Exception:  # noqa: BLE001 (a pool that forgot them)
            log.exception("blocks %s out of quarantine could not be freed: held for good",
                          ids[:16])
            self._lots.append((ids, None))
            return
        log.info("%d quarantined blocks freed: every read into them has ended", len(ids))
        if self._released is not None:
            try:
                self._released(len(ids))
            except Exception:  # noqa: BLE001 (a metric that failed: the blocks are free)
                log.exception("quarantined blocks freed, not counted")
