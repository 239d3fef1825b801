"""Read lanes (kvkern.xfer.read_lanes): the share split by property, and real reads on
loopback through dedicated UCX workers, one thread each.

The loopback tests read from this process's own ucxx worker (its address, as a source
publishes it in its state), which a Listener keeps progressing; every read lands in a
poisoned buffer and is compared bit for bit with the registered source bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkern.layout.hostmem import host_buffer
from kvkern.xfer import read_lanes, tuning, ucp_rma, ucxcompat
from kvkern.xfer.read_lanes import ReadLanes, address_usable, split_parts
from kvkern.xfer.transport import ReadsStuck, TransportError

from .rma_helpers import NeverDone, held_batch_class, random_host_buffer, until

pytestmark = pytest.mark.timeout(30)
aio = pytest.mark.asyncio(loop_scope="module")
POISON = 0xA5
SRC_BYTES = 32 << 20


# ------------------------------------------------------------------------- the split

runs_st = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40),
                             st.integers(1, 1 << 22)), max_size=12)
parts_st = st.lists(st.tuples(st.sampled_from([b"k0", b"k1", b"k2"]), runs_st), max_size=4)


@settings(max_examples=300, deadline=None)
@given(parts=parts_st, n=st.integers(1, 5), min_bytes=st.sampled_from([0, 1, 4096, 1 << 20]),
       align=st.sampled_from([1, 4096]))
@example(parts=[(b"k0", [(0, 0, 10 << 20)])], n=2, min_bytes=4 << 20, align=4096)
@example(parts=[(b"k0", [(0, 0, 1), (0, 0, 3)])], n=3, min_bytes=0, align=1)
def test_split_covers_every_byte_once_in_order(parts, n, min_bytes, align):
    shares = split_parts(parts, n, min_bytes=min_bytes, align=align)
    total = sum(nb for _, runs in parts for *_, nb in runs)
    k = max(1, min(n, total // max(min_bytes, 1)))  # shares planned
    assert 1 <= len(shares) <= k
    assert all(share for share in shares) or shares == [[]] and total == 0
    # read in order, the shares are the runs again, each cut only at aligned offsets
    pieces = iter([(key, lo, re, nb) for share in shares for key, runs in share
                   for lo, re, nb in runs])
    for key, runs in parts:
        for lo, re, nb in runs:
            off = 0
            while off < nb:
                k2, plo, pre, pnb = next(pieces)
                assert (k2, plo, pre) == (key, lo + off, re + off) and 0 < pnb <= nb - off
                assert off % align == 0
                off += pnb
    assert next(pieces, None) is None
    # every share but the last holds close to an equal part
    quota = -(-total // k)
    sizes = [sum(nb for _, runs in share for *_, nb in runs) for share in shares]
    assert sum(sizes) == total
    if quota >= align:  # (below that, cuts may meet and shares go empty)
        # (k - 1 shares of the rounded-up quota may hold every byte: 4 bytes in 3 shares)
        assert len(shares) == k or len(shares) == k - 1 and (k - 1) * quota >= total
        for size in sizes[:-1]:
            assert abs(size - quota) < align


def test_split_examples():
    runs = [(1000, 5000, 8192), (90000, 70000, 4096)]
    assert split_parts([(b"k", runs)], 1) == [[(b"k", runs)]]
    two = split_parts([(b"k", runs)], 2, align=4096)
    assert two == [[(b"k", [(1000, 5000, 4096)])],
                   [(b"k", [(5096, 9096, 4096), (90000, 70000, 4096)])]]
    assert split_parts([(b"k", runs)], 2, min_bytes=1 << 20) == [[(b"k", runs)]]
    assert split_parts([], 3) == [[]]
    with pytest.raises(ValueError):
        split_parts([], 0)


# ------------------------------------------------------------- the loop lane's driver


def test_steps_run_blocking_sleeps_each_pause():
    from kvkern.xfer.pauses import run_blocking  # noqa: PLC0415

    def steps():
        total = 0.0
        for pause in (0.001, 0.002):
            yield pause
            total += pause
        return total

    t0 = time.perf_counter()
    assert run_blocking(steps()) == pytest.approx(0.003)
    assert time.perf_counter() - t0 >= 0.003


@aio
async def test_loop_driver_spins_then_sleeps_and_outlives_a_cancel(monkeypatch):
    """The loop lane's driver: pauses within LOOP_SPIN_S only yield to the loop, later ones
    sleep; a cancellation lets the steps run on through READ_CANCEL_GRACE_S, then sets
    ``stop``, and the steps' own end is reported with the cancellation."""
    monkeypatch.setattr(tuning, "READ_CANCEL_GRACE_S", 0.02)
    stop = threading.Event()
    pauses = []

    def steps():
        while not stop.is_set():
            t = time.perf_counter()
            yield 0.005
            pauses.append(time.perf_counter() - t)
        raise TimeoutError("stopped")

    task = asyncio.ensure_future(read_lanes._drive_here(steps(), stop))
    await asyncio.sleep(0.05)
    assert not task.done() and not stop.is_set()
    assert min(pauses) < 0.004 and max(pauses) >= 0.0045  # spun first, then slept
    t_cancel = time.perf_counter()
    task.cancel()
    value, error, cancelled = await task  # (the cancellation is reported, not raised)
    assert value is None and isinstance(error, TimeoutError) and cancelled
    assert stop.is_set() and time.perf_counter() - t_cancel >= 0.02


# ------------------------------------------------------------------- loopback fixtures


@pytest.fixture(scope="module")
def source():
    """SRC_BYTES random bytes registered for remote read in this process's read target,
    and its worker's address: (buffer, Region, address)."""
    why = ucp_rma.rma_unavailable()
    if why is not None:
        pytest.skip(f"one-sided reads unavailable: {why}")
    address = ucxcompat.read_target().address
    buf = random_host_buffer(SRC_BYTES)
    region = ucp_rma.Region(buf.data_ptr(), SRC_BYTES)
    try:
        yield buf, region, address
    finally:
        region.close()


@pytest.fixture
def second_worker(source):
    """The address of a second source worker in this process (a lane context's worker,
    progressed by a thread of its own): the same memory, read through another endpoint."""
    worker, _ = ucxcompat.new_worker(read_lanes._lane_context())
    stop = threading.Event()

    def progress() -> None:
        while not stop.is_set():
            worker.progress()
            time.sleep(0.0005)

    thread = threading.Thread(target=progress, daemon=True)
    thread.start()
    try:
        yield bytes(memoryview(worker.address))
    finally:
        stop.set()
        thread.join(5)


@pytest.fixture
def lanes():
    made = []

    def make(n: int = 2, **kw) -> ReadLanes:
        made.append(ReadLanes(n, **kw))
        return made[-1]

    yield make
    for lane in made:
        lane.close()
        assert lane.peers == 0


@pytest.fixture(params=["threads", "loop"])
def on(request):
    """Where small reads run: the lanes' threads, or the loop lane (every read of these
    tests is small enough for it)."""
    return {"loop_bytes": 1 << 40} if request.param == "loop" else {}


def lane_peers(rl: ReadLanes, index: int = 0):
    """The endpoints of lane ``index`` (-1: the loop lane)."""
    return (rl._on_loop if index < 0 else rl._lanes[index])._peers


