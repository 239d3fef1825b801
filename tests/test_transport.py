"""The UCXX transport between real processes on 127.0.0.1.

One peer process (tests/peers/ucx_peer.py) serves the whole module; tests that kill or freeze
their peer get their own. All tests share one event loop (ucxx ties its progress to a loop)
and one connection pool, which is itself under test: after every failure it must reconnect.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkern.xfer import transport, ucxcompat
from kvkern.xfer.messages import Cancel, PlanPiece, PullReply, PullRequest, Status
from kvkern.xfer.networks import Networks
from kvkern.xfer.transport import (
    CONTROL_TAG,
    MAX_TRANSFER_ID,
    TRAILER_BYTES,
    ChunkLengths,
    ConnectionPool,
    Lane,
    Listener,
    TransportError,
    as_recv_buffer,
    as_send_buffer,
    tag_for,
)
from kvkern.xfer.ucx_env import import_ucxx

PEER = Path(__file__).parent / "peers" / "ucx_peer.py"
sys.path.insert(0, str(PEER.parent))
from ucx_peer import pattern  # noqa: E402

pytestmark = pytest.mark.timeout(60)
# One loop for the module: ucxx binds its progress to an event loop.
aio = pytest.mark.asyncio(loop_scope="module")
HOST = "127.0.0.1"


def start_peer(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / f"port-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, str(PEER), str(port_file)],
                            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"peer did not start (exit code {proc.poll()})")
        time.sleep(0.02)
    return proc, int(port_file.read_text())


def stop_peer(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # SIGKILL also ends a SIGSTOPped process
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    proc, port = start_peer(tmp_path_factory.mktemp("peer"))
    try:
        yield proc, port
    finally:
        stop_peer(proc)


@pytest.fixture
def solo_peer(tmp_path):
    """A peer of the test's own, for tests that kill or freeze it."""
    proc, port = start_peer(tmp_path)
    try:
        yield proc, port
    finally:
        stop_peer(proc)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool():
    async with ConnectionPool(connect_timeout=10) as p:
        yield p


_tids = iter(range(1, MAX_TRANSFER_ID))


def request(mode: str, total: int, chunk: int, tid: int | None = None) -> PullRequest:
    return PullRequest(transfer_id=tid or next(_tids), request_id=mode, hash_scheme="test",
                       block_hashes=[11, 22, 33], start=1, count=2,
                       pieces=[PlanPiece(src_rank=0, layer_start=0, layer_stop=1, head_start=0,
                                         head_stop=1, offset=0, length=total)],
                       chunk_bytes=chunk, deadline_ms=10_000)


async def pull(conn, mode: str, total: int, chunk: int, *, timeout: float = 10,
               max_in_flight: int = 8) -> tuple[PullReply, np.ndarray, int]:
    req = request(mode, total, chunk)
    await conn.send_msg(req, timeout=5)
    reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=5)
    bufs = [np.full(s, 0xA5, dtype=np.uint8) for s in reply.chunk_sizes]
    await conn.recv_chunks(req.transfer_id, bufs, timeout=timeout, max_in_flight=max_in_flight)
    data = np.concatenate(bufs) if bufs else np.empty(0, np.uint8)
    return reply, data, req.transfer_id


# ------------------------------------------------------------------------- no network


def test_tag_layout():
    assert tag_for(0, Lane.CONTROL, 0) == CONTROL_TAG == 0
    assert tag_for(1, Lane.DATA, 5) == (1 << 30) | (2 << 28) | 5
    top = tag_for(MAX_TRANSFER_ID, Lane.DATA, (1 << 28) - 1)
    assert top < (1 << 61) - 1  # ints below the hash modulus hash to themselves
    assert hash(top) == top
    for bad in [(-1, 0, 0), (MAX_TRANSFER_ID + 1, 0, 0), (1, 4, 0), (1, 0, 1 << 28)]:
        with pytest.raises(ValueError):
            tag_for(*bad)


def _lengths(sizes) -> ChunkLengths:
    out = ChunkLengths()
    for n in sizes:
        out.add(n)
    return out


SIZES = st.lists(st.integers(0, 1 << 40), max_size=12)


@given(sent=SIZES, received=SIZES)
def test_a_trailer_passes_exactly_the_lengths_sent(sent, received):
    """The trailer of chunks of ``sent`` lengths passes a receiver of ``received`` lengths
    only when the two are the same list (same count, bytes and order)."""
    trailer = _lengths(sent).pack()
    assert len(trailer) == TRAILER_BYTES
    if sent == received:
        _lengths(received).check(trailer)
    else:
        with pytest.raises(TransportError, match="chunk lengths differ") as info:
            _lengths(received).check(trailer)
        assert info.value.reason == "protocol_error"


