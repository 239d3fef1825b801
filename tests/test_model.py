"""The paged transformer: matches a dense reference, chunks agree, and a prefix copied to
other blocks or another layout continues bit for bit like the original."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvkern.layout.kv_layout import KVLayout
from kvkern.serve.model import (
    ModelConfig,
    PagedTransformer,
    allocate_from,
    blocks_needed,
)

LAYOUTS = ["trtllm", "vllm_hnd", "vllm_nhd", "vllm_flash", "cross_layer"]
NUM_BLOCKS = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread unless a test asks for more: tiny shapes gain nothing from
    threads, and on a shared 2-core machine OpenMP threads waiting on a busy core make these
    tests 10x slower. Bit-identity is claimed for equal thread counts (see the model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> PagedTransformer:
    return PagedTransformer(ModelConfig.tiny())


def tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def shuffled_blocks(num_blocks: int, seed: int) -> list[int]:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()


def random_pool(layout: KVLayout, seed: int = 0):
    """A pool full of random bytes (NaNs included): anything read by mistake shows."""
    return layout.allocate(fill="random", generator=torch.Generator().manual_seed(seed))


def layer_views(layout: KVLayout, pool) -> list[torch.Tensor]:
    """Per layer ``[NB, 2, H, T, D]`` views of the pool's storage."""
    tensors = layout.tensors(pool)
    if layout.per_layer:
        return [layout.canonical_view(t) for t in tensors]
    whole = layout.canonical_view(tensors[0])
    return [whole[:, layer] for layer in range(layout.num_layers)]


def copy_blocks(src_layout, src_pool, src_ids, dst_layout, dst_pool, dst_ids) -> None:
    """What a pull does to the bytes: block src_ids[i] lands in block dst_ids[i]."""
    src_index, dst_index = torch.tensor(src_ids), torch.tensor(dst_ids)
    for s, d in zip(layer_views(src_layout, src_pool), layer_views(dst_layout, dst_pool),
                    strict=True):
        d[dst_index] = s[src_index]


def bits(x: torch.Tensor) -> torch.Tensor:
    """Compare floats bit for bit (NaN payloads included)."""
    return x.contiguous().view(torch.int32)


# -- a dense, non-paged reference --------------------------------------------------------

def dense_reference(model: PagedTransformer, ids: list[int]):
    """The same model written the textbook way: whole sequence, no pool, explicit softmax.

    Returns logits ``[n, vocab]`` and, per layer, the rotated K and V ``[n, H_kv, D]``.
    """
    c = model.config
    n, D = len(ids), c.head_dim
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]   # [n, D/2]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]

    def rope(x):  # [n, H, D]: rotate the pairs (i, i + D/2) by position * inv_freq[i]
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def norm(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    group = c.n_heads // c.n_kv_heads
    x = model.embed[torch.tensor(ids)]
    kv_cache = []
    for w in model.layers:
        h = norm(x, w.attn_norm)
        q = rope((h @ w.wq.T).view(n, c.n_heads, D))
        k = rope((h @ w.wk.T).view(n, c.n_kv_heads, D))
        v = (h @ w.wv.T).view(n, c.n_kv_heads, D)
        kv_cache.append((k, v))
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k_rep) / math.sqrt(D)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v_rep).reshape(n, -1) @ w.wo.T
        h = norm(x, w.mlp_norm)
        x = x + (F.silu(h @ w.w_gate.T) * (h @ w.w_up.T)) @ w.w_down.T
    return norm(x, model.final_norm) @ model.lm_head.T, kv_cache


# -- correctness against the reference ----------------------------------------------------

