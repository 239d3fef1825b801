"""What the connector accepts of an engine's configuration (:func:`kvkern.integrations.vllm
.runtime.engine_facts`), on stand-ins for vLLM's config objects, and the connector's answer to
vLLM's scheduler about preemption."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvkern.integrations.vllm.config import ConnectorConfig
from kvkern.integrations.vllm.runtime import check_kv_cache_groups, engine_facts

pytestmark = pytest.mark.vllm


def vllm_config(*, backend: str = "uni", tp: int = 1, **model) -> SimpleNamespace:
    fields = {"model": "m", "revision": None, "dtype": "float32", "quantization": None,
              "hf_overrides": {}, **model}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_load_failure_policy="recompute"),
        cache_config=SimpleNamespace(enable_prefix_caching=True,
                                     prefix_caching_hash_algo="sha256", cache_dtype="auto",
                                     block_size=16),
        model_config=SimpleNamespace(get_head_size=lambda: 64, **fields),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        distributed_executor_backend=backend))


@pytest.mark.parametrize("backend", ["uni", "external_launcher"])
def test_a_worker_in_the_schedulers_process_is_served(backend):
    assert engine_facts(vllm_config(backend=backend), ConnectorConfig()).block_size == 16


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_a_worker_in_another_process_is_refused(backend):
    """Its worker half would hold a block index that the scheduler half never binds, and the
    engine would serve no peer without a word."""
    with pytest.raises(ValueError, match="worker in the scheduler's process"):
        engine_facts(vllm_config(backend=backend), ConnectorConfig())


@pytest.mark.parametrize("change", [{"quantization": "fp8"},
                                    {"hf_overrides": {"rope_scaling": {"factor": 2.0}}},
                                    {"dtype": "bfloat16"}, {"revision": "r2"}])
def test_what_changes_the_kv_of_the_same_tokens_changes_the_model_id(change):
    """Engines whose KV for the same tokens differs never pull from each other."""
    base = engine_facts(vllm_config(), ConnectorConfig()).model_id
    assert engine_facts(vllm_config(**change), ConnectorConfig()).model_id != base
    assert engine_facts(vllm_config(), ConnectorConfig()).model_id == base


def test_a_preempted_request_keeps_its_sampled_tokens():
    """The connector hands nothing off when a request finishes, so vLLM need not drop a
    preempted request's in-flight tokens (``requires_kv_delivery``)."""
    from kvkern.integrations.vllm.connector import KvkernConnector

    assert KvkernConnector.requires_kv_delivery.fget(None) is False


def _groups(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_only_one_group_of_full_attention_is_served():
    """A sliding-window (or chunked-local, or state-space) group hands out vLLM's shared null
    block for the positions it drops: a pull cannot fill it, and reporting it as a load
    error would roll back every running request that holds it."""
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    full = FullAttentionSpec(**shape)
    check_kv_cache_groups(_groups(full))
    check_kv_cache_groups(_groups(FullAttentionSpec(**shape, sliding_window=64)))  # (all blocks)
    check_kv_cache_groups(None)  # (a worker built without the config: nothing to check)
    for spec in (SlidingWindowSpec(**shape, sliding_window=64), MLAAttentionSpec(**shape)):
        with pytest.raises(ValueError, match=f"full attention KV caches; .* {type(spec).__name__}"):
            check_kv_cache_groups(_groups(spec))
    with pytest.raises(ValueError, match="one KV cache group, this one has 2"):
        check_kv_cache_groups(_groups(full, full))
