"""The pull path's control logic on the in-memory transport (:mod:`kvkern.xfer.memtransport`):
admission, de-duplication, policies, leases, cancels and fallback reasons, for streams and
for one-sided reads (grants, read holds, ReadDone/ReadAck), in milliseconds and without a
process or a socket. The real-process tests (test_pull.py) cover UCXX."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

import kvkern.xfer.endpoint as endpoint_mod
from kvkern.cache.hashing import sequence_hashes
from kvkern.cache.pool import BlockPool
from kvkern.kernels.pack import pack, unpack
from kvkern.layout.kv_layout import allocate_staging
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer.config import XferConfig
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.memtransport import MemoryConnector, MemorySource
from kvkern.xfer.outcome import Reason
from kvkern.xfer.puller import Puller
from kvkern.xfer.runtime import EventLoopThread

BS = 4
MODEL = ModelKVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float16")
TOPO = Topology(model=MODEL, parallel=Parallelism())
ADDR = ("127.0.0.1", 5000)
HINT = {"kv_hint": {"source": "http://127.0.0.1:8000/kvkern/v1/state"}}


def make_group(num_blocks: int = 64) -> KVGroup:
    lay = TOPO.local_layout(0, num_blocks, "trtllm")
    return KVGroup(TOPO, 0, BlockPool(num_blocks, block_size=BS),
                   {0: RankKV(0, lay, lay.allocate(fill="zeros"))})


def commit(group: KVGroup, tokens: list[int], seed: int = 0) -> list[int]:
    """Cache ``tokens``' full blocks in ``group`` with random KV; their hashes."""
    pool, rkv = group.manager, group.ranks[0]
    hs = sequence_hashes(tokens, BS)
    ids = pool.allocate(len(hs))
    staging = allocate_staging(rkv.layout, len(ids))
    raw = torch.randint(0, 256, (staging.numel() * staging.element_size(),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    staging.view(-1).view(torch.uint8).copy_(raw)
    unpack(staging, rkv.pool, rkv.layout, ids)
    pool.commit(ids, hs)
    pool.release(ids)
    return hs


@pytest.fixture(scope="module")
def loop():
    lp = EventLoopThread("memory-pull")
    yield lp
    lp.close()


@pytest.fixture
def fleet(loop, monkeypatch):
    src = MemorySource(make_group())

    async def fake_fetch(resolved, **kw):
        return src.state_body(*ADDR)

    monkeypatch.setattr(endpoint_mod, "fetch_state", fake_fetch)
    pullers = []

    def make(**kw):
        cfg = XferConfig(allowlist="127.0.0.1", cost_guard=False, transfer_timeout_s=0.3,
                         deadline_s=2.0, **kw)
        p = Puller(make_group(), config=cfg, loop=loop, pool=MemoryConnector({ADDR: src}))
        pullers.append(p)
        return p

    yield src, make
    for p in pullers:
        p.close()


def tokens(n_blocks: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n_blocks * BS)]


def same_bytes(src: MemorySource, dst: KVGroup, hashes: list[int], ids: list[int]) -> bool:
    a, b = src.group.ranks[0], dst.ranks[0]
    want = pack(a.pool, a.layout, src.group.manager.match_prefix(hashes))
    return torch.equal(want.view(torch.int16), pack(b.pool, b.layout, ids).view(torch.int16))


def test_a_pull_lands_the_source_bytes_and_is_claimed(fleet):
    src, make = fleet
    toks = tokens(6, 1)
    hs = commit(src.group, toks)
    p = make()
    t0 = time.perf_counter()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == 6, o
    assert time.perf_counter() - t0 < 1.0
    ids = p.claim("r")
    assert ids is not None and same_bytes(src, p.group, hs, ids)
    assert p.claim("r") is None  # a lease is claimed once
    p.group.manager.release(ids)
    p.group.manager.check_invariants()
    assert src.pins_outstanding == 0


def test_an_identical_pull_attaches_to_the_first(fleet):
    src, make = fleet
    toks = tokens(4, 2)
    commit(src.group, toks)
    src.faults.delay_s = 0.05
    p = make()
    p.submit("first", toks, HINT)
    p.submit("second", toks, HINT)
    first, second = p.result("first", 5), p.result("second", 5)
    assert first.reason is Reason.OK and second.reason is Reason.DUPLICATE, (first, second)
    assert second.blocks_local == 4 and len(src.requests) == 1
    assert p.release("first")


def test_an_identical_pull_due_sooner_than_the_request_does_not_hold_it(fleet):
    """A request whose identical pull in flight ends much sooner than it must (a shorter
    deadline, or the same deadline started long before) pulls itself, and later identical
    requests attach to its pull: the first pull's deadline ending it does not end a request
    that had time for its own."""
    src, make = fleet
    toks = tokens(4, 3)
    commit(src.group, toks)
    src.faults.delay_s = 0.4
    p = make()
    short = {"kv_hint": dict(HINT["kv_hint"], deadline_s=0.2)}
    p.submit("short", toks, short)
    p.submit("long", toks, HINT)
    p.submit("third", toks, HINT)
    short_o, long_o, third = p.result("short", 5), p.result("long", 5), p.result("third", 5)
    assert short_o.reason is Reason.DEADLINE_EXCEEDED, short_o
    assert long_o.used and long_o.reason is Reason.OK, long_o
    assert third.reason is Reason.DUPLICATE and third.blocks_local == 4, third
    sent = [r.request_id for r in src.requests]
    assert sent.count("long") == 1 and "third" not in sent, sent
    assert p.release("long")
    # the same stated deadline, the first pull started long before: its source never answers
    toks = tokens(4, 4)
    commit(src.group, toks)
    src.faults.delay_s, src.faults.drop = 0.0, True
    same = {"kv_hint": dict(HINT["kv_hint"], deadline_s=1.0, transfer_timeout_s=1.0)}
    p.submit("early", toks, same)
    time.sleep(0.8)
    src.faults.drop = False  # the source answers again
    p.submit("late", toks, same)  # 1 s from now: the early pull has 0.2 s left
    early, late = p.result("early", 5), p.result("late", 5)
    assert early.reason is Reason.DEADLINE_EXCEEDED, early
    assert late.used and late.reason is Reason.OK, late
    assert p.release("late")


@pytest.mark.parametrize("follower_stays", [True, False])
def test_a_cancelled_leader_goes_on_for_the_requests_still_attached_to_it(fleet,
                                                                       follower_stays):
    """Cancelling the request that leads a de-duplicated pull detaches it: the pull goes on
    for the identical request attached to it, whose engine then finds the blocks cached,
    and the cancelled request holds no lease; once that request is cancelled too, the pull
    is."""
    src, make = fleet
    toks = tokens(4, 34)
    commit(src.group, toks)
    src.faults.delay_s = 0.2 if follower_stays else 0.5
    p = make()
    p.submit("lead", toks, HINT)
    p.submit("follow", toks, HINT)
    time.sleep(0.05)
    assert p.cancel("lead") and (follower_stays or p.cancel("follow"))
    lead, follow = p.result("lead", 5), p.result("follow", 5)
    if follower_stays:
        assert lead.used and follow.reason is Reason.DUPLICATE and follow.blocks_local == 4
        assert p.group.manager.longest_prefix(sequence_hashes(toks, BS)) == 4
    else:
        assert lead.reason is Reason.CANCELLED and follow.reason is Reason.CANCELLED
        assert p.group.manager.num_free == p.group.manager.num_blocks
    assert p.claim("lead") is None and p.group.manager.num_leased == 0


def test_an_outcome_is_delivered_when_counting_it_fails(fleet, monkeypatch):
    from kvkern.xfer import puller as puller_mod
    from kvkern.xfer.metrics import XferMetrics

    src, make = fleet
    toks = tokens(2, 36)
    commit(src.group, toks)
    p = make()
    p.metrics = XferMetrics()

    def broken(*_):
        raise RuntimeError("a metrics backend that fails")

    monkeypatch.setattr(puller_mod, "_count", broken)
    with pytest.raises(RuntimeError):  # (the submitting thread counts its own refusal)
        p.submit("skip", toks, {"kv_hint": {"source": "not a url"}})
    assert p.result("skip", 1).used is False
    p.submit("r", toks, HINT)
    assert p.result("r", 5).used  # (counted on the loop thread, which logs the error)
    p.release("r")


def test_the_concurrency_cap_answers_busy(fleet):
    src, make = fleet
    a, b = tokens(3, 3), tokens(3, 4)
    commit(src.group, a)
    commit(src.group, b, seed=1)
    src.faults.delay_s = 0.05
    p = make(max_inflight_pulls=1)
    p.submit("a", a, HINT)
    p.submit("b", b, HINT)
    assert p.result("b", 5).reason is Reason.BUSY
    assert p.result("a", 5).reason is Reason.OK


def test_a_source_whose_pulls_stall_leaves_a_slot_to_the_others(fleet):
    """With max_inflight_per_source, one source holds at most that many of the puller's
    slots: while its pulls stall, a pull from another source still runs."""
    src, make = fleet
    slow = [tokens(2, 40 + i) for i in range(3)]
    for i, t in enumerate(slow):
        commit(src.group, t, seed=i)
    other = tokens(2, 45)
    commit(src.group, other, seed=5)
    src.faults.delay_s = 0.3
    assert make(max_inflight_pulls=3).config.per_source_pulls == 3  # (no share by default)
    p = make(max_inflight_pulls=3, max_inflight_per_source=2)
    for i, t in enumerate(slow):
        p.submit(f"slow{i}", t, HINT)
    assert p.result("slow2", 5).reason is Reason.BUSY
    assert "max_inflight_per_source 2" in p.outcome("slow2").detail
    elsewhere = {"kv_hint": {"source": "http://127.0.0.1:8001/kvkern/v1/state"}}
    p.submit("other", other, elsewhere)
    assert p.result("other", 5).reason is Reason.OK
    assert all(p.result(f"slow{i}", 5).used for i in range(2))
    for rid in ("slow0", "slow1", "other"):
        p.release(rid)


@pytest.mark.parametrize("policy,reason,kept", [("strict", Reason.SOURCE_MISS, 0),
                                                ("best_effort", Reason.PARTIAL, 3)])
def test_policies_on_a_source_short_of_blocks(fleet, policy, reason, kept):
    src, make = fleet
    toks = tokens(5, 5)
    commit(src.group, toks[:3 * BS])
    p = make(default_policy=policy)
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is reason and o.blocks_transferred == kept, o
    p.release("r")  # the kept blocks stay cached (and evictable)
    p.group.manager.check_invariants()
    assert p.group.manager.longest_prefix(sequence_hashes(toks, BS)) == kept
    assert p.group.manager.num_free == p.group.manager.num_blocks


@pytest.mark.parametrize("fault,value,reason", [
    ("drop", True, Reason.TRANSFER_TIMEOUT),
    ("stall_after", 0, Reason.TRANSFER_TIMEOUT),
    ("corrupt", "hashes", Reason.HASH_MISMATCH),
    ("disconnect", "request", Reason.TRANSFER_FAILED),
    ("disconnect", "stream", Reason.TRANSFER_FAILED),
    ("disconnect", "connect", Reason.TRANSFER_FAILED),
])
def test_faults_fall_back_with_their_reason_and_free_every_block(fleet, fault, value, reason):
    src, make = fleet
    toks = tokens(4, 6)
    commit(src.group, toks)
    setattr(src.faults, fault, value)
    p = make(chunk_bytes=1024, chunks_in_flight=2)
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert not o.used and o.reason is reason, o
    p.group.manager.check_invariants()
    assert p.group.manager.num_free == p.group.manager.num_blocks
    assert src.pins_outstanding == 0


def test_a_cancel_ends_the_pull_and_tells_the_source(fleet):
    src, make = fleet
    toks = tokens(4, 7)
    commit(src.group, toks)
    src.faults.delay_s = 0.2
    p = make()
    p.submit("r", toks, HINT)
    time.sleep(0.05)
    assert p.cancel("r")
    o = p.result("r", 5)
    assert o.reason is Reason.CANCELLED, o
    assert p.group.manager.num_free == p.group.manager.num_blocks
    deadline = time.monotonic() + 2
    while not src.cancels and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.reason for c in src.cancels] == ["cancelled"]


