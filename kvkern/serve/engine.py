"""The worker's engine: one model, one paged KV pool, one block manager, one request at a time.

A request's blocks, for a prompt of ``n`` tokens and ``T`` tokens per block::

    prompt positions  [0 ............................................. n)
    blocks            | hit 0 | hit 1 | ... | hit h-1 | new ... | new (partial) | decode ...
                      [ acquire_prefix: cached here  ][ allocate: private to this request  ]
                      (local hits, and blocks a pull committed)
    cached_len = h*T  positions [0, h*T) are read, never written; prefill runs [h*T, n)

* The hit is capped at ``(n - 1) // T`` blocks so the last prompt token is always computed
  (its logits give the first token) and every position written lies in a private block
  (``cached_len`` is block aligned, so the block holding it is freshly allocated).
* After prefill, the prompt's full blocks past the hit are committed under their chained
  hashes (the pool's scheme); decode continues into private blocks.
* At the end every block the request holds is released once: committed blocks stay cached
  (evictable), the rest return to the free queue.

Time to first token is measured from the request's arrival (``arrival``, a
``time.perf_counter()`` stamp) to the first token's logits, so it includes any pull wait.

Router-domain hashes: the pool indexes chained hashes of its own scheme; the router reads
chained ``public-xxh3-v1`` hashes (:mod:`kvkern.serve.router`). For every prompt it has run
with the cache, the engine remembers ``pool hash -> (router hash, router parent, local
hash)`` and :meth:`Engine.report` lists those whose blocks are still cached.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvkern.cache.hashing import DEFAULT_SCHEME, get_scheme, local_block_hashes
from kvkern.cache.pool import BlockPool
from kvkern.serve.model import ModelConfig, PagedTransformer
from kvkern.serve.router import ROUTER_SCHEME, router_hashes

__all__ = ["Engine", "GenerateResult", "MODELS", "encode_logits", "decode_logits"]

MODELS = {"tiny": ModelConfig.tiny, "demo": ModelConfig.demo}


def encode_logits(x: torch.Tensor) -> str:
    """``[vocab]`` float32 logits as base64 of their little-endian bytes (bit exact)."""
    return base64.b64encode(x.detach().float().cpu().contiguous().numpy().tobytes()).decode()


def decode_logits(text: str) -> torch.Tensor:
    """Inverse of :func:`encode_logits`."""
    raw = bytearray(base64.b64decode(text))
    return torch.frombuffer(raw, dtype=torch.float32).clone()


@dataclass(kw_only=True)
class GenerateResult:
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int           # prefix positions read from the pool (local hit + pulled)
    prefill_tokens: int          # positions computed for the prompt
    ttft_s: float                # arrival -> first token
    prefill_s: float             # the prefill alone
    total_s: float               # arrival -> last token
    first_logits: torch.Tensor | None = None
    blocks_committed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, *, return_logits: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "prefill_tokens": self.prefill_tokens,
            "ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "total_s": self.total_s,
            "blocks_committed": self.blocks_committed, **self.extra,
        }
        if self.first_logits is not None:
            raw = self.first_logits.float().cpu().contiguous().numpy().tobytes()
            out["logits_sha256"] = hashlib.sha256(raw).hexdigest()
            if return_logits:
                out["logits"] = encode_logits(self.first_logits)
        return out


class Engine:
    """Model + KV pool tensor(s) in ``layout_name`` + a :class:`BlockPool`.

    :meth:`generate` is synchronous and serialised by a lock (one forward at a time); the
    pool itself is thread-safe, so the source service may pin and read blocks meanwhile.
    """

    def __init__(self, config: ModelConfig, *, device: str | torch.device = "cpu",
                 layout_name: str = "trtllm", num_blocks: int = 1024,
                 hash_scheme: str = DEFAULT_SCHEME, prefill_chunk: int | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.model = PagedTransformer(config, device=self.device)
        self.layout = config.kv_layout(num_blocks, layout_name)
        self.kv = self.layout.allocate(self.device, fill="zeros")
        self.pool = BlockPool(num_blocks, block_size=config.block_size, hash_scheme=hash_scheme)
        self.prefill_chunk = prefill_chunk
        self._lock = threading.Lock()
        self._router_map: dict[int, tuple[int, int | None, int]] = {}
        self._map_lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def pool_hashes(self, token_ids: Sequence[int], cache_salt: str = "") -> list[int]:
        """Chained pool-scheme hashes of the full blocks, under the request's cache salt."""
        scheme = get_scheme(self.pool.hash_scheme)
        return scheme.sequence_hashes(token_ids, self.block_size,
                                      cache_salt=scheme.salt_id(cache_salt))

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str = "", *,
                             hashes: Sequence[int] | None = None) -> int:
        """Prompt tokens this worker holds now under ``cache_salt`` (read-only, full blocks);
        ``hashes``: the prompt's :meth:`pool_hashes`, when the caller has them."""
        if hashes is None:
            hashes = self.pool_hashes(token_ids, cache_salt)
        return self.pool.longest_prefix(list(hashes)) * self.block_size

    # ------------------------------------------------------------------------ generation

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, *, arrival: float,
                 use_cache: bool = True, held: Sequence[int] = (),
                 on_prefill: Any = None, cache_salt: str = "",
                 hashes: Sequence[int] | None = None) -> GenerateResult:
        """Greedy generation of ``max_new_tokens`` tokens after ``token_ids``.

        ``held``: block ids the caller holds references on (claimed pulled blocks); they
        are released with the request's own. ``on_prefill(tokens, seconds)`` is called after
        a prefill that computed ``tokens`` positions (the puller's cost model learns it).
        ``cache_salt``: the tenant's salt; only blocks cached under the same salt are reused.
        ``hashes``: the prompt's :meth:`pool_hashes` under that salt, when the caller has them.
        """
        prompt = [int(t) for t in token_ids]
        T = self.block_size
        owned: list[int] = list(held)  # one reference each, released in `finally`
        with self._lock:
            try:
                if not use_cache:
                    hashes = []
                elif hashes is None:
                    hashes = self.pool_hashes(prompt, cache_salt)
                else:
                    hashes = list(hashes)
                hit: list[int] = []
                if use_cache:
                    hit = self.pool.acquire_prefix(hashes)
                    owned.extend(hit)
                    hit = hit[: (len(prompt) - 1) // T]  # always compute the last token
                cached_len = len(hit) * T

                def allocate() -> int | None:
                    ids = self.pool.allocate(1)
                    if ids is None:
                        return None
                    owned.append(ids[0])
                    return ids[0]

                t0 = time.perf_counter()
                first = self.model.greedy_generate(
                    prompt, min(1, max_new_tokens), pool=self.kv, layout=self.layout,
                    block_table=hit, allocate=allocate, cached_len=cached_len,
                    prefill_chunk=self.prefill_chunk)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t1 = time.perf_counter()
                ttft = t1 - arrival
                if on_prefill is not None:
                    on_prefill(len(prompt) - cached_len, t1 - t0)
                committed = 0
                nfull = len(prompt) // T
                if use_cache and nfull > len(hit):
                    flags = self.pool.commit(first.block_table[len(hit):nfull],
                                             hashes[len(hit):nfull],
                                             parent=hashes[len(hit) - 1] if hit else None)
                    committed = sum(flags)
                if use_cache:
                    self._remember(prompt, hashes, cache_salt)
                tokens = list(first.tokens)
                if max_new_tokens > 1:
                    rest = self.model.greedy_generate(
                        prompt + tokens, max_new_tokens - 1, pool=self.kv, layout=self.layout,
                        block_table=first.block_table, allocate=allocate,
                        cached_len=len(prompt))
                    tokens += rest.tokens
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return GenerateResult(
                    tokens=tokens, prompt_tokens=len(prompt), cached_tokens=cached_len,
                    prefill_tokens=len(prompt) - cached_len, ttft_s=ttft, prefill_s=t1 - t0,
                    total_s=time.perf_counter() - arrival,
                    first_logits=first.logits[0] if max_new_tokens else None,
                    blocks_committed=committed)
            finally:
                if owned:
                    self.pool.release(owned)

    # ------------------------------------------------------------------ router report

    def _remember(self, prompt: list[int], pool_hashes: list[int], cache_salt: str) -> None:
        if not pool_hashes:
            return
        local = local_block_hashes(prompt, self.block_size, ROUTER_SCHEME)
        if self.pool.hash_scheme == ROUTER_SCHEME:
            chained = pool_hashes
        else:
            chained = router_hashes(prompt, self.block_size, cache_salt)
        with self._map_lock:
            for i, ph in enumerate(pool_hashes):
                self._router_map[ph] = (chained[i], chained[i - 1] if i else None, local[i])
            if len(self._router_map) > 4 * self.pool.num_blocks:
                self._prune_locked()

    def _prune_locked(self) -> None:
        for ph in [ph for ph in self._router_map if not self.pool.longest_prefix([ph])]:
            del self._router_map[ph]

    def report(self, worker_id: str) -> dict[str, Any]:
        """``GET /kvkern/v1/blocks``: the router-domain hashes of the blocks cached here."""
        with self._map_lock:
            self._prune_locked()
            blocks = [{"hash": c, "parent": p, "local": loc}
                      for c, p, loc in self._router_map.values()]
        return {"worker_id": worker_id, "hash_scheme": ROUTER_SCHEME,
                "pool_hash_scheme": self.pool.hash_scheme, "block_size": self.block_size,
                "num_blocks": self.pool.num_blocks, "blocks": blocks}