@given(cut=st.integers(0, TRAILER_BYTES - 1))
def test_a_short_or_foreign_trailer_fails(cut):
    trailer = bytearray(TRAILER_BYTES)
    trailer[:cut] = _lengths([4096, 4096]).pack()[:cut]  # the rest as received: zeros
    with pytest.raises(TransportError) as info:
        _lengths([4096, 4096]).check(trailer)
    assert info.value.reason == "protocol_error"


@pytest.mark.parametrize("make", [
    lambda: torch.arange(64, dtype=torch.int32).reshape(8, 8)[:, ::2],
    lambda: torch.arange(64, dtype=torch.int32).reshape(8, 8).t(),
    lambda: np.arange(64, dtype=np.int32).reshape(8, 8)[:, 1:3],
    lambda: memoryview(bytearray(64))[::2],
], ids=["torch-strided", "torch-transposed", "numpy-slice", "memoryview-step"])
def test_non_contiguous_buffers_rejected(make):
    with pytest.raises(ValueError, match="contiguous"):
        as_send_buffer(make())
    with pytest.raises(ValueError, match="contiguous"):
        as_recv_buffer(make())


def test_buffer_kinds():
    assert as_send_buffer(torch.zeros(3, 5, dtype=torch.bfloat16)).nbytes == 30
    assert as_send_buffer(b"abc").nbytes == 3
    assert as_recv_buffer(np.zeros((2, 3), np.float32)).nbytes == 24
    with pytest.raises(ValueError, match="read-only"):
        as_recv_buffer(b"abc")
    with pytest.raises(TypeError):
        as_send_buffer(object())


# ---------------------------------------------------------------------------- network


@pytest.mark.parametrize("total,chunk", [
    (0, 1), (1, 1), (4095, 4096), (65539, 4096), (3 * 2**20 + 5, 2**20), (4 * 2**20, 4 * 2**20),
], ids=["0B", "1B", "4095B-one-chunk", "64KiB+3-in-17", "3MiB+5-in-4", "4MiB-one-buffer"])
@aio
async def test_pull_sizes_byte_exact(peer, pool, total, chunk):
    conn = await pool.get(HOST, peer[1])
    reply, data, tid = await pull(conn, "ok", total, chunk)
    assert reply.status == Status.OK and reply.block_hashes == [22, 33]
    assert reply.total_bytes == total == data.size
    assert np.array_equal(data, pattern(tid, total))


@aio
async def test_many_chunks_in_flight_ring_buffers(peer, pool):
    """512 chunks through a ring of 16 buffers: on_chunk runs in order, and the ring is never
    overwritten before its chunk was consumed."""
    conn = await pool.get(HOST, peer[1])
    chunk, n, ring_n = 4096, 512, 16
    req = request("ok", chunk * n, chunk)
    await conn.send_msg(req)
    reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY))
    ring = [np.empty(chunk, np.uint8) for _ in range(ring_n)]
    out, order = np.empty(chunk * n, np.uint8), []

    def on_chunk(i, buf):
        order.append(i)
        out[i * chunk:(i + 1) * chunk] = buf

    got = await conn.recv_stream(req.transfer_id, lambda i: ring[i % ring_n], reply.n_chunks,
                                 on_chunk=on_chunk, max_in_flight=ring_n, timeout=10)
    assert got == chunk * n and order == list(range(n))
    assert np.array_equal(out, pattern(req.transfer_id, chunk * n))


@aio
async def test_send_stream_overlaps_and_sink_checks(peer, pool):
    """The other direction: we produce (async, torch bf16) and send; the peer hashes."""
    conn = await pool.get(HOST, peer[1])
    n, chunk = 24, 96 * 1024
    src = torch.randn(n * chunk // 2, generator=torch.Generator().manual_seed(3)).bfloat16()
    raw = src.view(torch.uint8)
    req = request("sink", n * chunk, chunk)
    await conn.send_msg(req)
    reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY))
    assert reply.n_chunks == n
    produced = []

    async def produce(i):
        produced.append(i)
        await asyncio.sleep(0)
        return src[i * chunk // 2:(i + 1) * chunk // 2]

    sent = await conn.send_stream(req.transfer_id, produce, n, max_in_flight=4, timeout=10)
    done = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY, 1))
    assert sent == n * chunk and produced == list(range(n))
    assert done.reason == hashlib.sha256(raw.numpy().tobytes()).hexdigest()


