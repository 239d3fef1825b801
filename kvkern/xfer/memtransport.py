"""An in-memory transport behind the seam (:mod:`kvkern.xfer.seam`), with fault injection:
a :class:`MemoryConnector` whose connections are served by a :class:`MemorySource` in the
same process (the stream path; it offers no one-sided reads). The control logic of the pull
path (admission, de-duplication, policies, leases, cancels, fallback reasons) runs on it in
milliseconds; the UCXX transport stays covered by the real-process tests.

Faults (:class:`Faults`, changeable between pulls): ``drop`` (no reply ever comes),
``delay_s`` (every reply and chunk waits), ``stall_after`` (the stream stops after that many
chunks), ``corrupt`` (``"hashes"``: the reply names other blocks; ``"bytes"``: the chunks
carry other bytes), ``disconnect`` (``"connect"``, ``"request"`` or ``"stream"``: the
connection fails there, ``peer_closed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvkern.kernels.pack import pack
from kvkern.layout.chunks import plan_chunks
from kvkern.xfer.codes import RejectCode, reply_text
from kvkern.xfer.kvgroup import KVGroup
from kvkern.xfer.messages import DEFAULT_CODEC, Cancel, PullReply, PullRequest, Status
from kvkern.xfer.send import RankCtx, Rejected, validate_request
from kvkern.xfer.state import CAPABILITIES, PROTOCOL, DpGroupDoc, RankDoc, StateDoc
from kvkern.xfer.transport import Lane, TransportError, tag_for

__all__ = ["Faults", "MemoryConnection", "MemoryConnector", "MemorySource"]


@dataclass
class Faults:
    drop: bool = False
    delay_s: float = 0.0
    stall_after: int | None = None
    corrupt: str | None = None  # "hashes" | "bytes"
    disconnect: str | None = None  # "connect" | "request" | "stream"


class MemorySource:
    """Serves the blocks of ``group`` (every rank hosted here) to memory connections."""

    def __init__(self, group: KVGroup, *, worker_id: str = "memory-source",
                 chunk_bytes: int = 1 << 20) -> None:
        self.group = group
        self.worker_id = worker_id
        self.chunk_bytes = chunk_bytes
        self.faults = Faults()
        self.requests: list[PullRequest] = []
        self.cancels: list[Cancel] = []
        self.pins_outstanding = 0

    def state_body(self, host: str = "127.0.0.1", port: int = 5000) -> bytes:
        """The state document a real source would publish (every rank at ``host:port``)."""
        g = self.group
        ranks = {str(r): RankDoc(ucx_host=host, ucx_port=port, layout=rkv.layout.describe())
                 for r, rkv in g.ranks.items()}
        doc = StateDoc(protocol=PROTOCOL, worker_id=self.worker_id, incarnation="memory",
                       hash_scheme=g.hash_scheme, block_size=g.block_size,
                       codec_fingerprint=f"{DEFAULT_CODEC.fingerprint:016x}", model=g.model_id,
                       topology=g.topology.to_dict(),
                       dp_groups={str(g.dp_rank): DpGroupDoc(ranks=ranks)},
                       capabilities=list(CAPABILITIES))
        return msgspec.json.encode(doc)

    def serve(self, req: PullRequest) -> tuple[PullReply, list[Any]]:
        """The reply to ``req`` and the chunks that follow it (pins released at once: the
        chunks are already packed)."""
        self.requests.append(req)
        src_rank = req.pieces[0].src_rank if req.pieces else 0
        ctx = RankCtx(self.group, self.group.ranks[src_rank])
        try:
            pieces = validate_request(ctx, req, model_id=self.group.model_id,
                                      chunk_bytes=self.chunk_bytes)
        except Rejected as rej:
            return PullReply(transfer_id=req.transfer_id, status=Status.REJECTED,
                             reason=str(rej)), []
        handle = self.group.manager.pin(req.requested_hashes, require_all=req.require_all)
        if handle is None:
            return PullReply(transfer_id=req.transfer_id, status=Status.MISS,
                             reason=reply_text(RejectCode.MISS, "not cached")), []
        self.pins_outstanding += 1
        try:
            chunks = self._pack(ctx, pieces, list(handle.block_ids), req)
        finally:
            self.group.manager.unpin(handle)
            self.pins_outstanding -= 1
        n = len(handle.block_ids)
        hashes = list(handle.hashes)
        if self.faults.corrupt == "hashes":
            hashes = [h ^ 1 for h in hashes]
        reply = PullReply(transfer_id=req.transfer_id,
                          status=Status.OK if n == req.count else Status.PARTIAL,
                          served_blocks=n, block_hashes=hashes,
                          total_bytes=sum(int(c.numel()) for c in chunks), n_chunks=len(chunks),
                          chunk_sizes=[int(c.numel()) for c in chunks])
        return reply, chunks

    def _pack(self, ctx: RankCtx, pieces: list, block_ids: list[int],
              req: PullRequest) -> list[Any]:
        import torch  # noqa: PLC0415

        rkv, lay = ctx.rkv, ctx.rkv.layout
        limit = min(req.chunk_bytes, self.chunk_bytes)
        out = []
        for c in plan_chunks([p.length for p in pieces], len(block_ids), limit):
            p = pieces[c.piece]
            staged = pack(rkv.pool, lay, block_ids[c.b0:c.b1], layers=p.layers, heads=p.heads)
            flat = staged.reshape(-1).view(torch.uint8)[c.lo:c.hi].clone()
            if self.faults.corrupt == "bytes":
                flat ^= 0xFF
            out.append(flat)
        return out


class MemoryConnection:
    """One connection to a :class:`MemorySource` (implements the seam's
    ``TransferConnection``)."""

    def __init__(self, source: MemorySource) -> None:
        self.source = source
        self._alive = True
        self._replies: dict[int, asyncio.Queue] = {}
        self._chunks: dict[int, list[Any]] = {}

    @property
    def alive(self) -> bool:
        return self._alive

    def abort(self, reason: str = "closed") -> None:
        self._alive = False

    def _require(self) -> None:
        if not self._alive:
            raise TransportError("closed", "memory connection closed")

    async def _delay(self) -> None:
        if self.source.faults.delay_s:
            await asyncio.sleep(self.source.faults.delay_s)

    def _queue(self, tag: int) -> asyncio.Queue:
        return self._replies.setdefault(tag, asyncio.Queue())

    async def send_msg(self, msg: Any, tag: int = 0, *, timeout: float = 10.0) -> None:
        self._require()
        if isinstance(msg, Cancel):
            self.source.cancels.append(msg)
            return
        if not isinstance(msg, PullRequest):
            return
        if self.source.faults.disconnect == "request":
            self.abort()
            raise TransportError("peer_closed", "memory source went away")
        reply, chunks = self.source.serve(msg)
        self._chunks[msg.transfer_id] = chunks
        if not self.source.faults.drop:
            self._queue(tag_for(msg.transfer_id, Lane.REPLY)).put_nowait(reply)

    async def recv_msg(self, tag: int = 0, *, timeout: float | None = 10.0,
                       max_bytes: int | None = None) -> Any:
        self._require()
        await self._delay()
        try:
            return await asyncio.wait_for(self._queue(tag).get(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.abort()
            raise TransportError("transfer_timeout", f"no message on tag {tag}") from None

    async def recv_stream(self, transfer_id: int, buffer_for: Callable[[int], Any],
                          n_chunks: int, *, on_chunk: Callable[[int, Any], Any] | None = None,
                          timeout: float = 10.0, max_in_flight: int = 2) -> int:
        self._require()
        chunks = self._chunks.pop(transfer_id, [])
        faults = self.source.faults
        total = 0
        for i in range(n_chunks):
            await self._delay()
            if faults.stall_after is not None and i >= faults.stall_after:
                await asyncio.sleep(timeout)
                self.abort()
                raise TransportError("transfer_timeout", f"chunk {i} not received")
            if faults.disconnect == "stream" and i == n_chunks // 2:
                self.abort()
                raise TransportError("peer_closed", "memory source went away mid-stream")
            buf = buffer_for(i)
            buf.copy_(chunks[i])
            total += int(buf.numel())
            if on_chunk is not None:
                on_chunk(i, buf)
        return total

    async def read_parts(self, parts: Sequence[Any], *, timeout: float = 10.0) -> float | None:
        raise TransportError("transfer_failed", "the memory source offers no reads")


class MemoryConnector:
    """Connections to :class:`MemorySource` objects by address (implements the seam's
    ``Connector``)."""

    codec = DEFAULT_CODEC

    def __init__(self, sources: dict[tuple[str, int], MemorySource]) -> None:
        self.sources = sources
        self.connects = 0
        self._conns: dict[tuple[str, int], MemoryConnection] = {}

    async def get(self, host: str, port: int) -> MemoryConnection:
        key = (host, int(port))
        source = self.sources.get(key)
        if source is None or source.faults.disconnect == "connect":
            raise TransportError("connect_failed", f"nothing at {host}:{port}")
        conn = self._conns.get(key)
        if conn is None or not conn.alive:
            conn = self._conns[key] = MemoryConnection(source)
            self.connects += 1
        return conn

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.abort()
        self._conns.clear()
