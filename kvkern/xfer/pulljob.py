"""What one pull carries between the roles of the destination side: the request's record
(lifecycle, outcome, lease), the job a running pull fills in, and :class:`Fallback`, the
exception every step raises to end a pull with a named reason."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvkern.xfer.hints import KvHint
from kvkern.xfer.outcome import PullOutcome, Reason, RequestState
from kvkern.xfer.state import SourceState

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvkern.cache.protocol import Lease
    from kvkern.xfer.quarantine import Outstanding
    from kvkern.xfer.seam import TransferConnection
    from kvkern.xfer.transport import ReadsStuck

__all__ = ["Fallback", "PullJob", "PullRecord"]


class Fallback(Exception):
    """Ends a pull: the request runs as if there had been no hint, with ``reason``."""

    def __init__(self, reason: Reason, detail: str = "", **fields: Any) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.fields = fields  # extra outcome fields (block counts known so far)


@dataclass(eq=False)
class PullRecord:
    """One request as the engine sees it: its state, outcome and unclaimed lease."""

    request_id: str
    state: RequestState = RequestState.CONTEXT_INIT
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    outcome: PullOutcome | None = None
    lease: Lease | None = None  # the manager's lease on the committed blocks
    future: concurrent.futures.Future | None = None  # the loop task (cancel() cancels it)
    key: tuple | None = None  # dedup key while leading a pull
    leader: PullRecord | None = None  # set on dedup followers
    followers: int = 0  # dedup followers waiting for this pull (while it leads one)
    source: str = ""  # the hint's source, while this request leads a pull
    deadline: float = float("inf")  # perf_counter time its pull ends by, while it leads one
    cancel_requested: bool = False
    into: bool = False  # a pull into the engine's own blocks (Puller.pull_into)
    # registered, and neither scheduled nor finished yet (its hint is being admitted)
    admitting: bool = True


@dataclass(eq=False)
class PullJob:
    """Everything one pull needs (from admission) and what it measured while running."""

    rec: PullRecord
    hint: KvHint
    policy: str
    chained: list[int]  # worker-scheme chained hashes of the hinted blocks (from the root)
    hinted: int
    local: int
    t_submit: float
    timeouts: tuple[float, float, float]  # metadata, transfer, deadline (seconds)
    base: dict  # common outcome fields
    # the engine's blocks for the pulled tail, in hash order (Puller.pull_into): received
    # into directly, never freed or committed here
    into: tuple[int, ...] | None = None
    # filled while running
    private: list[int] | None = None  # receive blocks, freed exactly once unless committed
    chunk_blocks: list[int] = field(default_factory=list)  # a stream's chunk plan (stream_plan)
    # (connection, transfer id) of each transfer awaiting completion
    open_transfers: list[tuple[TransferConnection, int]] = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    messages: int = 0
    reads: int = 0
    bytes: int = 0
    t_first_byte: float | None = None
    state: SourceState | None = None
    state_cached: bool = False
    pairs: int = 0
    unpack_s: float = 0.0
    allocated: bool = False
    quarantined: bool = False  # reads outlived their abort: never reuse the private blocks
    # ... until these have ended (kvkern.xfer.quarantine); None: reads not tracked, for good
    outstanding: list[Outstanding] | None = field(default_factory=list)
    # cached source facts this pull found due for a refresh: started once it has ended
    # (kvkern.xfer.discovery.SourceDiscovery.after_pull)
    refreshes: list[Callable[[], None]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.hinted - self.local

    @property
    def source_dp(self) -> int:
        return self.hint.source_dp_rank or 0

    def outlived(self, exc: ReadsStuck, kept: Sequence[object] = ()) -> bool:
        """Reads of this pull outlived their abort (``exc``): its private blocks are
        quarantined until those reads have ended, and ``kept`` (buffers they may write) held
        with them. False when ``exc`` does not say which reads: the caller keeps ``kept``
        for good."""
        self.quarantined = True
        held = exc.outstanding
        if held is None or self.outstanding is None:  # (untracked reads: held for good)
            self.outstanding = None
            return False
        held.kept.extend(kept)
        self.outstanding.append(held)
        return True

    @property
    def deadline(self) -> float:
        """The ``perf_counter`` time by which the pull ends (its overall deadline)."""
        return self.t_submit + self.timeouts[2]

    def remaining_s(self, now: float) -> float:
        """Seconds left of the pull's overall deadline at ``now`` (perf_counter)."""
        return self.timeouts[2] - (now - self.t_submit)
