"""One request being served by a source: its bookkeeping (:class:`SendSession`), its checks
(:func:`validate_request`), the per-peer accounting of sends and pins (:class:`PeerLedger`)
and the serving itself (:class:`Sender`: validate, pin, reply, then stream the chunks or hold
the pins for the destination's one-sided reads, release exactly once). The rules are in the
docstring of :mod:`kvkern.xfer.source`."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvkern.kernels.pack import pack
from kvkern.layout.chunks import (
    ChunkSpec,
    consecutive_from,
    count_chunks,
    plan_chunks,
    send_chunks,
)
from kvkern.layout.segments import piece_nbytes, spans_whole_block
from kvkern.xfer import devstream
from kvkern.xfer.codes import RejectCode, reply_text
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import (
    MAX_CHUNKS,
    PlanPiece,
    PullRequest,
    ReadAck,
    ReadGrant,
    Status,
    StreamReply,
)
from kvkern.xfer.source_config import PeerQuotas
from kvkern.xfer.transport import (
    MAX_CONTROL_FRAME_BYTES,
    Connection,
    Lane,
    TransportError,
    tag_for,
)
from kvkern.xfer.tuning import (
    MIN_CHUNK_BYTES,
    PACK_WAIT_S,
    QUOTA_POLL_S,
    QUOTA_WAIT_S,
    STREAM_MIN_RUN_BYTES,
)

if TYPE_CHECKING:
    from kvkern.cache.protocol import PinHandle
    from kvkern.layout.kv_layout import KVLayout
    from kvkern.xfer.regions import RegisteredPool
    from kvkern.xfer.source import SourceService

__all__ = ["PeerLedger", "RankCtx", "Rejected", "SendSession", "Sender", "count_down",
           "keep_hold", "validate_request"]

log = logging.getLogger("kvkern.xfer.source")
# a stream reply's bytes besides its chunk sizes and block hashes (preamble, ids, status,
# its reason text)
REPLY_HEADROOM_BYTES = 16 << 10


@dataclass(frozen=True)
class RankCtx:
    group: KVGroup
    rkv: RankKV

    @property
    def rank(self) -> int:
        return self.rkv.rank


class Rejected(Exception):
    """A well-formed request this source will not serve: a REJECTED reply's text."""

    def __init__(self, code: RejectCode, detail: str) -> None:
        super().__init__(reply_text(code, detail))
        self.code = code


class SendSession:
    """Bookkeeping of one request being served; owned by its task."""

    __slots__ = ("req", "conn", "ctx", "conn_sends", "deadline", "admitted", "handle",
                 "released", "replied", "completed", "cancel_reason", "task", "pack_cf",
                 "started", "staging", "read_done", "hold_until", "read_until", "ack_read")

    def __init__(self, req: PullRequest, conn: Connection, ctx: RankCtx,
                 conn_sends: dict[int, SendSession], deadline: float, admitted: bool) -> None:
        self.req = req
        self.conn = conn
        self.ctx = ctx
        self.conn_sends = conn_sends
        self.deadline = deadline
        self.admitted = admitted
        self.handle: PinHandle | None = None  # the manager's pin on the requested blocks
        self.released = False
        self.replied = False
        self.completed = False
        self.cancel_reason: str | None = None
        self.task: asyncio.Task | None = None
        self.pack_cf: concurrent.futures.Future | None = None
        self.started = time.monotonic()
        self.staging: list[torch.Tensor] = []  # ring slots taken from the StagingPool
        self.read_done: asyncio.Event | None = None  # set by ReadDone (read replies only)
        self.hold_until: float | None = None  # read pins are kept at least until then
        self.read_until: float | None = None  # ... and a ReadDone is waited for until then
        self.ack_read = True  # the destination's ReadDone asked for a ReadAck

    @property
    def peer(self) -> str:
        return self.conn.peer_id or ""


async def keep_hold(s: SendSession) -> None:
    """Sleep until ``s``'s granted read hold ends, unless the destination cancels it: no
    deadline, lost connection, close() or repeated cancellation releases a read's pins
    earlier (bounded by the hold, itself capped by the request's deadline)."""
    while s.cancel_reason is None:
        left = s.hold_until - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            continue