@aio
async def test_receive_timeout_then_pool_reconnects(peer, pool):
    conn = await pool.get(HOST, peer[1])
    req = request("silent", 8192, 4096)
    await conn.send_msg(req)
    reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY))
    bufs = [bytearray(s) for s in reply.chunk_sizes]
    t0 = time.monotonic()
    with pytest.raises(TransportError) as info:
        await conn.recv_chunks(req.transfer_id, bufs, timeout=0.5)
    assert info.value.reason == "transfer_timeout"
    assert 0.4 < time.monotonic() - t0 < 3
    assert not conn.alive and conn.failure == "transfer_timeout"
    with pytest.raises(TransportError) as info:
        await conn.recv_msg(timeout=1)
    assert info.value.reason == "closed"

    connects = pool.connects
    again = await pool.get(HOST, peer[1])
    assert again is not conn and again.alive and pool.connects == connects + 1
    _, data, tid = await pull(again, "ok", 100_000, 30_000)
    assert np.array_equal(data, pattern(tid, 100_000))
    assert await pool.get(HOST, peer[1]) is again  # reused, not reconnected


@aio
async def test_a_receive_cancelled_mid_chunk_writes_nothing_after_it_returns(peer, pool):
    """A stream's receive cancelled while its chunk is landing aborts the connection, and
    once the cancellation has returned not one byte more lands in the buffer: what the
    destination hands back (staging, private blocks) is no longer UCX's. Through CMA the
    abort waits for the copy UCX is running; the rest of the chunk is dropped."""
    conn = await pool.get(HOST, peer[1])
    total = 128 << 20
    req = request("ok", total, total)
    await conn.send_msg(req, timeout=5)
    reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=5)
    assert reply.chunk_sizes == [total]
    buf = np.full(total, 0xA5, dtype=np.uint8)
    probes = np.arange(0, total, 1 << 20)
    task = asyncio.ensure_future(conn.recv_chunks(req.transfer_id, [buf], timeout=10))
    while not task.done() and int((buf[probes] != 0xA5).sum()) < 2:
        await asyncio.sleep(0)
    assert not task.done(), "the chunk landed whole before it could be cancelled"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not conn.alive and conn.failure == "cancelled"
    snapshot = buf.copy()
    await asyncio.sleep(0.3)
    assert np.array_equal(buf, snapshot)
    landed = buf != 0xA5
    assert np.array_equal(buf[landed], pattern(req.transfer_id, total)[landed])


@aio
async def test_a_stream_whose_sender_aborted_and_reused_its_buffers_is_never_complete(
        solo_peer):
    """A sender that gives up while the receiver still copies a chunk (its progress timeout
    shorter than the copy), aborts, and then reuses the chunk's memory for other bytes: on
    this host the receiver's rendezvous copies the sender's memory itself, and the abort does
    not stop that copy, so a trailer sent with the chunks would complete a stream that is
    partly the reused bytes. The trailer follows the chunks' completion instead: the stream
    fails, and nothing it received counts."""
    async with ConnectionPool(connect_timeout=10) as own:
        conn = await own.get(HOST, solo_peer[1])
        total = 64 << 20  # one rendezvous chunk, copied in several milliseconds
        for _ in range(3):
            req = request("reuse", total, total)
            await conn.send_msg(req, timeout=5)
            reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=5)
            assert reply.chunk_sizes == [total]
            buf = np.full(total, 0xA5, dtype=np.uint8)
            with pytest.raises(TransportError):
                await conn.recv_chunks(req.transfer_id, [buf], timeout=2)
            assert not conn.alive
            conn = await own.get(HOST, solo_peer[1])


@aio
async def test_control_reply_timeout(peer, pool):
    conn = await pool.get(HOST, peer[1])
    req = request("noreply", 10, 10)
    await conn.send_msg(req)
    with pytest.raises(TransportError) as info:
        await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=0.3)
    assert info.value.reason == "transfer_timeout"
    pool.discard(conn)
    assert len(pool) == 0


@aio
async def test_peer_killed_mid_transfer(solo_peer):
    proc, port = solo_peer
    async with ConnectionPool() as pool:
        conn = await pool.get(HOST, port)
        t0 = time.monotonic()
        with pytest.raises(TransportError) as info:
            await pull(conn, "die", 8 * 2**20, 2**20, timeout=20)
        elapsed = time.monotonic() - t0
        assert info.value.reason in ("transfer_failed", "peer_closed"), info.value
        assert elapsed < 5, f"a dead peer took {elapsed:.1f} s to surface"
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert not conn.alive
        with pytest.raises(TransportError) as info:
            await pool.get(HOST, port)  # nobody listens any more
        assert info.value.reason in ("connect_failed", "connect_timeout")