def poisoned(nbytes: int) -> torch.Tensor:
    t = host_buffer(nbytes)
    t.fill_(POISON)
    return t


def shuffled_blocks(src, region, dst, n: int, nb: int, seed: int):
    """n blocks of nb bytes from shuffled source slots into shuffled destination slots
    (stride 2 nb on both sides: nothing merges); the expected destination."""
    rng = random.Random(seed)
    srcs = rng.sample(range(SRC_BYTES // (2 * nb)), n)
    dsts = list(range(n))
    rng.shuffle(dsts)
    runs = [(dst.data_ptr() + d * 2 * nb, region.address + s * 2 * nb, nb)
            for s, d in zip(srcs, dsts, strict=True)]
    want = torch.full_like(dst, POISON)
    for s, d in zip(srcs, dsts, strict=True):
        want[d * 2 * nb:d * 2 * nb + nb] = src[s * 2 * nb:s * 2 * nb + nb]
    return runs, want


# ------------------------------------------------------------------------------ reads


@pytest.mark.parametrize("n_lanes", [1, 2, 3])
@aio
async def test_scattered_blocks_bit_exact_on_every_lane(source, lanes, n_lanes, monkeypatch):
    """Blocks split over the lanes (no minimum share) land bit for bit, every other byte
    stays poison, and each lane opened its own endpoint to the source worker."""
    src, region, address = source
    used = []
    real_reading = read_lanes._Lane.reading

    def reading(self, *a):
        used.append(self.index)
        return real_reading(self, *a)

    monkeypatch.setattr(read_lanes._Lane, "reading", reading)
    rl = lanes(n_lanes, min_bytes=1)
    dst = poisoned(2 * 40 * 12288)
    runs, want = shuffled_blocks(src, region, dst, 40, 12288, seed=n_lanes)
    t0 = time.perf_counter()
    first = await rl.read(address, [(region.rkey, runs)], timeout=10, same_host=True)
    assert first is not None and t0 <= first <= time.perf_counter()
    assert torch.equal(dst, want)
    assert sorted(used) == list(range(n_lanes)) and rl.peers == n_lanes
    dst.fill_(POISON)  # again, on the endpoints and keys already open
    await rl.read(address, [(region.rkey, runs)], timeout=10, same_host=True)
    assert torch.equal(dst, want) and rl.peers == n_lanes


@pytest.mark.parametrize("n_lanes", [1, 2])
@aio
async def test_a_process_on_this_host_is_read_only_for_a_state_it_served(source, lanes,
                                                                         n_lanes):
    """UCX reads any address of a process on this host (CMA), whatever the key: without
    ``same_host`` (the state was not served by the process read) a lane refuses the read
    before posting anything, and the memory stays poison."""
    src, region, address = source
    rl = lanes(n_lanes, min_bytes=1)
    dst = poisoned(2 * 8 * 12288)
    runs, want = shuffled_blocks(src, region, dst, 8, 12288, seed=7)
    with pytest.raises(TransportError) as info:
        await rl.read(address, [(region.rkey, runs)], timeout=10)
    assert info.value.reason == "transfer_failed" and "on this host" in str(info.value)
    assert torch.equal(dst, poisoned(2 * 8 * 12288))
    await rl.read(address, [(region.rkey, runs)], timeout=10, same_host=True)
    assert torch.equal(dst, want)


@aio
async def test_a_read_cancelled_while_queued_behind_another_is_withdrawn_not_stuck(
        source, lanes):
    """The first lane runs one script at a time: a pull whose read waits behind another
    pull's and is cancelled meanwhile ends as cancelled at once (nothing of it ran, so
    nothing is quarantined), and its memory stays poison."""
    src, region, address = source
    rl = lanes(1)
    busy = threading.Event()
    rl._lanes[0].executor.submit(busy.wait, 10)  # another pull's script, still running
    dst = poisoned(4 * 12288)
    runs, _ = shuffled_blocks(src, region, dst, 2, 12288, seed=3)
    task = asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=20,
                                         same_host=True))
    await asyncio.sleep(0.1)
    task.cancel()
    t0 = time.perf_counter()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - t0 < 1.0 and rl.stuck_reads == 0
    busy.set()
    await asyncio.sleep(0.1)
    assert torch.equal(dst, poisoned(4 * 12288))


async def opened(rl: ReadLanes) -> None:
    """The lanes' first set opened, as a puller opens it when it is made."""
    for fut in rl.open(asyncio.get_running_loop()):
        await asyncio.wrap_future(fut)


def stall_reads_from(monkeypatch, stalled: bytes) -> threading.Event:
    """Reads from the source worker at ``stalled`` make no progress until the returned event
    is set (or their own bound or stop ends them): a source whose memory stops answering."""
    release = threading.Event()
    reading = read_lanes._Lane.reading

    def maybe_stalled(self, address, parts, timeout, stop, *args):
        if address == stalled:
            deadline = time.perf_counter() + timeout
            while not release.is_set():
                if stop.is_set() or time.perf_counter() >= deadline:
                    raise TimeoutError("stalled source")
                yield 0.001
        return (yield from reading(self, address, parts, timeout, stop, *args))

    monkeypatch.setattr(read_lanes._Lane, "reading", maybe_stalled)
    return release


@pytest.mark.parametrize("sets", [1, 3])
@aio
async def test_a_stalled_source_holds_one_lane_set_not_every_pull(source, second_worker,
                                                                  lanes, monkeypatch, sets):
    """A pull whose reads stall keeps its lane set; a pull from another source that waits
    behind it runs on the next set once the stalled one is past its due time, long before
    the stalled pull's own bound, bit for bit. With one set it waits for that bound."""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_DUE_S", 0.05)
    release = stall_reads_from(monkeypatch, second_worker)
    rl = lanes(2, min_bytes=1, sets=sets)
    await opened(rl)
    spills = read_lanes.lane_set_spills()
    stalled_dst = poisoned(2 * 8 * 4096)
    stalled_runs, stalled_want = shuffled_blocks(src, region, stalled_dst, 8, 4096, seed=41)
    stalled = asyncio.ensure_future(rl.read(second_worker, [(region.rkey, stalled_runs)],
                                            timeout=3, same_host=True))
    await until(lambda: rl._dispatch.sets[0].busy)
    dst = poisoned(2 * 64 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 64, 4096, seed=42)
    t0 = time.perf_counter()
    healthy = asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=1.5,
                                            same_host=True))
    try:
        if sets == 1:
            with pytest.raises(TransportError) as info:
                await healthy
            assert info.value.reason == "transfer_timeout"
            assert torch.equal(dst, poisoned(2 * 64 * 4096))
        else:
            await healthy
            assert time.perf_counter() - t0 < 1.0 and not stalled.done()
            assert torch.equal(dst, want)
            assert rl._dispatch.sets[0].busy and not rl._dispatch.sets[1].busy
            assert address not in lane_peers(rl, 0)  # (read on set 1, not set 0)
            assert list(rl._dispatch.sets[1].lanes[0]._peers) == [address]
            assert read_lanes.lane_set_spills() == spills + 1
    finally:
        release.set()
    await stalled  # released: it reads whole
    assert torch.equal(stalled_dst, stalled_want)


