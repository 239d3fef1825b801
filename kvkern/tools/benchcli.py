"""``kvkern bench``: transfer benchmarks between two OS processes on 127.0.0.1.

``kvkern bench xfer`` starts a peer process (the *source*: a :class:`~kvkern.xfer.transport.
Listener` answering PullRequest messages from preallocated buffers), connects to it from this
process (the *destination*) and measures, per size:

* ``raw``      one buffer of N bytes (request -> reply -> one data message)
* ``chunked``  the same N bytes as a stream of ``--chunk`` byte chunks, ``--in-flight`` posted
* ``messages`` per-message cost: a control round trip (PullRequest -> PullReply, no data),
               and 64 KiB chunks received one at a time vs 32 in flight
* ``pull``     the real path: the peer also runs a :class:`~kvkern.xfer.source.SourceService`
               over a pool of 512 KiB blocks (8 layers x 8 KV heads x 128 dims x 16 tokens,
               bf16); this process pulls N blocks (N x 512 KiB = each size) with a
               :class:`~kvkern.xfer.puller.Puller` (hint -> state from cache -> plan ->
               private blocks -> direct one-sided reads on ``--read-lanes`` read lanes,
               checked against the source's read directory, no message -> commit), from a
               source whose blocks are consecutive and from one whose blocks are shuffled
               (``scattered_*``); the same pull asking for a grant first
               (``granted_*``: PullRequest, pinned blocks, reads, ReadDone), on one lane
               (``lanes1_*``), into engine blocks (``into_*``) and more; with ``--data-path both``
               (default) also through the chunk stream (``stream_*``: packed, sent,
               unpacked). Every repeat runs each variant and a raw one-buffer fetch of the
               same bytes once, in a shuffled order. Reports ``pull_gbps`` (bytes /
               hint-to-commit time), ``raw_gbps``, ``ratio``, ``messages`` per pull
               (control + chunks), ``reads`` and the hint-to-first-byte median of 1-block
               pulls on the warm connection.

Every case is a function ``case_<name>(bench, settings) -> dict`` over one shared
:class:`Bench` connection, and both processes run with the same :class:`Settings` (UCX
environment, progress mode), so a ``pull`` case added later is measured under exactly the
conditions of the raw baseline. ``--json`` prints one JSON object as the LAST stdout line
(the peer's stdout, where UCX may print warnings, goes to stderr).

Per-message cost dominates below 16 MiB chunks: pulls use >= 16 MiB chunks with several in
flight. Recorded runs, with their environment, are in ``bench/results/`` and
``bench/RESULTS.md`` (``make results``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvkern.tools import benchtargets, engineload, threadpools
from kvkern.xfer.ucx_env import UCX_DEFAULTS, configure_ucx_env

MiB = 1 << 20
# a pull size's ratios to the raw send, one per path measured beside the headline pull
PATH_RATIOS = ("copy_ratio", "scattered_ratio", "granted_ratio", "stream_ratio",
               "stream_scattered_ratio", "into_ratio", "into_ucx_ratio", "into_stream_ratio",
               "lanes1_ratio", "ucx_ratio")
_PATTERN_PERIOD = 251  # prime, so chunk boundaries never line up with the pattern


def _parse_split(flag: str, text: str, parser: Any) -> tuple[int, int]:
    """``--pull-tp`` / ``--pull-pp`` ``S:D``: each size dividing the model's KV heads (TP)
    or layers (PP)."""
    total, what = ((PULL_MODEL["num_kv_heads"], "KV heads") if flag == "--pull-tp"
                   else (PULL_MODEL["num_layers"], "layers"))
    try:
        src, dst = (int(x) for x in text.split(":"))
        if src < 1 or dst < 1 or total % src or total % dst:
            raise ValueError
    except ValueError:
        parser.error(f"{flag} {text!r}: want S:D, each dividing the {total} {what}")
    return src, dst


def _load_fraction(text: str) -> float:
    try:
        return engineload.parse_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, mult in (("gib", 1 << 30), ("mib", MiB), ("kib", 1 << 10), ("g", 1 << 30),
                         ("m", MiB), ("k", 1 << 10), ("b", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


# Blocks in the bench's host source pools: 8 GiB of 512 KiB blocks, a serving engine's host
# pool, so a direct read looks hashes up in a directory of that size (read by bucket; a pool
# of only the pulled blocks has one small enough to read whole). Untouched pages take no
# memory.
SOURCE_POOL_BLOCKS = 16384


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """What both peers share. ``ucx_env='kvkern'`` applies kvkern.xfer.ucx_env; ``'off'``
    pins the three error-handling settings to ``n`` (UCX's default: TCP on loopback)."""

    ucx_env: str = "kvkern"
    progress_mode: str = "thread"
    sizes: tuple[int, ...] = (64 * MiB, 256 * MiB)
    chunk_bytes: int = 16 * MiB
    in_flight: int = 4
    repeats: int = 11  # medians of 5 moved by 0.05 between runs on 2 shared cores
    cases: tuple[str, ...] = ("raw", "chunked", "messages", "pull")
    peer_timeout_s: float = 60.0
    data_path: str = "both"  # pull case: "read", "stream" or both (read is the headline)
    pull_layout: str = "trtllm"  # pull case: the engine layout of both pools
    pull_tp: tuple[int, int] = (1, 1)  # pull case: TP size of the source and the destination
    pull_pp: tuple[int, int] = (1, 1)  # pull case: PP size of the source and the destination
    # pull case: this process hosts the destination's first rank only (one process per rank,
    # as engines run TP and PP), not every rank of its DP group
    pull_one_rank: bool = False
    read_lanes: int = 2  # pull case: XferConfig.read_lanes of the headline puller
    device: str = "cpu"  # where both peers' buffers and pools live ("cuda": device memory)
    all_variants: bool = True  # pull case: also fewer lanes and granted reads (else headline,
    # scattered and stream only)
    # pull case: blocks in each host source pool (0: the pulled ones only), the pulled ones
    # committed: a serving engine's pool size, so its read directory is as large
    source_blocks: int = SOURCE_POOL_BLOCKS
    # pull case: NIXL's READ of the same blocks as one more variant, interleaved with the
    # pulls (kvkern.tools.nixlbench.Server; host pools of the bench's block size only)
    nixl: bool = False

    def apply_env(self, env: dict[str, str] | Any) -> None:
        if self.ucx_env == "off":
            for name in ("UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING",
                         "UCX_CMA_MEMORY_INVALIDATE"):
                env[name] = "n"
        env["UCXPY_PROGRESS_MODE"] = self.progress_mode
        configure_ucx_env(env)


# ------------------------------------------------------------------------------ the peer


def _pattern(nbytes: int, device: str = "cpu") -> Any:
    data = np.resize(np.arange(_PATTERN_PERIOD, dtype=np.uint8), nbytes)
    if device == "cpu":
        return data
    import torch  # noqa: PLC0415

    return torch.from_numpy(data).to(device)


def _chunk_sizes(total: int, chunk: int) -> list[int]:
    sizes = [chunk] * (total // chunk)
    if total % chunk or total == 0:
        sizes.append(total % chunk)
    return sizes


# The pull case's model: 8 layers x 2 x 8 KV heads x 16 tokens x 128 dims x 2 B = 512 KiB
# per block on one TP1 rank (a mid-size model's per-rank block).
PULL_MODEL = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "block_size": 16,
              "dtype": "bfloat16"}


def _pull_topology(tp: int = 1, pp: int = 1) -> Any:
    from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology  # noqa: PLC0415

    return Topology(model=ModelKVSpec(**PULL_MODEL),
                    parallel=Parallelism(tp_size=tp, pp_size=pp))


def _rank_pools(topo: Any, n_blocks: int, layout_name: str,
                device: str = "cpu", fault_in: bool = True) -> dict[int, Any]:
    """rank -> RankKV of every rank of DP group 0 on ``device``, pages faulted in (else
    left untouched: host memory is only taken where blocks are written)."""
    from kvkern.xfer.kvgroup import RankKV  # noqa: PLC0415

    out = {}
    for r in topo.ranks_of_dp(0):
        layout = topo.local_layout(r, n_blocks, layout_name)
        out[r] = RankKV(r, layout, layout.allocate(device, fill="zeros" if fault_in else None))
    return out


POISON = -1  # the word a destination's blocks hold before a checked pull


def _words(view: Any) -> Any:
    """A block's slice of a canonical view as 32-bit words (its last dim is contiguous)."""
    import torch  # noqa: PLC0415

    return view.view(torch.int32)


def _block_words(topo: Any, rank: int, i: int, layer: int | None = None) -> Any:
    """What block ``i`` (in request order) holds in rank ``rank``'s pool, one 32-bit word per
    (layer, K/V, head, token) row of the model, in global coordinates:
    ``(i + 1) << 16 | layer << 9 | kv << 8 | head << 4 | token``, as ``[L, 2, H, T, 1]``
    (``[2, H, T, 1]`` for the one local ``layer`` of a per-layer pool). A block, a head, a
    layer, K/V or a token row landing in another's place, under any reshard, differs, and
    no word is :data:`POISON`."""
    import torch  # noqa: PLC0415

    l0, l1 = topo.layer_range(rank)
    h0, h1 = topo.head_range(rank)
    m = topo.model
    if not (i + 1 < 1 << 15 and m.num_layers <= 128 and m.num_kv_heads <= 16
            and m.block_size <= 16):
        raise ValueError(f"block {i} of a {m.num_layers}-layer, {m.num_kv_heads}-head, "
                         f"{m.block_size}-token model has no word of its own")
    layers = torch.arange(l0, l1) if layer is None else torch.tensor([l0 + layer])
    word = ((i + 1) << 16 | layers.view(-1, 1, 1, 1, 1) << 9
            | torch.arange(2).view(1, -1, 1, 1, 1) << 8
            | torch.arange(h0, h1).view(1, 1, -1, 1, 1) << 4
            | torch.arange(m.block_size).view(1, 1, 1, -1, 1)).to(torch.int32)
    return word[0] if layer is not None else word


def _block_views(rkv: Any, b: int) -> list[tuple[Any, int | None]]:
    """Pool block ``b`` of a rank as (32-bit words of each tensor's canonical slice, the
    local layer of that tensor: None for a pool of all layers)."""
    layout = rkv.layout
    return [(_words(layout.canonical_view(t)[b]), j if layout.per_layer else None)
            for j, t in enumerate(layout.tensors(rkv.pool))]


def _fill_block(topo: Any, rkv: Any, b: int, i: int) -> None:
    """Write block ``i``'s words (:func:`_block_words`) into pool block ``b`` of a rank."""
    for words, layer in _block_views(rkv, b):
        words.copy_(_block_words(topo, rkv.rank, i, layer).expand_as(words))


def _block_holds(topo: Any, rkv: Any, b: int, i: int) -> bool:
    """Whether pool block ``b`` of a rank holds block ``i``'s words, every one."""
    import torch  # noqa: PLC0415

    return all(torch.equal(words, _block_words(topo, rkv.rank, i, layer).to(words.device)
                           .expand_as(words)) for words, layer in _block_views(rkv, b))


async def _start_pull_source(n_blocks: int, chunk_bytes: int, in_flight: int,
                             scattered: bool = False, layout_name: str = "trtllm",
                             tp: int = 1, device: str = "cpu", pp: int = 1,
                             pool_blocks: int = 0) -> Any:
    """A SourceService over ``n_blocks`` committed blocks of tokens ``range(n * 16)``, in a
    pool of ``max(n_blocks, pool_blocks)`` blocks (the rest free and untouched: a serving
    engine's pool size, its read directory as large, without its memory). With
    ``scattered`` the request's blocks sit at shuffled pool ids (as in a long-running engine),
    so every chunk goes through the pack kernel instead of the zero-copy send."""

    from kvkern.cache.hashing import sequence_hashes  # noqa: PLC0415
    from kvkern.cache.pool import BlockPool  # noqa: PLC0415
    from kvkern.xfer.kvgroup import KVGroup  # noqa: PLC0415
    from kvkern.xfer.source import PeerQuotas, SourceService  # noqa: PLC0415

    topo = _pull_topology(tp, pp)
    bs = topo.model.block_size
    total = max(n_blocks, pool_blocks if device == "cpu" else 0)  # (device pools stream)
    ranks = _rank_pools(topo, total, layout_name, device, fault_in=total == n_blocks)
    pool = BlockPool(total, block_size=bs)
    hashes = sequence_hashes(list(range(n_blocks * bs)), bs)
    ids = pool.allocate(n_blocks)
    if scattered:  # (NIXL's scattered READ reads the same positions)
        from kvkern.tools.nixlbench import scattered_order  # noqa: PLC0415

        ids = [ids[k] for k in scattered_order(n_blocks)]
    for i, b in enumerate(ids):
        for rkv in ranks.values():
            _fill_block(topo, rkv, b, i)
    pool.commit(ids, hashes)
    pool.release(ids)
    group = KVGroup(topo, 0, pool, ranks)
    # The bench's pool holds exactly the pulled blocks and its one destination pulls them
    # all: no peer quota, and the one-sided reads it measures offered (an opt-in; host
    # pools only: device pools stream).
    return await SourceService([group], worker_id="bench-source", chunk_bytes=chunk_bytes,
                               chunks_in_flight=in_flight,
                               remote_read="host" if device == "cpu" else "off",
                               quotas=PeerQuotas(peer_pin_fraction=1.0,
                                                 total_pin_fraction=1.0)).start()


async def _peer_main(port_file: str, max_seconds: float, parent_pid: int,
                     in_flight: int, pull_blocks: int = 0, chunk_bytes: int = 16 * MiB,
                     pull_layout: str = "trtllm", pull_tp: int = 1,
                     device: str = "cpu", pull_pp: int = 1, pool_blocks: int = 0) -> None:
    from kvkern.xfer.messages import Cancel, Status, StreamReply  # noqa: PLC0415
    from kvkern.xfer.transport import Lane, Listener, TransportError, tag_for  # noqa: PLC0415

    buffers: dict[int, Any] = {}

    async def serve(conn) -> None:
        while True:
            try:
                req = await conn.recv_msg(timeout=None)
            except TransportError:
                return
            if isinstance(req, Cancel):
                continue
            total = sum(p.length for p in req.pieces)
            sizes = _chunk_sizes(total, req.chunk_bytes)
            reply = StreamReply(transfer_id=req.transfer_id, status=Status.OK,
                                served_blocks=req.count, block_hashes=req.requested_hashes,
                                total_bytes=total, n_chunks=len(sizes), chunk_sizes=sizes)
            await conn.send_msg(reply, tag_for(req.transfer_id, Lane.REPLY))
            if total == 0:
                continue
            if total not in buffers:
                buffers.clear()  # one size at a time keeps the peer's memory bounded
                buffers[total] = _pattern(total, device)
            data = buffers[total]
            offs = np.cumsum([0, *sizes])
            await conn.send_stream(req.transfer_id,
                                   lambda i, d=data, o=offs: d[o[i]:o[i + 1]],
                                   len(sizes), timeout=10, max_in_flight=in_flight,
                                   trailer=False)

    listener = await Listener(serve, host="127.0.0.1").start()
    source = None
    info: dict[str, Any] = {"port": listener.port}
    if pull_blocks:
        source = await _start_pull_source(pull_blocks, chunk_bytes, in_flight,
                                          layout_name=pull_layout, tp=pull_tp, device=device,
                                          pp=pull_pp, pool_blocks=pool_blocks)
        scattered = await _start_pull_source(pull_blocks, chunk_bytes, in_flight,
                                             layout_name=pull_layout, tp=pull_tp,
                                             pp=pull_pp, scattered=True, device=device,
                                             pool_blocks=pool_blocks)
        info["http_port"] = source.http_port
        info["scattered_http_port"] = scattered.http_port
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(info))
    os.replace(tmp, port_file)
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline and os.getppid() == parent_pid:
        await asyncio.sleep(0.2)
    if source is not None:
        await source.close()
        await scattered.close()
    await listener.close()


