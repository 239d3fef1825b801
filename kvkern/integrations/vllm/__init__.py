"""kvkern inside vLLM v1: :class:`KvkernConnector`, a KV connector that pulls a hinted prefix
from the vLLM engine that holds it, straight into the blocks vLLM allocated, and serves this
engine's prefix-cached blocks to its peers.

Enable it on every engine (each is a source and a destination)::

    from vllm.config import KVTransferConfig

    KVTransferConfig(kv_connector="KvkernConnector",
                     kv_connector_module_path="kvkern.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"listen": "10.0.0.5:8600",
                                                "allowlist": "10.0.0.0/16",
                                                "accept_from": "10.0.0.0/16",
                                                "fleet_secret_file": "/etc/kvkern/secret"})

Settings: :mod:`kvkern.integrations.vllm.config`. The halves:
:mod:`~kvkern.integrations.vllm.scheduler` (hint, admission, the allocated blocks),
:mod:`~kvkern.integrations.vllm.worker` (puller and source over vLLM's KV tensors),
:mod:`~kvkern.integrations.vllm.blocks` (pins in vLLM's block pool),
:mod:`~kvkern.integrations.vllm.layout` (vLLM's KV tensors as kvkern pools).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvkernConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvkernConnector":  # vLLM is imported only by who uses the connector
        from kvkern.integrations.vllm.connector import KvkernConnector

        return KvkernConnector
    raise AttributeError(f"module 'kvkern.integrations.vllm' has no attribute {name!r}")