@aio
async def test_a_pull_waiting_for_a_lane_set_is_withdrawn_when_cancelled(
        source, second_worker, lanes, monkeypatch):
    """The only set busy with a stalled pull: a pull waiting for it and cancelled ends at
    once, nothing of it ran (its memory stays poison) and the next waiting pull keeps its
    place."""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_DUE_S", 0.01)
    release = stall_reads_from(monkeypatch, second_worker)
    rl = lanes(1, sets=1)
    held = [poisoned(4096)]  # (alive until the read ends)
    stalled = [asyncio.ensure_future(rl.read(second_worker, [(region.rkey, [
        (buf.data_ptr(), region.address, 4096)])], timeout=5, same_host=True)) for buf in held]
    await until(lambda: all(st.busy for st in rl._dispatch.sets))
    dsts = [poisoned(2 * 4 * 4096) for _ in range(2)]
    plans = [shuffled_blocks(src, region, d, 4, 4096, seed=50 + i) for i, d in enumerate(dsts)]
    waiting = [asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=5,
                                             same_host=True)) for runs, _ in plans]
    await asyncio.sleep(0.1)
    waiting[0].cancel()
    t0 = time.perf_counter()
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    assert time.perf_counter() - t0 < 0.5 and not waiting[1].done()
    release.set()
    await asyncio.gather(waiting[1], *stalled)
    assert torch.equal(dsts[0], poisoned(2 * 4 * 4096)) and torch.equal(dsts[1], plans[1][1])
    assert rl.stuck_reads == 0 and not any(st.busy for st in rl._dispatch.sets)
    assert all(torch.equal(buf, src[:4096]) for buf in held)


@aio
async def test_a_stalled_sources_later_pulls_wait_for_its_set_not_the_spares(
        source, second_worker, lanes, monkeypatch):
    """Three pulls from a stalled source: the first holds set 0 and the other two wait for
    it (they would stall any set they took), so a pull from another source behind them
    still finds a spare set; once the source answers, all four land bit for bit."""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_DUE_S", 0.05)
    release = stall_reads_from(monkeypatch, second_worker)
    rl = lanes(1, min_bytes=1, sets=3)
    await opened(rl)
    dsts = [poisoned(2 * 8 * 4096) for _ in range(4)]
    plans = [shuffled_blocks(src, region, d, 8, 4096, seed=70 + i) for i, d in enumerate(dsts)]
    stalled = [asyncio.ensure_future(rl.read(second_worker, [(region.rkey, runs)], timeout=5,
                                             same_host=True)) for runs, _ in plans[:3]]
    await until(lambda: rl._dispatch.sets[0].busy)
    try:
        await asyncio.sleep(0.2)  # set 0 overdue by now
        await asyncio.wait_for(rl.read(address, [(region.rkey, plans[3][0])], timeout=5,
                                       same_host=True), 2.5)
        assert torch.equal(dsts[3], plans[3][1])
        assert [st.busy for st in rl._dispatch.sets] == [True, False, False]
        assert not any(t.done() for t in stalled)
    finally:
        release.set()
    await asyncio.gather(*stalled)
    assert all(torch.equal(d, want) for d, (_, want) in zip(dsts, plans, strict=True))


@aio
async def test_a_same_host_source_holds_one_set_whatever_worker_addresses_it_announces(
        source, second_worker, lanes, monkeypatch):
    """Three pulls from one process on this host whose reads stall, each under another read
    worker address of its announcing: they wait for one set, keyed by the process (which it
    cannot vary), so a pull from another source still finds a spare set."""
    from kvkern.xfer import local_reads  # noqa: PLC0415

    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_DUE_S", 0.05)
    stalled_process = local_reads.LocalSource(pid=4242, at=0, token=b"t" * 16)
    monkeypatch.setattr(local_reads, "usable", lambda local: True)
    release = threading.Event()
    reading = read_lanes._Lane.reading

    def maybe_stalled(self, address, parts, timeout, stop, local=None, *args):
        if local is stalled_process:  # its memory stops answering, then reads nothing
            while not release.is_set():
                if stop.is_set():
                    raise TimeoutError("stalled source")
                yield 0.001
            return time.perf_counter()
        return (yield from reading(self, address, parts, timeout, stop, local, *args))

    monkeypatch.setattr(read_lanes._Lane, "reading", maybe_stalled)
    rl = lanes(1, min_bytes=1, sets=3)
    await opened(rl)
    dst = poisoned(2 * 8 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 8, 4096, seed=80)
    stalled = [asyncio.ensure_future(rl.read(announced, [(region.rkey, runs)], timeout=5,
                                             local=stalled_process, same_host=True))
               for announced in (address, second_worker, b"announced-3")]
    await until(lambda: rl._dispatch.sets[0].busy)
    try:
        await asyncio.sleep(0.2)  # set 0 overdue by now
        await asyncio.wait_for(rl.read(address, [(region.rkey, runs)], timeout=5,
                                       same_host=True), 2.5)
        assert torch.equal(dst, want)
        assert [st.busy for st in rl._dispatch.sets] == [True, False, False]
    finally:
        release.set()
    await asyncio.gather(*stalled)


@aio
async def test_a_stalled_sources_waiting_pull_arms_no_timer_beside_a_free_set(lanes,
                                                                             monkeypatch):
    """Set 1 overdue on a stalled source, set 0 free: a pull from that source waits for its
    set without the dispatcher re-running itself meanwhile (no timer: the release wakes it),
    then takes the set that frees first."""
    rl = lanes(1, sets=3)
    d = rl._dispatch
    runs = []
    real = d._dispatch
    monkeypatch.setattr(d, "_dispatch", lambda: runs.append(1) or real())
    stalled = d.sets[1]
    stalled.busy, stalled.source = True, b"S"
    stalled.since, stalled.due = time.perf_counter() - 1.0, 0.01
    task = asyncio.ensure_future(d.acquire(b"S", 0.05, 5.0))
    await asyncio.sleep(0.1)
    assert not task.done() and d._timer is None and len(runs) == 1
    d.release(stalled)
    got = await asyncio.wait_for(task, 1)
    assert got is d.sets[0] and got.source == b"S"
    d.release(got)


@aio
async def test_a_wait_for_a_set_cancelled_as_it_times_out_ends_cancelled(lanes):
    """A pull cancelled in the loop step in which its wait for a set times out ends
    cancelled (its caller asked for that), not as a timeout."""
    rl = lanes(1, sets=1)
    held = rl._dispatch.sets[0]
    held.busy, held.since, held.due = True, time.perf_counter(), 100.0  # another pull's
    try:
        task = asyncio.ensure_future(rl.read(b"x", [(b"k", [(0, 0, 1 << 20)])], timeout=30))
        await until(lambda: rl._dispatch._waiting)
        read_lanes._expire(rl._dispatch._waiting[0].fut, 30)  # the wait's timer fires ...
        task.cancel()  # ... and the pull is cancelled in the same step
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        rl._dispatch.release(held)


