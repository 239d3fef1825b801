"""A small Llama-style transformer whose attention reads and writes a paged KV pool.

It exists for the worker, the demo and the tests: it proves that KV blocks pulled from
another worker continue a sequence exactly as the source's own cached blocks would. The
architecture is Llama's (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU),
weights come from a fixed seed, and the KV cache lives in a pool of any :class:`KVLayout`.

Paged KV, for one sequence (``T = block_size``)::

    positions   0 ........ T-1 | T ....... 2T-1 | 2T ..... 3T-1 | ...
    block_table[0]             | block_table[1] | block_table[2] | ...   (physical block ids)

    forward(token_ids[n], positions_start=s, ...):

    positions   [0 ............... s)[s ........... s+n)
                 KV already in pool    new tokens: K, V written to their slots,
                                        then every query attends causally over
                                        K, V of [0, s+n) read back from the pool

Physical placement never reaches the arithmetic: K and V of positions ``[0, s+n)`` are
first gathered (an exact copy) into a dense ``[s+n, 2, n_kv_heads, head_dim]`` tensor and
everything after that is the same computation whatever the block ids or the pool layout.
Hence the same KV content and the same call give bit-identical logits; that is the demo's
correctness criterion for a pulled prefix.

Threads: torch's CPU kernels split work by shape and intra-op thread count only, so equal
calls agree bit for bit across runs and processes *with the same* ``torch.get_num_threads()``.
Across different thread counts they may not: the fused attention kernel rounds a 1- or
3-token decode differently on 1 and 2 threads (measured, torch 2.13). Run every worker of a
demo with the same thread count; where workers share few cores, one thread per worker also
avoids OpenMP threads waiting on a busy core (a memcpy was 40x slower that way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvkern.checks import check_positive_int
from kvkern.layout.kv_layout import KVLayout

__all__ = [
    "Generation",
    "LayerWeights",
    "ModelConfig",
    "PagedTransformer",
    "allocate_from",
    "blocks_needed",
]

BlockAllocator = Callable[[], "int | None"]
"""Returns a free physical block id, or ``None`` when the pool is exhausted."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def allocate_from(block_ids: Iterable[int]) -> BlockAllocator:
    """A trivial allocator handing out ``block_ids`` in order, then ``None``.

    For tests and scripts; the worker uses kvkern's block pool instead.
    """
    it = iter(block_ids)
    return lambda: next(it, None)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of a :class:`PagedTransformer`; ``seed`` fixes its weights."""

    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    block_size: int = 16
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                      "ffn_hidden", "block_size", "max_seq_len"):
            check_positive_int(field, getattr(self, field))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """For unit tests: ~0.1 M parameters, blocks of 4 tokens so sequences span many."""
        sizes = dict(vocab_size=256, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_hidden=128, block_size=4, max_seq_len=512)
        return cls(**{**sizes, **overrides})

    @classmethod
    def demo(cls, **overrides) -> ModelConfig:
        """For the demo: ~30 M parameters, 16 KiB of fp32 KV per token. On 2 CPU cores a
        4096-token prefill takes seconds while pulling its 64 MiB of KV takes far less."""
        sizes = dict(vocab_size=8192, hidden=512, n_layers=8, n_heads=8, n_kv_heads=4,
                     head_dim=64, ffn_hidden=1408, block_size=16, max_seq_len=8192)
        return cls(**{**sizes, **overrides})

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers and KV heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

    def kv_layout(self, num_blocks: int, name: str = "trtllm") -> KVLayout:
        """The :class:`KVLayout` of a pool of ``num_blocks`` blocks for this model, in the
        engine layout ``name`` (``trtllm``, ``vllm_flash``, ``vllm_nhd``, ``vllm_hnd``,
        ``cross_layer``)."""
        return KVLayout.named(name, num_blocks=num_blocks, num_layers=self.n_layers,
                              num_heads=self.n_kv_heads, block_size=self.block_size,
                              head_dim=self.head_dim, dtype=self.dtype)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. Linear weights are ``[out_features, in_features]``."""

    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor         # [n_heads * head_dim, hidden]
    wk: torch.Tensor         # [n_kv_heads * head_dim, hidden]
    wv: torch.Tensor         # [n_kv_heads * head_dim, hidden]
    wo: torch.Tensor         # [hidden, n_heads * head_dim]
    mlp_norm: torch.Tensor   # [hidden]
    w_gate: torch.Tensor     # [ffn_hidden, hidden]
    w_up: torch.Tensor       # [ffn_hidden, hidden]
    w_down: torch.Tensor     # [hidden, ffn_hidden]


