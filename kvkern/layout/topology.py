"""Topology descriptors: a model's KV shape and a worker's TP/PP/attention-DP parallelism.

A :class:`Topology` (a :class:`ModelKVSpec` plus a :class:`Parallelism`) answers which global
layers and which global KV heads each rank of a worker holds, and gives the
:class:`~kvkern.layout.kv_layout.KVLayout` of that rank's local pool. It only describes;
:mod:`kvkern.layout.plan` matches two topologies and :mod:`kvkern.kernels.sharded` moves bytes.

Rank mapping (TRT-LLM's rule without context parallelism, i.e. ``CP = 1``)::

    world_size = tp_size * pp_size
    pp  = rank // tp_size                 pipeline stage
    tpg = rank %  tp_size                 global TP index within the stage
    attention DP off:  dp = 0,                   tp = tpg          (dp_size must be 1)
    attention DP on:   dp = tpg // attn_tp_size,  tp = tpg % attn_tp_size
                       attn_tp_size = tp_size // dp_size           (TP per DP group)
    rank = pp * tp_size + dp * attn_tp_size + tp

    e.g. tp_size=4, pp_size=2, dp_size=2, attention DP (attn_tp_size=2):

                 tpg 0     tpg 1     tpg 2     tpg 3
        pp 0   r0 d0t0   r1 d0t1   r2 d1t0   r3 d1t1
        pp 1   r4 d0t0   r5 d0t1   r6 d1t0   r7 d1t1
               \\__ DP group 0 __/   \\__ DP group 1 __/

With attention DP each DP group serves different requests, so one request's KV lives on the
``attn_tp_size * pp_size`` ranks of one DP group, and its heads are split over
``attn_tp_size`` ranks (not ``tp_size``).

KV heads: with ``A = attn_tp_size`` and ``H = num_kv_heads``,

- ``A <= H`` (``H % A == 0``): rank ``tp`` holds heads ``[tp*H/A, (tp+1)*H/A)``;
- ``A > H`` (``A % H == 0``): each head is replicated on ``A/H`` ranks; rank ``tp`` holds
  the one head ``tp // (A/H)`` (GQA replication, as TRT-LLM and vLLM do).

Any other ``A`` raises :class:`IncompatibleTopologyError`. Head counts need only divide;
there is no power-of-two rule.

Layers: ``num_layers`` split into ``pp_size`` contiguous stages. The default split is as even
as possible with the earlier stages taking the extra layers (7 layers over PP 3 ->
``(3, 2, 2)``); ``ModelKVSpec.layer_split`` gives an explicit split (one positive count per
stage, summing to ``num_layers``), which is honoured and validated against ``pp_size``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvkern.layout.kv_layout import KVLayout

__all__ = [
    "FALLBACK_REASON_INCOMPATIBLE",
    "IncompatibleTopologyError",
    "ModelKVSpec",
    "Parallelism",
    "RankCoords",
    "Topology",
    "dtype_itemsize",
]

FALLBACK_REASON_INCOMPATIBLE = "incompatible_topology"


class IncompatibleTopologyError(ValueError):
    """Two topologies cannot exchange KV (or one cannot hold its model's KV at all).

    ``reason`` is the fallback reason the transfer path records (``incompatible_topology``);
    ``detail`` names the offending field and both values.
    """

    reason = FALLBACK_REASON_INCOMPATIBLE

    def __init__(self, detail: str) -> None:
        super().__init__(f"{FALLBACK_REASON_INCOMPATIBLE}: {detail}")
        self.detail = detail


def _check_pos_int(owner: str, field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {field} must be a positive int, got {value!r}")


# every torch.dtype by its name in the torch namespace (aliases included: "half", "float").
# Names are looked up here, never with getattr(torch, name): a name from a peer's state such
# as "_inductor" would import that submodule (over a second) before it is refused.
_DTYPES: dict[str, torch.dtype] = {name: value for name, value in vars(torch).items()
                                   if isinstance(value, torch.dtype)}


def _dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; ValueError for any other name."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


@functools.lru_cache(maxsize=64)
def dtype_itemsize(name: str) -> int:
    """Bytes per element of a torch dtype given by name (``"bfloat16"``, ``"float8_e4m3fn"``)."""
    return _dtype(name).itemsize


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):  # (an alias, "half", becomes its dtype's name, "float16")
        return str(_dtype(dtype.removeprefix("torch."))).removeprefix("torch.")
    raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")


@dataclass(frozen=True, kw_only=True)
class ModelKVSpec:
    """The KV shape of a model, independent of parallelism.

    ``dtype`` is kept as a name (``"bfloat16"``); a ``torch.dtype`` is accepted and
    normalised. ``layer_split``, when given, is the number of layers of each pipeline stage
    (its length must equal the ``pp_size`` it is paired with in a :class:`Topology`); it is
    not part of compatibility: two workers with different splits exchange KV fine.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _check_pos_int("ModelKVSpec", field, getattr(self, field))
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.layer_split is not None:
            split = tuple(self.layer_split)
            for i, n in enumerate(split):
                _check_pos_int("ModelKVSpec", f"layer_split[{i}]", n)
            if sum(split) != self.num_layers:
                raise ValueError(
                    f"ModelKVSpec: layer_split {split} sums to {sum(split)}, "
                    f"num_layers is {self.num_layers}"
                )
            object.__setattr__(self, "layer_split", split)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @property
    def bytes_per_layer_head_block(self) -> int:
        """Bytes of K and V of one head of one layer of one block: ``2 * T * D * itemsize``."""
        return 2 * self.block_size * self.head_dim * self.itemsize

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "block_size": self.block_size, "dtype": self.dtype,
            "layer_split": None if self.layer_split is None else list(self.layer_split),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ModelKVSpec:
        split = d.get("layer_split")
        return cls(num_layers=d["num_layers"], num_kv_heads=d["num_kv_heads"],
                   head_dim=d["head_dim"], block_size=d["block_size"], dtype=d["dtype"],
                   layer_split=None if split is None else tuple(split))


class RankCoords(NamedTuple):
    """Coordinates of a rank: DP group, pipeline stage, TP rank within the DP group."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """A worker's parallelism: TP, PP and attention-DP sizes (no context parallelism).

    ``tp_size`` is the engine's TP size over all DP groups (TRT-LLM's convention); with
    ``attention_dp`` the attention TP per DP group is ``tp_size // dp_size``. Without
    attention DP, ``dp_size`` must be 1 (plain DP replicas are separate workers).
    See the module docstring for the rank <-> (dp, pp, tp) mapping.
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    attention_dp: bool = False

    def __post_init__(self) -> None:
        for field in ("tp_size", "pp_size", "dp_size"):
            _check_pos_int("Parallelism", field, getattr(self, field))
        if not isinstance(self.attention_dp, bool):
            raise TypeError(f"Parallelism: attention_dp must be a bool, got {self.attention_dp!r}")
        if not self.attention_dp and self.dp_size != 1:
            raise ValueError(
                f"Parallelism: dp_size {self.dp_size} needs attention_dp=True "
                f"(without attention DP each DP replica is a separate worker)"
            )
        if self.tp_size % self.dp_size:
            raise ValueError(
                f"Parallelism: tp_size {self.tp_size} is not a multiple of dp_size {self.dp_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def attn_tp_size(self) -> int:
        """TP size within one DP group (the ranks a request's heads are split over)."""
        return self.tp_size // self.dp_size

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        pp, tpg = divmod(rank, self.tp_size)
        dp, tp = divmod(tpg, self.attn_tp_size)
        return RankCoords(dp, pp, tp)

    def rank_of(self, *, dp: int = 0, pp: int, tp: int) -> int:
        if not (0 <= dp < self.dp_size and 0 <= pp < self.pp_size and 0 <= tp < self.attn_tp_size):
            raise ValueError(
                f"coordinates (dp={dp}, pp={pp}, tp={tp}) out of range for dp_size "
                f"{self.dp_size}, pp_size {self.pp_size}, attn_tp_size {self.attn_tp_size}"
            )
        return pp * self.tp_size + dp * self.attn_tp_size + tp

    def ranks_of_dp(self, dp: int) -> tuple[int, ...]:
        """The ranks of DP group ``dp``, stage-major: ``(pp0 tp0, pp0 tp1, ..., pp1 tp0, ...)``."""
        if not 0 <= dp < self.dp_size:
            raise ValueError(f"DP rank {dp} out of range for dp_size {self.dp_size}")
        a = self.attn_tp_size
        return tuple(p * self.tp_size + dp * a + t for p in range(self.pp_size) for t in range(a))

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "dp_size": self.dp_size,
                "attention_dp": self.attention_dp}

    @classmethod
    def from_dict(cls, d: dict) -> Parallelism:
        return cls(tp_size=d["tp_size"], pp_size=d["pp_size"], dp_size=d["dp_size"],
                   attention_dp=d["attention_dp"])


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A model's KV spread over a worker's ranks.

    Raises :class:`IncompatibleTopologyError` when the attention TP size neither divides nor
    is a multiple of the KV head count, ``ValueError`` when the layer split does not fit.
    """

    model: ModelKVSpec
    parallel: Parallelism

    def __post_init__(self) -> None:
        h, a = self.model.num_kv_heads, self.parallel.attn_tp_size
        if h % a and a % h:
            raise IncompatibleTopologyError(
                f"attention TP size {a} neither divides nor is a multiple of "
                f"num_kv_heads {h}"
            )
        pp, nl = self.parallel.pp_size, self.model.num_layers
        split = self.model.layer_split
        if split is not None and len(split) != pp:
            raise ValueError(f"layer_split {split} has {len(split)} stages, pp_size is {pp}")
        if split is None and nl < pp:
            raise ValueError(f"num_layers {nl} is smaller than pp_size {pp}")

    # -- layers --------------------------------------------------------------------------

    @functools.cached_property
    def layer_split(self) -> tuple[int, ...]:
        """Layers per stage: explicit, or as even as possible with earlier stages larger."""
        if self.model.layer_split is not None:
            return self.model.layer_split
        base, extra = divmod(self.model.num_layers, self.parallel.pp_size)
        return tuple(base + (p < extra) for p in range(self.parallel.pp_size))

    @functools.cached_property
    def stage_layers(self) -> tuple[tuple[int, int], ...]:
        """Global half-open layer range ``(l0, l1)`` of each pipeline stage."""
        out, l0 = [], 0
        for n in self.layer_split:
            out.append((l0, l0 + n))
            l0 += n
        return tuple(out)

    def layer_range(self, rank: int) -> tuple[int, int]:
        """Global half-open range of the layers rank ``rank`` holds."""
        return self.stage_layers[self.parallel.coords(rank).pp]

    # -- heads ---------------------------------------------------------------------------

    @property
    def head_replicas(self) -> int:
        """How many ranks of a DP group (per stage) hold each KV head (1: no replication)."""
        return max(1, self.parallel.attn_tp_size // self.model.num_kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.model.num_kv_heads // self.parallel.attn_tp_size)

    def tp_head_range(self, tp: int) -> tuple[int, int]:
        """Global half-open head range held by TP rank ``tp`` of a DP group."""
        if self.head_replicas > 1:
            h = tp // self.head_replicas
            return (h, h + 1)
        n = self.heads_per_rank
        return (tp * n, tp * n + n)

    def head_range(self, rank: int) -> tuple[int, int]:
        """Global half-open range of the KV heads rank ``rank`` holds."""
        return self.tp_head_range(self.parallel.coords(rank).tp)

    # -- ranks and pools -----------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def coords(self, rank: int) -> RankCoords:
        return self.parallel.coords(rank)

    def ranks_of_dp(self, dp: int) -> tuple[int, ...]:
        return self.parallel.ranks_of_dp(dp)

    def local_layout(self, rank: int, num_blocks: int, layout_name: str = "trtllm") -> KVLayout:
        """The :class:`KVLayout` of rank ``rank``'s local pool (its layers and heads only)."""
        l0, l1 = self.layer_range(rank)
        h0, h1 = self.head_range(rank)
        m = self.model
        return KVLayout.named(layout_name, num_blocks=num_blocks, num_layers=l1 - l0,
                              num_heads=h1 - h0, block_size=m.block_size, head_dim=m.head_dim,
                              dtype=m.torch_dtype)

    def replace(self, **changes) -> Topology:
        """A variant with other parallelism fields (``tp_size=...``) or ``model=...``."""
        model = changes.pop("model", self.model)
        return Topology(model=model, parallel=dataclasses.replace(self.parallel, **changes))

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "parallel": self.parallel.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        return cls(model=ModelKVSpec.from_dict(d["model"]),
                   parallel=Parallelism.from_dict(d["parallel"]))