def whole_blocks(rank_kv: RankKV, pieces: Sequence[PlanPiece]) -> bool:
    """The request moves whole blocks: one piece of every local layer and head."""
    return len(pieces) == 1 and spans_whole_block(rank_kv.layout, pieces[0].layers,
                                                      pieces[0].heads)


def direct_rows(rank_kv: RankKV, pieces: Sequence[PlanPiece]) -> torch.Tensor | None:
    """The pool's byte rows when a chunk of consecutive pinned blocks can be sent straight
    from the pool (:meth:`RankKV.stream_rows`, host or device), else None (packed to
    staging)."""
    if len(pieces) != 1:
        return None
    return rank_kv.stream_rows(pieces[0].layers, pieces[0].heads, pieces[0].length)


def validate_request(ctx: RankCtx, req: PullRequest, *, model_id: str, chunk_bytes: int,
                     min_chunk_bytes: int = MIN_CHUNK_BYTES) -> list[PlanPiece]:
    """The request's pieces sorted by offset, or :class:`Rejected` (nothing pinned yet).
    A request for chunks below ``min_chunk_bytes`` (or one block's bytes, where smaller)
    is refused: every chunk costs this side a message and a step of Python."""
    scheme = ctx.group.hash_scheme
    if req.hash_scheme != scheme:
        raise Rejected(RejectCode.HASH_SCHEME_MISMATCH, f"request scheme "
                       f"{req.hash_scheme!r} != source scheme {scheme!r}")
    if req.model != model_id:
        raise Rejected(RejectCode.INCOMPATIBLE_MODEL, f"request model {req.model!r} != "
                       f"source model {model_id!r}")
    layout = ctx.rkv.layout
    if req.count > layout.num_blocks:
        raise Rejected(RejectCode.BAD_REQUEST, f"{req.count} blocks requested, rank "
                       f"{ctx.rank}'s pool holds {layout.num_blocks}")
    wanted = req.requested_hashes
    if len(set(wanted)) != len(wanted):
        raise Rejected(RejectCode.BAD_REQUEST, "a block hash is requested more than once")
    pieces = sorted(req.pieces, key=lambda p: p.offset)
    end = 0
    for p in pieces:
        _check_piece(ctx, layout, p, end)
        end += p.length
    _check_disjoint(ctx, layout, pieces)
    floor = min(min_chunk_bytes, end)  # (end: the bytes of one block's pieces)
    if req.chunk_bytes < floor:
        raise Rejected(RejectCode.TOO_MANY_CHUNKS, f"chunks of at most {req.chunk_bytes} B "
                       f"asked for, this source cuts none below {floor} B")
    limit = min(req.chunk_bytes, chunk_bytes)
    n = count_chunks([p.length for p in pieces], req.count, limit, req.chunk_blocks)
    most = max_reply_chunks(req.count)
    if n > most:
        raise Rejected(RejectCode.TOO_MANY_CHUNKS, f"{req.count} blocks in chunks of <= "
                       f"{limit} B make {n} chunks, a reply lists at most {most}")
    return pieces


def max_reply_chunks(count: int) -> int:
    """The most chunks a stream of ``count`` blocks may have: its reply lists every chunk's
    size and every block's hash (at most 9 bytes each in msgpack) in one control frame."""
    room = (MAX_CONTROL_FRAME_BYTES - REPLY_HEADROOM_BYTES) // 9 - count
    return max(0, min(MAX_CHUNKS, room))


def _check_disjoint(ctx: RankCtx, layout: KVLayout, pieces: list[PlanPiece]) -> None:
    """Pieces cover distinct (layer, head) cells of a block: a piece repeated, or two that
    overlap, would stream a block's bytes more than once."""
    cells = np.zeros((layout.num_layers, layout.num_heads), dtype=bool)
    for p in pieces:
        area = cells[p.layer_start:p.layer_stop, p.head_start:p.head_stop]
        if area.any():
            raise Rejected(RejectCode.BAD_PIECE, f"piece layers [{p.layer_start},"
                           f"{p.layer_stop}) x heads [{p.head_start},{p.head_stop}) overlaps "
                           f"another piece of the request for rank {ctx.rank}")
        area[...] = True


