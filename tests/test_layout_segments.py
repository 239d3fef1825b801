"""The shared layout math of the pull path (:mod:`kvkern.layout.segments`,
:mod:`kvkern.layout.chunks`), on plain layouts: no pool, no network."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.layout.chunks import (
    chunk_runs,
    count_chunks,
    plan_chunks,
    send_chunks,
    stream_plan,
)
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


def _runs(ids):
    """Maximal runs of consecutive ids, as lists."""
    out = []
    for b in ids:
        if out and b == out[-1][-1] + 1:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def test_stream_plan_lands_long_runs_in_place_and_sends_the_short_ones_first():
    ids = list(range(40)) + [100, 101] + [200, 201] + list(range(300, 304))
    order, sizes = stream_plan(ids, 32, 4)
    assert order == [100, 101, 200, 201] + list(range(40)) + list(range(300, 304))
    assert sizes == [4, 32, 8, 4]
    assert chunk_runs(ids, 32, 4) == [32, 8, 4, 4]  # the order kept: short runs in between
    assert stream_plan([], 32, 4) == ([], [])
    # runs that land in place may take larger chunks than those through staging
    assert stream_plan(ids, 2, 4, 64) == (order, [2, 2, 40, 4])
    assert chunk_runs(ids, 2, 4, 16) == [16, 16, 8, 2, 2, 4]


def test_send_chunks_sends_runs_from_the_pool_and_packs_the_rest():
    """Pool blocks 10..13, then 2 and 5 (short runs), then 20..25 (block length 10, runs
    of 4 or more leave from the pool in chunks of up to 50 bytes, the rest in chunks of
    up to 20 bytes, packed)."""
    ids = [10, 11, 12, 13, 2, 5, 20, 21, 22, 23, 24, 25]
    got = [(c.b0, c.b1) for c in send_chunks(10, ids, 20, 50, [], 4)]
    assert got == [(0, 4), (4, 6), (6, 11), (11, 12)]
    assert all(c.lo == 0 and c.hi == (c.b1 - c.b0) * 10 for c in send_chunks(10, ids, 20, 50,
                                                                             [], 4))
    # the destination's plan still cuts: a run split by it is sent in two parts
    got = [(c.b0, c.b1) for c in send_chunks(10, ids, 20, 50, [8, 4], 4)]
    assert got == [(0, 4), (4, 6), (6, 8), (8, 12)]
    # a run limit below the pack limit is the pack limit; a block above it is sliced
    assert [(c.b0, c.b1) for c in send_chunks(10, ids[:4], 20, 10, [], 4)] == [(0, 2), (2, 4)]
    assert send_chunks(30, ids[:2], 20, 1000, [], 1) == plan_chunks([30], 2, 20)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.data())
def test_sent_chunks_tile_the_stream_and_only_runs_exceed_the_pack_limit(
        runs, per, more, min_run, data):
    """Any pool blocks (runs of consecutive ids with gaps) and destination plan: the chunks
    tile the served blocks in order, none across a planned boundary; a chunk above the pack
    limit (``per`` blocks) is a part of one run of at least ``min_run`` blocks (sent from the
    pool), within the run limit."""
    ids, at = [], 0
    for n, gap in runs:
        at += gap + 1
        ids += list(range(at, at + n))
        at += n
    n = len(ids)
    plan = data.draw(st.lists(st.integers(1, 9), max_size=6))
    per_run = per + more
    chunks = send_chunks(10, ids, per * 10, per_run * 10, plan, min_run)
    assert [c.b0 for c in chunks] == [0, *(c.b1 for c in chunks[:-1])]
    assert chunks[-1].b1 == n and all(c.lo == 0 and c.hi == (c.b1 - c.b0) * 10 for c in chunks)
    cuts = {sum(plan[:i]) for i in range(1, len(plan) + 1)}
    assert not any(c.b0 < cut < c.b1 for c in chunks for cut in cuts)
    # block -> its run, a run ending at a gap in the ids or at a planned cut
    run_of = list(itertools.accumulate(
        int(b > 0 and (ids[b] != ids[b - 1] + 1 or b in cuts)) for b in range(n)))
    length = collections.Counter(run_of)
    for c in chunks:
        part = ids[c.b0:c.b1]
        consecutive = part == list(range(part[0], part[0] + len(part)))
        assert c.b1 - c.b0 <= (per_run if consecutive else per)
        if c.b1 - c.b0 > per:  # a part of one run long enough to leave from the pool
            assert consecutive and length[run_of[c.b0]] >= min_run
        long = {run_of[b] for b in range(c.b0, c.b1) if length[run_of[b]] >= min_run}
        if long:  # a long run's blocks share a chunk with no other run's: nothing to pack
            assert {run_of[b] for b in range(c.b0, c.b1)} == long and len(long) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=30), st.integers(1, 9),
       st.integers(1, 6), st.randoms(use_true_random=False))
def test_chunk_plans_tile_the_ids_and_never_split_a_long_run_badly(run_lens, per, min_run,
                                                                   rnd):
    """Any ascending ids: the plan covers them exactly; each chunk is at most ``per``
    blocks; a chunk made from a long run holds consecutive ids (it lands in place) and
    every long run is cut only every ``per`` blocks."""
    ids, at = [], 0
    for n in run_lens:
        at += rnd.randint(1, 5)  # a gap: runs stay maximal
        ids += list(range(at, at + n))
        at += n
    order, sizes = stream_plan(ids, per, min_run)
    assert sorted(order) == ids and sum(sizes) == len(ids)
    assert all(1 <= k <= per for k in sizes)
    pos, long_runs = 0, [r for r in _runs(ids) if len(r) >= min_run]
    chunks = []
    for k in sizes:
        chunks.append(order[pos:pos + k])
        pos += k
    landed = [c for c in chunks if len(_runs(c)) == 1]
    for r in long_runs:  # each long run is whole chunks of consecutive ids
        mine = [c for c in chunks if set(c) <= set(r)]
        assert sum(map(len, mine)) == len(r)
        assert all(len(c) == per for c in mine[:-1])
    assert sum(map(len, landed)) >= sum(map(len, long_runs))


@pytest.mark.parametrize("blocks,n,limit,want", [
    ([3, 1, 4], 8, 4 * 10, [3, 1, 4]),        # the plan as asked
    ([3, 1, 4], 8, 2 * 10, [2, 1, 1, 2, 2]),  # each of its chunks cut to the source's limit
    ([3, 1, 4], 5, 4 * 10, [3, 1, 1]),        # a partial serve ends the plan
])
def test_plan_chunks_follows_the_destinations_plan(blocks, n, limit, want):
    chunks = plan_chunks([10], n, limit, blocks)
    assert [c.b1 - c.b0 for c in chunks] == want
    assert count_chunks([10], n, limit, blocks) == len(chunks)
    assert all(c.lo == 0 and c.hi == (c.b1 - c.b0) * 10 for c in chunks)
    assert [c.b0 for c in chunks[1:]] == [c.b1 for c in chunks[:-1]] and chunks[-1].b1 == n
    with pytest.raises(ValueError, match="one piece"):
        plan_chunks([10, 10], n, limit, blocks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(1, 7), st.data())
def test_a_planned_stream_is_counted_and_tiled_exactly(blocks, per, data):
    """Any plan, served whole or in part: the chunks tile the served blocks in order, none
    above the limit, none across a planned boundary, and count_chunks counts them."""
    n = data.draw(st.integers(0, sum(blocks)))
    chunks = plan_chunks([10], n, per * 10, blocks)
    assert count_chunks([10], n, per * 10, blocks) == len(chunks)
    assert [c.b0 for c in chunks] == [0, *(c.b1 for c in chunks[:-1])][:len(chunks)]
    assert sum(c.b1 - c.b0 for c in chunks) == n and all(0 < c.b1 - c.b0 <= per for c in chunks)
    cuts = {sum(blocks[:i]) for i in range(1, len(blocks))}
    assert not any(c.b0 < cut < c.b1 for c in chunks for cut in cuts)