@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_paged_prefill_matches_dense_reference(model, layout_name):
    c = model.config
    layout = c.kv_layout(NUM_BLOCKS, layout_name)
    pool = random_pool(layout)
    before = layout.logical(pool)
    ids = tokens(37, c.vocab_size)
    table = shuffled_blocks(NUM_BLOCKS, seed=1)[: blocks_needed(len(ids), c.block_size)]

    logits = model.forward(ids, 0, table, pool, layout)
    want, kv_cache = dense_reference(model, ids)

    assert logits.shape == (len(ids), c.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    after = layout.logical(pool)
    for p in range(len(ids)):   # the pool holds the reference's rotated K and V ...
        block, slot = table[p // c.block_size], p % c.block_size
        for layer, (k, v) in enumerate(kv_cache):
            torch.testing.assert_close(after[block, layer, 0, :, slot], k[p], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(after[block, layer, 1, :, slot], v[p], rtol=1e-5, atol=1e-5)
        before[block, :, :, :, slot] = after[block, :, :, :, slot]
    assert torch.equal(bits(after), bits(before))   # ... and every other byte is untouched


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_grouped_query_attention_matches_reference(n_kv_heads):
    model = PagedTransformer(ModelConfig.tiny(n_kv_heads=n_kv_heads, seed=3))
    layout = model.config.kv_layout(NUM_BLOCKS, "vllm_hnd")
    ids = tokens(21, model.config.vocab_size, seed=2)
    logits = model.forward(ids, 0, list(range(6)), layout.allocate(), layout)
    torch.testing.assert_close(logits, dense_reference(model, ids)[0], rtol=1e-4, atol=1e-4)


def test_rope_uses_absolute_positions(model):
    """The same token run at a later position stores the same V but K rotated by the
    position (as the reference rotates it), and its logits change."""
    c = model.config
    layout = c.kv_layout(NUM_BLOCKS, "trtllm")
    ids = tokens(12, c.vocab_size, seed=4)
    pool = layout.allocate(fill="zeros")
    model.forward(ids[:9], 0, list(range(3)), pool, layout)
    late = model.forward(ids[9:], 9, list(range(3)), pool, layout)       # positions 9..11
    _, kv_cache = dense_reference(model, ids)
    views = layer_views(layout, pool)
    for layer, (k, v) in enumerate(kv_cache):
        torch.testing.assert_close(views[layer][2, 0, :, 1:4].transpose(0, 1), k[9:],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(views[layer][2, 1, :, 1:4].transpose(0, 1), v[9:],
                                   rtol=1e-5, atol=1e-5)

    early_pool = layout.allocate(fill="zeros")
    early = model.forward(ids[9:], 0, [5], early_pool, layout)          # positions 0..2
    early_views = layer_views(layout, early_pool)
    assert torch.equal(early_views[0][5, 1, :, :3], views[0][2, 1, :, 1:4])    # same V
    assert not torch.allclose(early_views[0][5, 0, :, :3], views[0][2, 0, :, 1:4])  # K rotated
    assert not torch.allclose(early, late)


# -- chunking -------------------------------------------------------------------------------

def test_chunked_prefill_agrees_with_one_pass(model):
    c = model.config
    layout = c.kv_layout(NUM_BLOCKS, "trtllm")
    ids = tokens(37, c.vocab_size, seed=5)
    table = shuffled_blocks(NUM_BLOCKS, seed=6)[:10]
    one_pool, chunk_pool = layout.allocate(fill="zeros"), layout.allocate(fill="zeros")

    one = model.forward(ids, 0, table, one_pool, layout)
    chunks = [model.forward(ids[a:b], a, table, chunk_pool, layout)
              for a, b in [(0, 10), (10, 23), (23, 36), (36, 37)]]   # unaligned, then decode

    torch.testing.assert_close(torch.cat(chunks), one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunk_pool, one_pool, rtol=1e-5, atol=1e-5)
    last = model.forward(ids[-1:], 36, table, chunk_pool, layout, last_only=True)
    assert last.shape == (1, c.vocab_size)


@pytest.mark.parametrize("prefill_chunk", [None, 1, 5, 16])
def test_chunked_prefill_gives_the_same_greedy_tokens(model, prefill_chunk):
    c = model.config
    layout = c.kv_layout(NUM_BLOCKS, "vllm_nhd")
    prompt = tokens(30, c.vocab_size, seed=7)
    runs = [
        model.greedy_generate(prompt, 12, pool=layout.allocate(), layout=layout,
                              allocate=allocate_from(range(NUM_BLOCKS)), prefill_chunk=chunk)
        for chunk in (None, prefill_chunk)
    ]
    assert runs[0].tokens == runs[1].tokens
    torch.testing.assert_close(runs[0].logits, runs[1].logits, rtol=1e-5, atol=1e-5)
    assert len(set(runs[0].tokens)) > 3            # not a degenerate model
    assert runs[0].block_table == list(range(blocks_needed(30 + 11, c.block_size)))


# -- the demo's criterion: a moved prefix continues bit for bit ------------------------------

def continue_after_copy(model, src_name, dst_name):
    """Source prefills a 24-token prefix and continues the request; the destination gets the
    prefix's blocks copied to other block ids (and layout) and continues the same request."""
    c = model.config
    prompt = tokens(35, c.vocab_size, seed=8)
    prefix_len = 24                                        # 6 full blocks of 4
    src_layout, dst_layout = c.kv_layout(NUM_BLOCKS, src_name), c.kv_layout(NUM_BLOCKS, dst_name)
    src_pool, dst_pool = random_pool(src_layout, 1), random_pool(dst_layout, 2)

    src_free = shuffled_blocks(NUM_BLOCKS, seed=9)
    src_prefix = model.greedy_generate(prompt[:prefix_len], 0, pool=src_pool, layout=src_layout,
                                       allocate=allocate_from(src_free), prefill_chunk=10)
    src_blocks = src_prefix.block_table
    source = model.greedy_generate(prompt, 10, pool=src_pool, layout=src_layout,
                                   block_table=src_blocks, cached_len=prefix_len,
                                   allocate=allocate_from(src_free[len(src_blocks):]),
                                   prefill_chunk=4)

    dst_free = list(reversed(shuffled_blocks(NUM_BLOCKS, seed=10)))
    dst_blocks = dst_free[: len(src_blocks)]
    assert dst_blocks != src_blocks
    copy_blocks(src_layout, src_pool, src_blocks, dst_layout, dst_pool, dst_blocks)
    copied = [bits(v[dst_blocks]) for v in layer_views(dst_layout, dst_pool)]
    destination = model.greedy_generate(prompt, 10, pool=dst_pool, layout=dst_layout,
                                        block_table=dst_blocks, cached_len=prefix_len,
                                        allocate=allocate_from(dst_free[len(dst_blocks):]),
                                        prefill_chunk=4)
    for before, view in zip(copied, layer_views(dst_layout, dst_pool), strict=True):
        assert torch.equal(before, bits(view[dst_blocks]))     # the prefix is only read
    return source, destination


@pytest.mark.parametrize("src_name,dst_name", [
    ("trtllm", "trtllm"), ("trtllm", "vllm_hnd"), ("vllm_hnd", "vllm_nhd"),
    ("vllm_nhd", "trtllm"), ("cross_layer", "vllm_flash"),
])
def test_copied_prefix_continues_bit_identically(model, src_name, dst_name):
    source, destination = continue_after_copy(model, src_name, dst_name)
    assert torch.equal(source.logits, destination.logits)
    assert source.tokens == destination.tokens


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_copied_prefix_continues_bit_identically_on_two_threads(model, two_threads):
    """Threaded kernels split work by shape and thread count only, so two workers with the
    same thread count agree bit for bit too."""
    source, destination = continue_after_copy(model, "vllm_nhd", "vllm_hnd")
    assert torch.equal(source.logits, destination.logits)


def test_another_process_builds_the_same_model_and_logits(model, tmp_path):
    """Weights come from the seed alone; a fresh process with the same thread count gives
    the same bits."""
    script = textwrap.dedent(f"""
        import torch
        from kvkern.serve.model import ModelConfig, PagedTransformer, allocate_from
        torch.set_num_threads({torch.get_num_threads()})
        model = PagedTransformer(ModelConfig.tiny())
        layout = model.config.kv_layout(64, "vllm_hnd")
        run = model.greedy_generate({tokens(20, 256, seed=11)}, 5, pool=layout.allocate(),
                                    layout=layout, allocate=allocate_from(range(64)))
        torch.save((model.embed, model.lm_head, run.logits), {str(tmp_path / "out.pt")!r})
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    embed, lm_head, logits = torch.load(tmp_path / "out.pt")
    layout = model.config.kv_layout(64, "vllm_hnd")
    here = model.greedy_generate(tokens(20, 256, seed=11), 5, pool=layout.allocate(),
                                 layout=layout, allocate=allocate_from(range(64)))
    assert torch.equal(embed, model.embed) and torch.equal(lm_head, model.lm_head)
    assert torch.equal(logits, here.logits)


# -- configuration and misuse -----------------------------------------------------------------

def test_presets_and_kv_layout():
    demo = ModelConfig.demo()
    assert demo.n_heads % demo.n_kv_heads == 0 and demo.n_kv_heads < demo.n_heads
    assert demo.kv_bytes_per_token == 2 * demo.n_layers * demo.n_kv_heads * demo.head_dim * 4
    layout = demo.kv_layout(10, "vllm_hnd")
    assert (layout.num_layers, layout.num_heads, layout.head_dim, layout.block_size) == (
        demo.n_layers, demo.n_kv_heads, demo.head_dim, demo.block_size)
    assert layout.bytes_per_block == demo.kv_bytes_per_token * demo.block_size
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig.tiny(n_kv_heads=3)
    with pytest.raises(ValueError, match="even"):
        ModelConfig.tiny(head_dim=15)


def test_misuse_raises(model):
    c = model.config
    layout = c.kv_layout(8, "trtllm")
    pool = layout.allocate()
    with pytest.raises(ValueError, match="need 3"):
        model.forward(tokens(9, c.vocab_size), 0, [0, 1], pool, layout)
    with pytest.raises(ValueError, match="out of range"):
        model.forward([1], 0, [8], pool, layout)
    with pytest.raises(ValueError, match="repeats"):
        model.forward(tokens(8, c.vocab_size), 0, [2, 2], pool, layout)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.forward([1], c.max_seq_len, list(range(8)), pool, layout)
    with pytest.raises(ValueError, match="token ids"):
        model.forward([c.vocab_size], 0, [0], pool, layout)
    with pytest.raises(ValueError, match="num_heads"):
        other = KVLayout.trtllm(num_blocks=8, num_layers=c.n_layers, num_heads=c.n_heads,
                                block_size=c.block_size, head_dim=c.head_dim, dtype=c.dtype)
        model.forward([1], 0, [0], other.allocate(), other)
    with pytest.raises(RuntimeError, match="exhausted"):
        model.greedy_generate(tokens(9, c.vocab_size), 4, pool=pool, layout=layout,
                              allocate=allocate_from([0, 1]))
    with pytest.raises(ValueError, match="cached_len"):
        model.greedy_generate([1, 2], 1, pool=pool, layout=layout, block_table=[0],
                              cached_len=2)


# -- speed of the demo preset -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_demo_prefill_throughput(threads):
    """Prints prefill tokens/s of the demo preset on this machine (no assertion)."""
    config = ModelConfig.demo()
    model = PagedTransformer(config)
    sizes = [512, 2048, 4096]
    layout = config.kv_layout(blocks_needed(max(sizes), config.block_size), "trtllm")
    pool = layout.allocate(fill="zeros")
    table = list(range(layout.num_blocks))
    torch.set_num_threads(threads)          # the module fixture restores one thread
    model.forward(tokens(64, config.vocab_size), 0, table, pool, layout)   # warm up
    print(f"\ndemo preset ({model.num_parameters / 1e6:.0f} M parameters, "
          f"{config.kv_bytes_per_token} B of KV per token), {threads} thread(s)")
    for n in sizes:
        ids = tokens(n, config.vocab_size, seed=n)
        best = math.inf
        for _ in range(2):
            t0 = time.perf_counter()
            model.forward(ids, 0, table, pool, layout, last_only=True)
            best = min(best, time.perf_counter() - t0)
        print(f"  prefill {n:5d} tokens: {best:6.2f} s  {n / best:7.0f} tokens/s")
    t0 = time.perf_counter()
    for i in range(16):
        model.forward([1], max(sizes) - 16 + i, table, pool, layout)
    print(f"  decode at {max(sizes)} tokens: {(time.perf_counter() - t0) / 16 * 1e3:.1f} ms/token")
