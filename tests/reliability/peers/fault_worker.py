"""``kvkern worker`` with test-only fault knobs and admin routes, for the reliability suite.

Run as ``python tests/reliability/peers/fault_worker.py [kvkern worker flags]``. It is the real
worker (:func:`kvkern.serve.worker.main`: engine, pool, source service, puller, HTTP API, the
``KVKERN_READY`` line) with its :class:`~kvkern.xfer.source.SourceService` replaced by
:class:`FaultSource`, a subclass that adds the routes below. No library file changes.

``KVKERN_TEST_MAX_SENDS`` (env) sets the source's ``max_concurrent_sends`` and its per-peer
quota of sends (default 8).

State faults, chosen per request by the query of the state URL (so a hint can name a fresh,
uncached state URL per case)::

    GET /kvkern/v1/state?fault=MODE
        500 | garbage (bytes) | array (JSON list) | bad_schema (fields missing) |
        oversized (2 MiB) | slow (answers after 20 s) | slow_body (headers, then a byte a
        second) | redirect (302) | protocol (kvkern/9) | scheme (another hash scheme) |
        block_size (another) | ucx_foreign (UCX address 10.9.9.9) | evict (serves the state,
        then evicts the armed blocks: a miss between state fetch and pull)

Routes::

    GET  /test/stats       {"pool": BlockPool.stats(), "pins_outstanding", "pinned_blocks",
                            "active_sends", "listeners_open", "puller_inflight",
                            "prefetching": requests not schedulable, "faults": the knobs,
                            "replies": {"read": n, "stream": n} (data-carrying replies sent,
                            by kind), "acks_delayed": reads whose ReadDone arrived and whose
                            ReadAck comes next (after slow_send_ms)}
    POST /test/faults      {"slow_send_ms" (also before a read's ReadAck),
                            "freeze_after_reply", "reply_fault", "evict_armed": [pool
                            hashes], "remote_read": bool} (any subset); answers the knobs.
                           remote_read false: serve as a ``remote_read="off"`` source would
                           (no "read/1" in the state, read requests streamed); true (the
                           default): as configured.
                           reply_fault (one shot, the next data-carrying reply):
                           served_over (a read reply's read_blocks grow with it) |
                           wrong_hashes | chunk_oversize | total_mismatch | wrong_tid |
                           status_error | chunk_overrun (chunk 0 longer than announced) |
                           chunk_underrun (chunk 0 shorter than announced) |
                           read_stride_short (a read reply's stride below the block size) |
                           read_bytes_over (a read reply announces 4 KiB more than its blocks)
                           | read_order_flipped (a read reply calls its canonical segments
                           the pool's own order) | ack_not_held (a read's ReadAck says
                           held=False)
    POST /test/evict       {"hashes": [...]} or {"tokens": [...]}: evict cached unheld blocks
    POST /test/cancel      {"request_id"}: cancel the request's pull -> {"cancelled": bool}
    GET  /test/request     ?id=RID -> {"state": the puller's lifecycle state of RID's pull}
    POST /test/blocks      {"hashes": [...]} or {"tokens": [...]}: per pool hash, the sha256
                           of the block's canonical staging bytes, or null when not cached
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from typing import Any

import msgspec
import torch
from aiohttp import web

import kvkern.xfer.source as source_mod
from kvkern.cache.hashing import sequence_hashes
from kvkern.kernels.pack import pack
from kvkern.serve import worker as worker_mod
from kvkern.xfer.messages import READ_CAPABILITY, PullReply, ReadAck, ReadGrant, Refusal, Status
from kvkern.xfer.transport import Lane, tag_for

_BaseSource = source_mod.SourceService
WORKER: dict[str, Any] = {}
REPLY_FAULTS = ("served_over", "wrong_hashes", "chunk_oversize", "total_mismatch", "wrong_tid",
                "status_error", "chunk_overrun", "chunk_underrun", "read_stride_short",
                "read_bytes_over",
                "read_order_flipped", "ack_not_held")


def _pull_id(puller: Any, request_id: str) -> str:
    """The id the worker pulls a request's hint under: ``<request_id>/<a fresh hex id>``
    (the latest such), or ``request_id`` itself when there is none yet."""
    with puller._lock:
        ids = list(puller._records)
    return next((k for k in reversed(ids) if k.startswith(request_id + "/")), request_id)

class FaultSource(_BaseSource):
    """The worker's source service plus fault knobs and admin routes."""

    def __init__(self, *args: Any, extra_routes: Any = None, **kw: Any) -> None:
        routes = list(extra_routes or ()) + [
            web.get("/test/stats", self.h_stats), web.post("/test/faults", self.h_faults),
            web.post("/test/evict", self.h_evict), web.post("/test/cancel", self.h_cancel),
            web.get("/test/request", self.h_request), web.post("/test/blocks", self.h_blocks)]
        sends = int(os.environ.get("KVKERN_TEST_MAX_SENDS", "8"))
        kw.setdefault("max_concurrent_sends", sends)
        kw.setdefault("quotas", source_mod.PeerQuotas(max_sends_per_peer=sends))
        super().__init__(*args, extra_routes=routes, **kw)
        self.slow_send_ms = 0.0
        self.freeze_after_reply = False
        self.reply_fault: str | None = None
        self.evict_armed: list[int] = []
        self._resized: dict[int, int] = {}  # transfer id -> bytes chunk 0 is sent off by
        # the remote_read knob (SourceService.remote_read is the configured mode, untouched):
        # False serves as a remote_read="off" source would
        self.reads_offered = True
        self.replies = {"read": 0, "stream": 0}
        self.acks_delayed = 0
        self._reads: dict[int, Any] = {}  # read replies sent, ack not yet: tid -> _Send
        self._ack_not_held: set[int] = set()

    # ---------------------------------------------------------------- helpers

    @property
    def pool(self) -> Any:
        return self.groups[0].manager

    def _hashes(self, body: dict) -> list[int]:
        if "tokens" in body:
            return sequence_hashes([int(t) for t in body["tokens"]],
                                   self.topology.model.block_size, self.pool.hash_scheme)
        return [int(h) for h in body.get("hashes", [])]

    def evict(self, hashes: list[int]) -> dict:
        """Drop cached, unheld blocks from the index (BlockPool.evict), then check the pool."""
        out = self.pool.evict(hashes)
        self.pool.check_invariants()
        return out

    def knobs(self) -> dict:
        return {"slow_send_ms": self.slow_send_ms, "freeze_after_reply": self.freeze_after_reply,
                "reply_fault": self.reply_fault, "evict_armed": len(self.evict_armed),
                "remote_read": self.reads_offered, "read_hold_s": self.read_hold_s}

    # ---------------------------------------------------------------- reads on / off

    def state(self) -> dict:
        st = super().state()
        if not self.reads_offered:
            st["capabilities"] = [c for c in st["capabilities"] if c != READ_CAPABILITY]
        return st

    def _accept(self, conn: Any, ctx: Any, conn_sends: Any, req: Any) -> None:
        if req.read and not self.reads_offered:  # a destination with an older state asks
            req = msgspec.structs.replace(req, read=False)
        super()._accept(conn, ctx, conn_sends, req)

    # ---------------------------------------------------------------- fault hooks

    async def _after_reply(self, req: Any, reply: Any) -> None:
        if self.freeze_after_reply:
            await asyncio.Event().wait()  # until the deadline, a Cancel or close cancels us

    async def _before_chunk(self, transfer_id: int, index: int) -> None:
        s = self._reads.pop(transfer_id, None)
        if s is not None:  # a read: ReadDone arrived, the ReadAck comes next
            self.acks_delayed += 1
            if transfer_id in self._ack_not_held:
                self._ack_not_held.discard(transfer_id)
                await s.conn.send_msg(ReadAck(transfer_id=transfer_id, held=False,
                                              reason="injected: pins not held"),
                                      tag_for(transfer_id, Lane.REPLY, 1), timeout=5.0)
                await asyncio.Event().wait()  # until the destination's Cancel or deadline
        if self.slow_send_ms > 0:
            await asyncio.sleep(self.slow_send_ms / 1000)

    def _finished(self, s: Any, task: Any) -> None:
        super()._finished(s, task)
        tid = s.req.transfer_id
        if self._reads.get(tid) is s:  # a read that ended before its ack
            del self._reads[tid]
            self._ack_not_held.discard(tid)

    async def _reply(self, s: Any, reply: PullReply) -> None:
        fault = self.reply_fault
        if fault and reply.status in (Status.OK, Status.PARTIAL):
            self.reply_fault = None  # one shot
            reply = self._corrupt(fault, s.req, reply)
        if isinstance(reply, ReadGrant):
            self._reads[s.req.transfer_id] = s
        await super()._reply(s, reply)
        if reply.status in (Status.OK, Status.PARTIAL):
            self.replies["read" if isinstance(reply, ReadGrant) else "stream"] += 1

    def _corrupt(self, fault: str, req: Any, r: PullReply) -> PullReply:
        rep = msgspec.structs.replace
        if fault == "served_over":  # more blocks than requested, hashes beyond the range
            more = {}
            if isinstance(r, ReadGrant):  # a consistent read reply: 2 more pool blocks of the same size
                more = {"read_blocks": [*r.read_blocks, *r.read_blocks[:2]],
                        "total_bytes": r.total_bytes + 2 * (r.total_bytes // r.served_blocks)}
            return rep(r, served_blocks=r.served_blocks + 2,
                       block_hashes=[*r.block_hashes, 12345, 67890], **more)
        if fault == "wrong_hashes":
            return rep(r, block_hashes=[(h + 1) % (1 << 64) for h in r.block_hashes])
        if fault == "chunk_oversize":  # one chunk above the agreed chunk_bytes
            big = req.chunk_bytes + 4096
            return rep(r, n_chunks=1, chunk_sizes=[big], total_bytes=big)
        if fault == "total_mismatch":  # an extra chunk: more bytes than the blocks hold
            return rep(r, n_chunks=r.n_chunks + 1, chunk_sizes=[*r.chunk_sizes, 4096],
                       total_bytes=r.total_bytes + 4096)
        if fault == "wrong_tid":
            other = r.transfer_id % ((1 << 30) - 2) + 1
            return rep(r, transfer_id=other)
        if fault == "status_error":
            return Refusal(transfer_id=r.transfer_id, status=Status.ERROR,
                           reason="internal: injected")
        if fault in ("chunk_overrun", "chunk_underrun"):
            self._resized[req.transfer_id] = 4096 if fault == "chunk_overrun" else -4096
            return r
        if fault in ("read_stride_short", "read_bytes_over", "read_order_flipped",
                     "ack_not_held") \
                and not isinstance(r, ReadGrant):
            raise ValueError(f"reply fault {fault!r} needs a read reply (remote_read on, a "
                             f"destination asking for a read)")
        if fault == "read_stride_short":  # blocks would overlap: half a block apart
            return rep(r, read_stride=r.read_stride // 2)
        if fault == "read_bytes_over":
            return rep(r, total_bytes=r.total_bytes + 4096)
        if fault == "read_order_flipped":  # same sizes, the other byte order: never copy it
            return rep(r, read_native=not r.read_native)
        if fault == "ack_not_held":
            self._ack_not_held.add(req.transfer_id)
            return r
        raise ValueError(f"unknown reply fault {fault!r}")

    def _producer(self, s: Any, pieces: Any, block_ids: Any, chunks: Any):
        produce = super()._producer(s, pieces, block_ids, chunks)
        off = self._resized.pop(s.req.transfer_id, 0)
        if not off:
            return produce

        async def resized(i: int) -> torch.Tensor:
            buf = await produce(i)
            if i == 0 and off > 0:  # more than the reply announced
                buf = torch.cat([buf.reshape(-1), torch.zeros(off, dtype=torch.uint8)])
            elif i == 0:  # less than the reply announced
                buf = buf.reshape(-1)[:off]
            return buf

        return resized

    async def _http_state(self, request: web.Request) -> web.StreamResponse:
        fault = request.query.get("fault", "")
        if not fault:
            return await super()._http_state(request)
        state = self.state()
        if fault == "500":
            return web.Response(status=500, text="injected failure")
        if fault == "garbage":
            return web.Response(body=os.urandom(512), content_type="application/octet-stream")
        if fault == "array":
            return web.json_response([1, 2, 3])
        if fault == "bad_schema":
            return web.json_response({"protocol": "kvkern/1", "worker_id": 7})
        if fault == "oversized":
            return web.json_response({**state, "padding": "x" * (2 << 20)})
        if fault == "slow":
            await asyncio.sleep(20)
            return web.json_response(state)
        if fault == "slow_body":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            for _ in range(20):
                await resp.write(b" ")
                await asyncio.sleep(1.0)
            return resp
        if fault == "redirect":
            raise web.HTTPFound(location="http://169.254.169.254/latest/meta-data/")
        if fault == "protocol":
            return web.json_response({**state, "protocol": "kvkern/9"})
        if fault == "scheme":
            other = "trtllm-v1" if state["hash_scheme"] != "trtllm-v1" else "public-xxh3-v1"
            return web.json_response({**state, "hash_scheme": other})
        if fault == "block_size":
            return web.json_response({**state, "block_size": state["block_size"] * 2})
        if fault == "ucx_foreign":
            for g in state["dp_groups"].values():
                for r in g["ranks"].values():
                    r["ucx_host"] = "10.9.9.9"
            return web.json_response(state)
        if fault == "evict":
            resp = web.json_response(state)
            armed, self.evict_armed = self.evict_armed, []
            self.evict(armed)  # after the state is built, before the pull arrives
            return resp
        return web.Response(status=400, text=f"unknown fault {fault!r}")

    # ---------------------------------------------------------------- routes

    async def h_stats(self, request: web.Request) -> web.Response:
        w = WORKER.get("worker")
        puller = getattr(w, "puller", None)
        prefetching = 0
        if puller is not None:
            with puller._lock:
                prefetching = sum(1 for r in puller._records.values()
                                  if not r.state.schedulable)
        return web.json_response({
            "pool": self.pool.stats(), "pins_outstanding": self.pins_outstanding,
            "pinned_blocks": self.pinned_blocks, "active_sends": self.active_sends,
            "listeners_open": self.listeners_open,
            "puller_inflight": puller.inflight if puller is not None else 0,
            "prefetching": prefetching, "faults": self.knobs(), "replies": dict(self.replies),
            "acks_delayed": self.acks_delayed})

    async def h_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "slow_send_ms" in body:
            self.slow_send_ms = float(body["slow_send_ms"])
        if "freeze_after_reply" in body:
            self.freeze_after_reply = bool(body["freeze_after_reply"])
        if "reply_fault" in body:
            fault = body["reply_fault"]
            if fault is not None and fault not in REPLY_FAULTS:
                raise web.HTTPBadRequest(text=f"unknown reply fault {fault!r}")
            self.reply_fault = fault
        if "evict_armed" in body:
            self.evict_armed = [int(h) for h in body["evict_armed"]]
        if "remote_read" in body:
            self.reads_offered = bool(body["remote_read"])
        if "read_hold_s" in body:
            self.read_hold_s = float(body["read_hold_s"])
        return web.json_response(self.knobs())

    async def h_evict(self, request: web.Request) -> web.Response:
        return web.json_response(self.evict(self._hashes(await request.json())))

    async def h_cancel(self, request: web.Request) -> web.Response:
        body = await request.json()
        puller = WORKER["worker"].puller
        return web.json_response({"cancelled": puller.cancel(
            _pull_id(puller, str(body["request_id"])))})

    async def h_request(self, request: web.Request) -> web.Response:
        puller = WORKER["worker"].puller
        rid = _pull_id(puller, request.query["id"])
        outcome = puller.outcome(rid)  # with the detail a tenant's response leaves out
        return web.json_response({"state": puller.state(rid).value,
                                  "detail": outcome.detail if outcome is not None else None})

    async def h_blocks(self, request: web.Request) -> web.Response:
        hashes = self._hashes(await request.json())
        rkvs = [(r, rkv) for g in self.groups for r, rkv in sorted(g.ranks.items())]
        out: dict[str, Any] = {}
        for h in hashes:
            ids = self.pool.match_prefix([h])
            if not ids:
                out[str(h)] = None
                continue
            sha = hashlib.sha256()
            for _, rkv in rkvs:
                staged = pack(rkv.pool, rkv.layout, ids)
                sha.update(staged.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            out[str(h)] = sha.hexdigest()
        return web.json_response(out)


def main(argv: list[str] | None = None) -> int:
    source_mod.SourceService = FaultSource  # Worker.start imports it from the module
    original_start = worker_mod.Worker.start

    def start(self: Any, *args: Any, **kw: Any) -> Any:
        WORKER["worker"] = self
        return original_start(self, *args, **kw)

    worker_mod.Worker.start = start
    return worker_mod.main(argv)


if __name__ == "__main__":
    sys.exit(main())
