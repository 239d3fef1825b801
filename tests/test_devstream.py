"""The device-stream ordering of the transfer path (:mod:`kvkern.xfer.devstream`).

Off-GPU, :class:`CudaStream` is driven by recording fakes of CUDA streams and events, and the
source's producer and the destination's stream receiver run on it over CPU pools, through the
real chunk-stream logic of :class:`kvkern.xfer.transport.Connection` on a fake endpoint: the
send of chunk ``i`` follows the wait on exactly chunk ``i``'s pack event; a staging slot is
packed or received into again only after its send completed and its event fired; no stream
or device is ever synchronised as a whole; the compute stream waits for the last unpack.
The ``gpu`` tests run the same paths on real CUDA streams with bit-exact checks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import itertools
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvkern.kernels.pack import pack
from kvkern.kernels.sharded import pack_for_peer
from kvkern.layout.chunks import plan_chunks, send_chunks
from kvkern.layout.plan import plan_transfer
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer import devstream
from kvkern.xfer.config import XferConfig
from kvkern.xfer.devstream import DONE, HOST, CudaStream, StreamConfig, wait_ready
from kvkern.xfer.kvgroup import RankKV
from kvkern.xfer.messages import DEFAULT_CODEC, PlanPiece
from kvkern.xfer.metrics import XferMetrics
from kvkern.xfer.outcome import Reason
from kvkern.xfer.pulljob import Fallback
from kvkern.xfer.receive import StreamReceiver
from kvkern.xfer.send import Sender
from kvkern.xfer.staging import StagingPool
from kvkern.xfer.transport import INDEX_BITS, ChunkLengths, Connection, Lane

MODEL = ModelKVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
TOPO = Topology(model=MODEL, parallel=Parallelism())
BLOCK_BYTES = 2 * 2 * 2 * 4 * 8 * 2  # layers x kv x heads x tokens x head_dim x fp16
BLOCK_IDS = [5, 2, 7, 0, 3, 6]  # not consecutive: every chunk goes through staging
RING = 2


# ------------------------------------------------------------------------- recording fakes


class FakeEvent:
    """A CUDA event that fires only when someone synchronises on it (or :meth:`fire`)."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.fired = log, name, False

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.log.append(("sync", self.name, threading.current_thread().name))
        self.fired = True

    def fire(self) -> None:
        self.fired = True


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, ev: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, ev.name))

    def synchronize(self) -> None:  # a whole-stream wait: never allowed
        self.log.append(("stream_sync", self.name))


def fake_cuda_stream(log: list, max_programs: int | None = 3) -> CudaStream:
    count = iter(range(1 << 30))

    def new_event() -> FakeEvent:
        return FakeEvent(log, f"ev{next(count)}")

    @contextlib.contextmanager
    def use(stream: FakeStream):
        log.append(("enter", stream.name))
        try:
            yield
        finally:
            log.append(("exit", stream.name))

    return CudaStream(side=FakeStream(log, "side"), compute=FakeStream(log, "compute"),
                      max_programs=max_programs, new_event=new_event, use=use)


def at(log: list, entry: tuple) -> int:
    """Index of the first log entry starting with ``entry``."""
    for k, e in enumerate(log):
        if e[:len(entry)] == entry:
            return k
    raise AssertionError(f"{entry} not in the log:\n" + "\n".join(map(str, log)))


