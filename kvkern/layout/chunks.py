"""How a stream of served blocks is cut into chunks (messages), and the order of receive
blocks that lets whole chunks land in place. See :mod:`kvkern.xfer.source` ("Pieces and the
byte stream") for the stream itself."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ChunkSpec", "count_chunks", "direct_order", "plan_chunks"]


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


def count_chunks(lengths: Sequence[int], n_blocks: int, limit: int) -> int:
    """Number of chunks :func:`plan_chunks` makes, without building them."""
    total = 0
    for length in lengths:
        if length <= limit:
            total += math.ceil(n_blocks / (limit // length))
        else:
            total += n_blocks * math.ceil(length / limit)
    return total


def plan_chunks(lengths: Sequence[int], n_blocks: int, limit: int) -> list[ChunkSpec]:
    """Chunks of the stream of ``n_blocks`` blocks whose pieces (in stream order) have
    ``lengths`` bytes per block: for each piece, runs of ``max(1, limit // length)`` blocks,
    one chunk each (a chunk never spans two pieces); a block larger than ``limit`` is cut into
    ``ceil(length / limit)`` byte slices."""
    if limit < 1:
        raise ValueError(f"chunk limit {limit} must be >= 1")
    out: list[ChunkSpec] = []
    for p, length in enumerate(lengths):
        if length <= limit:
            per = limit // length
            for b0 in range(0, n_blocks, per):
                b1 = min(b0 + per, n_blocks)
                out.append(ChunkSpec(p, b0, b1, 0, (b1 - b0) * length))
        else:
            for b in range(n_blocks):
                for lo in range(0, length, limit):
                    out.append(ChunkSpec(p, b, b + 1, lo, min(lo + limit, length)))
    return out


def direct_order(ids: list[int], per: int) -> list[int]:
    """Order sorted receive block ``ids`` for a stream of ``per``-block chunks so that every
    chunk that can land zero-copy does, and the chunks that cannot (ids from the ends of
    short runs) come first, where their unpack overlaps the later chunks' transfer instead of
    trailing the last one (measured: 1.4-1.7 ms of unpack after the last byte of a 64 MiB
    pull from a fragmented pool). The trailing ``len(ids) % per`` blocks stay last::

        runs [0..119] [512..519], per 32  ->  [96..119, 512..519] [0..31] [32..63] [64..95]
    """
    direct: list[int] = []
    rest: list[int] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            run = ids[start:i]
            k = len(run) // per * per
            direct += run[:k]
            rest += run[k:]
            start = i
    lead = len(rest) // per * per  # whole mixed chunks; the remainder is the short last one
    return rest[:lead] + direct + rest[lead:]