@aio
async def test_a_dead_sources_connection_is_forgotten_at_the_next_connect(solo_peer, peer):
    """A source that went away (or restarted on another port) is never asked for again:
    its dead connection and lock go when the pool next connects anywhere."""
    proc, port = solo_peer
    async with ConnectionPool() as pool:
        dead = await pool.get(HOST, port)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while dead.alive:
            assert time.monotonic() < deadline, "the peer's death was never seen"
            await asyncio.sleep(0.05)
        assert (HOST, port) in pool._conns
        assert (await pool.get(HOST, peer[1])).alive
        assert (HOST, port) not in pool._conns and (HOST, port) not in pool._locks
        assert len(pool) == 1


@aio
async def test_frozen_peer_times_out(solo_peer):
    proc, port = solo_peer
    async with ConnectionPool() as pool:
        conn = await pool.get(HOST, port)
        with pytest.raises(TransportError) as info:
            await pull(conn, "stop", 8 * 2**20, 2**20, timeout=1)
        assert info.value.reason == "transfer_timeout"
        os.kill(proc.pid, signal.SIGCONT)


@aio
async def test_connect_to_closed_port_is_bounded():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago, nobody listening
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    async with ConnectionPool(connect_timeout=2) as pool:
        t0 = time.monotonic()
        with pytest.raises(TransportError) as info:
            await pool.get(HOST, port)
        assert info.value.reason in ("connect_failed", "connect_timeout")
        assert time.monotonic() - t0 < 4


# ------------------------------------------------------------ in-process listener


@aio
async def test_listener_shutdown_closes_everything():
    events = []

    async def handler(conn):
        try:
            await conn.recv_msg(timeout=None)
        except TransportError as exc:
            events.append(exc.reason)

    listener = await Listener(handler).start()
    async with ConnectionPool() as pool:
        a = await pool.get(HOST, listener.port)
        await asyncio.sleep(0)
        b_pool = ConnectionPool()
        b = await b_pool.get(HOST, listener.port)
        for _ in range(200):
            if listener.open_connections == 2:
                break
            await asyncio.sleep(0.01)
        assert listener.accepted == 2 and listener.open_connections == 2
        assert listener.running_handlers == 2
        await listener.close()
        assert listener.open_connections == 0 and listener.running_handlers == 0
        for conn in (a, b):
            with pytest.raises(TransportError) as info:
                await conn.recv_msg(timeout=3)
            assert info.value.reason in ("peer_closed", "transfer_failed", "transfer_timeout")
        await b_pool.close()
        assert len(b_pool) == 0


@aio
async def test_a_connection_from_outside_accept_from_is_rejected_before_it_has_an_endpoint():
    """A listener whose ``accept_from`` leaves loopback out rejects a loopback client's
    connection request: the client learns at once, the listener made no endpoint (nothing
    entered its gate or handshake) and names the reason; one that covers loopback serves."""
    reasons: list[str] = []

    async def handler(conn):
        await conn.recv_msg(timeout=None)

    outside = await Listener(handler, accept_from=Networks.parse("10.0.0.0/8"),
                             on_refused=reasons.append).start()
    inside = await Listener(handler, accept_from=Networks.parse("127.0.0.0/8")).start()
    try:
        async with ConnectionPool(connect_timeout=10) as pool:
            t0 = time.monotonic()
            with pytest.raises(TransportError) as info:
                await pool.get(HOST, outside.port)
            assert info.value.reason == "connect_failed"
            assert time.monotonic() - t0 < 5  # rejected, not timed out
            for _ in range(100):
                if reasons:
                    break
                await asyncio.sleep(0.01)
            assert reasons == ["address_not_accepted"] and outside.rejected_connections == 1
            assert outside.accepted == 0 and outside.untrusted_connections == 0
            assert outside.refused_untrusted == 0
            await pool.get(HOST, inside.port)
            assert inside.accepted == 1 and inside.rejected_connections == 0
    finally:
        await outside.close()
        await inside.close()


FLOOD = Path(__file__).parent / "peers" / "flood_peer.py"


