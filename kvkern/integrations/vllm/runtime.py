"""What one vLLM engine's two connector halves share in its process: the block index over
vLLM's block pool (bound by the scheduler half), the transfer loop, the credential, the
metrics, and (once the worker half has the KV tensors) the puller and the source service.

vLLM builds the scheduler half and the worker half as separate objects; with one worker per
engine (``UniProcExecutor``: tensor and pipeline parallel size 1) both live in the engine-core
process and find each other here by the engine's id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from kvkern.integrations.vllm.blocks import VllmBlocks
from kvkern.integrations.vllm.config import ConnectorConfig
from kvkern.xfer.auth import FROM_ENV, Credential, CredentialError, resolve
from kvkern.xfer.metrics import XferMetrics
from kvkern.xfer.runtime import EventLoopThread

__all__ = ["EngineRuntime", "check_kv_cache_groups", "engine_facts", "runtime_for"]

log = logging.getLogger("kvkern.integrations.vllm")

_RUNTIMES: dict[str, EngineRuntime] = {}
# vLLM executors that run the single worker in the engine core's process
SAME_PROCESS_EXECUTORS = ("uni", "external_launcher")
_RUNTIMES_LOCK = threading.Lock()


@dataclass(frozen=True)
class EngineFacts:
    """What kvkern needs to know of the engine, read once from its ``VllmConfig``."""

    engine_id: str
    block_size: int
    hash_scheme: str
    model_id: str
    head_dim: int


def check_kv_cache_groups(kv_cache_config: Any) -> None:
    """The engine's KV cache is one group of full attention, the one layout whose block
    table names a block of its own for every block of a request; ValueError otherwise. A
    sliding-window, chunked-local or state-space group hands out vLLM's shared null block for
    the positions it drops, which a pull can neither fill nor report as failed without
    rolling back every running request that holds it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: PLC0415

    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        return
    if len(groups) != 1:
        raise ValueError(f"the kvkern connector serves models with one KV cache group, "
                         f"this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        raise ValueError(f"the kvkern connector serves full attention KV caches; this "
                         f"model's is {type(spec).__name__}")


def engine_facts(vllm_config: Any, config: ConnectorConfig) -> EngineFacts:
    """Check that kvkern can serve this engine, and name what it needs; ValueError
    otherwise."""
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED, get_none_hash_seed

    kvt, cache, model = (vllm_config.kv_transfer_config, vllm_config.cache_config,
                         vllm_config.model_config)
    par = vllm_config.parallel_config
    if par.tensor_parallel_size * par.pipeline_parallel_size != 1:
        raise ValueError("the kvkern connector serves engines with one worker "
                         "(tensor_parallel_size=1, pipeline_parallel_size=1)")
    backend = getattr(par, "distributed_executor_backend", "uni")
    if backend not in SAME_PROCESS_EXECUTORS:
        # (the worker half in another process would have a runtime of its own, whose
        # blocks the scheduler half never binds: the engine would serve no peer)
        raise ValueError(f"the kvkern connector needs its worker in the scheduler's process "
                         f"(distributed_executor_backend {'/'.join(SAME_PROCESS_EXECUTORS)}, "
                         f"got {backend!r})")
    if getattr(kvt, "kv_load_failure_policy", "recompute") != "recompute":
        raise ValueError("the kvkern connector needs kv_load_failure_policy='recompute': a "
                         "pull that cannot be used must leave the request to recompute")
    if not cache.enable_prefix_caching:
        raise ValueError("the kvkern connector needs enable_prefix_caching=True (blocks are "
                         "named by vLLM's prefix-cache hashes)")
    algo = cache.prefix_caching_hash_algo
    scheme = f"vllm-{algo.replace('_', '-')}-v1"
    seed = get_none_hash_seed()
    if seed != DEFAULT_NONE_HASH_SEED:  # peers must share it, else no hash matches
        scheme += "+seed-" + hashlib.sha256(seed.encode()).hexdigest()[:12]
    head_dim = model.get_head_size()
    model_id = config.model_id or hashlib.sha256(json.dumps([
        model.model, getattr(model, "revision", None), str(model.dtype),
        str(cache.cache_dtype), cache.block_size, head_dim, scheme,
        # what else changes the KV of the same tokens: a quantization applied at load, and
        # overrides of the checkpoint's config (rope scaling, say)
        getattr(model, "quantization", None), getattr(model, "hf_overrides", None),
    ], default=str, sort_keys=True).encode()).hexdigest()
    return EngineFacts(engine_id=kvt.engine_id, block_size=cache.block_size,
                       hash_scheme=scheme, model_id=model_id, head_dim=head_dim)


@dataclass(eq=False)
class EngineRuntime:
    """One engine's shared kvkern state (see the module docstring)."""

    facts: EngineFacts
    config: ConnectorConfig
    blocks: VllmBlocks
    credential: Credential | None
    metrics: XferMetrics = field(default_factory=XferMetrics)
    loop: EventLoopThread | None = None
    puller: Any = None  # kvkern.xfer.puller.Puller, once the KV tensors are registered
    source: Any = None  # kvkern.xfer.source.SourceService, idem (config.serve)
    halves: int = 0

    def ensure_loop(self) -> EventLoopThread:
        if self.loop is None:
            self.loop = EventLoopThread("kvkern-vllm")
        return self.loop

    def release(self) -> None:
        """One half is done; the last one closes the puller, the source and the loop."""
        with _RUNTIMES_LOCK:
            self.halves -= 1
            if self.halves > 0:
                return
            _RUNTIMES.pop(self.facts.engine_id, None)
        if self.puller is not None:
            self.puller.close()
        if self.source is not None and self.loop is not None:
            try:
                self.loop.run(self.source.close(), 30)
            except Exception:  # closing: log and go on
                log.exception("closing the kvkern source")
        if self.loop is not None:
            self.loop.close()


def _credential(config: ConnectorConfig, peer_id: str) -> Credential | None:
    try:
        if config.fleet_secret_file:
            return Credential.from_file(config.fleet_secret_file, peer_id=peer_id)
        return resolve(FROM_ENV, peer_id=peer_id)
    except CredentialError as exc:
        raise ValueError(f"kvkern fleet credential: {exc}") from None


def _log_through_vllm() -> None:
    """kvkern's log lines (pull outcomes, fallbacks with their reasons) where vLLM's go,
    unless the application configured kvkern's logger itself."""
    ours = logging.getLogger("kvkern")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = not theirs.handlers


def runtime_for(vllm_config: Any, config: ConnectorConfig) -> EngineRuntime:
    """This engine's runtime, made by whichever half comes first."""
    facts = engine_facts(vllm_config, config)
    _log_through_vllm()
    if config.gil_switch_interval_s is not None:
        sys.setswitchinterval(config.gil_switch_interval_s)
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get(facts.engine_id)
        if rt is None:
            rt = EngineRuntime(facts=facts, config=config,
                               blocks=VllmBlocks(block_size=facts.block_size,
                                                 hash_scheme=facts.hash_scheme),
                               credential=_credential(config, f"vllm-{facts.engine_id[:12]}"))
            _RUNTIMES[facts.engine_id] = rt
            if rt.credential is None:
                log.warning("kvkern: no fleet credential; this engine serves no peer and "
                            "pulls from none")
        rt.halves += 1
        return rt
