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
answer is BUSY before anything is pinned. Its open connections are capped too (one over the
cap is closed before it is served), and a connection with nothing open and no message for
``SourceConfig.idle_connection_s`` is closed. The HTTP server is bounded by
:class:`kvkern.xfer.httpguard.HttpLimits` (head and body read time, body size, connections).

HTTP
----
``GET /kvkern/v1/state`` (``STATE_PATH``), the JSON a destination codes against::

    {"protocol": "kvkern/1",
     "worker_id": "...",
     "incarnation": "<uuid4 hex, new per service start>",
     "hash_scheme": "kvkern-blake2b-v1",       # every group's manager uses it
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
``read_worker``: the hex of the worker address of this process's read target
(:func:`kvkern.xfer.ucxcompat.read_target`: the context its pools are registered in, with no
TCP), which a destination's read lanes (:mod:`kvkern.xfer.read_lanes`) open endpoints to.

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

Chunking: ``limit = min(request.chunk_bytes, service chunk_bytes)``; a request whose
``chunk_bytes`` is below ``min_chunk_bytes`` (64 KiB, or one block's bytes where smaller) is
refused (``too_many_chunks``), as each chunk costs a message. Chunk boundaries fall on
whole (piece, block range) units: for each piece in offset order, runs of
``max(1, limit // length)`` blocks, one chunk each (the last run of a piece may be shorter;
a chunk never spans two pieces). A request's ``chunk_blocks`` (one piece only) replaces the
runs by the destination's plan, each planned chunk cut again to ``limit``. If one block of a
piece is larger than ``limit``, that block is cut into ``ceil(length / limit)`` byte slices.
A stream of whole pool blocks (:meth:`RankKV.stream_rows`) sends each run of consecutive
pinned blocks of at least ``STREAM_MIN_RUN_BYTES`` straight from the pool (a device pool's
once the fence after the engine's kernels has fired), in chunks of its own of up to
``request.chunk_bytes`` (no staging holds them); only the packed
chunks keep to ``limit`` (:func:`kvkern.layout.chunks.send_chunks`). So chunks are **not all
equal**: the destination sizes its buffers from ``StreamReply.chunk_sizes``. Chunk ``k + 1``
is packed (on a small packing thread pool, so the event loop stays free) into a ring of
``chunks_in_flight`` staging buffers while earlier chunks are on the wire
(:meth:`Connection.send_stream` guarantees the slot is free before reuse). Ring slots come
from a :class:`StagingPool` shared by all sends and go back to it when the send has ended.

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
running holds) keep them until then (:func:`kvkern.xfer.send.keep_hold`). ``read_hold_s=0`` grants none: every
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
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvkern.layout.chunks import ChunkSpec, count_chunks, plan_chunks
from kvkern.xfer.auth import (
    AUTH_HEADER,
    AUTH_RESPONSE_HEADER,
    FROM_ENV,
    Credential,
    HttpVerifier,
    serves_request,
)
from kvkern.xfer.auth import resolve as resolve_credential
from kvkern.xfer.devstream import serve_devices
from kvkern.xfer.httpguard import GuardedSite, guard_app, guard_stats, log_refused, start_guarded
from kvkern.xfer.kvgroup import KVGroup
from kvkern.xfer.messages import (
    DEFAULT_CODEC,
    READ_CAPABILITY,
    Cancel,
    Codec,
    PlanPiece,
    PullReply,
    PullRequest,
    ReadDone,
    Refusal,
    Status,
)
from kvkern.xfer.metrics import CONTENT_TYPE_LATEST, XferMetrics
from kvkern.xfer.networks import ANY, ProvenHosts
from kvkern.xfer.regions import RegionRegistry
from kvkern.xfer.runtime import spawn
from kvkern.xfer.send import PeerLedger, RankCtx, Sender, SendSession
from kvkern.xfer.served import ServedConnections
from kvkern.xfer.source_config import (
    DEFAULT_MAX_SEND_S,
    DEFAULT_PROGRESS_TIMEOUT_S,
    DEFAULT_READ_HOLD_S,
    REMOTE_READ_MODES,
    PeerQuotas,
    SourceConfig,
)
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
from kvkern.xfer.transport import CONTROL_TAG, Connection, Lane, Listener, TransportError, tag_for
from kvkern.xfer.tuning import REFUSAL_SEND_S

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

__all__ = ["BLOCKS_PATH", "CAPABILITIES", "DEFAULT_MAX_SEND_S", "DEFAULT_PROGRESS_TIMEOUT_S",
           "DEFAULT_READ_HOLD_S", "PEER_PREFIX", "PROTOCOL", "REMOTE_READ_MODES", "STATE_PATH",
           "ChunkSpec", "PeerQuotas", "SourceConfig", "SourceService", "StagingPool",
           "count_chunks", "plan_chunks"]

log = logging.getLogger(__name__)


class SourceService:
    """Serves the KV of ``groups`` (one :class:`KVGroup` per hosted attention-DP group, all of
    one worker topology) to pulling destinations. See the module docstring.

    Tuned by a :class:`SourceConfig` (``config``), or by its fields as keywords (which
    replace the config's). Create and use it on one event loop (``await start()`` ...
    ``await close()``). ``ucx_ports`` optionally fixes the listener port of a rank (default:
    the OS picks). ``extra_routes`` (aiohttp ``RouteDef``s) are added to the HTTP app (test
    admin routes).
    """

    def __init__(self, groups: Sequence[KVGroup], *, config: SourceConfig | None = None,
                 metrics: XferMetrics | None = None,
                 extra_routes: Iterable[web.RouteDef] | None = None,
                 ucx_ports: Mapping[int, int] | None = None, codec: Codec = DEFAULT_CODEC,
                 credential: Credential | str | None = FROM_ENV, **settings: Any) -> None:
        _check_groups(groups)
        settings = {k: v for k, v in settings.items()
                    if not (k in ("quotas", "http_limits") and v is None)}
        if config is None:
            config = SourceConfig(**settings)
        elif settings:
            config = config.replace(**settings)
        self.config = config
        # Without the fleet credential nothing is served to peers (fail closed): no
        # listeners, and the peer HTTP endpoints answer 503.
        self.credential = resolve_credential(credential, peer_id=config.worker_id)
        self._http_auth = HttpVerifier(self.credential) if self.credential is not None \
            else None
        self.auth_refusals = 0  # HTTP requests refused for missing or bad credentials
        # hosts that presented the credential over HTTP lately: the UCX listeners take no one else
        self.proven_hosts = (ProvenHosts(config.proven_host_ttl_s)
                             if config.proven_host_ttl_s is not None else None)
        self.groups = tuple(sorted(groups, key=lambda g: g.dp_rank))
        self.topology = groups[0].topology
        self.model_id = groups[0].model_id
        self.metrics = metrics if metrics is not None else XferMetrics()
        self.codec = codec
        self.incarnation = uuid.uuid4().hex
        self.ledger = PeerLedger(config.quotas, config.max_concurrent_sends)
        self.staging = StagingPool(config.staging_cache_bytes)
        self.regions = RegionRegistry(config.remote_read)
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.closing = False
        # a run-time knob (test peers lower it between pulls); the rest of the config is fixed
        self.read_hold_s = config.read_hold_s
        self._sender = Sender(self)
        self._extra_routes = list(extra_routes or ())
        self._ucx_ports = dict(ucx_ports or {})
        self._ctx: dict[int, RankCtx] = {
            r: RankCtx(g, rank_kv) for g in self.groups for r, rank_kv in g.ranks.items()}
        self._listeners: dict[int, Listener] = {}
        self._runner: web.AppRunner | None = None
        self._site: GuardedSite | None = None
        self._http_port: int | None = None
        self._sends: set[SendSession] = set()  # every request task not finished yet
        self._bg: set[asyncio.Task] = set()  # fire-and-forget replies, the idle sweep
        self.connections = ServedConnections(
            self.ledger, self.metrics, config.idle_connection_s,
            spawn=lambda coro: spawn(self._bg, coro), closing=lambda: self.closing)
        self._started = False

    # ----------------------------------------------------------------------- properties

    def __getattr__(self, name: str) -> Any:
        """The config's fields read as the service's (``svc.chunk_bytes``, ...)."""
        config = self.__dict__.get("config")
        if config is not None and name in SourceConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def advertise_host(self) -> str:
        return self.config.peer_host

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
        return self.ledger.active

    @property
    def pins_outstanding(self) -> int:
        """Pin handles held by running sends (0 once every send has ended)."""
        return self.ledger.pins

    @property
    def pinned_blocks(self) -> int:
        return self.ledger.pinned_blocks

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
            for r, rank_kv in g.ranks.items():
                lst = self._listeners.get(r)
                doc = RankDoc(ucx_host=self.advertise_host,
                              ucx_port=lst.port if lst is not None else None,
                              layout=rank_kv.layout.describe())
                registered = self.regions.get(r)
                if registered is not None:  # how its blocks can be read, and by which worker
                    doc.read = "native" if registered.native else "canonical"
                    if self.regions.read_worker:
                        doc.read_worker = self.regions.read_worker
                        # kvkern's same-host calls copy host memory only: a device pool
                        # (remote_read="all") is read through UCX's CUDA transports
                        if rank_kv.device.type == "cpu":
                            doc.read_local = self.regions.read_local
                        if registered.directory is not None:
                            doc.read_index = registered.read_index()
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
            capabilities=list(CAPABILITIES) + ([READ_CAPABILITY] if self.regions else []),
        )

    # -------------------------------------------------------------------- start / close

    async def start(self) -> SourceService:
        if self._started:
            raise RuntimeError("source service already started")
        self._started = True
        cfg = self.config
        self.executor = concurrent.futures.ThreadPoolExecutor(
            cfg.pack_threads, thread_name_prefix="kvkern-pack")
        try:
            for device in {ctx.rkv.device for ctx in self._ctx.values()}:
                self.staging.prewarm(device, cfg.chunk_bytes, cfg.chunks_in_flight)
            serve_devices((ctx.rkv for ctx in self._ctx.values()), "kvkern-source-warm-up")
            if self.credential is not None:  # no credential: peers are not served at all
                self.regions.register((ctx.rkv for ctx in self._ctx.values()),
                                      self.groups if cfg.read_directory else ())
                await self._start_listeners()
            else:
                log.warning("source %s has no fleet credential (%s): serving no peers",
                            self.worker_id, "KVKERN_FLEET_SECRET_FILE / KVKERN_FLEET_SECRET")
            await self._start_http()
        except BaseException:
            await self.close()
            raise
        log.info("source %s (incarnation %s) serving HTTP on %s:%s, UCX ranks %s to %s",
                 self.worker_id, self.incarnation, cfg.host, self._http_port, self.ucx_ports,
                 cfg.accept_networks)
        return self

    async def _start_listeners(self) -> None:
        accept = self.config.accept_networks
        if self.config.accept_from is None and accept == ANY:
            log.warning("source %s accepts UCX connections from any address: name the "
                        "fleet's networks with accept_from (--accept-from), see SECURITY.md",
                        self.worker_id)
        for rank, ctx in self._ctx.items():
            lst = Listener(self._handler_for(ctx), host=self.advertise_host,
                           port=self._ucx_ports.get(rank, 0), codec=self.codec,
                           credential=self.credential,
                           on_refused=self.metrics.source_connection_refused,
                           accept_from=accept, proven=self.proven_hosts)
            await asyncio.wait_for(lst.start(), 10.0)
            self._listeners[rank] = lst

    async def _start_http(self) -> None:
        limits = self.config.http_limits
        app = guard_app(web.Application(middlewares=[self._peer_auth]), limits)
        app.router.add_get(STATE_PATH, self._http_state)
        app.router.add_get("/metrics", self._http_metrics)
        app.router.add_get("/healthz", self._http_health)
        app.router.add_routes(self._extra_routes)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await asyncio.wait_for(self._runner.setup(), 10.0)
        self._site = site = await asyncio.wait_for(start_guarded(
            self._runner, self.config.host, self.config.http_port, limits), 10.0)
        stats = guard_stats(app)
        self.metrics.watch_http(lambda: {
            "unauthenticated": self.auth_refusals, "connection_limit": site.refused_limit,
            "header_timeout": site.closed_header_timeout, "body_timeout": stats.body_timeouts,
            "body_refused": stats.too_large})
        self._http_port = int(self._runner.addresses[0][1])

    async def close(self, timeout: float = 10.0) -> None:
        """Stop HTTP and listeners, cancel every send (releasing its pins) and wait for them,
        bounded by ``timeout``. Idempotent."""
        if self.closing:
            return
        self.closing = True
        deadline = time.monotonic() + timeout
        runner, self._runner = self._runner, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.cleanup(), max(deadline - time.monotonic(), 0.1))
        listeners, self._listeners = list(self._listeners.values()), {}
        for lst in listeners:
            with contextlib.suppress(Exception):
                await lst.close(timeout=max(deadline - time.monotonic(), 0.1))
        await self._end_sends(deadline)
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self.staging.clear()
        self.regions.close()  # every connection is aborted: nobody reads now

    async def _end_sends(self, deadline: float) -> None:
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

    async def __aenter__(self) -> SourceService:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------------------- HTTP

    @web.middleware
    async def _peer_auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Paths under :data:`PEER_PREFIX` answer fleet members only (``X-Kvkern-Auth``, see
        :mod:`kvkern.xfer.auth`), and their answers are signed. Everything else passes."""
        if not request.path.startswith(PEER_PREFIX):
            return await handler(request)
        if self._http_auth is None:
            return web.json_response({"error": "this worker serves no peers (no fleet "
                                      "credential)"}, status=503)
        verdict = self._http_auth.check(
            request.method, request.raw_path, request.headers.get(AUTH_HEADER),
            serves=serves_request(request, (self.config.host, self.advertise_host)))
        if not verdict.ok:
            self.auth_refusals += 1
            log_refused(log, request, verdict.why)  # (once per address: a flood logs little)
            return web.json_response({"error": "unauthorized"}, status=401)
        if self.proven_hosts is not None:
            self.proven_hosts.note(request.remote)
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
        status = "closing" if self.closing else "ok"
        return web.json_response({"status": status, "worker_id": self.worker_id,
                                  "incarnation": self.incarnation},
                                 status=503 if self.closing else 200)

    # ----------------------------------------------------------------------- listener

    def _handler_for(self, ctx: RankCtx):
        async def handler(conn: Connection) -> None:
            await self._serve_connection(conn, ctx)
        return handler

    async def _serve_connection(self, conn: Connection, ctx: RankCtx) -> None:
        served = self.connections
        if not served.enter(conn, ctx.rank):
            return
        conn_sends: dict[int, SendSession] = {}
        try:
            while True:
                msg = await conn.recv_msg(CONTROL_TAG, timeout=None)
                served.heard(conn)
                if isinstance(msg, PullRequest) and not served.may_open(conn, "requests"):
                    self.metrics.source_request("rejected")
                    continue
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
                    self._read_done(conn, conn_sends, msg)
                else:  # a PullReply has no business on the control tag
                    log.debug("ignoring %s on the control tag of rank %d",
                              type(msg).__name__, ctx.rank)
        except TransportError as exc:
            log.debug("rank %d connection ended: %s", ctx.rank, exc)
        finally:
            served.leave(conn)
            for s in list(conn_sends.values()):
                if s.task is not None:
                    s.task.cancel()

    def _read_done(self, conn: Connection, conn_sends: dict[int, SendSession],
                   msg: ReadDone) -> None:
        s = conn_sends.get(msg.transfer_id)
        if s is not None and s.read_done is not None and not s.read_done.is_set() \
                and s.read_until is not None and time.monotonic() >= s.read_until:
            s = None  # the wait for it ran out (its task may not have resumed yet): no hold
        if s is not None and s.read_done is not None:
            s.ack_read = msg.ack
            if not s.read_done.is_set():
                s.completed = True  # every read is done: the pins may go now,
                self._release(s)  # before the next request counts this quota
            s.read_done.set()
        elif msg.ack:  # nothing pinned for it (any more): say so, not silence
            self.connections.ack_unknown(conn, msg.transfer_id)

    def _accept(self, conn: Connection, ctx: RankCtx, conn_sends: dict[int, SendSession],
                req: PullRequest) -> None:
        """Synchronous admission (no await between the check and the count)."""
        if req.start or len(req.block_hashes) != req.count:
            # only the requested hashes are kept while the request is open: the rest of a
            # frame of up to 1 MiB would stay in memory for as long as its answer waits
            req = msgspec.structs.replace(req, block_hashes=req.requested_hashes, start=0)
        now = time.monotonic()
        max_send_s = self.config.max_send_s
        budget = req.deadline_ms / 1000 if req.deadline_ms else max_send_s
        deadline = now + min(budget, max_send_s)
        duplicate = req.transfer_id in conn_sends
        peer = conn.peer_id or ""
        admitted = not duplicate and not self.closing and self.ledger.may_admit(peer)
        s = SendSession(req, conn, ctx, conn_sends, deadline, admitted)
        if admitted:
            self.ledger.admitted(peer)
            self.metrics.source_send_started()
        if not duplicate:
            conn_sends[req.transfer_id] = s
        self._sends.add(s)
        self.connections.opened(conn)
        s.task = asyncio.ensure_future(self._sender.serve(s, duplicate=duplicate))
        s.task.add_done_callback(lambda t, s=s: self._finished(s, t))

    def _finished(self, s: SendSession, task: asyncio.Task) -> None:
        self._release(s)  # backstop; normally done when the send ends
        self._sends.discard(s)
        self.connections.ended(s.conn)
        if s.conn_sends.get(s.req.transfer_id) is s:
            del s.conn_sends[s.req.transfer_id]
        if s.admitted:
            s.admitted = False
            self.ledger.ended(s.peer)
            self.metrics.source_send_ended(time.monotonic() - s.started)
        if not task.cancelled() and task.exception() is not None:
            log.error("send of transfer %d failed unexpectedly", s.req.transfer_id,
                      exc_info=task.exception())

    def _release(self, s: SendSession) -> None:
        """Unpin ``s``'s blocks if pinned; idempotent (the manager is called once)."""
        if s.released or s.handle is None:
            s.released = True
            return
        s.released = True
        handle, s.handle = s.handle, None
        n = len(handle.block_ids)
        self.ledger.unpinned(s.peer, s.ctx.group.dp_rank, handle.hashes)
        self.metrics.source_pins_changed(-n)
        try:
            s.ctx.group.manager.unpin(handle)
        except Exception:  # noqa: BLE001 (a manager bug must not take the service down)
            log.exception("unpin of pin %s for transfer %d failed", handle.pin_id,
                          s.req.transfer_id)

    # -------------------------------------------- replies and hooks (test peers override)

    async def _reply(self, s: SendSession, reply: PullReply) -> None:
        """Send ``reply`` within the request's deadline; one that pins nothing (a refusal)
        within ``REFUSAL_SEND_S`` at most: a peer that stops receiving holds the connection's
        sends, and each request waiting behind them stays open meanwhile."""
        self.metrics.source_request(reply.status.value)
        timeout = max(s.deadline - time.monotonic(), 0.001)
        if reply.status not in (Status.OK, Status.PARTIAL):
            timeout = min(timeout, REFUSAL_SEND_S)
        await s.conn.send_msg(reply, tag_for(s.req.transfer_id, Lane.REPLY), timeout=timeout)
        s.replied = True

    async def _reply_status(self, s: SendSession, status: Status, reason: str) -> None:
        await self._reply(s, Refusal(transfer_id=s.req.transfer_id, status=status,
                                     reason=reason))

    def _producer(self, s: SendSession, pieces: list[PlanPiece], block_ids: list[int],
                  chunks: list[ChunkSpec]):
        """``produce(i)`` for send_stream: packs chunk ``i`` into ring slot ``i % ring``."""
        return self._sender.producer(s, pieces, block_ids, chunks)

    async def _after_reply(self, req: PullRequest, reply: PullReply) -> None:
        """Called after a data-carrying reply was sent, before the first chunk. No-op; test
        peers override it to freeze a send."""

    async def _before_chunk(self, transfer_id: int, index: int) -> None:
        """Called before chunk ``index`` is packed, and for a read before it is confirmed
        (index 0). No-op; test peers override it to slow a send down."""

    async def _before_read_reply(self, transfer_id: int) -> None:
        """Called when a read's blocks are pinned, before the reply that offers them.
        No-op; test peers override it to hold a read pull at the source."""


def _check_groups(groups: Sequence[KVGroup]) -> None:
    """One worker topology, model and hash scheme; each DP group once."""
    if not groups:
        raise ValueError("SourceService needs at least one KVGroup")
    first = groups[0]
    seen: set[int] = set()
    for g in groups:
        if g.topology != first.topology:
            raise ValueError(f"DP group {g.dp_rank} has topology {g.topology.to_dict()}, "
                             f"group {first.dp_rank} {first.topology.to_dict()}")
        if g.dp_rank in seen:
            raise ValueError(f"DP group {g.dp_rank} given twice")
        seen.add(g.dp_rank)
        if g.model_id != first.model_id:
            raise ValueError(f"DP group {g.dp_rank} holds model {g.model_id!r}, group "
                             f"{first.dp_rank} {first.model_id!r}")
        if g.hash_scheme != first.hash_scheme:
            raise ValueError(f"DP group {g.dp_rank} uses hash scheme {g.hash_scheme!r}, "
                             f"group {first.dp_rank} {first.hash_scheme!r}")
