"""KVLayout: constructors, sizes, strides, checks that name both sides."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvkern.layout import LAYOUT_CONSTRUCTORS, Axis, KVLayout, LayoutMismatchError, allocate_staging

SIZES = dict(num_blocks=10, num_layers=3, num_heads=4, block_size=16, head_dim=8,
             dtype=torch.float16)

EXPECTED_SHAPES = {
    "trtllm": (10, 3, 2, 4, 16, 8),
    "vllm_flash": (2, 10, 16, 4, 8),
    "vllm_nhd": (10, 2, 16, 4, 8),
    "vllm_hnd": (10, 2, 4, 16, 8),
    "vllm_cpu": (10, 4, 2, 16, 8),
    "vllm_v1": (10, 4, 16, 2, 8),
    "cross_layer": (10, 3, 2, 16, 4, 8),
}


@pytest.mark.parametrize("name", sorted(LAYOUT_CONSTRUCTORS))
def test_constructor_shapes_and_bytes(name):
    layout = KVLayout.named(name, **SIZES)
    assert layout.shape == EXPECTED_SHAPES[name]
    assert layout.per_layer == (len(layout.shape) == 5)
    assert layout.bytes_per_block == 3 * 2 * 4 * 16 * 8 * 2
    assert layout.total_bytes == 10 * layout.bytes_per_block
    pool = layout.allocate(fill="zeros")
    tensors = layout.check(pool)
    assert len(tensors) == layout.num_tensors
    assert sum(t.numel() * t.element_size() for t in tensors) == layout.total_bytes
    # the canonical view of every tensor is [NB, (L,) 2, H, T, D]
    canon = layout.canonical_view(tensors[0])
    assert canon.shape[0] == 10 and canon.shape[-4:] == (2, 4, 16, 8)


def test_contiguous_run_bytes():
    hnd = KVLayout.vllm_hnd(**SIZES)
    nhd = KVLayout.vllm_nhd(**SIZES)
    assert hnd.contiguous_run_bytes == 16 * 8 * 2
    assert nhd.contiguous_run_bytes == 8 * 2
    assert KVLayout.trtllm(**SIZES).stride(Axis.TOKEN) == 8
    assert hnd.stride(Axis.LAYER) == 0


def test_frozen_and_variants():
    layout = KVLayout.trtllm(**SIZES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.num_blocks = 3
    smaller = layout.with_sizes(num_blocks=4)
    assert smaller.shape[0] == 4 and smaller.strides[0] == 3 * 2 * 4 * 16 * 8
    assert dataclasses.replace(layout, dtype=torch.int8).itemsize == 1


@pytest.mark.parametrize("bad,match", [
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(head_dim=True), "head_dim must be a positive int"),
    (dict(dtype="fp16"), "dtype must be a torch.dtype"),
])
def test_invalid_sizes(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KVLayout.trtllm(**{**SIZES, **bad})


def test_invalid_orders():
    with pytest.raises(ValueError, match="exactly once"):
        KVLayout(name="x", order=("block", "kv", "head", "token", "dim"), **SIZES)
    with pytest.raises(ValueError, match="head_dim must be the last, dense axis"):
        KVLayout(name="x", order=("block", "layer", "kv", "head", "dim", "token"), **SIZES)
    with pytest.raises(ValueError, match="unknown layout 'nope'"):
        KVLayout.named("nope", **SIZES)


def test_check_messages_name_both_sides():
    layout = KVLayout.vllm_nhd(**SIZES)
    pool = layout.allocate(fill="zeros")
    pool[1] = pool[1].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(LayoutMismatchError, match=r"layer 1 tensor has strides .* expects"):
        layout.check(pool)
    with pytest.raises(LayoutMismatchError, match="pool is on cpu, expected meta"):
        layout.check(layout.allocate(fill="zeros"), device="meta")


def test_logical_round_trip_and_staging():
    layout = KVLayout.vllm_flash(**SIZES)
    pool = layout.allocate(fill="random", generator=torch.Generator().manual_seed(0))
    logical = layout.logical(pool)
    assert logical.shape == (10, 3, 2, 4, 16, 8)
    assert torch.equal(logical[3, 2, 1].view(torch.int16),
                       pool[2][1, 3].permute(1, 0, 2).view(torch.int16))
    st = allocate_staging(layout, 5, layers=(1, 3), heads=(0, 1))
    assert st.shape == (5, 2, 2, 1, 16, 8) and st.is_contiguous()
    assert layout.describe()["order"] == ["kv", "block", "token", "head", "dim"]


def test_host_buffer_is_aligned_zeroed_and_outlives_its_mapping_name():
    import gc

    from kvkern.layout.hostmem import HUGE_PAGE, host_buffer

    for n in (0, 1, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 5):
        t = host_buffer(n)
        assert t.dtype == torch.uint8 and t.numel() == n and t.is_contiguous()
        if n >= HUGE_PAGE:
            assert t.data_ptr() % HUGE_PAGE == 0
            assert int(t.count_nonzero()) == 0  # anonymous pages are born zeroed
    view = host_buffer(4 * HUGE_PAGE)[10:20]
    gc.collect()
    view.fill_(7)  # the view keeps the mapping alive
    assert view.tolist() == [7] * 10
    with pytest.raises(ValueError):
        host_buffer(-1)


def test_cpu_pools_are_zeroed_huge_page_memory():
    from kvkern.layout.hostmem import HUGE_PAGE

    lay = KVLayout.trtllm(num_blocks=64, num_layers=4, num_heads=4, block_size=16, head_dim=128,
                 dtype=torch.bfloat16)
    pool = lay.allocate(fill="zeros")
    assert pool.shape == lay.shape and pool.dtype == torch.bfloat16
    assert pool.data_ptr() % HUGE_PAGE == 0 and not pool.any()
    lay.check(pool)


@pytest.mark.parametrize("name", sorted(LAYOUT_CONSTRUCTORS))
def test_read_segments_address_the_canonical_block_bytes(name):
    """RankKV.read_segments: segment j of block b, read from raw memory at
    ``bases[j] + b * stride``, is bytes [j * nbytes, (j + 1) * nbytes) of the block's canonical
    ``[L, 2, H, T, D]`` bytes; layouts whose blocks are not whole segments have none."""
    import ctypes

    from kvkern.kernels.reference import reference_pack
    from kvkern.xfer.kvgroup import RankKV

    lay = LAYOUT_CONSTRUCTORS[name](num_blocks=5, num_layers=3, num_heads=2, block_size=4,
                                    head_dim=8, dtype=torch.float16)
    rkv = RankKV(0, lay, lay.allocate(fill="random", generator=torch.Generator().manual_seed(3)))
    segs = rkv.read_segments
    if name not in ("trtllm", "vllm_hnd"):
        assert segs is None
        return
    assert segs.block_nbytes == lay.bytes_per_block
    assert len(segs.bases) == (lay.num_layers if lay.per_layer else 1)
    for b in range(lay.num_blocks):
        want = reference_pack(rkv.pool, lay, [b]).contiguous().view(torch.uint8).numpy()
        got = b"".join(ctypes.string_at(base + b * segs.stride, segs.nbytes)
                       for base in segs.bases)
        assert got == want.tobytes()
    for (addr, length), base in zip(segs.spans, segs.bases, strict=True):
        assert addr <= base and base + (lay.num_blocks - 1) * segs.stride + segs.nbytes \
            <= addr + length


@pytest.mark.parametrize("name", sorted(LAYOUT_CONSTRUCTORS))
def test_native_segments_address_each_block_in_the_pools_own_order(name):
    """RankKV.native_segments: the segments of block b, read from raw memory, are the
    block's slice of each tensor (block axis first) in the pool's own element order; for
    the canonical-readable layouts they are the canonical segments."""
    import ctypes

    from kvkern.layout import Axis
    from kvkern.xfer.kvgroup import RankKV

    lay = LAYOUT_CONSTRUCTORS[name](num_blocks=5, num_layers=3, num_heads=2, block_size=4,
                                    head_dim=8, dtype=torch.float16)
    rkv = RankKV(0, lay, lay.allocate(fill="random", generator=torch.Generator().manual_seed(5)))
    segs = rkv.native_segments
    assert segs is not None and segs.block_nbytes == lay.bytes_per_block
    pos = lay.order.index(Axis.BLOCK)
    for b in range(lay.num_blocks):
        want = b"".join(t.movedim(pos, 0)[b].contiguous().view(torch.uint8).numpy().tobytes()
                        for t in lay.tensors(rkv.pool))
        got = b"".join(ctypes.string_at(base + b * segs.stride, segs.nbytes)
                       for base in segs.bases)
        assert got == want
    if rkv.read_segments is not None:
        assert rkv.read_segments == segs


_DTYPE_NAMES_PROBE = """
import json, sys
from kvkern.layout.topology import ModelKVSpec, dtype_itemsize
from kvkern.xfer.state import parse_state