@aio
async def test_closing_the_lanes_fails_the_pulls_waiting_for_a_set(source, second_worker,
                                                                  lanes, monkeypatch):
    """A pull waiting for a set when the lanes close ends at once as ``closed`` (not at its
    own bound), with nothing read."""
    src, region, address = source
    release = stall_reads_from(monkeypatch, second_worker)
    rl = lanes(1, sets=1)
    held = poisoned(4096)
    stalled = asyncio.ensure_future(rl.read(second_worker, [(region.rkey, [
        (held.data_ptr(), region.address, 4096)])], timeout=10, same_host=True))
    await until(lambda: rl._dispatch.sets[0].busy)
    dst = poisoned(2 * 4 * 4096)
    runs, _ = shuffled_blocks(src, region, dst, 4, 4096, seed=80)
    waiting = asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=10,
                                            same_host=True))
    await until(lambda: rl._dispatch._waiting)
    closing = threading.Thread(target=rl.close)
    closing.start()
    t0 = time.perf_counter()
    with pytest.raises(TransportError) as info:
        await waiting
    assert info.value.reason == "closed" and time.perf_counter() - t0 < 2
    assert torch.equal(dst, poisoned(2 * 4 * 4096))
    release.set()
    with contextlib.suppress(TransportError):
        await stalled
    while closing.is_alive():
        await asyncio.sleep(0.01)


@aio
async def test_pulls_from_healthy_sources_run_in_turn_on_the_first_set(source, lanes,
                                                                       monkeypatch):
    """No source stalls: concurrent pulls run one after another on set 0 (the others' lanes
    never open), each bit for bit. (The due time is raised: on a loaded host a pull of these
    may take longer than the default's 50 ms.)"""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_DUE_S", 2.0)
    rl = lanes(2, min_bytes=1, sets=3)
    dsts = [poisoned(2 * 32 * 4096) for _ in range(6)]
    plans = [shuffled_blocks(src, region, d, 32, 4096, seed=60 + i) for i, d in enumerate(dsts)]
    spills = read_lanes.lane_set_spills()
    await asyncio.gather(*(rl.read(address, [(region.rkey, runs)], timeout=10, same_host=True)
                           for runs, _ in plans))
    assert all(torch.equal(d, want) for d, (_, want) in zip(dsts, plans, strict=True))
    assert not any(lane.opened for st in rl._dispatch.sets[1:] for lane in st.lanes)
    assert read_lanes.lane_set_spills() == spills


@aio
async def test_one_big_run_is_cut_between_lanes(source, lanes):
    """Nearly the whole region as one run at odd offsets: cut at page multiples between two
    lanes of at least 4 MiB each, reassembled exactly."""
    src, region, address = source
    rl = lanes(2, min_bytes=4 << 20)
    n = SRC_BYTES - 5 - 4091
    dst = poisoned(3 + n + 4096)
    await rl.read(address, [(region.rkey, [(dst.data_ptr() + 3, region.address + 5, n)])],
                  timeout=10, same_host=True)
    assert torch.equal(dst[3:3 + n], src[5:5 + n])
    assert bool((dst[:3] == POISON).all()) and bool((dst[3 + n:] == POISON).all())
    assert rl.peers == 2


@aio
async def test_small_reads_use_one_lane(source, lanes):
    src, region, address = source
    rl = lanes(2)  # 4 MiB per lane by default
    dst = poisoned(1 << 20)
    await rl.read(address, [(region.rkey, [(dst.data_ptr(), region.address, 1 << 20)])],
                  timeout=5, same_host=True)
    assert torch.equal(dst, src[:1 << 20]) and rl.peers == 1
    assert await rl.read(address, [], timeout=1, same_host=True) is None


@aio
async def test_small_reads_run_on_the_loop_lane(source, lanes, monkeypatch):
    """Reads of at most loop_bytes run on the event loop's thread through the loop lane's
    own endpoint, bit for bit; larger ones go to the lanes' threads; a second small read
    while the loop lane is busy takes the lanes' threads, and both land."""
    src, region, address = source
    where = []
    real_reading = read_lanes._Lane.reading

    def reading(self, *a):
        where.append((self.index, threading.get_ident()))
        return real_reading(self, *a)

    monkeypatch.setattr(read_lanes._Lane, "reading", reading)
    rl = lanes(2, min_bytes=1, loop_bytes=64 << 10)
    here = threading.get_ident()
    dst = poisoned(2 * 16 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 16, 4096, seed=3)
    first = await rl.read(address, [(region.rkey, runs)], timeout=5, same_host=True)  # 64 KiB
    assert first is not None and torch.equal(dst, want)
    assert where == [(-1, here)] and rl.peers == 1 and len(lane_peers(rl, -1)) == 1
    where.clear()
    dst = poisoned(2 * 17 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 17, 4096, seed=4)  # 68 KiB: the lanes
    await rl.read(address, [(region.rkey, runs)], timeout=5, same_host=True)
    assert torch.equal(dst, want)
    assert sorted(i for i, _ in where) == [0, 1] and all(t != here for _, t in where)
    # two at once: the first holds the loop lane (its polling held for a while)
    where.clear()
    made = []
    held = held_batch_class(made)

    def first_held(*args, **kw):  # (only the first batch's polling is held)
        batch = held(*args, **kw)
        batch.hold = len(made) == 1
        return batch

    monkeypatch.setattr(ucp_rma, "ReadBatch", first_held)
    a, b = poisoned(4096), poisoned(4096)
    slow = asyncio.ensure_future(rl.read(
        address, [(region.rkey, [(a.data_ptr(), region.address, 4096)])], timeout=5,
                                         same_host=True))
    await until(lambda: len(made) == 1)
    assert not slow.done() and where == [(-1, here)]
    asyncio.get_running_loop().call_later(0.01, setattr, made[0], "hold", False)
    await rl.read(address, [(region.rkey, [(b.data_ptr(), region.address + 4096, 4096)])],
                  timeout=5, same_host=True)
    await slow
    assert where[1][0] == 0 and where[1][1] != here
    assert torch.equal(a, src[:4096]) and torch.equal(b, src[4096:8192])


@aio
async def test_a_lane_keeps_at_most_max_peers_endpoints(source, second_worker, lanes, on,
                                                        monkeypatch):
    """Past MAX_PEERS source workers a lane closes its least recently used endpoint (and its
    keys) and opens it again when that worker is read next; every read is whole."""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "MAX_PEERS", 1)
    rl = lanes(1, **on)
    lane = -1 if on else 0
    for i, addr in enumerate([address, second_worker, address, address, second_worker]):
        dst = poisoned(2 * 8 * 4096)
        runs, want = shuffled_blocks(src, region, dst, 8, 4096, seed=20 + i)
        await rl.read(addr, [(region.rkey, runs)], timeout=5, same_host=True)
        assert torch.equal(dst, want)
        assert list(lane_peers(rl, lane)) == [addr] and rl.peers == 1


@aio
async def test_the_loop_lane_closes_on_its_loop_from_another_thread(source, lanes):
    """close() from another thread while the loop runs closes the loop lane's endpoint on
    the loop's thread; a closed ReadLanes refuses further reads."""
    src, region, address = source
    rl = lanes(1, loop_bytes=1 << 20)
    dst = poisoned(4096)
    await rl.read(address, [(region.rkey, [(dst.data_ptr(), region.address, 4096)])],
                  timeout=5, same_host=True)
    assert torch.equal(dst, src[:4096]) and len(lane_peers(rl, -1)) == 1
    closed_on = []
    real = rl._on_loop.close
    rl._on_loop.close = lambda: (closed_on.append(threading.get_ident()), real())
    await asyncio.to_thread(rl.close, 5.0)
    assert closed_on == [threading.get_ident()] and rl.peers == 0
    with pytest.raises(TransportError) as info:
        await rl.read(address, [(region.rkey, [])], timeout=1, same_host=True)
    assert info.value.reason == "closed"