# ------------------------------------------------------------------------ the destination


class Bench:
    """The destination side: one connection to the peer, and the pull primitive every case
    uses (request ``total`` bytes in ``chunk`` byte chunks, receive with ``in_flight``)."""

    def __init__(self, conn: Any, *, pull_http_port: int | None = None,
                 scattered_http_port: int | None = None,
                 loop: Any = None, device: str = "cpu") -> None:
        self.conn = conn
        self.device = device
        self.pull_http_port = pull_http_port
        self.scattered_http_port = scattered_http_port
        self.loop = loop  # the EventLoopThread the cases run on (the puller shares it)
        self._next_tid = 1
        self._dst: dict[int, Any] = {}

    def _buffer(self, nbytes: int) -> Any:
        if nbytes not in self._dst:
            self._dst.clear()
            if self.device == "cpu":
                self._dst[nbytes] = np.empty(nbytes, dtype=np.uint8)
                self._dst[nbytes].fill(0)  # fault the pages in outside the timed region
            else:
                import torch  # noqa: PLC0415

                self._dst[nbytes] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return self._dst[nbytes]

    async def fetch(self, total: int, chunk: int, *, in_flight: int,
                    verify: bool = False) -> float:
        """Seconds for request -> reply -> every chunk landed (a bare stream: no trailer)."""
        from kvkern.xfer.messages import PlanPiece, PullRequest  # noqa: PLC0415
        from kvkern.xfer.transport import Lane, tag_for  # noqa: PLC0415

        tid, self._next_tid = self._next_tid, self._next_tid % 1_000_000 + 1
        req = PullRequest(transfer_id=tid, request_id="bench", hash_scheme="none",
                          block_hashes=[0], start=0, count=1,
                          pieces=[PlanPiece(src_rank=0, layer_start=0, layer_stop=1,
                                            head_start=0, head_stop=1, offset=0,
                                            length=total)],
                          chunk_bytes=max(chunk, 1), deadline_ms=10_000)
        dst = self._buffer(total)
        t0 = time.perf_counter()
        await self.conn.send_msg(req, timeout=10)
        reply = await self.conn.recv_msg(tag_for(tid, Lane.REPLY), timeout=10)
        if total:
            offs = np.cumsum([0, *reply.chunk_sizes])
            await self.conn.recv_stream(tid, lambda i: dst[offs[i]:offs[i + 1]],
                                        reply.n_chunks, timeout=10, max_in_flight=in_flight,
                                        trailer=False)
        dt = time.perf_counter() - t0
        if verify and total:
            idx = np.unique(np.r_[np.arange(0, total, 4099), offs[1:-1] - 1, offs[1:-1],
                                  total - 1])
            expect = (idx % _PATTERN_PERIOD).astype(np.uint8)
            got = dst[idx] if isinstance(dst, np.ndarray) else dst.cpu().numpy()[idx]
            if not np.array_equal(got, expect):
                raise RuntimeError(f"bench transfer of {total} B delivered wrong bytes")
        return dt


