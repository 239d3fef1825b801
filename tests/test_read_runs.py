"""The byte runs a one-sided read moves (:func:`kvkern.layout.segments.segment_runs`, read
as :func:`~kvkern.layout.segments.segment_gathers`), checked
without UCX: for random TP/PP topologies on both sides and TRT-LLM / HND pools, every
destination rank applies its pairs' runs as plain memory copies between the real pool
addresses that ``RankKV.read_segments`` describes (what ``ucp_get_nbx`` would copy), with
the source blocks at shuffled pool ids, and must end up with exactly its layers and heads
of the model's KV, bit for bit, while the blocks it did not receive keep their poison."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.kernels.reference import reference_pack, reference_unpack
from kvkern.layout.plan import plan_transfer
from kvkern.layout.segments import segment_gathers, segment_runs, source_segment_bytes
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer.kvgroup import RankKV

READABLE = ("trtllm", "vllm_hnd")


def _pool(topo: Topology, rank: int, n: int, name: str, fill: int | None = None) -> RankKV:
    lay = topo.local_layout(rank, n, name)
    pool = lay.allocate(fill="zeros")
    if fill is not None:
        for t in lay.tensors(pool):
            t.view(torch.uint8).fill_(fill)
    return RankKV(rank, lay, pool)


@st.composite
def cases(draw):
    layers = draw(st.sampled_from([2, 4]))
    heads = draw(st.sampled_from([2, 4]))
    model = ModelKVSpec(num_layers=layers, num_kv_heads=heads, head_dim=4, block_size=2,
                        dtype="float16")

    def par():
        return Parallelism(tp_size=draw(st.sampled_from([t for t in (1, 2, 4) if t <= heads])),
                           pp_size=draw(st.sampled_from([p for p in (1, 2) if p <= layers])))

    return (Topology(model=model, parallel=par()), Topology(model=model, parallel=par()),
            draw(st.sampled_from(READABLE)), draw(st.sampled_from(READABLE)),
            draw(st.integers(1, 4)), draw(st.randoms(use_true_random=False)))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_segment_runs_move_exactly_each_ranks_layers_and_heads(case):
    src_topo, dst_topo, src_name, dst_name, n, rng = case
    m = src_topo.model
    n_pool = 2 * n + 3
    # the model's KV of n logical blocks, canonical [n, L, 2, H, T, D]
    kv = torch.randint(-30000, 30000, (n, m.num_layers, 2, m.num_kv_heads, m.block_size,
                                       m.head_dim), dtype=torch.int16,
                       generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    kv = kv.view(torch.float16)
    src_ids = rng.sample(range(n_pool), n)
    dst_ids = rng.sample(range(n_pool), n)
    sources = {}
    for r in src_topo.ranks_of_dp(0):
        rkv = _pool(src_topo, r, n_pool, src_name)
        (l0, l1), (h0, h1) = src_topo.layer_range(r), src_topo.head_range(r)
        reference_unpack(kv[:, l0:l1, :, h0:h1].contiguous(), rkv.pool, rkv.layout, src_ids)
        sources[r] = rkv
    plan = plan_transfer(src_topo, 0, dst_topo, 0)
    for d in dst_topo.ranks_of_dp(0):
        dst = _pool(dst_topo, d, n_pool, dst_name, fill=0xA5)
        dsegs = dst.read_segments
        for tr in plan.for_destination(d):
            src = sources[tr.src_rank]
            ssegs = src.read_segments
            assert source_segment_bytes(src.layout) == ssegs.nbytes
            runs = segment_runs(tr.pieces, src.layout, dst.layout, ssegs.nbytes, dsegs.nbytes)
            assert sum(r[4] for r in runs) == tr.block_nbytes
            # the reads: each gather is contiguous source bytes, scattered over its pieces
            gathers = segment_gathers(tr.pieces, src.layout, dst.layout, ssegs.nbytes,
                                      dsegs.nbytes)
            assert sorted((j, so + sum(p[2] for p in pieces[:i]), *piece)
                          for j, so, _, pieces in gathers
                          for i, piece in enumerate(pieces)) == sorted(runs)
            for j, s_off, total, pieces in gathers:
                assert s_off + total <= ssegs.nbytes and total == sum(p[2] for p in pieces)
                for s_id, d_id in zip(src_ids, dst_ids, strict=True):
                    at = ssegs.bases[j] + s_id * ssegs.stride + s_off
                    for k, d_off, nbytes in pieces:
                        assert d_off + nbytes <= dsegs.nbytes
                        ctypes.memmove(dsegs.bases[k] + d_id * dsegs.stride + d_off, at,
                                       nbytes)
                        at += nbytes
        (l0, l1), (h0, h1) = dst_topo.layer_range(d), dst_topo.head_range(d)
        got = reference_pack(dst.pool, dst.layout, dst_ids)
        assert torch.equal(got.view(torch.int16),
                           kv[:, l0:l1, :, h0:h1].contiguous().view(torch.int16))
        untouched = [b for b in range(n_pool) if b not in set(dst_ids)]
        rest = reference_pack(dst.pool, dst.layout, untouched).view(torch.uint8)
        assert bool((rest == 0xA5).all())


@pytest.mark.parametrize("change", [None, "key", "more_key", "base", "stride", "segment",
                                    "block"])
def test_a_grant_must_name_the_registered_pool_the_state_announces(change):
    """A source whose state announces its registered pool (``read_index``) may grant reads of
    that pool only: a grant naming another key, address, stride or segment size, or a block
    beyond the pool, is refused before UCX unpacks any key."""
    from types import SimpleNamespace

    from kvkern.xfer.messages import ReadGrant, Status
    from kvkern.xfer.pulljob import Fallback
    from kvkern.xfer.receive import ReadReceiver
    from kvkern.xfer.state import ReadIndex

    model = ModelKVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2,
                        dtype="float16")
    topo = Topology(model=model, parallel=Parallelism(tp_size=1, pp_size=1))
    n_pool = 8
    src, dst = _pool(topo, 0, n_pool, "vllm_hnd"), _pool(topo, 0, n_pool, "vllm_hnd")
    segs = src.read_segments
    keys = tuple(b"key%d" % j for j in range(len(segs.bases)))
    idx = ReadIndex(keys=keys, bases=segs.bases, stride=segs.stride,
                    segment_bytes=segs.nbytes, blocks=n_pool, dir_key=b"d", dir_base=0,
                    dir_buckets=8)
    job = SimpleNamespace(source_dp=0, state=SimpleNamespace(
        read_indexes={(0, 0): idx}, reads={(0, 0): "canonical"}, layouts={}, topology=topo))
    (pair,) = plan_transfer(topo, 0, topo, 0).for_destination(0)
    fields = dict(read_rkey=keys[0], read_more_rkeys=list(keys[1:]), read_base=segs.bases[0],
                  read_more_bases=list(segs.bases[1:]), read_stride=segs.stride,
                  read_segment_bytes=segs.nbytes, read_blocks=[1, 5])
    if change == "key":
        fields["read_rkey"] = b"other"
    elif change == "more_key":
        fields["read_more_rkeys"] = [b"other", *keys[2:]]
    elif change == "base":
        fields["read_base"] += 64
    elif change == "stride":
        fields["read_stride"] *= 2
    elif change == "segment":
        fields["read_segment_bytes"] //= 2
    elif change == "block":
        fields["read_blocks"] = [1, n_pool]
    grant = ReadGrant(transfer_id=1, status=Status.OK, served_blocks=2, block_hashes=[1, 2],
                      total_bytes=2 * pair.block_nbytes, **fields)
    if change is None:
        assert ReadReceiver.check_offer(None, job, pair, grant, dst) is dst.read_segments
        return
    with pytest.raises(Fallback, match="outside the registered pool"):
        ReadReceiver.check_offer(None, job, pair, grant, dst)


@pytest.mark.parametrize("layout", ["trtllm", "vllm_hnd"])
@pytest.mark.parametrize("keys", [1, 2, 4, 16])
def test_an_offer_in_more_segments_than_a_block_has_layers_is_refused(layout, keys):
    """A canonical offer's segments are a block's whole bytes or one per layer: an offer in
    more (each smaller) would multiply the reads the destination plans and posts, so it is
    refused, whatever its sizes add up to. The source's state announces no read index here
    (a grant alone)."""
    from types import SimpleNamespace

    from kvkern.xfer.messages import ReadGrant, Status
    from kvkern.xfer.pulljob import Fallback
    from kvkern.xfer.receive import ReadReceiver

    model = ModelKVSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4,
                        dtype="float16")
    topo = Topology(model=model, parallel=Parallelism(tp_size=1, pp_size=1))
    dst = _pool(topo, 0, 8, layout)
    job = SimpleNamespace(source_dp=0, state=SimpleNamespace(
        read_indexes={}, reads={(0, 0): "canonical"}, layouts={}, topology=topo))
    (pair,) = plan_transfer(topo, 0, topo, 0).for_destination(0)
    seg = pair.block_nbytes // keys
    grant = ReadGrant(transfer_id=1, status=Status.OK, served_blocks=2, block_hashes=[1, 2],
                      total_bytes=2 * pair.block_nbytes, read_rkey=b"k0",
                      read_more_rkeys=[b"k%d" % j for j in range(1, keys)], read_base=4096,
                      read_more_bases=[4096 + j * (1 << 20) for j in range(1, keys)],
                      read_stride=seg, read_segment_bytes=seg, read_blocks=[1, 5])
    if keys in (1, model.num_layers):
        assert ReadReceiver.check_offer(None, job, pair, grant, dst) is dst.read_segments
        return
    with pytest.raises(Fallback, match=f"as {keys} segments"):
        ReadReceiver.check_offer(None, job, pair, grant, dst)
