"""The shared layout math of the pull path (:mod:`kvkern.layout.segments`,
:mod:`kvkern.layout.chunks`), on plain layouts: no pool, no network."""

from __future__ import annotations

import pytest

from kvkern.layout.chunks import count_chunks, direct_order, plan_chunks
from kvkern.layout.plan import plan_transfer
from kvkern.layout.segments import (
    piece_nbytes,
    segment_gathers,
    segment_runs,
    source_segment_bytes,
    spans_whole_block,
    whole_block_pair,
)
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology

MODEL = ModelKVSpec(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4, dtype="float16")


def topo(tp: int = 1, pp: int = 1) -> Topology:
    return Topology(model=MODEL, parallel=Parallelism(tp_size=tp, pp_size=pp))


def test_same_topology_moves_whole_blocks_in_one_run_per_segment():
    t = topo()
    lay = t.local_layout(0, 8)
    (tr,) = plan_transfer(t, 0, t, 0).transfers
    assert whole_block_pair(tr.pieces, lay, lay)
    assert spans_whole_block(lay, (0, 4), (0, 4)) and not spans_whole_block(lay, (0, 2), (0, 4))
    assert piece_nbytes(lay, (0, 4), (0, 4)) == lay.bytes_per_block
    assert segment_runs(tr.pieces, lay, lay, lay.bytes_per_block, lay.bytes_per_block) == (
        (0, 0, 0, 0, lay.bytes_per_block),)


def test_tp_reshard_cuts_runs_per_layer_and_kv():
    src_t, dst_t = topo(tp=1), topo(tp=2)
    src, dst = src_t.local_layout(0, 8), dst_t.local_layout(0, 8)
    tr = next(tr for tr in plan_transfer(src_t, 0, dst_t, 0).transfers if tr.dst_rank == 0)
    assert not whole_block_pair(tr.pieces, src, dst)
    row = MODEL.block_size * MODEL.head_dim * 2  # one head's [T, D] in fp16
    runs = segment_runs(tr.pieces, src, dst, src.bytes_per_block, dst.bytes_per_block)
    assert len(runs) == MODEL.num_layers * 2
    assert sum(r[4] for r in runs) == dst.bytes_per_block
    # each a head range of one layer's K or V, apart on the source side: no gather merges
    gathers = segment_gathers(tr.pieces, src, dst, src.bytes_per_block, dst.bytes_per_block)
    assert [g[2] for g in gathers] == [2 * row] * len(runs)


def test_tp_reshard_into_a_wider_rank_reads_each_source_block_once():
    """TP2 -> TP1: a source rank's whole block is a head range of every destination layer:
    one gather of the source block, scattered over a piece per layer and K/V."""
    src_t, dst_t = topo(tp=2), topo(tp=1)
    src, dst = src_t.local_layout(1, 8), dst_t.local_layout(0, 8)
    tr = next(tr for tr in plan_transfer(src_t, 0, dst_t, 0).transfers if tr.src_rank == 1)
    row = MODEL.block_size * MODEL.head_dim * 2
    half = MODEL.num_kv_heads // 2
    assert source_segment_bytes(src) == src.bytes_per_block
    ((j, off, n, pieces),) = segment_gathers(tr.pieces, src, dst, src.bytes_per_block,
                                             dst.bytes_per_block)
    assert (j, off, n) == (0, 0, src.bytes_per_block)
    assert pieces == tuple((0, (i * MODEL.num_kv_heads + half) * row, half * row)
                           for i in range(MODEL.num_layers * 2))


@pytest.mark.parametrize("lengths,n,limit", [([10], 7, 30), ([10, 4], 5, 8), ([100], 3, 32)])
def test_chunks_tile_each_piece(lengths, n, limit):
    chunks = plan_chunks(lengths, n, limit)
    assert len(chunks) == count_chunks(lengths, n, limit)
    assert all(0 < c.nbytes <= limit for c in chunks)
    for p, length in enumerate(lengths):
        assert sum(c.nbytes for c in chunks if c.piece == p) == n * length


def test_direct_order_puts_the_short_runs_first():
    ids = list(range(120)) + list(range(512, 520))
    order = direct_order(ids, 32)
    assert sorted(order) == ids
    assert order[:32] == list(range(96, 120)) + list(range(512, 520))
    assert order[32:64] == list(range(32))
