"""The connector's scheduler half: read a request's hint, admit it against vLLM's own prefix
hit and block hashes, and hand the worker half the blocks vLLM allocated for the pulled tail.

Per hinted request (vLLM's calls, in order)::

    get_num_new_matched_tokens   hint (kv_transfer_params or Request.kv_hints), its signature,
                                 admit(engine hashes, local hit) -> (tail tokens, async) or 0
    update_state_after_alloc     the tail's block ids -> a Load for the next step's metadata
    build_connector_meta         the step's Loads -> the worker half (pull_into), and the
                                 step's number: the blocks vLLM cached in it are served
                                 once the worker half reports its forward pass done
    update_connector_output      finished_recving: the load is over (one per request: when
                                 vLLM asks again after a failed load, the answer is 0)
    request_finished             a load still running: keep the blocks (True) until the
                                 worker reports it finished (vLLM frees them then)

The admission never touches the network; a hint that leads to no pull is counted
(``hints_ignored``) and logged with its reason exactly as in ``kvkern worker``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from kvkern.cache.hashing import vllm_u64
from kvkern.integrations.vllm.runtime import EngineRuntime
from kvkern.xfer.admission import Admitted, Skip, WorkerFacts, admit, read_hint
from kvkern.xfer.auth import check_hint
from kvkern.xfer.config import XferConfig
from kvkern.xfer.hints import HintLimits, KvHint
from kvkern.xfer.outcome import PullOutcome, Reason
from kvkern.xfer.policy import CostGuard

__all__ = ["Load", "LoadMetadataBase", "SchedulerSide", "hint_body", "xfer_config"]

log = logging.getLogger("kvkern.integrations.vllm")


@dataclass(frozen=True)
class Load:
    """One admitted pull into the blocks vLLM allocated (``block_ids[i]`` receives the block
    named by ``admitted.chained[admitted.local + i]``). Without ``admitted`` the load has
    already failed: the worker half reports it finished with ``block_ids`` to recompute (a
    request vLLM holds for a load must always hear that it ended)."""

    request_id: str
    hint: KvHint | None
    admitted: Admitted | None
    block_ids: tuple[int, ...]


class LoadMetadataBase:
    """The step's loads, from the scheduler half to the worker half; ``idle`` when the step
    computes no token (the engine is only waiting, for example on pulls); ``step``: its
    number in the block index (:meth:`VllmBlocks.seal
    <kvkern.integrations.vllm.blocks.VllmBlocks.seal>`), reported written after its forward
    pass."""

    def __init__(self, loads: list[Load], idle: bool = False, step: int = 0) -> None:
        self.loads = loads
        self.idle = idle
        self.step = step


def xfer_config(rt: EngineRuntime) -> XferConfig:
    cfg = rt.config
    return XferConfig(allowlist=list(cfg.allowlist), default_policy=cfg.policy,
                      metadata_timeout_s=cfg.metadata_timeout_s,
                      transfer_timeout_s=cfg.transfer_timeout_s, deadline_s=cfg.deadline_s,
                      max_inflight_pulls=cfg.max_inflight_pulls, dedup=False,
                      state_port_offset=0)  # a tcp:// endpoint (Dynamo) names the listen port


def hint_body(request: Any) -> dict | None:
    """Where vLLM carries a request's hint, as one body ``decode_hint`` reads: the fields of
    ``kv_transfer_params`` (``kv_hint``, ``kv_hints``, ``router_hint``, ``remote_kv_source``,
    the signature) and ``Request.kv_hints`` (the ``kv.fetch@1.0`` envelope)."""
    params = request.kv_transfer_params
    envelope = getattr(request, "kv_hints", None)
    if not params and envelope is None:
        return None
    body: dict = {}
    if isinstance(params, dict):
        body.update(params)
        body["kv_transfer_params"] = params
    if envelope is not None and "kv_hints" not in body:
        body["kv_hints"] = msgspec.to_builtins(envelope)
    return body


class SchedulerSide:
    """The scheduler half of :class:`~kvkern.integrations.vllm.KvkernConnector`."""

    def __init__(self, rt: EngineRuntime, kv_cache_manager: Any = None) -> None:
        self.rt = rt
        self.config = xfer_config(rt)
        self._limits = HintLimits(max_metadata_timeout_s=self.config.max_metadata_timeout_s,
                                  max_transfer_timeout_s=self.config.max_transfer_timeout_s,
                                  max_deadline_s=self.config.max_deadline_s,
                                  default_policy=self.config.default_policy)
        self._cost_guard = CostGuard(self.config)
        self._admitted: dict[str, tuple[int, KvHint, Admitted] | None] = {}
        self._loads: list[Load] = []
        self._loading: set[str] = set()
        self._tried: set[str] = set()  # requests that had their pull
        if kv_cache_manager is not None:
            self.bind(kv_cache_manager)

    def bind(self, kv_cache_manager: Any) -> None:
        self.rt.blocks.bind(kv_cache_manager)

    @property
    def cost_guard(self) -> CostGuard:
        """The worker half's guard once it exists (it learns from every pull)."""
        puller = self.rt.puller
        return puller.cost_guard if puller is not None else self._cost_guard

    # ---------------------------------------------------------------- vLLM's calls

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self._tried:  # one pull per request: after a failed one, vLLM recomputes
            return 0, False
        cached = self._admitted.get(rid, False)
        if cached is False or (cached is not None and cached[0] != num_computed_tokens):
            cached = self._admit(request, num_computed_tokens)
            self._admitted[rid] = cached
        if cached is None:
            return 0, False
        return cached[2].count * self.rt.facts.block_size, True

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        entry = self._admitted.pop(rid, None)
        if num_external_tokens <= 0:
            return
        bs = self.rt.facts.block_size
        ids = blocks.get_block_ids()[0]
        # the blocks before the external tokens' (vLLM sets num_computed_tokens only later)
        local = max(0, len(ids) - -(-num_external_tokens // bs))
        load = None
        if entry is not None:
            _, hint, adm = entry
            n = min(num_external_tokens // bs, adm.count)
            if n < adm.count:  # vLLM took fewer tokens than offered: pull fewer blocks
                adm = dataclasses.replace(adm, chained=adm.chained[:adm.local + n],
                                          hinted=adm.local + n)
            tail = tuple(ids[adm.local:adm.local + n])
            if n > 0 and len(tail) == n:
                load = Load(rid, hint, adm, tail)
            local = adm.local
        if load is None:  # vLLM waits for a load all the same: report it failed
            log.error("request %s: no pull for the %d tokens vLLM holds it for (%d blocks "
                      "allocated after %d local)", rid, num_external_tokens,
                      len(ids) - local, local)
            load = Load(rid, None, None, tuple(ids[local:]))
        self._loads.append(load)
        self._loading.add(rid)
        self._tried.add(rid)

    def build_connector_meta(self, metadata_type: type, scheduled_tokens: int) -> Any:
        loads, self._loads = self._loads, []
        return metadata_type(loads, idle=scheduled_tokens == 0, step=self.rt.blocks.seal())

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)

    def request_finished(self, request: Any) -> tuple[bool, dict | None]:
        """Keep a finished request's blocks while its pull may still write them."""
        rid = request.request_id
        self._admitted.pop(rid, None)
        self._tried.discard(rid)
        return rid in self._loading, None

    # ---------------------------------------------------------------------- admission

    def _admit(self, request: Any, num_computed_tokens: int
               ) -> tuple[int, KvHint, Admitted] | None:
        """The request's admitted pull, or None. Runs inside vLLM's ``schedule()``, where an
        exception would end the engine: whatever a request body makes it raise is logged and
        the request runs unhinted (``internal_error``)."""
        try:
            return self._admitting(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 (the engine outlives any hint)
            log.exception("request %s: hint admission failed", request.request_id)
            self._ignored(request.request_id, Reason.INTERNAL_ERROR,
                          f"{type(exc).__name__}: {exc}", None)
            return None

    def _admitting(self, request: Any, num_computed_tokens: int
                   ) -> tuple[int, KvHint, Admitted] | None:
        body = hint_body(request)
        if body is None:
            return None
        rid, metrics = request.request_id, self.rt.metrics
        decoded = read_hint(body, self._limits)
        if isinstance(decoded, Skip):
            if decoded.reason is not Reason.NO_HINT:
                metrics.hint_received()
                self._ignored(rid, decoded.reason, decoded.detail, None)
            return None
        metrics.hint_received()
        tokens = list(request.prompt_token_ids or ())
        if not self.rt.config.trust_unsigned_hints:
            # the router's signature rides in kv_transfer_params, beside the hint
            why = check_hint(self.rt.credential, body, decoded, tokens,
                             cache_salt=request.cache_salt or "")
            if why is not None:
                self._ignored(rid, Reason.HINT_UNTRUSTED, why, decoded)
                return None
        facts = self.rt.facts
        local = num_computed_tokens // facts.block_size
        worker = WorkerFacts(block_size=facts.block_size, hash_scheme=facts.hash_scheme,
                             bytes_per_block=self._bytes_per_block(),
                             longest_prefix=lambda _hashes: local)
        verdict = admit(tokens, decoded, worker=worker, config=self.config,
                        cost_guard=self.cost_guard, cache_salt=request.cache_salt or "",
                        engine_hashes=[vllm_u64(h) for h in request.block_hashes],
                        max_blocks=max(0, len(tokens) - 1) // facts.block_size)
        if isinstance(verdict, Skip):
            self._ignored(rid, verdict.reason, verdict.detail, decoded, verdict.fields)
            return None
        return num_computed_tokens, decoded, verdict

    def _bytes_per_block(self) -> int:
        puller = self.rt.puller
        if puller is None:
            return 0
        return sum(r.layout.bytes_per_block for r in puller.group.ranks.values())

    def _ignored(self, rid: str, reason: Reason, detail: str, hint: KvHint | None,
                 fields: dict | None = None) -> None:
        self.rt.metrics.hint_ignored(reason.value)
        self.rt.metrics.fallback(reason.value)
        extra = {} if hint is None else dict(policy=hint.policy, source=hint.source,
                                             dialect=hint.dialect)
        log.info(PullOutcome(request_id=rid, used=False, reason=reason, detail=detail[:2000],
                             **extra, **(fields or {})).to_log())