def _flood(accept_from: str, *extra: str) -> dict:
    env = {**os.environ, "UCX_LOG_LEVEL": "error"}
    out = subprocess.run([sys.executable, str(FLOOD), accept_from, "1.0", "4096", *extra],
                         capture_output=True, text=True, timeout=120, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith("FLOOD ")), None)
    assert out.returncode == 0 and line, (out.stdout[-2000:], out.stderr[-2000:])
    return json.loads(line.split(" ", 1)[1])


def test_a_rejected_address_cannot_fill_the_queue_of_unexpected_messages():
    """UCX keeps every tagged message no receive matches, from any connected endpoint,
    before kvkern has checked anything: a second of 4 KiB messages from one connection
    grows the listening process by hundreds of MiB. From an address outside
    ``accept_from``, or from a host that has not presented the fleet credential over HTTP
    (a source's ``ProvenHosts``), the connection never exists, and the process does not
    grow."""
    admitted = _flood("127.0.0.0/8")
    assert admitted["rejected"] == 0 and admitted["rss_growth_mib"] >= 64, admitted
    for rejected in (_flood("10.0.0.0/8"), _flood("127.0.0.0/8", "unproven")):
        assert rejected["rejected"] == 1 and rejected["accepted"] == 0, rejected
        assert rejected["rss_growth_mib"] <= 16, rejected


@aio
async def test_a_connection_made_while_the_pool_closes_is_not_kept(monkeypatch):
    """A get() whose connect is still running when the pool closes fails ``closed`` and
    leaves no live connection behind in the closed pool."""
    async def handler(conn):
        await asyncio.sleep(5)

    async with Listener(handler) as listener:
        pool = ConnectionPool()
        real, started, go = pool._connect, asyncio.Event(), asyncio.Event()

        async def slow_connect(key):
            conn = await real(key)
            started.set()
            await go.wait()
            return conn

        monkeypatch.setattr(pool, "_connect", slow_connect)
        getting = asyncio.ensure_future(pool.get(HOST, listener.port))
        await asyncio.wait_for(started.wait(), 10)
        await pool.close()
        go.set()
        with pytest.raises(TransportError) as info:
            await getting
        assert info.value.reason == "closed" and len(pool) == 0 and not pool._conns


@aio
async def test_send_timeout_aborts_endpoint():
    """A rendezvous send nobody receives: the send times out, the endpoint is aborted (UCX
    does not cancel a timed-out send), so the buffer is ours again."""
    gate = asyncio.Event()

    async def handler(conn):
        await gate.wait()

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        buf = np.zeros(8 * 2**20, np.uint8)
        with pytest.raises(TransportError) as info:
            await conn.send_chunks(7, [buf], timeout=0.5)
        assert info.value.reason == "transfer_timeout"
        assert not conn.alive and len(pool) == 0
        gate.set()


@aio
async def test_a_chunk_shorter_than_announced_is_an_error():
    """A sender whose chunks are shorter than the receiver's buffers (eager and rendezvous
    sizes): UCX completes each receive as if whole, and the canary at the buffer's end fails
    it (the trailer would too)."""
    async def handler(conn):
        await conn.send_chunks(9, [np.full(1000, 7, np.uint8), np.full(40 << 10, 7, np.uint8)],
                               timeout=5)
        await asyncio.sleep(1)

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        bufs = [np.zeros(64 << 10, np.uint8), np.zeros(64 << 10, np.uint8)]
        with pytest.raises(TransportError, match="chunk 0 arrived shorter") as info:
            await conn.recv_chunks(9, bufs, timeout=5)
        assert info.value.reason == "protocol_error" and not conn.alive


@aio
@pytest.mark.parametrize("short_by", [3000, 24 << 10, 3], ids=["eager", "rendezvous", "3-bytes"])
async def test_a_short_chunk_behind_a_lying_trailer_leaves_nothing_stale(short_by):
    """A sender that stops a chunk short and sends a trailer over the announced lengths (the
    trailer is its word): the receiver's buffer kept its earlier bytes past the message's
    end. The canary written there before the receive fails the stream; a chunk fewer than
    8 bytes short leaves random bytes there, never the buffer's earlier ones."""
    size = 64 << 10

    async def handler(conn):
        await conn.send_bytes(np.full(size - short_by, 7, np.uint8), tag_for(9, Lane.DATA, 0))
        lying = ChunkLengths()
        lying.add(size)
        await conn.send_bytes(np.frombuffer(lying.pack(), np.uint8), tag_for(9, Lane.TRAILER, 0))
        await asyncio.sleep(1)

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        buf = np.full(size, 0xAB, np.uint8)  # what the buffer held before: another pull's KV
        if short_by >= 8:
            with pytest.raises(TransportError, match="shorter than") as info:
                await conn.recv_chunks(9, [buf], timeout=5)
            assert info.value.reason == "protocol_error" and not conn.alive
        else:
            assert await conn.recv_chunks(9, [buf], timeout=5) == size  # (the trailer agrees)
            assert (buf[:size - short_by] == 7).all()
            assert not (buf[size - short_by:] == 0xAB).all()  # not the earlier bytes


