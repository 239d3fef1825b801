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
                   :mod:`~kvkern.xfer.read_lanes`, :mod:`~kvkern.xfer.staging`
the facade         :mod:`~kvkern.xfer.puller` (``Puller``), :mod:`~kvkern.xfer.pulljob`
source             :mod:`~kvkern.xfer.source` (``SourceService``), :mod:`~kvkern.xfer.send`,
                   :mod:`~kvkern.xfer.regions`, :mod:`~kvkern.xfer.source_config`
wire               :mod:`~kvkern.xfer.state`, :mod:`~kvkern.xfer.messages`,
                   :mod:`~kvkern.xfer.codes`
transport          :mod:`~kvkern.xfer.transport`, :mod:`~kvkern.xfer.ucp_rma`,
                   :mod:`~kvkern.xfer.ucx_env`, :mod:`~kvkern.xfer.auth`,
                   :mod:`~kvkern.xfer.httpguard`
=================  ===================================================================

Glossary (one noun per concept):

* **hint**: the router's advice that a source holds a longer prefix (:class:`KvHint`).
* **source** / **destination**: the worker that serves blocks / the one that pulls them.
* **pull**: everything one hinted request does, from admission to commit or fallback.
* **pair**: one (source rank, destination rank) of a pull's transfer plan.
* **transfer**: one pair's request on a connection, named by its transfer id.
* **piece**: one (layer range x head range) of a block that a pair moves
  (:class:`kvkern.layout.plan.Piece`, on the wire :class:`~kvkern.xfer.messages.PlanPiece`).
* **segment**: one contiguous part of a block in a pool
  (:class:`kvkern.layout.segments.BlockSegments`).
* **run**: one contiguous copy of a one-sided read (:func:`kvkern.layout.segments.segment_runs`).
* **chunk**: one message of a stream (:mod:`kvkern.layout.chunks`).
* **stream** / **read**: the two ways a pair's bytes move: the source sends chunks, or the
  destination reads the pinned blocks one-sided.
* **read lane**: an extra UCX worker and endpoint that carries a share of a pull's reads
  (:mod:`~kvkern.xfer.read_lanes`); a transport *tag lane* (REPLY, DATA) is a ``Lane`` of
  :mod:`~kvkern.xfer.transport`.
* **private blocks**: blocks the destination allocated for a pull, committed or freed
  exactly once. **pin**: the source's hold on served blocks. **lease**: the destination's
  hold on committed blocks until the engine claims or releases them.
* **fallback**: a pull that ends without blocks, with a :class:`Reason`.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvkern.xfer' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)
