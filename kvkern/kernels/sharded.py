"""Sharded pack/unpack: move the pieces of a :class:`~kvkern.layout.plan.TransferPlan` between
one source rank's pool and one destination rank's pool through one contiguous staging stream.

For each (source rank, destination rank) pair the source packs every piece the destination
needs from it, back to back, into one flat byte buffer (one message per peer); the
destination unpacks each piece into its own pool, which may use another engine layout::

    source rank s pool (its layers x heads)      stream s -> d (flat uint8)
    +---------------------------+                +------------------+------------------+
    | piece 0: src_layers x     |--- pack ------>| piece 0 staging  | piece 1 staging  | ...
    |          src_heads        |                | [n,L0,2,H0,T,D]  | [n,L1,2,H1,T,D]  |
    +---------------------------+                +------------------+------------------+
                                                 ^ block_offset*n   ^ ...
    destination rank d pool                                  |
    +---------------------------+                            |
    | dst_layers x dst_heads    |<------------- unpack ------+
    +---------------------------+

Piece offsets come from the plan (``piece.byte_offset(n_blocks)``); the copies are the core
kernels :func:`kvkern.kernels.pack.pack` / :func:`~kvkern.kernels.pack.unpack` on views into
the stream, so bytes move exactly once and bit-exactly.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvkern.kernels.pack import pack, unpack
from kvkern.layout.kv_layout import KVLayout, LayoutMismatchError
from kvkern.layout.plan import PeerTransfer, Piece, TransferPlan
from kvkern.layout.topology import Topology

__all__ = ["pack_for_peer", "unpack_from_peer", "peer_stream_nbytes"]

Backend = Literal["auto", "triton", "torch"]


def _num_blocks(block_ids) -> int:
    if isinstance(block_ids, torch.Tensor):
        return int(block_ids.numel())
    return len(block_ids)


def _check_layout(topo: Topology, rank: int, layout: KVLayout, side: str) -> None:
    """The pool's layout must hold exactly this rank's layers and heads of the plan's model."""
    l0, l1 = topo.layer_range(rank)
    h0, h1 = topo.head_range(rank)
    m = topo.model
    want = {"num_layers": l1 - l0, "num_heads": h1 - h0, "block_size": m.block_size,
            "head_dim": m.head_dim, "dtype": m.torch_dtype}
    for field, value in want.items():
        got = getattr(layout, field)
        if got != value:
            raise LayoutMismatchError(
                f"{side} rank {rank}: layout {layout.name!r} has {field} {got}, the plan's "
                f"topology gives that rank {field} {value}"
            )


def _pool_device(layout: KVLayout, pool) -> torch.device:
    tensors = layout.tensors(pool)
    if not tensors or not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"pool must be a tensor or a list of tensors, got {type(pool).__name__}")
    return tensors[0].device


def _flat_bytes(buf: torch.Tensor, nbytes: int, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if not buf.is_contiguous():
        raise ValueError(f"{what} must be contiguous, got shape {tuple(buf.shape)} "
                         f"strides {buf.stride()}")
    if buf.device != device:
        raise ValueError(f"{what} is on {buf.device}, pool on {device}")
    flat = buf.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    if flat.numel() != nbytes:
        raise ValueError(f"{what} holds {flat.numel()} bytes, the plan's stream needs {nbytes}")
    return flat


def _piece_view(flat: torch.Tensor, piece: Piece, n: int, layout: KVLayout) -> torch.Tensor:
    o, length = piece.byte_offset(n), piece.byte_length(n)
    shape = piece.staging_shape(n, layout.block_size, layout.head_dim)
    return flat[o:o + length].view(layout.dtype).view(shape)


def peer_stream_nbytes(plan: TransferPlan, src_rank: int, dst_rank: int, n_blocks: int) -> int:
    """Bytes of the staging stream from ``src_rank`` to ``dst_rank`` for ``n_blocks`` blocks."""
    return plan.pair(src_rank, dst_rank).nbytes(n_blocks)


def pack_for_peer(plan: TransferPlan, src_rank: int, dst_rank: int, pool, layout: KVLayout,
                  block_ids, out: torch.Tensor | None = None, *,
                  max_programs: int | None = None, backend: Backend = "auto") -> torch.Tensor:
    """Pack everything ``dst_rank`` needs from ``src_rank`` into one contiguous stream.

    Args:
        plan: the transfer plan; ``(src_rank, dst_rank)`` must be one of its pairs.
        pool, layout: source rank ``src_rank``'s local pool and its layout (holding exactly
            that rank's layers and heads, as :meth:`Topology.local_layout` gives).
        block_ids: the request's blocks in the source pool, in request order (negative =
            padding: its staging rows are left unwritten).
        out: optional contiguous buffer of exactly the stream's bytes (any dtype; e.g. a
            registered send buffer); a new flat ``uint8`` tensor otherwise.
        max_programs: the grid cap of every piece's launch (see
            :func:`kvkern.kernels.pack.pack`); no effect on CPU tensors or on the bytes.

    Returns:
        the stream as a flat ``uint8`` tensor of ``plan.pair(src_rank, dst_rank).nbytes(n)``
        bytes, on the pool's device.
    """
    transfer: PeerTransfer = plan.pair(src_rank, dst_rank)
    _check_layout(plan.src, src_rank, layout, "source")
    device = _pool_device(layout, pool)
    n = _num_blocks(block_ids)
    nbytes = transfer.nbytes(n)
    if out is None:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    else:
        flat = _flat_bytes(out, nbytes, device, "out")
    if n == 0:
        return flat
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.to(device=device, dtype=torch.int64)
    for piece in transfer.pieces:
        pack(pool, layout, block_ids, out=_piece_view(flat, piece, n, layout),
             layers=piece.src_layers, heads=piece.src_heads,
             max_programs=max_programs, backend=backend)
    return flat


def unpack_from_peer(plan: TransferPlan, src_rank: int, dst_rank: int, buffer: torch.Tensor,
                     pool, layout: KVLayout, block_ids, *, max_programs: int | None = None,
                     backend: Backend = "auto") -> None:
    """Unpack the stream ``src_rank`` sent into destination rank ``dst_rank``'s pool.

    ``buffer`` is the stream :func:`pack_for_peer` produced (contiguous, exactly its bytes,
    on the pool's device); ``block_ids`` are the destination blocks in request order, one per
    source block (negative = padding, skipped; duplicates raise). Blocks not named are never
    written.
    """
    transfer: PeerTransfer = plan.pair(src_rank, dst_rank)
    _check_layout(plan.dst, dst_rank, layout, "destination")
    device = _pool_device(layout, pool)
    n = _num_blocks(block_ids)
    flat = _flat_bytes(buffer, transfer.nbytes(n), device, "buffer")
    if n == 0:
        return
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.to(device=device, dtype=torch.int64)
    for piece in transfer.pieces:
        unpack(_piece_view(flat, piece, n, layout), pool, layout, block_ids,
               layers=piece.dst_layers, heads=piece.dst_heads,
               max_programs=max_programs, backend=backend)