@pytest.fixture
def no_device_sync(monkeypatch):
    """Fail on any whole-device or whole-stream synchronisation."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("device"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: calls.append("stream"), raising=False)
    yield calls
    assert calls == []


# ------------------------------------------------------------------------ the abstraction


def test_program_cap_is_a_fraction_of_the_sms():
    assert StreamConfig().max_programs(132) == 33
    assert StreamConfig(program_fraction=0.5).max_programs(108) == 54
    assert StreamConfig(program_fraction=0.01).max_programs(16) == 1  # at least one
    assert StreamConfig(program_fraction=1.0).max_programs(132) is None  # uncapped
    for bad in (0, -0.5, 1.5, True, "0.25"):
        with pytest.raises(ValueError, match="program_fraction"):
            StreamConfig(program_fraction=bad)
    with pytest.raises(ValueError, match="sm_count 0"):
        StreamConfig().max_programs(0)


def test_run_orders_the_side_stream_after_the_fence_and_records_inside():
    log: list = []
    ds = fake_cuda_stream(log)
    fence = ds.fence()
    out, ready = ds.run(lambda: log.append(("kernel",)) or 42, after=fence)
    assert out == 42 and ready.name == "ev1"
    assert log == [("record", "ev0", "compute"), ("wait_event", "side", "ev0"),
                   ("enter", "side"), ("kernel",), ("record", "ev1", "side"),
                   ("exit", "side")]
    log.clear()
    ds.publish(ready)  # the compute stream waits; the host does not
    assert log == [("wait_event", "compute", "ev1")] and not ready.fired


def test_host_stream_runs_at_once_and_every_event_has_fired():
    ran = []
    out, ready = HOST.run(lambda: ran.append(1) or "x", after=HOST.fence())
    assert out == "x" and ran == [1] and ready is DONE and ready.query()
    assert HOST.max_programs is None
    HOST.publish(ready)
    asyncio.run(HOST.wait(ready, 0.1))


def test_for_device_gives_host_for_cpu_and_the_installed_stream():
    assert devstream.for_device("cpu") is HOST
    fake = fake_cuda_stream([])
    with devstream.installed("cpu", fake):
        assert devstream.for_device(torch.device("cpu")) is fake
    assert devstream.for_device("cpu") is HOST


async def test_wait_never_blocks_the_loop_and_is_bounded():
    loop_thread = threading.current_thread().name
    log: list = []
    done = FakeEvent(log, "done")
    done.fire()
    await wait_ready(done, 0.1)
    assert log == []  # already fired: one query, no synchronize

    release = threading.Event()

    class Slow(FakeEvent):
        def synchronize(self) -> None:  # returns when the loop sets ``release``
            assert release.wait(5)
            super().synchronize()

    ev = Slow(log, "slow")
    waiter = asyncio.ensure_future(wait_ready(ev, 5))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    release.set()  # only possible because the loop thread is free while the waiter waits
    await waiter
    assert log == [("sync", "slow", log[0][2])] and log[0][2] != loop_thread

    stuck = Slow(log, "stuck")
    release.clear()
    with pytest.raises(asyncio.TimeoutError):
        await wait_ready(stuck, 0.05)
    release.set()


async def test_a_helper_thread_waits_on_an_event_with_its_device_current(monkeypatch):
    """An event of GPU 3 is synchronised with device 3 current on the helper thread, so the
    wait makes no context on device 0 for a process that serves another GPU."""
    log: list = []
    current: list = []

    @contextlib.contextmanager
    def device(d):
        current.append(d)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)

    class OnDevice3(FakeEvent):
        device = torch.device("cuda", 3)

        def synchronize(self) -> None:
            log.append(list(current))
            super().synchronize()

    await wait_ready(OnDevice3([], "gpu3"), 5)
    assert log == [[torch.device("cuda", 3)]] and current == []


def test_the_kernels_of_device_pools_compile_on_a_thread_of_their_own(monkeypatch, caplog):
    """A puller's or source's device pools get their kernels compiled at start, off the
    threads that pull; a host pool gets nothing, and a failure is a warning."""
    pack_mod = importlib.import_module("kvkern.kernels.pack")  # (kvkern.kernels.pack: the function)
    done: list = []
    monkeypatch.setattr(pack_mod, "warm_up", lambda pool, layout: done.append(
        (pool, threading.current_thread().name)) or pool == "bad" and 1 / 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    rank = lambda pool, kind: SimpleNamespace(pool=pool, layout=None,  # noqa: E731
                                              device=torch.device(kind, 0))
    assert devstream.warm_kernels([rank("host", "cpu")]) is None
    thread = devstream.warm_kernels([rank("gpu0", "cuda"), rank("host", "cpu"),
                                     rank("bad", "cuda")], "warm-test")
    thread.join(5)
    assert done == [("gpu0", "warm-test"), ("bad", "warm-test")]
    assert "compiling the kernels of cuda:0 ahead failed: ZeroDivisionError" in caplog.text


def test_staging_pool_keeps_a_buffer_until_its_event_fired():
    log: list = []
    cpu = torch.device("cpu")
    sp = StagingPool(max_bytes=4096)
    a = sp.take(cpu, 4096)
    ev = FakeEvent(log, "unpack")
    sp.give([a], ready=ev)
    assert sp.pending == 1 and sp.idle_bytes == 0
    b = sp.take(cpu, 4096)
    assert b.data_ptr() != a.data_ptr()  # a kernel may still read ``a``
    sp.give([b])  # nothing touches b: idle at once, and the cap is reached
    sp.clear()
    assert sp.pending == 1  # not dropped to the allocator either
    ev.fire()
    assert sp.take(cpu, 4096).data_ptr() == a.data_ptr()
    assert sp.pending == 0
    sp.give([b], ready=DONE)
    assert sp.idle_bytes == 4096


# ---------------------------------------------------------------- source and destination


def _is_trailer(tag: int) -> bool:
    return (tag >> INDEX_BITS) & 3 == Lane.TRAILER


class FakeEp:
    """A UCX endpoint: sends snapshot the buffer when posted and check it is unchanged when
    they complete (a staging slot overwritten while UCX reads it fails); receives copy the
    next chunk of ``stream`` in, and the stream's trailer as its sender would pack it."""

    closed = False

    def __init__(self, log: list, stream: torch.Tensor | None = None,
                 starts: list[int] | None = None) -> None:
        self.log, self.stream, self.starts = log, stream, starts
        self.sent: dict[int, bytes] = {}
        self.trailer: bytes | None = None

    def set_close_callback(self, cb) -> None:
        pass

    def abort(self) -> None:
        self.closed = True

    async def send(self, buf, tag: int) -> None:
        if _is_trailer(tag):
            self.trailer = bytes(memoryview(buf))
            return
        i = tag & 0xFFFF
        t = torch.as_tensor(buf) if not isinstance(buf, torch.Tensor) else buf
        posted = t.cpu().numpy().tobytes()
        self.log.append(("send", i))
        for _ in range(3):  # on the wire for a few loop turns
            await asyncio.sleep(0)
        assert t.cpu().numpy().tobytes() == posted, f"chunk {i} overwritten while sending"
        self.sent[i] = posted
        self.log.append(("sent", i))

    async def recv(self, buf, tag: int) -> None:
        if _is_trailer(tag):
            lengths = ChunkLengths()
            for a, b in itertools.pairwise(self.starts):
                lengths.add(b - a)
            memoryview(buf)[:] = lengths.pack()
            return
        i = tag & 0xFFFF
        self.log.append(("recv", i))
        await asyncio.sleep(0)
        t = torch.as_tensor(buf) if not isinstance(buf, torch.Tensor) else buf
        t.copy_(self.stream[self.starts[i]:self.starts[i + 1]])
        if t.is_cuda:  # UCX completes a receive once the bytes are in device memory
            torch.cuda.current_stream(t.device).synchronize()
        self.log.append(("received", i))