@dataclass(frozen=True)
class Generation:
    """What :meth:`PagedTransformer.greedy_generate` produced."""

    tokens: list[int]          # the generated tokens, in order
    logits: torch.Tensor       # [len(tokens), vocab_size] float32: logits each token came from
    block_table: list[int]     # the sequence's blocks, including any allocated on the way


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [n, hidden]`` normalised by its root mean square (in fp32), times ``weight``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Llama's rotate-half form. ``x [n, heads, D]``, ``cos/sin [n, 1, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class PagedTransformer:
    """A decoder-only Llama-style transformer over a paged KV pool.

    Weights are drawn from ``torch.Generator(seed)`` on the CPU in a fixed order and then
    moved to ``device``, so every process on every machine builds the same model. The model
    holds no KV state: each :meth:`forward` is told where the sequence's KV lives.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        c = config
        gen = torch.Generator(device="cpu").manual_seed(c.seed)

        def normal(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            return w.to(device=device, dtype=c.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=c.dtype)

        # Unit-scale embeddings and 1/sqrt(fan_in) projections keep every activation and the
        # logits at std ~1: attention is neither uniform nor one-hot, logits not degenerate.
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.embed = normal(c.vocab_size, c.hidden, std=1.0)  # [vocab, hidden]
        self.layers = [
            LayerWeights(
                attn_norm=ones(c.hidden),
                wq=normal(q_dim, c.hidden, std=c.hidden ** -0.5),
                wk=normal(kv_dim, c.hidden, std=c.hidden ** -0.5),
                wv=normal(kv_dim, c.hidden, std=c.hidden ** -0.5),
                wo=normal(c.hidden, q_dim, std=q_dim ** -0.5),
                mlp_norm=ones(c.hidden),
                w_gate=normal(c.ffn_hidden, c.hidden, std=c.hidden ** -0.5),
                w_up=normal(c.ffn_hidden, c.hidden, std=c.hidden ** -0.5),
                w_down=normal(c.hidden, c.ffn_hidden, std=c.ffn_hidden ** -0.5),
            )
            for _ in range(c.n_layers)
        ]
        self.final_norm = ones(c.hidden)                           # [hidden]
        self.lm_head = normal(c.vocab_size, c.hidden, std=c.hidden ** -0.5)  # [vocab, hidden]

        # One table for all positions, so a position's rotation never depends on how the
        # sequence was chunked. Computed in fp64 on the CPU, then rounded once.
        inv_freq = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64)
                                    / c.head_dim)
        angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)                # [max_seq_len, head_dim]
        self.rope_cos = angles.cos().to(device=device, dtype=c.dtype)
        self.rope_sin = angles.sin().to(device=device, dtype=c.dtype)
        self.device = self.embed.device

    def fingerprint(self) -> str:
        """``sha256:<hex>`` over the configuration and every weight's bytes: two workers
        whose KV may be exchanged have equal fingerprints (``KVGroup.model_id``)."""
        import hashlib  # noqa: PLC0415

        h = hashlib.sha256(repr(dataclasses.astuple(self.config)).encode())
        tensors = [self.embed, self.final_norm, self.lm_head]
        tensors += [t for layer in self.layers for t in dataclasses.astuple(layer)]
        for t in tensors:
            h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        return "sha256:" + h.hexdigest()

    @property
    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm, self.lm_head]
        tensors += [t for layer in self.layers for t in dataclasses.astuple(layer)]
        return sum(t.numel() for t in tensors)

    # -- paged KV access ----------------------------------------------------------------

    def _check_layout(self, pool, layout: KVLayout) -> list[torch.Tensor]:
        c = self.config
        want = dict(num_layers=c.n_layers, num_heads=c.n_kv_heads, block_size=c.block_size,
                    head_dim=c.head_dim, dtype=c.dtype)
        for field, value in want.items():
            if getattr(layout, field) != value:
                raise ValueError(
                    f"layout {layout.name!r} has {field}={getattr(layout, field)}, "
                    f"the model needs {field}={value}"
                )
        tensors = layout.check(pool)
        if tensors[0].device != self.device:
            raise ValueError(f"pool is on {tensors[0].device}, the model on {self.device}")
        return tensors

    def _slot_views(self, pool, layout: KVLayout) -> list[torch.Tensor]:
        """One view per layer, ``[num_blocks, block_size, 2, n_kv_heads, head_dim]`` (a slot
        is indexed by block and token), over the pool's own storage whatever the layout."""
        tensors = self._check_layout(pool, layout)
        if layout.per_layer:
            per_layer = [layout.canonical_view(t) for t in tensors]   # [NB, 2, H, T, D]
        else:
            whole = layout.canonical_view(tensors[0])                  # [NB, L, 2, H, T, D]
            per_layer = [whole[:, layer] for layer in range(layout.num_layers)]
        return [v.permute(0, 3, 1, 2, 4) for v in per_layer]

    def _block_index(self, block_table: Sequence[int], num_positions: int,
                     num_blocks: int) -> torch.Tensor:
        """``block_table[: ceil(num_positions / T)]`` as a tensor, validated."""
        need = blocks_needed(num_positions, self.config.block_size)
        if len(block_table) < need:
            raise ValueError(
                f"block_table has {len(block_table)} blocks, positions [0, {num_positions}) "
                f"need {need} of {self.config.block_size} tokens"
            )
        table = [int(b) for b in block_table[:need]]
        for b in table:
            if not 0 <= b < num_blocks:
                raise ValueError(f"block id {b} out of range for pool of {num_blocks} blocks")
        if len(set(table)) != need:
            raise ValueError(f"block_table repeats a block id: {table}")
        return torch.tensor(table, dtype=torch.long, device=self.device)

    # -- the model ----------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int] | torch.Tensor, positions_start: int,
                block_table: Sequence[int], pool, layout: KVLayout, *,
                last_only: bool = False) -> torch.Tensor:
        """Run tokens ``[s, s+n)`` of one sequence (``s = positions_start``) and return their
        logits, ``[n, vocab_size]`` float32 (``[1, vocab_size]`` for the last token only
        when ``last_only``).

        ``pool`` is a KV pool in ``layout`` (a tensor or a per-layer list, see
        :class:`KVLayout`) that already holds the sequence's K (after rotation) and V for
        positions ``[0, s)`` at the blocks of ``block_table``: block ``i`` holds positions
        ``[i*T, (i+1)*T)``. The caller allocates: ``block_table`` must cover ``s+n``
        positions. The new tokens' K and V are written to their slots; nothing else in the
        pool is touched. Prefill, chunked prefill and decode (``n = 1``) are all this call.
        """
        c = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        n, start = ids.numel(), int(positions_start)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start < 0 or start + n > c.max_seq_len:
            raise ValueError(
                f"positions [{start}, {start + n}) outside [0, max_seq_len={c.max_seq_len})"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        views = self._slot_views(pool, layout)
        total = start + n
        table = self._block_index(block_table, total, layout.num_blocks)   # [ceil(S / T)]

        all_pos = torch.arange(total, device=self.device)          # [S]
        new_pos = all_pos[start:]                                   # [n]
        write_at = (table[new_pos // c.block_size], new_pos % c.block_size)
        read_at = (table[all_pos // c.block_size], all_pos % c.block_size)
        causal = new_pos[:, None] >= all_pos[None, :]               # [n, S] bool
        cos = self.rope_cos[new_pos].unsqueeze(1)                   # [n, 1, D]
        sin = self.rope_sin[new_pos].unsqueeze(1)

        x = self.embed[ids]                                         # [n, hidden]
        for w, slots in zip(self.layers, views, strict=True):
            h = _rms_norm(x, w.attn_norm, c.norm_eps)
            q = F.linear(h, w.wq).view(n, c.n_heads, c.head_dim)
            k = F.linear(h, w.wk).view(n, c.n_kv_heads, c.head_dim)
            v = F.linear(h, w.wv).view(n, c.n_kv_heads, c.head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            slots[write_at] = torch.stack((k, v), dim=1)            # [n, 2, H_kv, D] -> pool
            # Read back every position as one new dense tensor: only a copy, so its bits and
            # strides depend on the KV content and S alone, never on block ids or layout.
            # (Per-position indexing: 1.2 ms at 4096 positions, 6x faster than gathering
            # whole blocks with index_select and reshaping.)
            kv = slots[read_at]                                     # [S, 2, H_kv, D]
            attn = self._attention(q, kv[:, 0], kv[:, 1], causal)   # [n, n_heads * D]
            x = x + F.linear(attn, w.wo)
            h = _rms_norm(x, w.mlp_norm, c.norm_eps)
            x = x + F.linear(F.silu(F.linear(h, w.w_gate)) * F.linear(h, w.w_up), w.w_down)
        if last_only:
            x = x[-1:]
        x = _rms_norm(x, self.final_norm, c.norm_eps)
        return F.linear(x, self.lm_head).float()

    __call__ = forward

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention. ``q [n, n_heads, D]``, ``k, v [S, n_kv_heads, D]``,
        ``causal [n, S]`` (True = may attend); returns ``[n, n_heads * D]``."""
        n = q.shape[0]
        # 4-D inputs with enable_gqa reach torch's fused CPU flash kernel (query head h reads
        # KV head h // group, no repeated KV, no [n, S] scores): at 4096 keys, 8 heads, one
        # thread, 0.2 ms to decode one token and 0.36 s to prefill 4096 vs 7 ms and 2.0 s for
        # 3-D inputs, which fall back to the math kernel.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],                                 # [1, n_heads, n, D]
            k.transpose(0, 1)[None],                                 # [1, n_kv_heads, S, D]
            v.transpose(0, 1)[None],
            attn_mask=causal, enable_gqa=True,
        )                                                            # [1, n_heads, n, D]
        return out[0].transpose(0, 1).reshape(n, -1)                # [n, n_heads * D]

    # -- convenience ----------------------------------------------------------------------

    def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, pool,
                        layout: KVLayout, block_table: Sequence[int] = (),
                        allocate: BlockAllocator | None = None, cached_len: int = 0,
                        prefill_chunk: int | None = None) -> Generation:
        """Greedy decoding of one sequence over the paged pool.

        ``block_table`` holds the sequence's blocks so far; the first ``cached_len`` prompt
        positions must already have their KV there (a local prefix hit or a pulled prefix),
        and ``0 <= cached_len < len(prompt_ids)``: the last prompt token is always computed,
        for its logits (cap a full hit at ``len - 1`` tokens, as vLLM does). Positions from
        ``cached_len`` on are written, so the block holding position ``cached_len`` must be
        private to this sequence unless ``cached_len`` is a multiple of ``block_size``.
        Blocks still missing are taken from ``allocate`` one at a time as positions reach
        them.

        The prompt tail ``[cached_len, len)`` runs in chunks of ``prefill_chunk`` tokens
        (one pass when ``None``), then ``max_new_tokens - 1`` single-token decode steps.
        ``max_new_tokens = 0`` only prefills (fills the cache). Ties go to the lowest id.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if not 0 <= cached_len < len(prompt):
            raise ValueError(
                f"cached_len {cached_len} must lie in [0, {len(prompt)}) for a prompt of "
                f"{len(prompt)} tokens"
            )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        table = [int(b) for b in block_table]
        T = self.config.block_size

        def run(ids: list[int], start: int) -> torch.Tensor:
            while len(table) < blocks_needed(start + len(ids), T):
                block = allocate() if allocate is not None else None
                if block is None:
                    why = "allocator is exhausted" if allocate else "no allocator given"
                    raise RuntimeError(
                        f"positions [0, {start + len(ids)}) need "
                        f"{blocks_needed(start + len(ids), T)} blocks, have {len(table)}; {why}"
                    )
                table.append(int(block))
            return self.forward(ids, start, table, pool, layout, last_only=True)[0]

        chunk = prefill_chunk or len(prompt)
        for start in range(cached_len, len(prompt), chunk):
            last = run(prompt[start:start + chunk], start)          # [vocab]
        tokens: list[int] = []
        logits: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            if step:
                last = run(tokens[-1:], len(prompt) + step - 1)
            logits.append(last)
            tokens.append(int(torch.argmax(last)))
        vocab = self.config.vocab_size
        stacked = torch.stack(logits) if logits else torch.empty(0, vocab, device=self.device)
        return Generation(tokens=tokens, logits=stacked, block_table=table)

