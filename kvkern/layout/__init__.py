"""KV layout descriptors for engine pools, the canonical staging format, and (in
:mod:`kvkern.layout.topology` / :mod:`kvkern.layout.plan`) TP/PP/DP transfer plans.
This package describes memory; it never moves bytes."""

from kvkern.layout.kv_layout import (
    CANONICAL_ORDER,
    LAYOUT_CONSTRUCTORS,
    Axis,
    KVLayout,
    LayoutMismatchError,
    allocate_staging,
    staging_shape,
)

__all__ = [
    "CANONICAL_ORDER", "LAYOUT_CONSTRUCTORS", "Axis", "KVLayout", "LayoutMismatchError",
    "allocate_staging", "staging_shape",
]

from kvkern.layout.plan import (  # noqa: E402
    PeerTransfer,
    Piece,
    TransferPlan,
    check_compatible,
    plan_transfer,
)
from kvkern.layout.topology import (  # noqa: E402
    IncompatibleTopologyError,
    ModelKVSpec,
    Parallelism,
    RankCoords,
    Topology,
)

__all__ += [
    "IncompatibleTopologyError", "ModelKVSpec", "Parallelism", "PeerTransfer", "Piece",
    "RankCoords", "Topology", "TransferPlan", "check_compatible", "plan_transfer",
]
