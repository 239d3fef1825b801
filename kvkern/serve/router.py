"""A KV-aware router: destination by load, hint by longest cached prefix.

The router never moves KV. It keeps, per worker, the *router-domain* hashes of the blocks that
worker caches and, for each request, picks a destination by load and names another worker as
the hint's source when that worker holds a longer prefix of the request than the destination::

    request tokens  | b0 | b1 | b2 | b3 | b4 | partial |
    local hashes      l0   l1   l2   l3   l4              XXH3-64 of each block's tokens
    chained           c0   c1   c2   c3   c4              c[i] names tokens[:(i+1)*T]

    worker A holds    c0   c1   c2   c3                   match 4 blocks
    worker B holds    c0                                  match 1 block
    load              A busy, B idle  ->  destination B, hint {source: A, block_hashes: c0..c3}

Router-domain hashes are ``public-xxh3-v1`` (Dynamo's router hash): local block hashes are
XXH3-64 of the block's tokens; the router indexes their *chained* form (Dynamo's sequence
hash), so one set lookup per block answers "does this worker hold this whole prefix". A
worker's holdings are learned two ways: from the prompts the router routed to it (after the
request finished, so the blocks are committed) and from the worker's report endpoint
(``GET /kvkern/v1/blocks``, which replaces what was learned, so evictions are forgotten).

Load is ``(requests in flight, prompt tokens in flight, least recently chosen)``; ties go to
the worker chosen longest ago, so an idle pair alternates.

Hint dialects (all decoded by :func:`kvkern.xfer.hints.decode_hint`): ``kv_hint`` (kvkern's
own, default), ``kv_hints`` (the ``kv.fetch`` 1.0 envelope), ``dynamo``
(``kv_transfer_params.router_hint``) and ``llm-d`` (``kv_transfer_params.remote_kv_source``,
which carries no hashes: the destination computes them). Hashes in a hint are the chained
``public-xxh3-v1`` hashes of the matched prefix, so their count is the number of blocks to pull.

``kvkern router`` (:func:`main`) serves this over HTTP; see :func:`build_app` for the API.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvkern.cache.hashing import get_scheme, normalize_hashes
from kvkern.checks import check_positive_int
from kvkern.serve.cliargs import (
    BIND_ERRNOS,
    LOG_LEVELS,
    Parser,
    UsageError,
    bind_error,
    check_port_free,
    credential_fix,
    nonneg_float,
    port,
    positive_float,
    positive_int,
    report,
)
from kvkern.xfer.auth import AUTH_RESPONSE_HEADER, DEFAULT_HINT_TTL_S, FROM_ENV

__all__ = [
    "DIALECTS",
    "DIALECT_NAMES",
    "NO_HINT_REASONS",
    "ROUTER_SCHEME",
    "KVRouter",
    "RouteDecision",
    "WorkerState",
    "build_app",
    "hint_fragment",
    "main",
    "router_hashes",
]

log = logging.getLogger(__name__)

ROUTER_SCHEME = "public-xxh3-v1"
BLOCKS_PATH = "/kvkern/v1/blocks"  # a worker's block listing (fleet members only)
DIALECTS = ("kv_hint", "kv_hints", "dynamo", "llm-d")
#: ``--dialect`` value -> the dialect's name as a worker reports it (``hint.dialect`` of the
#: worker's response, :class:`kvkern.xfer.hints.KvHint`), used in responses and metrics
DIALECT_NAMES = {"kv_hint": "kvkern", "kv_hints": "kv_hints", "dynamo": "dynamo",
                 "llm-d": "llm-d"}
#: why a routed request carries no hint (``no_hint_reason``, metric label)
NO_HINT_REASONS = ("no_other_worker", "no_longer_prefix", "no_credential")
MAX_REQUEST_ID_CHARS = 256
# A request id is also the X-Request-Id response header: printable ASCII, no spaces.
REQUEST_ID_RE = re.compile(rf"[!-~]{{1,{MAX_REQUEST_ID_CHARS}}}")
#: ``--max-tokens`` default: the longest prompt the router takes (longer ones get 413)
DEFAULT_MAX_TOKENS = 1 << 17
#: ``--max-forwards`` default: forwards in flight to one worker (more are answered 503)
DEFAULT_MAX_FORWARDS = 64
# A generate body holds at most max_tokens token ids (<= 12 bytes each in JSON, "4294967295, ")
# beside hints and options of a few KiB: the router's body limit follows its token limit.
BODY_BYTES_BASE = 256 << 10
BODY_BYTES_PER_TOKEN = 12
# Hashes a worker's routed requests may add to what the router believes it holds between two
# block listings (each listing replaces them): about 70 B each.
MAX_LEARNED_HASHES = 1 << 21


def router_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[int]:
    """Chained ``public-xxh3-v1`` hashes of the full blocks of ``token_ids`` under the
    request's ``cache_salt``: element ``i`` names ``token_ids[:(i + 1) * block_size]``."""
    scheme = get_scheme(ROUTER_SCHEME)
    return scheme.sequence_hashes(token_ids, block_size, cache_salt=scheme.salt_id(cache_salt))


