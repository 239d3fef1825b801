"""Transfer plans between two topologies: which source rank sends which (layers x heads) to
which destination rank, and where each piece sits in the staging stream of its rank pair.

Example: 8 KV heads, 6 layers; source TP4/PP1 -> destination TP2/PP2 (DP 1 on both sides).
Source rank ``s<t>`` holds every layer and heads ``2t, 2t+1``; destination rank
``d<pp*2+tp>`` holds stage ``pp``'s layers (3 each) and heads ``4tp .. 4tp+3``::

                 global KV heads ->
                 h0  h1  h2  h3  h4  h5  h6  h7
    source   L0 +-------+-------+-------+-------+
    TP4 PP1  .. |  s0   |  s1   |  s2   |  s3   |    every source rank: L0-L5, 2 heads
             L5 +-------+-------+-------+-------+

    dest     L0 +---------------+---------------+
    TP2 PP2  L2 |      d0       |      d1       |    stage 0: L0-L2
             L3 +---------------+---------------+
             L5 |      d2       |      d3       |    stage 1: L3-L5
                +---------------+---------------+

    pair      global (layers, heads)   source local (layers, heads)   dest local
    s0 -> d0  L[0,3) h[0,2)            L[0,3) h[0,2)                  L[0,3) h[0,2)
    s1 -> d0  L[0,3) h[2,4)            L[0,3) h[0,2)                  L[0,3) h[2,4)
    s0 -> d2  L[3,6) h[0,2)            L[3,6) h[0,2)                  L[0,3) h[0,2)
    ...       (8 pairs, one piece each; every source rank sends to 2 destination ranks)

A piece's bytes travel in the canonical staging format
``[n_blocks, n_layers, 2, n_heads, block_size, head_dim]``; the pieces of one
(source rank, destination rank) pair are concatenated into one stream, so the transport sends
one message per pair. Offsets scale with the number of blocks: a piece starts at byte
``block_offset * n_blocks`` of its pair's stream and is ``block_nbytes * n_blocks`` long.

Replicated heads (attention TP larger than the KV head count) are fetched once per
destination rank, from one of the source replicas; the destination ranks' demands on one
(source stage, head) are spread over its replicas round-robin, so replicas differ by at most
one piece. Planning is pure Python and cached (:func:`plan_transfer` is an ``lru_cache`` over
frozen inputs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from kvkern.layout.topology import IncompatibleTopologyError, ModelKVSpec, Topology

__all__ = [
    "PLAN_VERSION",
    "PeerTransfer",
    "Piece",
    "TransferPlan",
    "check_compatible",
    "plan_transfer",
]

PLAN_VERSION = 1

Range = tuple[int, int]


class Piece(NamedTuple):
    """One (layer range x head range) slab that one source rank sends to one destination rank.

    ``layers``/``heads`` are global half-open ranges; ``src_*``/``dst_*`` are the same ranges
    in each side's local pool (pass them as ``layers=``/``heads=`` to pack/unpack).
    ``block_offset``/``block_nbytes`` are the piece's byte offset and length in its pair's
    staging stream per block (multiply by the number of blocks).
    """

    src_rank: int
    dst_rank: int
    layers: Range
    heads: Range
    src_layers: Range
    src_heads: Range
    dst_layers: Range
    dst_heads: Range
    block_offset: int
    block_nbytes: int

    def byte_offset(self, n_blocks: int) -> int:
        return self.block_offset * n_blocks

    def byte_length(self, n_blocks: int) -> int:
        return self.block_nbytes * n_blocks

    def staging_shape(self, n_blocks: int, block_size: int, head_dim: int) -> tuple[int, ...]:
        return (n_blocks, self.layers[1] - self.layers[0], 2, self.heads[1] - self.heads[0],
                block_size, head_dim)


class PeerTransfer(NamedTuple):
    """Every piece one source rank sends one destination rank, in stream order."""

    src_rank: int
    dst_rank: int
    pieces: tuple[Piece, ...]
    block_nbytes: int  # bytes of the pair's whole stream per block

    def nbytes(self, n_blocks: int) -> int:
        return self.block_nbytes * n_blocks


def _r(r: Range) -> str:
    return f"[{r[0]},{r[1]})"


_COMPAT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")


def check_compatible(src: ModelKVSpec, dst: ModelKVSpec) -> None:
    """Raise :class:`IncompatibleTopologyError` naming the first field whose values differ
    (``layer_split`` is not compared: stages may split layers differently)."""
    for field in _COMPAT_FIELDS:
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise IncompatibleTopologyError(f"{field}: source {a!r} != destination {b!r}")


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """The plan for moving one request's KV from one source DP group to one destination DP
    group. ``transfers`` holds one :class:`PeerTransfer` per (source rank, destination rank)
    pair that exchanges anything, ordered by destination rank, then source rank."""

    src: Topology
    src_dp_rank: int
    dst: Topology
    dst_dp_rank: int
    transfers: tuple[PeerTransfer, ...]

    # -- lookups -------------------------------------------------------------------------

    @functools.cached_property
    def _by_pair(self) -> dict[tuple[int, int], PeerTransfer]:
        return {(t.src_rank, t.dst_rank): t for t in self.transfers}

    def pair(self, src_rank: int, dst_rank: int) -> PeerTransfer:
        """The transfer between one rank pair; ``KeyError`` naming both if there is none."""
        try:
            return self._by_pair[(src_rank, dst_rank)]
        except KeyError:
            raise KeyError(
                f"plan has no transfer from source rank {src_rank} to destination rank "
                f"{dst_rank}; pairs: {sorted(self._by_pair)}"
            ) from None

    def for_destination(self, dst_rank: int) -> tuple[PeerTransfer, ...]:
        """What destination rank ``dst_rank`` receives, one entry per source rank."""
        return tuple(t for t in self.transfers if t.dst_rank == dst_rank)

    def for_source(self, src_rank: int) -> tuple[PeerTransfer, ...]:
        """What source rank ``src_rank`` sends, one entry per destination rank."""
        return tuple(t for t in self.transfers if t.src_rank == src_rank)

    @property
    def src_ranks(self) -> tuple[int, ...]:
        """Source ranks that send anything (in rank order)."""
        return tuple(sorted({t.src_rank for t in self.transfers}))

    @property
    def dst_ranks(self) -> tuple[int, ...]:
        """Destination ranks of the destination DP group (each receives something)."""
        return self.dst.ranks_of_dp(self.dst_dp_rank)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for t in self.transfers for p in t.pieces)

    def total_bytes(self, n_blocks: int) -> int:
        """Bytes moved over all pairs for ``n_blocks`` blocks."""
        return sum(t.block_nbytes for t in self.transfers) * n_blocks

    # -- checks --------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the plan's invariants; ``ValueError`` naming the first violation.

        Every destination rank of the DP group is covered exactly once over its
        (layers x heads); every piece lies inside its source rank's holdings, in the source DP
        group; local ranges agree with the global ones; stream offsets are dense.
        """
        src, dst = self.src, self.dst
        check_compatible(src.model, dst.model)
        src_group = set(src.ranks_of_dp(self.src_dp_rank))
        dst_group = self.dst_ranks
        unit = src.model.bytes_per_layer_head_block
        covered: dict[int, set[tuple[int, int]]] = {d: set() for d in dst_group}
        seen_pairs = set()
        for t in self.transfers:
            if (t.src_rank, t.dst_rank) in seen_pairs:
                raise ValueError(f"pair ({t.src_rank}, {t.dst_rank}) listed twice")
            seen_pairs.add((t.src_rank, t.dst_rank))
            if t.src_rank not in src_group:
                raise ValueError(f"source rank {t.src_rank} not in source DP group "
                                 f"{self.src_dp_rank} {sorted(src_group)}")
            if t.dst_rank not in covered:
                raise ValueError(f"destination rank {t.dst_rank} not in destination DP group "
                                 f"{self.dst_dp_rank} {list(dst_group)}")
            sl, sh = src.layer_range(t.src_rank), src.head_range(t.src_rank)
            dl, dh = dst.layer_range(t.dst_rank), dst.head_range(t.dst_rank)
            offset = 0
            for p in t.pieces:
                (l0, l1), (h0, h1) = p.layers, p.heads
                if (p.src_rank, p.dst_rank) != (t.src_rank, t.dst_rank):
                    raise ValueError(f"piece {p} filed under pair ({t.src_rank}, {t.dst_rank})")
                if not (l0 < l1 and h0 < h1):
                    raise ValueError(f"piece {p} is empty")
                if not (sl[0] <= l0 and l1 <= sl[1] and sh[0] <= h0 and h1 <= sh[1]):
                    raise ValueError(f"piece {p} outside source rank {t.src_rank}'s layers "
                                     f"{sl} and heads {sh}")
                if not (dl[0] <= l0 and l1 <= dl[1] and dh[0] <= h0 and h1 <= dh[1]):
                    raise ValueError(f"piece {p} outside destination rank {t.dst_rank}'s "
                                     f"layers {dl} and heads {dh}")
                want = ((l0 - sl[0], l1 - sl[0]), (h0 - sh[0], h1 - sh[0]),
                        (l0 - dl[0], l1 - dl[0]), (h0 - dh[0], h1 - dh[0]))
                if (p.src_layers, p.src_heads, p.dst_layers, p.dst_heads) != want:
                    raise ValueError(f"piece {p} local ranges disagree with its global ranges")
                if p.block_offset != offset or p.block_nbytes != (l1 - l0) * (h1 - h0) * unit:
                    raise ValueError(f"piece {p} offset/length not dense in its stream")
                offset += p.block_nbytes
                cells = covered[t.dst_rank]
                for layer in range(l0, l1):
                    for head in range(h0, h1):
                        if (layer, head) in cells:
                            raise ValueError(f"destination rank {t.dst_rank} receives layer "
                                             f"{layer} head {head} twice")
                        cells.add((layer, head))
            if t.block_nbytes != offset:
                raise ValueError(f"pair ({t.src_rank}, {t.dst_rank}) block_nbytes "
                                 f"{t.block_nbytes} != sum of pieces {offset}")
        for d, cells in covered.items():
            (l0, l1), (h0, h1) = dst.layer_range(d), dst.head_range(d)
            if len(cells) != (l1 - l0) * (h1 - h0):
                raise ValueError(f"destination rank {d} receives {len(cells)} of its "
                                 f"{(l1 - l0) * (h1 - h0)} (layer, head) cells")

    # -- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain ints, strings, lists and dicts (JSON/msgpack ready, e.g. via msgspec)."""
        return {
            "version": PLAN_VERSION,
            "src": self.src.to_dict(), "src_dp_rank": self.src_dp_rank,
            "dst": self.dst.to_dict(), "dst_dp_rank": self.dst_dp_rank,
            "transfers": [
                {"src_rank": t.src_rank, "dst_rank": t.dst_rank, "block_nbytes": t.block_nbytes,
                 "pieces": [
                     {"layers": list(p.layers), "heads": list(p.heads),
                      "src_layers": list(p.src_layers), "src_heads": list(p.src_heads),
                      "dst_layers": list(p.dst_layers), "dst_heads": list(p.dst_heads),
                      "block_offset": p.block_offset, "block_nbytes": p.block_nbytes}
                     for p in t.pieces]}
                for t in self.transfers
            ],
        }

    @classmethod
    def from_dict(cls, d: dict, *, validate: bool = True) -> TransferPlan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. a decoded control message).

        Input is untrusted: wrong types, versions or shapes raise ``ValueError``/``TypeError``
        and, with ``validate`` (the default), so does any broken invariant.
        """
        if not isinstance(d, dict):
            raise TypeError(f"plan must be a dict, got {type(d).__name__}")
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('version')!r}, this kvkern reads {PLAN_VERSION}")

        def num(x, what: str) -> int:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise ValueError(f"plan field {what} must be a non-negative int, got {x!r}")
            return x

        def rng(x, what: str) -> Range:
            if not isinstance(x, (list, tuple)) or len(x) != 2:
                raise ValueError(f"plan field {what} must be a [start, stop] pair, got {x!r}")
            return (num(x[0], what), num(x[1], what))

        transfers = []
        for t in d["transfers"]:
            s, r = num(t["src_rank"], "src_rank"), num(t["dst_rank"], "dst_rank")
            pieces = tuple(
                Piece(s, r, rng(p["layers"], "layers"), rng(p["heads"], "heads"),
                      rng(p["src_layers"], "src_layers"), rng(p["src_heads"], "src_heads"),
                      rng(p["dst_layers"], "dst_layers"), rng(p["dst_heads"], "dst_heads"),
                      num(p["block_offset"], "block_offset"),
                      num(p["block_nbytes"], "block_nbytes"))
                for p in t["pieces"])
            transfers.append(PeerTransfer(s, r, pieces, num(t["block_nbytes"], "block_nbytes")))
        plan = cls(src=Topology.from_dict(d["src"]),
                   src_dp_rank=num(d["src_dp_rank"], "src_dp_rank"),
                   dst=Topology.from_dict(d["dst"]),
                   dst_dp_rank=num(d["dst_dp_rank"], "dst_dp_rank"),
                   transfers=tuple(transfers))
        if validate:
            plan.validate()
        return plan

    def describe(self) -> str:
        """A human-readable table of the plan (for logs and debugging)."""
        s, d = self.src.parallel, self.dst.parallel
        lines = [f"plan: source TP{s.tp_size} PP{s.pp_size} DP{s.dp_size} (dp rank "
                 f"{self.src_dp_rank}) -> destination TP{d.tp_size} PP{d.pp_size} DP{d.dp_size} "
                 f"(dp rank {self.dst_dp_rank}), {len(self.transfers)} pairs"]
        for t in self.transfers:
            for p in t.pieces:
                lines.append(
                    f"  s{p.src_rank:<3}-> d{p.dst_rank:<3} L{_r(p.layers)} h{_r(p.heads)}  "
                    f"src L{_r(p.src_layers)} h{_r(p.src_heads)}  dst L{_r(p.dst_layers)} "
                    f"h{_r(p.dst_heads)}  @{p.block_offset}+{p.block_nbytes} B/block")
        return "\n".join(lines)


@functools.lru_cache(maxsize=1024)
def plan_transfer(src: Topology, src_dp_rank: int, dst: Topology, dst_dp_rank: int) -> TransferPlan:
    """Plan moving one request's KV from DP group ``src_dp_rank`` of ``src`` to DP group
    ``dst_dp_rank`` of ``dst``.

    Raises :class:`IncompatibleTopologyError` (``.reason == "incompatible_topology"``) when the
    models' KV shapes differ, ``ValueError`` for a DP rank out of range. Cached.
    """
    check_compatible(src.model, dst.model)
    sp, dp_ = src.parallel, dst.parallel
    if not 0 <= src_dp_rank < sp.dp_size:
        raise ValueError(f"source DP rank {src_dp_rank} out of range for dp_size {sp.dp_size}")
    if not 0 <= dst_dp_rank < dp_.dp_size:
        raise ValueError(f"destination DP rank {dst_dp_rank} out of range for dp_size "
                         f"{dp_.dp_size}")
    unit = src.model.bytes_per_layer_head_block
    s_tp, s_base = sp.tp_size, src_dp_rank * sp.attn_tp_size
    s_rep, s_per = src.head_replicas, src.heads_per_rank
    d_tp, d_base = dp_.tp_size, dst_dp_rank * dp_.attn_tp_size
    s_stages = src.stage_layers

    # Head part of the pieces of each destination TP rank, independent of layers:
    # (source TP rank or first replica, global heads, source local heads, dest local heads,
    # head count, replicated?).
    head_parts = []
    for t in range(dp_.attn_tp_size):
        dh0, dh1 = dst.tp_head_range(t)
        if s_rep == 1:
            # One holder per head; the destination's range spans source ranges
            # [st*s_per, (st+1)*s_per) wholly or partly.
            parts = []
            for st in range(dh0 // s_per, (dh1 - 1) // s_per + 1):
                h0, h1 = max(dh0, st * s_per), min(dh1, st * s_per + s_per)
                parts.append((st, (h0, h1), (h0 - st * s_per, h1 - st * s_per),
                              (h0 - dh0, h1 - dh0), h1 - h0, False))
        else:
            # Each head on s_rep source ranks [h*s_rep, (h+1)*s_rep): picked per demand below.
            parts = [(h * s_rep, (h, h + 1), (0, 1), (h - dh0, h - dh0 + 1), 1, True)
                     for h in range(dh0, dh1)]
        head_parts.append(parts)

    new = tuple.__new__  # NamedTuple construction without the Python-level __new__ (~2x)
    next_replica: dict[tuple[int, int], int] = {}
    transfers = []
    # Destination ranks ascend with (stage, tp) and source ranks with (stage, tp), so the
    # transfers come out ordered by (dst_rank, src_rank) without a sort.
    for d_pp, (dl0, dl1) in enumerate(dst.stage_layers):
        overlaps = [(s_pp * s_tp + s_base, s_pp, (max(dl0, a), min(dl1, b)),
                     (max(dl0, a) - a, min(dl1, b) - a), (max(dl0, a) - dl0, min(dl1, b) - dl0))
                    for s_pp, (a, b) in enumerate(s_stages) if a < dl1 and dl0 < b]
        for t, parts in enumerate(head_parts):
            d_rank = d_pp * d_tp + d_base + t
            for stage_base, s_pp, layers, src_layers, dst_layers in overlaps:
                per_head = (layers[1] - layers[0]) * unit
                for st, heads, src_heads, dst_heads, nh, replicated in parts:
                    s_rank = stage_base + st
                    if replicated:
                        # Spread the demands on (stage, head) over its replicas round-robin.
                        key = (s_pp, heads[0])
                        k = next_replica.get(key, 0)
                        next_replica[key] = k + 1
                        s_rank += k % s_rep
                    nb = per_head * nh
                    piece = new(Piece, (s_rank, d_rank, layers, heads, src_layers, src_heads,
                                        dst_layers, dst_heads, 0, nb))
                    transfers.append(new(PeerTransfer, (s_rank, d_rank, (piece,), nb)))
    # With the TRT-LLM/vLLM head and layer assignment every (source, destination) pair
    # intersects in one (layer range x head range), so each pair carries exactly one piece
    # at offset 0; ``validate`` and the tests check this.
    return TransferPlan(src=src, src_dp_rank=src_dp_rank, dst=dst, dst_dp_rank=dst_dp_rank,
                        transfers=tuple(transfers))
