"""The source service between real processes on 127.0.0.1, plus its pure parts.

Two source peers (tests/peers/source_peer.py, TP1 and TP2, started in parallel) serve the
module; the test process is the destination, driving them with a raw ConnectionPool, messages
and recv_stream, and checking received bytes against the peers' own block checksums. Fault
knobs are switched at run time through the peer's /test/faults route, so one peer serves every
fault test. One in-process service covers busy admission and close().

One-sided reads (``PullRequest.read``): the test process reads a read reply's blocks with
``Connection.read`` as a destination would, then ReadDone -> ReadAck; in-process services
cover a read whose ReadDone never comes (deadline) and a source with reads off.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.cache.hashing import DEFAULT_SCHEME, sequence_hashes
from kvkern.cache.pool import BlockPool
from kvkern.kernels.pack import pack
from kvkern.layout.chunks import count_chunks, plan_chunks
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer.auth import Credential
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import (
    READ_CAPABILITY,
    Cancel,
    Codec,
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
from kvkern.xfer.metrics import PHASES, XferMetrics
from kvkern.xfer.runtime import EventLoopThread
from kvkern.xfer.source import (
    STATE_PATH,
    PeerQuotas,
    SourceConfig,
    SourceService,
    StagingPool,
)
from kvkern.xfer.transport import (
    CONTROL_TAG,
    MAX_TRANSFER_ID,
    ConnectionPool,
    Lane,
    TransportError,
    tag_for,
)
from kvkern.xfer.ucp_rma import coalesce
from tests.fleet import peer_get, peer_headers, prove_host

PEER = Path(__file__).parent / "peers" / "source_peer.py"
OPEN = PeerQuotas(max_sends_per_peer=64, peer_pin_fraction=1.0, total_pin_fraction=1.0)
HOST = "127.0.0.1"
READY = "KVKERN_READY "
CLOSED = "KVKERN_CLOSED "
pytestmark = pytest.mark.timeout(60)
aio = pytest.mark.asyncio(loop_scope="module")

# The peers' model: 2 layers, 4 KV heads, head_dim 16, block 4 tokens, fp16.
LAYERS, HEADS, HEAD_DIM, BLOCK, ITEM = 2, 4, 16, 4, 2
SCHEME = DEFAULT_SCHEME


def unit(layers: int, heads: int) -> int:
    """Bytes of one block of a (layers x heads) piece."""
    return layers * 2 * heads * BLOCK * HEAD_DIM * ITEM


# ------------------------------------------------------------------------------- peers


def start_peers(specs: list[list[str]], timeout: float = 40.0) -> list[tuple[subprocess.Popen, dict]]:
    """Start every peer at once; wait for each KVKERN_READY line (bounded)."""
    procs = [subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, bufsize=1)
             for args in specs]
    ready: list[dict | None] = [None] * len(procs)
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    deadline = time.monotonic() + timeout
    try:
        while any(r is None for r in ready):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"source peers not ready in {timeout} s")
            for key, _ in sel.select(min(left, 0.5)):
                i = key.data
                line = procs[i].stdout.readline()
                if line.startswith(READY):
                    ready[i] = json.loads(line[len(READY):])
                    sel.unregister(procs[i].stdout)
                elif not line and procs[i].poll() is not None:
                    raise RuntimeError(f"source peer {specs[i]} exited with {procs[i].poll()}")
    except BaseException:
        for p in procs:
            stop_peer(p)
        raise
    finally:
        sel.close()
    return list(zip(procs, ready, strict=True))


def stop_peer(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="module")
def peers():
    common = ["--lifetime-s", "90", "--chunk-bytes", "5000"]
    started = start_peers([[*common, "--seq", "0:64", "--worker-id", "src-tp1"],
                           [*common, "--tp", "2", "--layout", "vllm_nhd", "--seq", "0:32",
                            "--worker-id", "src-tp2"],
                           # the SIGTERM test's own, started with the others to save time
                           [*common, "--seq", "0:64", "--freeze-after-reply"]])
    try:
        for _, ready in started:  # (a destination fetches the state before it connects)
            peer_get(f"http://{HOST}:{ready['http_port']}", STATE_PATH)
        yield started
    finally:
        for proc, _ in started:
            stop_peer(proc)


@pytest.fixture(scope="module")
def tp1(peers):
    return peers[0][1]


@pytest.fixture(scope="module")
def tp2(peers):
    return peers[1][1]


@pytest.fixture(scope="module")
def frozen_peer(peers):
    return peers[2]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool():
    async with ConnectionPool(connect_timeout=10) as p:
        yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


_tids = iter(range(1, MAX_TRANSFER_ID))


async def get_json(http, ready: dict, path: str):
    base = f"http://{HOST}:{ready['http_port']}"
    async with http.get(f"{base}{path}", headers=peer_headers("GET", path, base)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def post_json(http, ready: dict, path: str, body: dict):
    async with http.post(f"http://{HOST}:{ready['http_port']}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def wait_released(http, ready: dict, timeout: float = 10.0) -> dict:
    """Poll /test/stats until no pin, no active send and no pinned block (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await get_json(http, ready, "/test/stats")
        if (st["pins_outstanding"] == 0 and st["active_sends"] == 0
                and st["pool"]["pinned"] == 0 and st["pool"]["pins"] == 0):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"pins not released within {timeout} s: {st}")
        await asyncio.sleep(0.05)


async def wait_pinned(http, ready: dict, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await get_json(http, ready, "/test/stats")
        if st["pins_outstanding"] >= 1 and st["pool"]["pinned"] >= 1:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing pinned within {timeout} s: {st}")
        await asyncio.sleep(0.02)


def full_piece(src_rank: int = 0, heads: int = HEADS) -> list[PlanPiece]:
    return [PlanPiece(src_rank=src_rank, layer_start=0, layer_stop=LAYERS, head_start=0,
                      head_stop=heads, offset=0, length=unit(LAYERS, heads))]


def request(hashes: list[int], *, start: int = 0, count: int | None = None,
            pieces: list[PlanPiece] | None = None, chunk_bytes: int = 1 << 20,
            deadline_ms: int = 10_000, scheme: str = SCHEME,
            require_all: bool = False, read: bool = False,
            chunk_blocks: list[int] | None = None) -> PullRequest:
    return PullRequest(transfer_id=next(_tids), request_id="test", hash_scheme=scheme,
                       block_hashes=hashes, start=start,
                       count=len(hashes) - start if count is None else count,
                       pieces=pieces or full_piece(), chunk_bytes=chunk_bytes,
                       deadline_ms=deadline_ms, require_all=require_all, read=read,
                       chunk_blocks=chunk_blocks or [])


async def ask(conn, req: PullRequest) -> PullReply:
    await conn.send_msg(req, timeout=5)
    reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=5)
    assert isinstance(reply, PullReply) and reply.transfer_id == req.transfer_id
    return reply


async def pull(conn, req: PullRequest) -> tuple[PullReply, np.ndarray]:
    reply = await ask(conn, req)
    sizes = reply.chunk_sizes if isinstance(reply, StreamReply) else []
    bufs = [np.full(s, 0xA5, np.uint8) for s in sizes]
    if bufs:
        await conn.recv_chunks(req.transfer_id, bufs, timeout=10)
    return reply, (np.concatenate(bufs) if bufs else np.empty(0, np.uint8))


def piece_blocks(data: np.ndarray, pieces: list[PlanPiece], n: int) -> list[list[bytes]]:
    """Split a stream of n blocks into per-piece per-block bytes (pack_for_peer's layout)."""
    out = []
    for p in sorted(pieces, key=lambda p: p.offset):
        base = p.offset * n
        out.append([data[base + b * p.length: base + (b + 1) * p.length].tobytes()
                    for b in range(n)])
    return out


async def digests(http, ready, hashes, rank=0, layers=None, heads=None) -> list[str]:
    q = "hashes=" + ",".join(map(str, hashes))
    if layers:
        q += f"&layers={layers[0]}:{layers[1]}"
    if heads:
        q += f"&heads={heads[0]}:{heads[1]}"
    got = await get_json(http, ready, f"/test/blocks?{q}")
    return [got[str(h)]["sha256"][str(rank)] for h in hashes]


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# --------------------------------------------------------------------------- HTTP routes


