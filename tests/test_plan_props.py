"""Property tests of topologies and transfer plans (pure Python, no bytes moved).

Checked independently of ``TransferPlan.validate`` (which is also exercised): every
destination rank's (layers x heads) is covered exactly once, no piece lies outside either
side's holdings, replicated heads are fetched once and spread evenly over their replicas, and
unlike models raise ``IncompatibleTopologyError`` with the transfer path's fallback reason.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkern.layout.plan import TransferPlan, plan_transfer
from kvkern.layout.topology import (
    IncompatibleTopologyError,
    ModelKVSpec,
    Parallelism,
    RankCoords,
    Topology,
)

HEADS = [1, 2, 3, 4, 6, 8, 12]
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layer_splits(draw, num_layers: int, pp: int):
    """None (the default split) or an explicit split of num_layers into pp positive parts."""
    if pp == 1 or draw(st.booleans()):
        return None
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1,
                               max_size=pp - 1)))
    bounds = [0, *cuts, num_layers]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


@st.composite
def topologies(draw, heads: int, layers: int):
    divisors = [a for a in range(1, heads + 1) if heads % a == 0]
    attn_tp = draw(st.sampled_from(divisors + [heads * k for k in (2, 3, 4) if heads * k <= 16]))
    dp = draw(st.integers(1, 3))
    attention_dp = dp > 1 or draw(st.booleans())
    pp = draw(st.integers(1, min(layers, 4)))
    split = draw(layer_splits(layers, pp))
    model = ModelKVSpec(num_layers=layers, num_kv_heads=heads, head_dim=8, block_size=16,
                        dtype="bfloat16", layer_split=split)
    par = Parallelism(tp_size=attn_tp * dp, pp_size=pp, dp_size=dp, attention_dp=attention_dp)
    return Topology(model=model, parallel=par), draw(st.integers(0, dp - 1))


@st.composite
def topology_pairs(draw):
    heads = draw(st.sampled_from(HEADS))
    layers = draw(st.integers(1, 9))
    src, src_dp = draw(topologies(heads, layers))
    dst, dst_dp = draw(topologies(heads, layers))
    return src, src_dp, dst, dst_dp


def _cells(layers, heads):
    return {(layer, h) for layer in range(*layers) for h in range(*heads)}


@SETTINGS
@given(topology_pairs())
def test_plan_covers_each_destination_cell_exactly_once(pair):
    src, src_dp, dst, dst_dp = pair
    plan = plan_transfer(src, src_dp, dst, dst_dp)
    received: dict[int, Counter] = defaultdict(Counter)
    src_group, dst_group = set(src.ranks_of_dp(src_dp)), set(dst.ranks_of_dp(dst_dp))
    unit = 2 * 16 * 8 * 2
    for t in plan.transfers:
        assert t.src_rank in src_group and t.dst_rank in dst_group
        offset = 0
        for p in t.pieces:
            assert (p.src_rank, p.dst_rank) == (t.src_rank, t.dst_rank)
            cells = _cells(p.layers, p.heads)
            assert cells, p
            # Inside both sides' holdings.
            assert cells <= _cells(src.layer_range(p.src_rank), src.head_range(p.src_rank))
            assert cells <= _cells(dst.layer_range(p.dst_rank), dst.head_range(p.dst_rank))
            # Local ranges name the same cells in each side's pool.
            (sl0, _), (sh0, _) = src.layer_range(p.src_rank), src.head_range(p.src_rank)
            (dl0, _), (dh0, _) = dst.layer_range(p.dst_rank), dst.head_range(p.dst_rank)
            assert p.src_layers == (p.layers[0] - sl0, p.layers[1] - sl0)
            assert p.src_heads == (p.heads[0] - sh0, p.heads[1] - sh0)
            assert p.dst_layers == (p.layers[0] - dl0, p.layers[1] - dl0)
            assert p.dst_heads == (p.heads[0] - dh0, p.heads[1] - dh0)
            # Dense stream offsets.
            assert p.block_offset == offset and p.block_nbytes == len(cells) * unit
            offset += p.block_nbytes
            received[p.dst_rank].update(cells)
        assert t.block_nbytes == offset
    # Exactly once: every destination rank of the group, every one of its cells, count 1.
    assert set(received) == dst_group
    for d, counts in received.items():
        assert set(counts) == _cells(dst.layer_range(d), dst.head_range(d)), d
        assert set(counts.values()) == {1}, d
    # One message per pair.
    pairs = [(t.src_rank, t.dst_rank) for t in plan.transfers]
    assert len(pairs) == len(set(pairs))
    assert pairs == sorted(pairs, key=lambda sd: (sd[1], sd[0]))
    plan.validate()


@SETTINGS
@given(topology_pairs())
def test_replicated_heads_spread_round_robin(pair):
    src, src_dp, dst, dst_dp = pair
    plan = plan_transfer(src, src_dp, dst, dst_dp)
    rep = src.head_replicas
    # Demands on each (source stage, head) and which replica served each.
    served: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for p in plan.pieces:
        pp = src.coords(p.src_rank).pp
        for h in range(*p.heads):
            served[(pp, h)][p.src_rank] += 1
    for (pp, h), counts in served.items():
        if rep == 1:
            assert len(counts) == 1  # one holder: nothing to spread
            continue
        replicas = [r for r in src.ranks_of_dp(src_dp)
                    if src.coords(r).pp == pp and src.head_range(r) == (h, h + 1)]
        assert len(replicas) == rep and set(counts) <= set(replicas)
        loads = [counts.get(r, 0) for r in replicas]
        assert max(loads) - min(loads) <= 1, (pp, h, loads)


@SETTINGS
@given(topology_pairs())
def test_plan_serialises_round_trip(pair):
    src, src_dp, dst, dst_dp = pair
    plan = plan_transfer(src, src_dp, dst, dst_dp)
    wire = json.loads(json.dumps(plan.to_dict()))
    assert TransferPlan.from_dict(wire) == plan
    assert plan.total_bytes(3) == sum(
        (dst.layer_range(d)[1] - dst.layer_range(d)[0])
        * (dst.head_range(d)[1] - dst.head_range(d)[0]) * 2 * 16 * 8 * 2 * 3
        for d in dst.ranks_of_dp(dst_dp))


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.booleans())
def test_rank_mapping_is_a_bijection(attn_tp, pp, dp, adp):
    if dp > 1:
        adp = True
    par = Parallelism(tp_size=attn_tp * dp, pp_size=pp, dp_size=dp, attention_dp=adp)
    seen = set()
    for r in range(par.world_size):
        c = par.coords(r)
        assert isinstance(c, RankCoords)
        assert par.rank_of(dp=c.dp, pp=c.pp, tp=c.tp) == r
        # TRT-LLM's rule (CP = 1): tp index = r % TP, pp = r // TP.
        assert c.pp == r // par.tp_size
        assert c.dp * par.attn_tp_size + c.tp == r % par.tp_size
        seen.add(c)
    assert len(seen) == par.world_size
    groups = [set(par.ranks_of_dp(g)) for g in range(dp)]
    assert set().union(*groups) == set(range(par.world_size))
    assert sum(map(len, groups)) == par.world_size


@SETTINGS
@given(st.integers(1, 40), st.integers(1, 8))
def test_default_layer_split_even_earlier_stages_larger(layers, pp):
    if pp > layers:
        with pytest.raises(ValueError, match="smaller than pp_size"):
            _topo(layers=layers, pp=pp)
        return
    topo = _topo(layers=layers, pp=pp)
    split = topo.layer_split
    assert sum(split) == layers and len(split) == pp
    assert max(split) - min(split) <= 1
    assert list(split) == sorted(split, reverse=True)
    assert topo.stage_layers[0][0] == 0 and topo.stage_layers[-1][1] == layers


def _topo(*, layers=8, heads=8, tp=1, pp=1, split=None, **model) -> Topology:
    spec = dict(num_layers=layers, num_kv_heads=heads, head_dim=8, block_size=16,
                dtype="bfloat16", layer_split=split) | model
    return Topology(model=ModelKVSpec(**spec), parallel=Parallelism(tp_size=tp, pp_size=pp))


def test_explicit_layer_split_honoured_and_validated():
    topo = _topo(layers=7, pp=3, split=(1, 4, 2))
    assert topo.stage_layers == ((0, 1), (1, 5), (5, 7))
    assert topo.layer_range(2) == (5, 7)
    with pytest.raises(ValueError, match="sums to 6, num_layers is 7"):
        _topo(layers=7, pp=3, split=(1, 3, 2))
    with pytest.raises(ValueError, match="3 stages, pp_size is 2"):
        _topo(layers=7, pp=2, split=(1, 4, 2))
    with pytest.raises(ValueError, match=r"layer_split\[1\] must be a positive int"):
        _topo(layers=7, pp=3, split=(4, 0, 3))


def test_gqa_replication_heads():
    topo = _topo(heads=2, tp=8)
    assert [topo.head_range(r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert topo.head_replicas == 4
    assert _topo(heads=6, tp=3).head_range(2) == (4, 6)


@pytest.mark.parametrize("field,a,b", [
    ("num_layers", 8, 6), ("num_kv_heads", 8, 4), ("head_dim", 8, 16),
    ("block_size", 16, 32), ("dtype", "bfloat16", "float16"),
])
def test_incompatible_models_raise_with_reason(field, a, b):
    src, dst = _topo(**{field: a}), _topo(**{field: b})
    with pytest.raises(IncompatibleTopologyError) as err:
        plan_transfer(src, 0, dst, 0)
    assert err.value.reason == "incompatible_topology"
    assert field in err.value.detail and repr(a) in err.value.detail and repr(b) in err.value.detail
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("heads,tp", [(8, 3), (6, 4), (4, 6), (3, 2)])
def test_tp_neither_divides_nor_multiple_raises(heads, tp):
    with pytest.raises(IncompatibleTopologyError) as err:
        _topo(heads=heads, tp=tp)
    assert err.value.reason == "incompatible_topology"
    assert str(tp) in err.value.detail and str(heads) in err.value.detail


def test_attention_dp_uses_tp_per_dp_group():
    model = ModelKVSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16")
    # TP8, DP4: attention TP 2 per group; heads split over 2 ranks, not 8.
    topo = Topology(model=model, parallel=Parallelism(tp_size=8, dp_size=4, attention_dp=True))
    assert topo.ranks_of_dp(3) == (6, 7)
    assert topo.head_range(6) == (0, 1) and topo.head_range(7) == (1, 2)
    # TP 6 DP 2 -> attention TP 3: does not fit 2 heads.
    with pytest.raises(IncompatibleTopologyError):
        Topology(model=model, parallel=Parallelism(tp_size=6, dp_size=2, attention_dp=True))
    with pytest.raises(ValueError, match="needs attention_dp"):
        Parallelism(tp_size=4, dp_size=2)
    with pytest.raises(ValueError, match="source DP rank 4 out of range"):
        plan_transfer(topo, 4, topo, 0)


def test_plan_travels_as_msgpack():
    msgspec = pytest.importorskip("msgspec")
    model = ModelKVSpec(num_layers=6, num_kv_heads=2, head_dim=8, block_size=16,
                        dtype="float8_e4m3fn")
    src = Topology(model=model, parallel=Parallelism(tp_size=8, pp_size=2, dp_size=2,
                                                     attention_dp=True))
    dst = Topology(model=model, parallel=Parallelism(tp_size=2, pp_size=3))
    plan = plan_transfer(src, 1, dst, 0)
    wire = msgspec.msgpack.encode(plan.to_dict())
    assert TransferPlan.from_dict(msgspec.msgpack.decode(wire)) == plan


def test_from_dict_rejects_tampered_plans():
    src, dst = _topo(tp=2), _topo(tp=4)
    wire = plan_transfer(src, 0, dst, 0).to_dict()
    bad = json.loads(json.dumps(wire))
    bad["transfers"][0]["pieces"][0]["heads"] = [0, 3]
    with pytest.raises(ValueError, match="outside"):
        TransferPlan.from_dict(bad)
    bad = json.loads(json.dumps(wire))
    del bad["transfers"][-1]
    with pytest.raises(ValueError, match="receives"):
        TransferPlan.from_dict(bad)
    bad = json.loads(json.dumps(wire))
    bad["transfers"][0]["block_nbytes"] = True
    with pytest.raises(ValueError, match="non-negative int"):
        TransferPlan.from_dict(bad)
    with pytest.raises(ValueError, match="version"):
        TransferPlan.from_dict({**wire, "version": 99})


def test_layout_name_and_split_are_not_compatibility():
    src = _topo(layers=6, pp=2, split=(5, 1))
    dst = _topo(layers=6, pp=2)
    plan = plan_transfer(src, 0, dst, 0)
    plan.validate()
    assert src.local_layout(0, 4, "vllm_hnd").num_layers == 5
    assert dst.local_layout(1, 4).num_layers == 3