@aio
async def test_a_stream_with_more_chunks_than_received_is_an_error():
    """One chunk more than the receiver takes: every receive it posts completes, and the
    trailer's count fails the stream."""
    async def handler(conn):
        await conn.send_chunks(10, [np.full(4096, i, np.uint8) for i in range(3)], timeout=5)
        await asyncio.sleep(1)

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        with pytest.raises(TransportError, match="sent 3 chunks") as info:
            await conn.recv_chunks(10, [np.zeros(4096, np.uint8)] * 2, timeout=5)
        assert info.value.reason == "protocol_error"


@aio
async def test_a_missing_trailer_times_out():
    """A bare stream (no trailer) into a receiver that expects one: it never passes."""
    async def handler(conn):
        await conn.send_stream(11, lambda i: np.full(4096, 1, np.uint8), 2, timeout=5,
                               trailer=False)
        await asyncio.sleep(2)

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        bufs = [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)]
        with pytest.raises(TransportError) as info:
            await conn.recv_chunks(11, bufs, timeout=0.5)
        assert info.value.reason == "transfer_timeout"
        assert all((b == 1).all() for b in bufs)  # the chunks came; the trailer did not


@aio
async def test_a_stream_whose_first_chunk_never_comes_times_out():
    """Chunk 1 lands, chunk 0 never does: the wait for chunk 0 is bounded, not a spin on
    chunk 1's finished receive."""
    async def handler(conn):
        await conn.send_bytes(np.ones(4096, np.uint8), tag_for(13, Lane.DATA, 1), timeout=5)
        await asyncio.sleep(3)

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        t0 = time.perf_counter()
        with pytest.raises(TransportError) as info:
            await asyncio.wait_for(
                conn.recv_chunks(13, [np.zeros(4096, np.uint8)] * 2, timeout=0.5), 5)
        assert info.value.reason == "transfer_timeout"
        assert time.perf_counter() - t0 < 2


@aio
async def test_a_bare_stream_on_both_sides():
    async def handler(conn):
        await conn.send_stream(12, lambda i: np.full(3000 + i, i + 1, np.uint8), 3, timeout=5,
                               trailer=False)

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        bufs = [np.zeros(3000 + i, np.uint8) for i in range(3)]
        assert await conn.recv_stream(12, bufs.__getitem__, 3, timeout=5,
                                      trailer=False) == 9003
        assert [int(b[-1]) for b in bufs] == [1, 2, 3]


@aio
async def test_garbage_control_frame_is_protocol_error():
    seen = []

    async def handler(conn):
        try:
            await conn.recv_msg(timeout=5)
        except TransportError as exc:
            seen.append((exc.reason, getattr(exc.__cause__, "reason", None)))

    async with Listener(handler) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        await conn.send_bytes(b"NOPE" + bytes(16), CONTROL_TAG, timeout=5)
        for _ in range(300):
            if seen:
                break
            await asyncio.sleep(0.01)
    assert seen == [("protocol_error", "bad_magic")]


# -------------------------------------------------- ucxx loop binding and read posting


@aio
async def test_bind_ucxx_loop_is_idempotent_on_one_loop(monkeypatch):
    """Binding twice (or again after forgetting the cached loop) keeps the notifier thread
    that already serves this loop, and UCX requests still complete on it afterwards."""
    loop = asyncio.get_running_loop()
    transport.bind_ucxx_loop()
    ctx = import_ucxx().core._get_ctx()
    thread = ctx.notifier_thread
    assert transport._NOTIFIER_LOOP is loop
    transport.bind_ucxx_loop()
    assert ctx.notifier_thread is thread and transport._NOTIFIER_LOOP is loop
    monkeypatch.setattr(transport, "_register_exit_hook", lambda: None, raising=False)
    monkeypatch.setattr(transport, "_NOTIFIER_LOOP", None)
    transport.bind_ucxx_loop()
    transport.bind_ucxx_loop()
    assert ctx.notifier_thread is thread and transport._NOTIFIER_LOOP is loop
    if ctx.enable_python_future:
        assert thread is not None and thread.is_alive() and thread._args[0] is loop
        assert thread._target is ucxcompat._notifier

    async def echo(conn):
        msg = await conn.recv_msg(timeout=5)
        await conn.send_msg(msg, tag_for(msg.transfer_id, Lane.REPLY), timeout=5)

    async with Listener(echo) as listener, ConnectionPool() as pool:
        conn = await pool.get(HOST, listener.port)
        await conn.send_msg(Cancel(transfer_id=5, reason="ping"), timeout=5)
        assert await conn.recv_msg(tag_for(5, Lane.REPLY), timeout=5) == Cancel(
            transfer_id=5, reason="ping")
    assert ctx.notifier_thread is thread