@aio
async def test_state_health_and_metrics(tp1, tp2, http):
    st = await get_json(http, tp1, STATE_PATH)
    assert st["protocol"] == "kvkern/1" and st["worker_id"] == "src-tp1"
    assert st["incarnation"] == tp1["incarnation"] and len(st["incarnation"]) == 32
    assert st["hash_scheme"] == SCHEME and st["block_size"] == BLOCK
    assert st["codec_fingerprint"] == f"{Codec().fingerprint:016x}"
    topo = Topology.from_dict(st["topology"])
    assert topo.model == ModelKVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                     block_size=BLOCK, dtype="float16")
    assert topo.parallel == Parallelism()
    r0 = st["dp_groups"]["0"]["ranks"]["0"]
    assert r0["ucx_host"] == HOST and r0["ucx_port"] == tp1["ucx_ports"]["0"]
    assert r0["layout"] == topo.local_layout(0, 64, "trtllm").describe()
    assert set(st["capabilities"]) >= {"pull/1", "strict", "best_effort", "sharded"}

    st2 = await get_json(http, tp2, STATE_PATH)
    assert st2["incarnation"] != st["incarnation"]
    ranks = st2["dp_groups"]["0"]["ranks"]
    assert sorted(ranks) == ["0", "1"]
    assert {ranks[r]["ucx_port"] for r in ranks} == set(tp2["ucx_ports"].values())
    assert all(ranks[r]["layout"]["num_heads"] == HEADS // 2 for r in ranks)

    health = await get_json(http, tp1, "/healthz")
    assert health == {"status": "ok", "worker_id": "src-tp1", "incarnation": tp1["incarnation"]}
    async with http.get(f"http://{HOST}:{tp1['http_port']}/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    assert 'kvkern_source_requests_total{status="ok"}' in text
    assert "kvkern_source_pinned_blocks 0.0" in text


# ------------------------------------------------------------------------------- pulls


@aio
async def test_full_pull_delivers_the_sources_bytes(tp1, pool, http):
    hs = tp1["sequences"][0]
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    req = request(hs, chunk_bytes=5000)  # 2 blocks of 2048 B per chunk
    reply, data = await pull(conn, req)
    assert reply.status == Status.OK and reply.served_blocks == 16
    assert reply.block_hashes == hs and reply.total_bytes == 16 * unit(LAYERS, HEADS)
    assert reply.chunk_sizes == [4096] * 8
    got = piece_blocks(data, req.pieces, 16)[0]
    assert [sha(b) for b in got] == await digests(http, tp1, hs)
    st = await wait_released(http, tp1)
    assert st["pool"]["cached"] >= 16

    # a middle range, then the service's own cap (5000) below the request's chunk_bytes
    req = request(hs, start=4, count=8, chunk_bytes=1 << 30)
    reply, data = await pull(conn, req)
    assert reply.status == Status.OK and reply.block_hashes == hs[4:12]
    assert reply.chunk_sizes == [4096] * 4
    assert [sha(b) for b in piece_blocks(data, req.pieces, 8)[0]] == \
        await digests(http, tp1, hs[4:12])

    # the destination's chunk plan (its runs of receive blocks), cut to the cap of 2 blocks
    req = request(hs, chunk_bytes=1 << 30, chunk_blocks=[3, 1, 12])
    reply, data = await pull(conn, req)
    assert reply.status == Status.OK and reply.served_blocks == 16
    assert reply.chunk_sizes == [b * 2048 for b in [2, 1, 1] + [2] * 6]
    assert [sha(b) for b in piece_blocks(data, req.pieces, 16)[0]] == \
        await digests(http, tp1, hs)

    # the source counts a send once it completed, before it releases the pins; the last
    # chunk can land here before that
    await wait_released(http, tp1)
    async with http.get(f"http://{HOST}:{tp1['http_port']}/metrics") as r:
        text = await r.text()
    assert "kvkern_source_blocks_served_total 40.0" in text


@aio
async def test_sub_slab_pieces_and_sub_block_chunks(tp1, pool, http):
    """Two pieces (layer 0 all heads; layer 1 heads 1..3) in offset order; chunks smaller than
    one block of a piece cut the block into byte slices."""
    hs = tp1["sequences"][0][:5]
    a = PlanPiece(src_rank=0, layer_start=0, layer_stop=1, head_start=0, head_stop=4,
                  offset=0, length=unit(1, 4))
    b = PlanPiece(src_rank=0, layer_start=1, layer_stop=2, head_start=1, head_stop=3,
                  offset=unit(1, 4), length=unit(1, 2))
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    req = request(hs, pieces=[b, a], chunk_bytes=700)  # given out of order on purpose
    reply, data = await pull(conn, req)
    assert reply.status == Status.OK
    # piece a: 1024 B/block -> 700 + 324 per block; piece b: 512 B/block -> 1 block per chunk
    assert reply.chunk_sizes == [700, 324] * 5 + [512] * 5
    got_a, got_b = piece_blocks(data, [a, b], 5)
    assert [sha(x) for x in got_a] == await digests(http, tp1, hs, layers=(0, 1), heads=(0, 4))
    assert [sha(x) for x in got_b] == await digests(http, tp1, hs, layers=(1, 2), heads=(1, 3))
    await wait_released(http, tp1)


@aio
async def test_tp2_each_rank_serves_its_heads(tp2, pool, http):
    hs = tp2["sequences"][0]
    for rank in (0, 1):
        conn = await pool.get(HOST, tp2["ucx_ports"][str(rank)])
        req = request(hs, pieces=full_piece(rank, heads=HEADS // 2))
        reply, data = await pull(conn, req)
        assert reply.status == Status.OK and reply.served_blocks == 8
        got = piece_blocks(data, req.pieces, 8)[0]
        assert [sha(b) for b in got] == await digests(http, tp2, hs, rank=rank)
        # a piece for the other rank is refused by this rank's listener
        wrong = await ask(conn, request(hs, pieces=full_piece(1 - rank, heads=HEADS // 2)))
        assert wrong.status == Status.REJECTED and wrong.reason.startswith("wrong_rank:")
    await wait_released(http, tp2)


@aio
async def test_partial_and_miss(tp1, pool, http):
    committed = await post_json(http, tp1, "/test/commit", {"range": [1000, 1032]})
    hs = committed["hashes"]
    assert hs == sequence_hashes(list(range(1000, 1032)), BLOCK, SCHEME) and len(hs) == 8
    ev = await post_json(http, tp1, "/test/evict", {"hashes": [hs[5]]})
    assert ev["evicted"] == [hs[5]]
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    req = request(hs)
    reply, data = await pull(conn, req)
    assert reply.status == Status.PARTIAL and reply.served_blocks == 5
    assert reply.block_hashes == hs[:5] and reply.reason.startswith("partial:")
    assert [sha(b) for b in piece_blocks(data, req.pieces, 5)[0]] == \
        await digests(http, tp1, hs[:5])

    await post_json(http, tp1, "/test/evict", {"hashes": [hs[0]]})
    for hashes in (hs, [12345, 67890]):
        reply = await ask(conn, request(hashes))
        assert reply.status == Status.MISS and isinstance(reply, Refusal)
    await wait_released(http, tp1)


@aio
async def test_require_all_misses_without_pinning_or_disturbing_the_connection(tp1, pool,
                                                                             http):
    committed = await post_json(http, tp1, "/test/commit", {"range": [2000, 2032]})
    hs = committed["hashes"]
    await post_json(http, tp1, "/test/evict", {"hashes": [hs[5]]})
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    connects = pool.connects
    other = tp1["sequences"][0]
    # a strict miss and a full pull of other blocks, concurrently on one connection
    (miss, _), (full, data) = await asyncio.gather(
        pull(conn, request(hs, require_all=True)), pull(conn, request(other)))
    assert miss.status == Status.MISS and isinstance(miss, Refusal)
    assert miss.reason == "miss: 5 of 8 requested blocks cached (require_all)"
    assert full.status == Status.OK and full.served_blocks == len(other)
    assert [sha(b) for b in piece_blocks(data, full_piece(), len(other))[0]] == \
        await digests(http, tp1, other)
    assert conn.alive
    # require_all with every block cached is an ordinary full pull
    ok, data = await pull(conn, request(hs[:5], require_all=True))
    assert ok.status == Status.OK and ok.served_blocks == 5
    assert [sha(b) for b in piece_blocks(data, full_piece(), 5)[0]] == \
        await digests(http, tp1, hs[:5])
    assert conn.alive and pool.connects == connects  # never aborted, never reconnected
    await wait_released(http, tp1)


@aio
async def test_bad_requests_rejected_and_listener_keeps_serving(tp1, pool, http):
    hs = tp1["sequences"][0][:4]
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    good = unit(LAYERS, HEADS)
    cases = {
        "hash_scheme_mismatch": request(hs, scheme="trtllm-v1"),
        "wrong_rank": request(hs, pieces=full_piece(src_rank=1)),
        "bad_piece": request(hs, pieces=[PlanPiece(src_rank=0, layer_start=0, layer_stop=3,
                                                   head_start=0, head_stop=4, offset=0,
                                                   length=unit(3, 4))]),
    }
    bad_heads = [PlanPiece(src_rank=0, layer_start=0, layer_stop=2, head_start=2, head_stop=5,
                           offset=0, length=unit(2, 3))]
    bad_len = [PlanPiece(src_rank=0, layer_start=0, layer_stop=2, head_start=0, head_stop=4,
                         offset=0, length=good * 3)]  # absolute, not per block
    gap = [PlanPiece(src_rank=0, layer_start=0, layer_stop=2, head_start=0, head_stop=4,
                     offset=8, length=good)]
    for name, req in cases.items():
        reply = await ask(conn, req)
        assert reply.status == Status.REJECTED and reply.reason.startswith(f"{name}:"), reply
    for pieces in (bad_heads, bad_len, gap):
        reply = await ask(conn, request(hs, pieces=pieces))
        assert reply.status == Status.REJECTED and reply.reason.startswith("bad_piece:"), reply
    assert conn.alive
    reply, data = await pull(conn, request(hs))  # the same connection still serves
    assert reply.status == Status.OK and len(data) == 4 * good

    # a malformed frame kills only its own connection
    async with ConnectionPool(connect_timeout=10) as other:
        bad = await other.get(HOST, tp1["ucx_ports"]["0"])
        await bad.send_bytes(b"NOPE" + bytes(16), CONTROL_TAG, timeout=5)
        with pytest.raises(TransportError):
            await bad.recv_msg(tag_for(1, Lane.REPLY), timeout=5)
    reply, _ = await pull(conn, request(hs))
    assert reply.status == Status.OK
    await wait_released(http, tp1)
    text = await (await http.get(f"http://{HOST}:{tp1['http_port']}/metrics")).text()
    assert 'kvkern_source_requests_total{status="rejected"}' in text


# ------------------------------------------------------------------ unpin on every path


@pytest_asyncio.fixture(loop_scope="module")
async def faults(tp1, http):
    async def set_faults(**kw):
        return await post_json(http, tp1, "/test/faults", kw)
    try:
        yield set_faults
    finally:
        await set_faults(slow_send_ms=0, freeze_after_reply=False)


@aio
async def test_disconnect_mid_stream_releases_pins(tp1, http, faults):
    await faults(slow_send_ms=150)
    hs = tp1["sequences"][0]
    async with ConnectionPool(connect_timeout=10) as own:
        conn = await own.get(HOST, tp1["ucx_ports"]["0"])
        req = request(hs, chunk_bytes=2048)  # 16 chunks, 150 ms each
        reply = await ask(conn, req)
        assert reply.status == Status.OK and reply.n_chunks == 16
        buf = np.empty(2048, np.uint8)
        await conn.recv_bytes(buf, tag_for(req.transfer_id, Lane.DATA, 0), timeout=5)
        st = await wait_pinned(http, tp1)
        assert st["active_sends"] == 1 and st["pool"]["pinned"] == 16
        conn.abort("test_disconnect")
    await wait_released(http, tp1)


@aio
async def test_cancel_releases_pins(tp1, http, faults):
    await faults(slow_send_ms=150)
    hs = tp1["sequences"][0]
    async with ConnectionPool(connect_timeout=10) as own:
        conn = await own.get(HOST, tp1["ucx_ports"]["0"])
        req = request(hs, chunk_bytes=2048)
        reply = await ask(conn, req)
        assert reply.status == Status.OK
        await wait_pinned(http, tp1)
        await conn.send_msg(Cancel(transfer_id=req.transfer_id, reason="test"), timeout=5)
        await wait_released(http, tp1)
        # the source broke its promise of 16 chunks, so it aborted the connection
        with pytest.raises(TransportError):
            await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1), timeout=5)
    text = await (await http.get(f"http://{HOST}:{tp1['http_port']}/metrics")).text()
    assert 'kvkern_source_send_failures_total{reason="cancelled"}' in text


@aio
async def test_deadline_releases_pins(tp1, http, faults):
    await faults(freeze_after_reply=True)
    hs = tp1["sequences"][0]
    async with ConnectionPool(connect_timeout=10) as own:
        conn = await own.get(HOST, tp1["ucx_ports"]["0"])
        req = request(hs, deadline_ms=400)
        t0 = time.monotonic()
        reply = await ask(conn, req)
        assert reply.status == Status.OK
        with pytest.raises(TransportError) as info:  # aborted at the source's deadline
            await conn.recv_bytes(np.empty(reply.chunk_sizes[0], np.uint8),
                                  tag_for(req.transfer_id, Lane.DATA, 0), timeout=5)
        assert info.value.reason == "peer_closed"
        assert time.monotonic() - t0 < 4
    await wait_released(http, tp1)
    text = await (await http.get(f"http://{HOST}:{tp1['http_port']}/metrics")).text()
    assert 'kvkern_source_send_failures_total{reason="deadline"}' in text


# ------------------------------------------------------------------- one-sided reads


def metric(text: str, sample: str) -> float:
    """The value of one exposition line ``sample`` (name and labels), 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


async def metrics_text(http, ready: dict) -> str:
    async with http.get(f"http://{HOST}:{ready['http_port']}/metrics") as r:
        return await r.text()


async def lane_read(http, ready: dict, rkey: bytes, runs: list) -> None:
    """Read ``runs`` one-sided as a destination does: on a read lane to the worker rank 0's
    state names (the source's read target)."""
    from kvkern.xfer.read_lanes import ReadLanes

    st = await get_json(http, ready, STATE_PATH)
    worker = bytes.fromhex(st["dp_groups"]["0"]["ranks"]["0"]["read_worker"])
    lanes = ReadLanes(1, min_bytes=1)
    try:
        await lanes.read(worker, [(rkey, runs)], timeout=10, same_host=True)
    finally:
        lanes.close()


async def read_blocks(http, ready: dict, reply: ReadGrant) -> np.ndarray:
    """Read a read reply's blocks one-sided, as a destination would, into one buffer."""
    u = reply.total_bytes // reply.served_blocks
    buf = np.full(reply.total_bytes, 0xA5, np.uint8)
    runs = coalesce([buf.ctypes.data + i * u for i in range(reply.served_blocks)],
                    [reply.read_base + b * reply.read_stride for b in reply.read_blocks], u)
    await lane_read(http, ready, reply.read_rkey, runs)
    return buf


@aio
async def test_state_names_the_worker_read_lanes_connect_to(tp1, http):
    """A readable rank lists its process's UCX worker address (hex); the puller takes it
    only when it is well formed, else that rank streams, and is not refused."""
    import copy

    from kvkern.xfer.puller import parse_state
    from kvkern.xfer.read_lanes import MAX_WORKER_ADDRESS_BYTES, address_usable

    st = await get_json(http, tp1, STATE_PATH)
    text = st["dp_groups"]["0"]["ranks"]["0"]["read_worker"]
    assert address_usable(bytes.fromhex(text))
    assert parse_state(st).read_workers == {(0, 0): bytes.fromhex(text)}
    for bad in ("zz", "", 123, None, "ab" * (MAX_WORKER_ADDRESS_BYTES + 1)):
        body = copy.deepcopy(st)
        body["dp_groups"]["0"]["ranks"]["0"]["read_worker"] = bad
        parsed = parse_state(body)
        assert parsed.read_workers == {} and parsed.reads == {(0, 0): "canonical"}


@aio
async def test_read_reply_read_done_ack_then_unpin(tp1, pool, http):
    st = await get_json(http, tp1, STATE_PATH)
    assert READ_CAPABILITY in st["capabilities"]
    hs = tp1["sequences"][0]
    n, u = len(hs), unit(LAYERS, HEADS)
    held = await get_json(http, tp1, "/test/blocks?hashes=" + ",".join(map(str, hs)))
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    served_before = metric(await metrics_text(http, tp1), "kvkern_source_blocks_served_total")
    req = request(hs, read=True)
    reply = await ask(conn, req)
    assert reply.status == Status.OK and reply.served_blocks == n and reply.block_hashes == hs
    assert isinstance(reply, ReadGrant) and reply.read_base and reply.read_stride == u
    assert reply.read_blocks == [held[str(h)]["block_id"] for h in hs]  # the pinned blocks
    assert reply.total_bytes == n * u
    st = await wait_pinned(http, tp1)
    assert st["pool"]["pinned"] == n and st["active_sends"] == 1
    data = await read_blocks(http, tp1, reply)
    assert [sha(data[i * u:(i + 1) * u].tobytes()) for i in range(n)] == \
        await digests(http, tp1, hs)
    st = await get_json(http, tp1, "/test/stats")
    assert st["pins_outstanding"] == 1 and st["pool"]["pinned"] == n  # held until ReadDone
    await conn.send_msg(ReadDone(transfer_id=req.transfer_id), timeout=5)
    ack = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1), timeout=5)
    assert ack == ReadAck(transfer_id=req.transfer_id, held=True), ack
    await wait_released(http, tp1)
    assert metric(await metrics_text(http, tp1),
                  "kvkern_source_blocks_served_total") == served_before + n
    # a second ReadDone: nothing is pinned for it any more, and the source says so
    await conn.send_msg(ReadDone(transfer_id=req.transfer_id), timeout=5)
    again = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1), timeout=5)
    assert isinstance(again, ReadAck) and again.transfer_id == req.transfer_id
    assert not again.held and again.reason
    assert conn.alive


@aio
async def test_read_done_without_ack_unpins_and_answers_nothing(tp1, pool, http):
    """The destination's fast path: its reads ended inside the hold, so it commits at once
    and sends ReadDone(ack=False); the source unpins, counts the blocks served and sends no
    ReadAck (nor one for an unknown transfer)."""
    hs = tp1["sequences"][0]
    n = len(hs)
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    served_before = metric(await metrics_text(http, tp1), "kvkern_source_blocks_served_total")
    req = request(hs, read=True)
    reply = await ask(conn, req)
    assert reply.status == Status.OK and isinstance(reply, ReadGrant)
    data = await read_blocks(http, tp1, reply)
    u = reply.total_bytes // n
    assert [sha(data[i * u:(i + 1) * u].tobytes()) for i in range(n)] == \
        await digests(http, tp1, hs)
    await conn.send_msg(ReadDone(transfer_id=req.transfer_id, ack=False), timeout=5)
    await conn.send_msg(ReadDone(transfer_id=next(_tids), ack=False), timeout=5)  # unknown
    await wait_released(http, tp1)
    assert metric(await metrics_text(http, tp1),
                  "kvkern_source_blocks_served_total") == served_before + n
    with pytest.raises(TransportError) as ei:  # nothing on the ack tag
        await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1), timeout=0.5)
    assert ei.value.reason == "transfer_timeout"