def test_a_request_id_being_admitted_is_not_submitted_twice(fleet, monkeypatch):
    """Two engine threads submit one request id: while the first thread still admits its
    hint, the second is refused (otherwise it replaced the first's record, and the lease
    of the first's pull was out of every claim's and close's reach)."""
    import threading

    from kvkern.xfer import puller as puller_mod

    src, make = fleet
    a, b = tokens(3, 11), tokens(3, 12)
    commit(src.group, a)
    commit(src.group, b, seed=1)
    p = make()
    real, gate, inside = puller_mod.read_hint, threading.Event(), threading.Event()

    def slow_read_hint(hint, limits):
        if threading.current_thread().name == "A":
            inside.set()
            gate.wait(5)  # (thread A descheduled inside its admission)
        return real(hint, limits)

    monkeypatch.setattr(puller_mod, "read_hint", slow_read_hint)
    out: dict = {}

    def submit(name: str, toks: list[int]) -> None:
        try:
            out[name] = p.submit("dup", toks, HINT)
        except ValueError as exc:
            out[name] = exc

    first = threading.Thread(target=submit, args=("A", a), name="A")
    first.start()
    assert inside.wait(5)
    submit("B", b)
    gate.set()
    first.join()
    assert isinstance(out["B"], ValueError) and "being admitted" in str(out["B"])
    assert p.result("dup", 5).reason is Reason.OK
    ids = p.claim("dup")
    assert ids is not None
    p.group.manager.release(ids)
    assert p.group.manager.num_leased == 0


