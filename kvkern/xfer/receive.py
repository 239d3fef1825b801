"""The byte-moving roles of the destination side, one per way a pair's blocks arrive.

* :class:`StreamReceiver`: the source streams chunks of the canonical staging format; each
  lands in a ring of staging buffers (or, whole blocks of a row pool, straight in the
  receive blocks) and is unpacked into the private blocks as it lands.
* :class:`ReadReceiver`: the source offers its pinned blocks for one-sided reads; the pair's
  runs are read straight into the private blocks, on read lanes
  (:mod:`kvkern.xfer.read_lanes`; the connection itself only for a transport that reads,
  such as :mod:`kvkern.xfer.memtransport`), then confirmed inside the source's read hold or
  by ``ReadDone``/``ReadAck``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvkern.layout.chunks import consecutive_from
from kvkern.layout.segments import (
    segment_gathers_to,
    source_segment_bytes,
    whole_block_pair,
)
from kvkern.xfer import local_reads
from kvkern.xfer.config import XferConfig
from kvkern.xfer.kvgroup import RankKV
from kvkern.xfer.messages import READ_CAPABILITY, ReadGrant, StreamReply
from kvkern.xfer.outcome import Reason
from kvkern.xfer.pulljob import Fallback, PullJob
from kvkern.xfer.runtime import through_cancels
from kvkern.xfer.seam import OneSidedReader, TransferConnection
from kvkern.xfer.tuning import (
    HOLD_MARGIN_S,
    HOLD_RATE_SLACK,
    LANE_RETRY_S,
    MIN_CHUNK_BYTES,
    SCATTER_MAX_BYTES,
    SCATTER_MAX_PIECES,
)

if TYPE_CHECKING:
    import concurrent.futures

    import torch

    from kvkern.layout.kv_layout import KVLayout
    from kvkern.layout.plan import PeerTransfer, Piece
    from kvkern.layout.segments import BlockSegments
    from kvkern.layout.topology import Topology
    from kvkern.xfer.devstream import Ready
    from kvkern.xfer.local_reads import LocalSource
    from kvkern.xfer.read_lanes import ReadLanes
    from kvkern.xfer.staging import StagingPool
    from kvkern.xfer.state import SourceState

__all__ = ["LANE_RETRY_S", "ReadReceiver", "StreamReceiver", "StreamUnpacker", "source_layout"]

log = logging.getLogger("kvkern.xfer")


@functools.lru_cache(maxsize=256)
def source_layout(topology: Topology, rank: int) -> KVLayout:
    """A source rank's local layout (sizes only), from its state's topology: once per
    (topology, rank), not per pull."""
    return topology.local_layout(rank, 1)


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ------------------------------------------------------------------------------ stream


class StreamUnpacker:
    """Feeds one pair's byte stream, chunk by chunk in order, into the private blocks.

    The stream is, for each piece of the pair in order, the canonical staging
    ``[n, L, 2, H, T, D]`` of the ``n`` served blocks; whole blocks inside a chunk are
    unpacked straight from the ring buffer, a block split across chunks through a one-block
    carry buffer."""

    def __init__(self, pair: PeerTransfer, rank_kv: RankKV, block_ids: Sequence[int], n: int, *,
                 max_programs: int | None = None) -> None:
        self.rank_kv = rank_kv
        self.layout = rank_kv.layout
        self.block_ids = list(block_ids)
        self.n = n
        self.segments: list[tuple[int, int, Piece]] = []  # (start, stop, piece)
        for p in pair.pieces:
            o = p.byte_offset(n)
            self.segments.append((o, o + p.byte_length(n), p))
        self.segments.sort(key=lambda s: s[0])
        self.total = pair.nbytes(n)
        self.pos = 0
        self.width = max((p.block_nbytes for p in pair.pieces), default=1)
        # made by the first split block, on the stream feed runs on
        self.carry: torch.Tensor | None = None
        self.max_programs = max_programs

    def _unpack(self, flat: torch.Tensor, piece: Piece, b0: int, k: int) -> None:
        from kvkern.kernels.pack import unpack  # noqa: PLC0415

        lay = self.layout
        shape = piece.staging_shape(k, lay.block_size, lay.head_dim)
        unpack(flat.view(lay.dtype).view(shape), self.rank_kv.pool, lay, self.block_ids[b0:b0 + k],
               layers=piece.dst_layers, heads=piece.dst_heads, max_programs=self.max_programs)

    def feed(self, chunk: torch.Tensor) -> None:
        """Unpack ``chunk``, the next bytes of the stream. On a device pool every copy is
        a launch on the current stream (the caller's side stream), the carry's included."""
        import torch  # noqa: PLC0415

        length = int(chunk.numel())
        if self.pos + length > self.total:
            raise ValueError(f"stream overrun: {self.pos} + {length} > {self.total} bytes")
        off = 0
        while off < length:
            seg = next((s for s in self.segments if s[0] <= self.pos < s[1]), None)
            if seg is None:
                raise ValueError(f"stream byte {self.pos} lies in no plan piece")
            start, stop, piece = seg
            bn = piece.block_nbytes
            rel = self.pos - start
            b, within = divmod(rel, bn)
            avail = min(length - off, stop - self.pos)
            if within or avail < bn:
                if self.carry is None:
                    self.carry = torch.empty(self.width, dtype=torch.uint8,
                                             device=self.rank_kv.device)
                take = min(bn - within, avail)
                self.carry[within:within + take].copy_(chunk[off:off + take])
                off += take
                self.pos += take
                if within + take == bn:
                    self._unpack(self.carry[:bn], piece, b, 1)
                continue
            k = avail // bn
            self._unpack(chunk[off:off + k * bn], piece, b, k)
            off += k * bn
            self.pos += k * bn

    def skip(self, nbytes: int) -> None:
        """Bytes that landed in the blocks directly (zero-copy chunk): just advance."""
        self.pos += nbytes

    @property
    def complete(self) -> bool:
        return self.pos == self.total


class StreamReceiver:
    """Receives a pair's stream into the private blocks through a ring of staging buffers
    taken from ``staging`` (a :class:`kvkern.xfer.staging.StagingPool`, loop thread only).

    On a device pool (:mod:`kvkern.xfer.devstream`) each chunk's unpack is launched on the
    device's side stream, after a fence on the engine's compute stream (kernels may still
    read the private blocks' previous contents), and records an event:

    * a ring slot receives its next chunk only after the event of the unpack that read it
      fired (awaited off the loop thread before ``on_chunk`` returns);
    * the ring goes back to the staging pool with the last event, so no later pull reuses a
      slot an unpack may still read;
    * chunks landing straight in the blocks (zero-copy) wait for the fence on the host first,
      since UCX writes them outside any stream's order;
    * at the pair's completion, before :meth:`receive` returns (so before the runner
      validates and commits the blocks and the engine may schedule the prefill), the
      compute stream is made to wait for the last unpack's event (``publish``): the host
      does not wait for it, the engine's next kernels do.
    """

    def __init__(self, config: XferConfig, staging: StagingPool) -> None:
        self.config = config
        self.staging = staging

    async def receive(self, job: PullJob, pair: PeerTransfer, rank_kv: RankKV,
                      conn: TransferConnection, reply: StreamReply, chunk: int, xfer_t: float,
                      entry: tuple, *, in_place: int = 0) -> None:
        """Receive and unpack every chunk ``reply`` announced; :class:`Fallback` if the
        stream is not exactly the served blocks' bytes. A chunk received into a staging
        slot holds at most ``chunk`` bytes, one landing in place in the blocks at most
        ``in_place`` (the request's ``chunk_bytes``)."""
        from kvkern.xfer import devstream  # noqa: PLC0415

        served, unit, cfg = reply.served_blocks, pair.block_nbytes, self.config
        nbytes = pair.nbytes(served)
        sizes = reply.chunk_sizes
        starts = list(itertools.accumulate(sizes, initial=0))
        ids = list(job.private[:served])
        # block rows a stream's chunks land in as they are (one piece of whole blocks)
        pieces = pair.pieces
        direct = (rank_kv.stream_rows(pieces[0].dst_layers, pieces[0].dst_heads,
                                      pieces[0].block_nbytes) if len(pieces) == 1 else None)
        limit = max(in_place, chunk)
        most = max_chunks(pair, served, chunk)
        if reply.n_chunks > most:
            raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} announces "
                           f"{reply.n_chunks} chunks for {served} blocks, more than the "
                           f"{most} of a stream cut no finer than "
                           f"{min(chunk, MIN_CHUNK_BYTES)} B")
        sized = reply.total_bytes == nbytes and all(s > 0 for s in sizes)
        # the chunks that land in the blocks as they are (zero-copy), by their first block
        landed_direct = {} if direct is None or not sized else _in_place(starts, unit, ids)
        if not sized or any(s > (limit if i in landed_direct else chunk)
                            for i, s in enumerate(sizes)):
            raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} announces "
                           f"{reply.total_bytes} B in chunks {sizes[:4]}..., expected "
                           f"{nbytes} B in chunks <= {chunk} B (<= {limit} B landing in "
                           "place)")
        ring_n = max(1, min(cfg.chunks_in_flight, reply.n_chunks))
        ring: list[torch.Tensor | None] = [None] * ring_n  # staging slots, taken on first use
        ds = devstream.for_device(rank_kv.device)
        unpacker = StreamUnpacker(pair, rank_kv, ids, served, max_programs=ds.max_programs)
        fence = ds.fence()
        if direct is not None:
            await ds.wait(fence, xfer_t)
        last: list[Ready | None] = [None]  # the event after the latest unpack launched

        def buffer_for(i: int) -> torch.Tensor:
            first = landed_direct.get(i)
            if first is not None:  # zero-copy: the chunk lands in the blocks
                return direct[first:first + (starts[i + 1] - starts[i]) // unit].reshape(-1)
            slot = i % ring_n
            if ring[slot] is None:
                ring[slot] = self.staging.take(rank_kv.device, max(chunk, cfg.chunk_bytes))
            return ring[slot][:sizes[i]]

        async def on_chunk(i: int, buf: torch.Tensor) -> None:
            if job.t_first_byte is None:
                job.t_first_byte = time.perf_counter()
            n = int(buf.numel())
            if i in landed_direct:
                unpacker.skip(n)
            else:
                t = time.perf_counter()
                try:
                    _, ready = ds.run(functools.partial(unpacker.feed, buf), after=fence)
                except BaseException as exc:  # (unpacks it launched: waited for below)
                    last[0] = devstream.launched(exc) or last[0]
                    raise
                last[0] = ready
                job.unpack_s += time.perf_counter() - t
                if i + ring_n < reply.n_chunks:  # recv_stream reuses this slot next
                    await ds.wait(ready, xfer_t)
            job.messages += 1
            job.bytes += n

        try:
            await conn.recv_stream(reply.transfer_id, buffer_for, reply.n_chunks,
                                   on_chunk=on_chunk, timeout=xfer_t, max_in_flight=ring_n)
        except ValueError as exc:
            raise Fallback(Reason.TRANSFER_FAILED, f"stream from source rank "
                           f"{pair.src_rank}: {exc}") from None
        finally:
            # recv_stream returns only with every posted receive completed, and raises
            # only after aborting the connection, so UCX holds none of the slots now; an
            # unpack may still read them until its event fires.
            self.staging.give((b for b in ring if b is not None), ready=last[0])
            if last[0] is not None:
                # The engine's next kernels (the prefill; after a failure, whatever reuses
                # the freed private blocks) run after every unpack of this pair.
                ds.publish(last[0])
                # Nor does the pull end before they are done: the engine may read its own
                # blocks on a stream of its own, which publish does not order, and committed
                # blocks enter the read directory, whose readers follow no stream at all.
                if not last[0].query():
                    waited = asyncio.ensure_future(ds.wait(last[0], xfer_t))
                    if await through_cancels(waited):
                        raise asyncio.CancelledError
                    waited.result()
        job.open_transfers.remove(entry)
        if not unpacker.complete:
            raise Fallback(Reason.TRANSFER_FAILED, f"stream from source rank "
                           f"{pair.src_rank} ended at byte {unpacker.pos} of {nbytes}")


def max_chunks(pair: PeerTransfer, served: int, chunk: int) -> int:
    """The most chunks a source may cut a stream of ``served`` blocks of ``pair`` into, asked
    for chunks of ``chunk`` bytes: one per block and piece, or a block's piece in slices of
    ``min(chunk, MIN_CHUNK_BYTES)`` where it is larger (sources cut no finer). Every chunk
    costs a receive and a step of Python here, so a source announcing more is refused
    before any receive is posted."""
    floor = max(1, min(chunk, MIN_CHUNK_BYTES))
    return served * sum(-(-p.block_nbytes // floor) for p in pair.pieces)


def _in_place(starts: Sequence[int], unit: int, ids: Sequence[int]) -> dict[int, int]:
    """chunk index -> first receive block, of the chunks (their byte ``starts`` in the
    stream, and its end) that are whole blocks of consecutive receive ``ids``."""
    out: dict[int, int] = {}
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        if lo % unit or hi % unit:
            continue
        first = consecutive_from(ids, lo // unit, hi // unit)
        if first is not None:
            out[i] = first
    return out


# -------------------------------------------------------------------------------- reads


class ReadReceiver:
    """Reads a pair's runs one-sided out of the source's pinned blocks; owns the read lanes
    (made and opened with the puller where it may read, :meth:`open_lanes`; else on first
    use) and which source workers' lanes failed lately."""

    def __init__(self, config: XferConfig, *, closed: Callable[[], bool],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.config = config
        self._closed = closed
        self._spawn = spawn
        self.lanes: ReadLanes | None = None  # made by open_lanes or the first lane read
        # directory buffers of direct reads (kvkern.xfer.direct) kept for the next one: each
        # lane set's first thread's (thread_scratch; the sets run scripts at once), and the
        # event loop's (the loop lane, one script at a time)
        self._thread_scratch = threading.local()
        self.loop_scratch: dict[tuple, np.ndarray] = {}
        # written by reads that outlived their abort, not tracked (kvkern.xfer.quarantine)
        self.stuck_buffers: list[np.ndarray] = []
        self._lanes_down: dict[bytes, float] = {}  # source worker -> when its lanes failed

    def thread_scratch(self) -> dict[tuple, np.ndarray]:
        """The direct reads' kept directory buffers of this thread (a lane set's first)."""
        scratch = getattr(self._thread_scratch, "buffers", None)
        if scratch is None:
            scratch = self._thread_scratch.buffers = {}
        return scratch

    def can_read(self, job: PullJob, pair: PeerTransfer, rank_kv: RankKV) -> bool:
        """Ask for a one-sided read: :meth:`read_allowed`, and its reads are not too small
        (:meth:`reads_big_enough`). Else the stream."""
        return (self.read_allowed(job, pair, rank_kv)
                and self.reads_big_enough(job, [(pair, rank_kv)]))

    def read_allowed(self, job: PullJob, pair: PeerTransfer, rank_kv: RankKV) -> bool:
        """Reads allowed here, into host memory, and the source rank's pool is registered
        (its state says how). Canonical segments on both sides (TRT-LLM rows, per-layer
        HND): any plan pieces (a TP or PP reshard reads head and layer ranges). A source pool
        readable only in its own order (e.g. vLLM NHD): a destination pool of the same
        layout, whole blocks. Into the engine's own blocks (``job.into``) only on read lanes,
        which end such a read only once every read it posted has (:mod:`kvkern.xfer.read_lanes`)."""
        state = job.state
        if not (self.config.remote_read and state is not None
                and READ_CAPABILITY in state.capabilities and rank_kv.device.type == "cpu"):
            return False
        key = (job.source_dp, pair.src_rank)
        if not self.reads_somewhere(state, key, into=job.into is not None):
            return False
        if key in state.read_locals and self.local_source(state, key) is None \
                and not self.near_reads(state, key):
            return False  # a source on this host that may be read neither way: the stream
        kind = state.reads.get(key)
        if kind == "canonical":
            return rank_kv.read_segments is not None
        return (kind == "native" and rank_kv.native_segments is not None
                and state.layouts.get(key) == rank_kv.layout_signature
                and whole_block_pair(pair.pieces, rank_kv.layout,
                                     rank_kv.layout))  # same dims

    def reads_somewhere(self, state: SourceState, key: tuple[int, int], *, into: bool) -> bool:
        """Source rank ``key`` can be read: on the read lanes, or, where its state names no
        worker for them, on the connection (a transport that reads itself, the in-process
        one; a UCX connection's worker has no RMA: :data:`ucxcompat.APP_FEATURES`). Into
        the engine's blocks only on lanes, which end a read only once every read it posted
        has."""
        worker = state.read_workers.get(key)
        if self.lanes_for(worker) is not None:
            return True
        return worker is None and not into

    def reads_big_enough(self, job: PullJob,
                         members: Sequence[tuple[PeerTransfer, RankKV]]) -> bool:
        """The pairs of one source rank (read together, :meth:`source_runs`) move whole
        blocks, or every read moves at least ``read_min_run_bytes`` (``local_read_min_run_bytes``
        from a source read with same-host calls, :mod:`kvkern.xfer.local_reads`)."""
        src_rank = members[0][0].src_rank
        if job.state.reads.get((job.source_dp, src_rank)) != "canonical":
            return True  # whole blocks in the source's order (read_allowed)
        src = source_layout(job.state.topology, src_rank)
        if all(whole_block_pair(pair.pieces, src, rank_kv.layout) for pair, rank_kv in members):
            return True
        gathers = segment_gathers_to(tuple(
            (pair.pieces, rank_kv.layout, rank_kv.read_segments.nbytes)
            for pair, rank_kv in members), src, source_segment_bytes(src))
        least = min(g[2] for g in gathers)
        if least >= self.config.read_min_run_bytes:
            return True
        if least < self.config.local_read_min_run_bytes:
            return False
        return self.reads_locally(job, (job.source_dp, src_rank))

    def reads_locally(self, job: PullJob, key: tuple[int, int]) -> bool:
        """Source rank ``key`` is a process on this host that this puller reads with its own
        calls (:mod:`kvkern.xfer.local_reads`, on the read lanes only)."""
        local = self.local_source(job.state, key)
        return (local is not None and self.lanes_for(job.state.read_workers.get(key)) is not None
                and local_reads.usable(local))

    async def receive(self, job: PullJob, pair: PeerTransfer, conn: TransferConnection,
                      reply: ReadGrant, rank_kv: RankKV, xfer_t: float, t_req: float) -> None:
        """Read the pair's pieces of the served blocks straight from the source's pool into
        the private blocks of ``rank_kv``. They count when every read completed inside the
        source's granted hold, measured from ``t_req`` (before the request was sent; the
        source counts from its receipt, so our window closes first); else only
        ``ReadAck(held=True)`` after our ReadDone makes them count. See
        :mod:`kvkern.xfer.ucp_rma`."""
        segs = self.check_offer(job, pair, reply, rank_kv)
        parts = self.grant_runs(job, pair, reply, rank_kv, segs)
        t = time.perf_counter()
        key = (job.source_dp, pair.src_rank)
        keys = [reply.read_rkey, *reply.read_more_rkeys]
        keyed = [(keys[j], runs) for j, runs in parts.items()]
        first = await self._copy(job, key, conn, job.state.read_workers.get(key), keyed, xfer_t,
                                 self.local_source(job.state, key))
        if job.t_first_byte is None:
            job.t_first_byte = first or time.perf_counter()
        job.reads += sum(len(runs) for runs in parts.values())
        job.bytes += reply.served_blocks * pair.block_nbytes
        t_ack = time.perf_counter()
        job.phases["read"] = job.phases.get("read", 0.0) + (t_ack - t)
        await self._confirm(job, pair, conn, reply, xfer_t, t_req, t_ack)

    def check_offer(self, job: PullJob, pair: PeerTransfer, reply: ReadGrant,
                     rank_kv: RankKV) -> BlockSegments:
        """The destination segments the offer's reads land in; Fallback when the offer is
        not what this pair's state and plan promise."""
        key = (job.source_dp, pair.src_rank)
        state = job.state
        if reply.read_native != (state.reads.get(key) == "native") or (
                reply.read_native and state.layouts.get(key) != rank_kv.layout_signature):
            raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} offers "
                           f"its blocks {'in its own order' if reply.read_native else 'canonical'}"
                           f", its state says {state.reads.get(key)!r} (layout "
                           f"{state.layouts.get(key)})")
        idx = state.read_indexes.get(key)
        if idx is not None and (
                (reply.read_rkey, *reply.read_more_rkeys) != idx.keys
                or (reply.read_base, *reply.read_more_bases) != idx.bases
                or reply.read_stride != idx.stride
                or reply.read_segment_bytes != idx.segment_bytes
                or max(reply.read_blocks, default=0) >= idx.blocks):
            # (its registered pool is the one its state announces: a grant naming other
            # keys or addresses is refused before UCX unpacks a key)
            raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} offers a "
                           "read outside the registered pool its state announces")
        segs = rank_kv.native_segments if reply.read_native else rank_kv.read_segments
        served, unit = reply.served_blocks, pair.block_nbytes
        n_keys = 1 + len(reply.read_more_rkeys)
        bases = [reply.read_base, *reply.read_more_bases]
        src_lay = source_layout(state.topology, pair.src_rank)
        seg, stride = reply.read_segment_bytes or unit, reply.read_stride
        top = max(reply.read_blocks) * stride + seg
        # (canonical segments are a block's whole canonical bytes, or one per layer: more
        # keys would only multiply the reads this offer makes the destination plan and post)
        if reply.total_bytes != served * unit or seg * n_keys != src_lay.bytes_per_block \
                or stride < seg or max(bases) + top > 1 << 64 or segs is None or (
                    not reply.read_native and n_keys not in (1, src_lay.num_layers)) or (
                    reply.read_native and not (n_keys == len(segs.bases)
                                               and seg == segs.nbytes
                                               and whole_block_pair(pair.pieces, src_lay,
                                                                    rank_kv.layout))):
            raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} offers "
                           f"{reply.total_bytes} B of {served} blocks as {n_keys} "
                           f"segments of {seg} B at stride {stride}, expected "
                           f"{src_lay.bytes_per_block} B blocks ({unit} B of each read)")
        return segs

    @staticmethod
    def grant_runs(job: PullJob, pair: PeerTransfer, reply: ReadGrant, rank_kv: RankKV,
                   segs: BlockSegments) -> dict[int, list]:
        """Per source segment (remote key index), the reads that move the pair's pieces of
        every served block: coalesced ``(local, remote, nbytes)`` runs, and a
        :class:`~kvkern.xfer.ucp_rma.Scatter` where source bytes that are contiguous land
        in several places of a destination block (a reshard's interleaved heads)."""
        return ReadReceiver.source_runs(job, reply, [(pair, rank_kv, segs)])

    @staticmethod
    def source_runs(job: PullJob, reply: ReadGrant,
                    members: Sequence[tuple[PeerTransfer, RankKV, BlockSegments]],
                    ) -> dict[int, list]:
        """:meth:`grant_runs` of the pairs of one source rank into destination ranks of
        this group (``(pair, rank kv, its segments)`` each, the private block ids shared):
        where their pieces of a source block are contiguous (the ranks of a narrower
        destination), one read scattered over all of them."""
        from kvkern.xfer.ucp_rma import coalesce_arrays, scatter_arrays  # noqa: PLC0415

        served = reply.served_blocks
        n_keys = 1 + len(reply.read_more_rkeys)
        bases = [reply.read_base, *reply.read_more_bases]
        seg = reply.read_segment_bytes or members[0][0].block_nbytes
        ids = np.asarray(job.private[:served], dtype=np.uint64)
        heres = [ids * np.uint64(segs.stride) for _, _, segs in members]
        there = np.asarray(reply.read_blocks, dtype=np.uint64) * np.uint64(reply.read_stride)
        parts: dict[int, list] = {}
        if reply.read_native:  # same layout, whole blocks: segment j into segment j
            if len(members) != 1:
                raise ValueError("a read in the source's own order has one destination")
            gathers: tuple = tuple((j, 0, seg, ((0, j, 0, seg),)) for j in range(n_keys))
        else:
            src_lay = source_layout(job.state.topology, members[0][0].src_rank)
            gathers = segment_gathers_to(tuple(
                (pair.pieces, rank_kv.layout, segs.nbytes) for pair, rank_kv, segs in members),
                src_lay, seg)
        for j, s_off, _, pieces in gathers:
            remote = there + np.uint64(bases[j] + s_off)
            local = [heres[k] + np.uint64(members[k][2].bases[d] + d_off)
                     for k, d, d_off, _ in pieces]
            if len(pieces) == 1:
                parts.setdefault(j, []).extend(coalesce_arrays(local[0], remote,
                                                               pieces[0][3]))
                continue
            parts.setdefault(j, []).extend(scatter_arrays(
                np.stack(local, axis=1), remote, [n for *_, n in pieces],
                max_pieces=SCATTER_MAX_PIECES, max_bytes=SCATTER_MAX_BYTES))
        return parts

    async def _copy(self, job: PullJob, key: tuple[int, int], conn: TransferConnection,
                    worker: bytes | None,
                    keyed: list[tuple[bytes, list]], xfer_t: float,
                    local: LocalSource | None = None) -> float | None:
        """Run the reads, on the lanes when there are, else on a connection that reads
        (:meth:`reads_somewhere`); returns when the first byte landed (if known)."""
        from kvkern.xfer.transport import ReadsStuck, TransportError  # noqa: PLC0415
        from kvkern.xfer.ucp_rma import scatter_check_failed  # noqa: PLC0415

        lanes = self.lanes_for(worker)
        into = job.into is not None
        try:
            if lanes is not None:
                try:
                    return await lanes.read(worker, keyed, timeout=xfer_t, local=local,
                                            owned=into,
                                            same_host=self.near_reads(job.state, key))
                except TransportError as exc:
                    # The lanes failed, not the copy's time: leave this source's lanes
                    # alone for a while (not for a failed scattered-read check: see
                    # ReadBatch.wait); the pull fails, and the next ones stream while the
                    # lanes rest.
                    if exc.reason == "transfer_failed" and not isinstance(exc, ReadsStuck) \
                            and not scatter_check_failed(exc):
                        self.lanes_failed(worker, exc)
                    raise
            if into or worker is not None or not isinstance(conn, OneSidedReader):
                raise TransportError("transfer_failed", "no read lanes for this read "
                                     "(see read_allowed)")
            return await conn.read_parts(keyed, timeout=xfer_t)
        except ReadsStuck as exc:
            job.outlived(exc)
            raise

    async def _confirm(self, job: PullJob, pair: PeerTransfer, conn: TransferConnection,
                       reply: ReadGrant, xfer_t: float, t_req: float, t_ack: float) -> None:
        """Reads inside the granted hold count now (the release goes in the background);
        later ones count on ``ReadAck(held=True)``."""
        from kvkern.xfer.messages import ReadAck, ReadDone  # noqa: PLC0415
        from kvkern.xfer.transport import CONTROL_TAG, Lane, tag_for  # noqa: PLC0415

        tid = reply.transfer_id
        hold_s = reply.read_hold_ms / 1000
        if hold_s and t_ack < t_req + hold_s * (1 - HOLD_RATE_SLACK) - HOLD_MARGIN_S:
            # Read inside the hold: the bytes are the pinned blocks'. Release them in the
            # background, asking for no ack.
            self._spawn(self._release_read(conn, tid, xfer_t))
            job.messages += 1
            return
        await conn.send_msg(ReadDone(transfer_id=tid), CONTROL_TAG, timeout=xfer_t)
        ack = await conn.recv_msg(tag_for(tid, Lane.REPLY, 1), timeout=xfer_t)
        job.messages += 2
        job.phases["ack"] = job.phases.get("ack", 0.0) + (time.perf_counter() - t_ack)
        if not isinstance(ack, ReadAck) or ack.transfer_id != tid or not ack.held:
            raise Fallback(Reason.TRANSFER_FAILED, f"source rank {pair.src_rank} did not "
                           f"confirm it held the blocks during the read: "
                           f"{getattr(ack, 'reason', type(ack).__name__)}")

    def near_reads(self, state: SourceState, key: tuple[int, int]) -> bool:
        """Whether the lanes may read rank ``key`` through UCX's transports that take any
        address of a process on this host (:data:`~kvkern.xfer.read_lanes.NEAR_TRANSPORTS`):
        only where this puller is told to (``XferConfig.ucx_same_host_reads``, with
        ``local_reads`` off) and the process that served the state announced that rank
        itself. Its worker address is still the state's word, which a member could point at
        another process of this host, so by default no rank is read through such a
        transport: same-host ranks are read with kvkern's own calls on the process whose
        pid was checked (``local_reads``), or streamed."""
        return (self.config.ucx_same_host_reads and not self.config.local_reads
                and key in state.read_locals)

    def local_source(self, state: SourceState, key: tuple[int, int]) -> LocalSource | None:
        """The source process of rank ``key`` where it runs on this host and this puller
        reads such sources directly (``XferConfig.local_reads``), else None."""
        return state.read_locals.get(key) if self.config.local_reads else None

    def lanes_for(self, worker: bytes | None) -> ReadLanes | None:
        """The read lanes (made here if :meth:`open_lanes` did not); None where there are
        none for ``worker`` (no lanes configured, lanes resting after a failure, or no worker
        address this UCX can use): then :meth:`reads_somewhere` says whether to read at
        all."""
        from kvkern.xfer.read_lanes import address_usable  # noqa: PLC0415

        if worker is None or not self.config.read_lanes or self._closed() \
                or not address_usable(worker):
            return None
        failed = self._lanes_down.get(worker)
        if failed is not None:
            if time.monotonic() - failed < LANE_RETRY_S:
                return None
            del self._lanes_down[worker]
        return self._made_lanes()

    def _made_lanes(self) -> ReadLanes:
        from kvkern.xfer.read_lanes import ReadLanes  # noqa: PLC0415

        if self.lanes is None:  # (lanes beyond this process's CPUs could not copy at once)
            self.lanes = ReadLanes(min(self.config.read_lanes, _usable_cpus()),
                                   min_bytes=self.config.read_lane_min_bytes,
                                   loop_bytes=self.config.loop_read_bytes,
                                   sets=self.config.read_lane_sets)
        return self.lanes

    def open_lanes(self, loop: asyncio.AbstractEventLoop,
                   ranks: Iterable[RankKV]) -> list[concurrent.futures.Future]:
        """Where this destination may read (reads and lanes configured, a host rank among
        ``ranks``), make the read lanes and open their UCX workers now, in the background
        (:meth:`ReadLanes.open`), not in the first pull; the futures of the openings."""
        if not (self.config.remote_read and self.config.read_lanes) or self._closed() \
                or not any(r.device.type == "cpu" for r in ranks):
            return []
        return self._made_lanes().open(loop)

    def lanes_failed(self, worker: bytes, exc: Exception) -> None:
        from kvkern.xfer.discovery import bounded_put  # noqa: PLC0415

        log.warning("read lanes to a source worker failed (%s); streaming from it for %s s",
                    exc, LANE_RETRY_S)
        bounded_put(self._lanes_down, worker, time.monotonic())

    async def _release_read(self, conn: TransferConnection, tid: int,
                            xfer_t: float) -> None:
        """ReadDone for a read that already counts: the source unpins, and answers nothing
        (``ack=False``)."""
        from kvkern.xfer.messages import ReadDone  # noqa: PLC0415
        from kvkern.xfer.transport import CONTROL_TAG  # noqa: PLC0415

        with contextlib.suppress(Exception):
            await conn.send_msg(ReadDone(transfer_id=tid, ack=False), CONTROL_TAG,
                                timeout=xfer_t)

    def close(self, timeout: float) -> None:
        lanes, self.lanes = self.lanes, None
        if lanes is not None:
            lanes.close(timeout)