@aio
async def test_read_done_for_an_unknown_transfer_is_not_held(tp1, pool, http):
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    tid = next(_tids)
    await conn.send_msg(ReadDone(transfer_id=tid), timeout=5)
    ack = await conn.recv_msg(tag_for(tid, Lane.REPLY, 1), timeout=5)
    assert isinstance(ack, ReadAck) and ack.transfer_id == tid and not ack.held, ack
    assert "no read" in ack.reason
    assert conn.alive
    reply, data = await pull(conn, request(tp1["sequences"][0][:2]))  # still serving
    assert reply.status == Status.OK and len(data) == 2 * unit(LAYERS, HEADS)
    await wait_released(http, tp1)


@aio
async def test_sub_block_pieces_are_read_and_unreadable_pools_stream(tp1, tp2, pool, http):
    """A sub-block piece is read too: the reply describes the whole pinned blocks and the
    destination reads the piece's bytes out of them. A pool readable only in its own order
    (vllm_nhd) offers whole blocks natively and streams sub-block pieces."""
    hs = tp1["sequences"][0][:3]
    a = PlanPiece(src_rank=0, layer_start=1, layer_stop=2, head_start=1, head_stop=3,
                  offset=0, length=unit(1, 2))
    conn = await pool.get(HOST, tp1["ucx_ports"]["0"])
    req = request(hs, pieces=[a], read=True)
    reply = await ask(conn, req)
    assert reply.status == Status.OK and isinstance(reply, ReadGrant)
    assert reply.total_bytes == 3 * unit(1, 2)  # what the piece moves
    assert reply.read_segment_bytes == unit(LAYERS, HEADS) == reply.read_stride  # TRT-LLM rows
    row = BLOCK * HEAD_DIM * ITEM
    out = np.full(3 * unit(1, 2), 0xA5, np.uint8)
    runs = []
    for i, b in enumerate(reply.read_blocks):  # layer 1, K then V, heads 1-2 of each
        for kv in (0, 1):
            off = ((1 * 2 + kv) * HEADS + 1) * row
            runs.append((out.ctypes.data + i * unit(1, 2) + kv * 2 * row,
                         reply.read_base + b * reply.read_stride + off, 2 * row))
    await lane_read(http, tp1, reply.read_rkey, runs)
    await conn.send_msg(ReadDone(transfer_id=req.transfer_id, ack=False), timeout=5)
    got = [sha(out[i * unit(1, 2):(i + 1) * unit(1, 2)].tobytes()) for i in range(3)]
    assert got == await digests(http, tp1, hs, layers=(1, 2), heads=(1, 3))
    await wait_released(http, tp1)

    st = await get_json(http, tp2, STATE_PATH)
    assert READ_CAPABILITY in st["capabilities"]
    assert st["dp_groups"]["0"]["ranks"]["0"]["read"] == "native"  # NHD: its own order only
    hs2 = tp2["sequences"][0][:2]
    conn2 = await pool.get(HOST, tp2["ucx_ports"]["0"])
    whole = request(hs2, pieces=full_piece(0, heads=HEADS // 2), read=True)
    reply = await ask(conn2, whole)  # whole blocks: read block for block, one per layer
    assert isinstance(reply, ReadGrant) and reply.read_native
    assert len(reply.read_more_rkeys) == LAYERS - 1
    assert reply.read_segment_bytes * LAYERS == unit(LAYERS, HEADS // 2)
    await conn2.send_msg(ReadDone(transfer_id=whole.transfer_id, ack=False), timeout=5)
    await wait_released(http, tp2)
    b = PlanPiece(src_rank=0, layer_start=0, layer_stop=1, head_start=0,
                  head_stop=HEADS // 2, offset=0, length=unit(1, HEADS // 2))
    req = request(hs2, pieces=[b], read=True)  # a sub-block piece of a native pool: stream
    reply, data = await pull(conn2, req)
    assert reply.status == Status.OK and isinstance(reply, StreamReply) and reply.n_chunks >= 1
    assert [sha(b) for b in piece_blocks(data, req.pieces, len(hs2))[0]] == \
        await digests(http, tp2, hs2, rank=0, layers=(0, 1))
    await wait_released(http, tp2)


@aio
async def test_cancel_during_a_read_releases_pins(tp1, http):
    hs = tp1["sequences"][0]
    cancelled = 'kvkern_source_send_failures_total{reason="cancelled"}'
    before = metric(await metrics_text(http, tp1), cancelled)
    async with ConnectionPool(connect_timeout=10) as own:
        conn = await own.get(HOST, tp1["ucx_ports"]["0"])
        req = request(hs, read=True)
        reply = await ask(conn, req)
        assert reply.status == Status.OK and isinstance(reply, ReadGrant)
        st = await wait_pinned(http, tp1)
        assert st["pool"]["pinned"] == len(hs)
        await read_blocks(http, tp1, reply)  # the destination read, then changed its mind
        await conn.send_msg(Cancel(transfer_id=req.transfer_id, reason="test"), timeout=5)
        await wait_released(http, tp1)
    assert metric(await metrics_text(http, tp1), cancelled) == before + 1


# ---------------------------------------------------------------- in-process: busy, close


class _Frozen(SourceService):
    async def _after_reply(self, req, reply) -> None:
        await asyncio.Event().wait()


def _group(tp: int = 1, num_blocks: int = 16, tokens: int = 32) -> tuple[KVGroup, list[int]]:
    topo = Topology(model=ModelKVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                      block_size=BLOCK, dtype="float16"),
                    parallel=Parallelism(tp_size=tp))
    bp = BlockPool(num_blocks, block_size=BLOCK)
    ranks = {}
    for r in topo.ranks_of_dp(0):
        layout = topo.local_layout(r, num_blocks)
        ranks[r] = RankKV(r, layout, layout.allocate(fill="random"))
    hs = sequence_hashes(list(range(tokens)), BLOCK)
    ids = bp.allocate(len(hs))
    bp.commit(ids, hs)
    bp.release(ids)
    return KVGroup(topo, 0, bp, ranks), hs


@aio
async def test_busy_then_close_leaves_nothing_running(http):
    group, hs = _group()
    svc = _Frozen([group], worker_id="inproc", max_concurrent_sends=1, quotas=OPEN)
    await svc.start()
    await prove_host(svc.http_port)
    port, ucx_port = svc.http_port, svc.ucx_ports[0]
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, ucx_port)
            first = await ask(conn, request(hs))
            assert first.status == Status.OK
            assert svc.pins_outstanding == 1 and svc.active_sends == 1
            assert group.manager.num_pinned == 8
            busy = await ask(conn, request(hs))
            assert busy.status == Status.BUSY and busy.reason.startswith("busy:")
            assert svc.metrics.value("kvkern_source_requests_total", status="busy") == 1
            assert svc.metrics.value("kvkern_source_pinned_blocks") == 8
            await svc.close()
            assert svc.listeners_open == 0 and svc.pins_outstanding == 0
            assert svc.active_sends == 0 and group.manager.num_pinned == 0
            assert svc.metrics.value("kvkern_source_pinned_blocks") == 0
            assert group.manager.stats()["pins"] == 0
            group.manager.check_invariants()
            with pytest.raises(aiohttp.ClientError):
                await http.get(f"http://{HOST}:{port}/healthz")
            with pytest.raises(TransportError):
                await conn.recv_msg(tag_for(1, Lane.REPLY), timeout=5)
    finally:
        await svc.close()


@aio
async def test_a_peers_pin_quota_counts_the_groups_pool_across_its_ranks(monkeypatch):
    """The ranks of a TP group share one block manager: a peer that asks each rank for
    distinct blocks is held to one share of that pool (25% by default), while its ranks'
    parts of the same blocks count once."""
    from kvkern.xfer import send

    monkeypatch.setattr(send, "QUOTA_WAIT_S", 0.05)
    group, hs = _group(tp=2)
    svc = _Frozen([group], worker_id="tp-quota")
    await svc.start()
    await prove_host(svc.http_port)
    heads = HEADS // 2

    def piece(rank: int) -> list[PlanPiece]:
        return [PlanPiece(src_rank=rank, layer_start=0, layer_stop=LAYERS, head_start=0,
                          head_stop=heads, offset=0, length=unit(LAYERS, heads))]

    try:
        assert len(hs) >= 8 and group.manager.num_blocks == 16  # (a peer: 4 blocks)
        async with ConnectionPool(connect_timeout=10) as own:
            first = await own.get(HOST, svc.ucx_ports[0])
            second = await own.get(HOST, svc.ucx_ports[1])
            assert (await ask(first, request(hs[:4], pieces=piece(0)))).status == Status.OK
            other = await ask(second, request(hs[4:8], pieces=piece(1)))
            assert other.status == Status.BUSY and "peer quota" in other.reason, other
            same = await ask(second, request(hs[:4], pieces=piece(1)))
            assert same.status == Status.OK  # the same 4 blocks, through the other rank
            assert group.manager.num_pinned == 4
    finally:
        await svc.close()


@aio
async def test_a_connection_with_too_many_requests_open_is_closed(monkeypatch):
    """Each request a connection sends is a task that holds its decoded request until it
    ends: one past MAX_OPEN_REQUESTS_PER_CONNECTION open on one connection closes that
    connection, which ends its requests and releases their pins; other connections go on."""
    from kvkern.xfer import served

    monkeypatch.setattr(served, "MAX_OPEN_REQUESTS_PER_CONNECTION", 3)
    group, hs = _group()
    svc = _Frozen([group], worker_id="open-requests", quotas=OPEN)
    await svc.start()
    await prove_host(svc.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as own, \
                ConnectionPool(connect_timeout=10) as other:
            conn = await own.get(HOST, svc.ucx_ports[0])
            for i in range(3):  # served and frozen after their replies: open
                assert (await ask(conn, request(hs[i:i + 1]))).status == Status.OK
            assert svc.pins_outstanding == 3
            await conn.send_msg(request(hs[3:4]), CONTROL_TAG, timeout=5)
            with pytest.raises(TransportError):
                await conn.recv_msg(tag_for(1 << 20, Lane.REPLY), timeout=5)
            deadline = time.monotonic() + 5
            while svc.pins_outstanding or svc.active_sends:
                assert time.monotonic() < deadline, "the closed connection's sends live on"
                await asyncio.sleep(0.02)
            assert group.manager.num_pinned == 0
            assert svc.metrics.value("kvkern_source_requests_total", status="rejected") == 1
            fresh = await other.get(HOST, svc.ucx_ports[0])
            assert (await ask(fresh, request(hs[:1]))).status == Status.OK
    finally:
        await svc.close()


@aio
@pytest.mark.parametrize("quotas,one_peer", [
    (PeerQuotas(max_sends_per_peer=64, max_connections_per_peer=2), True),
    (PeerQuotas(max_sends_per_peer=64, max_connections=2), False)], ids=["per-peer", "in-all"])
async def test_connections_over_the_quota_are_closed_before_they_are_served(quotas, one_peer):
    """Authenticated connections past ``max_connections_per_peer`` (of one peer) or
    ``max_connections`` (of four peers) are closed before their first request is read; one
    that ends frees its place."""
    group, hs = _group()
    svc = SourceService([group], config=SourceConfig(worker_id="conn-quota", quotas=quotas))
    await svc.start()
    await prove_host(svc.http_port)
    pools = [ConnectionPool(connect_timeout=10, credential=Credential.from_env(
        peer_id="dest" if one_peer else f"dest-{i}")) for i in range(4)]
    try:
        conns = [await pool.get(HOST, svc.ucx_ports[0]) for pool in pools[:2]]
        for conn in conns:
            assert (await ask(conn, request(hs[:1]))).status == Status.OK
        third = await pools[2].get(HOST, svc.ucx_ports[0])  # (authenticated, then closed)
        with pytest.raises(TransportError):
            await ask(third, request(hs[:1]))
        assert svc.metrics.value("kvkern_source_connections_refused_total",
                                 reason="connection_limit") == 1
        assert svc.metrics.value("kvkern_source_connections") == 2
        assert (await ask(conns[0], request(hs[:1]))).status == Status.OK  # the others go on
        await pools[0].close()
        deadline = time.monotonic() + 5
        while svc.metrics.value("kvkern_source_connections") != 1:
            assert time.monotonic() < deadline, "a closed connection still counts"
            await asyncio.sleep(0.02)
        fresh = await pools[3].get(HOST, svc.ucx_ports[0])
        assert (await ask(fresh, request(hs[:1]))).status == Status.OK
        assert svc.ledger.connections == 2 and svc.ledger.peer_connections
    finally:
        for pool in pools:
            await pool.close()
        await svc.close()
    assert svc.ledger.connections == 0 and not svc.ledger.peer_connections


@aio
async def test_a_source_takes_ucx_connections_only_from_accept_from():
    """A source whose ``accept_from`` leaves this host out rejects its connection requests
    (counted as ``address_not_accepted``) and serves nothing; by default a source bound to
    loopback serves loopback."""
    group, hs = _group()
    shut = SourceService([group], config=SourceConfig(worker_id="shut",
                                                      accept_from=("10.0.0.0/8",)))
    open_ = SourceService([group], worker_id="loopback", quotas=OPEN)
    await shut.start()
    await open_.start()
    await prove_host(open_.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            with pytest.raises(TransportError) as info:
                await own.get(HOST, shut.ucx_ports[0])
            assert info.value.reason == "connect_failed"
            deadline = time.monotonic() + 5
            while shut.metrics.value("kvkern_source_connections_refused_total",
                                     reason="address_not_accepted") != 1:
                assert time.monotonic() < deadline, "the rejection was not counted"
                await asyncio.sleep(0.02)
            assert shut.metrics.value("kvkern_source_connections") == 0
            conn = await own.get(HOST, open_.ucx_ports[0])
            assert (await ask(conn, request(hs[:1]))).status == Status.OK
    finally:
        await shut.close()
        await open_.close()


@aio
async def test_an_idle_connection_is_closed_but_not_one_with_a_request_open():
    """A connection with no request open and no message for ``idle_connection_s`` is closed
    (the pool then connects anew); one whose request is still open (a send frozen after its
    reply) is kept however long it lasts."""
    group, hs = _group()
    cfg = SourceConfig(worker_id="idle", quotas=OPEN, idle_connection_s=0.3)
    svc = _Frozen([group], config=cfg)
    await svc.start()
    await prove_host(svc.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as idle, \
                ConnectionPool(connect_timeout=10) as busy:
            quiet = await idle.get(HOST, svc.ucx_ports[0])
            held = await busy.get(HOST, svc.ucx_ports[0])
            assert (await ask(held, request(hs[:1]))).status == Status.OK  # open: frozen
            deadline = time.monotonic() + 10
            while svc.metrics.value("kvkern_source_connections_closed_total",
                                    reason="idle") < 1:
                assert time.monotonic() < deadline, "the idle connection was not closed"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.6)  # two more periods: the busy one stays
            assert svc.metrics.value("kvkern_source_connections_closed_total",
                                     reason="idle") == 1
            assert svc.metrics.value("kvkern_source_connections") == 1
            assert held.alive and svc.pins_outstanding == 1
            deadline = time.monotonic() + 5
            while quiet.alive:  # the destination learns of the close
                assert time.monotonic() < deadline, "the closed connection looks alive"
                await asyncio.sleep(0.02)
            again = await idle.get(HOST, svc.ucx_ports[0])
            assert again is not quiet and idle.connects == 2
            assert (await ask(again, request(hs[1:2]))).status == Status.OK
    finally:
        await svc.close()


@pytest.mark.asyncio
async def test_acks_of_unknown_transfers_count_with_the_connections_open_requests(
        monkeypatch):
    """Each ReadDone asking for an ack of a transfer nothing is pinned for is answered by a
    task; those still sending count with the connection's open requests, so a peer that
    asks for more than the cap at once (and reads none) loses the connection."""
    from kvkern.xfer import served

    monkeypatch.setattr(served, "MAX_OPEN_REQUESTS_PER_CONNECTION", 3)
    group, _ = _group()
    svc = SourceService([group], worker_id="acks", credential=None)
    gate = asyncio.Event()

    class Conn:
        peer_id = "p"
        aborted: list[str] = []

        async def send_msg(self, *a, **kw):
            await gate.wait()

        def abort(self, reason):
            self.aborted.append(reason)

    conn = Conn()
    for tid in range(1, 4):
        svc.connections.ack_unknown(conn, tid)
    assert svc.connections.open[conn] == 3 and not conn.aborted
    svc.connections.ack_unknown(conn, 4)
    assert conn.aborted == ["too_many_requests"] and svc.connections.open[conn] == 3
    assert svc.metrics.value("kvkern_source_connections_closed_total",
                             reason="too_many_requests") == 1
    gate.set()
    await asyncio.gather(*list(svc._bg))
    assert conn not in svc.connections.open


@aio
async def test_a_source_takes_ucx_connections_only_from_hosts_that_fetched_its_state(http):
    """Until this host presents the fleet credential over HTTP (a destination's signed state
    fetch), the source rejects its UCX connection requests before they exist (counted as
    ``address_not_proven``); a request without the credential proves nothing."""
    group, hs = _group()
    svc = SourceService([group], worker_id="proven", quotas=OPEN)
    await svc.start()
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            with pytest.raises(TransportError) as info:
                await own.get(HOST, svc.ucx_ports[0])
            assert info.value.reason == "connect_failed"
            async with http.get(f"http://{HOST}:{svc.http_port}{STATE_PATH}") as r:
                assert r.status == 401
            with pytest.raises(TransportError):
                await own.get(HOST, svc.ucx_ports[0])
            deadline = time.monotonic() + 5
            while svc.metrics.value("kvkern_source_connections_refused_total",
                                    reason="address_not_proven") != 2:
                assert time.monotonic() < deadline, "the rejections were not counted"
                await asyncio.sleep(0.02)
            await prove_host(svc.http_port)
            conn = await own.get(HOST, svc.ucx_ports[0])
            assert (await ask(conn, request(hs[:1]))).status == Status.OK
    finally:
        await svc.close()


async def test_a_peer_that_stops_receiving_holds_its_requests_for_a_refusals_time(
        monkeypatch):
    """A peer that never receives a large reply holds the connection's sends; its requests
    behind it, each padded with 50,000 hashes it does not ask for, keep only the hashes they
    ask for, and their refusals wait REFUSAL_SEND_S at most: then the connection is cut, and
    every request, pin and byte of it goes."""
    from kvkern.xfer import source as source_mod  # noqa: PLC0415

    monkeypatch.setattr(source_mod, "REFUSAL_SEND_S", 0.5)
    group, hs = _group(num_blocks=9000, tokens=8500 * BLOCK)
    svc = SourceService([group], worker_id="stall",
                        quotas=PeerQuotas(max_sends_per_peer=1, peer_pin_fraction=1.0,
                                          total_pin_fraction=1.0))
    await svc.start()
    await prove_host(svc.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, svc.ucx_ports[0])
            await conn.send_msg(request(hs, deadline_ms=60_000), timeout=5)  # ~68 KB reply
            padding = list(range(1, 50_001))
            for _ in range(20):  # each refused (one send per peer), behind the stalled reply
                await conn.send_msg(request([hs[0], *padding], count=1, deadline_ms=60_000),
                                    timeout=5)
            deadline = time.monotonic() + 5
            while len(svc._sends) < 21 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert sum(len(s.req.block_hashes) for s in svc._sends) <= len(hs) + 20
            t0 = time.monotonic()
            while svc._sends:
                assert time.monotonic() - t0 < 5, "requests held past their refusal's time"
                await asyncio.sleep(0.05)
        assert group.manager.num_pinned == 0 and svc.pins_outstanding == 0
    finally:
        await svc.close()


async def test_sigterm_closes_a_real_source_with_a_frozen_send(frozen_peer):
    """close() in the peer process: a send frozen after its reply holds 16 pins; SIGTERM makes
    the peer close its service (cancelling the send) and report what was left."""
    proc, ready = frozen_peer
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, ready["ucx_ports"]["0"])
            reply = await ask(conn, request(ready["sequences"][0]))
            assert reply.status == Status.OK and reply.served_blocks == 16
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(TransportError):  # the source's close aborts the connection
                await conn.recv_bytes(np.empty(reply.chunk_sizes[0], np.uint8),
                                      tag_for(reply.transfer_id, Lane.DATA, 0), timeout=15)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
        assert proc.returncode == 0
        closed = json.loads(next(line for line in out.splitlines()
                                 if line.startswith(CLOSED))[len(CLOSED):])
        assert closed["pins_outstanding"] == 0 and closed["active_sends"] == 0
        assert closed["listeners_open"] == 0
        assert closed["pool"]["pinned"] == 0 and closed["pool"]["pins"] == 0
    finally:
        stop_peer(proc)


@aio
async def test_read_without_read_done_is_released_once_at_the_deadline():
    """The destination never sends ReadDone: at the request's deadline the source unpins
    exactly once, keeps the connection (a read promises no chunks), and a late ReadDone is
    answered held=False, so what was read then never counts."""
    group, hs = _group()
    mgr = group.manager
    unpins = []
    real_unpin = mgr.unpin

    def counting_unpin(handle):
        unpins.append(handle.pin_id)
        return real_unpin(handle)

    mgr.unpin = counting_unpin
    svc = SourceService([group], worker_id="inproc-read", remote_read="host", quotas=OPEN)
    await svc.start()
    await prove_host(svc.http_port)
    try:
        assert READ_CAPABILITY in svc.state()["capabilities"]
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, svc.ucx_ports[0])
            req = request(hs, read=True, deadline_ms=400)
            t0 = time.monotonic()
            reply = await ask(conn, req)
            assert isinstance(reply, ReadGrant) and reply.served_blocks == 8
            assert reply.status == Status.OK
            assert svc.pins_outstanding == 1 and mgr.num_pinned == 8 and unpins == []
            deadline = time.monotonic() + 5
            while svc.pins_outstanding or svc.active_sends:
                assert time.monotonic() < deadline, "pins not released after the deadline"
                await asyncio.sleep(0.02)
            assert time.monotonic() - t0 < 4
            assert len(unpins) == 1 and mgr.num_pinned == 0 and mgr.stats()["pins"] == 0
            assert svc.metrics.value("kvkern_source_send_failures_total",
                                     reason="deadline") == 1
            assert svc.metrics.value("kvkern_source_pinned_blocks") == 0
            assert conn.alive  # nothing was promised on the wire: no abort
            # a late ReadDone finds nothing pinned: held=False, the reads must not count
            await conn.send_msg(ReadDone(transfer_id=req.transfer_id), timeout=5)
            ack = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1), timeout=5)
            assert isinstance(ack, ReadAck) and not ack.held, ack
            # and the same connection serves the next read
            again = request(hs, read=True)
            reply = await ask(conn, again)
            assert reply.status == Status.OK and isinstance(reply, ReadGrant)
            await conn.send_msg(ReadDone(transfer_id=again.transfer_id), timeout=5)
            ack = await conn.recv_msg(tag_for(again.transfer_id, Lane.REPLY, 1), timeout=5)
            assert isinstance(ack, ReadAck) and ack.held, ack
            while svc.pins_outstanding:
                assert time.monotonic() < deadline + 5, "second read's pins not released"
                await asyncio.sleep(0.02)
            assert len(unpins) == 2
        mgr.check_invariants()
    finally:
        await svc.close()
    assert len(unpins) == 2  # once per read, never twice


