"""Simulated heterogeneous transfers in one process, compared bit for bit.

One global random KV (random bytes, NaN payloads and all) is sharded into every source rank's
pool by plain tensor indexing (no kernel involved); the plan is made, each source rank packs
one stream per destination peer, each destination rank unpacks, and every destination pool
must equal its poisoned start with exactly its shard of the global KV written into the named
blocks (``torch.equal`` on bytes).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from kvkern.kernels.sharded import pack_for_peer, peer_stream_nbytes, unpack_from_peer
from kvkern.layout import KVLayout, LayoutMismatchError
from kvkern.layout.plan import plan_transfer
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology

NB_SRC, NB_DST = 9, 7
POISON_BYTE = 0xA5  # as tests/conftest.py poisons


@dataclass(frozen=True)
class Case:
    id: str
    heads: int
    layers: int
    src: Parallelism
    dst: Parallelism
    src_dp: int = 0
    dst_dp: int = 0
    src_layout: str = "trtllm"
    dst_layout: str = "trtllm"
    dtype: torch.dtype = torch.bfloat16
    src_split: tuple[int, ...] | None = None
    dst_split: tuple[int, ...] | None = None
    n_blocks: int = 4
    block_size: int = 4
    head_dim: int = 8


P = Parallelism
ADP = dict(attention_dp=True)
CASES = [
    Case("tp1-to-tp2", 8, 3, P(tp_size=1), P(tp_size=2)),
    Case("tp2-to-tp1", 8, 3, P(tp_size=2), P(tp_size=1)),
    Case("tp4-to-tp8", 8, 2, P(tp_size=4), P(tp_size=8)),
    Case("tp8-to-tp2", 8, 2, P(tp_size=8), P(tp_size=2), dtype=torch.float8_e4m3fn),
    Case("h2-tp8-to-tp1-replicated-src", 2, 3, P(tp_size=8), P(tp_size=1)),
    Case("h2-tp2-to-tp8-replicated-dst", 2, 3, P(tp_size=2), P(tp_size=8)),
    Case("h2-tp8-to-tp4-replicated-both", 2, 2, P(tp_size=8), P(tp_size=4), dtype=torch.float32),
    Case("h6-tp3-to-tp2-non-pow2", 6, 2, P(tp_size=3), P(tp_size=2), dtype=torch.float16),
    Case("pp2-to-pp1-uneven", 8, 5, P(tp_size=2, pp_size=2), P(tp_size=4)),
    Case("pp1-to-pp4-uneven", 8, 7, P(tp_size=2), P(tp_size=1, pp_size=4)),
    Case("pp2-explicit-to-pp4", 4, 5, P(pp_size=2), P(tp_size=2, pp_size=4),
         src_split=(1, 4)),
    Case("pp3-to-pp2-explicit-split", 4, 6, P(tp_size=4, pp_size=3), P(tp_size=2, pp_size=2),
         dst_split=(5, 1)),
    Case("tp4pp1-to-tp2pp2-docstring", 8, 6, P(tp_size=4), P(tp_size=2, pp_size=2)),
    Case("adp-src-dp3of4-to-dp1", 8, 3, P(tp_size=4, dp_size=4, **ADP), P(tp_size=2),
         src_dp=3),
    Case("adp-tp8dp4pp2-src-dp3-to-tp4", 8, 4, P(tp_size=8, pp_size=2, dp_size=4, **ADP),
         P(tp_size=4), src_dp=3),
    Case("adp-both-sides", 4, 4, P(tp_size=4, dp_size=2, **ADP),
         P(tp_size=8, pp_size=2, dp_size=4, **ADP), src_dp=1, dst_dp=2),
    Case("trtllm-to-vllm_hnd-tp4-to-tp2", 8, 3, P(tp_size=4), P(tp_size=2),
         dst_layout="vllm_hnd"),
    Case("vllm_nhd-to-cross_layer-tp2pp2-to-tp4", 8, 4, P(tp_size=2, pp_size=2), P(tp_size=4),
         src_layout="vllm_nhd", dst_layout="cross_layer"),
    Case("vllm_flash-to-vllm_hnd-h2-tp4-to-tp1pp2", 2, 3, P(tp_size=4), P(pp_size=2),
         src_layout="vllm_flash", dst_layout="vllm_hnd"),
    Case("one-block-odd-sizes", 6, 3, P(tp_size=2), P(tp_size=3), n_blocks=1, block_size=3,
         head_dim=5, dst_layout="vllm_nhd"),
]


def _topo(case: Case, par: Parallelism, split) -> Topology:
    model = ModelKVSpec(num_layers=case.layers, num_kv_heads=case.heads, head_dim=case.head_dim,
                        block_size=case.block_size, dtype=case.dtype, layer_split=split)
    return Topology(model=model, parallel=par)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _write_shard(topo: Topology, rank: int, layout: KVLayout, pool, kv: torch.Tensor,
                 block_ids) -> None:
    """Write request block k of the global KV bytes ``kv`` [n, L, 2, H, T, D*itemsize] into
    pool block ``block_ids[k]``, restricted to the rank's layers and heads (plain indexing)."""
    (l0, l1), (h0, h1) = topo.layer_range(rank), topo.head_range(rank)
    tensors = layout.tensors(pool)
    for k, b in enumerate(block_ids):
        if b < 0:
            continue
        if layout.per_layer:
            for i, t in enumerate(tensors):
                layout.canonical_view(_bytes(t))[b] = kv[k, l0 + i, :, h0:h1]
        else:
            layout.canonical_view(_bytes(tensors[0]))[b] = kv[k, l0:l1, :, h0:h1]


