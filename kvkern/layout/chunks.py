"""How a stream of served blocks is cut into chunks (messages), and the order of receive
blocks that lets whole chunks land in place. See :mod:`kvkern.xfer.source` ("Pieces and the
byte stream") for the stream itself."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ChunkSpec", "chunk_runs", "count_chunks", "consecutive_from", "plan_chunks",
           "send_chunks", "stream_plan"]


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: blocks ``[b0, b1)`` of piece ``piece`` (index into the offset-sorted
    pieces), bytes ``[lo, hi)`` of that (piece, block range) slab."""

    piece: int
    b0: int
    b1: int
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def _spans(n_blocks: int, per: int, blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Block ranges of the chunks of one piece: the destination's plan ``blocks`` (chunk
    sizes in blocks, each cut to ``per``) up to ``n_blocks``, the rest ``per`` at a time."""
    out: list[tuple[int, int]] = []
    b0 = 0
    for k in blocks:
        if b0 >= n_blocks:
            break
        end = min(b0 + k, n_blocks)
        out += [(b, min(b + per, end)) for b in range(b0, end, per)]
        b0 = end
    out += [(b, min(b + per, n_blocks)) for b in range(b0, n_blocks, per)]
    return out


def _count_spans(n_blocks: int, per: int, blocks: Sequence[int]) -> int:
    """``len(_spans(n_blocks, per, blocks))`` without building them (a request's plan may
    be long)."""
    total = b0 = 0
    for k in blocks:
        if b0 >= n_blocks:
            break
        end = min(b0 + k, n_blocks)
        total += -(-(end - b0) // per)
        b0 = end
    return total + -(-max(n_blocks - b0, 0) // per)


def count_chunks(lengths: Sequence[int], n_blocks: int, limit: int,
                 blocks: Sequence[int] = ()) -> int:
    """Number of chunks :func:`plan_chunks` makes, without building them."""
    total = 0
    for length in lengths:
        if length <= limit:
            per = limit // length
            total += _count_spans(n_blocks, per, blocks)
        else:
            total += n_blocks * math.ceil(length / limit)
    return total


def plan_chunks(lengths: Sequence[int], n_blocks: int, limit: int,
                blocks: Sequence[int] = ()) -> list[ChunkSpec]:
    """Chunks of the stream of ``n_blocks`` blocks whose pieces (in stream order) have
    ``lengths`` bytes per block: for each piece, runs of ``max(1, limit // length)`` blocks,
    one chunk each (a chunk never spans two pieces); a block larger than ``limit`` is cut into
    ``ceil(length / limit)`` byte slices.

    ``blocks`` is the destination's plan for a stream of one piece (``PullRequest.
    chunk_blocks``, see :func:`stream_plan`): the chunk boundaries it asked for, each of its
    chunks cut further to the limit; a stream of fewer blocks than the plan covers (a partial
    serve) ends with it."""
    if limit < 1:
        raise ValueError(f"chunk limit {limit} must be >= 1")
    if blocks and len(lengths) != 1:
        raise ValueError(f"a chunk plan in blocks is for one piece, not {len(lengths)}")
    out: list[ChunkSpec] = []
    for p, length in enumerate(lengths):
        if length <= limit:
            for b0, b1 in _spans(n_blocks, limit // length, blocks):
                out.append(ChunkSpec(p, b0, b1, 0, (b1 - b0) * length))
        else:
            for b in range(n_blocks):
                for lo in range(0, length, limit):
                    out.append(ChunkSpec(p, b, b + 1, lo, min(lo + limit, length)))
    return out


def consecutive_from(ids: Sequence[int], b0: int, b1: int) -> int | None:
    """``ids[b0]`` when ``ids[b0:b1]`` are consecutive ids (one stretch of a pool's block
    rows: a chunk that needs no pack or unpack), else None."""
    first = ids[b0]
    return first if list(ids[b0:b1]) == list(range(first, first + b1 - b0)) else None


def _run_lengths(ids: Sequence[int]) -> list[int]:
    """Lengths of the runs of consecutive ids in ``ids``, in order."""
    out: list[int] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append(i - start)
            start = i
    return out


def chunk_runs(ids: Sequence[int], per: int, min_run: int,
               per_run: int | None = None) -> list[int]:
    """The chunk sizes in blocks (``PullRequest.chunk_blocks``) of a stream into receive
    blocks ``ids`` in this order: every run of at least ``min_run`` consecutive ids as
    chunks of at most ``per_run`` blocks (default ``per``) of its own (they land in place,
    no staging); the shorter runs between them together, in chunks of at most ``per``
    blocks (unpacked from staging)::

        ids [0..39] [100, 101] [200, 201] [300..303], per 32, min_run 4  ->  [32, 8, 4, 4]
    """
    return _sizes(_run_lengths(ids), per, min_run, per_run)


def _sizes(runs: Sequence[int], per: int, min_run: int, per_run: int | None = None) -> list[int]:
    """:func:`chunk_runs` of ids whose runs have lengths ``runs``, in order."""
    per_run = per if per_run is None else per_run
    if per < 1 or min_run < 1 or per_run < 1:
        raise ValueError(f"per {per}, per_run {per_run} and min_run {min_run} must be >= 1")
    sizes: list[int] = []
    pending = 0  # blocks of short runs not yet in a chunk
    for n in runs:
        if n >= min_run:
            if pending:
                sizes.append(pending)
                pending = 0
            sizes += [min(per_run, n - j) for j in range(0, n, per_run)]
        else:
            pending += n
            while pending >= per:
                sizes.append(per)
                pending -= per
    if pending:
        sizes.append(pending)
    return sizes


def stream_plan(ids: Sequence[int], per: int, min_run: int,
                per_run: int | None = None) -> tuple[list[int], list[int]]:
    """Receive block ``ids`` (ascending, in any order the destination may choose) ordered
    for a stream, and its :func:`chunk_runs`: the ids of runs shorter than ``min_run``
    first, so that their chunks' unpack overlaps the later chunks' transfer (unpacked last,
    they trailed the last byte of a 64 MiB pull from a fragmented pool by 1.4-1.7 ms)::

        runs [0..39] [100, 101] [200, 201], per 32, min_run 4
            ->  ids [100, 101, 200, 201, 0..39]   chunk_blocks [4, 32, 8]
    """
    short: list[int] = []
    long: list[int] = []
    short_runs: list[int] = []
    long_runs: list[int] = []
    start = 0
    for n in _run_lengths(ids):
        if n >= min_run:
            long.extend(ids[start:start + n])
            long_runs.append(n)
        else:
            short.extend(ids[start:start + n])
            short_runs.append(n)
        start += n
    # maximal runs stay maximal side by side, so the order's runs are these
    return short + long, _sizes(short_runs + long_runs, per, min_run, per_run)


def send_chunks(length: int, ids: Sequence[int], limit: int, run_limit: int,
                blocks: Sequence[int], min_run: int) -> list[ChunkSpec]:
    """The chunks a source sends of a stream of one piece of ``length`` bytes per block whose
    pool blocks are ``ids`` (in stream order), when consecutive pool blocks can be sent
    straight from the pool: the destination's plan ``blocks`` (as :func:`plan_chunks`), and
    inside each of its chunks every run of at least ``min_run`` consecutive ids in chunks of
    its own of up to ``run_limit`` bytes (no staging on this side), the shorter runs between
    them together in chunks of up to ``limit`` bytes (packed into staging). A block larger
    than ``limit`` is cut into byte slices as :func:`plan_chunks` cuts it."""
    if length > limit:
        return plan_chunks([length], len(ids), limit, blocks)
    per, per_run = limit // length, max(run_limit, limit) // length
    out: list[ChunkSpec] = []
    for b0, b1 in _spans(len(ids), max(len(ids), 1), blocks):  # the plan's chunks, uncut
        at = b0
        for k in _sizes(_run_lengths(ids[b0:b1]), per, min_run, per_run):
            out.append(ChunkSpec(0, at, at + k, 0, k * length))
            at += k
    return out