@aio
async def test_a_read_done_after_the_wait_for_it_ran_out_is_answered_held_false(monkeypatch):
    """A ReadDone that arrives once the source's wait for it has run out, before the waiting
    task resumed (or after it ended, before the request was forgotten): the source answers
    held=False at once, as for a read it no longer holds, rather than nothing, which would
    keep the destination waiting for the ack and then cost it the connection."""
    import types

    from kvkern.xfer import send

    late = types.ModuleType("asyncio")
    late.__dict__.update(asyncio.__dict__)

    async def resuming_late(aw, timeout):  # the task resumes 0.5 s after its wait ran out
        try:
            return await asyncio.wait_for(aw, timeout)
        except TimeoutError:
            await asyncio.sleep(0.5)
            raise

    late.wait_for = resuming_late
    monkeypatch.setattr(send, "asyncio", late)
    group, hs = _group()
    svc = SourceService([group], worker_id="late-done", remote_read="host", quotas=OPEN)
    svc.read_hold_s = 0.2  # a hold shorter than the request's deadline
    await svc.start()
    await prove_host(svc.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, svc.ucx_ports[0])
            req = request(hs, read=True, deadline_ms=10_000)
            reply = await ask(conn, req)
            assert isinstance(reply, ReadGrant) and reply.status == Status.OK
            await asyncio.sleep(0.4)  # past the wait, before its task resumed
            await conn.send_msg(ReadDone(transfer_id=req.transfer_id), timeout=5)
            ack = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1), timeout=0.5)
            assert isinstance(ack, ReadAck) and not ack.held, ack
            assert conn.alive
            deadline = time.monotonic() + 5
            while svc.pins_outstanding:
                assert time.monotonic() < deadline, "pins not released"
                await asyncio.sleep(0.02)
    finally:
        await svc.close()


