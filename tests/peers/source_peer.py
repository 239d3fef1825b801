"""A test source worker: a SourceService over a reference BlockPool and random KV, on 127.0.0.1.

Run as ``python tests/peers/source_peer.py [flags]``. It builds a tiny model's KV for every
rank of one DP group (attention DP off) in this process, pre-commits token sequences under
their chained hashes (:func:`kvkern.cache.hashing.sequence_hashes`), starts the service on an
:class:`EventLoopThread` and prints ONE line to stdout (UCX may print other lines there, so
look for the prefix)::

    KVKERN_READY {"http_port": 41234, "ucx_ports": {"0": 40001, "1": 40002}, "pid": 123,
                  "worker_id": "src", "incarnation": "...", "sequences": [[h0, h1, ...], ...]}

It exits when its parent process dies, on SIGTERM/SIGINT, or after ``--lifetime-s``, closing
the service first (every send cancelled, every pin released) and printing
``KVKERN_CLOSED {"pins_outstanding", "active_sends", "listeners_open", "pool": stats}``.

Flags
-----
``--tp N`` / ``--pp N``       parallelism of the worker (default 1 / 1); every rank is hosted
``--layout NAME``             engine layout of every rank's pool (trtllm, vllm_nhd, vllm_hnd,
                              vllm_flash, cross_layer; default trtllm)
``--num-blocks N``            blocks per pool (default 64)
``--layers N --kv-heads N --head-dim N --block-size N --dtype NAME``
                              the model (default 2 layers, 4 KV heads, head_dim 16, block 4,
                              float16)
``--hash-scheme NAME``        default kvkern-blake2b-v1 (kvkern.cache.hashing.DEFAULT_SCHEME)
``--seq SPEC``                pre-commit a token sequence (repeatable): ``A:B`` = tokens
                              ``range(A, B)``, or a comma list ``1,2,3``
``--seed N``                  KV random seed (default 0)
``--chunk-bytes N --chunks-in-flight N --max-concurrent-sends N --max-send-s S``
                              SourceService settings (defaults 16 MiB, 4, 8, 60)
``--stream-min-run-bytes N``  the source's STREAM_MIN_RUN_BYTES: its runs of consecutive
                              blocks this long leave from the pool in chunks of their own
                              (default 4 MiB, more than a test pool holds: every chunk packed)
``--read-hold-s S``           SourceService read_hold_s (default 5; 0: every read waits for the
                              ReadAck)
``--idle-connection-s S``     SourceService idle_connection_s (default 600)
``--remote-read MODE``        SourceService remote_read: host (default; offer one-sided reads
                              of CPU pools of whole block rows, capability "read/1") | off
                              (stream only) | all
``--slow-send-ms MS``         sleep before packing each chunk, and before confirming a read
                              (ReadAck) (fault tests)
``--freeze-after-reply``      after a data-carrying reply (stream or read), send nothing until
                              the deadline, a Cancel or the connection's end (fault tests)
``--http-port N``             default 0 (the OS picks)
``--worker-id ID``            default "source-peer"
``--lifetime-s S``            exit after S seconds (default 120)
``--kv-by-hash``              a committed block's KV is a function of its hash (and rank), so
                              a prefix committed again holds the same bytes

Test-only HTTP routes (``extra_routes``)
----------------------------------------
``GET  /test/stats``      ``{"pool": BlockPool.stats(), "pins_outstanding", "pinned_blocks",
                          "active_sends", "listeners_open", "replies": {"read": n,
                          "stream": n} (data-carrying replies sent, by kind), "acks_delayed":
                          reads whose ReadDone arrived and whose ReadAck is about to be sent
                          (after ``slow_send_ms``)}``
``POST /test/evict``      body ``{"hashes": [...]}``: evict those cached, unheld blocks;
                          answers ``{"evicted": [...], "held": [...], "absent": [...]}``
``POST /test/commit``     body ``{"tokens": [...]}`` or ``{"range": [A, B]}``: commit the full
                          blocks (new blocks get fresh random KV); answers ``{"hashes",
                          "block_ids"}``
``POST /test/churn``      body ``{"tokens", "other", "seconds", "pause_s"}``: in a thread, until
                          the time is up: evict ``tokens``' blocks, commit ``other`` (fresh
                          KV in the blocks just freed), evict those, commit ``tokens`` again,
                          hold them ``pause_s``;
                          ``GET /test/churn`` answers ``{"rounds", "running", "error"}``
``GET  /test/blocks``     ``?hashes=h1,h2[&layers=A:B][&heads=C:D]``: per hash, its block id
                          and per rank the sha256 of the block's canonical staging bytes
                          ``[1, L', 2, H', T, D]`` (rank-local layer/head ranges; all by
                          default), or null when not cached
``POST /test/faults``     body ``{"slow_send_ms": 0, "freeze_after_reply": false,
                          "read_hold_s": 5, "read_reply_delay_ms": 0,
                          "short_chunk_bytes": 0, "abort_before_replies": 0,
                          "chunk_bytes": 16 MiB}``: change the
                          fault knobs at run time (``read_reply_delay_ms`` holds a read's
                          reply back, its blocks pinned; ``short_chunk_bytes`` sends each
                          stream's first chunk that many bytes short of what its reply
                          announced; ``abort_before_replies`` answers that many requests by
                          aborting their connection instead; ``chunk_bytes`` is the
                          source's own chunk size, which may cut streams finer than
                          destinations accept)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import hashlib
import itertools
import json
import os
import signal
import sys
import threading
import time

import torch
from aiohttp import web

from kvkern.cache.hashing import DEFAULT_SCHEME, sequence_hashes
from kvkern.cache.pool import BlockPool
from kvkern.kernels.pack import pack, unpack
from kvkern.layout.kv_layout import allocate_staging
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import ReadGrant, Status
from kvkern.xfer.runtime import EventLoopThread
from kvkern.xfer.source import REMOTE_READ_MODES, PeerQuotas, SourceService

READY_PREFIX = "KVKERN_READY "
CLOSED_PREFIX = "KVKERN_CLOSED "


class FaultySource(SourceService):
    """SourceService with run-time fault knobs for tests, counting the replies it sends by
    kind (one-sided read or stream) and the read acks it is about to send."""

    def __init__(self, *args, slow_send_ms: float = 0.0, freeze_after_reply: bool = False,
                 **kw) -> None:
        super().__init__(*args, **kw)
        self.slow_send_ms = slow_send_ms
        self.freeze_after_reply = freeze_after_reply
        self.read_reply_delay_ms = 0.0
        self.short_chunk_bytes = 0  # a stream's first chunk is sent this many bytes short
        self.abort_before_replies = 0  # requests answered by aborting their connection
        self.requests_aborted = 0
        self.replies = {"read": 0, "stream": 0}
        self.acks_delayed = 0
        self._read_tids: set[int] = set()  # read replies whose ReadAck is not sent yet

    async def _reply(self, s, reply) -> None:
        if self.abort_before_replies > 0:  # the connection dies under the request
            self.abort_before_replies -= 1
            self.requests_aborted += 1
            s.conn.abort("test: abort_before_replies")
            raise ConnectionAbortedError("aborted by the test before its reply")
        # counted when handed to the transport: a destination that reads the grant at once
        # may end its pull, and ask for these counts, before this send's completion is seen
        if reply.status in (Status.OK, Status.PARTIAL):
            kind = "read" if isinstance(reply, ReadGrant) else "stream"
            self.replies[kind] += 1
            if isinstance(reply, ReadGrant):
                self._read_tids.add(reply.transfer_id)
        await super()._reply(s, reply)

    def _producer(self, s, pieces, block_ids, chunks):
        produce = super()._producer(s, pieces, block_ids, chunks)
        cut = self.short_chunk_bytes
        if cut <= 0:
            return produce

        async def short(i: int):
            buf = await produce(i)
            return buf[:max(buf.numel() - cut, 0)] if i == 0 else buf

        return short

    async def _before_read_reply(self, transfer_id: int) -> None:
        if self.read_reply_delay_ms > 0:  # the blocks are pinned, the reply is held back
            await asyncio.sleep(self.read_reply_delay_ms / 1000)

    async def _after_reply(self, req, reply) -> None:
        if self.freeze_after_reply:
            await asyncio.Event().wait()  # until the deadline, a Cancel or close cancels us

    async def _before_chunk(self, transfer_id: int, index: int) -> None:
        if transfer_id in self._read_tids:  # a read: ReadDone arrived, the ack comes next
            self._read_tids.discard(transfer_id)
            self.acks_delayed += 1
        if self.slow_send_ms > 0:
            await asyncio.sleep(self.slow_send_ms / 1000)


def parse_tokens(spec: str) -> list[int]:
    if ":" in spec:
        a, b = spec.split(":")
        return list(range(int(a), int(b)))
    return [int(x) for x in spec.split(",") if x.strip()]


def parse_range(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    a, b = spec.split(":")
    return int(a), int(b)


class Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        model = ModelKVSpec(num_layers=args.layers, num_kv_heads=args.kv_heads,
                            head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype)
        self.topo = Topology(model=model, parallel=Parallelism(tp_size=args.tp,
                                                               pp_size=args.pp))
        self.pool = BlockPool(args.num_blocks, block_size=args.block_size,
                              hash_scheme=args.hash_scheme)
        self.gen = torch.Generator().manual_seed(args.seed)
        ranks = {}
        for r in self.topo.ranks_of_dp(0):
            layout = self.topo.local_layout(r, args.num_blocks, args.layout)
            ranks[r] = RankKV(r, layout, layout.allocate(fill="random", generator=self.gen))
        self.group = KVGroup(self.topo, 0, self.pool, ranks)
        self.lock = threading.Lock()  # KV writes (commit) vs reads (blocks)
        self.churned: dict = {"rounds": 0, "running": False, "error": None}
        self.service = FaultySource(
            [self.group], worker_id=args.worker_id, http_port=args.http_port,
            chunk_bytes=args.chunk_bytes, min_chunk_bytes=0,  # (tests slice tiny blocks)
            chunks_in_flight=args.chunks_in_flight,
            max_concurrent_sends=args.max_concurrent_sends, max_send_s=args.max_send_s,
            slow_send_ms=args.slow_send_ms, freeze_after_reply=args.freeze_after_reply,
            remote_read=args.remote_read, read_hold_s=args.read_hold_s,
            idle_connection_s=args.idle_connection_s,
            quotas=PeerQuotas(max_sends_per_peer=args.max_sends_per_peer,
                              peer_pin_fraction=args.peer_pin_fraction,
                              total_pin_fraction=args.total_pin_fraction),
            extra_routes=[web.get("/test/stats", self.h_stats),
                          web.post("/test/evict", self.h_evict),
                          web.post("/test/commit", self.h_commit),
                          web.get("/test/blocks", self.h_blocks),
                          web.post("/test/churn", self.h_churn),
                          web.get("/test/churn", self.h_churn),
                          web.post("/test/faults", self.h_faults)])

    # ---- KV helpers

    def commit_tokens(self, tokens: list[int], placement: str = "chain") -> dict:
        """Cache ``tokens``' full blocks with fresh KV. ``placement``: "chain" commits the
        whole chain from its start (the directory places it with its chain); "hash" commits
        the new blocks under a parent the pool does not hold, as an engine that does not
        name it would (placed by hash alone)."""
        hs = sequence_hashes(tokens, self.args.block_size, self.args.hash_scheme)
        if not hs:
            return {"hashes": [], "block_ids": []}
        with self.lock:
            have = self.pool.acquire_prefix(hs)
            new = self.pool.allocate(len(hs) - len(have))
            if new is None:
                self.pool.release(have)
                raise web.HTTPInsufficientStorage(text="pool full")
            for r, rkv in self.group.ranks.items():  # fresh KV in the new blocks
                if not new:
                    break
                staging = allocate_staging(rkv.layout, len(new))
                flat = staging.view(-1).view(torch.uint8)
                if self.args.kv_by_hash:  # each block's bytes a function of its hash
                    per = flat.numel() // len(new)
                    for j, h in enumerate(hs[len(have):]):
                        g = torch.Generator().manual_seed((h + r) & ((1 << 63) - 1))
                        flat[j * per:(j + 1) * per].copy_(
                            torch.randint(0, 256, (per,), dtype=torch.uint8, generator=g))
                else:
                    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8,
                                             generator=self.gen))
                unpack(staging, rkv.pool, rkv.layout, new)
            ids = have + new
            if placement == "hash" and new:
                unknown = next(x for x in itertools.count(1 << 63)
                               if self.pool.longest_prefix([x]) == 0)
                self.pool.commit(new, hs[len(have):], parent=unknown)
            else:
                self.pool.commit(ids, hs)
            self.pool.release(ids)
        return {"hashes": hs, "block_ids": ids}

    def churn(self, tokens: list[int], other: list[int], seconds: float,
              pause_s: float) -> None:
        """Until ``seconds`` pass: evict ``tokens``' blocks, commit ``other`` (its fresh KV
        lands in the blocks just freed), evict those, commit ``tokens`` again, hold them
        ``pause_s``; counts rounds in ``self.churned``."""
        hs = sequence_hashes(tokens, self.args.block_size, self.args.hash_scheme)
        hs_other = sequence_hashes(other, self.args.block_size, self.args.hash_scheme)
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                self.evict(hs)
                self.commit_tokens(other)
                self.evict(hs_other)
                self.commit_tokens(tokens)
                self.churned["rounds"] += 1
                time.sleep(pause_s)
        except Exception as exc:  # noqa: BLE001 (reported by GET /test/churn)
            self.churned["error"] = repr(exc)
        finally:
            self.churned["running"] = False

    def evict(self, hashes: list[int]) -> dict:
        """Drop cached, unheld blocks from the index (BlockPool.evict), then check the pool."""
        out = self.pool.evict(hashes)
        self.pool.check_invariants()
        return out

    def block_digests(self, hashes: list[int], layers, heads) -> dict:
        out = {}
        with self.lock:
            for h in hashes:
                ids = self.pool.match_prefix([h])
                if not ids:
                    out[str(h)] = None
                    continue
                sha = {}
                for r, rkv in self.group.ranks.items():
                    staged = pack(rkv.pool, rkv.layout, ids, layers=layers, heads=heads)
                    sha[str(r)] = hashlib.sha256(
                        staged.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    ).hexdigest()
                out[str(h)] = {"block_id": ids[0], "sha256": sha}
        return out

    # ---- routes

    async def h_stats(self, request: web.Request) -> web.Response:
        s = self.service
        return web.json_response({"pool": self.pool.stats(), "pins_outstanding":
                                  s.pins_outstanding, "pinned_blocks": s.pinned_blocks,
                                  "active_sends": s.active_sends,
                                  "listeners_open": s.listeners_open,
                                  "replies": dict(s.replies),
                                  "acks_delayed": s.acks_delayed})

    async def h_evict(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(self.evict([int(h) for h in body["hashes"]]))

    async def h_commit(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = body["tokens"] if "tokens" in body else list(range(*body["range"]))
        return web.json_response(self.commit_tokens([int(t) for t in tokens],
                                                    str(body.get("placement", "chain"))))

    async def h_churn(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            body = await request.json()
            if self.churned["running"]:
                raise web.HTTPConflict(text="already churning")
            self.churned.update(rounds=0, running=True, error=None)
            threading.Thread(target=self.churn, daemon=True,
                             args=([int(t) for t in body["tokens"]],
                                   [int(t) for t in body["other"]],
                                   float(body["seconds"]),
                                   float(body.get("pause_s", 0.0)))).start()
        return web.json_response(self.churned)

    async def h_blocks(self, request: web.Request) -> web.Response:
        q = request.query
        hashes = [int(h) for h in q.get("hashes", "").split(",") if h]
        return web.json_response(self.block_digests(
            hashes, parse_range(q.get("layers")), parse_range(q.get("heads"))))

    async def h_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "slow_send_ms" in body:
            self.service.slow_send_ms = float(body["slow_send_ms"])
        if "freeze_after_reply" in body:
            self.service.freeze_after_reply = bool(body["freeze_after_reply"])
        if "read_hold_s" in body:
            self.service.read_hold_s = float(body["read_hold_s"])
        if "read_reply_delay_ms" in body:
            self.service.read_reply_delay_ms = float(body["read_reply_delay_ms"])
        if "short_chunk_bytes" in body:
            self.service.short_chunk_bytes = int(body["short_chunk_bytes"])
        if "abort_before_replies" in body:
            self.service.abort_before_replies = int(body["abort_before_replies"])
        if "chunk_bytes" in body:
            self.service.config = dataclasses.replace(self.service.config,
                                                      chunk_bytes=int(body["chunk_bytes"]))
        return web.json_response({"slow_send_ms": self.service.slow_send_ms,
                                  "freeze_after_reply": self.service.freeze_after_reply,
                                  "read_hold_s": self.service.read_hold_s,
                                  "read_reply_delay_ms": self.service.read_reply_delay_ms,
                                  "short_chunk_bytes": self.service.short_chunk_bytes,
                                  "abort_before_replies": self.service.abort_before_replies,
                                  "requests_aborted": self.service.requests_aborted,
                                  "chunk_bytes": self.service.config.chunk_bytes})


def main() -> int:
    faulthandler.enable()  # a crash leaves its Python stacks on stderr (the test's output)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--layout", default="trtllm")
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--hash-scheme", default=DEFAULT_SCHEME)
    ap.add_argument("--seq", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-bytes", type=int, default=16 << 20)
    ap.add_argument("--chunks-in-flight", type=int, default=4)
    ap.add_argument("--stream-min-run-bytes", type=int, default=0)
    ap.add_argument("--max-concurrent-sends", type=int, default=8)
    ap.add_argument("--max-send-s", type=float, default=60.0)
    ap.add_argument("--remote-read", choices=REMOTE_READ_MODES, default="host")
    ap.add_argument("--read-hold-s", type=float, default=5.0)
    ap.add_argument("--idle-connection-s", type=float, default=600.0)
    # quotas off by default (tiny pools); the quota tests set them
    ap.add_argument("--max-sends-per-peer", type=int, default=8)
    ap.add_argument("--peer-pin-fraction", type=float, default=1.0)
    ap.add_argument("--total-pin-fraction", type=float, default=1.0)
    ap.add_argument("--slow-send-ms", type=float, default=0.0)
    ap.add_argument("--freeze-after-reply", action="store_true")
    ap.add_argument("--http-port", type=int, default=0)
    ap.add_argument("--worker-id", default="source-peer")
    ap.add_argument("--lifetime-s", type=float, default=120.0)
    ap.add_argument("--kv-by-hash", action="store_true")
    args = ap.parse_args()

    if args.stream_min_run_bytes:
        from kvkern.xfer import send  # noqa: PLC0415

        send.STREAM_MIN_RUN_BYTES = args.stream_min_run_bytes
    parent = os.getppid()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    peer = Peer(args)
    sequences = [peer.commit_tokens(parse_tokens(spec))["hashes"] for spec in args.seq]
    rt = EventLoopThread("source-peer")
    try:
        rt.run(peer.service.start(), 30)
        ready = {"http_port": peer.service.http_port,
                 "ucx_ports": {str(r): p for r, p in peer.service.ucx_ports.items()},
                 "pid": os.getpid(), "worker_id": args.worker_id,
                 "incarnation": peer.service.incarnation, "sequences": sequences}
        sys.stdout.write(READY_PREFIX + json.dumps(ready) + "\n")
        sys.stdout.flush()
        end = time.monotonic() + args.lifetime_s
        while not stop.wait(0.2):
            if os.getppid() != parent or time.monotonic() > end:
                break
    finally:
        try:
            rt.run(peer.service.close(), 10)
        except Exception as exc:  # noqa: BLE001 (exiting anyway)
            print(f"source peer close failed: {exc!r}", file=sys.stderr)
        rt.close(5)
        s = peer.service
        closed = {"pins_outstanding": s.pins_outstanding, "active_sends": s.active_sends,
                  "listeners_open": s.listeners_open, "pool": peer.pool.stats()}
        sys.stdout.write(CLOSED_PREFIX + json.dumps(closed) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
