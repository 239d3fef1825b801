"""The engine-side contract the transfer path needs from a KV cache manager
(:class:`KVCacheManager`), a reference paged block pool with a prefix index
(:class:`BlockPool`), and block-hash schemes (``kvkern-blake2b-v1``, ``public-xxh3-v1``,
``trtllm-v1``, vLLM's).

Names are loaded on first use, so importing ``kvkern.cache`` costs nothing until then.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "KVCacheManager": "kvkern.cache.protocol",
    "Lease": "kvkern.cache.protocol",
    "PinHandle": "kvkern.cache.protocol",
    "BlockPool": "kvkern.cache.pool",
    "HashScheme": "kvkern.cache.hashing",
    "DEFAULT_SCHEME": "kvkern.cache.hashing",
    "get_scheme": "kvkern.cache.hashing",
    "known_schemes": "kvkern.cache.hashing",
    "local_block_hashes": "kvkern.cache.hashing",
    "sequence_hashes": "kvkern.cache.hashing",
    "normalize_hash": "kvkern.cache.hashing",
    "normalize_hashes": "kvkern.cache.hashing",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvkern.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
