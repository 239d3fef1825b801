"""CPU benchmarks of the torch pack/unpack path against a per-block copy loop and a
contiguous copy of the same bytes (run with ``make bench``)."""

from __future__ import annotations

import pytest
import torch

from kvkern import KVLayout, pack, unpack

# (layout, blocks in pool, blocks moved, layers, kv heads, block size, head dim)
CASES = {
    "trtllm-bf16-16x128": ("trtllm", 1024, 256, 8, 8, 16, 128),
    "hnd-bf16-16x128": ("vllm_hnd", 1024, 256, 8, 8, 16, 128),
    "nhd-bf16-16x128": ("vllm_nhd", 1024, 256, 8, 8, 16, 128),
    "hnd-bf16-64x128": ("vllm_hnd", 256, 64, 8, 8, 64, 128),
}
METHODS = ["pack", "unpack", "per_block_loop", "contiguous_copy"]


@pytest.fixture(scope="module")
def setups():
    cache = {}

    def get(case):
        if case not in cache:
            name, nb, n, nl, nh, t, d = CASES[case]
            layout = KVLayout.named(name, num_blocks=nb, num_layers=nl, num_heads=nh,
                                    block_size=t, head_dim=d, dtype=torch.bfloat16)
            gen = torch.Generator().manual_seed(0)
            pool = layout.allocate(fill="random", generator=gen)
            ids = torch.randperm(nb, generator=gen)[:n]
            cache[case] = (layout, pool, ids, pack(pool, layout, ids))
        return cache[case]
    return get


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernels(benchmark, record, setups, case, method):
    layout, pool, ids, staging = setups(case)
    nbytes = staging.numel() * staging.element_size()
    benchmark.group = case
    if method == "pack":
        benchmark(pack, pool, layout, ids, staging)
    elif method == "unpack":
        benchmark(unpack, staging, pool, layout, ids)
    elif method == "per_block_loop":
        # what an engine without a gather kernel does: one copy_ per contiguous block slab
        tensors = layout.tensors(pool)
        pairs = [(staging[i, li] if layout.per_layer else staging[i],
                  layout.canonical_view(t)[b]) for i, b in enumerate(ids.tolist())
                 for li, t in enumerate(tensors)]

        def loop():
            for dst, src in pairs:
                dst.copy_(src)
        benchmark(loop)
    else:
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        benchmark(dst.copy_, src)
    record(case, method, nbytes)
