"""Configuration of the destination side of the pull path (the puller) and the knobs the
source reads for defaults it shares with it.

One frozen, keyword-only :class:`XferConfig` holds every bound the puller applies; it is
validated once at construction (a bad value is a ``ValueError`` naming the field and the
value). Variants come from :meth:`XferConfig.replace`. Defaults are the safe ones:

* **no allowlist means no outbound fetch** (``allowlist=()`` refuses every hint with
  ``source_not_allowed`` / ``empty_allowlist``);
* every wait is bounded: ``metadata_timeout_s`` (state GET), ``transfer_timeout_s`` (time
  without progress on the data stream), ``deadline_s`` (the whole pull, hint to commit);
* a hint may *lower* the timeouts but never raise them above the ``max_*`` caps
  (``effective_timeouts``)::

      effective = min(hint value or config default, config cap)

* the cost guard is on: a pull that cannot beat recompute is skipped (``not_worth_it``).

Timeline of one pull and the bound that applies to each part::

    submit ─┬─ resolve+allowlist ─ GET state ─┬─ plan, allocate ─ request ─ chunks ... ─ commit
            │  └──── metadata_timeout_s ─────┘                   └ transfer_timeout_s ┘
            │                                                       (no progress)      │
            └───────────────────────────── deadline_s ─────────────────────────────────┘

Endpoint knobs (``default_state_port``, ``dp_port_stride``, ``state_port_offset``,
``state_path``) are handed to :class:`kvkern.xfer.endpoint.EndpointConfig` by
:meth:`XferConfig.endpoint_config`; the allowlist is parsed by
:class:`kvkern.xfer.endpoint.Allowlist` (specs or an ``Allowlist``). Both are imported
lazily so this module stays light.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvkern.checks import check_non_negative_int, check_positive_int

if TYPE_CHECKING:
    from kvkern.xfer.endpoint import Allowlist, EndpointConfig

__all__ = ["POLICIES", "XferConfig", "DEFAULT_CONFIG"]

POLICIES = ("strict", "best_effort")
Policy = Literal["strict", "best_effort"]


def _pos(name: str, value: object, *, allow_none: bool = False, integer: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"XferConfig.{name} must be a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ValueError(f"XferConfig.{name} must be an int, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"XferConfig.{name} must be finite and > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class XferConfig:
    """Bounds, limits and policies of the puller. See the module docstring."""

    # ---- timeouts (seconds) and the caps a hint's own values are clamped to
    metadata_timeout_s: float = 2.0
    transfer_timeout_s: float = 10.0  # no progress for this long -> transfer_timeout
    deadline_s: float = 15.0  # the whole pull, from submit to commit
    max_metadata_timeout_s: float = 10.0
    max_transfer_timeout_s: float = 60.0
    max_deadline_s: float = 120.0

    # ---- admission
    max_inflight_pulls: int = 4  # more concurrent pulls -> busy (the seed's TRT-LLM limit)
    # of those, from one source (as the hint names it; None: no share of its own). Below
    # max_inflight_pulls, a source whose pulls stall leaves slots to the others; one source
    # under load then gets fewer (a 512-request load of one source: 68 busy, one slot fewer)
    max_inflight_per_source: int | None = None
    # an identical in-flight pull (same source, same hash range) with at least half the time
    # left that this request has: the request waits for it and ends ``duplicate``
    dedup: bool = True
    max_tracked_requests: int = 65536  # finished outcomes kept for result(); oldest dropped

    # ---- source state
    state_cache_ttl_s: float = 30.0  # per (source, incarnation); failures drop the entry
    # past its time to live a cached state or verdict is still used this much longer, and
    # fetched again after each pull that used it (a source pulled from rarely costs no fetch
    # per pull); a source that restarted meanwhile fails the pull's connection or direct read,
    # which fetches its state again at once and names the restart
    state_max_stale_s: float = 600.0
    max_state_bytes: int = 1 << 20

    # ---- retention and data stream
    lease_s: float = 30.0  # committed blocks are leased until claim/release or expiry
    # multi-MiB chunks amortize a per-message cost of ~30-270 us; a staging slot's size
    # (chunks landing in place are up to tuning.ZERO_COPY_CHUNK_BYTES)
    chunk_bytes: int = 16 << 20
    chunks_in_flight: int = 4  # staging ring depth per (source rank, destination rank) pair
    # read whole-block pieces one-sided from a source that offers it ("read/1"): one copy
    # from the source's pool into the private blocks, no pack, staging or unpack
    remote_read: bool = True
    # a TP/PP reshard pair reads one-sided only if each of its reads (a stretch of source
    # bytes that is contiguous: a head range of one layer's K or V, or a whole source block
    # scattered over the destination's rows) has at least this many bytes; else it streams.
    # Measured (kvkern bench xfer --pull-tp 2:1): 16 KiB reads at 0.33 of raw, the stream at
    # 0.45.
    read_min_run_bytes: int = 64 << 10
    # the same bound for a source on the same host read with kvkern's own calls (local_reads:
    # many pieces per call). One destination rank of a TP 1:4 / 1:8 reshard (8 / 4 KiB
    # pieces, bench --pull-one-rank): reads at 0.41-0.70 of a raw send against the stream's
    # 0.24-0.42 / at 0.27-0.28 against 0.29-0.37
    local_read_min_run_bytes: int = 8 << 10
    # reads run on this many read lanes (kvkern.xfer.read_lanes: a UCX worker and a thread
    # each; at most one per CPU the process may use), split by bytes with at least
    # read_lane_min_bytes per lane; 0: no lanes, and a source over UCX streams. One CMA
    # copy thread moves 5.8-6.3 GB/s on a 2-vCPU VM, two 10.9-11.7 (bench/RESULTS.md).
    read_lanes: int = 2
    read_lane_min_bytes: int = 4 << 20
    # sets of read_lanes lanes that read for pulls: set 0 runs every pull's reads in turn,
    # and a pull waiting behind one whose reads run past their due time (a stalled source,
    # kvkern.xfer.tuning.LANE_DUE_S) goes to the next set, opened on its first read
    read_lane_sets: int = 3
    # a pull that reads at most this many bytes of blocks reads them on the event loop's own
    # UCX worker (the loop lane), with no hand-off to a lane's thread and back (two thread
    # wakes per pull: 2 MiB pulls in 0.89-0.99 ms against 1.48-1.91); a CMA copy then runs on
    # the loop (~0.1 ms per MiB), so the default is one lane's minimum share, below which a
    # lane's thread copies no faster. 0: every read goes to the lanes' threads.
    loop_read_bytes: int = 4 << 20
    # read a source that publishes its read directory without asking it first
    # (kvkern.xfer.direct): no round trip, no pins; a block not confirmed by the directory
    # makes the pull ask for a grant as before
    direct_reads: bool = True
    # read a source process on the same host with process_vm_readv calls of up to 1024 pieces
    # (kvkern.xfer.local_reads) rather than through UCX's CMA transport, which passes 16
    # pieces per call and a request per run; elsewhere, or where the host refuses the call,
    # reads go through UCX
    local_reads: bool = True
    # with local_reads off, read a source on the same host through UCX's CMA/KNEM/XPMEM
    # transports too. They read any address of the process that owns the worker a state
    # names, and nothing ties that worker to the process that served the state: a member
    # could name another process's. For measuring UCX's read path on one host; off (the
    # default), such a source is streamed
    ucx_same_host_reads: bool = False

    # ---- policy
    default_policy: Policy = "strict"

    # ---- cost guard: estimated pull = rtt + bytes / bandwidth  vs  recompute = tokens * s/tok
    cost_guard: bool = True
    prefill_s_per_token: float | None = None  # configured; else learned by observe_prefill
    prefill_prior_s_per_token: float | None = None  # prior until observed; None: guard passes
    bandwidth_prior_bps: float = 1e9  # bytes/s before any pull was measured (TCP loopback ~0.8e9)
    rtt_prior_s: float = 2e-3  # per-pull fixed cost before any pull was measured
    ewma_alpha: float = 0.3  # weight of the newest measurement
    cost_margin: float = 1.0  # pull only if estimated pull * margin < recompute
    min_blocks: int = 1  # fewer missing blocks than this -> not_worth_it

    # ---- endpoints (handed to kvkern.xfer.endpoint.EndpointConfig)
    # specs ("10.0.0.0/8", "host:8000-8010", ...) are parsed into an Allowlist on creation
    allowlist: Allowlist | str | Iterable[str] | None = ()
    default_state_port: int = 8000
    state_path: str = "/kvkern/v1/state"
    dp_port_stride: int = 1  # Dynamo: control endpoint of DP rank N is control_port + N
    state_port_offset: int | None = None  # tcp:// control port -> state port; None refuses tcp

    def __post_init__(self) -> None:
        for name in ("metadata_timeout_s", "transfer_timeout_s", "deadline_s",
                     "max_metadata_timeout_s", "max_transfer_timeout_s", "max_deadline_s",
                     "state_cache_ttl_s", "lease_s", "bandwidth_prior_bps", "rtt_prior_s",
                     "cost_margin"):
            _pos(name, getattr(self, name))
        for name in ("prefill_s_per_token", "prefill_prior_s_per_token"):
            _pos(name, getattr(self, name), allow_none=True)
        if self.max_inflight_per_source is not None:
            _pos("max_inflight_per_source", self.max_inflight_per_source, integer=True)
        for name in ("max_inflight_pulls", "max_state_bytes", "chunk_bytes",
                     "chunks_in_flight", "min_blocks", "max_tracked_requests",
                     "default_state_port", "dp_port_stride"):
            _pos(name, getattr(self, name), integer=True)
        for short, cap in (("metadata_timeout_s", "max_metadata_timeout_s"),
                           ("transfer_timeout_s", "max_transfer_timeout_s"),
                           ("deadline_s", "max_deadline_s")):
            if getattr(self, short) > getattr(self, cap):
                raise ValueError(f"XferConfig.{short} {getattr(self, short)} exceeds "
                                 f"{cap} {getattr(self, cap)}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"XferConfig.ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if self.default_policy not in POLICIES:
            raise ValueError(f"XferConfig.default_policy {self.default_policy!r} not in "
                             f"{POLICIES}")
        if self.chunk_bytes > 1 << 34:
            raise ValueError(f"XferConfig.chunk_bytes {self.chunk_bytes} exceeds 16 GiB")
        if not 1 <= self.default_state_port <= 65535:
            raise ValueError(f"XferConfig.default_state_port {self.default_state_port} not in "
                             "1..65535")
        if self.state_port_offset is not None and (
                isinstance(self.state_port_offset, bool)
                or not isinstance(self.state_port_offset, int)):
            raise ValueError(f"XferConfig.state_port_offset must be an int or None, got "
                             f"{self.state_port_offset!r}")
        if not isinstance(self.state_path, str) or not self.state_path.startswith("/"):
            raise ValueError(f"XferConfig.state_path must start with '/', got "
                             f"{self.state_path!r}")
        stale = self.state_max_stale_s
        if isinstance(stale, bool) or not isinstance(stale, (int, float)) \
                or not (math.isfinite(stale) and stale >= 0):
            raise ValueError(f"XferConfig.state_max_stale_s must be a finite number >= 0, got "
                             f"{self.state_max_stale_s!r}")
        for name in ("read_min_run_bytes", "local_read_min_run_bytes", "read_lanes",
                     "read_lane_min_bytes", "loop_read_bytes"):
            check_non_negative_int(f"XferConfig.{name}", getattr(self, name))
        check_positive_int("XferConfig.read_lane_sets", self.read_lane_sets)
        for flag in ("dedup", "cost_guard", "remote_read", "direct_reads", "local_reads",
                     "ucx_same_host_reads"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"XferConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        # Parse allowlist specs now so a bad entry fails at configuration, not per request.
        allow = self.allowlist
        if allow is None or (not isinstance(allow, str) and isinstance(allow, (tuple, list))
                             and not allow):
            object.__setattr__(self, "allowlist", ())  # empty: fails closed
        elif isinstance(allow, str) or (isinstance(allow, Iterable)
                                        and not _is_allowlist(allow)):
            from kvkern.xfer.endpoint import Allowlist  # noqa: PLC0415 (stdlib-only module)

            object.__setattr__(self, "allowlist", Allowlist.parse(
                [allow] if isinstance(allow, str) else list(allow)))
        elif not _is_allowlist(allow):
            raise ValueError(f"XferConfig.allowlist must be an Allowlist or specs, got "
                             f"{type(allow).__name__}")

    # ------------------------------------------------------------------ helpers

    @property
    def per_source_pulls(self) -> int:
        """Pulls in flight from one source at most (``max_inflight_per_source``)."""
        if self.max_inflight_per_source is not None:
            return self.max_inflight_per_source
        return self.max_inflight_pulls

    def replace(self, **changes: Any) -> XferConfig:
        return dataclasses.replace(self, **changes)

    def endpoint_config(self) -> EndpointConfig:
        """The :class:`kvkern.xfer.endpoint.EndpointConfig` these knobs describe."""
        from kvkern.xfer.endpoint import EndpointConfig  # noqa: PLC0415

        return EndpointConfig(default_port=self.default_state_port, state_path=self.state_path,
                              dp_port_stride=self.dp_port_stride,
                              state_port_offset=self.state_port_offset)

    def effective_timeouts(self, *, metadata_timeout_s: float | None = None,
                           transfer_timeout_s: float | None = None,
                           deadline_s: float | None = None) -> tuple[float, float, float]:
        """``(metadata, transfer, deadline)`` seconds for one pull: a hint's value where it
        gives one (else the default), never above the cap."""

        def eff(value: float | None, default: float, cap: float) -> float:
            if value is None or not (isinstance(value, (int, float)) and value > 0
                                     and math.isfinite(value)):
                return default
            return min(float(value), cap)

        return (eff(metadata_timeout_s, self.metadata_timeout_s, self.max_metadata_timeout_s),
                eff(transfer_timeout_s, self.transfer_timeout_s, self.max_transfer_timeout_s),
                eff(deadline_s, self.deadline_s, self.max_deadline_s))

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> XferConfig:
        """Defaults plus ``KVKERN_ALLOWLIST`` (comma/space separated specs) and
        ``overrides``."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        if env.get("KVKERN_ALLOWLIST"):
            kw["allowlist"] = env["KVKERN_ALLOWLIST"]
        kw.update(overrides)
        return cls(**kw)


def _is_allowlist(obj: object) -> bool:
    return type(obj).__name__ == "Allowlist" and hasattr(obj, "entries")


DEFAULT_CONFIG = XferConfig()
