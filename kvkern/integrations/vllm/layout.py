"""vLLM's KV cache tensors as kvkern pools: one :class:`~kvkern.xfer.kvgroup.RankKV` over the
tensors vLLM hands ``register_kv_caches``, viewed in place (the pull writes vLLM's memory).

vLLM v1 gives each attention layer a ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
tensor (its logical order; the physical stride order varies by backend). What the last
dimension holds depends on the backend::

    CPU attention        a head's T keys, then its T values   -> [NB, H, 2, T, D]  "vllm_cpu"
    FlashAttention,      each token's key, then its value     -> [NB, H, T, 2, D]  "vllm_v1"
    Triton, Flex (CUDA)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kvkern.layout.kv_layout import KVLayout
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer.kvgroup import RankKV

__all__ = ["check_kv_layout", "kv_layout_name", "rank_kv"]

_LAYER = re.compile(r"\.(\d+)\.")


def kv_layout_name(device: torch.device, override: str | None = None) -> str:
    """The kvkern layout of vLLM's cache on ``device`` (``override`` wins)."""
    if override:
        if override not in ("vllm_cpu", "vllm_v1"):
            raise ValueError(f"kv_layout must be 'vllm_cpu' or 'vllm_v1', got {override!r}")
        return override
    return "vllm_cpu" if device.type == "cpu" else "vllm_v1"


def check_kv_layout(kv_caches: Mapping[str, torch.Tensor], setting: str | None) -> None:
    """Refuse a connector's ``kv_layout`` setting that is not the layout of vLLM's cache on
    its device: ``vllm_cpu`` on the CPU (its one attention backend stores a head's keys,
    then its values), ``vllm_v1`` on a GPU (every backend splits each token's last dimension
    into key, then value). Another would write keys where vLLM keeps something else, and
    its peers could not tell."""
    if not setting or not kv_caches:
        return
    device = next(iter(kv_caches.values())).device
    if setting != kv_layout_name(device):
        raise ValueError(f"kv_layout {setting!r} is not the layout of vLLM's cache on "
                         f"{device.type} ({kv_layout_name(device)!r})")


def _ordered(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The layers' tensors in layer order (the number in the layer's module name)."""
    def key(item: tuple[str, torch.Tensor]) -> tuple[int, str]:
        found = _LAYER.search(f".{item[0]}.")
        return (int(found.group(1)) if found else -1, item[0])

    tensors = [t for _, t in sorted(kv_caches.items(), key=key)]
    ptrs = [t.data_ptr() for t in tensors]
    if len(set(ptrs)) != len(ptrs):
        raise ValueError("layers share a KV cache tensor (cross-layer KV sharing): kvkern "
                         "moves each layer's KV once, so such models are not supported")
    return tensors


def _view(t: torch.Tensor, name: str, head_dim: int) -> torch.Tensor:
    if t.dim() != 4 or t.shape[-1] != 2 * head_dim:
        raise ValueError(f"a vLLM v1 KV cache tensor is [num_blocks, heads, block_size, "
                         f"2 * head_dim={2 * head_dim}], got {tuple(t.shape)}")
    nb, h, tokens, _ = t.shape
    s_b, s_h, s_t, s_c = t.stride()
    if s_c != 1:
        raise ValueError(f"the last dimension of a KV cache tensor must be contiguous, "
                         f"strides {t.stride()}")
    if name == "vllm_v1":
        return t.unflatten(-1, (2, head_dim))
    if s_t != 2 * head_dim:
        raise ValueError(f"vLLM's CPU cache keeps a head's [T, 2D] contiguous, strides "
                         f"{t.stride()}")
    return t.as_strided((nb, h, 2, tokens, head_dim),
                        (s_b, s_h, tokens * head_dim, head_dim, 1), t.storage_offset())


def rank_kv(kv_caches: Mapping[str, torch.Tensor], *, head_dim: int,
            layout: str | None = None) -> tuple[Topology, RankKV]:
    """The one-rank topology and the :class:`RankKV` over vLLM's ``kv_caches`` (layer name ->
    tensor), viewed in place."""
    tensors = _ordered(kv_caches)
    if not tensors:
        raise ValueError("vLLM registered no KV cache tensor")
    name = kv_layout_name(tensors[0].device, layout)
    views = [_view(t, name, head_dim) for t in tensors]
    first = views[0]
    for i, v in enumerate(views):
        if v.stride() != first.stride() or v.shape != first.shape or v.dtype != first.dtype:
            raise ValueError(f"layer {i}'s KV cache {tuple(v.shape)}/{v.stride()}/{v.dtype} "
                             f"differs from layer 0's {tuple(first.shape)}/{first.stride()}/"
                             f"{first.dtype}")
    nb, h = first.shape[0], first.shape[1]
    tokens = first.shape[3] if name == "vllm_cpu" else first.shape[2]
    model = ModelKVSpec(num_layers=len(views), num_kv_heads=h, head_dim=head_dim,
                        block_size=tokens, dtype=first.dtype)
    kv = KVLayout.named(name, num_blocks=nb, num_layers=len(views), num_heads=h,
                        block_size=tokens, head_dim=head_dim, dtype=first.dtype)
    if tuple(first.stride()) != kv.strides:
        kv = kv.restrided(first.stride())
    return Topology(model=model, parallel=Parallelism()), RankKV(0, kv, views)
