"""The transfer path: hints and their dialects, endpoint resolution and the allowlist, the
state document and control messages, the UCXX transport, the source service, the
destination puller, policies, the request lifecycle and metrics.

What a user needs is exported here (imported on first use, so ``import kvkern.xfer`` stays
light)::

    from kvkern.xfer import KVGroup, Puller, RankKV, SourceService, XferConfig

Modules by role (an engine connector's split: the scheduler side decides and discovers, the
worker side moves bytes):

=================  ===================================================================
scheduler side     :mod:`~kvkern.xfer.hints`, :mod:`~kvkern.xfer.admission`,
                   :mod:`~kvkern.xfer.endpoint`, :mod:`~kvkern.xfer.discovery`,
                   :mod:`~kvkern.xfer.policy`
worker side        :mod:`~kvkern.xfer.runner`, :mod:`~kvkern.xfer.receive`,
                   :mod:`~kvkern.xfer.read_lanes`, :mod:`~kvkern.xfer.staging`,
                   :mod:`~kvkern.xfer.devstream` (where pack and unpack kernels run on a GPU)
the facade         :mod:`~kvkern.xfer.puller` (``Puller``), :mod:`~kvkern.xfer.pulljob`
source             :mod:`~kvkern.xfer.source` (``SourceService``), :mod:`~kvkern.xfer.send`,
                   :mod:`~kvkern.xfer.regions`, :mod:`~kvkern.xfer.source_config`
wire               :mod:`~kvkern.xfer.state`, :mod:`~kvkern.xfer.messages`,
                   :mod:`~kvkern.xfer.codes`
transport          :mod:`~kvkern.xfer.seam` (the Protocols the pull path is typed against),
                   :mod:`~kvkern.xfer.transport` (UCXX), :mod:`~kvkern.xfer.memtransport`
                   (in memory, with fault injection), :mod:`~kvkern.xfer.ucxcompat` (every
                   use of ucxx internals), :mod:`~kvkern.xfer.ucp_rma`,
                   :mod:`~kvkern.xfer.ucx_env`, :mod:`~kvkern.xfer.auth`,
                   :mod:`~kvkern.xfer.httpguard`
shared             :mod:`~kvkern.xfer.config` (``XferConfig``), :mod:`~kvkern.xfer.tuning`
                   (tuning constants and their reasons), :mod:`~kvkern.xfer.kvgroup`
                   (``KVGroup``, ``RankKV``), :mod:`~kvkern.xfer.outcome`,
                   :mod:`~kvkern.xfer.metrics`, :mod:`~kvkern.xfer.runtime`
=================  ===================================================================

Glossary (one noun per concept):

* **hint**: the router's advice that a source holds a longer prefix (:class:`KvHint`).
* **source** / **destination**: the worker that serves blocks / the one that pulls them.
* **pull**: everything one hinted request does, from admission to commit or fallback.
* **pair**: one (source rank, destination rank) of a pull's transfer plan
  (:class:`kvkern.layout.plan.PeerTransfer`, ``pair`` in the code).
* **transfer**: one pair's request on a connection, named by its transfer id.
* **rank KV**: one rank's pool in its layout (:class:`RankKV`, ``rank_kv`` in the code).
* **state**: a source's published document of its ranks, layouts and addresses
  (:class:`~kvkern.xfer.state.StateDoc` on the wire, :class:`~kvkern.xfer.state.SourceState`
  once checked).
* **piece**: one (layer range x head range) of a block that a pair moves
  (:class:`kvkern.layout.plan.Piece`, on the wire :class:`~kvkern.xfer.messages.PlanPiece`).
* **segment**: one contiguous part of a block in a pool
  (:class:`kvkern.layout.segments.BlockSegments`).
* **run**: one contiguous copy of a one-sided read (:func:`kvkern.layout.segments.segment_runs`).
* **chunk**: one message of a stream (:mod:`kvkern.layout.chunks`), received into a ring of
  **staging** buffers (:class:`~kvkern.xfer.staging.StagingPool`) or straight into blocks.
* **stream** / **read**: the two ways a pair's bytes move: the source sends chunks, or the
  destination reads the pinned blocks one-sided.
* **read lane**: a UCX worker and endpoint of its own that carries a share of a pull's reads
  (:mod:`~kvkern.xfer.read_lanes`), to the source's **read target** (the UCX context its
  pools are registered in, :func:`~kvkern.xfer.ucxcompat.read_target`); a transport *tag
  lane* (REPLY, DATA) is a ``Lane`` of
  :mod:`~kvkern.xfer.transport`.
* **private blocks**: blocks the destination allocated for a pull, committed or freed
  exactly once. **pin**: the source's hold on served blocks
  (:class:`kvkern.cache.protocol.PinHandle`). **lease**: the destination's hold on committed
  blocks until the engine claims or releases them (:class:`kvkern.cache.protocol.Lease`).
* **fallback**: a pull that ends without blocks, with a :class:`Reason`
  (:class:`~kvkern.xfer.pulljob.Fallback` ends one).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees of the lazy exports below
    from kvkern.xfer.auth import Credential
    from kvkern.xfer.config import XferConfig
    from kvkern.xfer.hints import HintRejected, KvHint, decode_hint
    from kvkern.xfer.kvgroup import KVGroup, RankKV
    from kvkern.xfer.metrics import XferMetrics
    from kvkern.xfer.outcome import PullOutcome, Reason, RequestState
    from kvkern.xfer.puller import Puller
    from kvkern.xfer.runtime import EventLoopThread
    from kvkern.xfer.source import SourceService
    from kvkern.xfer.source_config import PeerQuotas, SourceConfig

__all__ = ["Credential", "EventLoopThread", "HintRejected", "KVGroup", "KvHint", "PeerQuotas",
           "PullOutcome", "Puller", "RankKV", "Reason", "RequestState", "SourceConfig",
           "SourceService", "XferConfig", "XferMetrics", "decode_hint"]

_HOMES = {
    "Credential": "kvkern.xfer.auth",
    "EventLoopThread": "kvkern.xfer.runtime",
    "HintRejected": "kvkern.xfer.hints",
    "KVGroup": "kvkern.xfer.kvgroup",
    "KvHint": "kvkern.xfer.hints",
    "PeerQuotas": "kvkern.xfer.source_config",
    "PullOutcome": "kvkern.xfer.outcome",
    "Puller": "kvkern.xfer.puller",
    "RankKV": "kvkern.xfer.kvgroup",
    "Reason": "kvkern.xfer.outcome",
    "RequestState": "kvkern.xfer.outcome",
    "SourceConfig": "kvkern.xfer.source_config",
    "SourceService": "kvkern.xfer.source",
    "XferConfig": "kvkern.xfer.config",
    "XferMetrics": "kvkern.xfer.metrics",
    "decode_hint": "kvkern.xfer.hints",
}


def __getattr__(name: str) -> Any:  # any of the exports: each has its own type
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvkern.xfer' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)
