"""The destination request's prefetch lifecycle and the outcome of one hinted request.

Lifecycle (:class:`RequestState`)::

    submit(hint) ──► CONTEXT_PREFETCH_INIT ──► CONTEXT_PREFETCH_IN_PROGRESS ──► CONTEXT_PREFETCH_COMPLETE
        │                  │ (admitted, not schedulable)  │ (network)            │ claim() / release()
        │ no/bad hint,     │ cancel, failure              │ failure, timeout     ▼
        └──────────────────┴──────────────────────────────┴──────────────► CONTEXT_INIT

``CONTEXT_INIT`` is schedulable (the request prefills whatever it has); the two prefetch
states are not. A pull that produced nothing goes straight back to ``CONTEXT_INIT`` with a
:class:`Reason`; a successful one waits in ``CONTEXT_PREFETCH_COMPLETE`` (schedulable) until
the engine claims or releases its lease.

Every hinted request ends with exactly one :class:`PullOutcome`, logged as one JSON line on
logger ``kvkern.xfer`` (:meth:`PullOutcome.to_log`) and counted in the metrics.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field

__all__ = ["REASON_DOCS", "PullOutcome", "Reason", "RequestState"]


class RequestState(str, enum.Enum):
    CONTEXT_INIT = "CONTEXT_INIT"
    CONTEXT_PREFETCH_INIT = "CONTEXT_PREFETCH_INIT"
    CONTEXT_PREFETCH_IN_PROGRESS = "CONTEXT_PREFETCH_IN_PROGRESS"
    CONTEXT_PREFETCH_COMPLETE = "CONTEXT_PREFETCH_COMPLETE"

    @property
    def schedulable(self) -> bool:
        return self in (RequestState.CONTEXT_INIT, RequestState.CONTEXT_PREFETCH_COMPLETE)


class Reason(str, enum.Enum):
    """Why a hinted request ended as it did. Values are metric labels (``[a-z_]``)."""

    OK = "ok"
    PARTIAL = "partial"
    NO_HINT = "no_hint"
    HINT_INVALID = "hint_invalid"
    SOURCE_NOT_ALLOWED = "source_not_allowed"
    HASH_SCHEME_MISMATCH = "hash_scheme_mismatch"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    INCOMPATIBLE_TOPOLOGY = "incompatible_topology"
    METADATA_FETCH_FAILED = "metadata_fetch_failed"
    METADATA_TIMEOUT = "metadata_timeout"
    METADATA_INVALID = "metadata_invalid"
    SOURCE_MISS = "source_miss"
    SOURCE_BUSY = "source_busy"
    HASH_MISMATCH = "hash_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    BUSY = "busy"
    DUPLICATE = "duplicate"
    NOT_WORTH_IT = "not_worth_it"
    LOCAL_PREFIX_SUFFICIENT = "local_prefix_sufficient"
    NO_BLOCKS = "no_blocks"
    CANCELLED = "cancelled"
    SOURCE_INCARNATION_CHANGED = "source_incarnation_changed"
    UNAUTHENTICATED = "unauthenticated"  # no fleet credential, or a peer failed to prove it
    INCOMPATIBLE_MODEL = "incompatible_model"
    HINT_UNTRUSTED = "hint_untrusted"  # unsigned, badly signed or expired router hint
    CLOSED = "closed"
    INTERNAL_ERROR = "internal_error"

    def __str__(self) -> str:
        return self.value


REASON_DOCS: dict[Reason, str] = {
    Reason.OK: "every requested block was pulled, validated and committed (used)",
    Reason.PARTIAL: "best effort: a leading run of the requested blocks was committed (used)",
    Reason.NO_HINT: "the request carried no hint (or only dialects/versions that are ignored)",
    Reason.HINT_INVALID: "the hint was malformed, too large or had too many hashes",
    Reason.SOURCE_NOT_ALLOWED: "the source endpoint (state URL or a UCX address it advertises) "
                               "failed parsing, resolution or the allowlist; the detail names "
                               "the endpoint check's reason",
    Reason.HASH_SCHEME_MISMATCH: "the source advertises another hash scheme than this worker's, "
                                 "or the hint's scheme is unknown here",
    Reason.PROTOCOL_MISMATCH: "the source speaks another protocol or codec fingerprint",
    Reason.INCOMPATIBLE_TOPOLOGY: "no transfer plan between the two topologies (model KV shape, "
                                  "head split, DP rank out of range)",
    Reason.METADATA_FETCH_FAILED: "the state GET failed (refused, non-2xx, redirect, too large)",
    Reason.METADATA_TIMEOUT: "the state GET did not finish within metadata_timeout_s",
    Reason.METADATA_INVALID: "the state body was not valid kvkern/1 state JSON",
    Reason.SOURCE_MISS: "the source no longer held (all, for strict) the requested blocks "
                        "(evicted after the router saw them)",
    Reason.SOURCE_BUSY: "the source refused the pull at its in-flight limit",
    Reason.HASH_MISMATCH: "the hint's hashes do not name this prompt, or the source served "
                          "other hashes than requested",
    Reason.TRANSFER_FAILED: "a UCX connect, send or receive failed (peer killed, reset, "
                            "protocol error, source error)",
    Reason.TRANSFER_TIMEOUT: "no progress on the data stream for transfer_timeout_s",
    Reason.DEADLINE_EXCEEDED: "the whole pull did not finish within deadline_s",
    Reason.BUSY: "max_inflight_pulls pulls were already running, or as many host name "
                 "lookups (kvkern.xfer.endpoint.MAX_PENDING_LOOKUPS)",
    Reason.DUPLICATE: "an identical pull (same source, same hash range) was in flight; this "
                      "request waited for it and uses its committed blocks through the prefix "
                      "index (blocks_local counts them)",
    Reason.NOT_WORTH_IT: "the cost guard estimated the pull slower than recomputing",
    Reason.LOCAL_PREFIX_SUFFICIENT: "this worker already held every hinted block",
    Reason.NO_BLOCKS: "no free private blocks to receive into",
    Reason.CANCELLED: "cancel() or close() ended the pull",
    Reason.SOURCE_INCARNATION_CHANGED: "the source restarted (new incarnation) since its state "
                                       "was cached; the cache now holds the new state",
    Reason.UNAUTHENTICATED: "this worker has no fleet credential, or the source did not prove "
                            "it holds the fleet's (unsigned or badly signed state, a failed "
                            "control-connection exchange)",
    Reason.INCOMPATIBLE_MODEL: "the source's model fingerprint differs from this worker's",
    Reason.HINT_UNTRUSTED: "the hint was not signed by the fleet's router, its signature did "
                           "not cover this request, or it had expired",
    Reason.CLOSED: "the puller was closed before the pull could start",
    Reason.INTERNAL_ERROR: "a bug: an unexpected exception (logged with its traceback)",
}

USED_REASONS = frozenset({Reason.OK, Reason.PARTIAL})


@dataclass(kw_only=True)
class PullOutcome:
    """The result of one hinted request. ``used`` means blocks were committed and leased for
    the request (claim them); otherwise the request runs exactly as without the hint.

    Block counts (``hinted = local + requested`` when a pull was attempted)::

        hashes     h0 h1 h2 h3 h4 h5 h6 h7
        hinted     [----------------------]   blocks the hint covers (full blocks only)
        local      [-----]                    already cached here, never pulled
        requested        [----------------]   asked of the source
        transferred      [---------]          validated and committed (best effort may stop
        skipped                    [------]   short: skipped = requested - transferred)

    ``bytes_transferred`` counts the bytes the pull moved, kept or not (a stream's chunks as
    they land, also before a failure; one-sided reads once they completed, blocks that a
    best-effort pull moved and then skipped included), as
    ``kvkern_bytes_transferred_total`` counts them; ``blocks_transferred`` counts what was
    kept.
    """

    request_id: str
    used: bool
    reason: Reason
    policy: str | None = None
    source: str | None = None
    source_dp_rank: int | None = None
    worker_id: str | None = None
    incarnation: str | None = None
    dialect: str | None = None
    blocks_hinted: int = 0
    blocks_local: int = 0
    blocks_requested: int = 0
    blocks_transferred: int = 0
    blocks_skipped: int = 0
    bytes_transferred: int = 0
    pairs: int = 0
    messages: int = 0  # control + data messages received and sent for this pull
    reads: int = 0  # one-sided reads (runs of blocks read from the source's pool)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    detail: str = ""

    def __post_init__(self) -> None:
        self.reason = Reason(self.reason)
        if self.used != (self.reason in USED_REASONS):
            raise ValueError(f"outcome used={self.used} contradicts reason {self.reason.value}")

    @property
    def total_s(self) -> float:
        return self.phases.get("total", 0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reason"] = self.reason.value
        d["phases"] = {k: round(v, 6) for k, v in self.phases.items()}
        return d

    def to_log(self) -> str:
        """One JSON line (sorted keys) with ``event: "kvkern.pull"``."""
        return json.dumps({"event": "kvkern.pull", **self.to_dict()}, sort_keys=True,
                          separators=(",", ":"), default=str)