@aio
async def test_a_device_pool_is_not_offered_for_same_host_calls():
    """kvkern's same-host reads copy host memory with ``process_vm_readv``; a rank whose
    pool is in device memory (``remote_read="all"``) names no process to read that way, so
    a destination on its host reads it through UCX like any other."""
    group, _ = _group()
    svc = SourceService([group], worker_id="inproc-local", remote_read="host", quotas=OPEN)
    await svc.start()
    try:
        rank = svc.state()["dp_groups"]["0"]["ranks"]["0"]
        if not rank.get("read_worker"):
            pytest.skip("this UCX has no worker address for read lanes")
        assert rank["read_local"] is not None  # a host pool: same-host calls offered

        class OnDevice:  # the same rank, its pool seen as device memory
            device = torch.device("cuda")

            def __getattr__(self, name):
                return getattr(rkv, name)

        rkv = group.ranks[0]
        group.ranks[0] = OnDevice()
        try:
            rank = svc.state()["dp_groups"]["0"]["ranks"]["0"]
        finally:
            group.ranks[0] = rkv
        assert rank["read_worker"] and rank["read"] == "canonical"
        assert rank.get("read_local") is None
    finally:
        await svc.close()


@aio
async def test_read_request_to_a_source_with_reads_off_gets_the_stream():
    group, hs = _group()
    svc = SourceService([group], worker_id="inproc-noread", remote_read="off", quotas=OPEN)
    await svc.start()
    await prove_host(svc.http_port)
    try:
        assert READ_CAPABILITY not in svc.state()["capabilities"]
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, svc.ucx_ports[0])
            req = request(hs, read=True, chunk_bytes=5000)
            reply, data = await pull(conn, req)
        assert reply.status == Status.OK and reply.served_blocks == 8
        assert isinstance(reply, StreamReply) and reply.n_chunks == 4
        rkv = group.ranks[0]
        want = pack(rkv.pool, rkv.layout, group.manager.match_prefix(hs))
        assert data.tobytes() == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        deadline = time.monotonic() + 5
        while svc.pins_outstanding or svc.active_sends:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert group.manager.num_pinned == 0
    finally:
        await svc.close()


