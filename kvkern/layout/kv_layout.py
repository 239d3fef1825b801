"""KV layout descriptors: how an engine's paged KV pool lies in memory.

Every engine stores the same logical object -- for each block, layer, K/V half, KV head,
token slot and head-dim element one value -- but orders the axes differently and may keep
one tensor per layer. A :class:`KVLayout` names the order (which tensor dimension is which
logical axis) and the element strides, so one kernel serves every engine::

    axis names:  block (NB)  layer (L)  kv (2)  head (H)  token (T = block_size)  dim (D)

    TRT-LLM V1          one tensor   [NB, L, 2, H, T, D]
    vLLM FlashAttention per layer    [2, NB, T, H, D]
    vLLM/FlashInfer NHD per layer    [NB, 2, T, H, D]
    vLLM/FlashInfer HND per layer    [NB, 2, H, T, D]
    cross-layer         one tensor   [NB, L, 2, T, H, D]
    vLLM v1 CPU         per layer    [NB, H, 2, T, D]   (its [NB, H, T, 2D] tensor)
    vLLM v1 unified     per layer    [NB, H, T, 2, D]   (its [NB, H, T, 2D] tensor, K then V
                                                         in the last dim; any stride order)

Canonical staging format (what travels between workers)::

    staging[n_blocks, n_layers, 2, n_heads, block_size, head_dim]   contiguous

    block 0                                  block 1
    +-----------------------------------+    +------ ...
    | layer l0                          |    |
    |  K: head h0 [T x D] head h0+1 ... |    |
    |  V: head h0 [T x D] head h0+1 ... |    |
    | layer l0+1 ...                    |    |
    +-----------------------------------+    +------ ...

Each (block, layer, kv, head) is one contiguous ``T x D`` run in staging, so a TP head
slice of a block is contiguous too and layouts of different engines interoperate through it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Axis",
    "KVLayout",
    "LayoutMismatchError",
    "staging_shape",
    "allocate_staging",
]


class Axis(str, enum.Enum):
    """A logical axis of a paged KV pool."""

    BLOCK = "block"
    LAYER = "layer"
    KV = "kv"
    HEAD = "head"
    TOKEN = "token"
    DIM = "dim"


_ALL_AXES = frozenset(Axis)
CANONICAL_ORDER: tuple[Axis, ...] = (
    Axis.BLOCK, Axis.LAYER, Axis.KV, Axis.HEAD, Axis.TOKEN, Axis.DIM
)


# engine layout name -> (axis of each tensor dim, one tensor per layer?)
ENGINE_ORDERS: dict[str, tuple[tuple[Axis, ...], bool]] = {
    "trtllm": (CANONICAL_ORDER, False),
    "vllm_flash": ((Axis.KV, Axis.BLOCK, Axis.TOKEN, Axis.HEAD, Axis.DIM), True),
    "vllm_nhd": ((Axis.BLOCK, Axis.KV, Axis.TOKEN, Axis.HEAD, Axis.DIM), True),
    "vllm_hnd": ((Axis.BLOCK, Axis.KV, Axis.HEAD, Axis.TOKEN, Axis.DIM), True),
    "cross_layer": ((Axis.BLOCK, Axis.LAYER, Axis.KV, Axis.TOKEN, Axis.HEAD, Axis.DIM), False),
    "vllm_cpu": ((Axis.BLOCK, Axis.HEAD, Axis.KV, Axis.TOKEN, Axis.DIM), True),
    "vllm_v1": ((Axis.BLOCK, Axis.HEAD, Axis.TOKEN, Axis.KV, Axis.DIM), True),
}


class LayoutMismatchError(ValueError):
    """Tensors given as a pool do not match the layout they were declared with."""


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """A frozen descriptor of one engine KV pool.

    ``order`` names the logical axis of each tensor dimension. A per-layer pool
    (``per_layer=True``) is a list of ``num_layers`` tensors whose order omits
    :attr:`Axis.LAYER`; a single-tensor pool includes it. ``strides`` are element strides
    of each tensor dimension (contiguous unless given); variants come from
    :func:`dataclasses.replace` or :meth:`restrided`.
    """

    name: str
    num_blocks: int
    num_layers: int
    num_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    order: tuple[Axis, ...]
    per_layer: bool = False
    strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        order = tuple(Axis(a) for a in self.order)
        object.__setattr__(self, "order", order)
        expected = _ALL_AXES - {Axis.LAYER} if self.per_layer else _ALL_AXES
        if len(order) != len(set(order)) or set(order) != expected:
            raise ValueError(
                f"layout {self.name!r}: order {[a.value for a in order]} must name each of "
                f"{sorted(a.value for a in expected)} exactly once"
            )
        for field in ("num_blocks", "num_layers", "num_heads", "block_size", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout {self.name!r}: {field} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"layout {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.strides is None:
            object.__setattr__(self, "strides", _contiguous_strides(self.shape))
        else:
            strides = tuple(int(s) for s in self.strides)
            if len(strides) != len(order):
                raise ValueError(
                    f"layout {self.name!r}: {len(strides)} strides for {len(order)} dimensions"
                )
            if any(s < 0 for s in strides):
                raise ValueError(f"layout {self.name!r}: negative strides {strides}")
            object.__setattr__(self, "strides", strides)
        if order[-1] != Axis.DIM or self.strides[-1] != 1:
            raise ValueError(
                f"layout {self.name!r}: head_dim must be the last, dense axis (stride 1); "
                f"got order {[a.value for a in order]} with strides {self.strides}"
            )

    # -- constructors for the engines' pools -------------------------------------------

    @classmethod
    def trtllm(cls, **sizes) -> KVLayout:
        """TRT-LLM V1: one tensor ``[NB, L, 2, H, T, D]`` (HND inside each block)."""
        return cls.named("trtllm", **sizes)

    @classmethod
    def vllm_flash(cls, **sizes) -> KVLayout:
        """vLLM FlashAttention (older): per layer ``[2, NB, T, H, D]``."""
        return cls.named("vllm_flash", **sizes)

    @classmethod
    def vllm_nhd(cls, **sizes) -> KVLayout:
        """vLLM / FlashInfer NHD: per layer ``[NB, 2, T, H, D]``."""
        return cls.named("vllm_nhd", **sizes)

    @classmethod
    def vllm_hnd(cls, **sizes) -> KVLayout:
        """vLLM / FlashInfer HND: per layer ``[NB, 2, H, T, D]``."""
        return cls.named("vllm_hnd", **sizes)

    @classmethod
    def cross_layer(cls, **sizes) -> KVLayout:
        """vLLM cross-layer: one tensor ``[NB, L, 2, T, H, D]``."""
        return cls.named("cross_layer", **sizes)

    @classmethod
    def vllm_cpu(cls, **sizes) -> KVLayout:
        """vLLM v1's CPU attention: per layer ``[NB, H, T, 2D]``, read as ``[NB, H, 2, T, D]``
        (a head's ``T`` keys, then its ``T`` values)."""
        return cls.named("vllm_cpu", **sizes)

    @classmethod
    def vllm_v1(cls, **sizes) -> KVLayout:
        """vLLM v1's unified KV cache (FlashAttention, Triton, FlexAttention): per layer
        ``[NB, H, T, 2D]``, read as ``[NB, H, T, 2, D]`` (each token's key, then its value);
        its physical stride order varies (``restrided``)."""
        return cls.named("vllm_v1", **sizes)

    @classmethod
    def named(cls, name: str, *, num_blocks: int, num_layers: int, num_heads: int,
              block_size: int, head_dim: int, dtype: torch.dtype) -> KVLayout:
        """Build an engine layout by name (a key of :data:`ENGINE_ORDERS`) from its sizes."""
        if name not in ENGINE_ORDERS:
            raise ValueError(f"unknown layout {name!r}; known: {sorted(ENGINE_ORDERS)}")
        order, per_layer = ENGINE_ORDERS[name]
        return cls(name=name, num_blocks=num_blocks, num_layers=num_layers, num_heads=num_heads,
                   block_size=block_size, head_dim=head_dim, dtype=dtype, order=order,
                   per_layer=per_layer)

    # -- sizes ---------------------------------------------------------------------------

    def axis_size(self, axis: Axis) -> int:
        return {
            Axis.BLOCK: self.num_blocks, Axis.LAYER: self.num_layers, Axis.KV: 2,
            Axis.HEAD: self.num_heads, Axis.TOKEN: self.block_size, Axis.DIM: self.head_dim,
        }[Axis(axis)]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of each pool tensor (of each layer's tensor for a per-layer pool)."""
        return tuple(self.axis_size(a) for a in self.order)

    @property
    def num_tensors(self) -> int:
        return self.num_layers if self.per_layer else 1

    def stride(self, axis: Axis) -> int:
        """Element stride of a logical axis inside one tensor (0 for LAYER in per-layer pools)."""
        axis = Axis(axis)
        if axis not in self.order:
            return 0
        return self.strides[self.order.index(axis)]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_per_token_head(self) -> int:
        """Bytes of one contiguous head_dim row."""
        return self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V, and heads."""
        return self.num_layers * 2 * self.num_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def bytes_per_block_per_layer(self) -> int:
        return self.bytes_per_block // self.num_layers

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def contiguous_run_bytes(self) -> int:
        """Largest run of adjacent bytes for one (block, layer, kv, head): ``T*D`` elements
        when tokens are dense after head_dim (HND, TRT-LLM), else one head_dim row."""
        if self.stride(Axis.TOKEN) == self.head_dim or self.block_size == 1:
            return self.block_size * self.bytes_per_token_head
        return self.bytes_per_token_head

    # -- variants ------------------------------------------------------------------------

    def restrided(self, strides: Sequence[int]) -> KVLayout:
        """The same layout over tensors with other element strides (a strided view)."""
        return dataclasses.replace(self, strides=tuple(int(s) for s in strides))

    def with_sizes(self, **sizes) -> KVLayout:
        """The same engine layout with other sizes (strides recomputed as contiguous)."""
        return dataclasses.replace(self, strides=None, **sizes)

    # -- pools ---------------------------------------------------------------------------

    def allocate(self, device: torch.device | str = "cpu", *, fill: str | None = None,
                 generator: torch.Generator | None = None):
        """Allocate a pool in this layout: a tensor, or a list of per-layer tensors.

        ``fill`` is ``None`` (uninitialised), ``"zeros"`` or ``"random"`` (random bytes,
        NaN payloads and all, so copies are checked bit for bit).
        """
        def one() -> torch.Tensor:
            if fill == "random":
                nbytes = int(torch.Size(self.shape).numel()) * self.itemsize
                raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
                return raw.view(self.dtype).view(self.shape).to(device)
            if fill in ("zeros", None) and torch.device(device).type == "cpu":
                # Huge-page host memory: UCX's CMA reads it 2-5x faster than torch's 4 KiB
                # pages (kvkern.layout.hostmem). "zeros" writes every page (faulted in now).
                from kvkern.layout.hostmem import host_buffer  # noqa: PLC0415

                nbytes = int(torch.Size(self.shape).numel()) * self.itemsize
                t = host_buffer(nbytes).view(self.dtype).view(self.shape)
                return t.zero_() if fill == "zeros" else t
            if fill == "zeros":
                return torch.zeros(self.shape, dtype=self.dtype, device=device)
            if fill is None:
                return torch.empty(self.shape, dtype=self.dtype, device=device)
            raise ValueError(f"fill must be None, 'zeros' or 'random', got {fill!r}")

        if self.strides != _contiguous_strides(self.shape):
            raise ValueError(f"layout {self.name!r} is strided; allocate its contiguous base")
        if self.per_layer:
            return [one() for _ in range(self.num_layers)]
        return one()

    def tensors(self, pool) -> list[torch.Tensor]:
        """The pool's tensors as a list (one entry for single-tensor pools)."""
        if isinstance(pool, torch.Tensor):
            return [pool]
        return list(pool)

    def check(self, pool, *, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Check that ``pool`` matches this layout; returns its tensors as a list.

        Raises :class:`LayoutMismatchError` (a ``ValueError``) naming both sides, or
        ``TypeError`` for a wrong dtype or a pool that is not tensors.
        """
        if self.per_layer and isinstance(pool, torch.Tensor):
            raise TypeError(
                f"layout {self.name!r} is per-layer: expected a list of {self.num_layers} "
                f"tensors, got one tensor of shape {tuple(pool.shape)}"
            )
        if not self.per_layer and not isinstance(pool, torch.Tensor):
            raise TypeError(
                f"layout {self.name!r} is one tensor {list(self.shape)}, got {type(pool).__name__}"
            )
        tensors = self.tensors(pool)
        if len(tensors) != self.num_tensors:
            raise LayoutMismatchError(
                f"layout {self.name!r} expects {self.num_tensors} tensors, got {len(tensors)}"
            )
        first_device = None
        for i, t in enumerate(tensors):
            where = f"layer {i} tensor" if self.per_layer else "pool tensor"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where} is {type(t).__name__}, not a torch.Tensor")
            if t.dtype != self.dtype:
                raise TypeError(f"{where} has dtype {t.dtype}, layout {self.name!r} expects {self.dtype}")
            if tuple(t.shape) != self.shape:
                raise LayoutMismatchError(
                    f"{where} has shape {tuple(t.shape)}, layout {self.name!r} expects {self.shape}"
                )
            if tuple(t.stride()) != self.strides:
                raise LayoutMismatchError(
                    f"{where} has strides {tuple(t.stride())}, layout {self.name!r} expects "
                    f"{self.strides} (use layout.restrided(tensor.stride()) for a strided view)"
                )
            first_device = first_device or t.device
            if t.device != first_device:
                raise LayoutMismatchError(f"{where} is on {t.device}, layer 0 on {first_device}")
        if device is not None and first_device is not None and first_device != torch.device(device):
            raise LayoutMismatchError(f"pool is on {first_device}, expected {torch.device(device)}")
        return tensors

    def canonical_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of one pool tensor with dims in canonical order: ``[NB, L, 2, H, T, D]``
        (``[NB, 2, H, T, D]`` for one tensor of a per-layer pool). No copy."""
        axes = [a for a in CANONICAL_ORDER if a in self.order]
        return tensor.permute([self.order.index(a) for a in axes])

    def logical(self, pool) -> torch.Tensor:
        """The whole pool as one new tensor ``[NB, L, 2, H, T, D]`` (a copy; for tests)."""
        tensors = self.check(pool)
        if self.per_layer:
            return torch.stack([self.canonical_view(t) for t in tensors], dim=1).contiguous()
        return self.canonical_view(tensors[0]).contiguous()

    def describe(self) -> dict:
        """A JSON-able description (for source state endpoints and logs)."""
        return {
            "name": self.name, "num_blocks": self.num_blocks, "num_layers": self.num_layers,
            "num_heads": self.num_heads, "block_size": self.block_size, "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."), "per_layer": self.per_layer,
            "order": [a.value for a in self.order], "strides": list(self.strides),
        }


LAYOUT_CONSTRUCTORS = {
    "trtllm": KVLayout.trtllm,
    "vllm_flash": KVLayout.vllm_flash,
    "vllm_nhd": KVLayout.vllm_nhd,
    "vllm_hnd": KVLayout.vllm_hnd,
    "vllm_cpu": KVLayout.vllm_cpu,
    "vllm_v1": KVLayout.vllm_v1,
    "cross_layer": KVLayout.cross_layer,
}


def staging_shape(n_blocks: int, n_layers: int, n_heads: int, block_size: int,
                  head_dim: int) -> tuple[int, int, int, int, int, int]:
    """Shape of the canonical staging buffer ``[n_blocks, n_layers, 2, n_heads, T, D]``."""
    return (n_blocks, n_layers, 2, n_heads, block_size, head_dim)


def allocate_staging(layout: KVLayout, n_blocks: int, *, layers: tuple[int, int] | None = None,
                     heads: tuple[int, int] | None = None, device=None) -> torch.Tensor:
    """Allocate an uninitialised contiguous staging buffer for a (sub-)slab of ``layout``."""
    l0, l1 = layers if layers is not None else (0, layout.num_layers)
    h0, h1 = heads if heads is not None else (0, layout.num_heads)
    return torch.empty(
        staging_shape(n_blocks, l1 - l0, h1 - h0, layout.block_size, layout.head_dim),
        dtype=layout.dtype, device=device,
    )
