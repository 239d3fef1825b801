"""The connector's worker half: kvkern's puller and source over vLLM's KV tensors.

``register_kv_caches`` views vLLM's per-layer tensors in place, builds the engine's
:class:`~kvkern.xfer.kvgroup.KVGroup` (its manager is the block index the scheduler half
binds to vLLM's block pool) and starts the :class:`~kvkern.xfer.source.SourceService`
(unless ``serve`` is off) and the :class:`~kvkern.xfer.puller.Puller`.

Each step: ``start_load_kv`` starts the step's loads (``Puller.pull_into``, on kvkern's
loop, never blocking the forward pass); ``wait_for_save`` reports the step's forward pass to
the block index, which then serves the blocks vLLM cached for it (:meth:`forward_done`);
``get_finished`` reports every load that ended in ``finished_recving``, and
``get_block_ids_with_load_errors`` the blocks a load did not fill (all of a failed load's,
the tail of a partial one), which vLLM recomputes. A load whose request finished (aborted)
is cancelled, and reported like any other when it has ended.
"""

from __future__ import annotations

import logging
from typing import Any

from kvkern.integrations.vllm.layout import check_kv_layout, rank_kv
from kvkern.integrations.vllm.runtime import EngineRuntime
from kvkern.integrations.vllm.scheduler import Load, xfer_config
from kvkern.xfer.kvgroup import KVGroup

__all__ = ["WorkerSide"]

log = logging.getLogger("kvkern.integrations.vllm")

#: The longest an idle engine step waits for a pull to end (it is woken at once when one
#: does): bounds the delay a newly arrived request can see while the engine only waits.
IDLE_WAIT_S = 0.005


class WorkerSide:
    """The worker half of :class:`~kvkern.integrations.vllm.KvkernConnector`."""

    def __init__(self, rt: EngineRuntime) -> None:
        self.rt = rt
        self._running: dict[str, Load] = {}
        self._done: set[str] = set()
        self._errors: set[int] = set()
        self._on_device = False  # vLLM's KV tensors are on a GPU (register_kv_caches)

    def register_kv_caches(self, kv_caches: dict) -> None:
        from kvkern.xfer.puller import Puller  # noqa: PLC0415
        from kvkern.xfer.source import SourceService  # noqa: PLC0415

        rt, facts = self.rt, self.rt.facts
        check_kv_layout(kv_caches, rt.config.kv_layout)
        topology, rank = rank_kv(kv_caches, head_dim=facts.head_dim, layout=rt.config.kv_layout)
        if rank.layout.block_size != facts.block_size:
            raise ValueError(f"vLLM's KV cache holds {rank.layout.block_size} tokens a block, "
                             f"its cache config {facts.block_size}")
        group = KVGroup(topology=topology, dp_rank=0, manager=rt.blocks, ranks={0: rank},
                        model_id=facts.model_id)
        self._on_device = rank.device.type == "cuda"
        rt.blocks.tensor_blocks(rank.layout.num_blocks)  # (the read directory's size)
        loop = rt.ensure_loop()
        rt.puller = Puller(group, config=xfer_config(rt), loop=loop, metrics=rt.metrics,
                           credential=rt.credential)
        cfg = rt.config
        if cfg.serve and rt.credential is not None:
            rt.source = SourceService([group], worker_id=f"vllm-{facts.engine_id}",
                                      host=cfg.listen_host, http_port=cfg.listen_port,
                                      advertise_host=cfg.advertise_host, metrics=rt.metrics,
                                      credential=rt.credential, remote_read=cfg.remote_read,
                                      accept_from=cfg.accept_from)
            loop.run(rt.source.start(), 30)
            log.info("kvkern: serving %s blocks of %d tokens (%s, %s) at %s:%d",
                     rank.layout.num_blocks, facts.block_size, rank.layout.name,
                     facts.hash_scheme, cfg.advertise_host or cfg.listen_host,
                     rt.source.http_port)

    @property
    def source_port(self) -> int | None:
        return None if self.rt.source is None else self.rt.source.http_port

    def start_load_kv(self, metadata: Any) -> None:
        puller = self.rt.puller
        for load in getattr(metadata, "loads", ()):
            if load.admitted is None:  # failed before it started: recompute its blocks
                self._done.add(load.request_id)
                self._errors.update(load.block_ids)
                continue
            self._running[load.request_id] = load
            try:
                puller.pull_into(load.request_id, load.hint, load.admitted, load.block_ids)
            except Exception:  # a refused start is a failed load: vLLM recomputes
                log.exception("kvkern: pull for %s not started", load.request_id)
                self._done.add(load.request_id)
                self._errors.update(load.block_ids)
                del self._running[load.request_id]

    def forward_done(self, metadata: Any) -> None:
        """The step of ``metadata`` has issued its forward pass: the blocks vLLM cached in it
        may be served once it has written them (at once on the CPU; on a GPU once the
        current stream passes an event recorded now)."""
        step = getattr(metadata, "step", 0)
        if not step:
            return
        ready = None
        if self._on_device:
            import torch  # noqa: PLC0415

            event = torch.cuda.Event()
            event.record()
            ready = event.query
        self.rt.blocks.written(step, ready)

    def get_finished(self, finished_req_ids: set[str], *, idle: bool = False
                     ) -> tuple[None, set[str] | None]:
        puller = self.rt.puller
        if puller is None:
            return None, None
        if idle and self._running:
            # The engine steps without computing while it waits for pulls: such a loop
            # holds the GIL that kvkern's transfer threads need (control round trips grew
            # from ~1 ms to ~30 ms). Wait a little, woken by the first pull that ends.
            puller.wait_finished(IDLE_WAIT_S)
        for rid in finished_req_ids or ():
            if rid in self._running:
                puller.cancel(rid)  # aborted while pulling: stop writing its blocks
        done, self._done = self._done, set()
        for rid, outcome in puller.take_finished():
            load = self._running.pop(rid, None)
            if load is None:
                continue
            done.add(rid)
            kept = outcome.blocks_transferred if outcome.used else 0
            self._errors.update(load.block_ids[kept:])
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