def test_close_survives_a_pull_ending_while_it_cancels(fleet, monkeypatch):
    """close() snapshots the running pulls, then cancels them: a pull that ends between
    the two (its future cleared by the loop thread) is no error, and close still releases
    every lease and closes what it owns."""
    import threading

    from kvkern.xfer import puller as puller_mod
    from kvkern.xfer.pulljob import PullRecord

    pause = threading.Event()

    class SlowToCancel(PullRecord):  # close()'s thread descheduled while it cancels
        @property
        def cancel_requested(self):
            return self.__dict__.get("_cancel", False)

        @cancel_requested.setter
        def cancel_requested(self, value):
            if value and pause.is_set() and threading.current_thread().name == "closer":
                time.sleep(0.3)
            self.__dict__["_cancel"] = value

    monkeypatch.setattr(puller_mod, "PullRecord", SlowToCancel)
    src, make = fleet
    toks = [tokens(3, s) for s in range(21, 25)]
    for i, t in enumerate(toks):
        commit(src.group, t, seed=i)
    src.faults.delay_s = 0.15
    p = make()
    for i, t in enumerate(toks):
        p.submit(f"r{i}", t, HINT)
    time.sleep(0.05)
    pause.set()
    errors: list = []

    def close() -> None:
        try:
            p.close()
        except Exception as exc:  # noqa: BLE001 (the defect this test keeps out)
            errors.append(exc)

    closer = threading.Thread(target=close, name="closer")
    closer.start()
    closer.join(10)
    assert not errors and p.group.manager.num_leased == 0
    assert p._reads.lanes is None