#: Dialects whose ``block_hashes`` are the engine's own hashes (Dynamo's): the router sends
#: them only to workers whose engine hashes in the router's scheme, else ``kv_hint``, which
#: names the scheme of the hashes it carries.
ENGINE_HASH_DIALECTS = ("dynamo", "kv_hints")


def hint_fragment(dialect: str, source: str, block_hashes: Sequence[int], *,
                  message_id: str | None = None) -> dict[str, Any]:
    """The request-body fields that carry a hint naming ``source`` for ``block_hashes`` (the
    chained ``public-xxh3-v1`` hashes of the prefix to pull) in ``dialect``.

    ``source`` is the source worker's endpoint (``http://host:port`` or ``host:port``); for
    ``llm-d`` it must have an explicit port."""
    hashes = [int(h) for h in block_hashes]
    if not hashes:
        raise ValueError("a hint needs at least one block hash")
    if dialect == "kv_hint":
        return {"kv_hint": {"version": 1, "source": source, "block_hashes": hashes,
                            "hash_scheme": ROUTER_SCHEME}}
    if dialect == "kv_hints":
        return {"kv_hints": {
            "protocol_version": "0.1",
            "message_id": message_id or uuid.uuid4().hex,
            "actions": [{"action_type": "kv.fetch", "action_version": "1.0",
                         "action_id": "0",
                         "payload": {"source_control_endpoint": source,
                                     "block_hashes": hashes}}],
        }}
    if dialect == "dynamo":
        return {"kv_transfer_params": {"router_hint": {"source_control_endpoint": source,
                                                       "block_hashes": hashes}}}
    if dialect == "llm-d":
        parts = urlsplit(source if "://" in source else f"http://{source}")
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"llm-d hints need host:port, got source {source!r}")
        return {"kv_transfer_params": {"remote_kv_source": {
            "kv_request_id": message_id or uuid.uuid4().hex, "remote_host": parts.hostname,
            "remote_port": parts.port}}}
    raise ValueError(f"unknown hint dialect {dialect!r}; known: {', '.join(DIALECTS)}")


