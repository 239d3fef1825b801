"""vLLM's KV cache tensors as kvkern pools (:mod:`kvkern.integrations.vllm.layout`), checked
against how vLLM's own attention backends split them into keys and values. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from kvkern.integrations.vllm.layout import check_kv_layout, rank_kv

NB, H, T, D, L = 6, 2, 32, 8, 3


def caches(device_order: str = "contiguous") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in (2, 0, 1):  # vLLM's dict order is not the layer order
        t = torch.randn(NB, H, T, 2 * D, generator=g)
        if device_order == "tokens_outer":  # another physical order: [NB, T, H, 2D] memory
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def test_cpu_cache_keys_and_values_are_vllms():
    kv = caches()
    topo, rank = rank_kv(kv, head_dim=D, layout="vllm_cpu")
    assert rank.layout.name == "vllm_cpu" and topo.model.num_layers == L
    logical = rank.layout.logical(rank.pool)  # [NB, L, 2, H, T, D]
    for layer in range(L):
        t = kv[f"model.layers.{layer}.self_attn.attn"]
        key, value = t.view(NB, H, 2 * T, D).chunk(2, dim=2)  # vLLM's CPU attention
        assert torch.equal(logical[:, layer, 0], key)
        assert torch.equal(logical[:, layer, 1], value)


@pytest.mark.parametrize("order", ["contiguous", "tokens_outer"])
def test_unified_cache_keys_and_values_are_vllms(order):
    kv = caches(order)
    _, rank = rank_kv(kv, head_dim=D, layout="vllm_v1")
    logical = rank.layout.logical(rank.pool)
    for layer in range(L):
        t = kv[f"model.layers.{layer}.self_attn.attn"]
        key, value = t.transpose(1, 2).split(D, dim=-1)  # FlashAttention's [NB, T, H, D]
        assert torch.equal(logical[:, layer, 0], key.transpose(1, 2))
        assert torch.equal(logical[:, layer, 1], value.transpose(1, 2))


def test_the_views_write_vllms_memory():
    kv = caches()
    _, rank = rank_kv(kv, head_dim=D, layout="vllm_cpu")
    rank.pool[0].fill_(7.0)  # layer 0's view
    assert bool((kv["model.layers.0.self_attn.attn"] == 7.0).all())


def test_unusable_caches_are_refused_by_name():
    kv = caches()
    with pytest.raises(ValueError, match="2 \\* head_dim=32"):
        rank_kv(kv, head_dim=16)
    shared = {"model.layers.0.attn": kv["model.layers.0.self_attn.attn"],
              "model.layers.1.attn": kv["model.layers.0.self_attn.attn"]}
    with pytest.raises(ValueError, match="share a KV cache tensor"):
        rank_kv(shared, head_dim=D)
    with pytest.raises(ValueError, match="kv_layout must be"):
        rank_kv(kv, head_dim=D, layout="trtllm")


def test_a_connector_layout_setting_that_is_not_the_devices_is_refused():
    """A ``kv_layout`` of the other device's backends would put keys where vLLM keeps
    values, unseen by peers: the connector refuses it at start."""
    kv = caches()
    with pytest.raises(ValueError, match="not the layout of vLLM's cache on cpu"):
        check_kv_layout(kv, "vllm_v1")
    check_kv_layout(kv, "vllm_cpu")
    check_kv_layout(kv, None)
