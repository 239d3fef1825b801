"""The destination side of the pull path: admit a hinted request, pull the missing tail of its
prefix from the hinted source, commit it to the prefix index under a lease, or fall back.

Engine-facing API (thread-safe; admission never waits on the network)::

    puller = Puller(group, config=XferConfig(allowlist=["10.0.0.0/8"]))
    state = puller.submit(request_id, token_ids, hint)   # hint: KvHint | HintRejected | body dict | None
    puller.is_schedulable(request_id)                     # False while prefetching
    outcome = puller.result(request_id, timeout=...)      # PullOutcome (blocking), or await wait()
    block_ids = puller.claim(request_id)                  # leased pulled blocks -> request refs
    puller.release(request_id)                            # or drop the lease unclaimed

One pull, on the loop thread (every step bounded; any failure frees every private block
exactly once, sends ``Cancel`` for every open transfer and ends with a reason)::

    submit   decode hint; hash the prompt's full blocks in the worker's scheme (chained) and
             the hint's scheme (check the hint's hashes name this prompt); longest local
             prefix; cost guard; de-duplication; concurrency cap     -> CONTEXT_PREFETCH_INIT
    resolve  endpoint parse + resolve once + allowlist                -> IN_PROGRESS
    state    GET /kvkern/v1/state (cached per source + incarnation): protocol, codec
             fingerprint, hash scheme, block size, topology, UCX address of each source rank
             (each checked against the allowlist too)
    plan     plan_transfer(source topology, source DP rank, our topology, our DP rank);
             keep the (source rank, destination rank) pairs whose destination is hosted here
    alloc    allocate_private(count): fresh blocks only, so no cached or partially filled
             block is ever written (a local partial leaf stays untouched)
    pull     per pair, concurrently: PullRequest on CONTROL_TAG (strict: ``require_all``,
             so a source short of blocks answers MISS without pinning, and no Cancel has
             to abort the shared connection) -> PullReply -> either one-sided reads of
             the pinned blocks' byte runs straight into the private blocks (``_can_read``:
             canonical segments on both sides, or one layout's own segments, whole
             blocks; split over ``read_lanes`` read lanes, :mod:`kvkern.xfer.read_lanes`,
             where the source names its UCX worker; then ReadDone) or chunks into a ring
             of ``chunks_in_flight`` staging
             buffers, each unpacked into the private blocks as it lands (chunk size is a
             multiple of the pair's per-block bytes)
    policy   served hashes must equal the requested ones; strict: all or nothing;
             best_effort: the shortest served run over pairs
    commit   commit_private(kept, chained hashes, lease_s) ; free_private(rest)
                                                                      -> CONTEXT_PREFETCH_COMPLETE

Roles (an engine connector's split: the scheduler side decides and discovers, the worker side
moves bytes): :mod:`kvkern.xfer.admission` (a pure function: pull or a named skip, with the
hash rules), :mod:`kvkern.xfer.discovery` (endpoints, allowlist, source state and
incarnations), :mod:`kvkern.xfer.runner` (one pull from plan to commit) and
:mod:`kvkern.xfer.receive` (the stream and read receivers). This class is the facade: the
request registry, leases, de-duplication, the concurrency cap and outcomes.

De-duplication (``XferConfig.dedup``): a second request whose pull would be identical (same
source spec and DP rank, same hash range) attaches to the first: it stays
``CONTEXT_PREFETCH_IN_PROGRESS`` until the first ends (bounded by its own deadline), then ends
with reason ``duplicate`` (``used`` False) and ``blocks_local`` re-measured: the first pull's
committed blocks are in the prefix index (held by the first request's lease), so the engine's
ordinary prefix match picks them up. Followers do not count against ``max_inflight_pulls``.

Connections and cancels: see :mod:`kvkern.xfer.runner`.

With CUDA pools the ring lives on the pool's device and each chunk is unpacked on the
device's side stream (:mod:`kvkern.xfer.devstream`); the engine's compute stream waits for a
pair's last unpack before the pull completes.

Engines that allocate a pull's blocks themselves (vLLM, SGLang, TRT-LLM connectors) admit on
their scheduler side (:func:`~kvkern.xfer.admission.admit`) and call :meth:`Puller.pull_into`
with their block ids, then poll :meth:`Puller.take_finished` once per step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvkern.cache.hashing import normalize_hashes
from kvkern.xfer.admission import Admitted, Skip, WorkerFacts, admit, read_hint
from kvkern.xfer.config import XferConfig
from kvkern.xfer.devstream import serve_devices
from kvkern.xfer.discovery import SourceDiscovery, bounded_put
from kvkern.xfer.hints import HintLimits, HintRejected, KvHint
from kvkern.xfer.kvgroup import KVGroup
from kvkern.xfer.outcome import PullOutcome, Reason, RequestState
from kvkern.xfer.policy import CostGuard
from kvkern.xfer.pulljob import PullJob, PullRecord
from kvkern.xfer.receive import ReadReceiver, StreamReceiver
from kvkern.xfer.runner import PullRunner, job_outcome
from kvkern.xfer.runtime import spawn
from kvkern.xfer.staging import StagingPool
from kvkern.xfer.state import PROTOCOL, SourceState, parse_state

if TYPE_CHECKING:
    from kvkern.cache.protocol import Lease
    from kvkern.xfer.auth import Credential
    from kvkern.xfer.endpoint import Resolver
    from kvkern.xfer.metrics import XferMetrics
    from kvkern.xfer.runtime import EventLoopThread
    from kvkern.xfer.seam import Connector
    from kvkern.xfer.transport import ConnectionPool

__all__ = ["PROTOCOL", "Puller", "SourceState", "bounded_put", "parse_state"]

log = logging.getLogger("kvkern.xfer")

_METRIC_PHASES = frozenset({"metadata", "plan", "allocate", "transfer", "unpack", "validate",
                            "commit", "total"})
_METADATA_REASONS = ("metadata_fetch_failed", "metadata_timeout", "metadata_invalid")
# A request waits for an identical pull in flight that has at least this share of the time
# the request has left; else it pulls itself (and leads later identical requests).
DEDUP_TIME_SHARE = 0.5


class Puller:
    """Destination side of the pull path for one DP group (see the module docstring)."""

    def __init__(self, group: KVGroup, *, config: XferConfig,
                 metrics: XferMetrics | None = None, loop: EventLoopThread | None = None,
                 resolver: Resolver | None = None, pool: Connector | None = None,
                 credential: Credential | str | None = None) -> None:
        from kvkern.xfer.auth import FROM_ENV, resolve  # noqa: PLC0415
        from kvkern.xfer.runtime import EventLoopThread  # noqa: PLC0415

        if not isinstance(config, XferConfig):
            raise TypeError(f"config must be an XferConfig, got {type(config).__name__}")
        self.group = group
        self.config = config
        self.metrics = metrics
        self._own_loop = loop is None
        self._loop = loop if loop is not None else EventLoopThread("kvkern-puller")
        # The fleet credential signs state requests and opens control connections; without
        # one every hint falls back (``unauthenticated``): no source serves a stranger.
        self.credential = resolve(FROM_ENV if credential is None else credential)
        self._own_pool: ConnectionPool | None = None  # made here: close() closes it
        if pool is None:
            from kvkern.xfer.transport import ConnectionPool  # noqa: PLC0415

            pool = self._own_pool = ConnectionPool(credential=self.credential)
        self._pool: Connector = pool
        self.cost_guard = CostGuard(config)
        self._limits = HintLimits(max_metadata_timeout_s=config.max_metadata_timeout_s,
                                  max_transfer_timeout_s=config.max_transfer_timeout_s,
                                  max_deadline_s=config.max_deadline_s,
                                  default_policy=config.default_policy)
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, PullRecord] = collections.OrderedDict()
        self._leaders: dict[str, PullRecord] = {}  # request id -> record, pulls on the network
        self._keys: dict[tuple, PullRecord] = {}
        self._closed = False
        self._finished_into: list[tuple[str, PullOutcome]] = []
        self._into_done = threading.Condition(self._lock)
        self._bg: set[asyncio.Task] = set()
        self._worker = WorkerFacts(
            block_size=group.block_size, hash_scheme=group.hash_scheme,
            bytes_per_block=sum(r.layout.bytes_per_block for r in group.ranks.values()),
            longest_prefix=group.manager.longest_prefix)
        self._staging = _staging_for(group, config)
        self._reads = ReadReceiver(config, closed=lambda: self._closed, spawn=self._spawn)
        self._runner = PullRunner(
            group, config, pool=pool,
            discovery=SourceDiscovery(config, self.credential, resolver),
            streams=StreamReceiver(config, self._staging), reads=self._reads,
            cost_guard=self.cost_guard, metrics=metrics, lock=self._lock,
            finish=self._finish, spawn=self._spawn)
        # Heavy modules now, not on the first request's path (triton via the kernels, and
        # aiohttp for the first state fetch: ~0.2 s each).
        import aiohttp  # noqa: F401, PLC0415
        import yarl  # noqa: F401, PLC0415

        import kvkern.kernels.pack  # noqa: F401, PLC0415
        import kvkern.layout.plan  # noqa: F401, PLC0415
        import kvkern.xfer.endpoint  # noqa: F401, PLC0415

        # and the read lanes' UCX workers, each made on its own thread meanwhile (one took
        # 7-10 ms of the first direct pull's look-up), and the kernels of device pools
        self._reads.open_lanes(self._loop.loop, group.ranks.values())
        serve_devices(group.ranks.values())

    @property
    def quarantined_blocks(self) -> int:
        """Private blocks held now for reads that outlived their abort (kvkern.xfer.quarantine)."""
        return self._runner.quarantine.blocks

    # ------------------------------------------------------------------ engine-facing API

    def submit(self, request_id: str, token_ids: Sequence[int],
               hint: KvHint | HintRejected | dict | None, *,
               cache_salt: str = "", block_hashes: Sequence[int] | None = None) -> RequestState:
        """Admit a request with its hint; returns its state at once. A missing or rejected
        hint, or one that needs no pull, records an outcome now and leaves the request in
        ``CONTEXT_INIT``; otherwise the pull is scheduled on the loop thread and the request
        is ``CONTEXT_PREFETCH_INIT`` (not schedulable) until it ends. ``cache_salt`` (the
        request's tenant salt, :func:`kvkern.cache.hashing.salt_key`) enters every hash the
        pull checks and asks for, so only blocks cached under the same salt are pulled.
        ``block_hashes``: the engine's own chained hashes of the prompt's full blocks, as
        its block manager indexes them (its scheme, under ``cache_salt``), when it has
        them already: the pull asks for those and the prompt is not hashed again (a hint in
        another scheme is still checked against the tokens).

        ``ValueError`` for a request id that is still being admitted or prefetching. A
        request id that ended before starts afresh: its unclaimed lease, if any, is
        released (claim it first to keep its blocks)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        t_submit = time.perf_counter()
        if block_hashes is not None:
            block_hashes = normalize_hashes(block_hashes)  # u64 (i64 bit-casts wrap)
        rec = self._register(request_id)
        with self._admitting(rec):
            decoded = read_hint(hint, self._limits)
            if self.metrics is not None and not (isinstance(decoded, Skip)
                                                 and decoded.reason is Reason.NO_HINT):
                self.metrics.hint_received()
            if isinstance(decoded, Skip):
                self._finish(rec, PullOutcome(request_id=request_id, used=False,
                                              reason=decoded.reason, detail=decoded.detail,
                                              **decoded.fields), ignored=True)
                return rec.state
            hint = decoded
            verdict = admit(token_ids, hint, worker=self._worker, config=self.config,
                            cost_guard=self.cost_guard, cache_salt=cache_salt,
                            engine_hashes=block_hashes)
            if isinstance(verdict, Skip):
                self._finish(rec, PullOutcome(request_id=request_id, used=False,
                                              reason=verdict.reason, policy=hint.policy,
                                              source=hint.source,
                                              source_dp_rank=hint.source_dp_rank,
                                              dialect=hint.dialect, detail=verdict.detail,
                                              **verdict.fields), ignored=True)
                return rec.state
            return self._schedule(_job(rec, hint, verdict, t_submit))

    def pull_into(self, request_id: str, hint: KvHint, admitted: Admitted,
                  block_ids: Sequence[int]) -> RequestState:
        """Run a pull that the engine's scheduler admitted (:func:`~kvkern.xfer.admission.admit`)
        straight into ``block_ids``, the blocks the engine allocated for the pulled tail
        (``block_ids[i]`` receives the block named by ``admitted.chained[admitted.local + i]``).

        The engine owns the blocks throughout: nothing is committed, leased or freed here,
        and the pull is never de-duplicated. When it ends, its outcome comes out of
        :meth:`take_finished`; ``outcome.blocks_transferred`` leading blocks hold the source's
        bytes, the rest must be recomputed. Host blocks are read one-sided on the read lanes
        (a source process on this host with kvkern's own calls, any other through UCX), and
        such a pull ends only once every read it started has ended: each call has returned
        and each UCX read has completed (an aborted read's endpoint is closed, which
        completes its reads once the transport has stopped them), however long that takes.
        So no read lands in a block after the engine learns the pull ended. Without read
        lanes, or from a device pool, the pull streams."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        ids = tuple(int(b) for b in block_ids)
        if len(ids) != admitted.count:
            raise ValueError(f"{len(ids)} block ids for a pull of {admitted.count} blocks")
        if len(set(ids)) != len(ids) or any(not 0 <= b < self.group.num_blocks for b in ids):
            raise ValueError(f"block ids must be distinct and in [0, {self.group.num_blocks}),"
                             f" got {list(ids)[:16]}")
        rec = self._register(request_id)
        with self._admitting(rec):
            rec.into = True  # (the caller's admission counted the hint as received)
            job = _job(rec, hint, admitted, time.perf_counter())
            job.into = ids
            return self._schedule(job)

    def take_finished(self) -> list[tuple[str, PullOutcome]]:
        """The (request id, outcome) of every :meth:`pull_into` pull that ended since the last
        call, in the order they ended: what an engine polls once per step."""
        with self._lock:
            done, self._finished_into = self._finished_into, []
        return done

    def wait_finished(self, timeout: float) -> bool:
        """Block (without holding the GIL) until a :meth:`pull_into` pull has ended or
        ``timeout`` seconds passed; whether one is waiting in :meth:`take_finished`. For an
        engine loop with nothing but pulls to wait for: a busy loop in the engine's thread
        would starve the threads that move the bytes."""
        with self._lock:
            if not self._finished_into:
                self._into_done.wait(timeout)
            return bool(self._finished_into)

    def state(self, request_id: str) -> RequestState:
        """The request's lifecycle state (``CONTEXT_INIT`` for unknown requests)."""
        with self._lock:
            rec = self._records.get(request_id)
            return RequestState.CONTEXT_INIT if rec is None else rec.state

    def is_schedulable(self, request_id: str) -> bool:
        return self.state(request_id).schedulable

    def outcome(self, request_id: str) -> PullOutcome | None:
        """The outcome if the request has finished, else ``None`` (non-blocking)."""
        with self._lock:
            rec = self._records.get(request_id)
        return None if rec is None else rec.outcome

    def result(self, request_id: str, timeout: float | None = None) -> PullOutcome:
        """Block until the request's outcome exists (``TimeoutError`` after ``timeout``)."""
        import concurrent.futures  # noqa: PLC0415

        rec = self._record(request_id)
        try:
            return rec.done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"request {request_id!r} still {rec.state.value} after "
                               f"{timeout} s") from None

    async def wait(self, request_id: str, timeout: float | None = None) -> PullOutcome:
        """Await the outcome from any event loop."""
        rec = self._record(request_id)
        # shield: a timed-out or cancelled wait must not cancel the outcome future itself
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(rec.done)), timeout)

    def cancel(self, request_id: str) -> bool:
        """Cancel a prefetching pull (UCX operations cancelled, blocks freed, ``Cancel``
        sent, reason ``cancelled``), also one whose submit is still scheduling it. False when
        the request is not prefetching. True does not promise ``cancelled``: a pull that
        ended meanwhile keeps its outcome (``ok``), and a pull that identical requests wait
        for (de-duplication) goes on for them (cancelled once the last of them left); either
        way a cancelled request's lease is released (its blocks stay cached)."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.state.schedulable:
                return False
            rec.cancel_requested = True
            if rec.followers:  # identical requests wait for this pull: it goes on for them
                return True  # (PullRunner.follow cancels it once the last of them left)
            # (not started yet: it ends at its start; future not published: see _schedule)
            fut = rec.future if rec.state is RequestState.CONTEXT_PREFETCH_IN_PROGRESS else None
        if fut is not None:
            fut.cancel()
        return True

    def claim(self, request_id: str) -> list[int] | None:
        """The pulled blocks' ids as references held by the request (the engine releases
        them like any request blocks), via ``manager.claim``; ``None`` when nothing was
        pulled, the lease expired or was already claimed/released. Moves the request from
        ``CONTEXT_PREFETCH_COMPLETE`` to ``CONTEXT_INIT``."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.lease is None:
                return None
            lease, rec.lease = rec.lease, None
            rec.state = RequestState.CONTEXT_INIT
        return self.group.manager.claim(lease)

    def release(self, request_id: str) -> bool:
        """Drop an unclaimed lease (the blocks stay cached and evictable)."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.lease is None:
                return False
            self._release_lease_locked(rec)
            rec.state = RequestState.CONTEXT_INIT
            return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed the cost guard a measured prefill (when no per-token cost is configured)."""
        self.cost_guard.observe_prefill(tokens, seconds)

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._leaders)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every pull, release unclaimed leases, close the connections (and the
        loop thread if this puller created it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # every prefetching pull, also one a submit is still scheduling (as cancel())
            running = [r for r in self._records.values()
                       if not r.state.schedulable and not r.done.done()]
            for r in running:
                r.cancel_requested = True
            futures = [r.future for r in running if r.future is not None
                       and r.state is RequestState.CONTEXT_PREFETCH_IN_PROGRESS]
        for fut in futures:
            fut.cancel()
        deadline = time.monotonic() + timeout
        try:
            for r in running:
                with contextlib.suppress(Exception):
                    r.done.result(max(0.0, deadline - time.monotonic()))
            with self._lock:
                for r in self._records.values():
                    if r.lease is not None:
                        self._release_lease_locked(r)
        finally:
            try:
                if not self._loop.closed:
                    with contextlib.suppress(Exception):
                        self._loop.run(self._aclose(), max(1.0, deadline - time.monotonic()))
                self._reads.close(max(1.0, deadline - time.monotonic()))
            finally:
                if self._own_loop:
                    self._loop.close()

    async def _aclose(self) -> None:
        self._runner.quarantine.close()  # (first: the waits below are bounded)
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=2.0)
        await self._runner.discovery.aclose()
        if self._own_pool is not None:
            await self._own_pool.close()

    def __enter__(self) -> Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- registry

    def _register(self, request_id: str) -> PullRecord:
        rec = PullRecord(request_id)
        with self._lock:
            old = self._records.get(request_id)
            if old is not None and (old.admitting or not old.state.schedulable):
                state = "being admitted" if old.admitting else old.state.value
                raise ValueError(f"request {request_id!r} is already prefetching ({state})")
            if old is not None and old.lease is not None:
                self._release_lease_locked(old)
            self._records[request_id] = rec
            self._records.move_to_end(request_id)
            self._trim_locked()
        return rec

    @contextlib.contextmanager
    def _admitting(self, rec: PullRecord) -> Iterator[None]:
        """While ``rec``'s hint is admitted (on the caller's thread), another submit of its
        request id is refused; whatever ends the admission, even an error, ends that."""
        try:
            yield
        finally:
            with self._lock:
                rec.admitting = False

    def _record(self, request_id: str) -> PullRecord:
        with self._lock:
            rec = self._records.get(request_id)
        if rec is None:
            raise KeyError(f"unknown request {request_id!r}")
        return rec

    def _trim_locked(self) -> None:
        """The oldest records beyond ``max_tracked_requests`` go, but for requests being
        admitted or prefetching (at most ``max_inflight_pulls`` pulls and their followers)."""
        excess = len(self._records) - self.config.max_tracked_requests
        if excess <= 0:
            return
        drop = []
        for rid, old in self._records.items():
            if old.state.schedulable and not old.admitting:
                drop.append((rid, old))
                if len(drop) == excess:
                    break
        for rid, old in drop:
            if old.lease is not None:
                self._release_lease_locked(old)
            del self._records[rid]

    def _release_lease_locked(self, rec: PullRecord) -> None:
        lease, rec.lease = rec.lease, None
        try:
            self.group.manager.release_lease(lease)
        except ValueError as exc:  # already expired and forgotten by the manager
            log.debug("release of lease %s of %r: %s", lease.lease_id, rec.request_id, exc)

    def _schedule(self, job: PullJob) -> RequestState:
        """De-duplication and the concurrency cap, then the pull (or its follower) on the
        loop thread."""
        rec, hint = job.rec, job.hint
        key = (hint.source, job.source_dp, job.local, job.chained[-1])
        leader = None
        with self._lock:
            reason = None
            if self._closed:
                reason, detail = Reason.CLOSED, "puller is closed"
            elif self.config.dedup and job.into is None and key in self._keys \
                    and _time_enough(self._keys[key], job):  # (else: a pull of its own)
                leader = self._keys[key]
            elif len(self._leaders) >= self.config.max_inflight_pulls:
                reason, detail = Reason.BUSY, (f"{len(self._leaders)} pulls in flight, "
                                               f"max_inflight_pulls "
                                               f"{self.config.max_inflight_pulls}")
            elif (n := sum(r.source == hint.source for r in self._leaders.values())) \
                    >= self.config.per_source_pulls:
                reason, detail = Reason.BUSY, (f"{n} pulls in flight from this source, "
                                               f"max_inflight_per_source "
                                               f"{self.config.per_source_pulls}")
            if reason is None:
                rec.state = RequestState.CONTEXT_PREFETCH_INIT
                if leader is None:
                    rec.source, rec.deadline = hint.source, job.deadline
                    if job.into is None:
                        rec.key = key
                        self._keys[key] = rec
                    self._leaders[rec.request_id] = rec
                else:
                    rec.leader = leader
                    leader.followers += 1
        if reason is not None:
            self._finish(rec, job_outcome(job, reason, detail), ignored=True)
            return rec.state
        run = self._runner
        coro = run.follow(job, leader) if leader is not None else run.run(job)
        try:
            fut = self._loop.submit(coro)
        except RuntimeError as exc:
            self._finish(rec, job_outcome(job, Reason.CLOSED, str(exc)))
            return rec.state
        with self._lock:
            cancel_now = False
            if rec.outcome is None:  # (a pull that ended already keeps no future)
                rec.future = fut
                if self._closed:
                    rec.cancel_requested = True
                # a cancel that came meanwhile, once the pull started (else it sees it then)
                cancel_now = (rec.cancel_requested and not rec.followers
                              and rec.state is RequestState.CONTEXT_PREFETCH_IN_PROGRESS)
            state = rec.state
        if cancel_now:
            fut.cancel()
        if self.metrics is not None:
            self.metrics.hint_accepted()
        return state

    # ------------------------------------------------------------------------ outcomes

    def _finish(self, rec: PullRecord, outcome: PullOutcome, *, ignored: bool = False,
                lease: Lease | None = None) -> None:
        with self._lock:
            rec.outcome = outcome
            rec.lease = lease
            if lease is not None and (self._closed
                                      or self._records.get(rec.request_id) is not rec):
                self._release_lease_locked(rec)  # no claim can reach it any more
            if rec.lease is not None and rec.cancel_requested:
                self._release_lease_locked(rec)  # (a cancelled request claims nothing)
            rec.state = (RequestState.CONTEXT_PREFETCH_COMPLETE
                         if outcome.used and not rec.into else RequestState.CONTEXT_INIT)
            if rec.key is not None and self._keys.get(rec.key) is rec:
                del self._keys[rec.key]
            if self._leaders.get(rec.request_id) is rec:
                del self._leaders[rec.request_id]
            rec.future = None
            if rec.into:
                self._finished_into.append((rec.request_id, outcome))
                self._into_done.notify_all()
        try:
            if self.metrics is not None and outcome.reason is not Reason.NO_HINT:
                _count(self.metrics, outcome, ignored)
            if log.isEnabledFor(logging.INFO):  # (formatting the line costs ~0.05 ms)
                log.info(outcome.to_log())
        finally:  # (whatever the metrics or the log do, the outcome is delivered)
            if not rec.done.done():
                rec.done.set_result(outcome)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        spawn(self._bg, coro)