def _summary(nbytes: int, times: list[float]) -> dict[str, float]:
    gbps = sorted(nbytes / t / 1e9 for t in times)
    q = statistics.quantiles(gbps, n=5) if len(gbps) >= 2 else [gbps[0]] * 4
    return {"gbps": round(statistics.median(gbps), 3), "gbps_p20": round(q[0], 3),
            "gbps_p80": round(q[3], 3), "ms": round(statistics.median(times) * 1e3, 3)}


async def case_raw(bench: Bench, s: Settings) -> dict[str, Any]:
    out = {}
    for size in s.sizes:
        await bench.fetch(size, size, in_flight=1, verify=True)  # warm-up
        times = [await bench.fetch(size, size, in_flight=1)
                 for _ in range(s.repeats)]
        out[str(size)] = _summary(size, times)
    return out


async def case_chunked(bench: Bench, s: Settings) -> dict[str, Any]:
    out = {}
    for size in s.sizes:
        kw = {"in_flight": s.in_flight}
        await bench.fetch(size, s.chunk_bytes, verify=True, **kw)
        times = [await bench.fetch(size, s.chunk_bytes, **kw) for _ in range(s.repeats)]
        out[str(size)] = _summary(size, times) | {"chunk_bytes": s.chunk_bytes,
                                                  "in_flight": s.in_flight}
    return out


async def case_messages(bench: Bench, s: Settings) -> dict[str, Any]:
    n, size = 256, 64 << 10
    await bench.fetch(0, 1, in_flight=1)
    rtt = [await bench.fetch(0, 1, in_flight=1) for _ in range(50)]
    serial = await bench.fetch(n * size, size, in_flight=1, verify=True)
    piped = await bench.fetch(n * size, size, in_flight=32, verify=True)
    connect, auth = await _connect_costs(bench.conn.peer)
    return {"control_rtt_us": round(statistics.median(rtt) * 1e6, 1),
            # a new connection: endpoint plus the authentication exchange, and the exchange
            # alone (paid once per connection, never per pull)
            "connect_ms": round(statistics.median(connect) * 1e3, 3),
            "auth_ms": round(statistics.median(auth) * 1e3, 3),
            "auth_ms_range": [round(min(auth) * 1e3, 3), round(max(auth) * 1e3, 3)],
            "n": n, "bytes_each": size,
            "serial_us_per_msg": round(serial / n * 1e6, 1),
            "serial_gbps": round(n * size / serial / 1e9, 3),
            "in_flight_32_us_per_msg": round(piped / n * 1e6, 1),
            "in_flight_32_gbps": round(n * size / piped / 1e9, 3)}


async def _connect_costs(peer: tuple[str, int], n: int = 20) -> tuple[list[float], list[float]]:
    """Seconds of ``n`` fresh authenticated connects to ``peer``, and of their exchange."""
    from kvkern.xfer.transport import ConnectionPool  # noqa: PLC0415

    connect: list[float] = []
    auth: list[float] = []
    for _ in range(n):
        async with ConnectionPool(connect_timeout=10) as pool:
            t0 = time.perf_counter()
            conn = await pool.get(*peer)
            connect.append(time.perf_counter() - t0)
            auth.append(conn.auth_s)
    return connect, auth