def _poisoned_pool(layout: KVLayout):
    pool = layout.allocate()
    for t in layout.tensors(pool):
        _bytes(t).fill_(POISON_BYTE)
    return pool


def _random_kv(topo: Topology, n: int, gen: torch.Generator) -> torch.Tensor:
    m = topo.model
    shape = (n, m.num_layers, 2, m.num_kv_heads, m.block_size, m.head_dim * m.itemsize)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def _ids(nb: int, n: int, rng: random.Random, pad: set[int]) -> list[int]:
    ids = rng.sample(range(nb), n)
    return [-1 if k in pad else b for k, b in enumerate(ids)]


def _simulate(case: Case, *, pad: frozenset[int] = frozenset(), tensor_ids: bool = False,
              one_send_buffer: bool = False, backend: str = "auto"):
    src = _topo(case, case.src, case.src_split)
    dst = _topo(case, case.dst, case.dst_split)
    gen = torch.Generator().manual_seed(hash(case.id) & 0xFFFF)
    rng = random.Random(case.id)
    kv = _random_kv(src, case.n_blocks, gen)
    other_kv = _random_kv(src, case.n_blocks, gen)  # what other DP groups hold
    src_ids = _ids(NB_SRC, case.n_blocks, rng, set(pad))
    dst_ids = _ids(NB_DST, case.n_blocks, rng, set(pad))

    src_group = set(src.ranks_of_dp(case.src_dp))
    src_pools, src_layouts = {}, {}
    for r in range(src.world_size):
        layout = src.local_layout(r, NB_SRC, case.src_layout)
        pool = layout.allocate(fill="random", generator=gen)
        _write_shard(src, r, layout, pool, kv if r in src_group else other_kv, src_ids)
        src_pools[r], src_layouts[r] = pool, layout

    dst_pools, dst_layouts, expected = {}, {}, {}
    dst_group = set(dst.ranks_of_dp(case.dst_dp))
    for r in range(dst.world_size):
        layout = dst.local_layout(r, NB_DST, case.dst_layout)
        dst_pools[r], dst_layouts[r] = _poisoned_pool(layout), layout
        expected[r] = _poisoned_pool(layout)
        if r in dst_group:
            _write_shard(dst, r, layout, expected[r], kv, dst_ids)

    plan = plan_transfer(src, case.src_dp, dst, case.dst_dp)
    plan.validate()
    if tensor_ids:
        src_ids, dst_ids = torch.tensor(src_ids), torch.tensor(dst_ids)

    # Source side: one stream per destination peer (optionally slices of one send buffer).
    streams = {}
    for s in plan.src_ranks:
        peers = plan.for_source(s)
        big = None
        if one_send_buffer:
            big = torch.empty(sum(t.nbytes(case.n_blocks) for t in peers), dtype=torch.uint8)
        offset = 0
        for t in peers:
            out = None
            if big is not None:
                out = big[offset:offset + t.nbytes(case.n_blocks)]
                offset += t.nbytes(case.n_blocks)
            streams[(s, t.dst_rank)] = pack_for_peer(
                plan, s, t.dst_rank, src_pools[s], src_layouts[s], src_ids, out=out,
                backend=backend)
            assert streams[(s, t.dst_rank)].numel() == peer_stream_nbytes(
                plan, s, t.dst_rank, case.n_blocks)
    # "Network": the destination receives its own copy of each stream.
    for (s, d), stream in streams.items():
        unpack_from_peer(plan, s, d, stream.clone(), dst_pools[d], dst_layouts[d], dst_ids,
                         backend=backend)

    for r in range(dst.world_size):
        got = dst_layouts[r].tensors(dst_pools[r])
        want = dst_layouts[r].tensors(expected[r])
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(_bytes(g), _bytes(w)), f"{case.id}: dst rank {r} tensor {i} differs"
    return plan


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_simulated_transfer_bit_exact(case):
    _simulate(case)


