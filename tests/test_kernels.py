"""pack/unpack: bit-exact against the pure-torch reference, poisoned buffers, every layout
and dtype, odd shapes, padding and bad ids, strided views, cross-layout conversion.

The Triton kernel runs under the interpreter on CPU (``interpreter`` marker) and compiled on
CUDA; the torch path runs on CPU. Both are compared with one reference."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvkern import KVLayout, pack, reference_pack, reference_unpack, staging_shape, unpack
from kvkern.kernels.pack import warm_up
from kvkern.kernels.reference import as_bits
from kvkern.layout import LAYOUT_CONSTRUCTORS, LayoutMismatchError

from .conftest import HAS_CUDA, POISON_BYTE, poisoned

LAYOUTS = sorted(LAYOUT_CONSTRUCTORS)
DTYPES = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8,
}
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]
DEVICE = "cuda" if HAS_CUDA else "cpu"


def make(name="trtllm", *, nb=8, nl=3, nh=4, t=4, d=8, dtype=torch.bfloat16, seed=0):
    layout = KVLayout.named(name, num_blocks=nb, num_layers=nl, num_heads=nh, block_size=t,
                            head_dim=d, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    return layout, layout.allocate(DEVICE, fill="random", generator=gen)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def logical_slab(layout, pool, ids, layers=None, heads=None):
    """Independent of the reference: index the logical [NB, L, 2, H, T, D] copy."""
    l0, l1 = layers or (0, layout.num_layers)
    h0, h1 = heads or (0, layout.num_heads)
    return layout.logical(pool)[torch.tensor(ids, dtype=torch.long)][:, l0:l1, :, h0:h1]


def check_pack(layout, pool, ids, backend, layers=None, heads=None):
    """Pack into two differently poisoned staging buffers: target rows must equal the
    logical slab (so every target byte was written), padding rows keep their poison."""
    l0, l1 = layers or (0, layout.num_layers)
    h0, h1 = heads or (0, layout.num_heads)
    shape = staging_shape(len(ids), l1 - l0, h1 - h0, layout.block_size, layout.head_dim)
    outs = []
    for poison in (POISON_BYTE, 0x5A):
        out = poisoned(shape, layout.dtype, DEVICE)
        out.view(torch.uint8).fill_(poison) if out.numel() else None
        got = pack(pool, layout, ids, out, layers=layers, heads=heads, backend=backend)
        assert got.data_ptr() == out.data_ptr()
        outs.append((poison, out))
    valid = [i for i, b in enumerate(ids) if b >= 0]
    expect = logical_slab(layout, pool, [ids[i] for i in valid], layers, heads)
    ref = reference_pack(pool, layout, ids, poisoned(shape, layout.dtype, DEVICE),
                         layers=layers, heads=heads)
    for poison, out in outs:
        assert bits_equal(out[valid].cpu(), expect)
        assert bits_equal(ref[valid].cpu(), expect)
        pad = [i for i, b in enumerate(ids) if b < 0]
        if pad:
            assert bool((out[pad].view(torch.uint8) == poison).all())
    return outs[0][1]


def check_unpack(layout, pool, ids, staging, backend, layers=None, heads=None):
    """Unpack into a copy of ``pool``: targeted (block, layer, head) cells equal staging,
    every other byte equals what the pool held before."""
    before = layout.logical(pool)
    got_pool = [t.clone() for t in layout.tensors(pool)]
    got_pool = got_pool if layout.per_layer else got_pool[0]
    unpack(staging, got_pool, layout, ids, layers=layers, heads=heads, backend=backend)
    ref_pool = [t.clone() for t in layout.tensors(pool)]
    ref_pool = ref_pool if layout.per_layer else ref_pool[0]
    reference_unpack(staging, ref_pool, layout, ids, layers=layers, heads=heads)
    l0, l1 = layers or (0, layout.num_layers)
    h0, h1 = heads or (0, layout.num_heads)
    expect = before.clone()
    for i, b in enumerate(ids):
        if b >= 0:
            expect[b, l0:l1, :, h0:h1] = staging[i].cpu()
    assert bits_equal(layout.logical(got_pool).cpu(), expect)
    assert bits_equal(layout.logical(ref_pool).cpu(), expect)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_and_dtype_round_trips(name, dtype, backend):
    layout, pool = make(name, dtype=dtype)
    ids = [5, 0, 7, 2]
    staging = check_pack(layout, pool, ids, backend)
    _, other = make(name, dtype=dtype, seed=1)
    check_unpack(layout, other, ids, staging, backend)
    # unpack(pack(x)) == x into a fresh pool
    fresh = layout.allocate(DEVICE, fill="zeros")
    unpack(staging, fresh, layout, ids, backend=backend)
    assert bits_equal(pack(fresh, layout, ids, backend=backend), staging)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [80, 96, 1, 3])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("name", ["trtllm", "vllm_nhd"])
def test_odd_head_dims_and_block_sizes(name, block_size, head_dim, backend):
    layout, pool = make(name, nb=4, nl=2, nh=2, t=block_size, d=head_dim, dtype=torch.float16)
    ids = [3, 1]
    staging = check_pack(layout, pool, ids, backend)
    check_unpack(layout, pool, ids, staging.flip(0).contiguous(), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ids", [[], [6], [-1], [-1, -1, 3], [7, -1, 0, -5, 2],
                                 [3, 1, 4, 0, 5, 2, 7, 6]],
                         ids=["zero", "one", "only-padding", "lead-padding", "mixed-padding",
                              "shuffled-all"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_block_id_sets(name, ids, backend):
    layout, pool = make(name)
    staging = check_pack(layout, pool, ids, backend)
    check_unpack(layout, pool, ids, staging, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_block_ids_as_a_strided_or_expanded_tensor(name, backend):
    """An id tensor that is a view (every other element, or one element expanded) names the
    blocks it shows: the kernels index ids densely, so they get a contiguous copy."""
    layout, pool = make(name)
    strided = torch.tensor([4, 0, 1, 5, 6, 2], dtype=torch.int64)[::2]  # [4, 1, 6]
    staging = check_pack(layout, pool, strided, backend)
    assert bits_equal(staging.cpu(), logical_slab(layout, pool, [4, 1, 6]))
    _, other = make(name, seed=2)
    check_unpack(layout, other, strided, staging, backend)
    expanded = torch.tensor([3, 7, 0], dtype=torch.int64)[:1].expand(3)  # [3, 3, 3]
    assert bits_equal(pack(pool, layout, expanded, backend=backend).cpu(),
                      logical_slab(layout, pool, [3, 3, 3]))



def test_a_host_id_tensor_is_copied_before_it_goes_to_a_device():
    """A caller's host tensor of ids (pinned, as an engine's block table) is copied, never
    used in place: the copy to a device may run after pack returns, and the caller rewrites
    its table at the next step."""
    pack_mod = importlib.import_module("kvkern.kernels.pack")
    layout, _ = make("trtllm")
    table = torch.tensor([4, 1, 6], dtype=torch.int64)
    ids = pack_mod._ids_tensor(table, layout, torch.device("cpu"), False, True)
    assert ids.tolist() == [4, 1, 6] and ids.data_ptr() != table.data_ptr()


@pytest.mark.interpreter
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_warm_up_compiles_and_writes_nothing(name, monkeypatch):
    """The warm-up launches the pack and the unpack (on CPU: only when asked for Triton, under
    the interpreter) and leaves every byte of the pool as it was."""
    layout, pool = make(name)
    before = layout.logical(pool).clone()
    assert warm_up(pool, layout) is (DEVICE == "cuda")
    pack_mod = importlib.import_module("kvkern.kernels.pack")  # (kvkern.kernels.pack: the function)
    launched: list = []
    launch = pack_mod._launch_triton
    monkeypatch.setattr(pack_mod, "_launch_triton",
                        lambda *a, **k: (launched.append(a[8]), launch(*a, **k)))
    assert warm_up(pool, layout, backend="triton")  # (CPU: the interpreter, tests/conftest.py)
    assert launched == [True, False]  # (pack, unpack)
    assert bits_equal(layout.logical(pool), before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers,heads", [((0, 1), None), ((1, 3), (2, 4)), (None, (1, 2)),
                                          ((2, 3), (0, 3)), ((1, 1), None)],
                         ids=["first-layer", "tail-slab", "one-head", "last-layer-3-heads",
                              "empty-layers"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_layer_and_head_sub_ranges(name, layers, heads, backend):
    layout, pool = make(name)
    ids = [4, -1, 6]
    staging = check_pack(layout, pool, ids, backend, layers, heads)
    _, other = make(name, seed=3)
    check_unpack(layout, other, ids, staging, backend, layers, heads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_non_contiguous_pool_views(name, backend):
    """A pool that is a strided view (every other block of a bigger allocation, and a
    head_dim slice of a wider row) packs and unpacks through restrided layouts."""
    layout, _ = make(name, nb=6)
    big = KVLayout.named(name, num_blocks=12, num_layers=3, num_heads=4, block_size=4,
                         head_dim=16, dtype=torch.bfloat16)
    base = big.allocate(DEVICE, fill="random", generator=torch.Generator().manual_seed(7))
    blk = big.order.index("block")

    def view(t):
        idx = [slice(None)] * t.dim()
        idx[blk] = slice(0, 12, 2)
        idx[-1] = slice(4, 12)
        return t[tuple(idx)]

    pool = [view(t) for t in base] if layout.per_layer else view(base)
    strided = layout.restrided(layout.tensors(pool)[0].stride())
    with pytest.raises(LayoutMismatchError, match="strides"):
        layout.check(pool)
    ids = [5, 0, -1, 3]
    staging = check_pack(strided, pool, ids, backend)
    before = [t.clone() for t in (base if layout.per_layer else [base])]
    unpack(staging.flip(0).contiguous(), pool, strided, ids, backend=backend)
    # bytes of the underlying allocation outside the view are untouched
    for b, a in zip(before, base if layout.per_layer else [base], strict=True):
        mask = torch.ones_like(a, dtype=torch.bool)
        mask[tuple(slice(0, 12, 2) if i == blk else (slice(4, 12) if i == a.dim() - 1
                   else slice(None)) for i in range(a.dim()))] = False
        assert torch.equal(as_bits(a)[mask], as_bits(b)[mask])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_name,dst_name", [("trtllm", "vllm_hnd"), ("vllm_nhd", "trtllm"),
                                               ("cross_layer", "vllm_flash")])
def test_cross_layout_conversion(src_name, dst_name, backend):
    src_layout, src_pool = make(src_name)
    dst_layout = KVLayout.named(dst_name, num_blocks=8, num_layers=3, num_heads=4, block_size=4,
                                head_dim=8, dtype=torch.bfloat16)
    dst_pool = dst_layout.allocate(DEVICE, fill="zeros")
    src_ids, dst_ids = [1, 6, 3], [7, 0, 4]
    staging = pack(src_pool, src_layout, src_ids, backend=backend)
    unpack(staging, dst_pool, dst_layout, dst_ids, backend=backend)
    assert bits_equal(dst_layout.logical(dst_pool)[dst_ids], src_layout.logical(src_pool)[src_ids])


@pytest.mark.interpreter
def test_program_cap_still_covers_every_row():
    layout, pool = make("vllm_nhd", nb=8)
    ids = [7, 6, 5, 4, 3, 2, 1, 0]
    capped = pack(pool, layout, ids, backend="triton", max_programs=3)
    assert bits_equal(capped, reference_pack(pool, layout, ids))


def test_nan_payloads_survive():
    layout, pool = make("trtllm", dtype=torch.float32)
    words = pool.view(torch.int32)
    words[2].fill_(0x7FC01234)  # quiet NaN with a payload
    words[3].fill_(-0x7F7FEDCC)  # negative NaN with a payload
    staging = pack(pool, layout, [2, 3])
    assert torch.equal(staging.view(torch.int32)[0], words[2])
    assert torch.equal(staging.view(torch.int32)[1], words[3])


def test_tensor_ids_and_int32_ids():
    layout, pool = make("vllm_hnd")
    for ids in (torch.tensor([3, 1], dtype=torch.int32), torch.tensor([3, 1]), (3, 1), range(3, 0, -2)):
        assert bits_equal(pack(pool, layout, ids), reference_pack(pool, layout, [3, 1]))


# ---- bad input: clear errors naming the values -------------------------------------------

def test_out_of_range_ids():
    layout, pool = make("trtllm", nb=8)
    with pytest.raises(ValueError, match="block id 8 out of range for pool of 8 blocks"):
        pack(pool, layout, [0, 8])
    staging = pack(pool, layout, [0, 1])
    with pytest.raises(ValueError, match="block id 100 out of range"):
        unpack(staging, pool, layout, [100, 1])
    # an unsigned id past int64 is refused, not taken for the padding id it would wrap to
    huge = torch.tensor([1, 2**63 + 2], dtype=torch.uint64)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        pack(pool, layout, huge)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        unpack(staging, pool, layout, huge)
    assert bits_equal(pack(pool, layout, torch.tensor([3, 1], dtype=torch.uint64)),
                      reference_pack(pool, layout, [3, 1]))


@pytest.mark.interpreter
def test_unvalidated_ids_never_leave_the_pool():
    """validate=False trusts the caller, but the kernel still masks ids past the pool."""
    layout, pool = make("trtllm", nb=8)
    staging = poisoned(staging_shape(3, 3, 4, 4, 8), torch.bfloat16)
    pack(pool, layout, [1, 8, 1000], staging, backend="triton", validate=False)
    assert bits_equal(staging[0], layout.logical(pool)[1])
    assert bool((staging[1:].view(torch.uint8) == POISON_BYTE).all())
    before = layout.logical(pool)
    unpack(staging[:1].clone(), pool, layout, [1 << 40], backend="triton", validate=False)
    assert bits_equal(layout.logical(pool), before)
    with pytest.raises(IndexError):
        pack(pool, layout, [9], backend="torch", validate=False)


@pytest.mark.skipif(HAS_CUDA, reason="the host copy path")
@pytest.mark.parametrize("name", ["trtllm", "vllm_hnd"])
def test_host_pack_split_over_the_copy_threads_is_exact(name, monkeypatch):
    """A pack above the split size runs on the calling thread and the copy threads; a dense
    pool's rows are taken whole (``_take_rows``), a layer-major pool's slices gathered; both
    bit-exact; a bad id in either share raises."""
    pack_mod = importlib.import_module("kvkern.kernels.pack")  # (the package exports pack())
    taken = []
    real = pack_mod._take_rows
    monkeypatch.setattr(pack_mod, "_take_rows", lambda *a: (taken.append(a[1].numel()),
                                                            real(*a)))
    layout, pool = make(name, nb=64, nl=4, nh=8, t=16, d=128, dtype=torch.float16)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:40].tolist()
    assert 40 * layout.bytes_per_block >= pack_mod._SPLIT_BYTES
    check_pack(layout, pool, ids, "torch")
    assert sum(taken) == (2 * 40 if name == "trtllm" else 0)  # (two poisoned packs)
    for bad in ([64, *ids[1:]], [*ids[:39], 64]):  # in the caller's share, in the other
        with pytest.raises(IndexError):
            pack(pool, layout, bad, backend="torch", validate=False)


def test_duplicate_destination_ids_rejected():
    layout, pool = make("vllm_nhd")
    staging = pack(pool, layout, [1, 2, 3])
    with pytest.raises(ValueError, match="duplicate destination block id 2"):
        unpack(staging, pool, layout, [2, -1, 2][:2] + [2])
    # duplicates are fine as pack sources, and padding may repeat in unpack
    pack(pool, layout, [1, 1])
    unpack(pack(pool, layout, [-1, -1, 4]), pool, layout, [-1, -1, 4])


@pytest.mark.parametrize("bad", [[1.0], [True], ["3"], [None]])
def test_non_integer_ids(bad):
    layout, pool = make()
    with pytest.raises(TypeError, match="not an int"):
        pack(pool, layout, bad)
    with pytest.raises(TypeError, match="integer tensor"):
        pack(pool, layout, torch.tensor([1.0]))


def test_staging_mismatches():
    layout, pool = make("trtllm")
    with pytest.raises(TypeError, match="staging dtype torch.float16 does not match"):
        pack(pool, layout, [1], torch.empty(staging_shape(1, 3, 4, 4, 8), dtype=torch.float16))
    with pytest.raises(ValueError, match=r"staging shape \(1, 3, 2, 4, 4, 9\) != expected"):
        pack(pool, layout, [1], torch.empty(1, 3, 2, 4, 4, 9, dtype=torch.bfloat16))
    wide = torch.empty(1, 3, 2, 4, 8, 4, dtype=torch.bfloat16).transpose(-1, -2)
    with pytest.raises(ValueError, match="must be contiguous"):
        pack(pool, layout, [1], wide)
    with pytest.raises(ValueError, match="staging is on meta"):
        unpack(torch.empty(staging_shape(1, 3, 4, 4, 8), dtype=torch.bfloat16, device="meta"),
               pool, layout, [1])
    with pytest.raises(ValueError, match=r"layer range \(2, 5\) not within \[0, 3\]"):
        pack(pool, layout, [1], layers=(2, 5))
    with pytest.raises(ValueError, match="backend must be"):
        pack(pool, layout, [1], backend="cuda")


def test_pool_mismatches_name_both_sides():
    layout, pool = make("vllm_hnd")
    with pytest.raises(TypeError, match="dtype torch.float32, layout 'vllm_hnd' expects torch.bfloat16"):
        pack([t.float() for t in pool], layout, [0])
    with pytest.raises(LayoutMismatchError, match=r"expects 3 tensors, got 2"):
        pack(pool[:2], layout, [0])
    with pytest.raises(TypeError, match="per-layer"):
        pack(pool[0], layout, [0])
    trt, tpool = make("trtllm")
    with pytest.raises(LayoutMismatchError, match=r"shape \(8, 3, 2, 4, 4, 4\), layout 'trtllm' expects"):
        pack(tpool[..., :4], trt, [0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYOUTS)
def test_cuda_matches_torch_path(name):
    layout, pool = make(name, nb=64, nl=4, nh=8, t=16, d=128)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40].tolist()
    staging = pack(pool, layout, ids)
    cpu_pool = [t.cpu() for t in layout.tensors(pool)]
    cpu_pool = cpu_pool if layout.per_layer else cpu_pool[0]
    assert bits_equal(staging.cpu(), pack(cpu_pool, layout, ids))


@pytest.mark.gpu
def test_gpu_launch_marks_the_cached_layer_offsets_used_by_its_stream(monkeypatch):
    """A pack launched on a side stream marks the cached layer offsets it reads as used by
    that stream, so that an entry evicted from the cache keeps its memory until the kernel
    has run (torch's caching allocator reuses a freed block on its own stream's order)."""
    seen: list[tuple[torch.dtype, torch.cuda.Stream]] = []
    real = torch.Tensor.record_stream

    def spy(self, stream):
        seen.append((self.dtype, stream))
        return real(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    layout, pool = make("vllm_hnd", nb=16, nl=4, nh=2, t=16, d=64)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        staging = pack(pool, layout, [3, 1, 2], backend="triton")
    side.synchronize()
    cpu_pool = [t.cpu() for t in layout.tensors(pool)]
    assert bits_equal(staging.cpu(), pack(cpu_pool, layout, [3, 1, 2]))
    assert (torch.int64, side) in seen


@pytest.mark.interpreter
@pytest.mark.parametrize("name,t,d,dtype", [
    ("vllm_hnd", 256, 128, torch.bfloat16),   # a row spans several token tiles
    ("trtllm", 1, 32, torch.bfloat16),        # many rows per tile
    ("vllm_nhd", 16, 128, torch.float8_e4m3fn),
    ("cross_layer", 128, 64, torch.float32),
], ids=["hnd-256-tokens", "trt-1-token", "nhd-fp8", "cross-fp32"])
def test_kernel_tiling_shapes(name, t, d, dtype):
    layout, pool = make(name, nb=5, nl=2, nh=2, t=t, d=d, dtype=dtype)
    staging = check_pack(layout, pool, [3, -1, 0], "triton")
    check_unpack(layout, pool, [3, -1, 0], staging.flip(0).contiguous(), "triton")
    capped = layout.allocate(DEVICE, fill="zeros")
    unpack(staging, capped, layout, [3, -1, 0], backend="triton", max_programs=2)
    assert bits_equal(pack(capped, layout, [3, 0]), staging[[0, 2]])