@dataclass(eq=False)
class WorkerState:
    """What the router knows about one worker. ``url`` is the worker's HTTP API base;
    ``source`` the endpoint a hint names for it (default: ``url``'s ``host:port``)."""

    worker_id: str
    url: str
    source: str
    hashes: set[int] = field(default_factory=set)
    in_flight: int = 0
    tokens_in_flight: int = 0
    last_chosen: int = -1
    routed: int = 0
    healthy: bool = True
    # the scheme the worker's engine hashes its blocks in (its report's pool_hash_scheme)
    pool_scheme: str = ROUTER_SCHEME

    def match(self, hashes: Sequence[int]) -> int:
        """Leading ``hashes`` this worker holds."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def describe(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "url": self.url, "source": self.source,
                "blocks": len(self.hashes), "in_flight": self.in_flight,
                "tokens_in_flight": self.tokens_in_flight, "routed": self.routed,
                "healthy": self.healthy}


@dataclass(frozen=True, kw_only=True)
class RouteDecision:
    """One routing decision. ``matched`` maps each worker to the leading blocks it holds;
    ``hint`` is the body fragment to merge into the request (``None``: no hint)."""

    request_id: str
    destination: str
    destination_url: str
    num_tokens: int
    hashes: tuple[int, ...]
    matched: dict[str, int]
    hint_source: str | None = None
    hint_blocks: int = 0
    hint: dict[str, Any] | None = None
    hint_dialect: str | None = None  # as a worker names it (DIALECT_NAMES)
    no_hint_reason: str | None = None  # one of NO_HINT_REASONS when hint is None

    def summary(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "destination": self.destination,
                "matched_blocks": dict(self.matched), "hint_source": self.hint_source,
                "hint_blocks": self.hint_blocks, "hint_dialect": self.hint_dialect,
                "no_hint_reason": self.no_hint_reason}


class KVRouter:
    """Routing state and decisions; thread-safe (one lock), no I/O.

    ``block_size`` must equal the workers' block size (a worker's report says it; a mismatch
    raises in :meth:`load_report`). ``min_hint_blocks``: a source must beat the destination by
    at least this many blocks to be named.
    """

    def __init__(self, block_size: int, *, dialect: str = "kv_hint",
                 min_hint_blocks: int = 1) -> None:
        check_positive_int("block_size", block_size)
        if dialect not in DIALECTS:
            raise ValueError(f"unknown hint dialect {dialect!r}; known: {', '.join(DIALECTS)}")
        check_positive_int("min_hint_blocks", min_hint_blocks)
        self.block_size = block_size
        self.dialect = dialect
        self.min_hint_blocks = min_hint_blocks
        self._workers: dict[str, WorkerState] = {}
        self._lock = threading.Lock()
        self._clock = itertools.count()

    # ------------------------------------------------------------------ membership

    def add_worker(self, worker_id: str, url: str, source: str | None = None) -> WorkerState:
        url = url.rstrip("/")
        if source is None:
            parts = urlsplit(url)
            if not parts.netloc:
                raise ValueError(f"worker {worker_id!r}: url {url!r} has no host")
            source = url if parts.path not in ("", "/") else f"{parts.scheme}://{parts.netloc}"
        with self._lock:
            if worker_id in self._workers:
                raise ValueError(f"worker {worker_id!r} already added (url "
                                 f"{self._workers[worker_id].url})")
            w = WorkerState(worker_id=worker_id, url=url, source=source)
            self._workers[worker_id] = w
            return w

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def workers(self) -> list[dict[str, Any]]:
        with self._lock:
            return [w.describe() for w in self._workers.values()]

    def worker(self, worker_id: str) -> WorkerState:
        with self._lock:
            return self._get(worker_id)

    def _get(self, worker_id: str) -> WorkerState:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}; known: "
                           f"{sorted(self._workers)}") from None

    def set_healthy(self, worker_id: str, healthy: bool, why: str = "") -> bool:
        """Mark ``worker_id`` (un)healthy; returns whether that changed its state, and logs
        each change (to unhealthy at WARNING with ``why``, back at INFO)."""
        with self._lock:
            w = self._get(worker_id)
            changed = w.healthy != healthy
            w.healthy = healthy
        if changed and healthy:
            log.info("worker %s (%s) is healthy again", worker_id, w.url)
        elif changed:
            log.warning("worker %s (%s) is unhealthy: %s; no requests or hints go to it until "
                        "it answers a refresh", worker_id, w.url, why or "unknown")
        return changed

    # ------------------------------------------------------------------ learning

    def learn(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Record that ``worker_id`` now caches the chained router-domain ``hashes``."""
        hs = normalize_hashes(list(hashes))
        with self._lock:
            self._get(worker_id).hashes.update(hs)

    def learn_tokens(self, worker_id: str, token_ids: Sequence[int]) -> None:
        """Record that ``worker_id`` cached the full blocks of ``token_ids``."""
        self.learn(worker_id, router_hashes(token_ids, self.block_size))

    def load_report(self, worker_id: str, report: dict[str, Any]) -> int:
        """Replace what is known of ``worker_id`` with its ``GET /kvkern/v1/blocks`` report;
        returns the number of blocks. Raises ``ValueError`` when the report's scheme or block size
        is not the router's."""
        scheme, bs = report.get("hash_scheme"), report.get("block_size")
        if scheme != ROUTER_SCHEME:
            raise ValueError(f"worker {worker_id!r} reports hash scheme {scheme!r}, the router "
                             f"reads {ROUTER_SCHEME!r}")
        if bs != self.block_size:
            raise ValueError(f"worker {worker_id!r} has block size {bs}, the router "
                             f"{self.block_size}")
        blocks = report.get("blocks")
        if not isinstance(blocks, list):
            raise ValueError(f"worker {worker_id!r}: report has no 'blocks' list")
        hs = normalize_hashes([b["hash"] if isinstance(b, dict) else b for b in blocks])
        pool_scheme = report.get("pool_hash_scheme", ROUTER_SCHEME)
        with self._lock:
            worker = self._get(worker_id)
            worker.hashes = set(hs)
            worker.pool_scheme = pool_scheme if isinstance(pool_scheme, str) else ROUTER_SCHEME
        return len(hs)

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._get(worker_id).hashes.clear()

    # ------------------------------------------------------------------ routing

    def route(self, token_ids: Sequence[int], *, destination: str | None = None,
              request_id: str | None = None, dialect: str | None = None,
              cache_salt: str = "") -> RouteDecision:
        """Pick a destination (least loaded healthy worker, or ``destination`` when given)
        and, when another worker holds a longer prefix (by ``min_hint_blocks``), a hint
        naming it. Marks the request in flight on the destination: call :meth:`finish`.
        Prefixes match only under the same ``cache_salt``."""
        hashes = router_hashes(token_ids, self.block_size, cache_salt)
        dialect = dialect or self.dialect
        with self._lock:
            if not self._workers:
                raise LookupError("the router has no workers")
            if destination is None:
                healthy = [w for w in self._workers.values() if w.healthy]
                if not healthy:
                    raise LookupError("no healthy worker")
                dest = min(healthy, key=lambda w: (w.in_flight, w.tokens_in_flight,
                                                   w.last_chosen))
            else:
                dest = self._get(destination)
            matched = {w.worker_id: w.match(hashes) for w in self._workers.values()}
            best = max((w for w in self._workers.values() if w is not dest and w.healthy),
                       key=lambda w: matched[w.worker_id], default=None)
            hint_source, hint_blocks, hint = None, 0, None
            no_hint = "no_other_worker" if best is None else None
            if best is not None and (matched[best.worker_id] - matched[dest.worker_id]
                                     >= self.min_hint_blocks):
                hint_source, hint_blocks = best.worker_id, matched[best.worker_id]
                if dialect in ENGINE_HASH_DIALECTS and dest.pool_scheme != ROUTER_SCHEME:
                    dialect = "kv_hint"  # those carry engine hashes; the router has its own
                hint = hint_fragment(dialect, best.source, hashes[:hint_blocks])
            elif best is not None:
                no_hint = "no_longer_prefix"
            dest.in_flight += 1
            dest.tokens_in_flight += len(token_ids)
            dest.last_chosen = next(self._clock)
            dest.routed += 1
            return RouteDecision(
                request_id=request_id or uuid.uuid4().hex, destination=dest.worker_id,
                destination_url=dest.url, num_tokens=len(token_ids), hashes=tuple(hashes),
                matched=matched, hint_source=hint_source, hint_blocks=hint_blocks, hint=hint,
                hint_dialect=DIALECT_NAMES[dialect] if hint else None, no_hint_reason=no_hint,
            )

    def finish(self, decision: RouteDecision, *, ok: bool) -> None:
        """The routed request ended. On success the destination holds the prompt's full
        blocks (its own, pulled or computed), so the router learns them."""
        with self._lock:
            w = self._workers.get(decision.destination)
            if w is None:
                return
            w.in_flight = max(0, w.in_flight - 1)
            w.tokens_in_flight = max(0, w.tokens_in_flight - decision.num_tokens)
            if ok and len(w.hashes) + len(decision.hashes) <= MAX_LEARNED_HASHES:
                w.hashes.update(decision.hashes)  # (past the bound: the next listing's)


