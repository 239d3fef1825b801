"""kvkern: router-hinted peer-to-peer pulls of paged KV-cache blocks between LLM workers.

The public names below are loaded lazily so that ``import kvkern`` needs only torch and
never imports the transport stack (ucxx, aiohttp, msgspec, prometheus-client).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "pack": "kvkern.kernels.pack",
    "unpack": "kvkern.kernels.pack",
    "reference_pack": "kvkern.kernels.reference",
    "reference_unpack": "kvkern.kernels.reference",
    "KVLayout": "kvkern.layout.kv_layout",
    "Axis": "kvkern.layout.kv_layout",
    "allocate_staging": "kvkern.layout.kv_layout",
    "staging_shape": "kvkern.layout.kv_layout",
    "ModelKVSpec": "kvkern.layout.topology",
    "Parallelism": "kvkern.layout.topology",
    "Topology": "kvkern.layout.topology",
    "plan_transfer": "kvkern.layout.plan",
    "TransferPlan": "kvkern.layout.plan",
    "pack_for_peer": "kvkern.kernels.sharded",
    "unpack_from_peer": "kvkern.kernels.sharded",
    "local_block_hashes": "kvkern.cache.hashing",
    "BlockPool": "kvkern.cache.pool",
    "KVCacheManager": "kvkern.cache.protocol",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvkern' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
