"""One attention-DP group's KV as a process hosts it: the group's block manager and the KV
memory of the group's ranks that live in this process.

One block manager drives every TP/PP rank of a DP group: a request's block ``b`` is block id
``b`` in the pool of every rank of the group (each rank holding its own layers x heads)::

    DP group 0 of TP2 x PP2                 manager (one per group)
    rank 0  pool [NB, L0..L2, 2, h0..h3, T, D]     \\
    rank 1  pool [NB, L0..L2, 2, h4..h7, T, D]      |  block id b is the same request
    rank 4  pool [NB, L3..L5, 2, h0..h3, T, D]      |  block on every rank
    rank 5  pool [NB, L3..L5, 2, h4..h7, T, D]     /

A process may host every rank of the group (tests, one-process workers) or a subset (one
process per GPU); ``KVGroup.ranks`` holds those it hosts. The checks here run once, when the
group is built, so the source service can trust sizes afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvkern.cache.protocol import KVCacheManager
from kvkern.layout.kv_layout import KVLayout, LayoutMismatchError
from kvkern.layout.segments import (
    BlockSegments,
    block_rows,
    layout_signature,
    native_segments,
    read_segments,
    spans_whole_block,
)
from kvkern.layout.topology import Topology

if TYPE_CHECKING:
    import torch

__all__ = ["BlockSegments", "KVGroup", "RankKV", "layout_signature"]

_SIZE_FIELDS = ("num_layers", "num_heads", "block_size", "head_dim", "dtype")


@dataclass(frozen=True)
class RankKV:
    """The KV memory of one rank: its pool tensor(s) in ``layout`` (checked on creation).

    ``pool`` is a tensor (single-tensor layouts) or a list of per-layer tensors, on any
    device; the source packs from it and the puller unpacks into it.
    """

    rank: int
    layout: KVLayout
    pool: torch.Tensor | list[torch.Tensor]

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {self.rank!r}")
        self.layout.check(self.pool)

    @functools.cached_property
    def device(self) -> torch.device:
        return self.layout.tensors(self.pool)[0].device

    def block_rows(self) -> torch.Tensor | None:
        """``[num_blocks, bytes_per_block]`` uint8 view of the pool when each block's
        canonical ``[L, 2, H, T, D]`` bytes are one contiguous run in stream order (a single
        contiguous tensor whose canonical view is contiguous, e.g. TRT-LLM's
        ``[NB, L, 2, H, T, D]``), else None. A run of consecutive block ids is then one
        contiguous buffer that UCX can send from or receive into without a pack or unpack.
        Computed once (every pull asks)."""
        return self._block_rows

    @functools.cached_property
    def _block_rows(self) -> torch.Tensor | None:
        return block_rows(self.layout, self.layout.tensors(self.pool))

    def stream_rows(self, layers: tuple[int, int], heads: tuple[int, int],
                    block_nbytes: int) -> torch.Tensor | None:
        """The pool's :meth:`block_rows` when a stream's bytes per block (``block_nbytes`` of
        the piece ``layers`` x ``heads``) are exactly a pool block's bytes: one piece of every
        local layer and head of a pool whose canonical view is contiguous. A chunk of
        consecutive block ids is then sent from, or received into, the pool directly. Else
        None."""
        if not spans_whole_block(self.layout, layers, heads):
            return None
        rows = self.block_rows()
        return rows if rows is not None and rows.shape[1] == block_nbytes else None

    @functools.cached_property
    def native_segments(self) -> BlockSegments | None:
        """A block's bytes in the pool's own order: per tensor (per layer of a per-layer
        pool) and per K/V plane stored before the block axis, the contiguous chunk at
        ``bases[j] + b * stride``. Two pools of one layout (order, sizes, dtype) hold a
        block in the same segments whatever their canonical order, so a read may copy
        segment ``j`` to segment ``j`` (vLLM NHD or ``[2, NB, ...]`` pools between workers
        of the same kind). None for a pool whose block chunks are not contiguous."""
        return native_segments(self.layout, self.layout.tensors(self.pool))

    @functools.cached_property
    def layout_signature(self) -> tuple:
        """What must be equal for :attr:`native_segments` to mean the same bytes."""
        return layout_signature(self.layout.describe())

    @functools.cached_property
    def read_segments(self) -> BlockSegments | None:
        """The :class:`BlockSegments` of this rank's pool, or None when a block's canonical
        bytes are not whole contiguous segments (NHD and ``[2, NB, ...]`` orders, where a
        block's tokens or its K and V are apart: those pools stream)."""
        return read_segments(self.layout, self.layout.tensors(self.pool),
                             self.block_rows())


@dataclass(frozen=True)
class KVGroup:
    """One DP group: ``topology`` (the whole worker's), the group's ``dp_rank``, its block
    ``manager`` and the hosted ``ranks`` (rank -> :class:`RankKV`, at least one).

    Raises ``ValueError`` naming both values when a hosted rank is not in the group, a pool's
    layout disagrees with ``topology.local_layout(rank)``, ranks disagree on the number of
    blocks, or the manager's block size differs from the model's.
    """

    topology: Topology
    dp_rank: int
    manager: KVCacheManager
    ranks: Mapping[int, RankKV] = field(default_factory=dict)
    # What produced this KV (a fingerprint of the model's configuration and weights, or an
    # operator's model id and revision): a source and a destination pull only between equal
    # ids (``incompatible_model`` otherwise).
    model_id: str = ""

    def __post_init__(self) -> None:
        topo = self.topology
        if not 0 <= self.dp_rank < topo.parallel.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} out of range for dp_size "
                             f"{topo.parallel.dp_size}")
        if not self.ranks:
            raise ValueError(f"DP group {self.dp_rank} hosts no rank")
        group = topo.ranks_of_dp(self.dp_rank)
        block_size = topo.model.block_size
        if self.manager.block_size != block_size:
            raise ValueError(f"DP group {self.dp_rank}: manager block size "
                             f"{self.manager.block_size} != model block size {block_size}")
        num_blocks = None
        for rank, rank_kv in self.ranks.items():
            if rank != rank_kv.rank:
                raise ValueError(f"ranks[{rank}] holds the KV of rank {rank_kv.rank}")
            if rank not in group:
                raise ValueError(f"rank {rank} is not in DP group {self.dp_rank} "
                                 f"(ranks {list(group)})")
            want = topo.local_layout(rank, rank_kv.layout.num_blocks, rank_kv.layout.name)
            for f in _SIZE_FIELDS:
                got, exp = getattr(rank_kv.layout, f), getattr(want, f)
                if got != exp:
                    raise LayoutMismatchError(
                        f"rank {rank}: layout {rank_kv.layout.name!r} has {f} {got}, the "
                        f"topology gives that rank {f} {exp}")
            if num_blocks is None:
                num_blocks = rank_kv.layout.num_blocks
            elif rank_kv.layout.num_blocks != num_blocks:
                raise ValueError(f"rank {rank} has {rank_kv.layout.num_blocks} blocks, rank "
                                 f"{next(iter(self.ranks))} has {num_blocks}: one manager "
                                 "needs the same block ids on every rank")
        mgr_blocks = getattr(self.manager, "num_blocks", None)
        if isinstance(mgr_blocks, int) and mgr_blocks > num_blocks:
            raise ValueError(f"DP group {self.dp_rank}: manager has {mgr_blocks} blocks, the "
                             f"pools only {num_blocks}")
        object.__setattr__(self, "ranks", dict(sorted(self.ranks.items())))

    @property
    def num_blocks(self) -> int:
        return next(iter(self.ranks.values())).layout.num_blocks

    @property
    def hash_scheme(self) -> str:
        return self.manager.hash_scheme

    @property
    def block_size(self) -> int:
        return self.topology.model.block_size

    def rank_kv(self, rank: int) -> RankKV:
        try:
            return self.ranks[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is not hosted here; DP group {self.dp_rank} hosts "
                           f"{sorted(self.ranks)}") from None