def rank_kv(device: str, seed: int, fill: str = "random") -> RankKV:
    lay = TOPO.local_layout(0, 8, "trtllm")
    pool = lay.allocate(fill=fill, generator=torch.Generator().manual_seed(seed)) \
        if fill == "random" else lay.allocate(fill=fill)
    return RankKV(0, lay, pool.to(device))


def whole_piece() -> PlanPiece:
    return PlanPiece(src_rank=0, layer_start=0, layer_stop=2, head_start=0, head_stop=2,
                     offset=0, length=BLOCK_BYTES)


async def send_all(device: str, log: list, ids: list[int] = BLOCK_IDS,
                   chunks: list | None = None, packed: int | None = None,
                   rkv: RankKV | None = None) -> FakeEp:
    """The source's producer over ``send_stream``: by default 6 blocks in 3 chunks, a ring
    of 2; the stream fakes, the producer's hook and the endpoint all append to ``log``.
    ``packed``: how many blocks go through staging (default: all); ``rkv``: the source's
    pool (default: random bytes on ``device``)."""
    rkv = rkv or rank_kv(device, seed=1)
    if chunks is None:
        chunks = plan_chunks([BLOCK_BYTES], len(ids), 2 * BLOCK_BYTES)
        assert len(chunks) == 3
    packed = len(ids) if packed is None else packed
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="test-pack")

    async def before_chunk(tid: int, i: int) -> None:
        log.append(("produce", i))

    svc = SimpleNamespace(config=SimpleNamespace(chunks_in_flight=RING,
                                                 chunk_bytes=2 * BLOCK_BYTES),
                          staging=StagingPool(1 << 20), executor=executor,
                          _before_chunk=before_chunk, metrics=XferMetrics())
    s = SimpleNamespace(ctx=SimpleNamespace(rkv=rkv), req=SimpleNamespace(transfer_id=9),
                        pack_cf=None, staging=[], deadline=time.monotonic() + 30)
    ep = FakeEp(log)
    conn = Connection(ep, peer=None, codec=DEFAULT_CODEC)
    try:
        produce = Sender(svc).producer(s, [whole_piece()], list(ids), chunks)
        await conn.send_stream(9, produce, len(chunks), timeout=5, max_in_flight=RING)
    finally:
        executor.shutdown()
    want = pack(rkv.pool, rkv.layout, ids).reshape(-1).view(torch.uint8).cpu()
    got = b"".join(ep.sent[i] for i in range(len(chunks)))
    assert got == want.numpy().tobytes()  # bit-exact
    sent = ChunkLengths()
    for i in range(len(chunks)):
        sent.add(len(ep.sent[i]))
    sent.check(ep.trailer)  # the trailer names the chunks as they went
    # the packed chunks (by default every chunk: none is a run of a host pool's rows) went
    # through the ring of staging slots of the staging size, reused, and were counted
    assert all(b.numel() == 2 * BLOCK_BYTES for b in s.staging)
    assert len({b.data_ptr() for b in s.staging}) == min(RING, -(-packed // 2))
    assert svc.metrics.value("kvkern_source_packed_bytes_total") == packed * BLOCK_BYTES
    return ep


async def test_source_sends_a_chunk_only_after_its_pack_event(no_device_sync):
    log: list = []
    with devstream.installed("cpu", fake_cuda_stream(log)):
        await send_all("cpu", log)
    # the fence is on the compute stream, before any pack; every pack waits for it
    assert at(log, ("record", "ev0", "compute")) < at(log, ("enter", "side"))
    assert sum(e == ("wait_event", "side", "ev0") for e in log) == 3
    for i in range(3):
        ev = f"ev{i + 1}"  # chunk i's pack event
        recorded = at(log, ("record", ev, "side"))
        synced = at(log, ("sync", ev))
        assert log[synced][2].startswith("test-pack")  # waited on the packing thread
        assert recorded < synced < at(log, ("send", i)), log
    # slot 0 is packed again for chunk 2 only after chunk 0 was sent and its event fired
    assert at(log, ("sent", 0)) < at(log, ("produce", 2))
    assert at(log, ("sync", "ev1")) < at(log, ("produce", 2))
    assert not any(e[0] == "stream_sync" for e in log)


async def test_host_source_sends_its_runs_from_the_pool_and_packs_the_rest():
    """Pool blocks 4..6 (a run of 3), then 0, 2 and 7: the run leaves from the pool in one
    chunk above the staging size, 0 and 2 are packed into a slot, 7 alone leaves from the
    pool; the bytes are the pack of all six either way."""
    ids = [4, 5, 6, 0, 2, 7]
    chunks = send_chunks(BLOCK_BYTES, ids, 2 * BLOCK_BYTES, 8 * BLOCK_BYTES, [], 3)
    assert [(c.b0, c.b1) for c in chunks] == [(0, 3), (3, 5), (5, 6)]
    log: list = []
    await send_all("cpu", log, ids, chunks, packed=2)


async def test_device_source_sends_its_runs_from_the_pool_once_the_fence_fired(no_device_sync):
    """A device pool's run of consecutive pinned blocks leaves from the pool, unstaged, as a
    host pool's does, but only once the fence after the engine's kernels that wrote them has
    fired (UCX reads device memory outside any stream's order), waited off the loop's
    thread and once per send; the blocks between are packed on the side stream after the
    same fence."""
    ids = [4, 5, 6, 0, 2, 7]
    chunks = send_chunks(BLOCK_BYTES, ids, 2 * BLOCK_BYTES, 8 * BLOCK_BYTES, [], 3)
    log: list = []
    with devstream.installed("cpu", fake_cuda_stream(log)):
        await send_all("cpu", log, ids, chunks, packed=2)
    fence = at(log, ("record", "ev0", "compute"))
    synced = at(log, ("sync", "ev0"))
    assert fence < synced < at(log, ("send", 0))
    assert log[synced][2] != threading.current_thread().name  # not the loop's thread
    assert sum(e[:2] == ("sync", "ev0") for e in log) == 1  # once, not per zero-copy chunk
    assert at(log, ("wait_event", "side", "ev0")) < at(log, ("send", 1))  # the packed chunk


async def receive_all(device: str, log: list, private: list[int] = BLOCK_IDS,
                      sizes: list[int] | None = None, in_place: int = 0,
                      into: bool = False) -> tuple[RankKV, StagingPool, list]:
    """The destination's stream receiver: 6 blocks, by default in chunks that split blocks
    (the carry) into non-consecutive blocks (the ring)."""
    src = rank_kv("cpu", seed=2)
    plan = plan_transfer(TOPO, 0, TOPO, 0)
    tr = plan.pair(0, 0)
    n = len(private)
    stream = pack_for_peer(plan, 0, 0, src.pool, src.layout, list(range(n)))
    sizes = sizes or [700, 700, 700, 700, n * BLOCK_BYTES - 2800]
    starts = [0, *itertools.accumulate(sizes)]
    dst = rank_kv(device, seed=0, fill="zeros")
    ep = FakeEp(log, stream.to(device), starts)
    conn = Connection(ep, peer=None, codec=DEFAULT_CODEC)
    staging = StagingPool(1 << 20)
    cfg = XferConfig(chunks_in_flight=RING, chunk_bytes=1024)
    job = SimpleNamespace(private=list(private), t_first_byte=None, unpack_s=0.0,
                          messages=0, bytes=0, open_transfers=["entry"],
                          into=list(private) if into else None)
    # the fields of the source's stream reply that the receiver reads
    reply = SimpleNamespace(transfer_id=11, served_blocks=n, total_bytes=n * BLOCK_BYTES,
                            n_chunks=len(sizes), chunk_sizes=sizes)
    await StreamReceiver(cfg, staging).receive(job, tr, dst, conn, reply, 1024, 5.0, "entry",
                                               in_place=in_place)
    want = src.layout.logical(src.pool)[:n]
    got = dst.layout.logical(dst.pool).cpu()[private]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit-exact
    return dst, staging, sizes


async def test_destination_reuses_a_slot_only_after_its_unpack_event(no_device_sync):
    log: list = []
    fake = fake_cuda_stream(log)
    with devstream.installed("cpu", fake):
        _, staging, sizes = await receive_all("cpu", log)
    n_chunks = len(sizes)
    fence = "ev0"
    assert at(log, ("record", fence, "compute")) < at(log, ("enter", "side"))
    for i in range(n_chunks):
        ev = f"ev{i + 1}"  # chunk i's unpack event
        launched = at(log, ("record", ev, "side"))
        assert at(log, ("received", i)) < launched
        if i + RING < n_chunks:  # its slot receives chunk i + RING next
            assert launched < at(log, ("sync", ev)) < at(log, ("recv", i + RING)), log
        elif i + 1 < n_chunks:  # not reused within the pull: nobody waits on the host
            assert ("sync", ev) not in [e[:2] for e in log]
    last = f"ev{n_chunks}"
    # the compute stream waits for the last unpack at the pair's completion, and the pair
    # ends once it is done (the engine's other streams and the read directory's readers)
    assert at(log, ("wait_event", "compute", last)) < at(log, ("sync", last)) == len(log) - 1
    # the ring went back with the last event, not yet fired then: no later pull took it
    assert staging.idle_bytes == 0
    assert not any(e[0] == "stream_sync" for e in log)


async def test_a_pull_into_the_engines_blocks_ends_after_its_last_unpack(no_device_sync):
    """Into the engine's own blocks too, which the engine may read on a stream of its own
    (not the one publish orders), the pair's receive returns only once the last unpack's
    event has fired: the pull is reported finished with every block written."""
    log: list = []
    with devstream.installed("cpu", fake_cuda_stream(log)):
        _, _, sizes = await receive_all("cpu", log, into=True)
    last = f"ev{len(sizes)}"
    assert at(log, ("wait_event", "compute", last)) < at(log, ("sync", last))
    assert log[-1][:2] == ("sync", last) and not any(e[0] == "stream_sync" for e in log)


async def test_chunks_landing_in_the_blocks_wait_for_the_fence_first(no_device_sync):
    log: list = []
    with devstream.installed("cpu", fake_cuda_stream(log)):
        _, staging, _ = await receive_all("cpu", log, private=[1, 2, 3, 4, 5, 6],
                                          sizes=[2 * BLOCK_BYTES] * 3)
    # UCX writes these chunks straight into the private blocks, outside any stream's
    # order: the engine's kernels still reading them must be done before the first receive
    assert at(log, ("record", "ev0", "compute")) < at(log, ("sync", "ev0")) \
        < at(log, ("recv", 0))
    assert ("enter", "side") not in log  # nothing to unpack, nothing to publish
    assert staging.pending == 0 and not any(e[0] == "stream_sync" for e in log)


async def test_chunks_landing_in_place_may_exceed_the_staging_size_up_to_the_request():
    """A planned run lands in place in one chunk of 6 blocks (above the 1 KiB staging slot,
    within the request's ``in_place`` limit); the same chunk beyond that limit, or one above
    the staging size into blocks that are not consecutive (it would need a staging slot),
    drops the stream before anything is received."""
    one = [6 * BLOCK_BYTES]
    _, staging, _ = await receive_all("cpu", [], private=[1, 2, 3, 4, 5, 6], sizes=one,
                                      in_place=6 * BLOCK_BYTES)
    assert staging.idle_bytes == 0  # no slot was taken
    for private, in_place in (([1, 2, 3, 4, 5, 6], 4 * BLOCK_BYTES),
                              (BLOCK_IDS, 6 * BLOCK_BYTES)):
        log: list = []
        with pytest.raises(Fallback, match="chunks") as err:
            await receive_all("cpu", log, private=private, sizes=one, in_place=in_place)
        assert err.value.reason is Reason.TRANSFER_FAILED
        assert not any(e[0] == "recv" for e in log)


async def test_a_reply_with_an_empty_chunk_is_refused_before_anything_is_planned():
    """Chunks that add up to the blocks but include an empty one (past the last served
    block) are refused as announced, before the in-place map is made from them."""
    log: list = []
    with pytest.raises(Fallback, match="chunks") as err:
        await receive_all("cpu", log, private=[1, 2, 3, 4, 5, 6],
                          sizes=[6 * BLOCK_BYTES, 0], in_place=6 * BLOCK_BYTES)
    assert err.value.reason is Reason.TRANSFER_FAILED
    assert not any(e[0] == "recv" for e in log)


async def test_destination_with_host_streams_needs_no_wait():
    log: list = []
    _, staging, _ = await receive_all("cpu", log)
    assert staging.pending == 0 and staging.idle_bytes > 0


async def grant_read(log: list) -> list:
    """The source's read offer of blocks 1 and 2 (``Sender.serve_read``); returns the
    replies it sent, each logged as ("reply", kind) when it went out."""
    replies: list = []

    async def reply(s, msg) -> None:
        log.append(("reply", type(msg).__name__))
        replies.append(msg)
        s.read_done.set()  # the destination's ReadDone, at once

    async def hook(*args) -> None:
        return None

    svc = SimpleNamespace(read_hold_s=5.0, metrics=XferMetrics(), _reply=reply,
                          _before_read_reply=hook, _after_reply=hook, _before_chunk=hook)
    now = asyncio.get_running_loop().time()
    s = SimpleNamespace(req=SimpleNamespace(transfer_id=9, count=2),
                        ctx=SimpleNamespace(rkv=rank_kv("cpu", seed=1), rank=0),
                        started=now, deadline=now + 5.0, read_done=None, hold_until=None,
                        ack_read=False, completed=False, cancel_reason=None)
    registered = SimpleNamespace(
        segments=SimpleNamespace(bases=[4096], stride=BLOCK_BYTES, nbytes=BLOCK_BYTES),
        regions=[SimpleNamespace(rkey=b"rkey")], native=False)
    await Sender(svc).serve_read(s, registered, [whole_piece()], [1, 2], [11, 12])
    return replies


async def test_a_read_offer_waits_for_the_kernels_that_wrote_its_blocks(no_device_sync):
    """A device pool's blocks are read outside any stream order, so the grant goes out
    only once the compute stream has passed a fence recorded after the pin."""
    log: list = []
    with devstream.installed("cpu", fake_cuda_stream(log)):
        replies = await grant_read(log)
    assert [type(r).__name__ for r in replies] == ["ReadGrant"]
    assert replies[0].read_blocks == [1, 2]
    fenced = at(log, ("record", "ev0", "compute"))
    waited = at(log, ("sync", "ev0"))
    assert log[waited][2].startswith("kvkern-event")  # off the event loop's thread
    assert fenced < waited < at(log, ("reply", "ReadGrant")), log


async def test_a_host_pools_read_offer_needs_no_wait():
    log: list = []
    replies = await grant_read(log)
    assert log == [("reply", "ReadGrant")] and replies[0].served_blocks == 2


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
async def test_gpu_source_and_destination_on_side_streams_are_bit_exact(no_device_sync):
    assert devstream.for_device("cuda").max_programs is not None
    await send_all("cuda", [])  # bytes checked against the pack of the same pool
    ids = [4, 5, 6, 0, 2, 7]  # a run of the device pool leaves from it, the rest packed
    await send_all("cuda", [], ids, send_chunks(BLOCK_BYTES, ids, 2 * BLOCK_BYTES,
                                               8 * BLOCK_BYTES, [], 3), packed=2)
    log: list = []
    await receive_all("cuda", log)
    assert [e for e in log if e[0] == "recv"]  # ran through the ring
    await receive_all("cuda", [], private=[1, 2, 3, 4, 5, 6], sizes=[2 * BLOCK_BYTES] * 3)


@pytest.mark.gpu
async def test_gpu_source_sends_a_run_only_after_the_engines_kernels_wrote_it(no_device_sync):
    """On real streams: the engine's compute stream (not the default one) writes the pool's
    blocks behind a long sleep. A run that leaves from the pool carries the written bytes,
    because the source waited for the fence recorded on that stream before UCX read them
    (the fake endpoint reads on the default stream, ordered after nothing on it)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    compute = torch.cuda.Stream(dev)
    rkv = rank_kv(str(dev), seed=1)
    written = rkv.pool.clone()
    rkv.pool.zero_()
    zeroed = torch.cuda.Event()
    zeroed.record()
    zeroed.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(1 << 28)  # the compute stream busy for about 0.1 s first
        rkv.pool.copy_(written)
    ids = [4, 5, 6, 0, 2, 7]  # the run 4..6 leaves from the pool, 0 and 2 are packed
    chunks = send_chunks(BLOCK_BYTES, ids, 2 * BLOCK_BYTES, 8 * BLOCK_BYTES, [], 3)
    with devstream.installed(dev, CudaStream.create(dev, compute=compute)):
        await send_all(str(dev), [], ids, chunks, packed=2, rkv=rkv)  # bit-exact inside


@pytest.mark.gpu
def test_gpu_pack_on_a_side_stream_overlaps_a_matmul(no_device_sync):
    dev = torch.device("cuda", torch.cuda.current_device())
    ds = CudaStream.create(dev)
    assert ds.side != torch.cuda.default_stream(dev) and ds.max_programs >= 1
    rkv = rank_kv("cuda", seed=3)
    # compiled first (a first launch compiles on the host for about a second, longer than
    # the matmuls below run), so that the launch below only enqueues
    pack(rkv.pool, rkv.layout, BLOCK_IDS, max_programs=ds.max_programs)
    warm = torch.cuda.Event()
    warm.record(torch.cuda.default_stream(dev))
    warm.synchronize()  # (an event: the test allows no device or stream synchronisation)
    fence = ds.fence()  # taken before the forward pass below is enqueued
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(40):  # tens of milliseconds of work on the compute stream
        a = (a @ a).clamp_(-1, 1)
    forward_done = torch.cuda.Event()
    forward_done.record(torch.cuda.default_stream(dev))
    staged, ready = ds.run(lambda: pack(rkv.pool, rkv.layout, BLOCK_IDS,
                                        max_programs=ds.max_programs), after=fence)
    ds.synchronize(ready)
    assert not forward_done.query(), "the pack waited for the matmuls"
    want = pack(rkv.pool.cpu(), rkv.layout, BLOCK_IDS)
    assert torch.equal(staged.cpu().view(torch.int16), want.view(torch.int16))
    forward_done.synchronize()


@pytest.mark.gpu
def test_gpu_publish_orders_the_compute_stream_after_the_unpack(no_device_sync):
    from kvkern.kernels.pack import unpack

    dev = torch.device("cuda", torch.cuda.current_device())
    ds = CudaStream.create(dev)
    rkv = rank_kv("cuda", seed=0, fill="zeros")
    src = rank_kv("cuda", seed=4)
    staging = pack(src.pool, src.layout, [0, 1, 2])

    def slow_unpack() -> None:
        torch.cuda._sleep(50_000_000)  # the side stream is busy for tens of milliseconds
        unpack(staging, rkv.pool, rkv.layout, [4, 1, 6], max_programs=ds.max_programs)

    _, ready = ds.run(slow_unpack, after=ds.fence())
    ds.publish(ready)
    seen = rkv.layout.logical(rkv.pool)[[4, 1, 6]].clone()  # on the compute stream
    want = src.layout.logical(src.pool)[[0, 1, 2]]
    assert torch.equal(seen.cpu().view(torch.int16), want.cpu().view(torch.int16))


@pytest.mark.gpu
def test_gpu_staging_slot_waits_for_its_unpack_event():
    dev = torch.device("cuda", torch.cuda.current_device())
    ds = CudaStream.create(dev)
    sp = StagingPool(1 << 20)
    a = sp.take(dev, 4096)
    _, ready = ds.run(lambda: torch.cuda._sleep(50_000_000), after=None)
    sp.give([a], ready=ready)
    assert sp.take(dev, 4096).data_ptr() != a.data_ptr()
    ready.synchronize()
    assert sp.take(dev, 4096).data_ptr() == a.data_ptr()


# ----------------------------------------------------------------- UCX's CUDA transports


def test_ucx_cuda_settings_and_transport_gaps():
    from kvkern.xfer.ucx_env import (
        CUDA_TRANSPORTS,
        UCX_DEFAULTS,
        configure_ucx_env,
        cuda_tls_gaps,
        ucx_tls_problem,
    )

    env: dict[str, str] = {}
    configure_ucx_env(env)
    assert env["UCX_MEMTYPE_REG_WHOLE_ALLOC_TYPES"] == "cuda" == UCX_DEFAULTS[
        "UCX_MEMTYPE_REG_WHOLE_ALLOC_TYPES"]
    assert env["UCX_CUDA_IPC_CACHE"] == "y" and "UCX_TLS" not in env  # UCX picks from all
    every = list(CUDA_TRANSPORTS)
    cases = {None: [], "all": [], "tcp,sm": every, "tcp,cuda": ["rc"],
             "tcp,cuda_copy,ib": ["cuda_ipc", "gdr_copy"], "^cuda_ipc": ["cuda_ipc"],
             "^cuda": ["cuda_copy", "cuda_ipc", "gdr_copy"], "^ib": ["rc"],
             "tcp,sm,cuda,rc_mlx5": []}
    for tls, gaps in cases.items():
        env = {} if tls is None else {"UCX_TLS": tls}
        assert cuda_tls_gaps(env) == gaps, tls
    assert "rules out cuda_copy" in ucx_tls_problem({"UCX_TLS": "tcp,sm"}, device_memory=True)
    assert ucx_tls_problem({"UCX_TLS": "tcp,sm"}) is None  # host pools do not need it
    assert ucx_tls_problem({"UCX_TLS": "tcp,cuda_copy"}, device_memory=True) is None
    assert "lacks tcp" in ucx_tls_problem({"UCX_TLS": "cuda"}, device_memory=True)


def test_first_device_stream_logs_what_ucx_tls_takes_away(monkeypatch, caplog):
    made = []
    monkeypatch.setattr(CudaStream, "create",
                        classmethod(lambda cls, dev: made.append(dev) or fake_cuda_stream([])))
    monkeypatch.setenv("UCX_TLS", "tcp,sm,cuda_copy")
    try:
        with caplog.at_level("WARNING", logger="kvkern.xfer"):
            ds = devstream.for_device("cuda:7")
            assert devstream.for_device("cuda:7") is ds and made == ["cuda:7"]
    finally:
        devstream.install("cuda:7", None)
    text = caplog.text
    assert "rules out cuda_ipc" in text and "rules out rc" in text
    assert "rules out cuda_copy" not in text and text.count("rules out cuda_ipc") == 1


def test_a_run_that_raises_hands_over_the_event_after_what_it_launched():
    """An unpack or pack that raises after launching kernels (a later piece's check, an
    allocation that fails): the event after them is recorded on the side stream and rides
    on the exception, for the caller to wait on before it reuses what they touch."""
    log: list = []
    ds = fake_cuda_stream(log)

    def launch_then_fail():
        log.append(("kernel",))
        raise ValueError("a later piece does not fit")

    with pytest.raises(ValueError) as info:
        ds.run(launch_then_fail, after=ds.fence())
    ready = devstream.launched(info.value)
    assert ready is not None and ready.name == "ev1"
    assert at(log, ("kernel",)) < at(log, ("record", "ev1", "side")) < at(log, ("exit", "side"))
    assert devstream.launched(ValueError("from a host stream")) is None


async def test_a_stream_whose_unpack_raises_gives_its_ring_back_only_after_the_launched_unpacks(
        no_device_sync, monkeypatch):
    """The destination's unpack of a chunk raises after launching (the second chunk): the
    pull fails, and its ring slots go back, and the engine is ordered, after the event of
    what that unpack launched, not the chunk before's."""
    from kvkern.xfer import receive
    from kvkern.xfer.pulljob import Fallback

    log: list = []
    fake = fake_cuda_stream(log)
    feed = receive.StreamUnpacker.feed
    calls = []

    def feed_then_fail(self, buf):
        calls.append(1)
        out = feed(self, buf)
        if len(calls) == 2:
            log.append(("launched then failed",))
            raise ValueError("a piece beyond the plan")
        return out

    monkeypatch.setattr(receive.StreamUnpacker, "feed", feed_then_fail)
    with devstream.installed("cpu", fake), pytest.raises(Fallback, match="beyond the plan"):
        await receive_all("cpu", log)
    failed = at(log, ("launched then failed",))
    ev = next(e[1] for e in log[failed:] if e[0] == "record" and e[2] == "side")
    assert at(log, ("wait_event", "compute", ev)) > failed  # the engine waits for it
    assert ("sync", ev) in [e[:2] for e in log]  # and the pair ended only after it