def _check_piece(ctx: RankCtx, layout: KVLayout, p: PlanPiece, end: int) -> None:
    if p.src_rank != ctx.rank:
        raise Rejected(RejectCode.WRONG_RANK, f"piece for source rank {p.src_rank} sent to "
                       f"the listener of rank {ctx.rank}")
    if p.layer_stop > layout.num_layers:
        raise Rejected(RejectCode.BAD_PIECE, f"layers [{p.layer_start},{p.layer_stop}) "
                       f"outside rank {ctx.rank}'s local [0,{layout.num_layers})")
    if p.head_stop > layout.num_heads:
        raise Rejected(RejectCode.BAD_PIECE, f"heads [{p.head_start},{p.head_stop}) outside "
                       f"rank {ctx.rank}'s local [0,{layout.num_heads})")
    want = piece_nbytes(layout, p.layers, p.heads)
    if p.length != want:
        raise Rejected(RejectCode.BAD_PIECE, f"piece length {p.length} != {want} bytes per "
                       f"block for layers [{p.layer_start},{p.layer_stop}) x heads "
                       f"[{p.head_start},{p.head_stop})")
    if p.offset != end:
        raise Rejected(RejectCode.BAD_PIECE, f"piece at per-block offset {p.offset}, "
                       f"expected {end} (pieces must tile the per-block stream from 0)")


def count_down(counts: dict[Any, int], key: Any) -> None:
    """One less of ``key`` in ``counts``; a key that reaches zero goes."""
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class PeerLedger:
    """Connections, admitted sends and pinned blocks, in all and per authenticated peer,
    held to :class:`PeerQuotas` (loop thread only). Pins count per DP group, whose ranks
    share one block manager (block id b is the same request block on every rank), and by
    distinct blocks: the group's ranks pinning their parts of the same blocks (a TP reshard,
    or a destination rank per source rank) hold them once, and distinct blocks asked for
    through different ranks add up."""

    def __init__(self, quotas: PeerQuotas, max_concurrent_sends: int) -> None:
        self.quotas = quotas
        self.max_concurrent_sends = max_concurrent_sends
        self.active = 0  # admitted sends (count toward max_concurrent_sends)
        self.pins = 0  # pin handles held
        self.pinned_blocks = 0  # blocks of every pin handle (a block pinned twice: twice)
        self.peer_sends: dict[str, int] = {}  # authenticated peer -> admitted sends
        self.changes = 0  # pins taken or released so far (a quota verdict's freshness)
        self.connections = 0  # authenticated connections being served
        self.peer_connections: dict[str, int] = {}  # of those, per peer
        # (peer, DP group) / DP group -> pinned block hash -> pin handles holding it
        self.peer_pins: dict[tuple[str, int], collections.Counter[int]] = {}
        self.group_pins: dict[int, collections.Counter[int]] = {}

    def may_connect(self, peer: str) -> bool:
        """Whether ``peer`` may hold one more authenticated connection."""
        return (self.connections < self.quotas.max_connections
                and self.peer_connections.get(peer, 0) < self.quotas.max_connections_per_peer)

    def connected(self, peer: str) -> None:
        self.connections += 1
        self.peer_connections[peer] = self.peer_connections.get(peer, 0) + 1

    def disconnected(self, peer: str) -> None:
        self.connections -= 1
        count_down(self.peer_connections, peer)

    def may_admit(self, peer: str) -> bool:
        return (self.active < self.max_concurrent_sends
                and self.peer_sends.get(peer, 0) < self.quotas.max_sends_per_peer)

    def admitted(self, peer: str) -> None:
        self.active += 1
        self.peer_sends[peer] = self.peer_sends.get(peer, 0) + 1

    def ended(self, peer: str) -> None:
        self.active -= 1
        count_down(self.peer_sends, peer)

    def never_fits(self, wanted: int, pool: int) -> bool:
        """Whether ``wanted`` distinct blocks exceed a quota share of a ``pool``-block pool
        by themselves (no release of other pins would let them in)."""
        q = self.quotas
        return wanted > min(q.peer_pin_fraction, q.total_pin_fraction) * pool

    def pinned(self, peer: str, group: int, hashes: Sequence[int]) -> None:
        self.changes += 1
        self.pins += 1
        self.pinned_blocks += len(hashes)
        self.peer_pins.setdefault((peer, group), collections.Counter()).update(hashes)
        self.group_pins.setdefault(group, collections.Counter()).update(hashes)

    def unpinned(self, peer: str, group: int, hashes: Sequence[int]) -> None:
        self.changes += 1
        self.pins -= 1
        self.pinned_blocks -= len(hashes)
        for table, key in ((self.peer_pins, (peer, group)), (self.group_pins, group)):
            held = table.get(key)
            if held is None:
                continue
            if len(held) == len(hashes) and sum(held.values()) == len(hashes) \
                    and held.keys() == set(hashes):  # held for this pin alone (C loops)
                del table[key]
                continue
            for h in hashes:
                left = held.get(h, 0) - 1
                if left > 0:
                    held[h] = left
                else:
                    held.pop(h, None)
            if not held:
                del table[key]

    def over_pin_quota(self, peer: str, group: int, want: Sequence[int] | AbstractSet[int],
                       pool: int) -> str | None:
        """Why pinning the blocks of hashes ``want`` in DP group ``group``'s ``pool``-block
        pool would exceed a :class:`PeerQuotas` share, or None. Blocks already pinned count
        once."""
        q = self.quotas
        wanted = want if isinstance(want, (set, frozenset)) else set(want)
        mine = self.peer_pins.get((peer, group), {})
        new = len(wanted) - len(mine.keys() & wanted)  # (set operations in C)
        if len(mine) + new > q.peer_pin_fraction * pool:
            return (f"peer quota: {len(mine)} blocks pinned + {new} requested > "
                    f"{q.peer_pin_fraction:g} of the {pool}-block pool")
        held = self.group_pins.get(group, {})
        new = len(wanted) - len(held.keys() & wanted)
        if len(held) + new > q.total_pin_fraction * pool:
            return (f"pin quota: {len(held)} blocks pinned by peers + {new} requested > "
                    f"{q.total_pin_fraction:g} of the {pool}-block pool")
        return None


