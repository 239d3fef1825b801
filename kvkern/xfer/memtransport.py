"""An in-memory transport behind the seam (:mod:`kvkern.xfer.seam`), with fault injection:
a :class:`MemoryConnector` whose connections are served by a :class:`MemorySource` in the
same process. The control logic of the pull path (admission, de-duplication, policies,
leases, cancels, fallback reasons) runs on it in milliseconds; the UCXX transport stays
covered by the real-process tests.

Both ways a pair's bytes move are served: the stream (packed chunks), and, for a source made
with ``remote_read=True``, one-sided reads (the seam's ``OneSidedReader``). A reading source
publishes ``read`` for its ranks (``"canonical"``, or ``"native"`` for a pool readable only
in its own order) and ``read/1``, and answers a request that asks for a read with a read
grant over its pool's segments, each memory span under a remote key of its own; the pins
stay until ``ReadDone`` or ``Cancel``, and at most ``read_hold_s`` after the request unless
that is 0 (then until ``ReadDone``), as :mod:`kvkern.xfer.send` does. ``read_parts`` copies
each run from the source's pool into the destination's memory (both in this process) after
checking that the remote key is the source's and the run lies inside its span, as a UCX
remote key on InfiniBand does.

Faults (:class:`Faults`, changeable between pulls): ``drop`` (no reply ever comes),
``delay_s`` (every reply, chunk and read part waits), ``stall_after`` (the stream stops
after that many chunks; a read, after that many runs), ``corrupt`` (``"hashes"``: the reply
names other blocks; ``"bytes"``: the chunks and reads carry other bytes; ``"rkey"``: a read
grant names a remote key the source never registered), ``disconnect`` (``"connect"``,
``"request"``, ``"stream"`` or ``"read"``: the connection fails there, ``peer_closed``).
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvkern.kernels.pack import pack
from kvkern.layout.chunks import plan_chunks
from kvkern.layout.segments import BlockSegments
from kvkern.xfer.codes import RejectCode, reply_text
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import (
    DEFAULT_CODEC,
    READ_CAPABILITY,
    Cancel,
    PlanPiece,
    PullReply,
    PullRequest,
    ReadAck,
    ReadDone,
    ReadGrant,
    Refusal,
    Status,
    StreamReply,
)
from kvkern.xfer.seam import BufferT, ReadPart
from kvkern.xfer.send import RankCtx, Rejected, validate_request, whole_blocks
from kvkern.xfer.state import CAPABILITIES, PROTOCOL, DpGroupDoc, RankDoc, StateDoc
from kvkern.xfer.transport import Lane, TransportError, tag_for
from kvkern.xfer.ucp_rma import expand

if TYPE_CHECKING:
    import torch

    from kvkern.cache.protocol import PinHandle
    from kvkern.xfer.messages import Message

__all__ = ["Faults", "MemoryConnection", "MemoryConnector", "MemorySource"]


@dataclass
class Faults:
    drop: bool = False
    delay_s: float = 0.0
    stall_after: int | None = None
    corrupt: str | None = None  # "hashes" | "bytes" | "rkey"
    disconnect: str | None = None  # "connect" | "request" | "stream" | "read"


@dataclass
class _Registered:
    """A rank's pool as a reading source offers it: its segments, the remote key of each
    segment's span, and whether the segments are in the pool's own order."""

    segments: BlockSegments
    rkeys: list[bytes]
    native: bool


@dataclass
class _Grant:
    """A read grant whose blocks are pinned: released by ReadDone, Cancel or its hold."""

    handle: PinHandle
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class MemorySource:
    """Serves the blocks of ``group`` (every rank hosted here) to memory connections; with
    ``remote_read`` its ranks' pools may also be read one-sided (see the module
    docstring)."""

    def __init__(self, group: KVGroup, *, worker_id: str = "memory-source",
                 chunk_bytes: int = 1 << 20, remote_read: bool = False,
                 read_hold_s: float = 1.0) -> None:
        self.group = group
        self.worker_id = worker_id
        self.chunk_bytes = chunk_bytes
        self.read_hold_s = read_hold_s
        self.faults = Faults()
        self.requests: list[PullRequest] = []
        self.cancels: list[Cancel] = []
        self.read_dones: list[ReadDone] = []
        self.pins_outstanding = 0
        self.registered: dict[int, _Registered] = {}
        self.spans: dict[bytes, tuple[int, int]] = {}  # remote key -> (address, length)
        self._grants: dict[int, _Grant] = {}
        if remote_read:
            for rank_kv in group.ranks.values():
                self._register(rank_kv)

    def _register(self, rank_kv: RankKV) -> None:
        segs, native = rank_kv.read_segments, False
        if segs is None:
            segs, native = rank_kv.native_segments, True
        if segs is None:
            return
        keys: dict[tuple[int, int], bytes] = {}  # one key per span (K/V planes share)
        for span in segs.spans:
            if span not in keys:
                keys[span] = f"memory-rkey/{rank_kv.rank}/{len(self.spans)}".encode()
                self.spans[keys[span]] = span
        self.registered[rank_kv.rank] = _Registered(segs, [keys[s] for s in segs.spans], native)

    def state_body(self, host: str = "127.0.0.1", port: int = 5000) -> bytes:
        """The state document a real source would publish (every rank at ``host:port``)."""
        g = self.group
        ranks = {str(r): RankDoc(ucx_host=host, ucx_port=port, layout=rank_kv.layout.describe())
                 for r, rank_kv in g.ranks.items()}
        for r, reg in self.registered.items():  # (no read_worker: reads on the connection)
            ranks[str(r)].read = "native" if reg.native else "canonical"
        capabilities = list(CAPABILITIES) + ([READ_CAPABILITY] if self.registered else [])
        doc = StateDoc(protocol=PROTOCOL, worker_id=self.worker_id, incarnation="memory",
                       hash_scheme=g.hash_scheme, block_size=g.block_size,
                       codec_fingerprint=f"{DEFAULT_CODEC.fingerprint:016x}", model=g.model_id,
                       topology=g.topology.to_dict(),
                       dp_groups={str(g.dp_rank): DpGroupDoc(ranks=ranks)},
                       capabilities=capabilities)
        return msgspec.json.encode(doc)

    def serve(self, req: PullRequest) -> tuple[PullReply, list[torch.Tensor]]:
        """The reply to ``req`` and the chunks that follow it: a stream's pins are released
        at once (the chunks are already packed); a read grant's stay (see :meth:`read_done`,
        :meth:`cancel`)."""
        self.requests.append(req)
        src_rank = req.pieces[0].src_rank if req.pieces else 0
        ctx = RankCtx(self.group, self.group.ranks[src_rank])
        try:
            pieces = validate_request(ctx, req, model_id=self.group.model_id,
                                      chunk_bytes=self.chunk_bytes)
        except Rejected as rej:
            return Refusal(transfer_id=req.transfer_id, status=Status.REJECTED,
                           reason=str(rej)), []
        handle = self.group.manager.pin(req.requested_hashes, require_all=req.require_all)
        if handle is None:
            return Refusal(transfer_id=req.transfer_id, status=Status.MISS,
                           reason=reply_text(RejectCode.MISS, "not cached")), []
        self.pins_outstanding += 1
        registered = self.registered.get(ctx.rank) if req.read else None
        if registered is not None and (not registered.native or whole_blocks(ctx.rkv, pieces)):
            return self._grant(req, pieces, handle, registered), []
        try:
            chunks = self._pack(ctx, pieces, list(handle.block_ids), req)
        finally:
            self.group.manager.unpin(handle)
            self.pins_outstanding -= 1
        n = len(handle.block_ids)
        hashes = list(handle.hashes)
        if self.faults.corrupt == "hashes":
            hashes = [h ^ 1 for h in hashes]
        reply = StreamReply(transfer_id=req.transfer_id,
                            status=Status.OK if n == req.count else Status.PARTIAL,
                            served_blocks=n, block_hashes=hashes,
                            total_bytes=sum(int(c.numel()) for c in chunks),
                            n_chunks=len(chunks), chunk_sizes=[int(c.numel()) for c in chunks])
        return reply, chunks

    def _grant(self, req: PullRequest, pieces: list[PlanPiece], handle: PinHandle,
               registered: _Registered) -> ReadGrant:
        """A read grant over the pinned blocks' whole segments; their pins stay until
        ReadDone, Cancel or the end of the hold."""
        segs, keys = registered.segments, list(registered.rkeys)
        if self.faults.corrupt == "rkey":
            keys[0] = b"memory-rkey/never-registered"
        n, hashes = len(handle.block_ids), list(handle.hashes)
        if self.faults.corrupt == "hashes":
            hashes = [h ^ 1 for h in hashes]
        grant = self._grants[req.transfer_id] = _Grant(handle)
        if self.read_hold_s > 0:
            grant.timer = asyncio.get_running_loop().call_later(
                self.read_hold_s, self.release, req.transfer_id)
        return ReadGrant(transfer_id=req.transfer_id,
                         status=Status.OK if n == req.count else Status.PARTIAL,
                         served_blocks=n, block_hashes=hashes,
                         total_bytes=n * sum(p.length for p in pieces), read_rkey=keys[0],
                         read_base=segs.bases[0], read_stride=segs.stride,
                         read_blocks=list(handle.block_ids),
                         read_hold_ms=int(self.read_hold_s * 1000),
                         read_segment_bytes=segs.nbytes, read_more_rkeys=keys[1:],
                         read_more_bases=list(segs.bases[1:]), read_native=registered.native)

    def release(self, transfer_id: int) -> bool:
        """Unpin a grant's blocks once; whether they were still pinned."""
        grant = self._grants.pop(transfer_id, None)
        if grant is None:
            return False
        if grant.timer is not None:
            grant.timer.cancel()
        self.group.manager.unpin(grant.handle)
        self.pins_outstanding -= 1
        return True

    def read_done(self, msg: ReadDone) -> ReadAck | None:
        """Unpin after the destination's reads; the ReadAck it asked for (``held``: the
        blocks stayed pinned until now)."""
        self.read_dones.append(msg)
        held = self.release(msg.transfer_id)
        if not msg.ack:
            return None
        return ReadAck(transfer_id=msg.transfer_id, held=held,
                       reason="" if held else "no read of this transfer is pinned")

    def cancel(self, msg: Cancel) -> None:
        self.cancels.append(msg)
        self.release(msg.transfer_id)

    def read(self, local: int, rkey: bytes, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``remote`` (under ``rkey``) to ``local``; TransportError when
        the key or the range is not one this source registered."""
        span = self.spans.get(rkey)
        if span is None:
            raise TransportError("transfer_failed", f"one-sided read: unknown remote key "
                                 f"{rkey[:32]!r}")
        if not (span[0] <= remote and remote + nbytes <= span[0] + span[1]):
            raise TransportError("transfer_failed", f"one-sided read of {nbytes} B at "
                                 f"{remote:#x} outside the region at {span[0]:#x} "
                                 f"({span[1]} B)")
        ctypes.memmove(local, remote, nbytes)
        if self.faults.corrupt == "bytes":
            out = np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(local))
            out ^= 0xFF

    def _pack(self, ctx: RankCtx, pieces: list, block_ids: list[int],
              req: PullRequest) -> list[torch.Tensor]:
        import torch  # noqa: PLC0415

        rank_kv, lay = ctx.rkv, ctx.rkv.layout
        limit = min(req.chunk_bytes, self.chunk_bytes)
        out = []
        for c in plan_chunks([p.length for p in pieces], len(block_ids), limit,
                             req.chunk_blocks):
            p = pieces[c.piece]
            staged = pack(rank_kv.pool, lay, block_ids[c.b0:c.b1], layers=p.layers, heads=p.heads)
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
        self._chunks: dict[int, list[torch.Tensor]] = {}
        self._grants: set[int] = set()  # read grants served here (released on abort)

    @property
    def alive(self) -> bool:
        return self._alive

    def abort(self, reason: str = "closed") -> None:
        """Close; like a real source seeing its connection end, the source unpins every
        read grant it made on it."""
        self._alive = False
        grants, self._grants = self._grants, set()
        for tid in grants:
            self.source.release(tid)

    def _require(self) -> None:
        if not self._alive:
            raise TransportError("closed", "memory connection closed")

    async def _delay(self) -> None:
        if self.source.faults.delay_s:
            await asyncio.sleep(self.source.faults.delay_s)

    def _queue(self, tag: int) -> asyncio.Queue:
        return self._replies.setdefault(tag, asyncio.Queue())

    async def send_msg(self, msg: Message, tag: int = 0, *, timeout: float = 10.0) -> None:
        self._require()
        if isinstance(msg, Cancel):
            self.source.cancel(msg)
            return
        if isinstance(msg, ReadDone):
            ack = self.source.read_done(msg)
            if ack is not None:
                self._queue(tag_for(msg.transfer_id, Lane.REPLY, 1)).put_nowait(ack)
            return
        if not isinstance(msg, PullRequest):
            return
        if self.source.faults.disconnect == "request":
            self.abort()
            raise TransportError("peer_closed", "memory source went away")
        reply, chunks = self.source.serve(msg)
        self._chunks[msg.transfer_id] = chunks
        if isinstance(reply, ReadGrant):
            self._grants.add(msg.transfer_id)
        if not self.source.faults.drop:
            self._queue(tag_for(msg.transfer_id, Lane.REPLY)).put_nowait(reply)

    async def recv_msg(self, tag: int = 0, *, timeout: float | None = 10.0,
                       max_bytes: int | None = None) -> Message:
        self._require()
        await self._delay()
        try:
            return await asyncio.wait_for(self._queue(tag).get(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.abort()
            raise TransportError("transfer_timeout", f"no message on tag {tag}") from None

    async def recv_stream(self, transfer_id: int, buffer_for: Callable[[int], BufferT],
                          n_chunks: int, *,
                          on_chunk: Callable[[int, BufferT], Awaitable[None] | None] | None = None,
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
            if on_chunk is not None:  # sync or async, as the UCXX transport's
                done = on_chunk(i, buf)
                if inspect.isawaitable(done):
                    await done
        return total

    async def read_parts(self, parts: Sequence[ReadPart], *,
                         timeout: float = 10.0) -> float | None:
        """Copy every part's runs of ``(local address, remote address, nbytes)`` from the
        source's memory under the part's remote key; the time the first run landed."""
        self._require()
        faults, first, done = self.source.faults, None, 0
        for rkey, runs in parts:
            await self._delay()
            if faults.disconnect == "read":
                self.abort()
                raise TransportError("peer_closed", "memory source went away mid-read")
            for local, remote, nbytes in expand(runs):
                if faults.stall_after is not None and done >= faults.stall_after:
                    await asyncio.sleep(timeout)
                    self.abort()
                    raise TransportError("transfer_timeout", f"read {done} not done")
                try:
                    self.source.read(local, rkey, remote, nbytes)
                except TransportError:
                    self.abort()  # as a failed read aborts a UCX connection
                    raise
                done += 1
                if first is None:
                    first = time.perf_counter()
        return first


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