@aio
async def test_a_close_while_the_loop_lane_reads_waits_for_its_script(source, lanes,
                                                                    monkeypatch):
    """close() while a read on the loop lane is between its polls: the read finishes on its
    open endpoint (every byte lands), then the lane closes; nothing is left open."""
    src, region, address = source
    made = []
    monkeypatch.setattr(ucp_rma, "ReadBatch", held_batch_class(made))
    rl = lanes(1, loop_bytes=1 << 20)
    dst = poisoned(2 * 64 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 64, 4096, seed=5)
    task = asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=10,
                                         same_host=True))
    await until(lambda: len(made) == 1)
    assert not task.done() and len(made) == 1 and rl.peers == 1
    await asyncio.to_thread(rl.close, 5.0)
    assert rl.peers == 1 and not task.done()  # the script's endpoint is still open
    made[0].hold = False
    await task
    assert torch.equal(dst, want) and rl.peers == 0 and rl.stuck_reads == 0


@aio
async def test_failed_read_closes_only_that_endpoint_and_names_the_status(source, lanes, on):
    """A read from an unmapped address fails (UCS_ERR_IO_ERROR through CMA): transfer_failed
    naming the status, that lane's endpoint closed; the next read reopens it and works."""
    src, region, address = source
    rl = lanes(1, **on)
    dst = poisoned(4096)
    ok = (dst.data_ptr(), region.address, 4096)
    await rl.read(address, [(region.rkey, [ok])], timeout=5, same_host=True)
    assert rl.peers == 1
    with pytest.raises(TransportError) as info:
        await rl.read(address, [(region.rkey, [(dst.data_ptr(), 4096, 4096)])], timeout=5,
                      same_host=True)
    assert info.value.reason == "transfer_failed" and "UCS_ERR" in str(info.value)
    assert isinstance(info.value.__cause__, ucp_rma.RmaError)
    assert rl.peers == 0
    dst.fill_(POISON)
    await rl.read(address, [(region.rkey, [ok])], timeout=5, same_host=True)
    assert torch.equal(dst, src[:4096]) and rl.peers == 1


@aio
async def test_timeout_is_transfer_timeout_closes_and_drains(source, lanes, monkeypatch, on):
    src, region, address = source
    made = []
    monkeypatch.setattr(ucp_rma, "ReadBatch", held_batch_class(made))
    rl = lanes(2, min_bytes=1, **on)
    dst = poisoned(2 * 64 * 4096)
    runs, _ = shuffled_blocks(src, region, dst, 64, 4096, seed=7)
    t0 = time.monotonic()
    with pytest.raises(TransportError) as info:
        await rl.read(address, [(region.rkey, runs)], timeout=0.05, same_host=True)
    assert info.value.reason == "transfer_timeout" and not isinstance(info.value, ReadsStuck)
    assert 0.04 < time.monotonic() - t0 < 2
    assert len(made) == (1 if on else 2) and not any(b.stuck for b in made)
    assert rl.peers == 0  # both endpoints closed
    monkeypatch.undo()
    dst.fill_(POISON)
    runs, want = shuffled_blocks(src, region, dst, 64, 4096, seed=7)
    await rl.read(address, [(region.rkey, runs)], timeout=5, same_host=True)
    assert torch.equal(dst, want)


@aio
async def test_timeout_with_copies_still_queued_drains(source, lanes, monkeypatch):
    """No held polling this time: a 32 MiB read over two lanes with a bound far shorter
    than its copy times out with real copies still queued in UCX; closing the endpoints
    cancels or finishes them (nothing stuck, no abort) and the next read is whole. The
    lanes copy in UCX's own 512 KiB segments here: with kvkern's 16 MiB ones a lane's share
    is copied whole within its post, before the bound is first checked."""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_UCX_CONFIG",
                        {**read_lanes.LANE_UCX_CONFIG, "CMA_SEG_SIZE": "512K"})
    rl = lanes(2, min_bytes=1)
    dst = poisoned(SRC_BYTES)
    parts = [(region.rkey, [(dst.data_ptr(), region.address, SRC_BYTES)])]
    for bound in (1e-4, 1e-3):
        with pytest.raises(TransportError) as info:
            await rl.read(address, parts, timeout=bound, same_host=True)
        assert info.value.reason == "transfer_timeout"
        assert rl.stuck_reads == 0 and rl.peers == 0
    dst.fill_(POISON)
    await rl.read(address, parts, timeout=10, same_host=True)
    assert torch.equal(dst, src)


def test_a_lane_context_takes_its_settings():
    """A lane's own UCP context gets LANE_UCX_CONFIG (16 MiB CMA segments, 64 copies per
    progress call), not the settings of ucxx's worker: a setting this UCX rejected would
    silently fall back to UCX's defaults, so the context's own configuration is checked."""
    config = read_lanes._lane_context().config
    assert (config.get("SEG_SIZE"), config.get("TX_QUOTA")) == ("16M", "64"), {
        k: v for k, v in config.items() if "SEG" in k or "QUOTA" in k}
    assert os.environ.get("UCX_CMA_SEG_SIZE") == "4M"  # ucxx's worker: kvkern.xfer.ucx_env


@aio
async def test_a_lane_setting_this_ucx_lacks_falls_back_to_defaults(source, lanes,
                                                                     monkeypatch):
    src, region, address = source
    monkeypatch.setattr(read_lanes, "LANE_UCX_CONFIG", {"NO_SUCH_SETTING": "1"})
    rl = lanes(1)
    dst = poisoned(8192)
    await rl.read(address, [(region.rkey, [(dst.data_ptr(), region.address, 8192)])],
                  timeout=5, same_host=True)
    assert torch.equal(dst, src[:8192])