class Sender:
    """Serves admitted requests for a :class:`~kvkern.xfer.source.SourceService`: the
    service's hooks (``_reply``, ``_producer``, ``_after_reply``, ``_before_chunk``,
    ``_before_read_reply``) are called through it, so a test peer can override them."""

    def __init__(self, svc: SourceService) -> None:
        self.svc = svc

    async def serve(self, s: SendSession, *, duplicate: bool) -> None:
        svc, req = self.svc, s.req
        try:
            if duplicate:
                await svc._reply_status(s, Status.REJECTED, reply_text(
                    RejectCode.DUPLICATE_TRANSFER, f"transfer id {req.transfer_id} is "
                    "already being served on this connection"))
                return
            if not s.admitted:
                await svc._reply_status(s, Status.BUSY, reply_text(
                    RejectCode.BUSY, f"{svc.ledger.active} sends in flight (limit "
                    f"{svc.config.max_concurrent_sends}, "
                    f"{svc.config.quotas.max_sends_per_peer} per peer)"))
                return
            try:
                pieces = validate_request(s.ctx, req, model_id=svc.model_id,
                                          chunk_bytes=svc.config.chunk_bytes,
                                          min_chunk_bytes=svc.config.min_chunk_bytes)
            except Rejected as rej:
                log.info("rejected transfer %d on rank %d: %s", req.transfer_id, s.ctx.rank,
                         rej)
                await svc._reply_status(s, Status.REJECTED, str(rej))
                return
            remaining = s.deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            async with asyncio.timeout(remaining):  # no extra task: one loop hop less
                await self.pin_and_send(s, pieces)
        except asyncio.TimeoutError:
            self.failed(s, "deadline")
        except asyncio.CancelledError:
            if s.cancel_reason is None:
                self.failed(s, "closed")
                raise
            self.failed(s, "cancelled")
        except TransportError as exc:
            self.failed(s, exc.reason)
        except Exception as exc:
            log.exception("serving transfer %d on rank %d failed", req.transfer_id,
                          s.ctx.rank)
            self.failed(s, "internal")
            if not s.replied and s.conn.alive:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await svc._reply_status(s, Status.ERROR, reply_text(
                        RejectCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            await self._end(s)

    async def _end(self, s: SendSession) -> None:
        """Release exactly once, after any packing thread and any granted read hold."""
        pack_future = s.pack_cf
        if pack_future is not None and not pack_future.done():  # the pool is still being read
            with contextlib.suppress(BaseException):
                await asyncio.wait({asyncio.wrap_future(pack_future)}, timeout=PACK_WAIT_S)
        if s.hold_until is not None and not s.completed:
            await keep_hold(s)  # a destination may commit what it reads until then
        self.svc._release(s)
        # Every posted send has completed or its endpoint was aborted (the transport's
        # rule), so UCX holds none of the slots; a pack still running keeps them.
        if (pack_future is None or pack_future.done()) and not self.svc.closing:
            self.svc.staging.give(s.staging)
        s.staging = []

    def failed(self, s: SendSession, reason: str) -> None:
        """A send that will not complete: count it; if a reply promised chunks that will not
        all arrive, abort the connection (see the module docstring)."""
        if s.handle is not None or s.replied:
            self.svc.metrics.source_send_failed(reason)
        if s.replied and not s.completed and s.handle is not None and s.read_done is None:
            s.conn.abort(f"send_{reason}")  # chunks promised: only an abort withdraws them
        log.info("transfer %d on rank %d ended without completing: %s", s.req.transfer_id,
                 s.ctx.rank, reason)

    async def _quota_verdict(self, s: SendSession) -> str | None:
        """Why the request's pins would exceed a quota, or None; over one, waits up to
        QUOTA_WAIT_S for a send of the peer to release its pins, checking again only after
        pins changed (a request can be as long as a pool, and the check is as long as it),
        and not at all when the request alone exceeds the quota."""
        ledger, pool = self.svc.ledger, s.ctx.rkv.layout.num_blocks
        group = s.ctx.group.dp_rank  # (its ranks share the block manager: one quota)
        wanted = set(s.req.requested_hashes)
        busy = ledger.over_pin_quota(s.peer, group, wanted, pool)
        if busy is None or ledger.never_fits(len(wanted), pool):
            return busy
        waited, seen = 0.0, ledger.changes
        while busy is not None and waited < QUOTA_WAIT_S:  # a send of the peer finishing
            await asyncio.sleep(QUOTA_POLL_S)
            waited += QUOTA_POLL_S
            if ledger.changes != seen:
                seen = ledger.changes
                busy = ledger.over_pin_quota(s.peer, group, wanted, pool)
        return busy

    async def _pin(self, s: SendSession) -> PinHandle | None:
        """The pin handle of the requested blocks, or None after a MISS reply."""
        svc, req, ctx = self.svc, s.req, s.ctx
        handle = ctx.group.manager.pin(req.requested_hashes, require_all=req.require_all)
        if handle is not None:
            s.handle = handle
            svc.ledger.pinned(s.peer, ctx.group.dp_rank, handle.hashes)
            svc.metrics.source_pins_changed(len(handle.block_ids))
            return handle
        if req.require_all:  # how many there are, for the destination's log line
            have = ctx.group.manager.longest_prefix(req.requested_hashes)
            detail = f"{have} of {req.count} requested blocks cached (require_all)"
        else:
            detail = f"none of the {req.count} requested blocks is cached"
        await svc._reply_status(s, Status.MISS, reply_text(RejectCode.MISS, detail))
        return None

    async def pin_and_send(self, s: SendSession, pieces: list[PlanPiece]) -> None:
        svc, req, ctx = self.svc, s.req, s.ctx
        busy = await self._quota_verdict(s)
        if busy is not None:
            await svc._reply_status(s, Status.BUSY, reply_text(RejectCode.BUSY, busy))
            return
        handle = await self._pin(s)
        if handle is None:
            return
        block_ids = list(handle.block_ids)
        n = len(block_ids)
        if max(block_ids) >= ctx.rkv.layout.num_blocks:
            raise RuntimeError(f"manager pinned block {max(block_ids)}, rank {ctx.rank}'s pool "
                               f"has {ctx.rkv.layout.num_blocks} blocks")
        registered = svc.regions.get(ctx.rank) if req.read else None
        if registered is not None and (not registered.native or whole_blocks(ctx.rkv, pieces)):
            # the destination reads the pieces it asked for (native segments: whole blocks)
            await self.serve_read(s, registered, pieces, block_ids, handle.hashes)
            return
        limit = min(req.chunk_bytes, svc.config.chunk_bytes)  # what fits a staging slot
        if direct_rows(ctx.rkv, pieces) is None:
            chunks = plan_chunks([p.length for p in pieces], n, limit, req.chunk_blocks)
        else:  # runs of consecutive blocks leave from the pool, up to the request's limit
            unit = pieces[0].length
            chunks = send_chunks(unit, block_ids, limit, req.chunk_bytes, req.chunk_blocks,
                                 -(-STREAM_MIN_RUN_BYTES // unit))
        sizes = [c.nbytes for c in chunks]
        reply = StreamReply(transfer_id=req.transfer_id,
                            status=Status.OK if n == req.count else Status.PARTIAL,
                            served_blocks=n, block_hashes=list(handle.hashes),
                            total_bytes=sum(sizes), n_chunks=len(chunks), chunk_sizes=sizes,
                            reason=_partial(n, req.count))
        await svc._reply(s, reply)
        await svc._after_reply(req, reply)
        produce = svc._producer(s, pieces, block_ids, chunks)
        ring = min(svc.config.chunks_in_flight, len(chunks))
        remaining = max(s.deadline - time.monotonic(), 0.001)
        sent = await s.conn.send_stream(req.transfer_id, produce, len(chunks),
                                        timeout=min(svc.config.progress_timeout_s, remaining),
                                        max_in_flight=ring)
        s.completed = True
        svc.metrics.source_served(n, sent)

    async def serve_read(self, s: SendSession, registered: RegisteredPool, pieces: list[PlanPiece],
                         block_ids: list[int], hashes: Sequence[int]) -> None:
        """Reply with where the pinned blocks are (the whole blocks' segments) and how long
        they stay pinned (``read_hold_ms``); the destination reads the bytes of ``pieces``
        out of them one-sided (``total_bytes``). The pins stay until its ReadDone (answered
        with ReadAck held=True when it asks) or Cancel, and whatever else ends this task
        first, at least until the hold ends (see :func:`keep_hold`)."""
        svc, req, n = self.svc, s.req, len(block_ids)
        segs, regions = registered.segments, registered.regions
        block_nbytes = sum(p.length for p in pieces)  # what the destination will read
        # A device pool's pinned blocks were written by engine kernels enqueued before the
        # pin, and the destination's reads follow no stream order: the offer waits for them
        # (a host pool's fence has always fired).
        ds = devstream.for_device(s.ctx.rkv.device)
        await ds.wait(ds.fence(), max(s.deadline - time.monotonic(), 0.001))
        s.read_done = asyncio.Event()
        # The hold counts from receipt (s.started): the destination counts it from before
        # it sent the request, so its window always ends first.
        hold_s = max(min(svc.read_hold_s, s.deadline - s.started), 0.0)
        reply = ReadGrant(transfer_id=req.transfer_id,
                          status=Status.OK if n == req.count else Status.PARTIAL,
                          served_blocks=n, block_hashes=list(hashes),
                          total_bytes=n * block_nbytes, read_rkey=regions[0].rkey,
                          read_base=segs.bases[0], read_stride=segs.stride,
                          read_blocks=block_ids, read_hold_ms=int(hold_s * 1000),
                          read_segment_bytes=segs.nbytes,
                          read_more_rkeys=[r.rkey for r in regions[1:]],
                          read_more_bases=list(segs.bases[1:]),
                          read_native=registered.native, reason=_partial(n, req.count))
        await svc._before_read_reply(req.transfer_id)
        s.hold_until = s.started + hold_s  # from here on the destination may be reading
        await svc._reply(s, reply)
        await svc._after_reply(req, reply)
        # The pins last as long as the reply says and no longer; a source that grants no
        # hold (read_hold_s=0) keeps them until ReadDone within the request's deadline.
        until = s.read_until = s.hold_until if hold_s > 0 else s.deadline
        try:
            await asyncio.wait_for(s.read_done.wait(), max(until - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            log.info("read hold of transfer %d on rank %d ended without ReadDone "
                     "(%.0f ms granted); releasing its pins", req.transfer_id, s.ctx.rank,
                     hold_s * 1000)
            svc.metrics.source_send_failed("hold_expired")
            return
        await svc._before_chunk(req.transfer_id, 0)
        if s.ack_read:
            remaining = max(s.deadline - time.monotonic(), 0.001)
            await s.conn.send_msg(ReadAck(transfer_id=req.transfer_id, held=True),
                                  tag_for(req.transfer_id, Lane.REPLY, 1), timeout=remaining)
        s.completed = True
        svc.metrics.source_served(n, n * block_nbytes)

    def producer(self, s: SendSession, pieces: list[PlanPiece], block_ids: list[int],
                 chunks: list[ChunkSpec]):
        """``produce(i)`` for send_stream: packs chunk ``i`` into ring slot ``i % ring``.

        Slot ``k`` is packed again (chunk ``i + ring``) only after both that slot's send of
        chunk ``i`` completed (send_stream calls ``produce(i + ring)`` no earlier) and the
        event of chunk ``i``'s pack fired (waited before chunk ``i`` was handed over)."""
        svc = self.svc
        rank_kv = s.ctx.rkv
        layout = rank_kv.layout
        device = rank_kv.device
        ring = min(svc.config.chunks_in_flight, len(chunks))
        rows = direct_rows(rank_kv, pieces)

        def from_pool(c: ChunkSpec) -> int | None:
            """The first pool block of a chunk sent straight from the pool (its pinned
            blocks are consecutive: no pack, no staging), else None."""
            return None if rows is None else consecutive_from(block_ids, c.b0, c.b1)

        # one size class for every send, so the prewarmed slots serve small pulls too
        slot_bytes = max(max((c.nbytes for c in chunks if from_pool(c) is None), default=0),
                         svc.config.chunk_bytes)
        slots: list[torch.Tensor | None] = [None] * ring  # taken from the pool on first use
        big: dict[str, Any] = {"key": None, "buf": None}  # one oversized block, sliced
        loop = asyncio.get_running_loop()
        tid = s.req.transfer_id
        ds = devstream.for_device(device)
        # The pinned blocks were written by engine kernels enqueued before the pin: every
        # pack of this send starts after them (kvkern.xfer.devstream), and UCX, which
        # follows no stream, reads them in place only once they have run.
        fence = ds.fence()
        fenced = [False]

        def pack_slab(p: PlanPiece, b0: int, b1: int, out: torch.Tensor | None) -> torch.Tensor:
            """Runs on a packing thread: launches the pack on the device's side stream and
            waits for exactly its event, since UCX reads the staging as soon as the send is
            posted (no stream or device synchronisation)."""
            t0 = time.perf_counter()
            shape = (b1 - b0, p.layer_stop - p.layer_start, 2, p.head_stop - p.head_start,
                     layout.block_size, layout.head_dim)
            view = None if out is None else out.view(layout.dtype).view(shape)
            try:
                staged, ready = ds.run(functools.partial(
                    pack, rank_kv.pool, layout, block_ids[b0:b1], out=view,
                    layers=(p.layer_start, p.layer_stop), heads=(p.head_start, p.head_stop),
                    max_programs=ds.max_programs), after=fence)
            except BaseException as exc:  # (a pack it launched ends before the slot is free)
                if (started := devstream.launched(exc)) is not None:
                    ds.synchronize(started)
                raise
            ds.synchronize(ready)
            flat = staged.reshape(-1).view(torch.uint8)
            svc.metrics.source_packed(flat.numel(), time.perf_counter() - t0)
            return flat

        async def run(fn, *args):
            if svc.executor is None:
                raise TransportError("closed", "source service closed")
            s.pack_cf = svc.executor.submit(fn, *args)
            return await asyncio.wrap_future(s.pack_cf, loop=loop)

        async def produce(i: int) -> torch.Tensor:
            await svc._before_chunk(tid, i)
            c = chunks[i]
            p = pieces[c.piece]
            first = from_pool(c)
            if first is not None:  # zero-copy: the pinned blocks are the chunk
                if not fenced[0]:  # (off the loop's thread; a host pool's fence has fired)
                    await ds.wait(fence, max(s.deadline - time.monotonic(), 0.001))
                    fenced[0] = True
                return rows[first:first + c.b1 - c.b0].reshape(-1)[c.lo:c.hi]
            if c.lo == 0 and c.hi == (c.b1 - c.b0) * p.length:
                k = i % ring
                if slots[k] is None:
                    slots[k] = svc.staging.take(device, slot_bytes)
                    s.staging.append(slots[k])
                return await run(pack_slab, p, c.b0, c.b1, slots[k][:c.nbytes])
            key = (c.piece, c.b0)
            if big["key"] != key:  # a new oversized block: pack it whole into a fresh buffer
                big["buf"] = await run(pack_slab, p, c.b0, c.b1, None)
                big["key"] = key
            return big["buf"][c.lo:c.hi]

        return produce


def _partial(n: int, count: int) -> str:
    return "" if n == count else reply_text(RejectCode.PARTIAL,
                                            f"{n} of {count} requested blocks cached")