def _pull_blocks_for(s: Settings) -> int:
    """Blocks of the largest pull (of the bytes the destination process hosts)."""
    topo = _pull_topology(s.pull_tp[1], s.pull_pp[1]) if s.pull_one_rank else _pull_topology()
    per_block = topo.local_layout(0, 1).bytes_per_block
    return max(1, max(s.sizes) // per_block)


class _PullBench:
    """The pullers of ``case_pull`` on one cold pool: the headline one, and (in the same run)
    one that always streams and ones with fewer read lanes."""

    def __init__(self, bench: Bench, s: Settings) -> None:
        from kvkern.cache.pool import BlockPool  # noqa: PLC0415
        from kvkern.xfer.config import XferConfig  # noqa: PLC0415
        from kvkern.xfer.kvgroup import KVGroup  # noqa: PLC0415
        from kvkern.xfer.puller import Puller  # noqa: PLC0415

        class _ColdPool(BlockPool):
            """Never reports a local prefix, so the same blocks can be pulled again (a commit
            of an already cached hash keeps the old block and frees the received one)."""

            def longest_prefix(self, hashes: Any) -> int:
                return 0

        self.bench = bench
        topo = _pull_topology(s.pull_tp[1], s.pull_pp[1])
        self.bs = topo.model.block_size
        self.n_max = _pull_blocks_for(s)
        self.ranks = _rank_pools(topo, self.n_max + 8, s.pull_layout,  # faulted in untimed
                                 s.device)
        if s.pull_one_rank:
            first = min(self.ranks)
            self.ranks = {first: self.ranks[first]}
        self.group = KVGroup(topo, 0, _ColdPool(self.n_max + 8, block_size=self.bs),
                             self.ranks)
        cfg = XferConfig(allowlist="127.0.0.1/32", cost_guard=False,
                         chunk_bytes=s.chunk_bytes, chunks_in_flight=s.in_flight,
                         deadline_s=60.0, transfer_timeout_s=20.0,
                         remote_read=s.data_path != "stream", read_lanes=s.read_lanes)
        self.puller = Puller(self.group, config=cfg, loop=bench.loop)
        # "both": a second puller on the same pool that always streams, measured in the
        # same run
        self.streamer = (Puller(self.group, config=cfg.replace(remote_read=False),
                                loop=bench.loop) if s.data_path == "both" else None)
        # and the read on one lane, so the headline's gain from parallel copies is visible
        # in the same run
        self.fewer: dict[str, Puller] = {}
        if s.all_variants and s.data_path != "stream" and s.read_lanes > 1:
            self.fewer["lanes1"] = Puller(self.group, config=cfg.replace(read_lanes=1),
                                          loop=bench.loop)
        # and every read asking the source first (a grant and its round trip), so the gain
        # of direct reads (kvkern.xfer.direct) is measured in the same run
        if s.all_variants and s.data_path != "stream":
            self.fewer["granted"] = Puller(self.group, config=cfg.replace(direct_reads=False),
                                           loop=bench.loop)
        # and a same-host source read through UCX's CMA transport rather than kvkern's own
        # process_vm_readv calls (XferConfig.local_reads): across hosts reads go through UCX
        if s.all_variants and s.data_path != "stream":
            self.fewer["ucx"] = Puller(self.group, config=cfg.replace(
                local_reads=False, ucx_same_host_reads=True), loop=bench.loop)
        # and small pulls read on the first lane's thread rather than the loop lane
        # (XferConfig.loop_read_bytes), for the 1-block figures of both in the same run
        self.threaded = (Puller(self.group, config=cfg.replace(loop_read_bytes=0),
                                loop=bench.loop)
                         if s.all_variants and s.data_path != "stream" else None)
        # and the source's state past a short time to live at every pull, as for a source
        # pulled from rarely: used while fetched again, and (the alternative) waited for
        self.past_ttl = ({"stale": Puller(self.group, loop=bench.loop, config=cfg.replace(
                              state_cache_ttl_s=PAST_TTL_S)),
                          "refetch": Puller(self.group, loop=bench.loop, config=cfg.replace(
                              state_cache_ttl_s=PAST_TTL_S, state_max_stale_s=0.0))}
                         if s.all_variants else {})
        self.per_block = sum(rkv.layout.bytes_per_block for rkv in self.ranks.values())
        self.nixl: Any = None  # a kvkern.tools.nixlbench.Server, when NIXL is interleaved
        self.nixl_error: str | None = None  # why it stopped, if it failed
        self._rid = iter(range(1 << 30))
        self._hashes: dict[int, list[int]] = {}  # per prompt length: the engine's own hashes

    @property
    def pullers(self) -> list[Any]:
        return [p for p in (self.puller, self.streamer, *self.fewer.values(), self.threaded,
                            *self.past_ttl.values())
                if p is not None]

    async def checked(self, n: int, port: int | None = None, via: Any = None, *,
                      into: bool = False) -> Any:
        """:meth:`pull`, untimed, into a pool whose every block was poisoned first (nothing
        cached), then every block of the ``n`` checked word for word against the source's
        (:func:`_block_words`); RuntimeError on any difference. Blocks pulled into the
        pool's cache are evicted after, so the next pull's commit keeps its own."""
        import torch  # noqa: PLC0415

        from kvkern.cache.hashing import sequence_hashes  # noqa: PLC0415

        hashes = sequence_hashes(list(range(self.n_max * self.bs)), self.bs,
                                 self.group.hash_scheme)
        if held := self.group.manager.evict(hashes)["held"]:
            raise RuntimeError(f"{len(held)} blocks still held before a checked pull")
        for r in self.ranks.values():
            for t in r.layout.tensors(r.pool):
                _words(r.layout.canonical_view(t)).fill_(POISON)
                if t.is_cuda:  # (UCX writes device memory outside any stream's order)
                    torch.cuda.current_stream(t.device).synchronize()

        def check(ids: list[int]) -> None:
            if len(ids) != n:
                raise RuntimeError(f"bench pull of {n} blocks left {len(ids)} in the pool")
            for i, b in enumerate(ids):
                if not all(_block_holds(self.group.topology, r, b, i)
                           for r in self.ranks.values()):
                    raise RuntimeError(f"bench pull of {n} blocks delivered wrong bytes in "
                                       f"block {i} (pool block {b})")

        o = await self.pull(n, port, via, into=into, check=check)
        if not into:
            check(self.group.manager.match_prefix(hashes[:n]))
            if held := self.group.manager.evict(hashes)["held"]:
                raise RuntimeError(f"{len(held)} pulled blocks still held after the pull")
        return o

    async def pull(self, n: int, port: int | None = None, via: Any = None, *,
                   into: bool = False, check: Any = None) -> Any:
        """One pull of ``n`` blocks through ``via``; ``into``: as an engine connector pulls,
        into blocks taken from the pool beforehand (``Puller.pull_into``, admitted first,
        untimed), given back after, ``check(ids)`` called on them first."""
        via = via or self.puller
        r = f"bench-{next(self._rid)}"
        hint = {"kv_hint": {"source": f"127.0.0.1:{port or self.bench.pull_http_port}",
                            "no_retain": True}}
        tokens = list(range(n * self.bs))
        hashes = self._hashes.get(n)
        if hashes is None:  # an engine hashes its prompt as it arrives, for its own cache
            from kvkern.cache.hashing import sequence_hashes  # noqa: PLC0415

            hashes = self._hashes[n] = sequence_hashes(tokens, self.bs, self.group.hash_scheme)
        if into:
            return await self._pull_into(via, r, tokens, hint, hashes, check)
        via.submit(r, tokens, hint, block_hashes=hashes)
        o = await via.wait(r, 60)
        return self._used(o, n)

    async def _pull_into(self, via: Any, r: str, tokens: list[int], hint: dict,
                         hashes: list[int], check: Any = None) -> Any:
        from kvkern.xfer.admission import Admitted, WorkerFacts, admit  # noqa: PLC0415
        from kvkern.xfer.hints import decode_hint  # noqa: PLC0415

        decoded = decode_hint(hint)
        facts = WorkerFacts(block_size=self.bs, hash_scheme=self.group.hash_scheme,
                            bytes_per_block=self.per_block, longest_prefix=lambda hs: 0)
        admitted = admit(tokens, decoded, worker=facts, config=via.config,
                         cost_guard=via.cost_guard, engine_hashes=hashes)
        if not isinstance(admitted, Admitted):
            raise RuntimeError(f"bench pull into the engine's blocks not admitted: {admitted}")
        ids = self.group.manager.allocate(len(hashes))
        if ids is None:
            raise RuntimeError(f"{len(hashes)} blocks for a pull into them not available")
        try:
            via.pull_into(r, decoded, admitted, ids)
            o = await via.wait(r, 60)
            via.take_finished()
            if check is not None and o.used:
                check(ids)
        finally:
            self.group.manager.release(ids)
        return self._used(o, len(hashes))

    @staticmethod
    def _used(o: Any, n: int) -> Any:
        if not o.used:
            raise RuntimeError(f"bench pull of {n} blocks fell back: {o.reason.value}: "
                               f"{o.detail}")
        return o

    async def close(self) -> None:
        for p in self.pullers:
            await asyncio.get_running_loop().run_in_executor(None, p.close)


async def case_pull(bench: Bench, s: Settings) -> dict[str, Any]:
    pb = _PullBench(bench, s)
    out: dict[str, Any] = {"block_bytes": pb.per_block, "data_path": s.data_path,
                           "layout": s.pull_layout, "tp": f"{s.pull_tp[0]}:{s.pull_tp[1]}",
                           "pp": f"{s.pull_pp[0]}:{s.pull_pp[1]}",
                           "ranks": sorted(pb.ranks), "one_rank": s.pull_one_rank,
                           "read_lanes": s.read_lanes, "source_blocks": s.source_blocks}
    try:
        if s.nixl:
            await _start_nixl(pb, s, out)
        out["first_pull"] = await _check_pulls(pb)
        for size in s.sizes:
            out[str(size)] = await _pull_size(pb, s, size)
        if s.all_variants:
            out.update(await _one_block(pb, s, pb.puller))
        if "granted" in pb.fewer:
            out["granted"] = await _one_block(pb, s, pb.fewer["granted"])
        if pb.threaded is not None:
            out["lane_thread"] = await _one_block(pb, s, pb.threaded)
        if pb.past_ttl:
            out["past_ttl"] = await _past_ttl(pb, s)
        if pb.nixl is not None:
            server, pb.nixl = pb.nixl, None
            sent = await server.close()
            if sent is None:  # its per-request figures claim notifications that never arrived
                raise RuntimeError("the NIXL server did not end cleanly (its target did not "
                                   "receive every notification)")
            out["nixl"]["notifications"] = sent
        elif pb.nixl_error is not None:
            out["nixl"]["error"] = pb.nixl_error
            _drop_nixl_figures(out)
        return out
    finally:
        if pb.nixl is not None:
            await pb.nixl.close()
        await pb.close()


async def _start_nixl(pb: _PullBench, s: Settings, out: dict[str, Any]) -> None:
    """NIXL's READ server for the pulls' sizes (``pb.nixl``), or why not in ``out``."""
    from kvkern.tools import nixlbench  # noqa: PLC0415

    if s.device != "cpu" or pb.per_block != nixlbench.BLOCK_BYTES:
        out["nixl"] = {"error": f"interleaved only with host pools of "
                                f"{nixlbench.BLOCK_BYTES} B blocks"}
        return
    try:
        pb.nixl = await nixlbench.Server.start(pb.n_max)
    except Exception as exc:  # noqa: BLE001 (recorded; the pulls are measured anyway)
        out["nixl"] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    out["nixl"] = {"bench": "nixl_read", "agent": "lean", "env": pb.nixl.env}


async def _one_block(pb: _PullBench, s: Settings, via: Any) -> dict[str, float]:
    """One-block pulls on a warm connection: the time from the hint to the first byte, the
    whole pull, and its overhead (the pull less its block's copy; medians and p80)."""
    fb, total, over, phases = [], [], [], []
    cpu0, n = time.process_time() - engineload.engine_cpu_s(), max(20, s.repeats)
    for _ in range(n):
        o = await pb.pull(1, via=via)
        fb.append(o.phases["first_byte"])
        total.append(o.total_s)
        phases.append(_with_rest(o.phases))
        copy = o.phases.get("data", o.phases.get("read"))  # a read's copy (a stream: none)
        if copy is not None:
            over.append(o.total_s - copy)

    def ms(v: list[float], q: int) -> float:
        return round((statistics.median(v) if q == 2 else statistics.quantiles(v, n=5)[3])
                     * 1e3, 3)

    out = {"hint_to_first_byte_ms": ms(fb, 2), "hint_to_first_byte_p80_ms": ms(fb, 4),
           "one_block_total_ms": ms(total, 2),
           # this process's CPU time per pull over all its threads (the bench's own loop
           # included, the engine load's thread not): what a pull takes from the engine
           "one_block_cpu_ms": round((time.process_time() - engineload.engine_cpu_s()
                                      - cpu0) / n * 1e3, 3),
           "one_block_phases_ms": _median_phases(phases)}
    if len(over) == len(total):
        out.update(one_block_overhead_ms=ms(over, 2), one_block_overhead_p80_ms=ms(over, 4))
    return out


# The state's time to live of ``case_pull``'s past-ttl pullers; their pulls are spaced by
# twice this, which also lets each refresh end before the next round.
PAST_TTL_S = 0.02


async def _past_ttl(pb: _PullBench, s: Settings) -> dict[str, Any]:
    """Pulls of one block and of the middle measured size, each after a pause past the
    source state's time to live, by a puller that uses the stale state (fetching it again
    once the pull has ended) and one that waits for the fetch, alternated with the headline
    puller (its state fresh) after the same pause: per size (bytes), medians of the whole
    pull and its ``metadata`` phase, and each over the fresh one's."""
    vias = {"fresh": pb.puller, **pb.past_ttl}
    out: dict[str, Any] = {"ttl_s": PAST_TTL_S}
    middle = sorted(s.sizes)[len(s.sizes) // 2] if s.sizes else pb.per_block
    for n in dict.fromkeys((1, max(1, middle // pb.per_block))):
        total: dict[str, list[float]] = {k: [] for k in vias}
        metadata: dict[str, list[float]] = {k: [] for k in vias}
        for _ in range(s.repeats):
            for name, via in vias.items():
                await asyncio.sleep(2 * PAST_TTL_S)
                o = await pb.pull(n, via=via)
                total[name].append(o.total_s)
                metadata[name].append(o.phases.get("metadata", 0.0))
        row: dict[str, Any] = {
            name: {"total_ms": round(statistics.median(total[name]) * 1e3, 3),
                   "metadata_ms": round(statistics.median(metadata[name]) * 1e3, 3)}
            for name in vias}
        for name in pb.past_ttl:
            row[f"{name}_over_fresh"] = round(row[name]["total_ms"] / row["fresh"]["total_ms"], 3)
        out[str(n * pb.per_block)] = row
    return out


async def _check_pulls(pb: _PullBench) -> dict[str, Any]:
    """Warm-up (connection, state cache) and a checked pull (:meth:`_PullBench.checked`) of
    every puller, from each source; returns the headline puller's first pull (the process's
    first: state fetch, connections, the lanes' endpoints to the source) as ``total_ms`` and
    ``phases_ms``."""
    bench = pb.bench
    ports = [None] + ([bench.scattered_http_port] if bench.scattered_http_port else [])
    first: dict[str, Any] = {}
    for via in pb.pullers:
        for port in ports:
            o = await pb.checked(pb.n_max, port, via)
            if not first:
                first = {"blocks": pb.n_max, "total_ms": round(o.total_s * 1e3, 3),
                         "phases_ms": {k: round(v * 1e3, 3) for k, v in o.phases.items()}}
    return first


# A direct read's phases, one after another from the hint to the commit (``direct``,
# ``read`` and ``transfer`` contain some of them); ``rest`` is the pull's time outside them.
DIRECT_STEPS = ("queue", "metadata", "plan", "allocate", "handoff", "lookup", "data",
                "confirm", "validate", "commit")


def _with_rest(phases: dict[str, float]) -> dict[str, float]:
    """``phases`` with ``rest`` added for a direct read."""
    if not all(k in phases for k in (*DIRECT_STEPS, "total")):
        return phases
    return {**phases, "rest": phases["total"] - sum(phases[k] for k in DIRECT_STEPS)}


def _median_phases(phases: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the pulls that had it, in ms."""
    return {k: round(statistics.median(p[k] for p in phases if k in p) * 1e3, 3)
            for k in dict.fromkeys(k for p in phases for k in p)}


async def _pack_totals(port: int) -> tuple[float, float]:
    """The source at ``port``'s packing so far, from its metrics: seconds and bytes."""
    import aiohttp  # noqa: PLC0415
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    found = {m.name: m for m in text_string_to_metric_families(text)}
    samples = {smp.name: smp.value for name in ("kvkern_source_pack_seconds",
                                                "kvkern_source_packed_bytes")
               for smp in found[name].samples}
    return samples["kvkern_source_pack_seconds_sum"], samples["kvkern_source_packed_bytes_total"]


async def _pull_size(pb: _PullBench, s: Settings, size: int) -> dict[str, Any]:
    """Every variant once per repeat, in a shuffled order, at one size."""
    bench = pb.bench
    n = max(1, size // pb.per_block)
    nbytes = n * pb.per_block
    await bench.fetch(nbytes, nbytes, in_flight=1)  # warm the raw buffer too
    raw_t, msgs, reads, phases = [], [], [], []
    times: dict[str, list[float]] = {"pull": [], "scattered": [], "stream": [],
                                     "stream_scattered": [], "into": [], "into_ucx": [],
                                     "into_stream": [],
                                     **{k: [] for k in pb.fewer}}
    scat = bench.scattered_http_port
    variants = [("raw", None, None), ("pull", None, pb.puller)]
    if scat:
        variants.append(("scattered", scat, pb.puller))
    if pb.streamer is not None:
        variants.append(("stream", None, pb.streamer))
        if scat:
            variants.append(("stream_scattered", scat, pb.streamer))
        if s.all_variants:  # as an engine connector pulls: read (this host's source), and
            # streamed (a device pool, or a source that allows no reads)
            variants += [("into", None, pb.puller), ("into_stream", None, pb.streamer)]
    if "ucx" in pb.fewer:  # and read through UCX, as from a source on another host
        variants.append(("into_ucx", None, pb.fewer["ucx"]))
    variants += [(k, None, via) for k, via in pb.fewer.items()]
    if pb.nixl is not None:  # NIXL's READ of as many blocks, each of its ways
        for mapping, per_request in NIXL_WAYS:
            times[_nixl_key(mapping, per_request)] = []
            variants.append((_nixl_key(mapping, per_request), None, (mapping, per_request)))
            await _nixl_read(pb, n, mapping, per_request)  # warm-up: registration caches
    # untimed, one pull of every variant into poisoned blocks, each block checked: also each
    # one's warm-up at this size, as NIXL's ways have theirs
    checked = []
    for kind, port, via in sorted(variants, key=lambda v: v[0]):
        if kind != "raw" and not kind.startswith("nixl"):
            await pb.checked(n, port, via, into=kind.startswith("into"))
            checked.append(kind)
    # the scattered source packs for its streams only (the headline's reads do not pack)
    packed = await _pack_totals(scat) if scat and pb.streamer is not None else None
    order = random.Random(size)
    for _ in range(s.repeats):  # every variant once per repeat, in a shuffled order
        order.shuffle(variants)  # (a fixed order favoured whichever ran after raw)
        for kind, port, via in variants:
            if kind == "raw":
                raw_t.append(await bench.fetch(nbytes, nbytes, in_flight=1))
                continue
            if kind.startswith("nixl"):
                if (took := await _nixl_read(pb, n, *via)) is not None:
                    times[kind].append(took)
                continue
            o = await pb.pull(n, port, via, into=kind.startswith("into"))
            times[kind].append(o.total_s)
            if kind == "pull":
                msgs.append(o.messages)
                reads.append(o.reads)
                phases.append(_with_rest(o.phases))
    ps, rs = _summary(nbytes, times["pull"]), _summary(nbytes, raw_t)
    # each phase's median over the headline pulls that had it (the copy alone: "data" of a
    # direct read, "read" of a granted one; a stream's copy is not apart from its messages)
    median_phases = _median_phases(phases)
    row = {"bytes": nbytes, "blocks": n, "pull_gbps": ps["gbps"],
           "pull_gbps_p20": ps["gbps_p20"], "pull_gbps_p80": ps["gbps_p80"],
           "raw_gbps": rs["gbps"], "ratio": round(ps["gbps"] / rs["gbps"], 3),
           "pull_ms": ps["ms"], "raw_ms": rs["ms"], "messages": statistics.median(msgs),
           "chunk_bytes": s.chunk_bytes,
           "phases_ms": median_phases}
    row["reads"] = statistics.median(reads)
    copy_ms = next((median_phases[k] for k in ("data", "read") if k in median_phases), None)
    if copy_ms:  # the bytes' own move: what the pull costs beyond it is its overhead
        row["copy_gbps"] = round(nbytes / copy_ms / 1e6, 3)
        row["copy_ratio"] = round(row["copy_gbps"] / rs["gbps"], 3)
        over = [p["total"] - p.get("data", p.get("read", 0.0)) for p in phases]
        row["overhead_ms"] = round(statistics.median(over) * 1e3, 3)
    if times["scattered"]:  # source blocks at shuffled ids: one read (or pack) per block
        ss = _summary(nbytes, times["scattered"])
        row.update(scattered_pull_gbps=ss["gbps"], scattered_pull_gbps_p20=ss["gbps_p20"],
                   scattered_pull_gbps_p80=ss["gbps_p80"],
                   scattered_ratio=round(ss["gbps"] / rs["gbps"], 3))
    for key in ("stream", "stream_scattered", "into", "into_ucx", "into_stream", *pb.fewer):
        if times[key]:  # the stream path and fewer lanes in the same run, for comparison
            t = _summary(nbytes, times[key])
            row.update({f"{key}_pull_gbps": t["gbps"],
                        f"{key}_ratio": round(t["gbps"] / rs["gbps"], 3)})
    if pb.nixl is not None:  # (every READ of every way done: the server is still up)
        row.update(_nixl_row(nbytes, times, row))
    if packed is not None and times["stream_scattered"]:
        # what a scattered stream spends packing at the source: a second pass over the
        # bytes, beside the raw send's one
        secs, nb = (b - a for a, b in zip(packed, await _pack_totals(scat), strict=True))
        if secs > 0:
            row["stream_scattered_pack_ms"] = round(secs / len(times["stream_scattered"])
                                                    * 1e3, 3)
            row["stream_scattered_pack_gbps"] = round(nb / secs / 1e9, 3)
    row["checked"] = checked
    return row


# NIXL's ways of reading a pull's blocks: (mapping, issued per request as vLLM's connector does)
NIXL_WAYS = (("consecutive", False), ("consecutive", True), ("scattered", False),
             ("scattered", True))


async def _nixl_read(pb: _PullBench, n: int, mapping: str, per_request: bool) -> float | None:
    """One of NIXL's READs (seconds); None once NIXL failed: the server is stopped, the
    error recorded (``pb.nixl_error``) and the pulls go on without it."""
    if pb.nixl is None:
        return None
    try:
        return await pb.nixl.read(n, mapping, per_request)
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        server, pb.nixl = pb.nixl, None
        pb.nixl_error = f"{type(exc).__name__}: {exc}"
        await server.close()
        return None


def _drop_nixl_figures(out: dict[str, Any]) -> None:
    """NIXL's interleaved figures out of every size of a pull case whose NIXL server failed:
    a server that did not end cleanly never confirmed its notifications, so none of its
    figures stand (the targets then take NIXL's own run's)."""
    for size, row in out.items():
        if size.isdigit():
            for key in [k for k in row if k == "nixl" or k.startswith("kvkern_") and "nixl" in k]:
                del row[key]


def _nixl_key(mapping: str, per_request: bool) -> str:
    return f"nixl_{mapping}" + ("_per_request" if per_request else "")


def _nixl_row(nbytes: int, times: dict[str, list[float]], row: dict[str, Any]) -> dict[str, Any]:
    """NIXL's READs of one size, interleaved with the pulls (``nixl``: each way's GB/s), and
    kvkern / NIXL for each: the pull against the consecutive ways, the scattered pull
    against the scattered ones."""
    from kvkern.tools.nixlbench import kvkern_ratios, summary  # noqa: PLC0415

    ways = {_nixl_key(m, r)[5:]: summary(nbytes, times[_nixl_key(m, r)]) for m, r in NIXL_WAYS}
    return {"nixl": ways, **kvkern_ratios(row, ways)}


CASES = {"raw": case_raw, "chunked": case_chunked, "messages": case_messages,
         "pull": case_pull}


def _environment(s: Settings) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "machine": platform.machine(), "device": s.device,
                           "progress_mode": s.progress_mode, **threadpools.record(),
                           # kvkern's UCX settings, and every other UCX_ variable this
                           # process has (ucxx sets some when imported; NIXL inherits them)
                           "ucx_env": {**{k: os.environ.get(k) for k in UCX_DEFAULTS
                                          | {"UCX_TLS": ""}},
                                       **{k: v for k, v in os.environ.items()
                                          if k.startswith("UCX_")}}}
    with contextlib.suppress(Exception):
        import ucxx  # noqa: PLC0415 (already imported by the transport at this point)

        env["ucxx"] = ucxx.__version__
        env["libucx"] = ucxx.__ucx_version__
    from kvkern.tools.provenance import git_state  # noqa: PLC0415

    env.update(git_state())
    return env


async def _run_cases(info: dict, s: Settings, loop: Any) -> dict[str, Any]:
    from kvkern.xfer.transport import ConnectionPool  # noqa: PLC0415

    async with ConnectionPool(connect_timeout=10) as pool:
        t0 = time.perf_counter()
        conn = await pool.get("127.0.0.1", info["port"])
        result: dict[str, Any] = {"connect_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        bench = Bench(conn, pull_http_port=info.get("http_port"),
                      scattered_http_port=info.get("scattered_http_port"), loop=loop,
                      device=s.device)
        for name in s.cases:
            result[name] = await CASES[name](bench, s)
    return result


def run_xfer(s: Settings) -> dict[str, Any]:
    """Start the peer (and this process's engine load, when the run asks for one), run the
    cases, always kill the peer. Returns the result object."""
    threadpools.settle()
    s.apply_env(os.environ)
    from kvkern.xfer.auth import SECRET_ENV, SECRET_FILE_ENV, Credential, generate_secret  # noqa: PLC0415

    if Credential.from_env() is None:  # the bench and its peer form a fleet of their own
        os.environ[SECRET_ENV] = generate_secret()
        os.environ.pop(SECRET_FILE_ENV, None)
    load = engineload.from_env()
    try:
        out = _run_xfer(s)
    finally:
        busy = load.stop() if load is not None else 0.0
    if load is not None:  # what this (the pulling) process's engine computed
        out["env"]["engine_load"] = {"fraction": load.fraction, "busy": busy}
    return out


def _run_xfer(s: Settings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvkern-bench-") as tmp:
        port_file = os.path.join(tmp, "port")
        cmd = [sys.executable, "-m", "kvkern.tools.benchcli", "_peer", "--port-file", port_file,
               "--max-seconds", str(s.peer_timeout_s), "--parent-pid", str(os.getpid()),
               "--in-flight", str(s.in_flight), "--chunk-bytes", str(s.chunk_bytes),
               "--pull-blocks", str(_pull_blocks_for(s) if "pull" in s.cases else 0),
               "--pull-layout", s.pull_layout, "--pull-tp", str(s.pull_tp[0]),
               "--pull-pp", str(s.pull_pp[0]), "--source-blocks", str(s.source_blocks),
               "--device", s.device]
        peer = subprocess.Popen(cmd, env=dict(os.environ), stdout=sys.stderr,
                                stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(port_file):
                if peer.poll() is not None:
                    raise RuntimeError(f"bench peer exited with {peer.returncode} before "
                                       "listening")
                if time.monotonic() > deadline:
                    raise RuntimeError("bench peer did not listen within 30 s")
                time.sleep(0.02)
            with open(port_file) as f:
                info = json.loads(f.read())
            from kvkern.xfer.runtime import EventLoopThread  # noqa: PLC0415

            # One loop for everything (ucxx binds progress to a loop; the puller shares it).
            rt = EventLoopThread("kvkern-bench")
            try:
                result = rt.run(_run_cases(info, s, rt), s.peer_timeout_s)
            finally:
                rt.close()
        finally:
            peer.kill()
            peer.wait(timeout=10)
    biggest = str(max(s.sizes))
    out: dict[str, Any] = {"bench": "xfer", "bytes": max(s.sizes)}
    if "pull" in result:  # the headline: pull vs a raw one-buffer send of the same bytes
        pr = result["pull"][biggest]
        out |= {"bytes": pr["bytes"], "blocks": pr["blocks"], "pull_gbps": pr["pull_gbps"],
                "raw_gbps": pr["raw_gbps"], "ratio": pr["ratio"],
                "messages": pr["messages"],
                "hint_to_first_byte_ms": result["pull"].get("hint_to_first_byte_ms"),
                "scattered_ratio": pr.get("scattered_ratio"),
                "data_path": result["pull"]["data_path"],
                "by_size": {size: {k: r[k] for k in ("bytes", "blocks", "pull_gbps",
                                                     "raw_gbps", "ratio", "messages", "reads",
                                                     "copy_gbps", "scattered_pull_gbps",
                                                     *PATH_RATIOS, "kvkern_vs_nixl",
                                                     "kvkern_vs_nixl_scattered")
                                   if k in r}
                            for size, r in result["pull"].items() if size.isdigit()}}
    elif "raw" in result:
        out["raw_gbps"] = result["raw"][biggest]["gbps"]
    if "chunked" in result:
        out["chunked_gbps"] = result["chunked"][biggest]["gbps"]
    out["connect_ms"] = result.pop("connect_ms")
    out["cases"] = result
    out["env"] = _environment(s)
    return out


def _print_human(res: dict[str, Any]) -> None:
    nan = float("nan")
    env = res["env"]
    print(f"kvkern bench xfer: progress={env['progress_mode']} "
          f"ucx={env.get('libucx')} ucxx={env.get('ucxx')} connect={res['connect_ms']} ms")
    cases = res["cases"]
    for case in ("raw", "chunked"):
        for size, r in cases.get(case, {}).items():
            print(f"  {case:8s} {int(size) // MiB:5d} MiB  {r['gbps']:7.2f} GB/s "
                  f"[p20 {r['gbps_p20']:.2f}, p80 {r['gbps_p80']:.2f}]  {r['ms']:.2f} ms")
    for size, r in cases.get("pull", {}).items():
        if size.isdigit():
            print(f"  pull     {int(size) // MiB:5d} MiB  {r['pull_gbps']:7.2f} GB/s "
                  f"[p20 {r['pull_gbps_p20']:.2f}, p80 {r['pull_gbps_p80']:.2f}]  "
                  f"raw {r['raw_gbps']:.2f} GB/s  ratio {r['ratio']:.2f}  {r['blocks']} blocks "
                  f"{r['messages']} messages {r['reads']} reads")
            extra = [f"{k} {r[k]:.2f}" for k in (*PATH_RATIOS, "stream_scattered_pack_ms")
                     if k in r]
            if extra:
                print(f"  pull     {int(size) // MiB:5d} MiB  " + "  ".join(extra))
    for name, one in (("pull", cases.get("pull")),
                      ("granted", cases.get("pull", {}).get("granted"))):
        if one:
            print(f"  {name:8s} 1 block (warm): hint to first byte {one['hint_to_first_byte_ms']}"
                  f" ms, whole pull {one['one_block_total_ms']} ms, overhead "
                  f"{one.get('one_block_overhead_ms', '-')} ms (medians)")
    for size, past in cases.get("pull", {}).get("past_ttl", {}).items():
        if size.isdigit():
            print(f"  past ttl {int(size) / MiB:5g} MiB, the state past its time to live: used "
                  f"{past['stale']['total_ms']} ms, waiting for its fetch "
                  f"{past['refetch']['total_ms']} ms (metadata {past['refetch']['metadata_ms']} "
                  f"ms), fresh {past['fresh']['total_ms']} ms (medians)")
    for size, r in cases.get("pull", {}).items():  # interleaved: what the targets judge
        if size.isdigit() and "nixl" in r:
            w = r["nixl"]

            def judged(suffix: str, r: dict = r) -> float:  # the lower of its two ways
                got = [r[k] for k in (f"kvkern_vs_nixl{suffix}",
                                      f"kvkern_vs_nixl_per_request{suffix}") if k in r]
                return min(got, default=nan)

            print(f"  nixl     {int(size) // MiB:5d} MiB  interleaved READ "
                  f"{w['consecutive']['gbps']:.2f} GB/s (scattered {w['scattered']['gbps']:.2f}"
                  f", per request {w['consecutive_per_request']['gbps']:.2f} / "
                  f"{w['scattered_per_request']['gbps']:.2f})  kvkern / NIXL "
                  f"{judged(''):.2f} (scattered {judged('_scattered'):.2f}; through UCX "
                  f"{r.get('kvkern_ucx_vs_nixl', nan):.2f}, copy alone "
                  f"{r.get('kvkern_copy_vs_nixl', nan):.2f})")
    nixl = res.get("compare", {}).get("nixl")
    if nixl is not None and "error" in nixl:
        print(f"  nixl     {nixl['error']}")
    for size, r in (nixl or {}).get("cases", {}).items():  # NIXL's own run, minutes later
        print(f"  nixl     {int(size) // MiB:5d} MiB  own run READ {r['consecutive']['gbps']:.2f} GB/s "
              f"(scattered {r['scattered']['gbps']:.2f})  kvkern / NIXL "
              f"{r.get('kvkern_vs_nixl', float('nan')):.2f} "
              f"(scattered {r.get('kvkern_vs_nixl_scattered', float('nan')):.2f})")
        if "consecutive_per_request" in r:
            print(f"  nixl     {int(size) // MiB:5d} MiB  per request "
                  f"{r['consecutive_per_request']['gbps']:.2f} GB/s (scattered "
                  f"{r['scattered_per_request']['gbps']:.2f})  kvkern / NIXL "
                  f"{r.get('kvkern_vs_nixl_per_request', float('nan')):.2f} (scattered "
                  f"{r.get('kvkern_vs_nixl_per_request_scattered', float('nan')):.2f})")
    for name, sub in res.get("reshards", {}).items():
        if "error" in sub:
            print(f"  reshard  {name}: {sub['error']}")
        for size, r in sub.get("cases", {}).get("pull", {}).items():
            if size.isdigit():
                extra = "  ".join(f"{k} {r[k]:.2f}" for k in
                                  ("copy_ratio", "scattered_ratio", "stream_ratio",
                                   "stream_scattered_ratio") if k in r)
                print(f"  reshard  {name:5s} {int(size) // MiB:5d} MiB  ratio {r['ratio']:.2f}  "
                      f"{r['reads']} reads  {extra}")
    if res.get("targets"):
        print("  targets (same run):")
        print("\n".join(benchtargets.format_lines(res["targets"])))
    if "messages" in cases:
        m = cases["messages"]
        print(f"  messages control rtt {m['control_rtt_us']} us; {m['n']} x 64 KiB: "
              f"serial {m['serial_us_per_msg']} us/msg ({m['serial_gbps']} GB/s), "
              f"32 in flight {m['in_flight_32_us_per_msg']} us/msg "
              f"({m['in_flight_32_gbps']} GB/s)")


def _parser() -> argparse.ArgumentParser:
    from kvkern.layout import LAYOUT_CONSTRUCTORS  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="kvkern bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True, metavar="{xfer}")
    x = sub.add_parser("xfer", help="raw UCXX transfer between two processes on 127.0.0.1",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    x.add_argument("--sizes", default="64MiB,256MiB", help="comma list, e.g. 64MiB,256MiB")
    x.add_argument("--chunk", default="16MiB",
                   help="chunk size of the chunked case, and the pull case's chunk_bytes "
                        "(source and puller)")
    x.add_argument("--in-flight", type=int, default=4,
                   help="chunks in flight in the chunked case, and the pull case's "
                        "chunks_in_flight (source and puller)")
    x.add_argument("--repeats", type=int, default=Settings.repeats,
                   help="timed repetitions of each case")
    x.add_argument("--cases", default="raw,chunked,messages,pull",
                   help=f"comma list of {sorted(CASES)}")
    x.add_argument("--progress-mode", default=os.environ.get("UCXPY_PROGRESS_MODE", "thread"),
                   choices=["thread", "thread-polling", "polling", "blocking"],
                   help="ucxx progress mode (UCXPY_PROGRESS_MODE)")
    x.add_argument("--ucx-env", default="kvkern", choices=["kvkern", "off"],
                   help="'off' measures UCX's default error handling (TCP on loopback)")
    x.add_argument("--timeout", type=float, default=60.0, help="hard limit for the run (s)")
    x.add_argument("--data-path", default="both", choices=["read", "stream", "both"],
                   help="pull case: one-sided reads (the default path), the chunk stream, "
                        "or both in the same run (read is the headline)")
    x.add_argument("--pull-layout", default="trtllm", choices=sorted(LAYOUT_CONSTRUCTORS),
                   help="pull case: engine layout of both pools (trtllm: block rows, one "
                        "read per run of blocks; vllm_hnd: per layer, one read per layer "
                        "and run; the others stream)")
    x.add_argument("--pull-tp", default="1:1", metavar="S:D",
                   help="pull case: TP size of the source and of the destination (e.g. 2:1, "
                        "a reshard: each destination block gathers every source rank's heads)")
    x.add_argument("--pull-pp", default="1:1", metavar="S:D",
                   help="pull case: PP size of the source and of the destination (e.g. 2:1: "
                        "each destination block gathers every source stage's layers)")
    x.add_argument("--pull-one-rank", action="store_true",
                   help="pull case: this process hosts only the destination's first rank "
                        "(one process per rank, as engines run TP and PP); sizes are that "
                        "rank's bytes")
    x.add_argument("--read-lanes", type=int, default=Settings.read_lanes,
                   help="pull case: read lanes of the headline pull (XferConfig.read_lanes); "
                        "one lane is measured in the same run (lanes1_*)")
    x.add_argument("--source-blocks", type=int, default=SOURCE_POOL_BLOCKS, metavar="N",
                   help="pull case: blocks in each host source pool, the pulled ones "
                        "committed and the rest free and untouched: a serving engine's pool "
                        "size, so the read directory is as large (0: the pulled blocks "
                        "only, a directory small enough to read whole)")
    x.add_argument("--compare", choices=["nixl"], default=None,
                   help="also measure NIXL's block-list READ on the same pool shapes and sizes "
                        "in this run, with kvkern / NIXL ratios (needs nixl: make bench-nixl)")
    x.add_argument("--reshards", default=None, metavar="LIST",
                   help="also pull through TP and PP reshards (a peer each), with the raw "
                        "send of the same bytes: all, none or a comma list of "
                        "tp2:1,tp1:2,pp2:1,pp1:2 (default: all with --compare, else none)")
    x.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where both processes' buffers and KV pools live (cuda: device "
                        "memory, moved by UCX's CUDA transports; the pull streams)")
    x.add_argument("--engine-load", type=_load_fraction, default=0.0, metavar="F",
                   help="an engine's own Python work in every process of the run: a thread "
                        "computing for F of every 10 ms (kvkern.tools.engineload)")
    x.add_argument("--json", action="store_true", help="print one JSON object, last line")
    p = sub.add_parser("_peer")  # the benchmark's second process; no help: not listed
    p.add_argument("--port-file", required=True)
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--chunk-bytes", type=int, default=16 * MiB)
    p.add_argument("--pull-blocks", type=int, default=0)
    p.add_argument("--pull-layout", default="trtllm")
    p.add_argument("--pull-tp", type=int, default=1)
    p.add_argument("--pull-pp", type=int, default=1)
    p.add_argument("--source-blocks", type=int, default=0)
    p.add_argument("--device", default="cpu")
    return parser


def main(argv: list[str] | None = None) -> int:
    threadpools.settle()  # (before anything loads torch; the peer and NIXL's inherit it)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "device", "cpu") == "cuda":  # the raw sends' buffers, before any pool
        from kvkern.xfer.ucxcompat import note_cuda_device  # noqa: PLC0415

        note_cuda_device(ns.device)

    if ns.what == "_peer":
        engineload.from_env()  # the source's engine, when the run asks for one
        asyncio.run(_peer_main(ns.port_file, ns.max_seconds, ns.parent_pid or os.getppid(),
                               ns.in_flight, ns.pull_blocks, ns.chunk_bytes,
                               ns.pull_layout, ns.pull_tp, ns.device, ns.pull_pp,
                               ns.source_blocks))
        return 0
    cases = tuple(c for c in ns.cases.split(",") if c)
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {sorted(CASES)}")
    if ns.device == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible to torch")
    s = Settings(ucx_env=ns.ucx_env, progress_mode=ns.progress_mode,
                 sizes=tuple(_parse_size(t) for t in ns.sizes.split(",") if t),
                 chunk_bytes=_parse_size(ns.chunk), in_flight=ns.in_flight,
                 repeats=ns.repeats, cases=cases, peer_timeout_s=ns.timeout,
                 data_path=ns.data_path, pull_layout=ns.pull_layout,
                 pull_tp=_parse_split("--pull-tp", ns.pull_tp, parser),
                 pull_pp=_parse_split("--pull-pp", ns.pull_pp, parser), read_lanes=ns.read_lanes,
                 pull_one_rank=ns.pull_one_rank,
                 device=ns.device, source_blocks=ns.source_blocks,
                 nixl=ns.compare == "nixl" and "pull" in cases)
    if ns.engine_load:  # every process of the run (peers, NIXL's) starts its own
        os.environ[engineload.ENV] = str(ns.engine_load)
    try:
        reshards = benchtargets.parse_reshards(ns.reshards, compare=ns.compare is not None)
    except ValueError as exc:
        parser.error(f"--reshards: {exc}")
    res = run_xfer(s)
    if ns.compare == "nixl":
        from kvkern.tools.nixlbench import compare  # noqa: PLC0415

        res["compare"] = {"nixl": compare(res)}
    if reshards and "pull" in cases:
        res["reshards"] = benchtargets.run_reshards(s, reshards, run_xfer)
    if "pull" in cases:
        res["targets"] = benchtargets.evaluate(res, complete=ns.compare is not None)
    if ns.json:
        sys.stdout.flush()
        print(json.dumps(res), flush=True)
    else:
        _print_human(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