def _submitting_slowly(p: Puller, monkeypatch, toks: list[int]):
    """``p.submit("r", toks)`` on a thread descheduled for 0.2 s between handing the pull
    to the loop and publishing its future; returns the thread, started."""
    import threading

    real = p._loop.submit

    def slow(coro):
        fut = real(coro)
        time.sleep(0.2)
        return fut

    monkeypatch.setattr(p._loop, "submit", slow)
    t = threading.Thread(target=p.submit, args=("r", toks, HINT))
    t.start()
    time.sleep(0.1)
    assert not p.is_schedulable("r")
    return t


@pytest.mark.parametrize("started", [True, False], ids=["pull_started", "pull_not_started"])
def test_a_cancel_while_submit_still_schedules_the_pull_cancels_it(fleet, monkeypatch,
                                                                  started):
    """A cancel that comes while an engine thread's submit is still scheduling the pull:
    the pull has started (its future is cancelled once published) or has not (the loop is
    busy: it ends at its start); either way it ends ``cancelled``."""
    src, make = fleet
    toks = tokens(4, 31)
    commit(src.group, toks)
    src.faults.delay_s = 0.3 if started else 0.0
    p = make()
    if not started:
        p._loop.call_soon(time.sleep, 0.4)  # (the loop runs nothing else meanwhile)
    t = _submitting_slowly(p, monkeypatch, toks)
    assert p.cancel("r")
    t.join(5)
    o = p.result("r", 5)
    assert o.reason is Reason.CANCELLED and not o.used, o
    assert p.group.manager.num_leased == 0
    assert p.group.manager.num_free == p.group.manager.num_blocks


