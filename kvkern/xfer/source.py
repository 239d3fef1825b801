"""The source side of the pull path: serve pinned KV blocks to destinations over UCXX.

A :class:`SourceService` runs on the transfer event loop (:class:`kvkern.xfer.runtime.
EventLoopThread`) of a worker hosting one or more attention-DP groups (:class:`KVGroup`). It
has one HTTP server (state, metrics, health) and one UCXX :class:`Listener` per hosted rank.

Peers
-----
Only fleet members are served (:mod:`kvkern.xfer.auth`): every listener runs the
authentication exchange before it reads a request, and every path under ``/kvkern/`` (the
state document, a worker's block listing) needs a signed request and signs its answer
(``401`` otherwise). Without a credential the service starts no listener and those paths
answer ``503``. Each authenticated peer is held to :class:`PeerQuotas`: admitted sends, and
the share of a rank's pool it (and all peers together) may have pinned; over a quota the
answer is BUSY before anything is pinned. The HTTP server is bounded by
:class:`kvkern.xfer.httpguard.HttpLimits` (head and body read time, body size, connections).

HTTP
----
``GET /kvkern/v1/state`` (``STATE_PATH``), the JSON a destination codes against::

    {"protocol": "kvkern/1",
     "worker_id": "...",
     "incarnation": "<uuid4 hex, new per service start>",
     "hash_scheme": "public-xxh3-v1",          # every group's manager uses it
     "block_size": 16,
     "codec_fingerprint": "<16 hex digits of Codec.fingerprint, zero padded>",
     "model": "<KVGroup.model_id>",            # a destination pulls only from its own model
     "topology": Topology.to_dict(),
     "dp_groups": {"<dp_rank>": {"ranks": {"<rank>": {"ucx_host": "127.0.0.1",
                                                       "ucx_port": 12345,
                                                       "layout": KVLayout.describe(),
                                                       "read": "canonical",
                                                       "read_worker": "<hex>"}}}},
     "capabilities": ["pull/1", "strict", "best_effort", "sharded", "read/1"]}

``read`` (only for a rank registered for remote reads, which also adds ``read/1``):
``"canonical"`` when its blocks are canonical segments (any destination, any plan pieces),
``"native"`` when only a destination of the same layout may read them, whole blocks. With it
``read_worker``: the hex of this process's UCX worker address, which a destination's read
lanes (:mod:`kvkern.xfer.read_lanes`) open extra endpoints to.

Only hosted groups and ranks appear (a worker of one process per GPU publishes one rank per
process). ``GET /metrics`` is the Prometheus exposition of :class:`XferMetrics`; ``GET
/healthz`` is ``{"status": "ok", "worker_id", "incarnation"}`` (503 while closing).

Pull protocol (one rank's listener)
-----------------------------------
The handler of each connection reads control frames on ``CONTROL_TAG`` and serves every
:class:`PullRequest` in its own task, so a :class:`Cancel` for a running transfer is read
while it streams. For one request::

    validate  (no pin yet)        hash_scheme and model == the group's; count <= the pool's
                                  blocks, no hash twice; every piece from this rank
                                  (src_rank), its layer/head ranges inside this rank's local
                                  layout; pieces tile the per-block stream (below); the chunk
                                  count fits the protocol          -> REJECTED "code: detail"
    admit                         active sends < max_concurrent_sends, and the peer's
                                  < its quota -> else BUSY; the peer's pinned share after
                                  this request within PeerQuotas -> else BUSY
    pin       manager.pin(block_hashes[start:start + count], require_all=req.require_all)
              served = the pinned leading run; none -> MISS; fewer than count -> PARTIAL
              (require_all: fewer than count -> MISS, nothing pinned)
    reply     PullReply on tag_for(tid, REPLY): served blocks and hashes, total_bytes,
              n_chunks, chunk_sizes
    stream    chunks on tag_for(tid, DATA, i), packed into a ring of staging buffers
      or read   (request.read, this rank's pool registered; native segments: one whole-block
              piece) the reply carries the whole blocks' segments (read_rkey/base/stride,
              read_segment_bytes, read_more_*, read_native), the pool ids and read_hold_ms;
              the destination reads its pieces one-sided, then ReadDone(ack) on CONTROL_TAG
              -> ReadAck(held) on tag_for(tid, REPLY, 1) when it asks; the pins are held
              until ReadDone or Cancel, and for read_hold_ms from receipt once the reply
              went out, whatever happens (lost connection, close), and no longer
    unpin     exactly once (see below)

Remote reads: with ``remote_read="host"`` (an opt-in; default ``"off"``) ``start()``
registers every host pool
whose blocks are contiguous segments (:attr:`RankKV.read_segments`, else
:attr:`RankKV.native_segments`) with UCX for remote read only
(:class:`kvkern.xfer.ucp_rma.Region`; ``"all"`` also device pools, untested without a GPU;
``"off"`` none) and lists ``read/1`` in the state. The registration lasts until ``close()``,
so a peer holding the key can read any block of that pool while connected, like any
RDMA-registered KV pool (NIXL, Mooncake); it can never write. Keys go to authenticated peers
only, but the transports available without InfiniBand (TCP, CMA) do not bound a key to a
grant, and UCX's TCP transport serves reads in software on the source: opt in only where every
fleet member may read the whole pool (SECURITY.md).

A REJECTED / ERROR reply's ``reason`` is ``"<code>: <detail>"``; codes: ``hash_scheme_mismatch``,
``wrong_rank``, ``bad_piece``, ``too_many_chunks``, ``duplicate_transfer``, ``busy``,
``bad_request``, ``incompatible_model``, ``internal``. By default the source serves the
longest pinned leading run and says PARTIAL.
A strict destination sets ``PullRequest.require_all``: then the source pins with
``require_all=True`` and answers MISS (nothing pinned, nothing sent) unless every requested
block is cached, so a strict miss never needs a :class:`Cancel` that would abort the
connection under other transfers.

Pieces and the byte stream
--------------------------
A :class:`PlanPiece` is one :class:`kvkern.layout.plan.Piece` of the (source rank,
destination rank) pair, in **source-local** coordinates and **per block**::

    layer_start, layer_stop = piece.src_layers      head_start, head_stop = piece.src_heads
    offset = piece.block_offset                     length = piece.block_nbytes
    (length == n_layers * 2 * n_heads * block_size * head_dim * itemsize)

Offsets are per block because the served count ``n`` is known only at the source; pieces
sorted by offset must tile ``[0, sum(length))`` exactly. The stream for ``n`` served blocks is
:func:`kvkern.kernels.sharded.pack_for_peer`'s: piece-major, each piece the canonical staging
``[n, L', 2, H', T, D]`` of the served blocks, at byte ``offset * n``::

    stream   | piece 0: n blocks x length0 | piece 1: n blocks x length1 | ...
    chunks   |  c0  |  c1  |  c2 |  c3   |  c4  | c5 |                           (<= limit)

Chunking: ``limit = min(request.chunk_bytes, service chunk_bytes)``. Chunk boundaries fall on
whole (piece, block range) units: for each piece in offset order, runs of
``max(1, limit // length)`` blocks, one chunk each (the last run of a piece may be shorter;
a chunk never spans two pieces). If one block of a piece is larger than ``limit``, that block
is cut into ``ceil(length / limit)`` byte slices. So chunks are at most ``limit`` bytes but
**not all equal**: the destination sizes its buffers from ``PullReply.chunk_sizes``. Chunk
``k + 1`` is packed (on a small packing thread pool, so the event loop stays free) into a ring
of ``chunks_in_flight`` staging buffers while earlier chunks are on the wire
(:meth:`Connection.send_stream` guarantees the slot is free before reuse). Ring slots come from
a :class:`StagingPool` shared by all sends and go back to it when the send has ended.

Unpin exactly once
------------------
Each admitted request is a task that pins inside its body and releases in ``finally``; a
done-callback releases again as a backstop (release is idempotent, the manager's ``unpin``
is called once). Whatever ends the task — the last chunk sent (for a read, ReadDone
answered), a send failure, the peer
vanishing (``peer_closed``), the deadline (``deadline_ms`` from receipt, 0 = the source cap,
capped by ``max_send_s``), a :class:`Cancel` for its transfer id, or :meth:`close` — the pins
are released once and ``pins_outstanding`` / ``kvkern_source_pinned_blocks`` drop. If a packing
thread is still reading the pool, the release waits for it (bounded).

Broken promises abort: if the task ends after the reply promised chunks but before all were
sent, the connection is aborted (UCX can withdraw posted sends only that way, and the
destination then fails fast with ``peer_closed`` instead of waiting). Other transfers on that
connection fail too; the destination's :class:`ConnectionPool` reconnects. A read reply
promises no chunks: a read that ends early (deadline, Cancel) just releases the pins, and
the destination's ReadDone then gets ``ReadAck(held=False)``, so it commits nothing it read
after the release; the connection keeps serving.

Read holds: a read reply grants ``read_hold_ms`` = ``min(read_hold_s, the request's
deadline)`` counted from receipt of the request; the pins end with it, or at ReadDone, or a
Cancel (a source granting no hold keeps them until ReadDone within the deadline). A
destination whose reads all
completed within that time of *sending* the request commits them without waiting for the
ReadAck (one round trip less: 0.78 -> 0.80-0.90 of raw at 64 MiB). So, unlike a
stream, a read's pins are not released before the hold ends by anything but ReadDone or a
Cancel: a lost connection, a deadline, an internal error or :meth:`close` (which waits for
running holds) keep them until then (:func:`_keep_hold`). ``read_hold_s=0`` grants none: every
read then counts only on ``ReadAck(held=True)``.

A malformed frame aborts its connection (the transport's rule); a well-formed but invalid
request gets a REJECTED reply and the connection keeps serving. Nothing a peer sends stops the
listener or the service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from aiohttp import web

from kvkern.kernels.pack import pack
from kvkern.layout.chunks import ChunkSpec, count_chunks, plan_chunks
from kvkern.layout.segments import piece_nbytes, spans_whole_block
from kvkern.xfer.auth import (
    AUTH_HEADER,
    AUTH_RESPONSE_HEADER,
    FROM_ENV,
    Credential,
    HttpVerifier,
)
from kvkern.xfer.auth import resolve as resolve_credential
from kvkern.xfer.codes import RejectCode, reply_text
from kvkern.xfer.httpguard import GuardedSite, HttpLimits, guard_app, start_guarded
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import (
    DEFAULT_CODEC,
    MAX_CHUNKS,
    READ_CAPABILITY,
    Cancel,
    Codec,
    PlanPiece,
    PullReply,
    PullRequest,
    ReadAck,
    ReadDone,
    Status,
)
from kvkern.xfer.metrics import CONTENT_TYPE_LATEST, XferMetrics
from kvkern.xfer.runtime import spawn
from kvkern.xfer.staging import StagingPool
from kvkern.xfer.state import (
    BLOCKS_PATH,
    CAPABILITIES,
    PEER_PREFIX,
    PROTOCOL,
    STATE_PATH,
    DpGroupDoc,
    RankDoc,
    StateDoc,
)
from kvkern.xfer.transport import (
    CONTROL_TAG,
    Connection,
    Lane,
    Listener,
    TransportError,
    tag_for,
)

__all__ = ["BLOCKS_PATH", "CAPABILITIES", "PEER_PREFIX", "PROTOCOL", "STATE_PATH", "ChunkSpec",
           "PeerQuotas", "SourceService", "StagingPool", "count_chunks", "plan_chunks"]

log = logging.getLogger(__name__)

REMOTE_READ_MODES = ("off", "host", "all")
DEFAULT_MAX_SEND_S = 60.0  # TRT-LLM kv_transfer_timeout_ms (REFERENCE "Defaults")
DEFAULT_PROGRESS_TIMEOUT_S = 10.0
DEFAULT_READ_HOLD_S = 5.0  # read pins are granted this long (capped by the request deadline)
_PACK_WAIT_S = 5.0
_QUOTA_WAIT_S = 0.05  # a request over a pin quota waits this long for the peer's ending sends


@dataclass(frozen=True, kw_only=True)
class PeerQuotas:
    """What one authenticated peer, and all peers together, may hold of a source.

    ``max_sends_per_peer``: admitted requests of one peer at a time. ``peer_pin_fraction``:
    the share of a rank's pool one peer may have pinned; ``total_pin_fraction``: the share
    all peers together may have pinned, so the rest always stays evictable for the source's
    own requests. A request over a quota gets BUSY (``source_busy`` at the destination)
    before anything is pinned."""

    max_sends_per_peer: int = 4
    peer_pin_fraction: float = 0.25
    total_pin_fraction: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.max_sends_per_peer, bool) or not isinstance(
                self.max_sends_per_peer, int) or self.max_sends_per_peer < 1:
            raise ValueError(f"max_sends_per_peer must be a positive int, got "
                             f"{self.max_sends_per_peer!r}")
        for name in ("peer_pin_fraction", "total_pin_fraction"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")


# ------------------------------------------------------------------------------ chunking


def _whole_blocks(rkv: RankKV, pieces: Sequence[PlanPiece]) -> bool:
    """The request moves whole blocks: one piece of every local layer and head."""
    return len(pieces) == 1 and spans_whole_block(rkv.layout, pieces[0].layers,
                                                  pieces[0].heads)


def _direct_rows(rkv: RankKV, pieces: Sequence[PlanPiece]) -> torch.Tensor | None:
    """The pool's byte rows when a chunk of consecutive pinned blocks can be sent straight
    from the pool (:meth:`RankKV.stream_rows` of a CPU pool), else None (packed to staging)."""
    if rkv.device.type != "cpu" or len(pieces) != 1:
        return None
    return rkv.stream_rows(pieces[0].layers, pieces[0].heads, pieces[0].length)


def _worker_address_hex() -> str:
    """This process's ucxx worker address, hex: what a destination's read lanes
    (:mod:`kvkern.xfer.read_lanes`) open their endpoints to. Empty if unavailable."""
    from kvkern.xfer.ucx_env import import_ucxx  # noqa: PLC0415

    try:
        return import_ucxx().core._get_ctx().worker.address.tobytes().hex()
    except Exception as exc:  # noqa: BLE001 (no lanes: destinations read on the connection)
        log.warning("UCX worker address unavailable, no read lanes: %s", exc)
        return ""


async def _keep_hold(s: _Send) -> None:
    """Sleep until ``s``'s granted read hold ends, unless the destination cancels it: no
    deadline, lost connection, close() or repeated cancellation releases a read's pins
    earlier (bounded by the hold, itself capped by the request's deadline)."""
    while s.cancel_reason is None:
        left = s.hold_until - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            continue


class _Rejected(Exception):
    def __init__(self, code: RejectCode, detail: str) -> None:
        super().__init__(reply_text(code, detail))
        self.code = code


# ------------------------------------------------------------------------------ one send


@dataclass(frozen=True)
class _RankCtx:
    group: KVGroup
    rkv: RankKV

    @property
    def rank(self) -> int:
        return self.rkv.rank


class _Send:
    """Bookkeeping of one request being served; owned by its task."""

    __slots__ = ("req", "conn", "ctx", "conn_sends", "deadline", "admitted", "handle",
                 "released", "replied", "completed", "cancel_reason", "task", "pack_cf",
                 "started", "staging", "read_done", "hold_until", "ack_read")

    def __init__(self, req: PullRequest, conn: Connection, ctx: _RankCtx,
                 conn_sends: dict[int, _Send], deadline: float, admitted: bool) -> None:
        self.req = req
        self.conn = conn
        self.ctx = ctx
        self.conn_sends = conn_sends
        self.deadline = deadline
        self.admitted = admitted
        self.handle: Any = None
        self.released = False
        self.replied = False
        self.completed = False
        self.cancel_reason: str | None = None
        self.task: asyncio.Task | None = None
        self.pack_cf: concurrent.futures.Future | None = None
        self.started = time.monotonic()
        self.staging: list[torch.Tensor] = []  # ring slots taken from the StagingPool
        self.read_done: asyncio.Event | None = None  # set by ReadDone (read replies only)
        self.hold_until: float | None = None  # read pins are kept at least until then
        self.ack_read = True  # the destination's ReadDone asked for a ReadAck


# ------------------------------------------------------------------------------- service


class SourceService:
    """Serves the KV of ``groups`` (one :class:`KVGroup` per hosted attention-DP group, all of
    one worker topology) to pulling destinations. See the module docstring.

    Create and use it on one event loop (``await start()`` ... ``await close()``).
    ``ucx_ports`` optionally fixes the listener port of a rank (default: the OS picks).
    ``extra_routes`` (aiohttp ``RouteDef``s) are added to the HTTP app (test admin routes).
    """

    def __init__(
        self,
        groups: Sequence[KVGroup],
        *,
        worker_id: str,
        host: str = "127.0.0.1",
        http_port: int = 0,
        advertise_host: str | None = None,
        chunk_bytes: int = 16 << 20,
        chunks_in_flight: int = 4,
        max_concurrent_sends: int = 8,
        metrics: XferMetrics | None = None,
        extra_routes: Iterable[web.RouteDef] | None = None,
        ucx_ports: Mapping[int, int] | None = None,
        codec: Codec = DEFAULT_CODEC,
        max_send_s: float = DEFAULT_MAX_SEND_S,
        progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S,
        pack_threads: int = 2,
        staging_cache_bytes: int = 256 << 20,
        remote_read: str = "off",
        read_hold_s: float = DEFAULT_READ_HOLD_S,
        credential: Credential | str | None = FROM_ENV,
        quotas: PeerQuotas | None = None,
        http_limits: HttpLimits | None = None,
    ) -> None:
        if not groups:
            raise ValueError("SourceService needs at least one KVGroup")
        topo = groups[0].topology
        seen: set[int] = set()
        for g in groups:
            if g.topology != topo:
                raise ValueError(f"DP group {g.dp_rank} has topology {g.topology.to_dict()}, "
                                 f"group {groups[0].dp_rank} {topo.to_dict()}")
            if g.dp_rank in seen:
                raise ValueError(f"DP group {g.dp_rank} given twice")
            seen.add(g.dp_rank)
            if g.model_id != groups[0].model_id:
                raise ValueError(f"DP group {g.dp_rank} holds model {g.model_id!r}, group "
                                 f"{groups[0].dp_rank} {groups[0].model_id!r}")
            if g.hash_scheme != groups[0].hash_scheme:
                raise ValueError(f"DP group {g.dp_rank} uses hash scheme {g.hash_scheme!r}, "
                                 f"group {groups[0].dp_rank} {groups[0].hash_scheme!r}")
        for name, value in (("chunk_bytes", chunk_bytes), ("chunks_in_flight", chunks_in_flight),
                            ("max_concurrent_sends", max_concurrent_sends),
                            ("pack_threads", pack_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if remote_read not in REMOTE_READ_MODES:
            raise ValueError(f"remote_read must be one of {REMOTE_READ_MODES}, got "
                             f"{remote_read!r}")
        if isinstance(staging_cache_bytes, bool) or not isinstance(staging_cache_bytes, int) \
                or staging_cache_bytes < 0:
            raise ValueError(f"staging_cache_bytes must be an int >= 0, got "
                             f"{staging_cache_bytes!r}")
        if not (isinstance(read_hold_s, (int, float)) and math.isfinite(read_hold_s)
                and 0 <= read_hold_s <= max_send_s):
            raise ValueError(f"read_hold_s must be a finite number in [0, max_send_s], got "
                             f"{read_hold_s!r}")
        for name, value in (("max_send_s", max_send_s),
                            ("progress_timeout_s", progress_timeout_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        credential = resolve_credential(credential, peer_id=worker_id)
        # Without the fleet credential nothing is served to peers (fail closed): no
        # listeners, and the peer HTTP endpoints answer 503.
        self.credential = credential
        self.quotas = quotas if quotas is not None else PeerQuotas()
        self.model_id = groups[0].model_id
        self._http_auth = HttpVerifier(credential) if credential is not None else None
        self._peer_sends: dict[str, int] = {}  # authenticated peer -> admitted sends
        self._peer_pins: dict[str, int] = {}  # authenticated peer -> blocks it has pinned
        self.auth_refusals = 0  # HTTP requests refused for missing or bad credentials
        self.groups = tuple(sorted(groups, key=lambda g: g.dp_rank))
        self.topology = topo
        self.worker_id = worker_id
        self.host = host
        self.advertise_host = advertise_host or host
        if self.advertise_host in ("0.0.0.0", "::", "", "[::]"):
            raise ValueError(f"host {host!r} binds every interface; pass the address peers "
                             f"should dial as advertise_host (got {advertise_host!r})")
        self.chunk_bytes = chunk_bytes
        self.chunks_in_flight = chunks_in_flight
        self.max_concurrent_sends = max_concurrent_sends
        self.metrics = metrics if metrics is not None else XferMetrics()
        self.codec = codec
        self.max_send_s = float(max_send_s)
        self.progress_timeout_s = float(progress_timeout_s)
        self.incarnation = uuid.uuid4().hex
        self._http_port_req = http_port
        self._extra_routes = list(extra_routes or ())
        self._ucx_ports = dict(ucx_ports or {})
        self._pack_threads = pack_threads
        self._staging = StagingPool(staging_cache_bytes)
        self.remote_read = remote_read
        self.read_hold_s = float(read_hold_s)
        # rank -> its pool's BlockSegments, one ucp_rma.Region per segment, and whether the
        # segments are in the pool's own order rather than canonical (read path)
        self._regions: dict[int, tuple[Any, list[Any], bool]] = {}
        self._read_worker = ""  # hex of this process's UCX worker address (read lanes)
        self._ctx: dict[int, _RankCtx] = {
            r: _RankCtx(g, rkv) for g in self.groups for r, rkv in g.ranks.items()}
        self._listeners: dict[int, Listener] = {}
        self._runner: web.AppRunner | None = None
        self._site: GuardedSite | None = None
        self.http_limits = http_limits or HttpLimits()
        self._http_port: int | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._sends: set[_Send] = set()  # every request task not finished yet
        self._bg: set[asyncio.Task] = set()  # fire-and-forget replies
        self._active = 0  # admitted sends (count toward max_concurrent_sends)
        self._pins = 0  # pin handles held
        self._pinned_blocks = 0
        self._started = False
        self._closing = False

    # ----------------------------------------------------------------------- properties

    @property
    def http_port(self) -> int:
        if self._http_port is None:
            raise RuntimeError("source service not started")
        return self._http_port

    @property
    def ucx_ports(self) -> dict[int, int]:
        """rank -> listener port of every hosted rank."""
        return {r: lst.port for r, lst in self._listeners.items()}

    @property
    def active_sends(self) -> int:
        """Admitted requests not finished (pinning, replying or streaming)."""
        return self._active

    @property
    def pins_outstanding(self) -> int:
        """Pin handles held by running sends (0 once every send has ended)."""
        return self._pins

    @property
    def pinned_blocks(self) -> int:
        return self._pinned_blocks

    @property
    def listeners_open(self) -> int:
        return len(self._listeners)

    @property
    def hash_scheme(self) -> str:
        return self.groups[0].hash_scheme

    def state(self) -> dict:
        """The state document (see the module docstring and :mod:`kvkern.xfer.state`)."""
        return msgspec.to_builtins(self.state_doc())

    def state_doc(self) -> StateDoc:
        dp_groups: dict[str, DpGroupDoc] = {}
        for g in self.groups:
            ranks = {}
            for r, rkv in g.ranks.items():
                lst = self._listeners.get(r)
                doc = RankDoc(ucx_host=self.advertise_host,
                              ucx_port=lst.port if lst is not None else None,
                              layout=rkv.layout.describe())
                if r in self._regions:  # how its blocks can be read, and by which worker
                    doc.read = "native" if self._regions[r][2] else "canonical"
                    if self._read_worker:
                        doc.read_worker = self._read_worker
                ranks[str(r)] = doc
            dp_groups[str(g.dp_rank)] = DpGroupDoc(ranks=ranks)
        return StateDoc(
            protocol=PROTOCOL,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            hash_scheme=self.hash_scheme,
            block_size=self.topology.model.block_size,
            codec_fingerprint=f"{self.codec.fingerprint:016x}",
            model=self.model_id,
            topology=self.topology.to_dict(),
            dp_groups=dp_groups,
            capabilities=list(CAPABILITIES) + ([READ_CAPABILITY] if self._regions else []),
        )

    # -------------------------------------------------------------------- start / close

    async def start(self) -> SourceService:
        if self._started:
            raise RuntimeError("source service already started")
        self._started = True
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self._pack_threads, thread_name_prefix="kvkern-pack")
        try:
            for device in {ctx.rkv.device for ctx in self._ctx.values()}:
                self._staging.prewarm(device, self.chunk_bytes, self.chunks_in_flight)
            if self.credential is not None:  # no credential: peers are not served at all
                self._register_pools()
                for rank, ctx in self._ctx.items():
                    lst = Listener(self._handler_for(ctx), host=self.advertise_host,
                                   port=self._ucx_ports.get(rank, 0), codec=self.codec,
                                   credential=self.credential)
                    await asyncio.wait_for(lst.start(), 10.0)
                    self._listeners[rank] = lst
            else:
                log.warning("source %s has no fleet credential (%s): serving no peers",
                            self.worker_id, "KVKERN_FLEET_SECRET_FILE / KVKERN_FLEET_SECRET")
            app = guard_app(web.Application(middlewares=[self._peer_auth]), self.http_limits)
            app.router.add_get(STATE_PATH, self._http_state)
            app.router.add_get("/metrics", self._http_metrics)
            app.router.add_get("/healthz", self._http_health)
            app.router.add_routes(self._extra_routes)
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await asyncio.wait_for(self._runner.setup(), 10.0)
            self._site = await asyncio.wait_for(start_guarded(
                self._runner, self.host, self._http_port_req, self.http_limits), 10.0)
            self._http_port = int(self._runner.addresses[0][1])
        except BaseException:
            await self.close()
            raise
        log.info("source %s (incarnation %s) serving HTTP on %s:%s, UCX ranks %s",
                 self.worker_id, self.incarnation, self.host, self._http_port, self.ucx_ports)
        return self

    async def close(self, timeout: float = 10.0) -> None:
        """Stop HTTP and listeners, cancel every send (releasing its pins) and wait for them,
        bounded by ``timeout``. Idempotent."""
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + timeout
        runner, self._runner = self._runner, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.cleanup(), max(deadline - time.monotonic(), 0.1))
        listeners, self._listeners = list(self._listeners.values()), {}
        for lst in listeners:
            with contextlib.suppress(Exception):
                await lst.close(timeout=max(deadline - time.monotonic(), 0.1))
        sends = list(self._sends)
        for s in sends:
            if s.task is not None:
                s.task.cancel()
        tasks = [s.task for s in sends if s.task is not None]
        # a granted read hold outlasts close(): the destination may still be reading
        held = [s.hold_until for s in sends if s.hold_until is not None and not s.completed]
        deadline = max([deadline, *(h + 0.1 for h in held)])
        if tasks:
            await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.1))
        for t in list(self._bg):  # ReadAck(held=False) replies on aborted connections
            t.cancel()
        for s in list(self._sends):  # a task that did not finish in time: release anyway
            log.warning("send of transfer %d still running at close; releasing its pins",
                        s.req.transfer_id)
            self._release(s)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._staging.clear()
        regions, self._regions = list(self._regions.values()), {}
        for _, rank_regions, _ in regions:  # every connection is aborted: nobody reads now
            for region in rank_regions:
                region.close()

    def _register_pools(self) -> None:
        """Register each rank's pool for remote reads where ``remote_read`` allows it: by
        canonical segments (:attr:`RankKV.read_segments`: block rows, or each layer of a
        per-layer HND pool; any destination and plan pieces), else by the pool's own
        segments (:attr:`RankKV.native_segments`: destinations of the same layout, whole
        blocks). A rank with neither is served by the stream (logged, not an error)."""
        if self.remote_read == "off":
            return
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        why = ucp_rma.rma_unavailable()
        if why is not None:
            log.warning("remote reads unavailable, streaming only: %s", why)
            return
        for rank, ctx in self._ctx.items():
            rkv = ctx.rkv
            if rkv.device.type != "cpu" and self.remote_read != "all":
                continue
            segs, native = rkv.read_segments, False
            if segs is None:  # same-layout destinations may still read it, block for block
                segs, native = rkv.native_segments, True
            if segs is None:
                continue
            mem = "host" if rkv.device.type == "cpu" else "cuda"
            made: dict[tuple[int, int], Any] = {}  # one region per span (K/V planes share)
            try:
                for span in segs.spans:
                    if span not in made:
                        made[span] = ucp_rma.Region(*span, memory_type=mem)
            except (ucp_rma.RmaError, ValueError) as exc:
                log.warning("rank %d pool not registered for remote reads: %s", rank, exc)
                for region in made.values():
                    region.close()
                continue
            regions = [made[span] for span in segs.spans]
            self._regions[rank] = (segs, regions, native)
        if self._regions:
            self._read_worker = _worker_address_hex()

    async def __aenter__(self) -> SourceService:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -------------------------------------------------------------------------- HTTP

    @web.middleware
    async def _peer_auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Paths under :data:`PEER_PREFIX` answer fleet members only (``X-Kvkern-Auth``, see
        :mod:`kvkern.xfer.auth`), and their answers are signed. Everything else passes."""
        if not request.path.startswith(PEER_PREFIX):
            return await handler(request)
        if self._http_auth is None:
            return web.json_response({"error": "this worker serves no peers (no fleet "
                                      "credential)"}, status=503)
        verdict = self._http_auth.check(request.method, request.raw_path,
                                        request.headers.get(AUTH_HEADER))
        if not verdict.ok:
            self.auth_refusals += 1
            log.warning("refused %s %s from %s: %s", request.method, request.path,
                        request.remote, verdict.why)
            return web.json_response({"error": "unauthorized"}, status=401)
        resp = await handler(request)
        body = resp.body if isinstance(resp, web.Response) else None
        if isinstance(body, (bytes, bytearray)):
            resp.headers[AUTH_RESPONSE_HEADER] = self._http_auth.credential.response_mac(
                verdict.nonce, bytes(body))
        return resp

    async def _http_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def _http_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _http_health(self, request: web.Request) -> web.Response:
        status = "closing" if self._closing else "ok"
        return web.json_response({"status": status, "worker_id": self.worker_id,
                                  "incarnation": self.incarnation},
                                 status=503 if self._closing else 200)

    # ----------------------------------------------------------------------- listener

    def _handler_for(self, ctx: _RankCtx):
        async def handler(conn: Connection) -> None:
            await self._serve_connection(conn, ctx)
        return handler

    async def _serve_connection(self, conn: Connection, ctx: _RankCtx) -> None:
        conn_sends: dict[int, _Send] = {}
        try:
            while True:
                msg = await conn.recv_msg(CONTROL_TAG, timeout=None)
                if isinstance(msg, Cancel):
                    s = conn_sends.get(msg.transfer_id)
                    if s is not None and s.task is not None and not s.task.done():
                        s.cancel_reason = msg.reason or "cancelled"
                        s.task.cancel()
                elif isinstance(msg, PullRequest):
                    self._accept(conn, ctx, conn_sends, msg)
                    # Let the request's task check, pin and post its reply before this loop
                    # re-arms the receive (measured: its first step came ~55 us sooner).
                    await asyncio.sleep(0)
                elif isinstance(msg, ReadDone):
                    s = conn_sends.get(msg.transfer_id)
                    if s is not None and s.read_done is not None:
                        s.ack_read = msg.ack
                        if not s.read_done.is_set():
                            s.completed = True  # every read is done: the pins may go now,
                            self._release(s)  # before the next request counts this quota
                        s.read_done.set()
                    elif msg.ack:  # nothing pinned for it (any more): say so, not silence
                        self._ack_unknown(conn, msg.transfer_id)
                else:  # a PullReply has no business on the control tag
                    log.debug("ignoring %s on the control tag of rank %d",
                              type(msg).__name__, ctx.rank)
        except TransportError as exc:
            log.debug("rank %d connection ended: %s", ctx.rank, exc)
        finally:
            for s in list(conn_sends.values()):
                if s.task is not None:
                    s.task.cancel()

    def _ack_unknown(self, conn: Connection, tid: int) -> None:
        async def send() -> None:
            with contextlib.suppress(TransportError):
                await conn.send_msg(ReadAck(transfer_id=tid, held=False,
                                            reason="no read of this transfer is pinned"),
                                    tag_for(tid, Lane.REPLY, 1), timeout=5.0)

        spawn(self._bg, send())

    def _accept(self, conn: Connection, ctx: _RankCtx, conn_sends: dict[int, _Send],
                req: PullRequest) -> None:
        """Synchronous admission (no await between the check and the count)."""
        now = time.monotonic()
        budget = req.deadline_ms / 1000 if req.deadline_ms else self.max_send_s
        deadline = now + min(budget, self.max_send_s)
        duplicate = req.transfer_id in conn_sends
        peer = conn.peer_id or ""
        admitted = (not duplicate and not self._closing
                    and self._active < self.max_concurrent_sends
                    and self._peer_sends.get(peer, 0) < self.quotas.max_sends_per_peer)
        s = _Send(req, conn, ctx, conn_sends, deadline, admitted)
        if admitted:
            self._active += 1
            self._peer_sends[peer] = self._peer_sends.get(peer, 0) + 1
            self.metrics.source_send_started()
        if not duplicate:
            conn_sends[req.transfer_id] = s
        self._sends.add(s)
        s.task = asyncio.ensure_future(self._serve(s, duplicate=duplicate))
        s.task.add_done_callback(lambda t, s=s: self._finished(s, t))

    def _finished(self, s: _Send, task: asyncio.Task) -> None:
        self._release(s)  # backstop; normally done in _serve's finally
        self._sends.discard(s)
        if s.conn_sends.get(s.req.transfer_id) is s:
            del s.conn_sends[s.req.transfer_id]
        if s.admitted:
            s.admitted = False
            self._active -= 1
            peer = s.conn.peer_id or ""
            left = self._peer_sends.get(peer, 1) - 1
            if left > 0:
                self._peer_sends[peer] = left
            else:
                self._peer_sends.pop(peer, None)
            self.metrics.source_send_ended(time.monotonic() - s.started)
        if not task.cancelled() and task.exception() is not None:
            log.error("send of transfer %d failed unexpectedly", s.req.transfer_id,
                      exc_info=task.exception())

    def _release(self, s: _Send) -> None:
        """Unpin ``s``'s blocks if pinned; idempotent (the manager is called once)."""
        if s.released or s.handle is None:
            s.released = True
            return
        s.released = True
        handle, s.handle = s.handle, None
        n = len(handle.block_ids)
        self._pins -= 1
        self._pinned_blocks -= n
        key = (s.conn.peer_id or "", s.ctx.rank)
        left = self._peer_pins.get(key, n) - n
        if left > 0:
            self._peer_pins[key] = left
        else:
            self._peer_pins.pop(key, None)
        self.metrics.source_pins_changed(-n)
        try:
            s.ctx.group.manager.unpin(handle)
        except Exception:  # noqa: BLE001 (a manager bug must not take the service down)
            log.exception("unpin of pin %s for transfer %d failed", handle.pin_id,
                          s.req.transfer_id)

    # ------------------------------------------------------------------------ serving

    async def _reply(self, s: _Send, reply: PullReply) -> None:
        self.metrics.source_request(reply.status.value)
        timeout = max(s.deadline - time.monotonic(), 0.001)
        await s.conn.send_msg(reply, tag_for(s.req.transfer_id, Lane.REPLY), timeout=timeout)
        s.replied = True

    async def _reply_status(self, s: _Send, status: Status, reason: str) -> None:
        await self._reply(s, PullReply(transfer_id=s.req.transfer_id, status=status,
                                       reason=reason))

    async def _serve(self, s: _Send, *, duplicate: bool) -> None:
        req = s.req
        try:
            if duplicate:
                await self._reply_status(s, Status.REJECTED, reply_text(
                    RejectCode.DUPLICATE_TRANSFER, f"transfer id {req.transfer_id} is already being "
                    "served on this connection"))
                return
            if not s.admitted:
                await self._reply_status(s, Status.BUSY, reply_text(
                    RejectCode.BUSY, f"{self._active} sends in flight (limit "
                    f"{self.max_concurrent_sends}, {self.quotas.max_sends_per_peer} per peer)"))
                return
            try:
                pieces = self._validate(s.ctx, req)
            except _Rejected as rej:
                log.info("rejected transfer %d on rank %d: %s", req.transfer_id, s.ctx.rank,
                         rej)
                await self._reply_status(s, Status.REJECTED, str(rej))
                return
            remaining = s.deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            async with asyncio.timeout(remaining):  # no extra task: one loop hop less
                await self._pin_and_send(s, pieces)
        except asyncio.TimeoutError:
            self._failed(s, "deadline")
        except asyncio.CancelledError:
            if s.cancel_reason is None:
                self._failed(s, "closed")
                raise
            self._failed(s, "cancelled")
        except TransportError as exc:
            self._failed(s, exc.reason)
        except Exception as exc:
            log.exception("serving transfer %d on rank %d failed", req.transfer_id,
                          s.ctx.rank)
            self._failed(s, "internal")
            if not s.replied and s.conn.alive:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._reply_status(s, Status.ERROR, reply_text(
                        RejectCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            cf = s.pack_cf
            if cf is not None and not cf.done():  # the pool is still being read
                with contextlib.suppress(BaseException):
                    await asyncio.wait({asyncio.wrap_future(cf)}, timeout=_PACK_WAIT_S)
            if s.hold_until is not None and not s.completed:
                await _keep_hold(s)  # a destination may commit what it reads until then
            self._release(s)
            # Every posted send has completed or its endpoint was aborted (the transport's
            # rule), so UCX holds none of the slots; a pack still running keeps them.
            if (cf is None or cf.done()) and not self._closing:
                self._staging.give(s.staging)
            s.staging = []

    def _failed(self, s: _Send, reason: str) -> None:
        """A send that will not complete: count it; if a reply promised chunks that will not
        all arrive, abort the connection (see the module docstring)."""
        if s.handle is not None or s.replied:
            self.metrics.source_send_failed(reason)
        if s.replied and not s.completed and s.handle is not None and s.read_done is None:
            s.conn.abort(f"send_{reason}")  # chunks promised: only an abort withdraws them
        log.info("transfer %d on rank %d ended without completing: %s", s.req.transfer_id,
                 s.ctx.rank, reason)

    def _validate(self, ctx: _RankCtx, req: PullRequest) -> list[PlanPiece]:
        """Pieces sorted by offset, or :class:`_Rejected`."""
        scheme = ctx.group.hash_scheme
        if req.hash_scheme != scheme:
            raise _Rejected(RejectCode.HASH_SCHEME_MISMATCH, f"request scheme {req.hash_scheme!r} != "
                            f"source scheme {scheme!r}")
        if req.model != self.model_id:
            raise _Rejected(RejectCode.INCOMPATIBLE_MODEL, f"request model {req.model!r} != source "
                            f"model {self.model_id!r}")
        layout = ctx.rkv.layout
        if req.count > layout.num_blocks:
            raise _Rejected(RejectCode.BAD_REQUEST, f"{req.count} blocks requested, rank {ctx.rank}'s "
                            f"pool holds {layout.num_blocks}")
        wanted = req.requested_hashes
        if len(set(wanted)) != len(wanted):
            raise _Rejected(RejectCode.BAD_REQUEST, "a block hash is requested more than once")
        pieces = sorted(req.pieces, key=lambda p: p.offset)
        end = 0
        for p in pieces:
            if p.src_rank != ctx.rank:
                raise _Rejected(RejectCode.WRONG_RANK, f"piece for source rank {p.src_rank} sent to the "
                                f"listener of rank {ctx.rank}")
            if p.layer_stop > layout.num_layers:
                raise _Rejected(RejectCode.BAD_PIECE, f"layers [{p.layer_start},{p.layer_stop}) outside "
                                f"rank {ctx.rank}'s local [0,{layout.num_layers})")
            if p.head_stop > layout.num_heads:
                raise _Rejected(RejectCode.BAD_PIECE, f"heads [{p.head_start},{p.head_stop}) outside "
                                f"rank {ctx.rank}'s local [0,{layout.num_heads})")
            want = piece_nbytes(layout, p.layers, p.heads)
            if p.length != want:
                raise _Rejected(RejectCode.BAD_PIECE, f"piece length {p.length} != {want} bytes per "
                                f"block for layers [{p.layer_start},{p.layer_stop}) x heads "
                                f"[{p.head_start},{p.head_stop})")
            if p.offset != end:
                raise _Rejected(RejectCode.BAD_PIECE, f"piece at per-block offset {p.offset}, expected "
                                f"{end} (pieces must tile the per-block stream from 0)")
            end += p.length
        limit = min(req.chunk_bytes, self.chunk_bytes)
        n = count_chunks([p.length for p in pieces], req.count, limit)
        if n > MAX_CHUNKS:
            raise _Rejected(RejectCode.TOO_MANY_CHUNKS, f"{req.count} blocks in chunks of <= {limit} B "
                            f"make {n} chunks, the protocol allows {MAX_CHUNKS}")
        return pieces

    async def _pin_and_send(self, s: _Send, pieces: list[PlanPiece]) -> None:
        req, ctx = s.req, s.ctx
        busy = self._over_pin_quota(s)
        waited = 0.0
        while busy is not None and waited < _QUOTA_WAIT_S:  # a send of the peer finishing
            await asyncio.sleep(0.002)
            waited += 0.002
            busy = self._over_pin_quota(s)
        if busy is not None:
            await self._reply_status(s, Status.BUSY, reply_text(RejectCode.BUSY, busy))
            return
        handle = ctx.group.manager.pin(req.requested_hashes, require_all=req.require_all)
        if handle is not None:
            s.handle = handle
            self._pins += 1
            self._pinned_blocks += len(handle.block_ids)
            key = (s.conn.peer_id or "", ctx.rank)
            self._peer_pins[key] = self._peer_pins.get(key, 0) + len(handle.block_ids)
            self.metrics.source_pins_changed(len(handle.block_ids))
        if handle is None:
            if req.require_all:  # how many there are, for the destination's log line
                have = ctx.group.manager.longest_prefix(req.requested_hashes)
                detail = f"{have} of {req.count} requested blocks cached (require_all)"
            else:
                detail = f"none of the {req.count} requested blocks is cached"
            await self._reply_status(s, Status.MISS, reply_text(RejectCode.MISS, detail))
            return
        block_ids = list(handle.block_ids)
        n = len(block_ids)
        if max(block_ids) >= ctx.rkv.layout.num_blocks:
            raise RuntimeError(f"manager pinned block {max(block_ids)}, rank {ctx.rank}'s pool "
                               f"has {ctx.rkv.layout.num_blocks} blocks")
        registered = self._regions.get(ctx.rank) if req.read else None
        if registered is not None and (not registered[2] or _whole_blocks(ctx.rkv, pieces)):
            # the destination reads the pieces it asked for (native segments: whole blocks)
            await self._serve_read(s, *registered, pieces, block_ids, handle.hashes)
            return
        limit = min(req.chunk_bytes, self.chunk_bytes)
        lengths = [p.length for p in pieces]
        chunks = plan_chunks(lengths, n, limit)
        sizes = [c.nbytes for c in chunks]
        reply = PullReply(transfer_id=req.transfer_id,
                          status=Status.OK if n == req.count else Status.PARTIAL,
                          served_blocks=n, block_hashes=list(handle.hashes),
                          total_bytes=sum(sizes), n_chunks=len(chunks), chunk_sizes=sizes,
                          reason="" if n == req.count else reply_text(
                              RejectCode.PARTIAL, f"{n} of {req.count} requested blocks cached"))
        await self._reply(s, reply)
        await self._after_reply(req, reply)
        produce = self._producer(s, pieces, block_ids, chunks)
        ring = min(self.chunks_in_flight, len(chunks))
        remaining = max(s.deadline - time.monotonic(), 0.001)
        sent = await s.conn.send_stream(req.transfer_id, produce, len(chunks),
                                        timeout=min(self.progress_timeout_s, remaining),
                                        max_in_flight=ring)
        s.completed = True
        self.metrics.source_served(n, sent)

    def _over_pin_quota(self, s: _Send) -> str | None:
        """Why pinning ``s``'s blocks would exceed a :class:`PeerQuotas` share, or None.
        Counts the request's whole ``count`` (the served run can only be shorter)."""
        rank, peer, want = s.ctx.rank, s.conn.peer_id or "", s.req.count
        pool = s.ctx.rkv.layout.num_blocks
        mine = self._peer_pins.get((peer, rank), 0)
        if mine + want > self.quotas.peer_pin_fraction * pool:
            return (f"peer quota: {mine} blocks pinned + {want} requested > "
                    f"{self.quotas.peer_pin_fraction:g} of the {pool}-block pool")
        total = sum(n for (_, r), n in self._peer_pins.items() if r == rank)
        if total + want > self.quotas.total_pin_fraction * pool:
            return (f"pin quota: {total} blocks pinned by peers + {want} requested > "
                    f"{self.quotas.total_pin_fraction:g} of the {pool}-block pool")
        return None

    async def _serve_read(self, s: _Send, segs: Any, regions: list[Any], native: bool,
                          pieces: list[PlanPiece], block_ids: list[int],
                          hashes: Sequence[int]) -> None:
        """Reply with where the pinned blocks are (the whole blocks' segments) and how long
        they stay pinned (``read_hold_ms``); the destination reads the bytes of ``pieces``
        out of them one-sided (``total_bytes``). The pins stay until its
        ReadDone (answered with ReadAck held=True when it asks) or Cancel, and whatever else
        ends this task first, at least until the hold ends (see :func:`_keep_hold`)."""
        req, n = s.req, len(block_ids)
        block_nbytes = sum(p.length for p in pieces)  # what the destination will read
        s.read_done = asyncio.Event()
        # The hold counts from receipt (s.started): the destination counts it from before
        # it sent the request, so its window always ends first.
        hold_s = max(min(self.read_hold_s, s.deadline - s.started), 0.0)
        reply = PullReply(transfer_id=req.transfer_id,
                          status=Status.OK if n == req.count else Status.PARTIAL,
                          served_blocks=n, block_hashes=list(hashes),
                          total_bytes=n * block_nbytes, read_rkey=regions[0].rkey,
                          read_base=segs.bases[0], read_stride=segs.stride,
                          read_blocks=block_ids, read_hold_ms=int(hold_s * 1000),
                          read_segment_bytes=segs.nbytes,
                          read_more_rkeys=[r.rkey for r in regions[1:]],
                          read_more_bases=list(segs.bases[1:]), read_native=native,
                          reason="" if n == req.count else reply_text(
                              RejectCode.PARTIAL, f"{n} of {req.count} requested blocks cached"))
        await self._before_read_reply(req.transfer_id)
        s.hold_until = s.started + hold_s  # from here on the destination may be reading
        await self._reply(s, reply)
        await self._after_reply(req, reply)
        # The pins last as long as the reply says and no longer; a source that grants no
        # hold (read_hold_s=0) keeps them until ReadDone within the request's deadline.
        until = s.hold_until if hold_s > 0 else s.deadline
        try:
            await asyncio.wait_for(s.read_done.wait(), max(until - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            log.info("read hold of transfer %d on rank %d ended without ReadDone "
                     "(%.0f ms granted); releasing its pins", req.transfer_id, s.ctx.rank,
                     hold_s * 1000)
            self.metrics.source_send_failed("hold_expired")
            return
        await self._before_chunk(req.transfer_id, 0)
        if s.ack_read:
            remaining = max(s.deadline - time.monotonic(), 0.001)
            await s.conn.send_msg(ReadAck(transfer_id=req.transfer_id, held=True),
                                  tag_for(req.transfer_id, Lane.REPLY, 1), timeout=remaining)
        s.completed = True
        self.metrics.source_served(n, n * block_nbytes)

    def _producer(self, s: _Send, pieces: list[PlanPiece], block_ids: list[int],
                  chunks: list[ChunkSpec]):
        """``produce(i)`` for send_stream: packs chunk ``i`` into ring slot ``i % ring``."""
        rkv = s.ctx.rkv
        layout = rkv.layout
        device = rkv.device
        ring = min(self.chunks_in_flight, len(chunks))
        # one size class for every send, so the prewarmed slots serve small pulls too
        slot_bytes = max(max(c.nbytes for c in chunks), self.chunk_bytes)
        slots: list[torch.Tensor | None] = [None] * ring  # taken from the pool on first use
        big: dict[str, Any] = {"key": None, "buf": None}  # one oversized block, sliced
        loop = asyncio.get_running_loop()
        tid = s.req.transfer_id

        def pack_slab(p: PlanPiece, b0: int, b1: int, out: torch.Tensor | None) -> torch.Tensor:
            shape = (b1 - b0, p.layer_stop - p.layer_start, 2, p.head_stop - p.head_start,
                     layout.block_size, layout.head_dim)
            view = None if out is None else out.view(layout.dtype).view(shape)
            staged = pack(rkv.pool, layout, block_ids[b0:b1], out=view,
                          layers=(p.layer_start, p.layer_stop),
                          heads=(p.head_start, p.head_stop))
            if staged.is_cuda:  # UCX reads the memory as soon as the send is posted
                torch.cuda.current_stream(staged.device).synchronize()
            return staged.reshape(-1).view(torch.uint8)

        async def run(fn, *args):
            if self._executor is None:
                raise TransportError("closed", "source service closed")
            s.pack_cf = self._executor.submit(fn, *args)
            return await asyncio.wrap_future(s.pack_cf, loop=loop)

        rows = _direct_rows(rkv, pieces)

        async def produce(i: int) -> torch.Tensor:
            await self._before_chunk(tid, i)
            c = chunks[i]
            p = pieces[c.piece]
            if rows is not None:
                first = block_ids[c.b0]
                if block_ids[c.b0:c.b1] == list(range(first, first + c.b1 - c.b0)):
                    # zero-copy: the pinned blocks are the chunk (no pack, no staging)
                    return rows[first:first + c.b1 - c.b0].reshape(-1)[c.lo:c.hi]
            if c.lo == 0 and c.hi == (c.b1 - c.b0) * p.length:
                k = i % ring
                if slots[k] is None:
                    slots[k] = self._staging.take(device, slot_bytes)
                    s.staging.append(slots[k])
                return await run(pack_slab, p, c.b0, c.b1, slots[k][:c.nbytes])
            key = (c.piece, c.b0)
            if big["key"] != key:  # a new oversized block: pack it whole into a fresh buffer
                big["buf"] = await run(pack_slab, p, c.b0, c.b1, None)
                big["key"] = key
            return big["buf"][c.lo:c.hi]

        return produce

    # ------------------------------------------------------------- hooks (fault tests)

    async def _after_reply(self, req: PullRequest, reply: PullReply) -> None:
        """Called after a data-carrying reply was sent, before the first chunk. No-op; test
        peers override it to freeze a send."""

    async def _before_chunk(self, transfer_id: int, index: int) -> None:
        """Called before chunk ``index`` is packed, and for a read before it is confirmed
        (index 0). No-op; test peers override it to slow a send down."""

    async def _before_read_reply(self, transfer_id: int) -> None:
        """Called when a read's blocks are pinned, before the reply that offers them.
        No-op; test peers override it to hold a read pull at the source."""