def test_the_notifier_hands_each_batch_to_the_loop_and_ends_on_shutdown():
    """kvkern's notifier thread body: one loop callback per batch of completed requests,
    the future pool refilled before every wait, nothing scheduled on a timeout, the pool
    cleared when it ends (on ucxx's shutdown state, the shutdown message, or a closed
    loop)."""
    from ucxx._lib.libucxx import PythonRequestNotifierWaitState as State

    class Worker:
        def __init__(self, states):
            self.states, self.calls = list(states), []

        def populate_python_futures_pool(self):
            self.calls.append("populate")

        def wait_request_notifier(self, period_ns):
            assert period_ns == ucxcompat.NOTIFIER_POLL_NS
            return self.states.pop(0)

        def run_request_notifier(self):
            self.calls.append("run")

        def clear_python_futures_pool(self):
            self.calls.append("clear")

    class Loop(asyncio.AbstractEventLoop):
        def __init__(self, closed=False):
            self.scheduled, self.closed = [], closed

        def call_soon_threadsafe(self, fn):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.scheduled.append(fn)

    import queue as queues

    def run(loop, worker, q):  # on a thread of its own, as ucxx starts it
        t = threading.Thread(target=ucxcompat._notifier, args=(loop, worker, q))
        t.start()
        t.join(10)
        assert not t.is_alive()

    worker, loop = Worker([State.Ready, State.Timeout, State.Ready, State.Shutdown]), Loop()
    run(loop, worker, queues.Queue())
    assert loop.scheduled == [worker.run_request_notifier] * 2
    assert worker.calls == ["populate"] * 4 + ["clear"]
    q = queues.Queue()
    q.put("shutdown")
    worker = Worker([State.Timeout])
    run(Loop(), worker, q)
    assert worker.calls == ["populate", "clear"]
    worker = Worker([State.Ready])
    run(Loop(closed=True), worker, queues.Queue())
    assert worker.calls == ["populate", "clear"]


_RMA_PEER = r"""
import ctypes, sys, time
from kvkern.xfer import ucxcompat
from ucxx._lib import libucxx as lib

host, port, address, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# a peer of its own making: every feature, software RMA included (UCX_TLS=tcp)
ctx = lib.UCXContext({}, tuple(lib.Feature))
worker = lib.UCXWorker(ctx)
ep = lib.UCXEndpoint.create(worker, host, port, True)
own = ctypes.create_string_buffer(n)
status, memh = ucxcompat.map_for_remote_read(int(ctx.handle), ctypes.addressof(own), n, 0)
status, packed = ucxcompat.pack_rkey(int(ctx.handle), memh)
status, rkey = ucxcompat.unpack_rkey(int(ep.handle), packed)
assert status == 0, status
out = ctypes.create_string_buffer(n)
req = ucxcompat.read_poster(0)(int(ep.handle), ctypes.addressof(out), n, address, rkey)
check, _, progress = ucxcompat.request_calls()
state = ucxcompat.ptr_status(req)
deadline = time.monotonic() + 3
while state is None and time.monotonic() < deadline:
    progress(int(worker.handle))
    state = None if check(req) == 1 else check(req)  # 1: UCS_INPROGRESS
    time.sleep(0.001)
print("read" if state == 0 else f"no read ({state})", out.raw.hex(), flush=True)
"""


@aio
async def test_the_listening_worker_serves_no_one_sided_read_or_write():
    """The worker kvkern listens on has no RMA and no AM (ucxcompat.APP_FEATURES): a peer
    that connects to the UCX port and asks UCX itself (no kvkern exchange) for a software
    read of this process's memory at an address of its choosing gets nothing."""
    secret = np.frombuffer(os.urandom(4096), np.uint8).copy()

    async def hold(conn):
        await asyncio.sleep(30)

    async with Listener(hold) as listener:
        features = ucxcompat.app_features()
        assert features & ucxcompat.UCP_FEATURE_RMA == 0
        assert features & (1 << 6) == 0  # UCP_FEATURE_AM
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_LOG_LEVEL": "error"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _RMA_PEER, HOST, str(listener.port),
            str(secret.ctypes.data), str(secret.nbytes), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    line = out.decode().strip()
    assert proc.returncode == 0 and line.startswith("no read"), (line, err.decode()[-2000:])
    assert secret.tobytes().hex() not in line