def test_close_while_submit_still_schedules_a_pull_ends_it_first(fleet, monkeypatch):
    src, make = fleet
    toks = tokens(4, 32)
    commit(src.group, toks)
    src.faults.delay_s = 0.3
    p = make()
    t = _submitting_slowly(p, monkeypatch, toks)
    p.close()
    assert p.result("r", 0).reason is Reason.CANCELLED  # (delivered before close returned)
    t.join(5)
    assert p.group.manager.num_leased == 0 and src.pins_outstanding == 0


def test_one_long_pull_does_not_stop_the_records_from_being_trimmed(fleet):
    """max_tracked_requests bounds the records while a pull older than all of them still
    runs: the running one is kept, the finished ones beyond the bound go."""
    src, make = fleet
    toks = tokens(4, 33)
    commit(src.group, toks)
    src.faults.delay_s = 0.5
    p = make(max_tracked_requests=8)
    p.submit("slow", toks, HINT)
    for i in range(50):  # requests without a hint: each leaves a record
        p.submit(f"plain{i}", tokens(1, 100 + i), {})
    assert len(p._records) == 8 and "slow" in p._records and "plain49" in p._records
    assert p.result("slow", 5).used
    p.release("slow")


def test_a_rejected_request_names_the_source_code(fleet):
    src, make = fleet
    toks = tokens(3, 8)
    commit(src.group, toks)
    body = src.state_body(*ADDR)  # names our model ("")
    src.state_body = lambda *a: body
    object.__setattr__(src.group, "model_id", "another-model")  # the source now holds another
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is Reason.INCOMPATIBLE_MODEL and len(src.requests) == 1, o
    assert "incompatible_model" in o.detail


# ------------------------------------------------------------------ one-sided reads


@pytest.fixture
def reading(fleet):
    """The fleet's source made a reading one (its pool registered for one-sided reads)."""
    src, make = fleet
    src.__init__(src.group, remote_read=True)
    return src, make