@pytest.mark.parametrize("grace", [0.0, 30.0], ids=["stopped", "finished-in-grace"])
@aio
async def test_cancel(source, lanes, monkeypatch, grace):
    """A cancelled read raises CancelledError. With no grace the lanes are stopped: their
    endpoints closed, every request retired, nothing written afterwards. With a grace the
    reads finish, every byte lands and the endpoints stay open."""
    src, region, address = source
    monkeypatch.setattr(tuning, "READ_CANCEL_GRACE_S", grace)
    made = []
    if not grace:  # (else the copies are real and finish in the grace)
        monkeypatch.setattr(ucp_rma, "ReadBatch", held_batch_class(made))
    rl = lanes(2, min_bytes=1)
    dst = poisoned(2 * 256 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 256, 4096, seed=11)
    task = asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=20,
                                         same_host=True))
    if grace:
        await asyncio.sleep(0)
    else:  # (cancelled once both lanes' reads are posted and held)
        await until(lambda: len(made) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if grace:
        assert torch.equal(dst, want) and rl.peers == 2
    else:
        assert rl.peers == 0 and made and not any(b.stuck for b in made)
        snapshot = dst.clone()
        await asyncio.sleep(0.02)
        assert torch.equal(dst, snapshot)


@pytest.mark.parametrize("grace", [0.0, 30.0], ids=["stopped", "finished-in-grace"])
@aio
async def test_cancel_on_the_loop_lane(source, lanes, monkeypatch, grace):
    """The loop lane's reads run in the cancelled task itself, so a cancellation arrives at
    one of their pauses: the reads go on through the grace (here: they land once their
    polling is let go, and every byte is there) or, with none, are stopped (endpoint
    closed, every request retired, nothing written afterwards); CancelledError either way.
    Meanwhile the loop stays free: another task keeps running."""
    src, region, address = source
    monkeypatch.setattr(tuning, "READ_CANCEL_GRACE_S", grace)
    made = []
    monkeypatch.setattr(ucp_rma, "ReadBatch", held_batch_class(made))
    rl = lanes(2, min_bytes=1, loop_bytes=1 << 40)
    dst = poisoned(2 * 256 * 4096)
    runs, want = shuffled_blocks(src, region, dst, 256, 4096, seed=11)
    ticks = []

    async def ticker():
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    tick = asyncio.ensure_future(ticker())
    task = asyncio.ensure_future(rl.read(address, [(region.rkey, runs)], timeout=20,
                                         same_host=True))
    await until(lambda: len(made) == 1)
    assert not task.done() and len(made) == 1 and ticks
    task.cancel()
    if grace:
        await asyncio.sleep(0.005)
        assert not task.done()
        made[0].hold = False  # the reads complete within the grace
    with pytest.raises(asyncio.CancelledError):
        await task
    tick.cancel()
    assert not any(b.stuck for b in made)
    if grace:
        assert torch.equal(dst, want) and rl.peers == 1
    else:
        assert rl.peers == 0
        snapshot = dst.clone()
        await asyncio.sleep(0.02)
        assert torch.equal(dst, snapshot)


@aio
async def test_reads_outliving_the_close_raise_reads_stuck(source, lanes, monkeypatch, on):
    _, region, address = source

    monkeypatch.setattr(ucp_rma, "ReadBatch", NeverDone)
    monkeypatch.setattr(tuning, "READ_DRAIN_S", 0.05)
    rl = lanes(1, **on)
    with pytest.raises(ReadsStuck) as info:
        await rl.read(address, [(region.rkey, [(1, 2, 3)])], timeout=0.01, same_host=True)
    assert info.value.reason == "transfer_failed" and "still running" in str(info.value)
    assert rl.stuck_reads == 1


@aio
async def test_memory_the_engine_owns_is_read_through_ucx_without_a_same_host_source(
        source, lanes, monkeypatch, on):
    """``owned`` (a pull into the engine's blocks) with no same-host source, or one whose
    calls are refused: read through UCX, bit-exact, every other byte untouched."""
    from kvkern.xfer import local_reads
    from kvkern.xfer.local_reads import LocalSource

    src, region, address = source
    rl = lanes(2, min_bytes=1, **on)
    monkeypatch.setattr(local_reads, "usable", lambda src: False)
    for seed, local in enumerate((None, LocalSource(os.getppid(), 1, bytes(16)))):
        dst = poisoned(2 * 64 * 4096)
        runs, want = shuffled_blocks(src, region, dst, 64, 4096, seed=seed)
        await rl.read(address, [(region.rkey, runs)], timeout=5, local=local, owned=True,
                      same_host=True)
        assert torch.equal(dst, want)


class LateBatch(NeverDone):
    """A batch whose reads complete only once ``done`` is set: reads that outlive their
    endpoint's close and the drain, then end."""

    done = threading.Event()

    @property
    def stuck(self):
        return not self.done.is_set()

    def poll(self):
        return self.done.is_set()


@pytest.mark.parametrize("owned", [False, True], ids=["private", "engine"])
@aio
async def test_a_ucx_read_into_engine_memory_ends_only_after_its_reads(source, lanes,
                                                                        monkeypatch, on, owned):
    """UCX reads still running after their endpoint's forced close and the drain: into the
    puller's own blocks the read raises ReadsStuck at the drain's end (the memory is
    quarantined); into the engine's blocks (``owned``) it ends only once they have
    completed, however long after the drain, raising the timeout that stopped it."""
    _, region, address = source
    late = type("Late", (LateBatch,), {"done": threading.Event()})
    monkeypatch.setattr(ucp_rma, "ReadBatch", late)
    monkeypatch.setattr(tuning, "READ_DRAIN_S", 0.05)
    rl = lanes(1, **on)
    done_at = []
    past = read_lanes.reads_past_drain()

    def complete_later():
        time.sleep(0.5)  # 10 drains
        done_at.append(time.monotonic())
        late.done.set()

    threading.Thread(target=complete_later, daemon=True).start()
    if owned:
        with pytest.raises(TransportError) as info:
            await rl.read(address, [(region.rkey, [(1, 2, 3)])], timeout=0.01, owned=True,
                          same_host=True)
        assert info.value.reason == "transfer_timeout" and done_at
        assert rl.stuck_reads == 0
    else:
        with pytest.raises(ReadsStuck):
            await rl.read(address, [(region.rkey, [(1, 2, 3)])], timeout=0.01, same_host=True)
        assert not done_at and rl.stuck_reads == 1
        await until(lambda: bool(done_at))
    memory = "engine" if owned else "private"  # counted once, under its memory
    assert read_lanes.reads_past_drain() == dict(past, **{memory: past[memory] + 1})


@aio
async def test_reads_that_outlived_their_drain_are_named_and_retired_once_they_end(
        source, lanes, monkeypatch, on):
    """The ReadsStuck of reads outliving the drain names them (its ``outstanding``): while
    they run they stay their lane's, and nudging retires nothing; once they complete, a
    nudge has their lane retire them (on its own thread, or the loop lane on the loop) and
    they count as ended."""
    _, region, address = source
    late = type("Late", (LateBatch,), {"done": threading.Event()})
    monkeypatch.setattr(ucp_rma, "ReadBatch", late)
    monkeypatch.setattr(tuning, "READ_DRAIN_S", 0.05)
    rl = lanes(2, min_bytes=1, **on)
    with pytest.raises(ReadsStuck) as info:
        await rl.read(address, [(region.rkey, [(1, 2, 4096), (3, 4, 4096)])], timeout=0.01,
                      same_host=True)
    held = info.value.outstanding
    stuck = len(held.batches)
    assert stuck and rl.stuck_reads == stuck and not held.ended()
    held.nudge()
    await asyncio.sleep(0.05)
    assert rl.stuck_reads == stuck and not held.ended()
    late.done.set()
    held.nudge()
    await until(lambda: rl.stuck_reads == 0)
    assert held.ended()


@pytest.mark.parametrize("owned,cancels", [(False, 1), (True, 1), (True, 3)],
                         ids=["private", "engine", "engine-cancelled-thrice"])
@aio
async def test_a_cancelled_read_into_engine_memory_ends_after_its_call(lanes, monkeypatch,
                                                                      owned, cancels):
    """A same-host call that outlives the stop and the drain (a source whose memory stalls
    the call): a read into the puller's own blocks raises ReadsStuck at the drain's end (the
    blocks are quarantined); one into the engine's blocks (``owned``) is waited for
    until its call has returned, cancelled again or not (a deadline, then the request's
    abort), so no byte lands after the cancelled read has ended."""
    from kvkern.xfer import local_reads
    from kvkern.xfer.local_reads import LocalSource

    monkeypatch.setattr(tuning, "READ_CANCEL_GRACE_S", 0.0)
    monkeypatch.setattr(tuning, "READ_DRAIN_S", 0.05)
    monkeypatch.setattr(local_reads, "usable", lambda src: True)
    in_call, landed = threading.Event(), []

    def stalled_call(src, parts, deadline, stop):  # one call: it ignores the stop
        in_call.set()
        time.sleep(1.6)  # past READ_DRAIN_S + 1 s
        landed.append(time.monotonic())
        return None
        yield

    monkeypatch.setattr(local_reads, "reading", stalled_call)
    rl = lanes(1)
    task = asyncio.ensure_future(rl.read(b"unused", [(b"key", [(1, 2, 3)])], timeout=20,
                                         local=LocalSource(os.getppid(), 1, bytes(16)),
                                         owned=owned, same_host=True))
    await until(in_call.is_set)
    task.cancel()
    for _ in range(cancels - 1):  # again, past the grace and the drain
        await asyncio.sleep(0.4)
        task.cancel()
    if owned:
        with pytest.raises(asyncio.CancelledError):
            await task
        assert landed  # the call had returned when the read ended
    else:
        with pytest.raises(ReadsStuck):
            await task
        assert not landed  # the call was still running when the read ended
        await until(lambda: bool(landed))


@aio
async def test_remote_key_cache_is_bounded_between_reads(source, lanes, monkeypatch, on):
    """Keys are unpacked once per endpoint and kept; a read whose new keys would overflow
    the cache first destroys the cached ones (never a key a posted read uses), and a read
    with more distinct keys than the cache holds is refused."""
    src, region, address = source
    monkeypatch.setattr(read_lanes, "MAX_CACHED_RKEYS", 2)
    destroyed = []
    real = ucp_rma.RemoteKey.destroy
    monkeypatch.setattr(ucp_rma.RemoteKey, "destroy",
                        lambda self: (destroyed.append(self.handle), real(self)))
    keys = [region.rkey + bytes(i) for i in range(4)]  # one key, four spellings
    rl = lanes(1, **on)
    dst = poisoned(3 * 4096)

    def parts(ks):
        return [(k, [(dst.data_ptr() + i * 4096, region.address + i * 4096, 4096)])
                for i, k in enumerate(ks)]

    await rl.read(address, parts(keys[:2]), timeout=5, same_host=True)
    peer = next(iter(lane_peers(rl, -1 if on else 0).values()))
    assert len(peer.rkeys) == 2 and destroyed == []
    await rl.read(address, parts(keys[:2]), timeout=5,
                  same_host=True)  # cached: nothing unpacked again
    assert len(peer.rkeys) == 2 and destroyed == []
    await rl.read(address, parts([keys[2]]), timeout=5, same_host=True)
    assert len(destroyed) == 2 and list(peer.rkeys) == [keys[2]]
    with pytest.raises(TransportError, match="3 remote keys"):  # 3 new ones > 2
        await rl.read(address, parts([keys[0], keys[1], keys[3]]), timeout=5, same_host=True)
    assert torch.equal(dst[:4096], src[:4096])


@aio
async def test_closed_lanes_refuse(source, lanes):
    _, region, address = source
    rl = lanes(2)
    rl.close()
    rl.close()  # idempotent
    with pytest.raises(TransportError) as info:
        await rl.read(address, [(region.rkey, [])], timeout=1, same_host=True)
    assert info.value.reason == "closed"


@aio
async def test_closing_starts_no_thread_for_a_spare_set_never_used(source, lanes,
                                                                    monkeypatch):
    """Spare lane sets open on their first read: closing the lanes closes every lane that
    never ran anything where the close runs, starting none of their threads; a script
    handed to such a lane after the close is refused (and its pull fails as ``closed``)."""
    src, region, address = source
    rl = lanes(2, sets=3)
    dst = poisoned(2 * 4 * 4096)
    runs, _ = shuffled_blocks(src, region, dst, 4, 4096, seed=81)
    await rl.read(address, [(region.rkey, runs)], timeout=10, same_host=True)
    started = []
    start = threading.Thread.start

    def recording(thread):
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording)
    rl.close()
    assert not [name for name in started if "-set" in name], started
    spare = rl._dispatch.sets[1]
    assert not any(lane.started for lane in spare.lanes)
    assert rl._dispatch.sets[0].lanes[0].started  # (the read ran there: closed there)
    with pytest.raises(RuntimeError):  # (as a lane set's script meets it: mapped to closed)
        spare.lanes[0].submit(print)