@aio
async def test_a_request_for_chunks_below_the_floor_is_refused_before_any_pin():
    """Each chunk costs the source a message and a step of Python: a request may not ask for
    chunks below min_chunk_bytes, or one block's bytes where a block is smaller (this
    pool's blocks: 2048 B)."""
    group, hs = _group()
    svc = SourceService([group], worker_id="inproc-floor", quotas=OPEN)
    await svc.start()
    await prove_host(svc.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, svc.ucx_ports[0])
            for small in (1, 2047):
                reply = await ask(conn, request(hs, chunk_bytes=small))
                assert reply.status == Status.REJECTED, reply
                assert reply.reason.startswith("too_many_chunks:") and "2048 B" in reply.reason
                assert group.manager.num_pinned == 0
            reply, data = await pull(conn, request(hs, chunk_bytes=2048))  # a block a chunk
            assert reply.status == Status.OK and reply.n_chunks == len(hs)
            assert data.size == reply.total_bytes
    finally:
        await svc.close()
    assert svc.config.min_chunk_bytes == 64 << 10
    with pytest.raises(ValueError, match="min_chunk_bytes"):
        SourceService([group], worker_id="w", min_chunk_bytes=-1)


# ----------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("lengths,n,limit", [
    ([2048], 16, 5000), ([1024, 512], 5, 700), ([100], 1, 100), ([4096, 8, 300], 7, 256),
    ([64], 0, 64),
], ids=["whole-blocks", "sub-block", "exact", "mixed", "empty"])
def test_plan_chunks_tiles_the_stream(lengths, n, limit):
    chunks = plan_chunks(lengths, n, limit)
    assert len(chunks) == count_chunks(lengths, n, limit)
    assert all(0 < c.nbytes <= limit for c in chunks)
    assert sum(c.nbytes for c in chunks) == sum(lengths) * n
    pos = {p: 0 for p in range(len(lengths))}  # each piece covered in order, no gap
    for c in chunks:
        start = c.b0 * lengths[c.piece] + c.lo
        assert start == pos[c.piece]
        pos[c.piece] = start + c.nbytes
    assert [c.piece for c in chunks] == sorted(c.piece for c in chunks)