@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[13]], ids=lambda c: c.id)
def test_padding_ids_tensor_ids_and_one_send_buffer(case):
    _simulate(case, pad=frozenset({1}), tensor_ids=True, one_send_buffer=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [CASES[12], CASES[18]], ids=lambda c: c.id)
def test_triton_backend(case):
    # The Triton kernel (interpreted on CPU) through the same sharded path.
    _simulate(dataclasses.replace(case, n_blocks=2, head_dim=4), pad=frozenset({0}),
              backend="triton")


def test_replicas_spread_over_source_ranks():
    # 2 heads on TP8: 4 replicas per head; 4 destination ranks (TP1 PP4) each need both heads:
    # each of the 8 source ranks serves exactly one destination rank.
    case = Case("spread", 2, 4, P(tp_size=8), P(pp_size=4))
    plan = _simulate(case)
    assert sorted(t.src_rank for t in plan.transfers) == list(range(8))


def _small_plan():
    case = Case("err", 8, 2, P(tp_size=2), P(tp_size=4))
    src, dst = _topo(case, case.src, None), _topo(case, case.dst, None)
    plan = plan_transfer(src, 0, dst, 0)
    return plan, src, dst


def test_wrong_layout_raises_naming_both():
    plan, src, dst = _small_plan()
    wrong = dst.local_layout(0, NB_SRC)  # 2 heads, the source rank holds 4
    with pytest.raises(LayoutMismatchError, match="num_heads 2.*num_heads 4"):
        pack_for_peer(plan, 0, 0, wrong.allocate(), wrong, [0])
    layout = src.local_layout(0, NB_SRC)
    bad_dtype = layout.with_sizes(dtype=torch.float16)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        pack_for_peer(plan, 0, 0, bad_dtype.allocate(), bad_dtype, [0])


def test_wrong_buffer_or_pair_raises():
    plan, src, dst = _small_plan()
    s_layout, d_layout = src.local_layout(0, NB_SRC), dst.local_layout(0, NB_DST)
    stream = pack_for_peer(plan, 0, 0, s_layout.allocate(fill="random"), s_layout, [3, 1])
    with pytest.raises(ValueError, match="bytes"):
        unpack_from_peer(plan, 0, 0, stream[:-2], d_layout.allocate(), d_layout, [0, 1])
    with pytest.raises(ValueError, match="contiguous"):
        unpack_from_peer(plan, 0, 0, stream.view(2, -1).t(), d_layout.allocate(), d_layout,
                         [0, 1])
    with pytest.raises(KeyError, match="source rank 1 to destination rank 0"):
        pack_for_peer(plan, 1, 0, s_layout.allocate(), s_layout, [0])


def test_zero_blocks_is_empty_stream():
    plan, src, dst = _small_plan()
    s_layout, d_layout = src.local_layout(0, NB_SRC), dst.local_layout(0, NB_DST)
    stream = pack_for_peer(plan, 0, 0, s_layout.allocate(), s_layout, [])
    assert stream.numel() == 0 and stream.dtype == torch.uint8
    pool = _poisoned_pool(d_layout)
    unpack_from_peer(plan, 0, 0, stream, pool, d_layout, [])
    assert bool((_bytes(pool) == POISON_BYTE).all())