def test_a_ucxx_context_made_with_rma_before_kvkern_is_named():
    """Code of the same process that made ucxx's context first (every feature) leaves the
    listener serving UCX's software RMA: kvkern says so once, at its first use."""
    code = (
        "import logging, os, ucxx\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "ucxx.core._get_ctx()\n"
        "from kvkern.xfer import ucxcompat\n"
        "assert ucxcompat.app_features() & ucxcompat.UCP_FEATURE_RMA\n"
        "ucxcompat.app_features()\n"
        "ucxcompat.stop_notifier()\n"
        "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("created with RMA before kvkern used it") == 1, out.stderr


# ------------------------------------------------------------ ucxx's progress thread's device

_PROGRESS_THREAD_PROBE = r"""
import asyncio, json, sys, threading
import torch
import ucxx._cuda_context as cuda_context
from kvkern.xfer import devstream, ucxcompat

made = []  # what ucxx's own start callback would do: make GPU 0's context current
cuda_context.ensure_cuda_context = lambda device=0: made.append(device)
calls = []  # (call, device, on the main thread)
torch.cuda.set_device = lambda device: calls.append(
    ("set_device", device, threading.current_thread() is threading.main_thread()))
torch.cuda.mem_get_info = lambda device: calls.append(
    ("mem_get_info", device, threading.current_thread() is threading.main_thread()))
devstream.warm_kernels = lambda ranks, name="": None
if sys.argv[1] == "cuda":  # a rank serving GPU 3, named as a puller or source names it
    devstream.serve_devices([type("Rank", (), {"device": torch.device("cuda", 3)})()])
elif sys.argv[1] == "cuda-unnamed":  # a process that uses CUDA but names no pool's device
    torch.cuda.is_initialized = lambda: True
async def main():
    ctx = ucxcompat._app_context()
    ctx.continuous_ucx_progress()  # starts ucxx's progress thread, as a first connection does
    for _ in range(500):
        if ucxcompat._progress_applied:
            break
        await asyncio.sleep(0.01)
asyncio.run(main())
print(json.dumps({"applied": ucxcompat._progress_applied, "made": made, "calls": calls}))
"""


@pytest.mark.parametrize(("pools", "device"), [("cpu", None), ("cuda", 3), ("cuda-unnamed", 0)])
def test_ucxx_progress_thread_makes_only_the_pools_device_current(pools, device):
    """ucxx's progress thread starts by making GPU 0's CUDA context current in every process
    (through cuda-core): a context on GPU 0 for each rank of a multi-GPU host. kvkern's start
    makes no CUDA call in a process with host pools alone, and makes the pools' device
    current (its context bound by a call that needs one) on that thread; a process that uses
    CUDA without naming a device gets GPU 0's, as ucxx's start gives it."""
    proc = subprocess.run([sys.executable, "-c", _PROGRESS_THREAD_PROBE, pools],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["made"] == []
    assert seen["applied"] == [-1 if device is None else device]
    assert seen["calls"] == ([] if device is None else [["set_device", device, False],
                                                         ["mem_get_info", device, False]])


def test_a_progress_thread_start_that_fails_is_logged_not_raised(monkeypatch, caplog):
    """A device that cannot be made current (a driver error) leaves UCX's thread running;
    a device named only after the thread started is a warning."""
    monkeypatch.setattr(ucxcompat, "_progress_device", [1])
    monkeypatch.setattr(ucxcompat, "_progress_applied", [])

    def fail(device):
        raise RuntimeError("CUDA driver error: no device")

    monkeypatch.setattr(torch.cuda, "set_device", fail)
    ucxcompat._progress_thread_started()
    assert ucxcompat._progress_applied == [1]
    assert "could not make CUDA device 1 current: CUDA driver error" in caplog.text
    ucxcompat.note_cuda_device(torch.device("cuda", 2))  # the first named stays
    assert ucxcompat._progress_device == [1]
    monkeypatch.setattr(ucxcompat, "_progress_device", [])
    monkeypatch.setattr(ucxcompat, "_progress_applied", [-1])  # started with nothing named
    ucxcompat.note_cuda_device("cuda:2")
    assert "started before CUDA device 2 was named (current there: none)" in caplog.text
