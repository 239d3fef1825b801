"""A tiny Llama with random weights, written from ``model.json`` (no download): big enough
that its logits vary with every input token, so a wrong KV block changes them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HERE = Path(__file__).parent


def write_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """``folder`` with ``config.json`` and ``model.safetensors`` (deterministic weights);
    ``overrides`` change fields of ``model.json`` (a larger model for benchmarks)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**json.loads((HERE / "model.json").read_text()), **overrides}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads, head_dim = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                 cfg["head_dim"])
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
               "model.norm.weight": torch.ones(hidden), "lm_head.weight": w(vocab, hidden) * 4}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden) * 2,
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden) * 2,
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