# ---------------------------------------------------------------------------- HTTP front


def body_bytes(max_tokens: int) -> int:
    """The router's request-body limit for prompts of at most ``max_tokens`` tokens."""
    return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_tokens


def build_app(router: KVRouter, *, request_timeout_s: float = 120.0,
              report_timeout_s: float = 5.0, refresh_s: float | None = 5.0,
              credential: Any = FROM_ENV, hint_ttl_s: float = DEFAULT_HINT_TTL_S,
              limits: Any = None, max_tokens: int = DEFAULT_MAX_TOKENS,
              max_forwards: int = DEFAULT_MAX_FORWARDS):
    """The ``kvkern router`` HTTP API (aiohttp)::

        POST /v1/generate   body: a worker generate body ({"token_ids": [...], ...});
                            optional "destination": worker id; optional "request_id" (one
                            is made when absent: printable ASCII without spaces, at most
                            256 characters). Routes, removes any hint the client put in
                            the body, attaches its own hint signed with the fleet credential
                            (valid ``hint_ttl_s``), forwards to the destination's
                            POST /v1/generate with the request id and returns its JSON plus
                            "request_id" and "router": the decision summary.
        POST /v1/route      body: {"token_ids": [...]}: the decision only (nothing is sent;
                            the request is not counted in flight). Returns summary plus
                            "destination_url" and "hint" (the body fragment).
        GET  /v1/workers    what the router knows of each worker
        POST /v1/refresh    re-read every worker's GET /kvkern/v1/blocks now (signed: fleet only)
        GET  /metrics       Prometheus text (:mod:`kvkern.serve.routermetrics`)
        GET  /healthz       "ok"

    Errors are ``{"error": "..."}``: 400 malformed body, 413 more than ``max_tokens`` prompt
    tokens (or a body past ``limits.max_body_bytes``, by default :func:`body_bytes` of
    ``max_tokens``), 503 no (healthy) worker or ``max_forwards`` forwards already in flight
    to the destination, 502 the destination did not answer (within ``request_timeout_s``).

    Health: a worker is marked unhealthy when its block listing cannot be read (each refresh)
    or when a forward cannot connect to it; a slow, failed or unreadable answer is a 502 that
    leaves its health to the next listing read. Listings use their own connections, so
    forwards waiting on busy workers never delay them. The router reads the workers' block
    listings and signs hints with the fleet credential (``credential``, by default the
    environment's); without one it routes without hints.
    """
    return _RouterService(router, request_timeout_s=request_timeout_s,
                          report_timeout_s=report_timeout_s, refresh_s=refresh_s,
                          credential=credential, hint_ttl_s=hint_ttl_s, limits=limits,
                          max_tokens=max_tokens, max_forwards=max_forwards).app