def test_a_script_whose_other_lane_closed_reads_nothing_and_fails_closed(source, lanes):
    """A lane set's script that finds one of its other lanes closed unstarted (the lanes
    closing meanwhile) reads nothing, not even its own share, and fails as ``closed``."""
    src, region, address = source
    rl = lanes(2, min_bytes=4096)
    dst = poisoned(2 * 4 * 4096)
    runs, _ = shuffled_blocks(src, region, dst, 4, 4096, seed=82)
    lane_set = rl._dispatch.sets[0]
    assert lane_set.lanes[1].retire_unstarted()
    stop = threading.Event()
    with pytest.raises(TransportError) as info:
        read_lanes.run_blocking(rl._reading_all(
            lane_set.lanes, address, [(region.rkey, runs)], time.perf_counter() + 5, stop,
            same_host=True))
    assert info.value.reason == "closed" and stop.is_set()
    assert torch.equal(dst, poisoned(2 * 4 * 4096))


@aio
async def test_addresses_are_checked_before_ucx_sees_them(source, lanes, on):
    """libucp aborts the process on an address of an unknown version: such an address is
    refused before UCX sees it (the puller then streams); an address of
    the right version that names nobody fails the read, never the process."""
    _, region, address = source
    assert address_usable(address)
    wrong = bytes([address[0] ^ 0x0F]) + address[1:]
    assert not address_usable(wrong) and not address_usable(b"")
    assert not address_usable(address + bytes(read_lanes.MAX_WORKER_ADDRESS_BYTES))
    rl = lanes(1, **on)
    dst = poisoned(4096)
    runs = [(dst.data_ptr(), region.address, 4096)]
    with pytest.raises(TransportError) as info:
        await rl.read(wrong, [(region.rkey, runs)], timeout=2, same_host=True)
    assert info.value.reason == "transfer_failed" and "unusable" in str(info.value)
    broken = address[:1] + bytes(len(address) - 1)
    with pytest.raises(TransportError):
        await rl.read(broken, [(region.rkey, runs)], timeout=2, same_host=True)
    assert bool((dst == POISON).all()) and rl.peers == 0


def test_lanes_arguments():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            ReadLanes(bad)


@pytest.mark.timeout(60)
def test_a_source_process_that_dies_fails_the_read_not_the_reader(tmp_path):
    """Lanes reading from another process: a read works, then that process is killed and
    the next read fails (transfer_failed) within its bound; the reader lives on."""
    script = tmp_path / "reader.py"
    script.write_text(_READER)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=50, env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.split()
    assert [line for line in lines if "read" in line] == [
        "read-ok", "killed-read-failed", "killed-read-failed"], out.stdout + out.stderr