def wait_unpinned(src: MemorySource, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while src.pins_outstanding and time.monotonic() < deadline:
        time.sleep(0.005)
    assert src.pins_outstanding == 0


def test_a_read_pull_lands_the_source_bytes_inside_the_hold(reading):
    src, make = reading
    toks = tokens(5, 11)
    hs = commit(src.group, toks)
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == 5, o
    assert o.reads >= 1 and src.requests[0].read, o
    ids = p.claim("r")
    assert ids is not None and same_bytes(src, p.group, hs, ids)
    wait_unpinned(src)  # the background ReadDone, asking for no ack: read inside the hold
    assert [d.ack for d in src.read_dones] == [False]
    p.group.manager.release(ids)
    p.group.manager.check_invariants()


def test_a_source_granting_no_hold_is_asked_to_confirm(reading):
    src, make = reading
    src.read_hold_s = 0.0
    toks = tokens(3, 12)
    hs = commit(src.group, toks)
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is Reason.OK and o.messages == 4, o  # request, grant, ReadDone, ReadAck
    assert [d.ack for d in src.read_dones] == [True] and src.pins_outstanding == 0
    ids = p.claim("r")
    assert ids is not None and same_bytes(src, p.group, hs, ids)


def test_reads_after_the_hold_expired_are_not_committed(reading):
    src, make = reading
    src.read_hold_s = 0.02
    src.faults.delay_s = 0.05  # the grant arrives after its hold ended: the pins are gone
    toks = tokens(3, 13)
    commit(src.group, toks)
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is Reason.TRANSFER_FAILED and "did not confirm" in o.detail, o
    assert [d.ack for d in src.read_dones] == [True] and src.pins_outstanding == 0
    assert p.group.manager.num_free == p.group.manager.num_blocks
    assert p.group.manager.longest_prefix(sequence_hashes(toks, BS)) == 0


@pytest.mark.parametrize("fault,value,reason", [
    ("drop", True, Reason.TRANSFER_TIMEOUT),
    ("stall_after", 0, Reason.TRANSFER_TIMEOUT),
    ("corrupt", "hashes", Reason.HASH_MISMATCH),
    ("disconnect", "read", Reason.TRANSFER_FAILED),
])
def test_read_faults_fall_back_with_their_reason_and_release_everything(reading, fault,
                                                                        value, reason):
    src, make = reading
    toks = tokens(4, 14)
    commit(src.group, toks)
    setattr(src.faults, fault, value)
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert not o.used and o.reason is reason, o
    assert src.requests[0].read
    p.group.manager.check_invariants()
    assert p.group.manager.num_free == p.group.manager.num_blocks
    wait_unpinned(src)  # by Cancel, or by the aborted connection


def test_a_read_that_fails_gives_up_its_grant_and_streams_the_pair(reading):
    """A read that fails (here: the grant's key is not the pool's) costs no pull: the grant
    is cancelled and the same pull asks for the pair again as a stream."""
    src, make = reading
    toks = tokens(4, 16)
    commit(src.group, toks)
    src.faults.corrupt = "rkey"
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == 4, o
    assert [r.read for r in src.requests] == [True, False]
    wait_unpinned(src)
    p.release("r")
    p.group.manager.check_invariants()


def test_a_cancel_during_the_read_releases_the_pins(reading):
    src, make = reading
    toks = tokens(4, 15)
    commit(src.group, toks)
    src.faults.stall_after = 0  # the read hangs until the transfer timeout (0.3 s)
    p = make()
    p.submit("r", toks, HINT)
    deadline = time.monotonic() + 2
    while not src.requests and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    assert p.cancel("r")
    o = p.result("r", 5)
    assert o.reason is Reason.CANCELLED, o
    assert p.group.manager.num_free == p.group.manager.num_blocks
    wait_unpinned(src)
    assert [c.reason for c in src.cancels] == ["cancelled"]


@pytest.mark.parametrize("policy,reason,kept", [("strict", Reason.SOURCE_MISS, 0),
                                                ("best_effort", Reason.PARTIAL, 2)])
def test_read_policies_on_a_source_short_of_blocks(reading, policy, reason, kept):
    src, make = reading
    toks = tokens(5, 16)
    commit(src.group, toks[:2 * BS])
    p = make(default_policy=policy)
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is reason and o.blocks_transferred == kept, o
    assert o.reads == (1 if kept else 0), o
    assert p.release("r") == bool(kept)
    assert p.group.manager.longest_prefix(sequence_hashes(toks, BS)) == kept
    wait_unpinned(src)


def test_a_destination_that_does_not_read_gets_a_stream(reading):
    src, make = reading
    toks = tokens(3, 17)
    hs = commit(src.group, toks)
    p = make(remote_read=False)
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is Reason.OK and o.reads == 0 and not src.requests[0].read, o
    assert not src.read_dones and src.pins_outstanding == 0
    ids = p.claim("r")
    assert ids is not None and same_bytes(src, p.group, hs, ids)


def test_an_unasked_read_grant_is_refused(reading):
    src, make = reading
    toks = tokens(3, 18)
    commit(src.group, toks)
    serve = src.serve
    src.serve = lambda req: serve(msgspec.structs.replace(req, read=True))
    p = make(remote_read=False)
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is Reason.TRANSFER_FAILED and "did not ask" in o.detail, o
    assert p.group.manager.num_free == p.group.manager.num_blocks
    wait_unpinned(src)


def test_a_grant_unlike_the_published_state_is_refused(reading):
    src, make = reading
    toks = tokens(3, 19)
    commit(src.group, toks)
    body = src.state_body(*ADDR)  # says "canonical"
    src.state_body = lambda *a: body
    src.registered[0].native = True  # the grant says "in its own order"
    p = make()
    p.submit("r", toks, HINT)
    o = p.result("r", 5)
    assert o.reason is Reason.TRANSFER_FAILED and "own order" in o.detail, o
    assert o.reads == 0 and p.group.manager.num_free == p.group.manager.num_blocks
    wait_unpinned(src)