class _RouterService:
    """The state and handlers behind :func:`build_app`'s aiohttp app."""

    def __init__(self, router: KVRouter, *, request_timeout_s: float,
                 report_timeout_s: float, refresh_s: float | None, credential: Any,
                 hint_ttl_s: float, limits: Any, max_tokens: int, max_forwards: int) -> None:
        from aiohttp import web  # noqa: PLC0415 (lazy heavy import)

        from kvkern.serve.routermetrics import RouterMetrics  # noqa: PLC0415
        from kvkern.xfer.auth import resolve  # noqa: PLC0415
        from kvkern.xfer.httpguard import HttpLimits, guard_app  # noqa: PLC0415

        check_positive_int("max_tokens", max_tokens)
        check_positive_int("max_forwards", max_forwards)
        self.router = router
        self.max_tokens = max_tokens
        self.max_forwards = max_forwards
        self.request_timeout_s = request_timeout_s
        self.report_timeout_s = report_timeout_s
        self.refresh_s = refresh_s
        self.hint_ttl_s = hint_ttl_s
        self.cred = resolve(credential, peer_id="router")
        if self.cred is None:
            log.warning("the router has no fleet credential (--fleet-secret-file, "
                        "KVKERN_FLEET_SECRET_FILE, KVKERN_FLEET_SECRET): it cannot read block "
                        "listings or sign hints, so it routes by load only")
        self.limits = limits or HttpLimits(max_body_bytes=body_bytes(max_tokens))
        self.metrics = RouterMetrics()
        for info in router.workers():
            self.metrics.add_worker(info["worker_id"])
        self.session: Any = None  # forwards
        self.listing_session: Any = None  # block listings (own connections: never queued)
        self.forwarding: dict[str, int] = {}  # worker id -> forwards in flight to it
        self.task: asyncio.Task | None = None
        self._verifier = None  # (made on first use: a refresh's signature)
        self._refreshing: asyncio.Future | None = None
        app = guard_app(web.Application(), self.limits)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        app.add_routes([web.post("/v1/generate", self.timed("generate", self.generate)),
                        web.post("/v1/route", self.timed("route", self.route)),
                        web.get("/v1/workers", self.workers),
                        web.post("/v1/refresh", self.refresh),
                        web.get("/metrics", self.metrics_page),
                        web.get("/healthz", self.healthz)])
        self.app = app

    # ------------------------------------------------------------------ worker listings

    def mark(self, worker_id: str, healthy: bool, why: str = "") -> None:
        self.router.set_healthy(worker_id, healthy, why)
        self.metrics.healthy.labels(worker_id).set(1 if healthy else 0)

    async def _listing(self, url: str) -> dict[str, Any]:
        """A worker's signed block listing; raises naming what is wrong."""
        import yarl  # noqa: PLC0415
        from aiohttp import ClientTimeout  # noqa: PLC0415

        from kvkern.xfer.auth import authority  # noqa: PLC0415

        cred = self.cred
        if cred is None:
            raise RuntimeError("no fleet credential")
        u = yarl.URL(url)
        headers, nonce = cred.sign_request("GET", BLOCKS_PATH, to=authority(u.host, u.port))
        async with self.listing_session.get(
                f"{url}{BLOCKS_PATH}", headers=headers,
                timeout=ClientTimeout(total=self.report_timeout_s)) as r:
            r.raise_for_status()
            raw = await r.read()
            if not cred.verify_response(nonce, raw, r.headers.get(AUTH_RESPONSE_HEADER)):
                raise RuntimeError("the block listing is not signed by a fleet member")
        return json.loads(raw)

    async def refresh_once(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for info in self.router.workers():
            wid = info["worker_id"]
            try:
                out[wid] = self.router.load_report(wid, await self._listing(info["url"]))
                self.metrics.blocks.labels(wid).set(out[wid])
                self.mark(wid, True)
            except Exception as exc:  # noqa: BLE001 (a worker down must not stop the router)
                why = f"{type(exc).__name__}: {exc}"
                self.metrics.refresh_failures.labels(wid).inc()
                self.mark(wid, False, f"block listing: {why}")
                out[wid] = f"unreachable: {why}"
        return out

    async def refresher(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh_once()
            await asyncio.sleep(self.refresh_s)

    async def on_startup(self, app: Any) -> None:
        from aiohttp import ClientSession, TCPConnector  # noqa: PLC0415

        # forwards are bounded per worker by max_forwards (503 past it), not by a pool size
        self.session = ClientSession(trust_env=False, connector=TCPConnector(limit=0))
        self.listing_session = ClientSession(trust_env=False)
        if self.refresh_s:
            self.task = asyncio.create_task(self.refresher())
        else:
            await self.refresh_once()

    async def on_cleanup(self, app: Any) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        for session in (self.session, self.listing_session):
            if session is not None:
                await session.close()

    # ------------------------------------------------------------------ requests

    async def read_request(self, request: Any) -> tuple[dict, list[int], str, str]:
        """The body, its tokens, its cache salt and its request id (made when absent)."""
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.httpguard import json_error, read_json_body  # noqa: PLC0415

        body = await read_json_body(request, max_bytes=self.limits.max_body_bytes,
                                    timeout_s=self.limits.body_timeout_s)
        tokens = body.get("token_ids") if isinstance(body, dict) else None
        if isinstance(tokens, list) and len(tokens) > self.max_tokens:  # (before per-token work)
            raise json_error(web.HTTPRequestEntityTooLarge, f"{len(tokens)} prompt tokens "
                             f"exceed the router's limit of {self.max_tokens}",
                             max_size=self.max_tokens, actual_size=len(tokens))
        if not isinstance(tokens, list) or not tokens or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
                for t in tokens):
            raise json_error(web.HTTPBadRequest, "token_ids must be a non-empty list of "
                                                 "token ids in [0, 2**32)")
        salt = body.get("cache_salt", "")
        if not isinstance(salt, str):
            raise json_error(web.HTTPBadRequest, "cache_salt must be a string")
        destination = body.get("destination")
        if destination is not None and not isinstance(destination, str):
            raise json_error(web.HTTPBadRequest, "destination must be a worker id (a string)")
        request_id = body.get("request_id") or uuid.uuid4().hex
        if not isinstance(request_id, str) or REQUEST_ID_RE.fullmatch(request_id) is None:
            raise json_error(web.HTTPBadRequest, f"request_id must be a string of at most "
                                                 f"{MAX_REQUEST_ID_CHARS} printable ASCII "
                                                 "characters without spaces")
        return body, tokens, salt, request_id

    def decide(self, tokens: list[int], salt: str, request_id: str,
               destination: Any) -> tuple[RouteDecision, dict]:
        """Route; returns the decision (without a hint when none can be signed) and the
        signed hint's body fields."""
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.auth import sign_hint  # noqa: PLC0415
        from kvkern.xfer.hints import KvHint, decode_hint  # noqa: PLC0415
        from kvkern.xfer.httpguard import json_error  # noqa: PLC0415

        try:
            decision = self.router.route(tokens, destination=destination, cache_salt=salt,
                                         request_id=request_id)
        except (LookupError, KeyError) as exc:
            raise json_error(web.HTTPServiceUnavailable,
                             str(exc.args[0] if exc.args else exc)) from None
        if decision.hint is None:
            return decision, {}
        if self.cred is None:
            return dataclasses.replace(decision, hint=None, hint_source=None, hint_blocks=0,
                                       hint_dialect=None, no_hint_reason="no_credential"), {}
        hint = decode_hint(decision.hint)
        if not isinstance(hint, KvHint):  # the router's own fragment always decodes
            log.error("router hint did not decode: %s", hint)
            return decision, {}
        return decision, {**decision.hint, **sign_hint(self.cred, hint, tokens,
                                                       cache_salt=salt, ttl_s=self.hint_ttl_s)}

    def timed(self, endpoint: str, handler: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        async def run(request: Any) -> Any:
            t0 = time.perf_counter()
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            finally:
                self.metrics.answered(endpoint, status, time.perf_counter() - t0)
        return run

    async def _forward(self, decision: RouteDecision, data: bytes,
                       request_id: str) -> tuple[Any, int]:
        """POST ``data`` (a JSON body) to the destination; (payload, status), 502 when it did
        not answer. Only a failure to connect marks the worker unhealthy: a slow, broken or
        unreadable answer may be the request's own doing, and the next block listing judges
        the worker."""
        from aiohttp import ClientConnectorError, ClientTimeout  # noqa: PLC0415

        dest = decision.destination
        try:
            async with self.session.post(
                    f"{decision.destination_url}/v1/generate", data=data,
                    headers={"Content-Type": "application/json"},
                    timeout=ClientTimeout(total=self.request_timeout_s)) as r:
                payload = await r.json(content_type=None)
                status = r.status
            if status >= 500:
                self.metrics.forward_errors.labels(dest, "http_5xx").inc()
            return payload, status
        except Exception as exc:  # noqa: BLE001 (any failure is the client's 502)
            # (aiohttp's timeouts are asyncio.TimeoutError, some also ClientConnectionError)
            timeout = isinstance(exc, asyncio.TimeoutError)
            self.metrics.forward_errors.labels(dest, "timeout" if timeout else
                                               "unreachable").inc()
            why = f"{type(exc).__name__}: {exc}".rstrip(": ")
            if timeout:
                why = f"no answer within {self.request_timeout_s:g} s"
            log.warning("request %s: forward to %s failed: %s", request_id, dest, why)
            if not timeout and isinstance(exc, ClientConnectorError):
                self.mark(dest, False, f"forward of request {request_id}: {why}")
            return {"error": f"destination {dest} did not answer: {why}"}, 502

    def _forward_body(self, body: dict, hint_fields: dict, request_id: str) -> bytes:
        """The body forwarded to the destination, encoded; 400 when the client's body cannot
        be (nesting deeper than the encoder's recursion bound, say)."""
        import msgspec  # noqa: PLC0415
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.hints import strip_hints  # noqa: PLC0415
        from kvkern.xfer.httpguard import json_error  # noqa: PLC0415

        try:
            return msgspec.json.encode({**strip_hints(body), **hint_fields,
                                        "request_id": request_id})
        except (msgspec.EncodeError, TypeError, ValueError, RecursionError) as exc:
            raise json_error(web.HTTPBadRequest, f"body cannot be forwarded: "
                                                 f"{type(exc).__name__}: {exc}") from None

    async def generate(self, request: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.httpguard import json_error  # noqa: PLC0415

        body, tokens, salt, request_id = await self.read_request(request)
        decision, hint_fields = self.decide(tokens, salt, request_id,
                                            body.pop("destination", None))
        dest = decision.destination
        status = 502
        try:
            data = self._forward_body(body, hint_fields, request_id)
            if self.forwarding.get(dest, 0) >= self.max_forwards:
                raise json_error(web.HTTPServiceUnavailable, f"worker {dest} already has "
                                 f"{self.max_forwards} requests in flight from this router "
                                 "(its bound); retry later")
            self.metrics.routed(decision)
            self.forwarding[dest] = self.forwarding.get(dest, 0) + 1
            try:
                payload, status = await self._forward(decision, data, request_id)
            finally:
                self.forwarding[dest] -= 1
        finally:
            # (a request that bypassed the cache left nothing there for the router to learn)
            self.router.finish(decision, ok=status == 200 and body.get("use_cache") is not False)
        if not isinstance(payload, dict):
            payload = {"response": payload}
        payload.setdefault("request_id", request_id)
        payload["router"] = decision.summary()
        log.debug("request %s -> %s, hint %s (%s blocks)", request_id, decision.destination,
                  decision.hint_source, decision.hint_blocks)
        return web.json_response(payload, status=status, headers={"X-Request-Id": request_id})

    async def route(self, request: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        body, tokens, salt, request_id = await self.read_request(request)
        decision, hint_fields = self.decide(tokens, salt, request_id, body.get("destination"))
        self.router.finish(decision, ok=False)
        return web.json_response({**decision.summary(),
                                  "destination_url": decision.destination_url,
                                  "hint": hint_fields or None})

    async def workers(self, request: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        return web.json_response({"block_size": self.router.block_size,
                                  "scheme": ROUTER_SCHEME, "dialect": self.router.dialect,
                                  "workers": self.router.workers()})

    async def refresh(self, request: Any) -> Any:
        """Fleet members only (a signed request, as for a worker's listing): each refresh
        reads every worker's listing, and a failed one marks that worker unhealthy. Calls
        while one runs share it."""
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.auth import AUTH_HEADER, HttpVerifier, serves_request  # noqa: PLC0415
        from kvkern.xfer.httpguard import json_error  # noqa: PLC0415

        if self.cred is None:
            raise json_error(web.HTTPForbidden, "this router has no fleet credential to "
                             "check a refresh's")
        if self._verifier is None:
            self._verifier = HttpVerifier(self.cred)
        auth = self._verifier.check(request.method, request.path_qs,
                                    request.headers.get(AUTH_HEADER),
                                    serves=serves_request(request))
        if not auth.ok:
            raise json_error(web.HTTPUnauthorized, f"refresh refused: {auth.why}")
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh_once())
        return web.json_response(await asyncio.shield(self._refreshing))

    async def metrics_page(self, request: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        from kvkern.serve.routermetrics import CONTENT_TYPE_LATEST  # noqa: PLC0415

        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        return web.Response(text="ok")


def _parse_worker(spec: str, index: int) -> tuple[str, str, str | None]:
    """``[id=]URL[,source=ENDPOINT]`` -> (id, url, source)."""
    source = None
    if ",source=" in spec:
        spec, source = spec.split(",source=", 1)
    wid = f"w{index}"
    if "=" in spec.split("://", 1)[0]:
        wid, spec = spec.split("=", 1)
    if "://" not in spec:
        spec = f"http://{spec}"
    return wid, spec, source


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvkern router",
        description="KV-aware router: destination by load, hint naming the worker with the "
                    "longest cached prefix. Workers are `kvkern worker` processes.")
    p.add_argument("--worker", action="append", default=[], metavar="[ID=]URL[,source=EP]",
                   help="a worker's HTTP base URL (repeat; at least one); source= overrides "
                        "the endpoint hints name for it (default: the URL)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=port, default=8100, help="HTTP port (0: the OS picks)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per block (default: read from the first worker's "
                        "GET /v1/info)")
    p.add_argument("--dialect", choices=DIALECTS, default="kv_hint",
                   help="how hints are written into forwarded requests (docs/hints.md)")
    p.add_argument("--min-hint-blocks", type=positive_int, default=1,
                   help="blocks a source must hold beyond the destination to be named")
    p.add_argument("--refresh-s", type=nonneg_float, default=5.0,
                   help="re-read workers' block listings this often (0: only at start)")
    p.add_argument("--request-timeout-s", type=positive_float, default=120.0,
                   help="bound on one forwarded request")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help="longest prompt taken, in tokens (longer: 413); also bounds the "
                        "request body")
    p.add_argument("--max-forwards", type=positive_int, default=DEFAULT_MAX_FORWARDS,
                   help="requests in flight to one worker; more are answered 503")
    p.add_argument("--fleet-secret-file", default=None, metavar="PATH",
                   help="file holding the fleet secret, to read block listings and sign "
                        "hints (default: KVKERN_FLEET_SECRET_FILE or KVKERN_FLEET_SECRET)")
    p.add_argument("--hint-ttl-s", type=positive_float, default=DEFAULT_HINT_TTL_S,
                   help="how long a signed hint stays valid, in seconds (at most 600)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="stderr log level; INFO shows worker health changes")
    return p


def _check_worker(spec: str, index: int) -> tuple[str, str, str | None]:
    wid, url, source = _parse_worker(spec, index)
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--worker {spec!r}: not [ID=]URL[,source=EP] with an http(s) URL such "
                         "as a=http://10.0.0.5:8000")
    if not wid:
        raise UsageError(f"--worker {spec!r}: empty worker id before '='")
    return wid, url, source


def main(argv: list[str] | None = None) -> int:
    from kvkern.xfer.auth import MAX_HINT_TTL_S, Credential, CredentialError  # noqa: PLC0415
    from kvkern.xfer.httpguard import HttpLimits, run_guarded  # noqa: PLC0415

    prog = "kvkern router"
    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.worker:
        p.error("at least one --worker is needed, e.g. --worker a=http://10.0.0.5:8000")
    try:
        if args.hint_ttl_s > MAX_HINT_TTL_S:
            raise UsageError(f"--hint-ttl-s {args.hint_ttl_s:g} exceeds {MAX_HINT_TTL_S:g} s; "
                             "pass a shorter validity")
        specs = [_check_worker(s, i) for i, s in enumerate(args.worker)]
        ids = [wid for wid, _, _ in specs]
        if len(set(ids)) != len(ids):
            raise UsageError(f"--worker ids must be distinct, got {ids}")
        cred = (Credential.from_file(args.fleet_secret_file, peer_id="router")
                if args.fleet_secret_file else Credential.from_env(peer_id="router"))
        check_port_free(args.host, args.port)
        block_size = args.block_size
        if block_size is None:
            block_size = _fetch_block_size([url for _, url, _ in specs])
        router = KVRouter(block_size, dialect=args.dialect,
                          min_hint_blocks=args.min_hint_blocks)
        for wid, url, source in specs:
            router.add_worker(wid, url, source)
        limits = HttpLimits(max_body_bytes=body_bytes(args.max_tokens))
        app = build_app(router, request_timeout_s=args.request_timeout_s,
                        refresh_s=args.refresh_s or None, credential=cred,
                        hint_ttl_s=args.hint_ttl_s, limits=limits,
                        max_tokens=args.max_tokens, max_forwards=args.max_forwards)
        def listening(bound: int) -> None:
            print(f"kvkern router on http://{args.host}:{bound} -> "
                  + ", ".join(f"{w}={u}" for w, u, _ in specs), flush=True)

        try:
            run_guarded(app, host=args.host, port=args.port, limits=limits,
                        on_listening=listening)
        except OSError as exc:
            if exc.errno not in BIND_ERRNOS:
                raise
            raise bind_error(exc, args.host, args.port) from None
    except UsageError as exc:
        return report(prog, str(exc))
    except CredentialError as exc:
        return report(prog, credential_fix(exc))
    return 0


def _fetch_block_size(urls: list[str], timeout_s: float = 10.0) -> int:
    from kvkern.serve.httpjson import get_json  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        for url in urls:
            try:
                return int(get_json(f"{url}/v1/info", timeout=2.0)["block_size"])
            except Exception as exc:  # noqa: BLE001
                last = exc
        time.sleep(0.5)
    raise UsageError(f"no worker answered GET /v1/info within {timeout_s:g} s ({last}); start "
                     "the workers first or pass --block-size")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
