"""Direct reads: a pull that reads the source's blocks with no message to the source.

A source whose pools are registered for reads also registers its block manager's read
directory (:mod:`kvkern.cache.directory`) and announces both in its state (``read_index``).
A destination that has that state reads, on the first read lane's thread (or, for a pull of at
most ``XferConfig.loop_read_bytes``, on the event loop through the loop lane: see
:mod:`kvkern.xfer.read_lanes`) and without a hop between threads between the steps::

    1. the home buckets of the wanted hashes, then the plain buckets of those not found
       there (or the whole table, when that is fewer bytes than the buckets' per-read
       cost)                                       -> the block of each hash, its slot words
    2. the blocks' bytes into the private blocks   (split over every lane, as a granted read)
    3. the same slots again                        -> kept only if every slot is unchanged

Step 1 reads the wanted buckets in ascending order, neighbours that are at most
``DIRECTORY_READ_COST_BYTES`` apart in one read with the bytes between them
(:func:`read_spans`): a read's fixed cost buys that many bytes. A source that places chains
together (the index's ``dir_group``) puts a pull's consecutive hashes in consecutive home
buckets, read as one run each in the order wanted (:func:`plan_reads`): about one read per
group of them. Step 3 repeats step 1's reads, in one batch; when every byte they bring is as
step 1 read it, every found slot is unchanged at once (one comparison), else the found slots
are compared one by one.

A block is withdrawn from the directory (its slot's tag bumped) before its pool can hand it
to a writer, and published only after its bytes are final; a slot's tag never repeats. So a
slot that reads the same, cached, before and after the block's bytes proves those bytes are
the block of that hash throughout the read, and the pull counts them without pins, grants or
acknowledgements: the content check of a granted read, made by the reader.

Anything short of every wanted block found and confirmed (a hash not in the directory, a
block evicted during the read, a lane that fails) returns ``None`` and the caller asks the
source for a grant as before: the direct read only ever skips the round trip, it never
changes what a pull serves. Direct reads need what granted reads need (host memory, read
lanes, ``remote_read`` on the source) and are turned off on either side by
``XferConfig.direct_reads`` / ``SourceConfig.read_directory``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvkern.cache.directory import (
    BUCKET_BYTES,
    BUCKET_SLOTS,
    SLOT_WORDS,
    SMALL,
    bucket_of,
    entries,
    find,
    home_buckets,
    home_runs,
    stable,
)
from kvkern.xfer.messages import ReadGrant, Status
from kvkern.xfer.pulljob import Fallback, PullJob
from kvkern.xfer.tuning import DIRECTORY_READ_COST_BYTES

if TYPE_CHECKING:
    from kvkern.layout.plan import PeerTransfer
    from kvkern.layout.segments import BlockSegments
    from kvkern.xfer.kvgroup import RankKV
    from kvkern.xfer.metrics import XferMetrics
    from kvkern.xfer.pauses import Steps
    from kvkern.xfer.read_lanes import Reader
    from kvkern.xfer.receive import ReadReceiver
    from kvkern.xfer.state import ReadIndex

__all__ = ["DirectRead", "look_up_reads", "plan_reads", "read_directly", "read_spans",
           "read_whole", "run_reads", "same_directory"]

# Whole-directory buffers kept per source for the next pull: at most this many, each at most
# this large (a directory is 256 B per pool block).
SCRATCH_TABLES = 16
SCRATCH_TABLE_BYTES = 4 << 20
# A larger directory is read by bucket, whatever the pull's size (no read, and no buffer, of
# more than this on a source's word).
MAX_WHOLE_DIRECTORY_BYTES = 64 << 20
_SPANS = ("spans",)  # the scratch key of the buffer that bucket reads land in
BUCKET_WORDS = BUCKET_BYTES // 8

log = logging.getLogger("kvkern.xfer")


def _outlived(exc: BaseException) -> bool:
    """``exc`` says reads outlived their endpoint (their drain ran out): what they target
    must not be freed before they end. The pull may have ended before this script did (a
    cancellation that cut its wait short), so the script hands its buffers to the reads'
    :class:`~kvkern.xfer.quarantine.Outstanding` itself (list.extend holds the interpreter
    lock)."""
    from kvkern.xfer.read_lanes import _Stuck  # noqa: PLC0415
    from kvkern.xfer.transport import ReadsStuck  # noqa: PLC0415

    return isinstance(exc, (_Stuck, ReadsStuck))


def _on_event_loop() -> bool:
    """Whether this thread is running an event loop (the loop lane's) rather than a read
    lane's thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def read_whole(dir_buckets: int, k: int) -> bool:
    """Look hashes up by reading the whole directory of ``dir_buckets`` buckets rather than
    ``k`` reads of their buckets: when it is no more bytes than ``k`` small reads cost, and
    never more than :data:`MAX_WHOLE_DIRECTORY_BYTES` (the size is the source's word)."""
    table = dir_buckets * BUCKET_BYTES
    return table <= min(k * DIRECTORY_READ_COST_BYTES, MAX_WHOLE_DIRECTORY_BYTES)


def look_up_reads(start: int, count: int, group: int) -> int:
    """About how many reads look ``count`` consecutive hashes from position ``start`` up in
    a directory that places ``group`` positions together (0: by hash alone, one each)."""
    if not group:
        return count
    return (start + count - 1) // group - start // group + 1 if count else 0


def read_spans(offsets: np.ndarray, item: int, gap: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The reads that fetch the ``item``-byte entries at byte ``offsets`` of a remote table
    (multiples of ``item``, repeats allowed): the distinct entries in ascending order,
    neighbours at most ``gap`` bytes apart sharing one read of the bytes between them.
    Returns each offset's entry index in the concatenation of the reads' bytes, and the
    reads as ``(position, remote offset, nbytes)`` in that order (``position``: the read's
    byte offset in the concatenation)."""
    offs = np.asarray(offsets, dtype=np.int64)
    if offs.ndim == 1 and len(offs) <= SMALL:
        listed = offs.tolist()
        if any(o % item or o < 0 for o in listed):
            raise ValueError(f"offsets must be non-negative multiples of {item}")
        reads: list[list[int]] = []
        at: dict[int, int] = {}
        for off in sorted(set(listed)):
            if reads and off - (reads[-1][1] + reads[-1][2]) <= gap:
                reads[-1][2] = off + item - reads[-1][1]
            else:
                reads.append([reads[-1][0] + reads[-1][2] if reads else 0, off, item])
            at[off] = (reads[-1][0] + off - reads[-1][1]) // item
        return (np.array([at[o] for o in listed], np.int64),
                [(p, o, n) for p, o, n in reads])
    if offs.ndim != 1 or (offs % item).any() or (len(offs) and offs.min() < 0):
        raise ValueError(f"offsets must be non-negative multiples of {item}")
    if not len(offs):
        return np.empty(0, np.int64), []
    u, inv = np.unique(offs, return_inverse=True)
    new = np.ones(len(u), bool)
    new[1:] = u[1:] - (u[:-1] + item) > gap
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(u) - 1)
    start, nbytes = u[first], u[last] + item - u[first]
    pos = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    span = np.cumsum(new) - 1
    index = (pos[span] + u - start[span]) // item
    return (index[inv.reshape(-1)],
            list(zip(pos.tolist(), start.tolist(), nbytes.tolist(), strict=True)))


def plan_reads(offsets: np.ndarray, item: int, gap: int) -> tuple[np.ndarray | None,
                                                                  list[tuple[int, int, int]]]:
    """The reads that fetch the ``item``-byte entries at byte ``offsets`` of a remote table,
    as :func:`read_spans` returns them; but when the entries mostly follow each other in the
    order wanted (each at the previous one's next ``item`` bytes: a chain's home buckets),
    one read per such run, in that order, at most a quarter as many reads as entries, and
    ``None`` for the index (entry ``i`` is the concatenation's ``i``-th: no sort, no
    gather)."""
    offs = np.asarray(offsets, dtype=np.int64)
    k = len(offs)
    if k >= 4 and offs.ndim == 1:
        if k <= SMALL:
            listed = offs.tolist()
            starts = [0, *(i for i in range(1, k) if listed[i] != listed[i - 1] + item)]
        else:
            starts = [0, *(np.flatnonzero(np.diff(offs) != item) + 1).tolist()]
            listed = offs
        if 4 * len(starts) <= k and not (offs % item).any() and offs.min() >= 0:
            ends = [*starts[1:], k]
            return None, [(a * item, int(listed[a]), (b - a) * item)
                          for a, b in zip(starts, ends, strict=True)]
    return read_spans(offs, item, gap)


def run_reads(runs: Sequence[tuple[int, int]], item: int) -> tuple[None, list[tuple[int, int,
                                                                                 int]]]:
    """The reads of ``runs`` of consecutive ``item``-byte entries (``(first entry, count)``
    each), one per run in the order given, as :func:`plan_reads` returns them."""
    reads, at = [], 0
    for first, n in runs:
        reads.append((at * item, first * item, n * item))
        at += n
    return None, reads


def same_directory(a: ReadIndex, b: ReadIndex) -> bool:
    """Two ranks' indexes name one read directory (the ranks of one pool): one look-up and
    one confirmation serve the pairs of both."""
    return (a.dir_key, a.dir_base, a.dir_buckets, a.dir_group, a.blocks) == \
        (b.dir_key, b.dir_base, b.dir_buckets, b.dir_group, b.blocks)


class DirectRead:
    """The direct read of one or more pairs whose source ranks share a read directory and a
    read worker (see the module docstring): one look-up, the blocks of every pair in one
    read over the lanes (the pairs of one source rank read together: each stretch of its
    blocks once, scattered over every destination rank it feeds), one confirmation. Built
    on the event loop; :meth:`__call__` is its steps (:mod:`kvkern.xfer.pauses`), run on
    the first read lane's thread or on the loop (:meth:`ReadLanes.run_script
    <kvkern.xfer.read_lanes.ReadLanes.run_script>`)."""

    def __init__(self, job: PullJob, pairs: Sequence[tuple[PeerTransfer, RankKV]],
                 indexes: Sequence[ReadIndex], receiver: ReadReceiver) -> None:
        index = indexes[0]
        if not all(same_directory(index, other) for other in indexes):
            raise ValueError("the pairs' source ranks announce different read directories")
        self.job, self.pairs, self.index = job, list(pairs), index
        # the buffers kept for the next pull: the running thread's (a lane set's first, or
        # the loop lane's: each runs one script at a time), chosen when the read runs
        self._receiver = receiver
        self.scratch: dict[tuple, np.ndarray] = {}
        self.buffers: list[np.ndarray] = []  # what this read's reads write, besides blocks
        self.kept: list[np.ndarray] = []  # kept buffers given up by a read that failed
        hashes = job.chained[job.local:job.local + job.count]
        self.want = np.asarray(hashes, dtype=np.uint64)
        self._plain: np.ndarray | None = None  # each hash's bucket by hash alone (plain)
        self._home: np.ndarray | None = None  # and its home bucket (home)
        # Per pair, a grant as the source rank would write it, for the largest block the
        # index allows: the receiver's checks of an offer then bound every address this
        # read computes.
        self.templates: list[ReadGrant] = []
        self.segs: list[BlockSegments] = []
        for (pair, rank_kv), idx in zip(self.pairs, indexes, strict=True):
            template = ReadGrant(
                transfer_id=1, status=Status.OK, served_blocks=job.count, block_hashes=hashes,
                total_bytes=job.count * pair.block_nbytes, read_rkey=idx.keys[0],
                read_base=idx.bases[0], read_stride=idx.stride,
                read_blocks=[idx.blocks - 1] * job.count,
                read_segment_bytes=idx.segment_bytes, read_more_rkeys=list(idx.keys[1:]),
                read_more_bases=list(idx.bases[1:]),
                read_native=job.state.reads.get((job.source_dp, pair.src_rank)) == "native")
            self.templates.append(template)
            self.segs.append(receiver.check_offer(job, pair, template, rank_kv))
        group = index.dir_group
        self.whole = read_whole(index.dir_buckets,
                                look_up_reads(job.local, job.count, group))
        # A chain's home buckets read as one run per group of positions, in the order
        # wanted (as plan_reads finds them, without an array): None to plan from the buckets
        runs = home_runs(job.chained, job.local, job.count, index.dir_buckets,
                         group) if group and not self.whole else []
        self._home_plan = (run_reads(runs, BUCKET_BYTES)
                           if runs and 4 * len(runs) <= job.count else None)
        self.nbytes = job.count * sum(pair.block_nbytes for pair, _ in self.pairs)
        self.reads = 0
        self._rounds: list[tuple] = []  # the look-up's bucket reads: (which, k, plan)
        self._raw: list[bytes] = []  # the bytes each of those reads brought
        self.lookup_s = self.data_s = self.confirm_s = 0.0  # steps 1, 2 and 3
        self.t_in = self.t_out = 0.0  # when the steps began and ended (perf_counter)
        self.miss = ""  # why nothing was kept (a grant is asked for instead)
        self.result = "used"  # kvkern.xfer.metrics.DIRECT_READ_RESULTS

    @property
    def plain(self) -> np.ndarray:
        if self._plain is None:
            self._plain = bucket_of(self.want, self.index.dir_buckets)
        return self._plain

    @property
    def home(self) -> np.ndarray:
        if self._home is None:
            job, group = self.job, self.index.dir_group
            self._home = self.plain if not group else home_buckets(
                job.chained, job.local, job.count, self.index.dir_buckets, group)
        return self._home

    # ---- steps, on the first lane's thread or the loop lane's

    def __call__(self, read: Reader) -> Steps[float | None]:
        """Look up, read, confirm; the time the first byte landed, or None with ``miss``
        set when the blocks do not all count."""
        t0 = self.t_in = time.perf_counter()
        receiver = self._receiver
        self.scratch = receiver.loop_scratch if _on_event_loop() else receiver.thread_scratch()
        try:
            return (yield from self._steps(read, t0))
        except BaseException as exc:
            # (a read that failed may still write them: never reused, on this very thread)
            self.kept = list(self.scratch.values())
            self.scratch.clear()
            if _outlived(exc):  # kept here: the pull may have let go of this script
                held = getattr(exc, "outstanding", None)
                (receiver.stuck_buffers if held is None else held.kept).extend(
                    [*self.buffers, *self.kept])
            raise
        finally:
            self.t_out = time.perf_counter()

    def _steps(self, read: Reader, t0: float) -> Steps[float | None]:
        rows, slot, block, where = yield from self._look_up(read)
        if (block < 0).any():
            self.miss = f"{int((block < 0).sum())} of {len(block)} hashes not in the directory"
            self.result = "missing"
            return None
        if (block >= self.index.blocks).any():
            self.miss = "the directory names a block beyond the pool"
            self.result = "failed"
            return None
        from kvkern.xfer.receive import ReadReceiver  # noqa: PLC0415

        blocks = block.tolist()
        by_source: dict[int, list[int]] = {}  # a source rank's pairs read together
        for i, (pair, _) in enumerate(self.pairs):
            by_source.setdefault(pair.src_rank, []).append(i)
        parts = []
        for members in by_source.values():
            grant = msgspec.structs.replace(self.templates[members[0]], read_blocks=blocks)
            keys = [grant.read_rkey, *grant.read_more_rkeys]
            runs = ReadReceiver.source_runs(self.job, grant, [
                (*self.pairs[i], self.segs[i]) for i in members])
            parts += [(keys[j], part) for j, part in runs.items()]
        t = time.perf_counter()
        self.lookup_s = t - t0
        first = yield from read(parts)
        t1 = time.perf_counter()
        self.data_s = t1 - t
        self.reads = sum(len(runs) for _, runs in parts)
        kept = yield from self._confirm(read, rows, slot, where)
        self.confirm_s = time.perf_counter() - t1
        if not kept.all():
            self.miss = f"{int((~kept).sum())} blocks changed while they were read"
            self.result = "changed"
            return None
        return first

    def _look_up(self, read: Reader) -> Steps[tuple[np.ndarray, ...]]:
        """Each wanted hash's bucket as read from the source, its slot and block there (-1
        when absent), and which bucket that is: the home bucket, or the plain one for a hash
        not found at home; None when the buckets were read on their own (the confirmation
        repeats those reads and needs no bucket)."""
        table = (yield from self._whole_table(read)) if self.whole else None
        if table is None:
            rows = yield from self._buckets(read, None, None, self._home_plan)
        else:
            rows = table[self.home]
        slot, block, _ = find(rows, self.want)
        where = self.home if table is not None else None  # (bucket reads: see _confirm)
        absent = block < 0
        miss = np.flatnonzero(absent & (self.plain != self.home)) if absent.any() else ()
        if len(miss):
            if table is None:
                more = yield from self._buckets(read, self.plain[miss], miss)
            else:
                more = table[self.plain[miss]]
            slot2, block2, _ = find(more, self.want[miss])
            rows[miss], slot[miss], block[miss] = more, slot2, block2
            if where is not None:
                where = self.home.copy()
                where[miss] = self.plain[miss]
        return rows, slot, block, where

    def _whole_table(self, read: Reader) -> Steps[np.ndarray]:
        """The whole directory, read from the source."""
        index = self.index
        table = self._table()
        yield from read([(index.dir_key, [(table.ctypes.data, index.dir_base, table.nbytes)])])
        return table

    def _buckets(self, read: Reader, buckets: np.ndarray | None, which: np.ndarray | None,
                 plan: tuple | None = None) -> Steps[np.ndarray]:
        """The rows of ``buckets`` (those of the wanted hashes ``which``, None: all), read
        from the source; the reads are kept for the confirmation (:meth:`_confirm`).
        ``plan``: their reads, made already (:func:`plan_reads`'s form; ``buckets`` None:
        the home buckets)."""
        if plan is None:
            buckets = self.home if buckets is None else buckets
            # (the reads' gaps narrowed so that their bytes stay within
            # MAX_WHOLE_DIRECTORY_BYTES)
            gap = max(0, min(DIRECTORY_READ_COST_BYTES,
                             MAX_WHOLE_DIRECTORY_BYTES // max(len(buckets), 1) - BUCKET_BYTES))
            plan = plan_reads(buckets * BUCKET_BYTES, BUCKET_BYTES, gap)
        k = len(self.want) if buckets is None else len(buckets)
        self._rounds.append((which, k, plan))
        raw = yield from self._fetch_raw(read, [plan])
        self._raw.append(raw.tobytes())
        return self._rows(raw, [(k, plan)])[0]

    def _fetch_raw(self, read: Reader, plans: Sequence[tuple]) -> Steps[np.ndarray]:
        """The bytes of every plan's reads (:func:`plan_reads`), all read at once, one plan
        after the other: a view of a buffer that the next fetch reuses."""
        buf = self._scratch(sum(n for _, runs in plans for *_, n in runs) // 8)
        base, at = buf.ctypes.data, 0
        dir_base = self.index.dir_base
        reads = []
        for _, runs in plans:
            for p, off, n in runs:
                reads.append((base + at + p, dir_base + off, n))
            at += sum(n for *_, n in runs)
        yield from read([(self.index.dir_key, reads)])
        return buf

    @staticmethod
    def _rows(raw: np.ndarray, plans: Sequence[tuple[int, tuple]]) -> list[np.ndarray]:
        """Each plan's ``k`` bucket rows in the bytes :meth:`_fetch_raw` read for them;
        copies."""
        out, at = [], 0
        for k, (index, runs) in plans:
            words = raw[at // 8:]
            rows = (words[:k * BUCKET_WORDS].copy() if index is None
                    else words.reshape(-1, BUCKET_WORDS)[index])
            out.append(rows.reshape(k, BUCKET_SLOTS, SLOT_WORDS))
            at += sum(n for *_, n in runs)
        return out

    def _table(self) -> np.ndarray:
        """A buffer for the whole directory: this source's from earlier reads when it is
        small (no fresh pages to fault in per pull), else a new one."""
        index = self.index
        shape = (index.dir_buckets, BUCKET_SLOTS, SLOT_WORDS)
        if index.dir_buckets * BUCKET_BYTES > SCRATCH_TABLE_BYTES:
            table = np.empty(shape, np.uint64)
            self.buffers.append(table)
            return table
        key = (index.dir_key, index.dir_base, index.dir_buckets)
        table = self.scratch.pop(key, None)
        if table is None:
            table = np.empty(shape, np.uint64)
        self.scratch[key] = table  # most recently used last
        while len(self.scratch) > SCRATCH_TABLES:
            del self.scratch[next(iter(self.scratch))]
        return table

    def _confirm(self, read: Reader, rows: np.ndarray, slot: np.ndarray,
                 where: np.ndarray | None) -> Steps[np.ndarray]:
        """Which blocks count: the look-up's reads once more, all at once, after the blocks.
        Bucket reads whose bytes are all as the look-up read them keep every block found
        (one comparison, no per-slot work); else each found slot's words are compared
        (:func:`~kvkern.cache.directory.stable`)."""
        if self.whole:
            post = entries((yield from self._whole_table(read))[where], slot)
        else:
            plans = [(k, plan) for _, k, plan in self._rounds]
            raw = yield from self._fetch_raw(read, [plan for _, plan in plans])
            if raw.tobytes() == b"".join(self._raw):
                return np.ones(len(self.want), dtype=bool)
            got = self._rows(raw, plans)
            fresh = got[0]
            for (which, _, _), more in zip(self._rounds[1:], got[1:], strict=True):
                fresh[which] = more
            post = entries(fresh, slot)
        return stable(entries(rows, slot), post, self.want)

    def _scratch(self, words: int) -> np.ndarray:
        """A buffer of ``words`` for bucket reads: one kept for the next pull while it is
        small, else a new one."""
        if words * 8 > SCRATCH_TABLE_BYTES:
            buf = np.empty(words, np.uint64)
            self.buffers.append(buf)
            return buf
        buf = self.scratch.get(_SPANS)
        if buf is None or len(buf) < words:
            buf = self.scratch[_SPANS] = np.empty(max(words, 512), np.uint64)
        return buf[:words]


async def read_directly(receiver: ReadReceiver, job: PullJob,
                        pairs: Sequence[tuple[PeerTransfer, RankKV]], xfer_t: float,
                        metrics: XferMetrics | None = None,
                        failed: Callable[[PullJob, Exception], Awaitable[None]] | None = None,
                        ) -> int | None:
    """The blocks of ``pairs`` (source ranks with one read worker and one read directory,
    see :func:`same_directory`) read directly into the private blocks: the served count
    (every wanted block, for every pair), or None when the caller must ask for grants
    (nothing read counts; the private blocks are rewritten by the granted reads). A read
    that failed (the source's process may be gone) is told to ``failed`` first, which may
    end the pull instead (:meth:`~kvkern.xfer.discovery.SourceDiscovery.connect_failed`)."""
    from kvkern.xfer.transport import ReadsStuck, TransportError  # noqa: PLC0415
    from kvkern.xfer.ucp_rma import scatter_check_failed  # noqa: PLC0415

    keys = [(job.source_dp, pair.src_rank) for pair, _ in pairs]
    worker = job.state.read_workers[keys[0]]
    lanes = receiver.lanes_for(worker)
    if lanes is None or any(job.state.read_workers[k] != worker for k in keys):
        return None
    t = time.perf_counter()
    try:
        direct = DirectRead(job, pairs, [job.state.read_indexes[k] for k in keys], receiver)
    except (Fallback, ValueError) as exc:  # an index a grant could not match: ask for one
        log.debug("pull %r: no direct read: %s", job.rec.request_id, exc)
        return None
    try:
        first = await lanes.run_script(worker, direct, timeout=xfer_t, nbytes=direct.nbytes,
                                       local=receiver.local_source(job.state, keys[0]),
                                       owned=job.into is not None,
                                       same_host=all(receiver.near_reads(job.state, k)
                                                     for k in keys))
    except ReadsStuck as exc:
        # UCX may still write the directory buffers: never reuse (or free) them until then
        if not job.outlived(exc, [*direct.buffers, *direct.kept]):
            receiver.stuck_buffers.extend([*direct.buffers, *direct.kept])
        raise
    except TransportError as exc:
        if exc.reason != "transfer_failed":
            if metrics is not None:
                metrics.direct_read("failed")
            raise
        job.phases["direct"] = time.perf_counter() - t
        if scatter_check_failed(exc):  # not the lanes' fault (see ReadBatch.wait)
            if metrics is not None:
                metrics.direct_read("changed")
            log.debug("pull %r: direct read not used (%s): asking for a grant",
                      job.rec.request_id, exc)
            return None
        if metrics is not None:
            metrics.direct_read("failed")
        receiver.lanes_failed(worker, exc)  # the pair is streamed while the lanes rest
        if failed is not None:
            await failed(job, exc)
        return None
    now = time.perf_counter()
    job.phases["direct"] = now - t
    # the read's setup here and its hand-offs onto the first lane's thread and back (none
    # on the loop lane: its script's driver only)
    job.phases["handoff"] = job.phases.get("handoff", 0.0) + (
        direct.t_in - t + now - direct.t_out)
    if metrics is not None:
        metrics.direct_read(direct.result)
    if direct.miss:
        log.debug("pull %r: direct read not used (%s): asking for a grant",
                  job.rec.request_id, direct.miss)
        return None
    if job.t_first_byte is None:
        job.t_first_byte = first or time.perf_counter()
    job.reads += direct.reads
    job.bytes += direct.nbytes
    job.phases["read"] = job.phases.get("read", 0.0) + job.phases["direct"]
    for phase, took in (("lookup", direct.lookup_s), ("data", direct.data_s),
                        ("confirm", direct.confirm_s)):
        job.phases[phase] = job.phases.get(phase, 0.0) + took
    return job.count