refused = []
for attempt in (lambda: parse_state(sys.argv[1]), lambda: dtype_itemsize("_inductor"),
                lambda: ModelKVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4,
                                    dtype="torch._inductor")):
    try:
        attempt()
    except ValueError as exc:
        refused.append("_inductor" in str(exc))
print(json.dumps({"refused": refused, "imported": "torch._inductor" in sys.modules}))
"""


def test_dtype_names_come_from_torchs_dtypes_and_import_nothing():
    """A dtype name from a peer's state is one of torch's dtypes or a ValueError; a name
    of a torch submodule is refused without importing it (a fresh interpreter, so no
    other test imported it first)."""
    import json
    import subprocess
    import sys

    from kvkern.layout.topology import ModelKVSpec, dtype_itemsize
    from tests.test_state_hostile import state_doc

    doc = state_doc()
    doc["topology"]["model"]["dtype"] = "_inductor"
    out = subprocess.run([sys.executable, "-c", _DTYPE_NAMES_PROBE, json.dumps(doc)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {"refused": [True, True, True],
                                                       "imported": False}
    for name, size in (("bfloat16", 2), ("float8_e4m3fn", 1), ("float32", 4), ("half", 2)):
        assert dtype_itemsize(name) == size
    spec = ModelKVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4,
                       dtype=torch.float8_e5m2)
    assert spec.dtype == "float8_e5m2" and spec.torch_dtype is torch.float8_e5m2
    for bad in ("nn", "Tensor", "dtype", ""):
        with pytest.raises(ValueError, match="unknown dtype name"):
            dtype_itemsize(bad)


def test_a_dtype_alias_names_the_same_model_as_its_dtype():
    """"half" and torch.float16 (or "torch.float" and "float32") are one dtype: workers
    that spell it differently are compatible."""
    from kvkern.layout.plan import plan_transfer
    from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology

    def spec(dtype):
        return ModelKVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)

    for alias, dtype in (("half", torch.float16), ("torch.float", torch.float32),
                         ("bfloat16", torch.bfloat16)):
        assert spec(alias) == spec(dtype) and spec(alias).dtype == str(dtype)[6:]
    plan_transfer(Topology(model=spec("half"), parallel=Parallelism()), 0,
                  Topology(model=spec(torch.float16), parallel=Parallelism()), 0)