def test_service_arguments_are_checked():
    group, _ = _group()
    with pytest.raises(ValueError, match="advertise_host"):
        SourceService([group], worker_id="w", host="0.0.0.0")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got 0"):
        SourceService([group], worker_id="w", chunk_bytes=0)
    with pytest.raises(ValueError, match="given twice"):
        SourceService([group, group], worker_id="w")
    svc = SourceService([group], worker_id="w", host="0.0.0.0", advertise_host="10.1.2.3")
    st = svc.state()  # before start: no ports yet, but the document is complete
    assert st["dp_groups"]["0"]["ranks"]["0"]["ucx_host"] == "10.1.2.3"
    assert st["dp_groups"]["0"]["ranks"]["0"]["ucx_port"] is None


def test_staging_pool_reuses_by_size_class_and_caps_idle_bytes():
    sp = StagingPool(max_bytes=3 * 4096 - 1)
    assert [sp.size_class(n) for n in (1, 2, 3, 4096, 4097)] == [2, 2, 4, 4096, 8192]
    a, b = sp.take(torch.device("cpu"), 3000), sp.take(torch.device("cpu"), 4096)
    assert a.numel() == b.numel() == 4096 and a.data_ptr() != b.data_ptr()
    sp.give([a, b])
    assert sp.idle_bytes == 8192
    assert sp.take(torch.device("cpu"), 2049).data_ptr() in (a.data_ptr(), b.data_ptr())
    sp.give([torch.empty(8192, dtype=torch.uint8)])  # over the cap: dropped
    assert sp.idle_bytes == 4096
    sp.clear()
    assert sp.idle_bytes == 0


def test_staging_pool_prewarm_keeps_faulted_slots_ready():
    sp = StagingPool(max_bytes=1 << 24)
    cpu = torch.device("cpu")
    sp.prewarm(cpu, 3 << 20, 3)  # size class 4 MiB
    assert sp.idle_bytes == 3 * (4 << 20)
    ready = [sp.take(cpu, 4 << 20) for _ in range(3)]
    assert all(bool((b == 0).all()) for b in ready)  # written, so faulted in
    sp.give(ready)
    sp.prewarm(cpu, 4 << 20, 2)  # already enough idle: nothing new
    assert sp.idle_bytes == 3 * (4 << 20)


def test_metrics_names_labels_and_render():
    m, other = XferMetrics(), XferMetrics()
    m.hint_received()
    m.hint_ignored("source_not_allowed")
    m.fallback("source_miss")
    m.transferred(3, 300)
    for ph in PHASES:
        m.observe_phase(ph, 0.002)
    with m.pull_in_flight():
        assert m.value("kvkern_pulls_in_flight") == 1
    assert m.value("kvkern_hints_received_total") == 1
    assert other.value("kvkern_hints_received_total") == 0  # registries are separate
    assert m.value("kvkern_hints_ignored_total", reason="source_not_allowed") == 1
    assert m.value("kvkern_phase_seconds_count", phase="total") == 1
    assert m.value("kvkern_phase_seconds_bucket", phase="total", le="0.0001") == 0
    assert m.value("kvkern_phase_seconds_bucket", phase="total", le="60.0") == 1
    with pytest.raises(ValueError, match="not a metric label"):
        m.fallback("Timeout after 3 s")
    with pytest.raises(ValueError, match="phase 'prefill'"):
        m.observe_phase("prefill", 1.0)
    m.source_connection_refused("untrusted_limit")
    assert m.value("kvkern_source_connections_refused_total", reason="untrusted_limit") == 1
    m.source_packed(4096, 0.002)
    assert m.value("kvkern_source_packed_bytes_total") == 4096
    assert m.value("kvkern_source_pack_seconds_sum") == pytest.approx(0.002)
    with pytest.raises(ValueError, match="negative"):
        m.source_packed(-1, 0.001)
    assert m.value("kvkern_source_connections_refused_total", reason="handshake") == 0
    text = m.render().decode()
    for name in ("kvkern_bytes_transferred_total 300.0", "kvkern_blocks_skipped_total",
                 "kvkern_metadata_fetch_failures_total", "kvkern_transfer_failures_total",
                 "kvkern_pulls_total", "kvkern_source_bytes_sent_total",
                 "kvkern_source_pinned_blocks"):
        assert name in text


def test_kvgroup_checks_layouts_against_the_topology():
    group, _ = _group(tp=2)
    assert group.num_blocks == 16 and list(group.ranks) == [0, 1]
    topo = group.topology
    wrong = topo.local_layout(0, 16).with_sizes(num_heads=HEADS)
    with pytest.raises(ValueError, match="num_heads 4, the topology gives that rank num_heads 2"):
        KVGroup(topo, 0, group.manager, {0: RankKV(0, wrong, wrong.allocate())})
    with pytest.raises(ValueError, match="manager block size 8"):
        KVGroup(topo, 0, BlockPool(16, block_size=8), group.ranks)
    small = topo.local_layout(1, 8)
    with pytest.raises(ValueError, match="rank 1 has 8 blocks"):
        KVGroup(topo, 0, group.manager,
                {0: group.ranks[0], 1: RankKV(1, small, small.allocate())})
    with pytest.raises(ValueError, match="not in DP group"):
        lay = topo.local_layout(0, 16)
        KVGroup(topo.replace(tp_size=1), 0, group.manager, {1: RankKV(1, lay, lay.allocate())})
    with pytest.raises(TypeError, match="dtype torch.float32"):
        RankKV(0, topo.local_layout(0, 16), torch.empty(3))
    with pytest.raises(ValueError, match="shape"):
        RankKV(0, topo.local_layout(0, 16), torch.empty(3, dtype=torch.float16))


def test_event_loop_thread_runs_times_out_and_closes():
    rt = EventLoopThread("test-rt")
    try:
        async def double(x):
            await asyncio.sleep(0.01)
            return 2 * x

        assert rt.run(double(21), 5) == 42
        with pytest.raises(TimeoutError):
            rt.run(asyncio.sleep(10), 0.1)
        hit = []
        rt.call_soon(hit.append, 1)
        rt.run(asyncio.sleep(0.01), 5)
        assert hit == [1]
        fut = rt.submit(asyncio.sleep(60))
    finally:
        t0 = time.monotonic()
        rt.close(5)
    assert time.monotonic() - t0 < 5 and fut.cancelled()
    assert not rt._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        rt.run(double(1), 1)
    rt.close()  # idempotent


def test_event_loop_thread_close_ends_the_tasks_cancelled_tasks_start():
    """A task that, cancelled, starts another (a pull telling its source it gave up) and
    awaits it: close() cancels and waits for that one too, and for one it starts without
    awaiting it, instead of leaving them pending on a stopped loop."""
    rt = EventLoopThread("test-rt-late")
    late: list = []
    started = threading.Event()

    async def tell_source():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            late.append("told")
            raise

    async def pull():
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            asyncio.get_running_loop().create_task(tell_source())  # not awaited
            await asyncio.sleep(0.05)
            raise

    fut = rt.submit(pull())
    assert started.wait(5)
    rt.close(5)
    assert fut.cancelled() and late == ["told"]


