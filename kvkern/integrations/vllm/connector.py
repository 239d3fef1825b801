"""``KvkernConnector``: vLLM's ``KVConnectorBase_V1`` over the scheduler and worker halves
(:mod:`~kvkern.integrations.vllm.scheduler`, :mod:`~kvkern.integrations.vllm.worker`)."""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvkern.integrations.vllm.config import ConnectorConfig
from kvkern.integrations.vllm.runtime import check_kv_cache_groups, runtime_for
from kvkern.integrations.vllm.scheduler import LoadMetadataBase, SchedulerSide
from kvkern.integrations.vllm.worker import WorkerSide

__all__ = ["KvkernConnector", "KvkernMetadata"]

log = logging.getLogger("kvkern.integrations.vllm")


class KvkernMetadata(KVConnectorMetadata, LoadMetadataBase):
    """One step's loads (:class:`~kvkern.integrations.vllm.scheduler.Load`)."""


class KvkernConnector(KVConnectorBase_V1):
    """Pulls hinted prefixes between vLLM engines (see :mod:`kvkern.integrations.vllm`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        check_kv_cache_groups(kv_cache_config)
        self._rt = runtime_for(vllm_config, config)
        self._scheduler = SchedulerSide(self._rt) if role == KVConnectorRole.SCHEDULER \
            else None
        self._worker = WorkerSide(self._rt) if role == KVConnectorRole.WORKER else None

    @property
    def requires_kv_delivery(self) -> bool:
        """Nothing is handed off when a request finishes (peers pull from the prefix cache
        itself), so a preempted request keeps its sampled tokens."""
        return False

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(
            KvkernMetadata, scheduler_output.total_num_scheduled_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return (0,)

    # --------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only after its whole load

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # peers pull from vLLM's prefix cache itself: nothing to save

    def wait_for_save(self) -> None:
        # the step's forward pass has been issued: its cached blocks may be served once written
        if self.has_connector_metadata():
            self._worker.forward_done(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        idle = self.has_connector_metadata() and self._get_connector_metadata().idle
        return self._worker.get_finished(finished_req_ids, idle=idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ------------------------------------------------------------------------- common

    @property
    def runtime(self) -> Any:
        """This engine's kvkern state (puller, source, metrics), for operators and tests."""
        return self._rt

    def shutdown(self) -> None:
        rt, self._rt = getattr(self, "_rt", None), None
        if rt is not None:
            rt.release()
