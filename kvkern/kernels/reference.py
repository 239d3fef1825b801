"""The pure-torch reference for pack/unpack: short, slow, obviously right.

Tests compare the Triton kernel and the vectorized torch path against these bit for bit.
Same signature and semantics as :func:`kvkern.kernels.pack.pack` / ``unpack``; it loops
over blocks and layers in Python, so keep inputs small.
"""

from __future__ import annotations

import torch

from kvkern.layout.kv_layout import KVLayout, staging_shape

__all__ = ["reference_pack", "reference_unpack", "as_bits"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as an integer dtype of the same item size (bit comparisons
    with ``torch.equal`` then hold for NaN payloads and fp8 too)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _block_slab(tensors, layout: KVLayout, block: int, layer: int) -> torch.Tensor:
    """``[2, H, T, D]`` view of one block of one layer."""
    if layout.per_layer:
        return layout.canonical_view(tensors[layer])[block]
    return layout.canonical_view(tensors[0])[block, layer]


def _ranges(layout: KVLayout, layers, heads) -> tuple[int, int, int, int]:
    l0, l1 = layers if layers is not None else (0, layout.num_layers)
    h0, h1 = heads if heads is not None else (0, layout.num_heads)
    return l0, l1, h0, h1


def reference_pack(pool, layout: KVLayout, block_ids, out: torch.Tensor | None = None, *,
                   layers=None, heads=None) -> torch.Tensor:
    """``out[i, l - l0, kv, h - h0] = pool[block_ids[i], l, kv, h]`` for non-negative ids."""
    tensors = layout.check(pool)
    l0, l1, h0, h1 = _ranges(layout, layers, heads)
    ids = [int(b) for b in block_ids]
    if out is None:
        out = torch.empty(staging_shape(len(ids), l1 - l0, h1 - h0, layout.block_size,
                                        layout.head_dim), dtype=layout.dtype,
                          device=tensors[0].device)
    for i, block in enumerate(ids):
        if block < 0:
            continue
        for layer in range(l0, l1):
            src = as_bits(_block_slab(tensors, layout, block, layer)[:, h0:h1])
            as_bits(out[i, layer - l0]).copy_(src)
    return out


def reference_unpack(staging: torch.Tensor, pool, layout: KVLayout, block_ids, *,
                     layers=None, heads=None) -> None:
    """``pool[block_ids[i], l, kv, h] = staging[i, l - l0, kv, h - h0]`` for non-negative ids."""
    tensors = layout.check(pool)
    l0, l1, h0, h1 = _ranges(layout, layers, heads)
    for i, block in enumerate(int(b) for b in block_ids):
        if block < 0:
            continue
        for layer in range(l0, l1):
            dst = as_bits(_block_slab(tensors, layout, block, layer)[:, h0:h1])
            dst.copy_(as_bits(staging[i, layer - l0]))