_READER = r'''
import asyncio, multiprocessing as mp, os, sys, time
import numpy as np

def serve(q, stop):
    from kvkern.xfer import ucp_rma
    from kvkern.xfer.transport import Listener
    from kvkern.xfer.ucxcompat import read_target
    async def main():
        async def hold(conn):
            await asyncio.sleep(60)
        async with Listener(hold):
            buf = np.arange(8 << 20, dtype=np.uint8)
            reg = ucp_rma.Region(buf.ctypes.data, buf.nbytes)
            q.put((read_target().address, reg.rkey,
                   buf.ctypes.data))
            while not stop.is_set():
                await asyncio.sleep(0.02)
    asyncio.run(main())

async def main():
    from kvkern.xfer.read_lanes import ReadLanes
    from kvkern.xfer.transport import Listener, TransportError
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=serve, args=(q, stop), daemon=True)
    p.start()
    address, rkey, base = q.get(timeout=30)
    async def hold(conn):
        await asyncio.sleep(60)
    async with Listener(hold):  # this process's worker progresses too
        lanes = ReadLanes(2, min_bytes=1 << 20, loop_bytes=64 << 10)
        dst = np.zeros(8 << 20, dtype=np.uint8)
        parts = [(rkey, [(dst.ctypes.data, base, dst.nbytes)])]
        small = [(rkey, [(dst.ctypes.data, base, 64 << 10)])]  # on the loop lane
        await lanes.read(address, parts, timeout=10, same_host=True)
        assert (dst == np.arange(8 << 20, dtype=np.uint8)).all()
        dst[:] = 0
        await lanes.read(address, small, timeout=10, same_host=True)
        assert (dst[:64 << 10] == np.arange(64 << 10, dtype=np.uint8)).all()
        print("read-ok", flush=True)
        p.kill()
        p.join(10)
        for what in (parts, small):
            t0 = time.monotonic()
            try:
                await lanes.read(address, what, timeout=10, same_host=True)
                print("killed-read-succeeded", flush=True)
            except TransportError as exc:
                assert time.monotonic() - t0 < 10, exc
                print("killed-read-failed", exc.reason, flush=True)
        lanes.close()
    os._exit(0)  # (ucxx's notifier thread would hold the interpreter at exit)

if __name__ == "__main__":
    asyncio.run(main())
'''


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.tuples(st.booleans(), st.integers(1, 1 << 22)), max_size=12),
       n=st.integers(1, 4), min_bytes=st.sampled_from([0, 4096, 1 << 20]))
def test_split_never_cuts_a_scattered_read(sizes, n, min_bytes):
    """A Scatter is one read: it lands whole in one share, in order with the plain runs
    around it, and every byte still lands once."""
    import numpy as np  # noqa: PLC0415

    runs = []
    for i, (scattered, nb) in enumerate(sizes):
        at = i << 30
        runs.append(ucp_rma.Scatter(np.asarray([[at, nb]], np.uint64), at, nb) if scattered
                    else (at, at, nb))
    shares = split_parts([(b"k", runs)], n, min_bytes=min_bytes)
    out = [run for share in shares for _, rs in share for run in rs]
    whole = [r for r in out if type(r) is ucp_rma.Scatter]
    assert whole == [r for r in runs if type(r) is ucp_rma.Scatter]
    assert sum(r[2] for r in out) == sum(nb for _, nb in sizes)
    _assert_tiles(list(ucp_rma.expand(out)), runs)


def _assert_tiles(pieces, runs):
    """``pieces`` (plain runs cut from ``runs``) tile ``runs`` in order."""
    it = iter(pieces)
    for lo, re, nb in ucp_rma.expand(runs):
        off = 0
        while off < nb:
            plo, pre, pnb = next(it)
            assert (plo, pre) == (lo + off, re + off) and pnb <= nb - off
            off += pnb
    assert next(it, None) is None


# ------------------------------------------------------------------- the dispatcher


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


ops_st = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from([b"A", b"B", b"C"]),
              st.sampled_from([0.01, 0.05, 1.0])),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
    st.tuples(st.just("advance"), st.sampled_from([0.005, 0.02, 0.1, 2.0]))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, n_sets=st.integers(1, 3))
def test_the_dispatcher_never_shares_a_set_nor_leaves_a_pull_waiting_for_a_set_it_may_take(
        ops, n_sets):
    """Random pulls, releases, cancellations and the passing of time against the lane-set
    dispatcher alone (no lanes run): no set is ever held twice, every busy set has exactly
    one holder, and after each step no pull waits while a set it may take is free, unless a
    dispatch is due (the timer armed for when the set it waits behind becomes overdue)."""
    clock = _Clock()

    async def main() -> None:
        d = read_lanes._Dispatch(n_sets, 1)
        held: list[read_lanes._LaneSet] = []
        waiting: list[asyncio.Task] = []

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)
            for t in list(waiting):
                if t.done():
                    waiting.remove(t)
                    if not t.cancelled() and t.exception() is None:
                        held.append(t.result())
                        got = t.result()
                        k = d.sets.index(got)  # handed out past overdue sets only ...
                        assert all(p.overdue(clock.now) for p in d.sets[:k]), k
                        assert got.source not in {  # ... never to a stalled source's pull
                            p.source for p in d.sets if p is not got and p.overdue(clock.now)}

        for op in ops:
            if op[0] == "acquire":
                waiting.append(asyncio.ensure_future(d.acquire(op[1], op[2], 1e6)))
            elif op[0] == "release" and held:
                d.release(held.pop(op[1] % len(held)))
            elif op[0] == "cancel" and waiting:
                waiting[op[1] % len(waiting)].cancel()
            elif op[0] == "advance":
                clock.now += op[1]
                if d._timer is not None:  # a timer due by the fake clock fires
                    d._dispatch()
            await settle()
            assert len({id(s) for s in held}) == len(held)
            assert sorted(id(s) for s in held) == sorted(id(s) for s in d.sets if s.busy)
            stalled = {s.source for s in d.sets if s.overdue(clock.now)}
            eligible = [w for w in d._waiting if not w.fut.done() and w.source not in stalled]
            takeable = next((s for i, s in enumerate(d.sets) if not s.busy and all(
                clock.now - p.since > p.due for p in d.sets[:i])), None)
            if eligible and takeable is not None:
                raise AssertionError("a pull waits while a set it may take is free")
            if eligible and d._timer is None:
                assert not any(not s.busy for s in d.sets), "no dispatch is due"
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(read_lanes, "time", clock)
        mp.setattr(read_lanes, "LANE_OPEN_S", 0.0)
        asyncio.run(main())


@aio
async def test_a_spill_counts_a_script_that_holds_the_spare_set_not_one_cancelled_first():
    """``lane_set_spills`` counts scripts that ran on a spare set: a wait handed a spare set
    and cancelled in the same loop step gives it back uncounted."""
    d = read_lanes._Dispatch(2, 1)
    first = await d.acquire(b"a", 0.0, 1.0)  # due at once: overdue from the next instant
    await asyncio.sleep(0.002)
    spills = read_lanes.lane_set_spills()
    spare = await d.acquire(b"b", 10.0, 1.0)
    assert spare is d.sets[1] and read_lanes.lane_set_spills() == spills + 1
    waiting = asyncio.ensure_future(d.acquire(b"c", 10.0, 1.0))
    await until(lambda: d._waiting)
    d.release(spare)  # handed to the waiting script's future ...
    assert d._waiting == [] and d.sets[1].busy
    waiting.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not d.sets[1].busy and read_lanes.lane_set_spills() == spills + 1
    d.release(first)
