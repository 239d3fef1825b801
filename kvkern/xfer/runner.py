"""Running one admitted pull on the loop thread: discover the source, plan the pairs,
allocate the private blocks, move each pair's blocks (:mod:`kvkern.xfer.receive`), apply the
policy and commit under a lease. Every step is bounded; any failure frees every private block
exactly once, sends ``Cancel`` for every open transfer and ends with a reason.

Connections: one UCXX connection per source rank, shared by concurrent pulls; a timeout or
cancel in the middle of a stream, or while a message is awaited, aborts that connection
(UCX owns posted buffers until an abort), so other pulls on it that had their reply fail
with ``transfer_failed``, one still waiting for its reply asks once more on a new
connection, and the next one reconnects. A cancel during one-sided reads lets them
finish and keeps the connection; a read lane that fails or is stopped closes only its own
endpoint to that source.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from kvkern.layout.chunks import chunk_runs, stream_plan
from kvkern.xfer.codes import CONNECT_FAILURES, reject_reason, transport_reason
from kvkern.xfer.config import XferConfig
from kvkern.xfer.direct import read_directly
from kvkern.xfer.discovery import SourceDiscovery
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import Message, PullReply, PullRequest, ReadGrant
from kvkern.xfer.outcome import PullOutcome, Reason, RequestState
from kvkern.xfer.policy import CostGuard, apply_policy
from kvkern.xfer.pulljob import Fallback, PullJob, PullRecord
from kvkern.xfer.quarantine import Quarantine
from kvkern.xfer.receive import ReadReceiver, StreamReceiver
from kvkern.xfer.seam import Connector, TransferConnection
from kvkern.xfer.tuning import (
    CANCEL_SEND_TIMEOUT_S,
    STREAM_MIN_RUN_BYTES,
    ZERO_COPY_CHUNK_BYTES,
)

if TYPE_CHECKING:
    from kvkern.cache.protocol import Lease
    from kvkern.layout.plan import PeerTransfer
    from kvkern.xfer.metrics import XferMetrics
    from kvkern.xfer.state import SourceState

__all__ = ["CANCEL_SEND_TIMEOUT_S", "PullRunner", "check_reply", "job_outcome"]

T = TypeVar("T")
log = logging.getLogger("kvkern.xfer")


def job_outcome(job: PullJob, reason: Reason, detail: str = "", **kw: Any) -> PullOutcome:
    """The outcome of ``job`` ending with ``reason`` (its common fields, then ``kw``)."""
    fields = dict(job.base)
    fields.update(kw)
    state = job.state
    if state is not None:
        fields.setdefault("worker_id", state.worker_id)
        fields.setdefault("incarnation", state.incarnation)
    return PullOutcome(request_id=job.rec.request_id, used=reason in (Reason.OK,
                                                                      Reason.PARTIAL),
                       reason=reason, detail=detail[:2000], **fields)


def observe_pull(cost_guard: CostGuard, job: PullJob) -> None:
    """Teach ``cost_guard`` a finished pull: the time that moved its bytes (a direct read's
    copy, a granted read's reads, else the transfer less its round trip) and the rest of the
    pull, from its submission, as the fixed cost it adds to every pull (not learnt from a
    pull that fetched its source's state: a first contact, connections made)."""
    phases = job.phases
    copy = phases.get("data", phases.get("read"))
    if copy is None:
        copy = phases["transfer"] - phases.get("rtt", 0.0)
    total = time.perf_counter() - job.t_submit
    fixed = max(total - copy, 0.0) if job.state_cached else None
    cost_guard.observe_pull(job.bytes, max(copy, 1e-9), fixed)


def check_reply(job: PullJob, pair: PeerTransfer, req: PullRequest, reply: Message,
                entry: tuple[TransferConnection, int]) -> int:
    """The served count of a well-formed reply that serves; else Fallback (and the
    transfer is closed where nothing follows)."""
    from kvkern.xfer.messages import Status  # noqa: PLC0415

    tid, count = req.transfer_id, job.count
    if not isinstance(reply, PullReply) or reply.transfer_id != tid:
        raise Fallback(Reason.TRANSFER_FAILED, f"expected PullReply for transfer {tid}, "
                       f"got {type(reply).__name__} "
                       f"{getattr(reply, 'transfer_id', None)}")
    if reply.status in (Status.MISS,):
        job.open_transfers.remove(entry)  # nothing follows
        raise Fallback(Reason.SOURCE_MISS, f"source rank {pair.src_rank} cannot serve "
                       f"the {count} requested blocks: {reply.reason}")
    if reply.status == Status.BUSY:
        job.open_transfers.remove(entry)
        raise Fallback(Reason.SOURCE_BUSY, f"source rank {pair.src_rank}: {reply.reason}")
    if reply.status not in (Status.OK, Status.PARTIAL):
        job.open_transfers.remove(entry)
        raise Fallback(reject_reason(reply.reason), f"source rank {pair.src_rank} "
                       f"answered {reply.status.value}: {reply.reason}")
    served = reply.served_blocks
    want = job.chained[job.local:job.local + served]
    if served > count or list(reply.block_hashes) != want:
        raise Fallback(Reason.HASH_MISMATCH, f"source rank {pair.src_rank} served "
                       f"{served} blocks with hashes that are not the requested "
                       f"{count}")
    if served == 0:
        job.open_transfers.remove(entry)
        raise Fallback(Reason.SOURCE_MISS, f"source rank {pair.src_rank} served 0 of "
                       f"{count} blocks")
    if served < count and job.policy == "strict":
        raise Fallback(Reason.SOURCE_MISS, f"source rank {pair.src_rank} holds {served} "
                       f"of {count} requested blocks (strict)")
    return served


class PullRunner:
    """Runs admitted pulls for one DP group (see the module docstring)."""

    def __init__(self, group: KVGroup, config: XferConfig, *, pool: Connector,
                 discovery: SourceDiscovery, streams: StreamReceiver, reads: ReadReceiver,
                 cost_guard: CostGuard, metrics: XferMetrics | None, lock: threading.Lock,
                 finish: Callable[..., None],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.group = group
        self.config = config
        self.pool = pool  # kvkern.xfer.transport.ConnectionPool behind the seam
        self.discovery = discovery
        self.streams = streams
        self.reads = reads
        self.cost_guard = cost_guard
        self.metrics = metrics
        # private blocks that reads outlived, held until those reads end (see ReadsStuck)
        self.quarantine = Quarantine(group.manager.free_private, released=(
            metrics.blocks_quarantine_freed.inc if metrics is not None else None))
        self._lock = lock
        self._finish = finish
        self._spawn = spawn
        self._tids = itertools.count(random.randrange(1, 1 << 29))

    def _started(self, rec: PullRecord) -> bool:
        """The pull's first step: it is in progress now; False when a cancel (or a close)
        came before it started (it then ends ``cancelled`` at once), unless identical
        requests wait for it (it goes on for them)."""
        with self._lock:
            rec.state = RequestState.CONTEXT_PREFETCH_IN_PROGRESS
            return not rec.cancel_requested or rec.followers > 0

    async def follow(self, job: PullJob, leader: PullRecord) -> None:
        """A de-duplicated request: wait for the identical pull, then end ``duplicate``."""
        rec = job.rec
        go = self._started(rec)
        t0 = time.perf_counter()
        reason, detail = Reason.DUPLICATE, ""
        try:
            if not go:
                raise asyncio.CancelledError
            first = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(leader.done)),
                                           job.timeouts[2])
            detail = f"attached to {leader.request_id!r} ({first.reason.value})"
        except (asyncio.TimeoutError, TimeoutError):
            reason, detail = Reason.DEADLINE_EXCEEDED, (f"waited {job.timeouts[2]} s for the "
                                                        f"identical pull {leader.request_id!r}")
        except asyncio.CancelledError:
            reason, detail = Reason.CANCELLED, "cancelled while attached"
        finally:
            with self._lock:
                leader.followers -= 1
                # a leader its own request cancelled went on for its followers only
                orphan = (leader.future if not leader.followers and leader.cancel_requested
                          and leader.state is RequestState.CONTEXT_PREFETCH_IN_PROGRESS
                          else None)
            if orphan is not None:
                orphan.cancel()
        local = self.group.manager.longest_prefix(job.chained)
        self._finish(rec, job_outcome(job, reason, detail, blocks_local=local,
                                      phases={"total": time.perf_counter() - t0}))

    async def run(self, job: PullJob) -> None:
        """The whole pull, ending in exactly one outcome."""
        from kvkern.xfer.transport import TransportError  # noqa: PLC0415

        rec = job.rec
        go = self._started(rec)
        t0 = job.t_submit
        deadline_s = job.timeouts[2]
        remaining = job.remaining_s(time.perf_counter())
        lease = None
        reason, detail, result = Reason.INTERNAL_ERROR, "", {}
        m = self.metrics
        if m is not None:
            m.pull_started()
        try:
            try:
                if not go:
                    raise asyncio.CancelledError
                async with asyncio.timeout(max(remaining, 1e-3)) as cm:
                    lease, reason, detail, result = await self._pull(job)
            except TimeoutError:
                if not cm.expired():
                    raise
                reason, detail = Reason.DEADLINE_EXCEEDED, (
                    f"pull not done within deadline_s {deadline_s} s")
        except Fallback as fb:
            reason, detail = fb.reason, fb.detail
        except TransportError as exc:
            reason, detail = transport_reason(exc.reason), str(exc)
        except asyncio.CancelledError:
            reason, detail = Reason.CANCELLED, ("cancelled" if rec.cancel_requested
                                                else "loop shut down")
        except Exception as exc:
            log.exception("pull %r failed unexpectedly", rec.request_id)
            reason, detail = Reason.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
        finally:
            self._free_private(job)
            self._send_cancels(job, reason)
            if m is not None:
                m.pull_ended()
        fields = self._measured(job, t0)
        fields.update(result)
        self._finish(rec, job_outcome(job, reason, detail, **fields), lease=lease)
        self.discovery.after_pull(job)

    def _free_private(self, job: PullJob) -> None:
        """Private blocks not committed go back exactly once (quarantined ones never)."""
        if job.private is not None and job.into is not None:
            if job.quarantined:  # only when the wait for a stuck read was cancelled
                log.error("pull %r: a read into the engine's blocks %s was still running "
                          "when the pull ended", job.rec.request_id, job.private[:16])
            job.private = None  # the engine's blocks: it recomputes them (Puller.pull_into)
        if job.private is not None and job.quarantined:
            ids, job.private = job.private, None
            self.quarantine.hold(ids, job.outstanding)
            if self.metrics is not None:
                self.metrics.blocks_quarantined.inc(len(ids))
            log.error("pull %r: %d private blocks quarantined (one-sided reads still "
                      "running after their endpoint was aborted%s)", job.rec.request_id,
                      len(ids), "" if job.outstanding is not None else ", for good")
        if job.private is not None:  # not committed: free every block exactly once
            ids, job.private = job.private, None
            self.group.manager.free_private(ids)

    @staticmethod
    def _measured(job: PullJob, t0: float) -> dict:
        job.phases["total"] = time.perf_counter() - t0
        if job.t_first_byte is not None:
            job.phases["first_byte"] = job.t_first_byte - t0
        if job.unpack_s:
            job.phases["unpack"] = job.unpack_s
        return dict(phases=dict(job.phases), pairs=job.pairs, messages=job.messages,
                    reads=job.reads, bytes_transferred=job.bytes,
                    blocks_requested=job.count if job.allocated else 0)

    async def _pull(self, job: PullJob) -> tuple[Lease | None, Reason, str, dict]:
        group = self.group
        t = time.perf_counter()
        # the hint's admission on the engine's thread and the hand-off onto this loop
        job.phases["queue"] = t - job.t_submit
        state = await self.discovery.discover(job)
        job.phases["metadata"] = time.perf_counter() - t

        t = time.perf_counter()
        pairs, addrs = self._plan(job, state)
        job.phases["plan"] = time.perf_counter() - t

        t = time.perf_counter()
        self._allocate(job, pairs)
        job.phases["allocate"] = time.perf_counter() - t

        t = time.perf_counter()
        xfer_t = job.timeouts[1]
        served = await self._pull_pairs(job, pairs, addrs, xfer_t)
        xfer_s = time.perf_counter() - t
        job.phases["transfer"] = xfer_s

        t = time.perf_counter()
        decision = apply_policy(job.policy, job.count, served)
        job.phases["validate"] = time.perf_counter() - t
        if not decision.used:
            raise Fallback(decision.reason, f"pairs served {served} of {job.count} blocks "
                           f"({job.policy})")
        t = time.perf_counter()
        keep = decision.keep
        if job.into is not None:  # the engine's blocks: it caches what it keeps itself
            return None, decision.reason, self._into_detail(job, keep, len(pairs)), {
                "blocks_transferred": keep, "blocks_skipped": decision.skipped,
                "blocks_requested": job.count}
        ids, job.private = job.private, None
        # a manager with a read directory places the blocks with their chain (see
        # kvkern.cache.protocol)
        chain = ({"parent": job.chained[job.local - 1] if job.local else None}
                 if hasattr(group.manager, "read_directory") else {})
        try:
            lease = group.manager.commit_private(
                ids[:keep], job.chained[job.local:job.local + keep],
                lease_s=None if job.hint.no_retain else self.config.lease_s, **chain)
        except BaseException:
            job.private = ids  # not committed: the caller frees them
            raise
        if keep < len(ids):
            group.manager.free_private(ids[keep:])
        job.phases["commit"] = time.perf_counter() - t
        observe_pull(self.cost_guard, job)
        detail = (f"{keep} of {job.count} blocks from {len(pairs)} pair(s)"
                  + (f", {len(ids) - keep} skipped" if keep < len(ids) else ""))
        return lease, decision.reason, detail, {"blocks_transferred": keep,
                                                "blocks_skipped": decision.skipped,
                                                "blocks_requested": job.count}

    def _plan(self, job: PullJob,
              state: SourceState) -> tuple[list[PeerTransfer], dict[int, tuple[str, int]]]:
        """The (source rank, destination rank) pairs hosted here and each source rank's
        checked UCX address."""
        from kvkern.layout.plan import plan_transfer  # noqa: PLC0415
        from kvkern.layout.topology import IncompatibleTopologyError  # noqa: PLC0415

        group = self.group
        self.discovery.check_compatible(state, group, self.pool.codec.fingerprint)
        try:
            plan = plan_transfer(state.topology, job.source_dp, group.topology, group.dp_rank)
        except (IncompatibleTopologyError, ValueError) as exc:
            raise Fallback(Reason.INCOMPATIBLE_TOPOLOGY, str(exc)) from None
        pairs = [pair for pair in plan.transfers if pair.dst_rank in group.ranks]
        if not pairs:
            raise Fallback(Reason.INCOMPATIBLE_TOPOLOGY, f"plan has no pair for the hosted "
                           f"ranks {sorted(group.ranks)}")
        addrs = self.discovery.rank_addresses(state, job.source_dp,
                                              [pair.src_rank for pair in pairs])
        job.pairs = len(pairs)
        return pairs, addrs

    def _into_detail(self, job: PullJob, keep: int, n_pairs: int) -> str:
        job.private = None
        observe_pull(self.cost_guard, job)
        return f"{keep} of {job.count} blocks from {n_pairs} pair(s) into the engine's blocks"

    def _allocate(self, job: PullJob, pairs: list[PeerTransfer]) -> None:
        if job.into is not None:  # the engine's blocks, in hash order
            job.private = list(job.into)
        else:
            ids = self.group.manager.allocate_private(job.count)
            if ids is None:
                raise Fallback(Reason.NO_BLOCKS, f"{job.count} private blocks not available")
            job.private = sorted(ids)  # ascending: runs of consecutive ids land in place
        job.allocated = True

    def _plan_chunks(self, job: PullJob, pairs: list[PeerTransfer]) -> None:
        """A lone pair's stream plan (``job.chunk_blocks``, the private blocks reordered
        for it): its chunks then land in place run by run. Made only when the pair asks its
        source, before any block counts (a read ignores the plan; a direct read that did not
        count leaves nothing in the private blocks that the stream keeps)."""
        pair = pairs[0]
        unit = pair.block_nbytes
        if len(pairs) == 1 and len(pair.pieces) == 1 and self.config.chunk_bytes >= unit \
                and self.group.ranks[pair.dst_rank].stream_rows(
                    pair.pieces[0].dst_layers, pair.pieces[0].dst_heads, unit) is not None:
            per, min_run = self.config.chunk_bytes // unit, -(-STREAM_MIN_RUN_BYTES // unit)
            per_run = max(per, ZERO_COPY_CHUNK_BYTES // unit)
            if job.into is None:
                job.private, job.chunk_blocks = stream_plan(job.private, per, min_run, per_run)
            else:
                job.chunk_blocks = chunk_runs(job.private, per, min_run, per_run)

    async def _pull_pairs(self, job: PullJob, pairs: list[PeerTransfer],
                          addrs: dict[int, tuple[str, int]],
                          xfer_t: float) -> list[int]:
        """The pairs that read directly, in groups of one look-up each; then every other
        pair (and those whose direct read did not count) concurrently, asking the source.
        The first failure cancels the others (awaited)."""
        groups = self._direct_groups(job, pairs)
        served: dict[int, int] = {}
        for group, got in zip(groups, await _all([
                read_directly(self.reads, job, [(pairs[i], self.group.ranks[pairs[i].dst_rank])
                                                for i in group], xfer_t, self.metrics,
                              self.discovery.connect_failed)
                for group in groups]), strict=True):
            if got is not None:
                served.update(dict.fromkeys(group, got))
                self._pulled("direct", len(group))
        rest = [i for i in range(len(pairs)) if i not in served]
        if rest and not served:
            self._plan_chunks(job, pairs)
        asked = await _all([self._pull_pair(job, pairs[i], addrs[pairs[i].src_rank], xfer_t)
                            for i in rest])
        served.update(zip(rest, asked, strict=True))
        return [served[i] for i in range(len(pairs))]

    def _direct_groups(self, job: PullJob, pairs: list[PeerTransfer]) -> list[list[int]]:
        """The pairs that may read directly (:meth:`_direct`), grouped by the read worker
        and read directory their source ranks announce (one look-up per group)."""
        from kvkern.xfer.direct import same_directory  # noqa: PLC0415

        groups: list[list[int]] = []
        for i, pair in enumerate(pairs):
            if not self._direct(job, pair, self.group.ranks[pair.dst_rank]):
                continue
            key = (job.source_dp, pair.src_rank)
            worker, index = job.state.read_workers[key], job.state.read_indexes[key]
            for group in groups:
                other = (job.source_dp, pairs[group[0]].src_rank)
                if job.state.read_workers[other] == worker and same_directory(
                        job.state.read_indexes[other], index):
                    group.append(i)
                    break
            else:
                groups.append([i])
        out = []
        for group in groups:  # a source rank's pairs read together: each read big enough
            by_source: dict[int, list[int]] = {}
            for i in group:
                by_source.setdefault(pairs[i].src_rank, []).append(i)
            kept = [i for members in by_source.values()
                    if self.reads.reads_big_enough(job, [
                        (pairs[i], self.group.ranks[pairs[i].dst_rank]) for i in members])
                    for i in members]
            if kept:
                out.append(kept)
        return out

    async def _pull_pair(self, job: PullJob, pair: PeerTransfer, addr: tuple[str, int],
                         xfer_t: float, *, read: bool = True) -> int:
        """One (source rank, destination rank) pair; returns the validated served count.
        A connection that dies before the reply (``peer_closed``: its source aborted it,
        for another transfer on it perhaps) is asked once more on a fresh one: nothing of
        the transfer had moved, and the source let go of what the first request pinned
        with the connection. A granted read that fails is asked once more as a stream
        (``read`` False)."""
        from kvkern.xfer.transport import ReadsStuck, TransportError  # noqa: PLC0415

        rank_kv = self.group.ranks[pair.dst_rank]
        unit = pair.block_nbytes
        # Whole blocks per chunk (zero-copy landing, no carry); a block larger than
        # chunk_bytes travels in chunk_bytes slices that the unpacker reassembles. A planned
        # stream's runs land in place in chunks up to ZERO_COPY_CHUNK_BYTES (no staging).
        chunk = (self.config.chunk_bytes // unit) * unit or self.config.chunk_bytes
        ask = max(chunk, ZERO_COPY_CHUNK_BYTES // unit * unit) if job.chunk_blocks else chunk
        for again in (False, True):
            conn = await self._connect(job, addr, xfer_t)
            req = self._request(job, pair, rank_kv, ask, read=read)
            entry = (conn, req.transfer_id)
            t_req = time.perf_counter()
            job.open_transfers.append(entry)
            try:
                reply = await self._exchange(job, conn, req, xfer_t)
                break
            except TransportError as exc:
                if again or exc.reason != "peer_closed":
                    raise
                job.open_transfers.remove(entry)  # (its connection is gone with it)
                log.info("pull %r: the connection to %s:%d closed before the reply (%s); "
                         "asking once more on a new one", job.rec.request_id, *addr, exc)
        job.phases.setdefault("rtt", time.perf_counter() - t_req)
        served = check_reply(job, pair, req, reply, entry)
        if isinstance(reply, ReadGrant):
            if not req.read:
                raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} offered "
                               f"a read to a request that did not ask for one")
            try:
                await self.reads.receive(job, pair, conn, reply, rank_kv, xfer_t, t_req)
            except TransportError as exc:
                if exc.reason != "transfer_failed" or isinstance(exc, ReadsStuck) \
                        or job.into is not None or job.quarantined:
                    raise
                # The read failed (its lanes now rest: ReadReceiver.lanes_failed): let go
                # of the grant and stream the pair instead, into the same private blocks.
                log.info("pull %r: reads from source rank %d failed (%s); streaming it",
                         job.rec.request_id, pair.src_rank, exc)
                job.open_transfers.remove(entry)
                self._cancel(job, conn, req.transfer_id, Reason.TRANSFER_FAILED)
                return await self._pull_pair(job, pair, addr, xfer_t, read=False)
            job.open_transfers.remove(entry)
            self._pulled("read")
            return served
        await self.streams.receive(job, pair, rank_kv, conn, reply, chunk, xfer_t, entry,
                                   in_place=ask)
        self._pulled("stream")
        return served

    def _pulled(self, path: str, pairs: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.pair_pulled(path, pairs)

    def _direct(self, job: PullJob, pair: PeerTransfer, rank_kv: RankKV) -> bool:
        """This pair may read directly (:mod:`kvkern.xfer.direct`): allowed on both sides,
        the source rank publishes its directory (with check words) and read worker, and a
        granted read would be allowed too, but for the size of its reads (which the pairs
        of one source rank have together: :meth:`_direct_groups`)."""
        state, key = job.state, (job.source_dp, pair.src_rank)
        return (self.config.direct_reads and state is not None
                and key in state.read_indexes and state.read_indexes[key].dir_check
                and key in state.read_workers and self.reads.read_allowed(job, pair, rank_kv))

    async def _connect(self, job: PullJob, addr: tuple[str, int],
                       xfer_t: float) -> TransferConnection:
        from kvkern.xfer.transport import TransportError  # noqa: PLC0415

        try:
            async with asyncio.timeout(xfer_t):  # not wait_for: no task per pull
                return await self.pool.get(*addr)
        except TimeoutError:
            raise Fallback(Reason.TRANSFER_TIMEOUT, f"connect to {addr[0]}:{addr[1]} took "
                           f"over {xfer_t} s") from None
        except TransportError as exc:
            await self.discovery.connect_failed(job, exc)
            raise

    def _request(self, job: PullJob, pair: PeerTransfer, rank_kv: RankKV, chunk: int, *,
                 read: bool = True) -> PullRequest:
        from kvkern.xfer.messages import PlanPiece  # noqa: PLC0415

        pieces = [PlanPiece(src_rank=p.src_rank, layer_start=p.src_layers[0],
                            layer_stop=p.src_layers[1], head_start=p.src_heads[0],
                            head_stop=p.src_heads[1], offset=p.block_offset,
                            length=p.block_nbytes) for p in pair.pieces]  # per block
        remaining = job.remaining_s(time.perf_counter())
        return PullRequest(transfer_id=self._next_tid(), request_id=job.rec.request_id[:256],
                           hash_scheme=self.group.hash_scheme, block_hashes=job.chained,
                           start=job.local, count=job.count, pieces=pieces, chunk_bytes=chunk,
                           deadline_ms=max(1, int(remaining * 1000)),
                           require_all=job.policy == "strict",
                           read=read and self.reads.can_read(job, pair, rank_kv),
                           chunk_blocks=job.chunk_blocks,
                           model=getattr(self.group, "model_id", ""))

    async def _exchange(self, job: PullJob, conn: TransferConnection, req: PullRequest,
                        xfer_t: float) -> Message:
        from kvkern.xfer.transport import CONTROL_TAG, Lane, TransportError, tag_for  # noqa: PLC0415

        try:
            await conn.send_msg(req, CONTROL_TAG, timeout=xfer_t)
            job.messages += 1
            reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=xfer_t)
            job.messages += 1
        except TransportError as exc:
            if exc.reason in CONNECT_FAILURES:
                await self.discovery.connect_failed(job, exc)
            raise
        return reply

    def _next_tid(self) -> int:
        while True:
            tid = next(self._tids) & ((1 << 30) - 1)
            if tid:
                return tid

    def _send_cancels(self, job: PullJob, reason: Reason) -> None:
        entries, job.open_transfers = job.open_transfers, []
        for conn, tid in entries:
            self._cancel(job, conn, tid, reason)

    def _cancel(self, job: PullJob, conn: TransferConnection, tid: int, reason: Reason) -> None:
        """Tell the source, in the background, that transfer ``tid`` is given up."""
        from kvkern.xfer.messages import Cancel  # noqa: PLC0415
        from kvkern.xfer.transport import CONTROL_TAG  # noqa: PLC0415

        if not conn.alive:
            return  # an aborted connection tells the source by itself
        job.messages += 1

        async def send() -> None:
            with contextlib.suppress(Exception):
                await conn.send_msg(Cancel(transfer_id=tid, reason=reason.value),
                                    CONTROL_TAG, timeout=CANCEL_SEND_TIMEOUT_S)

        self._spawn(send())


async def _all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently (one: inline); their results in order. The first failure
    cancels the others (awaited) and is raised."""
    if len(coros) <= 1:  # no task to spawn and wait for (a loop hop less)
        return [await c for c in coros]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for tk in tasks:
            if tk.done() and not tk.cancelled() and tk.exception() is not None:
                raise tk.exception()
        return [tk.result() for tk in tasks]
    finally:
        for tk in tasks:
            tk.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