@aio
async def test_a_granted_read_hold_outlasts_a_lost_connection_and_close():
    """A read reply grants ``read_hold_ms`` (the service's read_hold_s, capped by the
    request's deadline): the destination may commit whatever it read within it without a
    ReadAck, so neither a lost connection nor close() may release the pins earlier; a
    Cancel (the destination gave up) releases them at once."""
    group, hs = _group()
    mgr = group.manager
    svc = SourceService([group], worker_id="inproc-hold", read_hold_s=0.8,
                        remote_read="host", quotas=OPEN)
    await svc.start()
    await prove_host(svc.http_port)
    try:
        async with ConnectionPool(connect_timeout=10) as own:
            conn = await own.get(HOST, svc.ucx_ports[0])
            capped = await ask(conn, request(hs, read=True, deadline_ms=300))
            assert isinstance(capped, ReadGrant)
            assert 0 < capped.read_hold_ms <= 300  # the deadline caps it
            await conn.send_msg(ReadDone(transfer_id=capped.transfer_id), timeout=5)
            assert (await conn.recv_msg(tag_for(capped.transfer_id, Lane.REPLY, 1),
                                        timeout=5)).held
            # Cancel: released at once despite the hold
            req = request(hs, read=True)
            reply = await ask(conn, req)
            assert 700 <= reply.read_hold_ms <= 800 and svc.pins_outstanding == 1
            await conn.send_msg(Cancel(transfer_id=req.transfer_id, reason="test"), timeout=5)
            t0 = time.monotonic()
            while svc.pins_outstanding:
                assert time.monotonic() - t0 < 0.3, "a Cancel must not wait for the hold"
                await asyncio.sleep(0.01)
            # lost connection: pinned until the hold ends, then released once
            req = request(hs, read=True)
            t0 = time.monotonic()
            reply = await ask(conn, req)
            conn.abort("test")
            await asyncio.sleep(0.3)
            assert svc.pins_outstanding == 1 and mgr.num_pinned == 8, "released early"
            while svc.pins_outstanding:
                assert time.monotonic() - t0 < 2.0, "not released after the hold"
                await asyncio.sleep(0.02)
            assert time.monotonic() - t0 >= reply.read_hold_ms / 1000 - 0.01
            # close(): waits for a hold still running
            conn = await own.get(HOST, svc.ucx_ports[0])
            reply = await ask(conn, request(hs, read=True))
            t0 = time.monotonic()
            await svc.close()
            assert time.monotonic() - t0 >= reply.read_hold_ms / 1000 - 0.1
            assert svc.pins_outstanding == 0 and mgr.num_pinned == 0
        mgr.check_invariants()
    finally:
        await svc.close()


# ------------------------------------------------------------------ pin quotas (ledger)


@pytest.mark.asyncio
async def test_a_request_over_its_quota_is_checked_again_only_when_pins_change(monkeypatch):
    """The quota check is as long as the request: a request over its quota because of other
    pins waits up to QUOTA_WAIT_S for them, checking again only when pins change; one over
    the quota by itself is answered at once."""
    from types import SimpleNamespace

    from kvkern.xfer import send

    monkeypatch.setattr(send, "QUOTA_WAIT_S", 0.05)
    ledger = send.PeerLedger(PeerQuotas(peer_pin_fraction=0.5, total_pin_fraction=1.0), 8)
    checks = []
    real = ledger.over_pin_quota
    monkeypatch.setattr(ledger, "over_pin_quota",
                        lambda *a: (checks.append(a), real(*a))[1])
    sender = send.Sender.__new__(send.Sender)
    sender.svc = SimpleNamespace(ledger=ledger)

    def session(hashes):
        return SimpleNamespace(peer="p", req=SimpleNamespace(requested_hashes=hashes),
                               ctx=SimpleNamespace(rkv=SimpleNamespace(layout=SimpleNamespace(
                                   num_blocks=16)), group=SimpleNamespace(dp_rank=0)))

    busy = await sender._quota_verdict(session(list(range(100, 109))))  # 9 > 8 by itself
    assert busy is not None and len(checks) == 1
    ledger.pinned("p", 0, list(range(6)))
    checks.clear()
    busy = await sender._quota_verdict(session(list(range(100, 104))))  # 6 + 4 > 8: waits
    assert busy is not None and len(checks) == 1  # (no pin changed meanwhile)

    async def release_soon():
        await asyncio.sleep(0.01)
        ledger.unpinned("p", 0, list(range(6)))

    checks.clear()
    task = asyncio.ensure_future(release_soon())
    assert await sender._quota_verdict(session(list(range(100, 104)))) is None
    await task
    assert len(checks) == 2



@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["pin", "unpin"]), st.sampled_from("ab"),
                              st.integers(0, 1),
                              st.lists(st.integers(0, 11), min_size=1, max_size=6)),
                    max_size=40))
def test_pin_quotas_count_distinct_blocks(ops):
    """Against a reference over the live pin handles: a peer's share and all peers' share of
    a DP group's pool are the distinct blocks pinned, so the same blocks pinned again (each
    narrower destination rank asking for its part) hold nothing more; every unpin restores
    it."""
    from kvkern.xfer.send import PeerLedger

    pool = 16
    ledger = PeerLedger(PeerQuotas(peer_pin_fraction=0.5, total_pin_fraction=0.75), 8)
    live: list[tuple[str, int, list[int]]] = []
    for op, peer, group, hs in ops:
        if op == "unpin" and live:
            ledger.unpinned(*live.pop(len(hs) % len(live)))
            continue
        mine = {h for p, g, held in live if (p, g) == (peer, group) for h in held}
        every = {h for _, g, held in live if g == group for h in held}
        verdict = ledger.over_pin_quota(peer, group, hs, pool)
        if len(mine | set(hs)) > pool * 0.5:
            assert verdict is not None and verdict.startswith("peer quota"), verdict
        elif len(every | set(hs)) > pool * 0.75:
            assert verdict is not None and verdict.startswith("pin quota"), verdict
        else:
            assert verdict is None, verdict
            ledger.pinned(peer, group, hs)
            live.append((peer, group, hs))
    for args in live:
        ledger.unpinned(*args)
    assert ledger.pins == ledger.pinned_blocks == 0
    assert ledger.peer_pins == {} and ledger.group_pins == {}


def test_overlapping_pieces_are_refused_before_any_chunk_is_planned(monkeypatch):
    """Pieces must cover distinct (layer, head) cells of a block. 4096 copies of the whole
    block in one small request made the source plan 2**20 chunks on its event loop (seconds)
    and promise 4096 times the blocks' bytes; two pieces that share cells stream them twice."""
    from kvkern.xfer import send as send_mod
    from kvkern.xfer.codes import RejectCode
    from kvkern.xfer.send import RankCtx, Rejected, max_reply_chunks, validate_request

    group, hs = _group()
    ctx = RankCtx(group, group.ranks[0])

    def check(req):
        return validate_request(ctx, req, model_id=group.model_id, chunk_bytes=1 << 20,
                                min_chunk_bytes=1)

    whole = unit(LAYERS, HEADS)
    copies = [PlanPiece(src_rank=0, layer_start=0, layer_stop=LAYERS, head_start=0,
                        head_stop=HEADS, offset=i * whole, length=whole) for i in range(4096)]
    t0 = time.perf_counter()
    with pytest.raises(Rejected) as info:
        check(request(hs[:4], pieces=copies, chunk_bytes=whole))
    assert info.value.code is RejectCode.BAD_PIECE and "overlaps" in str(info.value)
    assert time.perf_counter() - t0 < 0.5
    shared = [PlanPiece(src_rank=0, layer_start=0, layer_stop=1, head_start=0, head_stop=HEADS,
                        offset=0, length=unit(1, HEADS)),
              PlanPiece(src_rank=0, layer_start=0, layer_stop=LAYERS, head_start=1, head_stop=2,
                        offset=unit(1, HEADS), length=unit(LAYERS, 1))]
    with pytest.raises(Rejected, match="overlaps"):
        check(request(hs[:4], pieces=shared))
    split = [PlanPiece(src_rank=0, layer_start=0, layer_stop=LAYERS, head_start=0, head_stop=1,
                       offset=0, length=unit(LAYERS, 1)),
             PlanPiece(src_rank=0, layer_start=0, layer_stop=LAYERS, head_start=1,
                       head_stop=HEADS, offset=unit(LAYERS, 1), length=unit(LAYERS, HEADS - 1))]
    assert len(check(request(hs[:4], pieces=split))) == 2  # disjoint pieces: a reshard's plan
    # a reply lists every chunk's size and block's hash in one control frame
    assert 100_000 < max_reply_chunks(16) < 2**20 and max_reply_chunks(200_000) == 0
    monkeypatch.setattr(send_mod, "MAX_CONTROL_FRAME_BYTES",
                        send_mod.REPLY_HEADROOM_BYTES + 9 * 100)  # room for 96 chunks
    assert max_reply_chunks(4) == 96
    assert len(check(request(hs[:4], chunk_bytes=whole // 16))) == 1  # 64 chunks
    with pytest.raises(Rejected) as info:
        check(request(hs[:4], chunk_bytes=whole // 32))  # 128 chunks
    assert info.value.code is RejectCode.TOO_MANY_CHUNKS and "at most 96" in str(info.value)
