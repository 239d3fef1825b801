"""Where a block's bytes are, and which byte runs move a transfer's pieces between two
layouts: the math both sides of the pull path share (the source to register and stream, the
puller to read and unpack). Describes memory; never moves bytes.

Nouns (the same in :mod:`kvkern.xfer`):

* **piece**: one (layer range x head range) of a block that a (source rank, destination
  rank) pair moves (:class:`kvkern.layout.plan.Piece`);
* **segment**: one contiguous part of a block in a pool (:class:`BlockSegments`): the whole
  block of a TRT-LLM row pool, one layer of a per-layer HND pool;
* **run**: one contiguous copy of a read, inside one segment on each side
  (:func:`segment_runs`);
* **chunk**: one message of a stream (:mod:`kvkern.layout.chunks`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvkern.layout.kv_layout import Axis, KVLayout

__all__ = ["BlockSegments", "block_rows", "layout_signature",
           "native_segments", "piece_nbytes", "read_segments", "segment_gathers",
           "segment_gathers_to",
           "segment_runs", "source_segment_bytes", "spans_whole_block", "whole_block_pair"]

Range = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class BlockSegments:
    """Where a rank's blocks are in memory, for one-sided reads: the canonical bytes of a
    block (its stream, ``[L, 2, H, T, D]``) are ``len(bases)`` equal segments of ``nbytes``;
    segment ``j`` of block ``b`` is the ``nbytes`` at ``bases[j] + b * stride``. One segment
    for a pool of whole block rows (TRT-LLM), one per layer for a per-layer pool whose
    ``[2, H, T, D]`` per block is contiguous (vLLM/FlashInfer HND). ``spans`` are the
    ``(address, length)`` of the memory each segment lives in (what a source registers)."""

    bases: tuple[int, ...]
    stride: int
    nbytes: int
    spans: tuple[tuple[int, int], ...]

    @property
    def block_nbytes(self) -> int:
        return self.nbytes * len(self.bases)


# ------------------------------------------------------------------------ pool memory


def block_rows(layout: KVLayout, tensors: Sequence[Any]) -> Any:
    """``[num_blocks, bytes_per_block]`` uint8 view of a single-tensor pool whose canonical
    view is contiguous (each block's ``[L, 2, H, T, D]`` bytes one run in stream order, e.g.
    TRT-LLM's ``[NB, L, 2, H, T, D]``), else None."""
    if layout.per_layer:
        return None
    cv = layout.canonical_view(tensors[0])
    if not cv.is_contiguous():
        return None
    import torch  # noqa: PLC0415

    return cv.reshape(cv.shape[0], -1).view(torch.uint8)


def read_segments(layout: KVLayout, tensors: Sequence[Any],
                  rows: Any = None) -> BlockSegments | None:
    """The canonical :class:`BlockSegments` of a pool (``rows``: its :func:`block_rows`, when
    known), or None when a block's canonical bytes are not whole contiguous segments (NHD and
    ``[2, NB, ...]`` orders, where a block's tokens or its K and V are apart)."""
    if rows is None:
        rows = block_rows(layout, tensors)
    if rows is not None:
        return BlockSegments(bases=(rows.data_ptr(),), stride=rows.stride(0),
                             nbytes=rows.shape[1], spans=(_span(rows),))
    if not layout.per_layer:
        return None
    views = [layout.canonical_view(t) for t in tensors]  # [NB, 2, H, T, D]
    for cv in views:
        inner = cv[0]
        if not inner.is_contiguous() or cv.stride(0) < inner.numel() or cv.stride(0) != \
                views[0].stride(0):
            return None
    isz = views[0].element_size()
    return BlockSegments(bases=tuple(cv.data_ptr() for cv in views),
                         stride=views[0].stride(0) * isz,
                         nbytes=views[0][0].numel() * isz,
                         spans=tuple(_span(cv) for cv in views))


def native_segments(layout: KVLayout, tensors: Sequence[Any]) -> BlockSegments | None:
    """A block's bytes in the pool's own order: per tensor (per layer of a per-layer pool)
    and per K/V plane stored before the block axis, the contiguous part at
    ``bases[j] + b * stride``; None when a block's parts are not contiguous."""
    pos = layout.order.index(Axis.BLOCK)
    bases: list[int] = []
    spans: list[tuple[int, int]] = []
    shape: tuple[int, int] | None = None
    for t in tensors:
        tb = t.movedim(pos, 0)  # [NB, planes stored before the block axis..., rest]
        for idx in itertools.product(*(range(n) for n in tb.shape[1:pos + 1])):
            sub = tb[(slice(None), *idx)]
            isz = sub.element_size()
            here = (sub.stride(0) * isz, sub[0].numel() * isz)
            if not sub[0].is_contiguous() or here[0] < here[1] or shape not in (None, here):
                return None
            shape = here
            bases.append(sub.data_ptr())
            spans.append(_span(t))
    assert shape is not None
    return BlockSegments(bases=tuple(bases), stride=shape[0], nbytes=shape[1],
                         spans=tuple(spans))


def layout_signature(described: dict) -> tuple:
    """The fields of a :meth:`KVLayout.describe` dict that fix how one block's bytes are
    arranged (not the block count, nor strides that scale with it)."""
    return tuple(described.get(k) if not isinstance(described.get(k), list)
                 else tuple(described[k]) for k in (
                     "order", "per_layer", "num_layers", "num_heads", "block_size",
                     "head_dim", "dtype"))


def _span(t: Any) -> tuple[int, int]:
    """``(lowest address, bytes)`` of the memory a strided tensor touches."""
    n = sum((size - 1) * st for size, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), n * t.element_size()


# ------------------------------------------------------------------ pieces and runs


def piece_nbytes(layout: KVLayout, layers: Range, heads: Range) -> int:
    """Bytes per block of the piece ``layers`` x ``heads`` of ``layout``'s blocks."""
    return ((layers[1] - layers[0]) * 2 * (heads[1] - heads[0])
            * layout.block_size * layout.head_dim * layout.itemsize)


def spans_whole_block(layout: KVLayout, layers: Range, heads: Range) -> bool:
    """The piece ``layers`` x ``heads`` is every local layer and head of ``layout``."""
    return (tuple(layers), tuple(heads)) == ((0, layout.num_layers), (0, layout.num_heads))


def whole_block_pair(pieces: Sequence[Any], src: KVLayout, dst: KVLayout) -> bool:
    """A pair's plan ``pieces`` move whole blocks: one piece of every local layer and head
    of the source layout ``src`` into every local layer and head of ``dst``."""
    if len(pieces) != 1:
        return False
    p = pieces[0]
    return (spans_whole_block(src, p.src_layers, p.src_heads)
            and spans_whole_block(dst, p.dst_layers, p.dst_heads))


@functools.lru_cache(maxsize=1024)
def segment_runs(pieces: Any, src: KVLayout, dst: KVLayout, src_seg: int,
                 dst_seg: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """The byte runs that move a pair's plan ``pieces`` (a tuple) from a block of layout
    ``src`` to a block of layout ``dst`` (each block's canonical ``[L, 2, H, T, D]`` bytes
    cut into segments of ``src_seg`` / ``dst_seg``), as ``(src segment, offset in it, dst
    segment, offset in it, nbytes)``: one per layer, K/V and piece, merged where contiguous
    on both sides (whole blocks: one run per segment), cut where either side's segment
    ends."""
    row = src.block_size * src.head_dim * src.itemsize  # one head's [T, D]
    runs: list[list[int]] = []
    for p in pieces:
        (sl0, sl1), (sh0, sh1) = p.src_layers, p.src_heads
        (dl0, _), (dh0, _) = p.dst_layers, p.dst_heads
        n = (sh1 - sh0) * row
        for i in range(sl1 - sl0):
            for kv in (0, 1):
                so = (((sl0 + i) * 2 + kv) * src.num_heads + sh0) * row
                do = (((dl0 + i) * 2 + kv) * dst.num_heads + dh0) * row
                if runs and runs[-1][0] + runs[-1][2] == so and runs[-1][1] + runs[-1][2] == do:
                    runs[-1][2] += n
                else:
                    runs.append([so, do, n])
    out = []
    for so, do, n in runs:
        while n:
            cut = min(src_seg - so % src_seg, dst_seg - do % dst_seg, n)
            out.append((so // src_seg, so % src_seg, do // dst_seg, do % dst_seg, cut))
            so, do, n = so + cut, do + cut, n - cut
    return tuple(out)  # cached per (pieces, layouts, segments): immutable


Gather = tuple[int, int, int, tuple[tuple[int, int, int], ...]]
MultiGather = tuple[int, int, int, tuple[tuple[int, int, int, int], ...]]


@functools.lru_cache(maxsize=1024)
def segment_gathers(pieces: Any, src: KVLayout, dst: KVLayout, src_seg: int,
                    dst_seg: int) -> tuple[Gather, ...]:
    """:func:`segment_runs` grouped into reads that are contiguous on the source side:
    ``(src segment, offset in it, nbytes, ((dst segment, offset in it, nbytes), ...))``, the
    pieces in source order. A TP reshard into a wider destination (each source rank's
    heads a head range of every destination layer) makes one gather per source segment
    out of a run per layer and K/V: one read of the source's bytes, scattered over the
    destination's rows on arrival."""
    return tuple((j, off, n, tuple(p[1:] for p in parts)) for j, off, n, parts
                 in segment_gathers_to(((pieces, dst, dst_seg),), src, src_seg))


@functools.lru_cache(maxsize=1024)
def segment_gathers_to(dsts: tuple[tuple[Any, KVLayout, int], ...], src: KVLayout,
                       src_seg: int) -> tuple[MultiGather, ...]:
    """:func:`segment_gathers` of one source rank's blocks into several destinations, each
    ``(pieces, layout, segment bytes)``: the pieces of a gather are ``(destination index,
    dst segment, offset in it, nbytes)``. The ranks of a narrower destination (TP 1 -> 2:
    each a head range of every source layer) together read each source block once."""
    runs = sorted((j, s_off, k, d, d_off, n) for k, (pieces, dst, dst_seg) in enumerate(dsts)
                  for j, s_off, d, d_off, n in segment_runs(pieces, src, dst, src_seg,
                                                            dst_seg))
    out: list[list] = []
    for j, s_off, k, d, d_off, n in runs:
        last = out[-1] if out else None
        if last is not None and last[0] == j and last[1] + last[2] == s_off:
            last[2] += n
            last[3].append((k, d, d_off, n))
        else:
            out.append([j, s_off, n, [(k, d, d_off, n)]])
    return tuple((j, off, n, tuple(parts)) for j, off, n, parts in out)


def source_segment_bytes(src: KVLayout) -> int:
    """The canonical read segment of a source layout's block (:func:`read_segments`): the
    whole block, or one layer of a per-layer pool."""
    return src.bytes_per_block // (src.num_layers if src.per_layer else 1)