def _staging_for(group: KVGroup, config: XferConfig) -> StagingPool:
    """Receive rings reused across pulls (loop thread only): a fresh 16 MiB ring slot
    cost page faults and 4 KiB-page CMA writes on every pull (unpack path 5 ms per
    64 MiB). Faulted in now, one ring per hosted rank that would stream: with remote_read
    a host rank whose blocks are whole segments (TRT-LLM rows, per-layer HND) reads
    instead, so its ring is only made if a source that offers no read streams to it."""
    staging = StagingPool(4 * config.chunks_in_flight * config.chunk_bytes)
    streaming = [r for r in group.ranks.values()
                 if not (config.remote_read and r.device.type == "cpu"
                         and r.read_segments is not None)]
    devices = collections.Counter(r.device for r in streaming)
    for device, n_ranks in devices.items():
        staging.prewarm(device, config.chunk_bytes, config.chunks_in_flight * n_ranks)
    return staging


def _time_enough(leader: PullRecord, job: PullJob) -> bool:
    """Whether ``job`` waits for ``leader``'s identical pull: it has at least half the time
    ``job`` has left (a pull due much sooner, by a shorter deadline or an earlier start, would
    end a request that had time for a pull of its own)."""
    now = time.perf_counter()
    return leader.deadline - now >= DEDUP_TIME_SHARE * job.remaining_s(now)


def _job(rec: PullRecord, hint: KvHint, admitted: Admitted, t_submit: float) -> PullJob:
    return PullJob(rec=rec, hint=hint, policy=hint.policy, chained=admitted.chained,
                   hinted=admitted.hinted, local=admitted.local, t_submit=t_submit,
                   timeouts=admitted.timeouts, base=admitted.base)


def _count(m: XferMetrics, outcome: PullOutcome, ignored: bool) -> None:
    """Count a finished request's outcome in ``m``."""
    r = outcome.reason.value
    if ignored:
        m.hint_ignored(r)
    if outcome.used:
        m.pull_finished(r)
        m.transferred(outcome.blocks_transferred, outcome.bytes_transferred)
    else:
        m.fallback(r)
        if not ignored:
            m.pull_finished("fallback")
            if r in _METADATA_REASONS:
                m.metadata_fetch_failed(r)
            elif r not in ("cancelled", "duplicate", "closed"):
                m.transfer_failed(r)
    if outcome.blocks_local and outcome.reason is not Reason.LOCAL_PREFIX_SUFFICIENT:
        m.skipped(outcome.blocks_local)
    for ph, s in outcome.phases.items():
        if ph in _METRIC_PHASES:
            m.observe_phase(ph, s)
