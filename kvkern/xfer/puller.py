"""The destination side of the pull path: admit a hinted request, pull the missing tail of its
prefix from the hinted source, commit it to the prefix index under a lease, or fall back.

Engine-facing API (thread-safe; admission never waits on the network)::

    puller = Puller(group, config=XferConfig(allowlist=["10.0.0.0/8"]))
    state = puller.submit(request_id, token_ids, hint)   # hint: KvHint | HintRejected | body dict | None
    puller.is_schedulable(request_id)                     # False while prefetching
    outcome = puller.result(request_id, timeout=...)      # PullOutcome (blocking), or await wait()
    block_ids = puller.claim(request_id)                  # leased pulled blocks -> request refs
    puller.release(request_id)                            # or drop the lease unclaimed

One pull, on the loop thread (every step bounded; any failure frees every private block
exactly once, sends ``Cancel`` for every open transfer and ends with a reason)::

    submit   decode hint; hash the prompt's full blocks in the worker's scheme (chained) and
             the hint's scheme (check the hint's hashes name this prompt); longest local
             prefix; cost guard; de-duplication; concurrency cap     -> CONTEXT_PREFETCH_INIT
    resolve  endpoint parse + resolve once + allowlist                -> IN_PROGRESS
    state    GET /kvkern/v1/state (cached per source + incarnation): protocol, codec
             fingerprint, hash scheme, block size, topology, UCX address of each source rank
             (each checked against the allowlist too)
    plan     plan_transfer(source topology, source DP rank, our topology, our DP rank);
             keep the (source rank, destination rank) pairs whose destination is hosted here
    alloc    allocate_private(count): fresh blocks only, so no cached or partially filled
             block is ever written (a local partial leaf stays untouched)
    pull     per pair, concurrently: PullRequest on CONTROL_TAG (strict: ``require_all``,
             so a source short of blocks answers MISS without pinning, and no Cancel has
             to abort the shared connection) -> PullReply -> either one-sided reads of
             the pinned blocks' byte runs straight into the private blocks (``_can_read``:
             canonical segments on both sides, or one layout's own segments, whole
             blocks; split over ``read_lanes`` read lanes, :mod:`kvkern.xfer.read_lanes`,
             where the source names its UCX worker; then ReadDone) or chunks into a ring
             of ``chunks_in_flight`` staging
             buffers, each unpacked into the private blocks as it lands (chunk size is a
             multiple of the pair's per-block bytes)
    policy   served hashes must equal the requested ones; strict: all or nothing;
             best_effort: the shortest served run over pairs
    commit   commit_private(kept, chained hashes, lease_s) ; free_private(rest)
                                                                      -> CONTEXT_PREFETCH_COMPLETE

Hashes: hint hashes are checked against the prompt in the hint's scheme, either in the
per-block form (Dynamo's router) or the chained form; the request to the source always
carries the chained hashes of the worker's scheme from the root. A hint without hashes
(llm-d) covers every full block of the prompt. The trailing partial block is never pulled.

De-duplication (``XferConfig.dedup``): a second request whose pull would be identical (same
source spec and DP rank, same hash range) attaches to the first: it stays
``CONTEXT_PREFETCH_IN_PROGRESS`` until the first ends (bounded by its own deadline), then ends
with reason ``duplicate`` (``used`` False) and ``blocks_local`` re-measured: the first pull's
committed blocks are in the prefix index (held by the first request's lease), so the engine's
ordinary prefix match picks them up. Followers do not count against ``max_inflight_pulls``.

Connections: one UCXX connection per source rank, shared by concurrent pulls; a timeout or
cancel in the middle of a stream, or while a message is awaited, aborts that connection
(UCX owns posted buffers until an abort), so other pulls on it fail with
``transfer_failed`` and the next one reconnects. A cancel during one-sided reads lets them
finish (``READ_CANCEL_GRACE_S``) and keeps the connection; a read lane that fails or is
stopped closes only its own endpoint to that source.

CPU pools only are tested here; with CUDA pools the ring lives on the pool's device and the
unpack is a kernel launch on the current stream.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvkern.cache.hashing import DEFAULT_SCHEME, get_scheme, salt_key
from kvkern.layout.chunks import direct_order
from kvkern.layout.segments import min_run_bytes, segment_runs, whole_block_pair
from kvkern.xfer.config import XferConfig
from kvkern.xfer.hints import HintLimits, HintRejected, KvHint, decode_hint
from kvkern.xfer.messages import READ_CAPABILITY
from kvkern.xfer.outcome import PullOutcome, Reason, RequestState
from kvkern.xfer.policy import CostGuard, apply_policy
from kvkern.xfer.runtime import spawn

__all__ = ["PROTOCOL", "Puller", "SourceState", "parse_state"]

log = logging.getLogger("kvkern.xfer")

PROTOCOL = "kvkern/1"
_HINT_REASONS = {
    "no_hint": Reason.NO_HINT,
    "unknown_hash_scheme": Reason.HASH_SCHEME_MISMATCH,
}
_TRANSPORT_REASONS = {"transfer_timeout": Reason.TRANSFER_TIMEOUT,
                      "auth_failed": Reason.UNAUTHENTICATED}
_CONNECT_FAILURES = ("connect_failed", "connect_timeout", "peer_closed", "closed")
_CANCEL_SEND_TIMEOUT_S = 1.0


class _Fallback(Exception):
    def __init__(self, reason: Reason, detail: str = "", **fields: Any) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.fields = fields  # extra outcome fields (block counts known so far)


# --------------------------------------------------------------------------- source state


@dataclass(frozen=True, kw_only=True)
class SourceState:
    """The parsed ``GET /kvkern/v1/state`` body. ``ranks[(dp, rank)] = (ucx_host, ucx_port)``."""

    protocol: str
    worker_id: str
    incarnation: str
    hash_scheme: str
    block_size: int
    codec_fingerprint: int
    topology: Any  # kvkern.layout.topology.Topology
    ranks: dict[tuple[int, int], tuple[str, int]]
    capabilities: tuple[str, ...]
    # (dp, rank) -> "canonical" | "native": how that rank's registered pool can be read
    reads: dict[tuple[int, int], str] = field(default_factory=dict)
    # (dp, rank) -> kvkern.xfer.kvgroup.layout_signature of its pool (native reads)
    layouts: dict[tuple[int, int], tuple] = field(default_factory=dict)
    # (dp, rank) -> the UCX worker address its read lanes open endpoints to
    read_workers: dict[tuple[int, int], bytes] = field(default_factory=dict)
    model: str = ""  # the source's model fingerprint (KVGroup.model_id)


def parse_state(body: bytes | str | dict) -> SourceState:
    """Parse and check a state body; ``ValueError`` naming the bad field otherwise."""
    from kvkern.layout.topology import Topology  # noqa: PLC0415 (torch: only when pulling)

    try:
        d = json.loads(body) if isinstance(body, (bytes, str)) else body
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"state is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"state is a JSON {type(d).__name__}, not an object")

    def get(name: str, typ: type | tuple[type, ...]) -> Any:
        v = d.get(name)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ValueError(f"state field {name!r} is {v!r}, expected {typ}")
        return v

    protocol = get("protocol", str)
    worker_id = get("worker_id", str)
    incarnation = get("incarnation", str)
    hash_scheme = get("hash_scheme", str)
    block_size = get("block_size", int)
    fp_text = get("codec_fingerprint", str)
    try:
        fingerprint = int(fp_text, 16)
    except ValueError:
        raise ValueError(f"state codec_fingerprint {fp_text!r} is not hex") from None
    try:
        topology = Topology.from_dict(get("topology", dict))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # e.g. "model": null
        raise ValueError(f"state topology invalid: {type(exc).__name__}: {exc}") from None
    from kvkern.xfer.kvgroup import layout_signature  # noqa: PLC0415

    ranks: dict[tuple[int, int], tuple[str, int]] = {}
    reads: dict[tuple[int, int], str] = {}
    layouts: dict[tuple[int, int], tuple] = {}
    read_workers: dict[tuple[int, int], bytes] = {}
    for dp_text, group in get("dp_groups", dict).items():
        try:
            dp = int(dp_text)
            for r_text, info in group["ranks"].items():
                host, port = info["ucx_host"], info["ucx_port"]
                if not isinstance(host, str) or isinstance(port, bool) or not isinstance(
                        port, int) or not 0 < port < 65536:
                    raise ValueError(f"ucx address {host!r}:{port!r}")
                ranks[(dp, int(r_text))] = (host, port)
                if info.get("read") in ("canonical", "native"):
                    reads[(dp, int(r_text))] = info["read"]
                    worker = _worker_address(info.get("read_worker"))
                    if worker is not None:
                        read_workers[(dp, int(r_text))] = worker
                if isinstance(info.get("layout"), dict):
                    layouts[(dp, int(r_text))] = layout_signature(info["layout"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"state dp_groups[{dp_text!r}] invalid: {exc}") from None
    model = d.get("model", "")
    if not isinstance(model, str):
        raise ValueError(f"state model {model!r} is not a string")
    caps = d.get("capabilities", [])
    if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
        raise ValueError(f"state capabilities {caps!r} is not a list of strings")
    return SourceState(protocol=protocol, worker_id=worker_id, incarnation=incarnation,
                       hash_scheme=hash_scheme, block_size=block_size,
                       codec_fingerprint=fingerprint, topology=topology, ranks=ranks,
                       capabilities=tuple(caps), reads=reads, layouts=layouts,
                       read_workers=read_workers, model=model)


def _worker_address(text: Any) -> bytes | None:
    """A state's ``read_worker`` (hex of a UCX worker address) as bytes; None when absent or
    malformed (that rank is then read on the control connection, without lanes)."""
    from kvkern.xfer.read_lanes import MAX_WORKER_ADDRESS_BYTES  # noqa: PLC0415

    if not isinstance(text, str) or not 0 < len(text) <= 2 * MAX_WORKER_ADDRESS_BYTES:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


# --------------------------------------------------------------------------- per request


@dataclass(eq=False)
class _Record:
    request_id: str
    state: RequestState = RequestState.CONTEXT_INIT
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    outcome: PullOutcome | None = None
    lease: Any = None
    future: concurrent.futures.Future | None = None  # the loop task (cancel() cancels it)
    key: tuple | None = None  # dedup key while leading a pull
    leader: _Record | None = None  # set on dedup followers
    cancel_requested: bool = False


@dataclass(eq=False)
class _Job:
    """Everything one pull needs, computed at submit."""

    rec: _Record
    hint: KvHint
    policy: str
    chained: list[int]  # worker-scheme chained hashes of the hinted blocks (from the root)
    hinted: int
    local: int
    t_submit: float
    timeouts: tuple[float, float, float]
    base: dict  # common outcome fields
    # filled while running
    private: list[int] | None = None
    open_transfers: list = field(default_factory=list)  # [(conn, tid)] awaiting completion
    phases: dict = field(default_factory=dict)
    messages: int = 0
    reads: int = 0
    bytes: int = 0
    t_first_byte: float | None = None
    state: SourceState | None = None
    state_cached: bool = False
    pairs: int = 0
    unpack_s: float = 0.0
    allocated: bool = False
    quarantined: bool = False  # reads outlived their abort: never reuse the private blocks

    @property
    def count(self) -> int:
        return self.hinted - self.local


class _StreamUnpacker:
    """Feeds one pair's byte stream, chunk by chunk in order, into the private blocks.

    The stream is, for each piece of the pair in order, the canonical staging
    ``[n, L, 2, H, T, D]`` of the ``n`` served blocks; whole blocks inside a chunk are
    unpacked straight from the ring buffer, a block split across chunks through a one-block
    carry buffer."""

    def __init__(self, transfer: Any, rkv: Any, block_ids: Sequence[int], n: int) -> None:
        import torch  # noqa: PLC0415

        self._torch = torch
        self.rkv = rkv
        self.layout = rkv.layout
        self.block_ids = list(block_ids)
        self.n = n
        self.segments = []  # (start, stop, piece)
        for p in transfer.pieces:
            o = p.byte_offset(n)
            self.segments.append((o, o + p.byte_length(n), p))
        self.segments.sort(key=lambda s: s[0])
        self.total = transfer.nbytes(n)
        self.pos = 0
        width = max((p.block_nbytes for p in transfer.pieces), default=1)
        self.carry = torch.empty(width, dtype=torch.uint8, device=rkv.device)

    def _unpack(self, flat: Any, piece: Any, b0: int, k: int) -> None:
        from kvkern.kernels.pack import unpack  # noqa: PLC0415

        lay = self.layout
        shape = piece.staging_shape(k, lay.block_size, lay.head_dim)
        unpack(flat.view(lay.dtype).view(shape), self.rkv.pool, lay, self.block_ids[b0:b0 + k],
               layers=piece.dst_layers, heads=piece.dst_heads)

    def feed(self, chunk: Any) -> None:
        length = int(chunk.numel())
        if self.pos + length > self.total:
            raise ValueError(f"stream overrun: {self.pos} + {length} > {self.total} bytes")
        off = 0
        while off < length:
            seg = next((s for s in self.segments if s[0] <= self.pos < s[1]), None)
            if seg is None:
                raise ValueError(f"stream byte {self.pos} lies in no plan piece")
            start, stop, piece = seg
            bn = piece.block_nbytes
            rel = self.pos - start
            b, within = divmod(rel, bn)
            avail = min(length - off, stop - self.pos)
            if within or avail < bn:
                take = min(bn - within, avail)
                self.carry[within:within + take].copy_(chunk[off:off + take])
                off += take
                self.pos += take
                if within + take == bn:
                    self._unpack(self.carry[:bn], piece, b, 1)
                continue
            k = avail // bn
            self._unpack(chunk[off:off + k * bn], piece, b, k)
            off += k * bn
            self.pos += k * bn

    def skip(self, nbytes: int) -> None:
        """Bytes that landed in the blocks directly (zero-copy chunk): just advance."""
        self.pos += nbytes

    @property
    def complete(self) -> bool:
        return self.pos == self.total


# --------------------------------------------------------------------------------- puller


_HOLD_RATE_SLACK = 1e-3  # clock-rate difference allowed between the two hosts' clocks
_HOLD_MARGIN_S = 1e-3  # and a fixed margin, both taken off the source's granted read hold
LANE_RETRY_S = 60.0  # after its read lanes failed, a source worker is read on the connection
_MAX_CACHED_SOURCES = 4096  # hints name arbitrary sources: the caches must stay bounded


@functools.lru_cache(maxsize=256)
def _source_layout(topology: Any, rank: int) -> Any:
    """A source rank's local layout (sizes only), from its state's topology: once per
    (topology, rank), not per pull."""
    return topology.local_layout(rank, 1)


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _bounded_put(cache: dict, key: Any, value: Any, limit: int = _MAX_CACHED_SOURCES) -> None:
    """Insert as the newest entry, dropping the oldest ones beyond ``limit``."""
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]


class Puller:
    """Destination side of the pull path for one DP group (see the module docstring)."""

    def __init__(self, group: Any, *, config: XferConfig, metrics: Any = None,
                 loop: Any = None, resolver: Any = None, pool: Any = None,
                 credential: Any = None) -> None:
        from kvkern.xfer.runtime import EventLoopThread  # noqa: PLC0415

        if not isinstance(config, XferConfig):
            raise TypeError(f"config must be an XferConfig, got {type(config).__name__}")
        self.group = group
        self.config = config
        self.metrics = metrics
        self._own_loop = loop is None
        self._loop = loop if loop is not None else EventLoopThread("kvkern-puller")
        self._resolver = resolver
        from kvkern.xfer.auth import FROM_ENV, resolve  # noqa: PLC0415

        # The fleet credential signs state requests and opens control connections; without
        # one every hint falls back (``unauthenticated``): no source serves a stranger.
        self.credential = resolve(FROM_ENV if credential is None else credential)
        self._own_pool = pool is None
        if pool is None:
            from kvkern.xfer.transport import ConnectionPool  # noqa: PLC0415

            pool = ConnectionPool(credential=self.credential)
        self._pool = pool
        self.cost_guard = CostGuard(config)
        self._limits = HintLimits(max_metadata_timeout_s=config.max_metadata_timeout_s,
                                  max_transfer_timeout_s=config.max_transfer_timeout_s,
                                  max_deadline_s=config.max_deadline_s,
                                  default_policy=config.default_policy)
        self._endpoint_config = None
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        self._leaders: dict[str, _Record] = {}  # request id -> record, pulls using the network
        self._keys: dict[tuple, _Record] = {}
        self._closed = False
        self._state_cache: dict[tuple, tuple[SourceState, float]] = {}
        self._state_fetches: dict[tuple, asyncio.Future] = {}
        self._verdicts: dict[tuple, tuple[Any, float]] = {}  # allowed endpoints, with time
        self._tids = itertools.count(random.randrange(1, 1 << 29))
        self._bytes_per_block = sum(r.layout.bytes_per_block for r in group.ranks.values())
        self._bg: set[asyncio.Task] = set()
        self.quarantined_blocks = 0  # private blocks never reused (see Connection.read)
        self._lanes = None  # kvkern.xfer.read_lanes.ReadLanes, made by the first lane read
        self._lanes_down: dict[bytes, float] = {}  # source worker -> when its lanes failed
        from kvkern.xfer.source import StagingPool  # noqa: PLC0415

        # Receive rings reused across pulls (loop thread only): a fresh 16 MiB ring slot cost
        # page faults and 4 KiB-page CMA writes on every pull (unpack path 5 ms per 64 MiB).
        # Faulted in now, one ring per hosted rank that would stream: with remote_read a
        # host rank whose blocks are whole segments (TRT-LLM rows, per-layer HND) reads
        # instead, so its ring is only made if a source that offers no read streams to it.
        self._staging = StagingPool(4 * config.chunks_in_flight * config.chunk_bytes)
        streaming = [r for r in group.ranks.values()
                     if not (config.remote_read and r.device.type == "cpu"
                             and r.read_segments is not None)]
        devices = collections.Counter(r.device for r in streaming)
        for device, n_ranks in devices.items():
            self._staging.prewarm(device, config.chunk_bytes, config.chunks_in_flight * n_ranks)
        # Heavy modules now, not on the first request's path (triton via the kernels: ~0.2 s).
        import kvkern.kernels.pack  # noqa: F401, PLC0415
        import kvkern.layout.plan  # noqa: F401, PLC0415
        import kvkern.xfer.endpoint  # noqa: F401, PLC0415

    # ------------------------------------------------------------------ engine-facing API

    def submit(self, request_id: str, token_ids: Sequence[int],
               hint: KvHint | HintRejected | dict | None, *,
               cache_salt: str = "") -> RequestState:
        """Admit a request with its hint; returns its state at once. A missing or rejected
        hint, or one that needs no pull, records an outcome now and leaves the request in
        ``CONTEXT_INIT``; otherwise the pull is scheduled on the loop thread and the request
        is ``CONTEXT_PREFETCH_INIT`` (not schedulable) until it ends. ``cache_salt`` (the
        request's tenant salt, :func:`kvkern.cache.hashing.salt_key`) enters every hash the
        pull checks and asks for, so only blocks cached under the same salt are pulled."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        t_submit = time.perf_counter()
        rec = _Record(request_id)
        with self._lock:
            old = self._records.get(request_id)
            if old is not None and not old.state.schedulable:
                raise ValueError(f"request {request_id!r} is already prefetching "
                                 f"({old.state.value})")
            if old is not None and old.lease is not None:
                self._release_lease_locked(old)
            self._records[request_id] = rec
            self._records.move_to_end(request_id)
            self._trim_locked()
        if isinstance(hint, dict):
            hint = decode_hint(hint, limits=self._limits)
        if hint is None:
            hint = HintRejected(reason="no_hint", detail="no hint given")
        if self.metrics is not None and not (isinstance(hint, HintRejected)
                                             and hint.reason == "no_hint"):
            self.metrics.hint_received()
        if isinstance(hint, HintRejected):
            reason = _HINT_REASONS.get(hint.reason, Reason.HINT_INVALID)
            self._finish(rec, PullOutcome(request_id=request_id, used=False, reason=reason,
                                          dialect=hint.dialect,
                                          detail=f"{hint.reason}: {hint.detail}"[:2000]),
                         ignored=True)
            return rec.state
        if not isinstance(hint, KvHint):
            raise TypeError(f"hint must be a KvHint, HintRejected, dict or None, got "
                            f"{type(hint).__name__}")
        try:
            job = self._prepare(rec, token_ids, hint, t_submit, salt_key(cache_salt))
        except _Fallback as fb:
            self._finish(rec, PullOutcome(request_id=request_id, used=False, reason=fb.reason,
                                          policy=hint.policy, source=hint.source,
                                          source_dp_rank=hint.source_dp_rank,
                                          dialect=hint.dialect, detail=fb.detail,
                                          **fb.fields),
                         ignored=True)
            return rec.state
        return self._admit(job)

    def state(self, request_id: str) -> RequestState:
        """The request's lifecycle state (``CONTEXT_INIT`` for unknown requests)."""
        with self._lock:
            rec = self._records.get(request_id)
            return RequestState.CONTEXT_INIT if rec is None else rec.state

    def is_schedulable(self, request_id: str) -> bool:
        return self.state(request_id).schedulable

    def outcome(self, request_id: str) -> PullOutcome | None:
        """The outcome if the request has finished, else ``None`` (non-blocking)."""
        with self._lock:
            rec = self._records.get(request_id)
        return None if rec is None else rec.outcome

    def result(self, request_id: str, timeout: float | None = None) -> PullOutcome:
        """Block until the request's outcome exists (``TimeoutError`` after ``timeout``)."""
        rec = self._record(request_id)
        try:
            return rec.done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"request {request_id!r} still {rec.state.value} after "
                               f"{timeout} s") from None

    async def wait(self, request_id: str, timeout: float | None = None) -> PullOutcome:
        """Await the outcome from any event loop."""
        rec = self._record(request_id)
        # shield: a timed-out or cancelled wait must not cancel the outcome future itself
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(rec.done)), timeout)

    def cancel(self, request_id: str) -> bool:
        """Cancel a running pull (UCX operations cancelled, blocks freed, ``Cancel`` sent,
        reason ``cancelled``). False when the request is not prefetching."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.state.schedulable or rec.future is None:
                return False
            rec.cancel_requested = True
            fut = rec.future
        fut.cancel()
        return True

    def claim(self, request_id: str) -> list[int] | None:
        """The pulled blocks' ids as references held by the request (the engine releases
        them like any request blocks), via ``manager.claim``; ``None`` when nothing was
        pulled, the lease expired or was already claimed/released. Moves the request from
        ``CONTEXT_PREFETCH_COMPLETE`` to ``CONTEXT_INIT``."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.lease is None:
                return None
            lease, rec.lease = rec.lease, None
            rec.state = RequestState.CONTEXT_INIT
        return self.group.manager.claim(lease)

    def release(self, request_id: str) -> bool:
        """Drop an unclaimed lease (the blocks stay cached and evictable)."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.lease is None:
                return False
            self._release_lease_locked(rec)
            rec.state = RequestState.CONTEXT_INIT
            return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed the cost guard a measured prefill (when no per-token cost is configured)."""
        self.cost_guard.observe_prefill(tokens, seconds)

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._leaders)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every pull, release unclaimed leases, close the connections (and the
        loop thread if this puller created it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = [r for r in self._records.values() if r.future is not None
                       and not r.done.done()]
        for r in running:
            r.cancel_requested = True
            r.future.cancel()
        deadline = time.monotonic() + timeout
        for r in running:
            with contextlib.suppress(Exception):
                r.done.result(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for r in self._records.values():
                if r.lease is not None:
                    self._release_lease_locked(r)
        if not self._loop.closed:
            with contextlib.suppress(Exception):
                self._loop.run(self._aclose(), max(1.0, deadline - time.monotonic()))
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.close(max(1.0, deadline - time.monotonic()))
        if self._own_loop:
            self._loop.close()

    async def _aclose(self) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=2.0)
        if self._own_pool:
            await self._pool.close()

    def __enter__(self) -> Puller:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------- admission

    def _record(self, request_id: str) -> _Record:
        with self._lock:
            rec = self._records.get(request_id)
        if rec is None:
            raise KeyError(f"unknown request {request_id!r}")
        return rec

    def _trim_locked(self) -> None:
        while len(self._records) > self.config.max_tracked_requests:
            rid, old = next(iter(self._records.items()))
            if not old.state.schedulable:
                break  # never drop a running pull's record
            if old.lease is not None:
                self._release_lease_locked(old)
            del self._records[rid]

    def _release_lease_locked(self, rec: _Record) -> None:
        lease, rec.lease = rec.lease, None
        try:
            self.group.manager.release_lease(lease)
        except ValueError as exc:  # already expired and forgotten by the manager
            log.debug("release of lease %s of %r: %s", lease.lease_id, rec.request_id, exc)

    def _prepare(self, rec: _Record, token_ids: Sequence[int], hint: KvHint,
                 t_submit: float, salt: int | None) -> _Job:
        """Submit-time checks (CPU only); raises _Fallback for a hint that needs no pull."""
        from kvkern.cache.hashing import sequence_hashes  # noqa: PLC0415

        bs = self.group.block_size
        n_full = len(token_ids) // bs
        tokens = list(token_ids[:n_full * bs])
        mine = None
        if hint.block_hashes is not None:
            scheme_name = hint.hash_scheme or DEFAULT_SCHEME
            try:
                scheme = get_scheme(scheme_name)
            except ValueError as exc:
                raise _Fallback(Reason.HASH_SCHEME_MISMATCH, str(exc)) from None
            hinted = len(hint.block_hashes)
            if hinted > n_full:
                raise _Fallback(Reason.HASH_MISMATCH, f"hint names {hinted} blocks, the prompt "
                                f"has {n_full} full blocks of {bs} tokens")
            want = list(hint.block_hashes)
            mine = scheme.block_hashes(tokens[:hinted * bs], bs,
                                       cache_salt=salt if scheme.chained else None)
            if mine != want and scheme.salted_chain(mine, salt) != want:
                i = next(i for i, (a, b) in enumerate(zip(mine, want, strict=True)) if a != b)
                raise _Fallback(Reason.HASH_MISMATCH,
                                f"hint hash {i} is {want[i]}, the prompt's block {i} hashes to "
                                f"{mine[i]} in {scheme_name}")
        else:
            hinted = n_full
        if hinted == 0:
            raise _Fallback(Reason.LOCAL_PREFIX_SUFFICIENT,
                            f"prompt of {len(token_ids)} tokens has no full block of {bs}")
        if mine is not None and scheme_name == self.group.hash_scheme:
            chained = scheme.salted_chain(mine, salt)  # the tokens are hashed once
        else:
            chained = sequence_hashes(tokens[:hinted * bs], bs, self.group.hash_scheme,
                                      cache_salt=salt)
        local = self.group.manager.longest_prefix(chained)
        base = dict(policy=hint.policy, source=hint.source, source_dp_rank=hint.source_dp_rank,
                    dialect=hint.dialect, blocks_hinted=hinted, blocks_local=local)
        counts = dict(blocks_hinted=hinted, blocks_local=local)
        if local >= hinted:
            raise _Fallback(Reason.LOCAL_PREFIX_SUFFICIENT,
                            f"all {hinted} hinted blocks are cached here", **counts)
        count = hinted - local
        ok, detail = self.cost_guard.check(blocks=count, nbytes=count * self._bytes_per_block,
                                           tokens=count * bs)
        if not ok:
            raise _Fallback(Reason.NOT_WORTH_IT, detail, **counts)
        timeouts = self.config.effective_timeouts(
            metadata_timeout_s=hint.metadata_timeout_s,
            transfer_timeout_s=hint.transfer_timeout_s, deadline_s=hint.deadline_s)
        return _Job(rec=rec, hint=hint, policy=hint.policy, chained=chained, hinted=hinted,
                    local=local, t_submit=t_submit, timeouts=timeouts, base=base)

    def _admit(self, job: _Job) -> RequestState:
        rec, hint = job.rec, job.hint
        key = (hint.source, hint.source_dp_rank or 0, job.local, job.chained[-1])
        leader = None
        with self._lock:
            reason = None
            if self._closed:
                reason, detail = Reason.CLOSED, "puller is closed"
            elif self.config.dedup and key in self._keys:
                leader = self._keys[key]
            elif len(self._leaders) >= self.config.max_inflight_pulls:
                reason, detail = Reason.BUSY, (f"{len(self._leaders)} pulls in flight, "
                                               f"max_inflight_pulls "
                                               f"{self.config.max_inflight_pulls}")
            if reason is None:
                rec.state = RequestState.CONTEXT_PREFETCH_INIT
                if leader is None:
                    rec.key = key
                    self._keys[key] = rec
                    self._leaders[rec.request_id] = rec
                else:
                    rec.leader = leader
        if reason is not None:
            self._finish(rec, self._outcome(job, reason, detail), ignored=True)
            return rec.state
        coro = self._follow(job, leader) if leader is not None else self._run(job)
        try:
            fut = self._loop.submit(coro)
        except RuntimeError as exc:
            self._finish(rec, self._outcome(job, Reason.CLOSED, str(exc)))
            return rec.state
        with self._lock:
            rec.future = fut
            state = rec.state
        if self.metrics is not None:
            self.metrics.hint_accepted()
        return state

    # ------------------------------------------------------------------------ outcomes

    def _outcome(self, job: _Job, reason: Reason, detail: str = "", **kw: Any) -> PullOutcome:
        fields = dict(job.base)
        fields.update(kw)
        st = job.state
        if st is not None:
            fields.setdefault("worker_id", st.worker_id)
            fields.setdefault("incarnation", st.incarnation)
        return PullOutcome(request_id=job.rec.request_id, used=reason in (Reason.OK,
                                                                          Reason.PARTIAL),
                           reason=reason, detail=detail[:2000], **fields)

    def _finish(self, rec: _Record, outcome: PullOutcome, *, ignored: bool = False,
                lease: Any = None) -> None:
        with self._lock:
            rec.outcome = outcome
            rec.lease = lease
            rec.state = (RequestState.CONTEXT_PREFETCH_COMPLETE if outcome.used
                         else RequestState.CONTEXT_INIT)
            if rec.key is not None and self._keys.get(rec.key) is rec:
                del self._keys[rec.key]
            if self._leaders.get(rec.request_id) is rec:
                del self._leaders[rec.request_id]
            rec.future = None
        m = self.metrics
        if m is not None and outcome.reason is not Reason.NO_HINT:
            r = outcome.reason.value
            if ignored:
                m.hint_ignored(r)
            if outcome.used:
                m.pull_finished(r)
                m.transferred(outcome.blocks_transferred, outcome.bytes_transferred)
            else:
                m.fallback(r)
                if not ignored:
                    m.pull_finished("fallback")
                    if r in ("metadata_fetch_failed", "metadata_timeout", "metadata_invalid"):
                        m.metadata_fetch_failed(r)
                    elif r not in ("cancelled", "duplicate", "closed"):
                        m.transfer_failed(r)
            if outcome.blocks_local and outcome.reason is not Reason.LOCAL_PREFIX_SUFFICIENT:
                m.skipped(outcome.blocks_local)
            for ph, s in outcome.phases.items():
                if ph in _METRIC_PHASES:
                    m.observe_phase(ph, s)
        if log.isEnabledFor(logging.INFO):  # (formatting the line costs ~0.05 ms)
            log.info(outcome.to_log())
        if not rec.done.done():
            rec.done.set_result(outcome)

    # ------------------------------------------------------------------------ the pull

    async def _follow(self, job: _Job, leader: _Record) -> None:
        rec = job.rec
        with self._lock:
            rec.state = RequestState.CONTEXT_PREFETCH_IN_PROGRESS
        t0 = time.perf_counter()
        reason, detail = Reason.DUPLICATE, ""
        try:
            first = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(leader.done)),
                                           job.timeouts[2])
            detail = f"attached to {leader.request_id!r} ({first.reason.value})"
        except (asyncio.TimeoutError, TimeoutError):
            reason, detail = Reason.DEADLINE_EXCEEDED, (f"waited {job.timeouts[2]} s for the "
                                                        f"identical pull {leader.request_id!r}")
        except asyncio.CancelledError:
            reason, detail = Reason.CANCELLED, "cancelled while attached"
        local = self.group.manager.longest_prefix(job.chained)
        self._finish(rec, self._outcome(job, reason, detail, blocks_local=local,
                                        phases={"total": time.perf_counter() - t0}))

    async def _run(self, job: _Job) -> None:
        from kvkern.xfer.transport import TransportError  # noqa: PLC0415

        rec = job.rec
        with self._lock:
            rec.state = RequestState.CONTEXT_PREFETCH_IN_PROGRESS
        t0 = job.t_submit
        deadline_s = job.timeouts[2]
        remaining = deadline_s - (time.perf_counter() - t0)
        lease = None
        reason, detail, result = Reason.INTERNAL_ERROR, "", {}
        m = self.metrics
        if m is not None:
            m.pull_started()
        try:
            try:
                async with asyncio.timeout(max(remaining, 1e-3)) as cm:
                    lease, reason, detail, result = await self._pull(job)
            except TimeoutError:
                if not cm.expired():
                    raise
                reason, detail = Reason.DEADLINE_EXCEEDED, (
                    f"pull not done within deadline_s {deadline_s} s")
        except _Fallback as fb:
            reason, detail = fb.reason, fb.detail
        except TransportError as exc:
            reason = _TRANSPORT_REASONS.get(exc.reason, Reason.TRANSFER_FAILED)
            detail = str(exc)
        except asyncio.CancelledError:
            reason, detail = Reason.CANCELLED, ("cancelled" if rec.cancel_requested
                                                else "loop shut down")
        except Exception as exc:
            log.exception("pull %r failed unexpectedly", rec.request_id)
            reason, detail = Reason.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
        finally:
            if job.private is not None and job.quarantined:
                ids, job.private = job.private, None
                self.quarantined_blocks += len(ids)
                log.error("pull %r: %d private blocks quarantined (one-sided reads still "
                          "running after their endpoint was aborted)", rec.request_id, len(ids))
            if job.private is not None:  # not committed: free every block exactly once
                ids, job.private = job.private, None
                self.group.manager.free_private(ids)
            self._send_cancels(job, reason)
            if m is not None:
                m.pull_ended()
        job.phases["total"] = time.perf_counter() - t0
        if job.t_first_byte is not None:
            job.phases["first_byte"] = job.t_first_byte - t0
        if job.unpack_s:
            job.phases["unpack"] = job.unpack_s
        fields = dict(phases=dict(job.phases), pairs=job.pairs, messages=job.messages,
                      reads=job.reads,
                      bytes_transferred=job.bytes,
                      blocks_requested=job.count if job.allocated else 0)
        fields.update(result)
        self._finish(rec, self._outcome(job, reason, detail, **fields), lease=lease)

    async def _pull(self, job: _Job) -> tuple[Any, Reason, str, dict]:
        from kvkern.layout.plan import plan_transfer  # noqa: PLC0415
        from kvkern.layout.topology import IncompatibleTopologyError  # noqa: PLC0415
        from kvkern.xfer.endpoint import normalize_host  # noqa: PLC0415

        cfg, hint, group = self.config, job.hint, self.group
        md_t, xfer_t, _ = job.timeouts
        t = time.perf_counter()
        resolved = await self._resolve(hint, md_t)
        state = await self._get_state(job, resolved, md_t)
        job.phases["metadata"] = time.perf_counter() - t

        t = time.perf_counter()
        if state.protocol != PROTOCOL or "pull/1" not in state.capabilities:
            raise _Fallback(Reason.PROTOCOL_MISMATCH, f"source speaks {state.protocol!r} "
                            f"{list(state.capabilities)}, we speak {PROTOCOL!r} pull/1")
        if state.codec_fingerprint != self._pool.codec.fingerprint:
            raise _Fallback(Reason.PROTOCOL_MISMATCH,
                            f"source codec fingerprint {state.codec_fingerprint:#018x} != ours "
                            f"{self._pool.codec.fingerprint:#018x}")
        if state.hash_scheme != group.hash_scheme:
            raise _Fallback(Reason.HASH_SCHEME_MISMATCH, f"source hashes with "
                            f"{state.hash_scheme!r}, this worker with {group.hash_scheme!r}")
        if state.block_size != group.block_size:
            raise _Fallback(Reason.INCOMPATIBLE_TOPOLOGY, f"source block size "
                            f"{state.block_size} != ours {group.block_size}")
        if state.model != getattr(group, "model_id", ""):
            raise _Fallback(Reason.INCOMPATIBLE_MODEL, f"source model {state.model!r} != "
                            f"ours {getattr(group, 'model_id', '')!r}")
        src_dp = hint.source_dp_rank or 0
        try:
            plan = plan_transfer(state.topology, src_dp, group.topology, group.dp_rank)
        except (IncompatibleTopologyError, ValueError) as exc:
            raise _Fallback(Reason.INCOMPATIBLE_TOPOLOGY, str(exc)) from None
        pairs = [tr for tr in plan.transfers if tr.dst_rank in group.ranks]
        if not pairs:
            raise _Fallback(Reason.INCOMPATIBLE_TOPOLOGY, f"plan has no pair for the hosted "
                            f"ranks {sorted(group.ranks)}")
        addrs: dict[int, tuple[str, int]] = {}
        for tr in pairs:
            addr = state.ranks.get((src_dp, tr.src_rank))
            if addr is None:
                raise _Fallback(Reason.METADATA_INVALID, f"source state has no UCX address "
                                f"for DP {src_dp} rank {tr.src_rank}")
            try:
                ip = normalize_host(addr[0])
            except Exception as exc:  # noqa: BLE001 (endpoint's refusal type is private)
                raise _Fallback(Reason.SOURCE_NOT_ALLOWED, f"UCX host {addr[0]!r}: "
                                f"{exc}") from None
            if isinstance(ip, str):
                raise _Fallback(Reason.SOURCE_NOT_ALLOWED, f"UCX host {addr[0]!r} of rank "
                                f"{tr.src_rank} is a name, not an address")
            why, what = self._allowlist().check(ip, None, addr[1])
            if why != "allowed":
                raise _Fallback(Reason.SOURCE_NOT_ALLOWED, f"UCX address of source rank "
                                f"{tr.src_rank}: {why}: {what}")
            addrs[tr.src_rank] = (str(ip), addr[1])
        job.pairs = len(pairs)
        job.phases["plan"] = time.perf_counter() - t

        t = time.perf_counter()
        ids = group.manager.allocate_private(job.count)
        if ids is None:
            raise _Fallback(Reason.NO_BLOCKS, f"{job.count} private blocks not available")
        job.private = sorted(ids)  # ascending: runs of consecutive ids receive zero-copy
        unit = pairs[0].block_nbytes
        if len(pairs) == 1 and cfg.chunk_bytes >= unit:
            job.private = direct_order(job.private, cfg.chunk_bytes // unit)
        job.allocated = True
        job.phases["allocate"] = time.perf_counter() - t

        t = time.perf_counter()
        if len(pairs) == 1:  # one pair: no task to spawn and wait for (a loop hop less)
            served = [await self._pull_pair(job, pairs[0], addrs[pairs[0].src_rank], xfer_t)]
        else:
            served = await self._pull_pairs(job, pairs, addrs, xfer_t)
        xfer_s = time.perf_counter() - t
        job.phases["transfer"] = xfer_s

        t = time.perf_counter()
        decision = apply_policy(job.policy, job.count, served)
        job.phases["validate"] = time.perf_counter() - t
        if not decision.used:
            raise _Fallback(decision.reason, f"pairs served {served} of {job.count} blocks "
                            f"({job.policy})")
        t = time.perf_counter()
        keep = decision.keep
        ids, job.private = job.private, None
        try:
            lease = group.manager.commit_private(
                ids[:keep], job.chained[job.local:job.local + keep],
                lease_s=None if hint.no_retain else cfg.lease_s)
        except BaseException:
            job.private = ids  # not committed: the caller frees them
            raise
        if keep < len(ids):
            group.manager.free_private(ids[keep:])
        job.phases["commit"] = time.perf_counter() - t
        self.cost_guard.observe_pull(job.bytes, max(xfer_s, 1e-9), job.phases.get("rtt"))
        detail = (f"{keep} of {job.count} blocks from {len(pairs)} pair(s)"
                  + (f", {len(ids) - keep} skipped" if keep < len(ids) else ""))
        return lease, decision.reason, detail, {"blocks_transferred": keep,
                                                "blocks_skipped": decision.skipped,
                                                "blocks_requested": job.count}

    async def _pull_pairs(self, job: _Job, pairs: list, addrs: dict, xfer_t: float) -> list[int]:
        """Every pair concurrently; the first failure cancels the others (awaited)."""
        tasks = [asyncio.ensure_future(self._pull_pair(job, tr, addrs[tr.src_rank], xfer_t))
                 for tr in pairs]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for tk in tasks:
                if tk.done() and not tk.cancelled() and tk.exception() is not None:
                    raise tk.exception()
            return [tk.result() for tk in tasks]
        finally:
            for tk in tasks:
                tk.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pull_pair(self, job: _Job, tr: Any, addr: tuple[str, int], xfer_t: float) -> int:
        """One (source rank, destination rank) pair; returns the validated served count."""

        from kvkern.xfer.messages import PlanPiece, PullReply, PullRequest, Status  # noqa: PLC0415
        from kvkern.xfer.transport import CONTROL_TAG, Lane, TransportError, tag_for  # noqa: PLC0415

        count, cfg = job.count, self.config
        rkv = self.group.ranks[tr.dst_rank]
        # block rows a stream's chunks land in as they are (one piece of whole blocks)
        direct = (rkv.stream_rows(tr.pieces[0].dst_layers, tr.pieces[0].dst_heads,
                                  tr.pieces[0].block_nbytes) if len(tr.pieces) == 1 else None)
        try:
            async with asyncio.timeout(xfer_t):  # not wait_for: no task per pull
                conn = await self._pool.get(*addr)
        except TimeoutError:
            raise _Fallback(Reason.TRANSFER_TIMEOUT, f"connect to {addr[0]}:{addr[1]} took "
                            f"over {xfer_t} s") from None
        except TransportError as exc:
            await self._connect_failed(job, exc)
            raise
        tid = self._next_tid()
        unit = tr.block_nbytes
        # Whole blocks per chunk (zero-copy landing, no carry); a block larger than
        # chunk_bytes travels in chunk_bytes slices that the unpacker reassembles.
        chunk = (cfg.chunk_bytes // unit) * unit or cfg.chunk_bytes
        pieces = [PlanPiece(src_rank=p.src_rank, layer_start=p.src_layers[0],
                            layer_stop=p.src_layers[1], head_start=p.src_heads[0],
                            head_stop=p.src_heads[1], offset=p.block_offset,
                            length=p.block_nbytes) for p in tr.pieces]  # per block
        remaining = job.timeouts[2] - (time.perf_counter() - job.t_submit)
        req = PullRequest(transfer_id=tid, request_id=job.rec.request_id[:256],
                          hash_scheme=self.group.hash_scheme, block_hashes=job.chained,
                          start=job.local, count=count, pieces=pieces, chunk_bytes=chunk,
                          deadline_ms=max(1, int(remaining * 1000)),
                          require_all=job.policy == "strict",
                          read=self._can_read(job, tr, rkv),
                          model=getattr(self.group, "model_id", ""))
        entry = (conn, tid)
        t_req = time.perf_counter()
        job.open_transfers.append(entry)
        try:
            await conn.send_msg(req, CONTROL_TAG, timeout=xfer_t)
            job.messages += 1
            reply = await conn.recv_msg(tag_for(tid, Lane.REPLY), timeout=xfer_t)
            job.messages += 1
        except TransportError as exc:
            if exc.reason in _CONNECT_FAILURES:
                await self._connect_failed(job, exc)
            raise
        job.phases.setdefault("rtt", time.perf_counter() - t_req)
        if not isinstance(reply, PullReply) or reply.transfer_id != tid:
            raise _Fallback(Reason.TRANSFER_FAILED, f"expected PullReply for transfer {tid}, "
                            f"got {type(reply).__name__} "
                            f"{getattr(reply, 'transfer_id', None)}")
        if reply.status in (Status.MISS,):
            job.open_transfers.remove(entry)  # nothing follows
            raise _Fallback(Reason.SOURCE_MISS, f"source rank {tr.src_rank} cannot serve "
                            f"the {count} requested blocks: {reply.reason}")
        if reply.status == Status.BUSY:
            job.open_transfers.remove(entry)
            raise _Fallback(Reason.SOURCE_BUSY, f"source rank {tr.src_rank}: {reply.reason}")
        if reply.status not in (Status.OK, Status.PARTIAL):
            job.open_transfers.remove(entry)
            reason = (Reason.HASH_SCHEME_MISMATCH if "scheme" in reply.reason
                      else Reason.INCOMPATIBLE_MODEL if reply.reason.startswith(
                          "incompatible_model") else Reason.TRANSFER_FAILED)
            raise _Fallback(reason, f"source rank {tr.src_rank} answered "
                            f"{reply.status.value}: {reply.reason}")
        served = reply.served_blocks
        want = job.chained[job.local:job.local + served]
        if served > count or list(reply.block_hashes) != want:
            raise _Fallback(Reason.HASH_MISMATCH, f"source rank {tr.src_rank} served "
                            f"{served} blocks with hashes that are not the requested "
                            f"{count}")
        if served == 0:
            job.open_transfers.remove(entry)
            raise _Fallback(Reason.SOURCE_MISS, f"source rank {tr.src_rank} served 0 of "
                            f"{count} blocks")
        if served < count and job.policy == "strict":
            raise _Fallback(Reason.SOURCE_MISS, f"source rank {tr.src_rank} holds {served} "
                            f"of {count} requested blocks (strict)")
        if reply.read_rkey:
            if not req.read:
                raise _Fallback(Reason.TRANSFER_FAILED, f"source rank {tr.src_rank} offered "
                                f"a read to a request that did not ask for one")
            await self._read_pair(job, tr, conn, reply, rkv, xfer_t, t_req)
            job.open_transfers.remove(entry)
            return served
        nbytes = tr.nbytes(served)
        if reply.total_bytes != nbytes or any(not 0 < s <= chunk for s in reply.chunk_sizes):
            raise _Fallback(Reason.TRANSFER_FAILED, f"source rank {tr.src_rank} announces "
                            f"{reply.total_bytes} B in chunks {reply.chunk_sizes[:4]}..., "
                            f"expected {nbytes} B in chunks <= {chunk} B")
        ring_n = max(1, min(cfg.chunks_in_flight, reply.n_chunks))
        ring: list[Any] = [None] * ring_n  # staging slots, allocated on first use
        sizes = reply.chunk_sizes
        ids = job.private[:served]
        unpacker = _StreamUnpacker(tr, rkv, ids, served)
        starts = list(itertools.accumulate(sizes, initial=0))
        landed_direct: set[int] = set()

        def buffer_for(i: int) -> Any:
            lo, hi = starts[i], starts[i + 1]
            if direct is not None and lo % unit == 0 and hi % unit == 0:
                b0, k = lo // unit, (hi - lo) // unit
                first = ids[b0]
                if all(ids[b0 + j] == first + j for j in range(k)):
                    landed_direct.add(i)  # zero-copy: the chunk lands in the blocks
                    return direct[first:first + k].reshape(-1)
            slot = i % ring_n
            if ring[slot] is None:
                ring[slot] = self._staging.take(rkv.device, max(chunk, cfg.chunk_bytes))
            return ring[slot][:sizes[i]]

        def on_chunk(i: int, buf: Any) -> None:
            if job.t_first_byte is None:
                job.t_first_byte = time.perf_counter()
            n = int(buf.numel())
            if i in landed_direct:
                unpacker.skip(n)
            else:
                t = time.perf_counter()
                unpacker.feed(buf)
                job.unpack_s += time.perf_counter() - t
            job.messages += 1
            job.bytes += n

        try:
            await conn.recv_stream(tid, buffer_for, reply.n_chunks, on_chunk=on_chunk,
                                   timeout=xfer_t, max_in_flight=ring_n)
        except ValueError as exc:
            raise _Fallback(Reason.TRANSFER_FAILED, f"stream from source rank "
                            f"{tr.src_rank}: {exc}") from None
        finally:
            # recv_stream returns only with every posted receive completed, and raises
            # only after aborting the connection, so UCX holds none of the slots now.
            self._staging.give(b for b in ring if b is not None)
        job.open_transfers.remove(entry)
        if not unpacker.complete:
            raise _Fallback(Reason.TRANSFER_FAILED, f"stream from source rank {tr.src_rank} "
                            f"ended at byte {unpacker.pos} of {nbytes}")
        return served

    def _can_read(self, job: _Job, tr: Any, rkv: Any) -> bool:
        """Ask for a one-sided read: allowed here, into host memory, and the source rank's
        pool is registered (its state says how). Canonical segments on both sides (TRT-LLM
        rows, per-layer HND): any plan pieces (a TP or PP reshard reads head and layer
        ranges). A source pool readable only in its own order (e.g. vLLM NHD): a
        destination pool of the same layout, whole blocks. Else the stream."""
        st = job.state
        if not (self.config.remote_read and st is not None
                and READ_CAPABILITY in st.capabilities and rkv.device.type == "cpu"):
            return False
        key = (job.hint.source_dp_rank or 0, tr.src_rank)
        kind = st.reads.get(key)
        if kind == "canonical":
            if rkv.read_segments is None:
                return False
            src = _source_layout(st.topology, tr.src_rank)
            return (whole_block_pair(tr.pieces, src, rkv.layout)
                    or min_run_bytes(tr.pieces, src, rkv.layout) >= self.config.read_min_run_bytes)
        return (kind == "native" and rkv.native_segments is not None
                and st.layouts.get(key) == rkv.layout_signature
                and whole_block_pair(tr.pieces, rkv.layout, rkv.layout))  # one layout: same dims

    async def _read_pair(self, job: _Job, tr: Any, conn: Any, reply: Any, rkv: Any,
                         xfer_t: float, t_req: float) -> None:
        """Read the pair's pieces of the served blocks straight from the source's pool into
        the private blocks of ``rkv``. They count when every read completed inside the
        source's granted hold, measured from ``t_req`` (before the request was sent; the
        source counts from its receipt, so our window closes first); else only
        ``ReadAck(held=True)`` after our ReadDone makes them count. See
        :mod:`kvkern.xfer.ucp_rma`."""
        from kvkern.xfer.messages import ReadAck, ReadDone  # noqa: PLC0415
        from kvkern.xfer.transport import (  # noqa: PLC0415
            CONTROL_TAG,
            Lane,
            ReadsStuck,
            TransportError,
            tag_for,
        )
        from kvkern.xfer.ucp_rma import coalesce_arrays  # noqa: PLC0415

        key = (job.hint.source_dp_rank or 0, tr.src_rank)
        if reply.read_native != (job.state.reads.get(key) == "native") or (
                reply.read_native and job.state.layouts.get(key) != rkv.layout_signature):
            raise _Fallback(Reason.TRANSFER_FAILED, f"source rank {tr.src_rank} offers its "
                            f"blocks {'in its own order' if reply.read_native else 'canonical'}"
                            f", its state says {job.state.reads.get(key)!r} (layout "
                            f"{job.state.layouts.get(key)})")
        segs = rkv.native_segments if reply.read_native else rkv.read_segments
        served, unit, tid = reply.served_blocks, tr.block_nbytes, reply.transfer_id
        keys = [reply.read_rkey, *reply.read_more_rkeys]
        bases = [reply.read_base, *reply.read_more_bases]
        src_lay = _source_layout(job.state.topology, tr.src_rank)
        seg, stride = reply.read_segment_bytes or unit, reply.read_stride
        top = max(reply.read_blocks) * stride + seg
        if reply.total_bytes != served * unit or seg * len(keys) != src_lay.bytes_per_block \
                or stride < seg or max(bases) + top > 1 << 64 or segs is None or (
                    reply.read_native and not (len(keys) == len(segs.bases)
                                               and seg == segs.nbytes
                                               and whole_block_pair(tr.pieces, src_lay, rkv.layout))):
            raise _Fallback(Reason.TRANSFER_FAILED, f"source rank {tr.src_rank} offers "
                            f"{reply.total_bytes} B of {served} blocks as {len(keys)} "
                            f"segments of {seg} B at stride {stride}, expected "
                            f"{src_lay.bytes_per_block} B blocks ({unit} B of each read)")
        here = np.asarray(job.private[:served], dtype=np.uint64) * np.uint64(segs.stride)
        there = np.asarray(reply.read_blocks, dtype=np.uint64) * np.uint64(stride)
        parts: dict[int, list] = {}
        if reply.read_native:  # same layout, whole blocks: segment j into segment j
            runs = [(j, 0, j, 0, seg) for j in range(len(keys))]
        else:
            runs = segment_runs(tr.pieces, src_lay, rkv.layout, seg, segs.nbytes)
        for j, s_off, d, d_off, n in runs:
            local = here + np.uint64(segs.bases[d] + d_off)
            remote = there + np.uint64(bases[j] + s_off)
            parts.setdefault(j, []).extend(coalesce_arrays(local, remote, n))
        t = time.perf_counter()
        worker = job.state.read_workers.get(key)
        lanes = self._read_lanes(worker)
        keyed = [(keys[j], runs) for j, runs in parts.items()]
        try:
            first = None
            if lanes is not None:
                try:
                    first = await lanes.read(worker, keyed, timeout=xfer_t)
                except TransportError as exc:
                    if exc.reason != "transfer_failed" or isinstance(exc, ReadsStuck):
                        raise
                    # The lanes failed, not the copy's time: read again on the connection
                    # (the private blocks are ours; the pins are held), and leave this
                    # source's lanes alone for a while.
                    self._lanes_failed(worker, exc)
                    lanes = None
            if lanes is None:
                first = await conn.read_parts(keyed, timeout=xfer_t)
        except ReadsStuck:
            job.quarantined = True
            raise
        if job.t_first_byte is None:
            job.t_first_byte = first or time.perf_counter()
        job.reads += sum(len(runs) for runs in parts.values())
        job.bytes += served * unit
        t_ack = time.perf_counter()
        job.phases["read"] = job.phases.get("read", 0.0) + (t_ack - t)
        hold_s = reply.read_hold_ms / 1000
        if hold_s and t_ack < t_req + hold_s * (1 - _HOLD_RATE_SLACK) - _HOLD_MARGIN_S:
            # Read inside the hold: the bytes are the pinned blocks'. Release them in the
            # background, asking for no ack.
            self._spawn(self._release_read(conn, tid, xfer_t))
            job.messages += 1
            return
        await conn.send_msg(ReadDone(transfer_id=tid), CONTROL_TAG, timeout=xfer_t)
        ack = await conn.recv_msg(tag_for(tid, Lane.REPLY, 1), timeout=xfer_t)
        job.messages += 2
        job.phases["ack"] = job.phases.get("ack", 0.0) + (time.perf_counter() - t_ack)
        if not isinstance(ack, ReadAck) or ack.transfer_id != tid or not ack.held:
            raise _Fallback(Reason.TRANSFER_FAILED, f"source rank {tr.src_rank} did not "
                            f"confirm it held the blocks during the read: "
                            f"{getattr(ack, 'reason', type(ack).__name__)}")

    def _read_lanes(self, worker: bytes | None) -> Any:
        """The read lanes, made on first use; None where reads stay on the connection (no
        lanes configured, or the source rank publishes no worker address this UCX can
        use)."""
        from kvkern.xfer.read_lanes import ReadLanes, address_usable  # noqa: PLC0415

        if worker is None or not self.config.read_lanes or self._closed \
                or not address_usable(worker):
            return None
        failed = self._lanes_down.get(worker)
        if failed is not None:
            if time.monotonic() - failed < LANE_RETRY_S:
                return None
            del self._lanes_down[worker]
        if self._lanes is None:  # (lanes beyond this process's CPUs could not copy at once)
            self._lanes = ReadLanes(min(self.config.read_lanes, _usable_cpus()),
                                    min_bytes=self.config.read_lane_min_bytes)
        return self._lanes

    def _lanes_failed(self, worker: bytes, exc: Exception) -> None:
        log.warning("read lanes to a source worker failed (%s); reading on the control "
                    "connection for %s s", exc, LANE_RETRY_S)
        _bounded_put(self._lanes_down, worker, time.monotonic())

    async def _release_read(self, conn: Any, tid: int, xfer_t: float) -> None:
        """ReadDone for a read that already counts: the source unpins, and answers nothing
        (``ack=False``)."""
        from kvkern.xfer.messages import ReadDone  # noqa: PLC0415
        from kvkern.xfer.transport import CONTROL_TAG  # noqa: PLC0415

        with contextlib.suppress(Exception):
            await conn.send_msg(ReadDone(transfer_id=tid, ack=False), CONTROL_TAG,
                                timeout=xfer_t)

    def _spawn(self, coro: Any) -> None:
        spawn(self._bg, coro)

    # ------------------------------------------------------------- endpoints and state

    def _allowlist(self) -> Any:
        from kvkern.xfer.endpoint import Allowlist  # noqa: PLC0415

        allow = self.config.allowlist
        return allow if isinstance(allow, Allowlist) else Allowlist.parse(list(allow))

    async def _resolve(self, hint: KvHint, md_t: float) -> Any:
        """Parse, resolve once and allowlist-check the hint's endpoint. Allowed verdicts are
        cached for ``state_cache_ttl_s`` (refusals never are), so a warm pull skips the
        resolver thread; the connection still goes to the address that was checked."""
        from kvkern.xfer.endpoint import resolve_endpoint_async  # noqa: PLC0415

        if self._endpoint_config is None:
            self._endpoint_config = self.config.endpoint_config()
        key = (hint.source, hint.source_dp_rank)
        hit = self._verdicts.get(key)
        if hit is not None and time.monotonic() - hit[1] < self.config.state_cache_ttl_s:
            return hit[0]
        try:
            verdict = await asyncio.wait_for(resolve_endpoint_async(
                hint.source, self._allowlist(), dp_rank=hint.source_dp_rank,
                config=self._endpoint_config, resolver=self._resolver), md_t)
        except (asyncio.TimeoutError, TimeoutError):
            raise _Fallback(Reason.METADATA_TIMEOUT, f"resolving {hint.source!r} took over "
                            f"{md_t} s") from None
        if not verdict.allowed:
            raise _Fallback(Reason.SOURCE_NOT_ALLOWED, f"{hint.source!r}: {verdict.reason}: "
                            f"{verdict.detail}")
        _bounded_put(self._verdicts, key, (verdict.endpoint, time.monotonic()))
        return verdict.endpoint

    @staticmethod
    def _state_key(resolved: Any) -> tuple:
        return (resolved.scheme, resolved.host, resolved.ip, resolved.port, resolved.path)

    async def _get_state(self, job: _Job, resolved: Any, md_t: float) -> SourceState:
        key = self._state_key(resolved)
        hit = self._state_cache.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[1] < self.config.state_cache_ttl_s:
            job.state, job.state_cached = hit[0], True
            return hit[0]
        fut = self._state_fetches.get(key)
        if fut is None:  # one fetch per source at a time; concurrent pulls share it
            fut = asyncio.ensure_future(self._fetch_state(resolved, md_t))
            self._state_fetches[key] = fut
            fut.add_done_callback(lambda f, k=key: self._state_fetched(k, f))
        state = await asyncio.shield(fut)
        job.state = state
        return state

    def _state_fetched(self, key: tuple, fut: asyncio.Future) -> None:
        if self._state_fetches.get(key) is fut:
            del self._state_fetches[key]
        if fut.cancelled() or fut.exception() is not None:
            self._state_cache.pop(key, None)
            return
        old = self._state_cache.get(key)
        if old is not None and old[0].incarnation != fut.result().incarnation:
            log.info("source %s restarted: incarnation %s -> %s", key[1],
                     old[0].incarnation, fut.result().incarnation)
        _bounded_put(self._state_cache, key, (fut.result(), time.monotonic()))

    async def _fetch_state(self, resolved: Any, md_t: float) -> SourceState:
        from kvkern.xfer.endpoint import FetchError, fetch_state  # noqa: PLC0415

        if self.credential is None:
            raise _Fallback(Reason.UNAUTHENTICATED, "this worker has no fleet credential "
                            "(KVKERN_FLEET_SECRET_FILE / KVKERN_FLEET_SECRET)")
        try:
            body = await fetch_state(resolved, timeout_s=md_t,
                                     max_bytes=self.config.max_state_bytes,
                                     credential=self.credential)
        except FetchError as exc:
            reason = {"metadata_timeout": Reason.METADATA_TIMEOUT,
                      "unauthenticated": Reason.UNAUTHENTICATED}.get(
                          exc.reason, Reason.METADATA_FETCH_FAILED)
            raise _Fallback(reason, f"{exc.reason}: {exc.detail}") from None
        try:
            return parse_state(body)
        except ValueError as exc:
            raise _Fallback(Reason.METADATA_INVALID,
                            f"{resolved.display_url}: {exc}") from None

    async def _connect_failed(self, job: _Job, exc: Exception) -> None:
        """A connection to a source rank failed before any data: if its state came from the
        cache, drop it and re-check the incarnation (the source may have restarted)."""
        self._verdicts.pop((job.hint.source, job.hint.source_dp_rank), None)
        if not job.state_cached or job.state is None:
            return
        for key, (st, _) in list(self._state_cache.items()):
            if st is job.state:
                del self._state_cache[key]
                try:
                    resolved = await self._resolve(job.hint, job.timeouts[0])
                    fresh = await self._get_state(job, resolved, job.timeouts[0])
                except _Fallback:
                    return
                if fresh.incarnation != st.incarnation:
                    raise _Fallback(Reason.SOURCE_INCARNATION_CHANGED,
                                    f"source incarnation {st.incarnation} -> "
                                    f"{fresh.incarnation} ({exc})") from exc
                return

    # ------------------------------------------------------------------------ helpers

    def _next_tid(self) -> int:
        while True:
            tid = next(self._tids) & ((1 << 30) - 1)
            if tid:
                return tid

    def _send_cancels(self, job: _Job, reason: Reason) -> None:
        from kvkern.xfer.messages import Cancel  # noqa: PLC0415
        from kvkern.xfer.transport import CONTROL_TAG  # noqa: PLC0415

        entries, job.open_transfers = job.open_transfers, []
        for conn, tid in entries:
            if not conn.alive:
                continue  # an aborted connection tells the source by itself
            job.messages += 1

            async def send(conn: Any = conn, tid: int = tid) -> None:
                with contextlib.suppress(Exception):
                    await conn.send_msg(Cancel(transfer_id=tid, reason=reason.value),
                                        CONTROL_TAG, timeout=_CANCEL_SEND_TIMEOUT_S)

            self._spawn(send())


_METRIC_PHASES = frozenset({"metadata", "plan", "allocate", "transfer", "unpack", "validate",
                            "commit", "total"})
