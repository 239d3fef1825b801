"""The reference block pool: a hypothesis state machine over every call, plus directed tests
for eviction order, pins, private blocks, leases, misuse and threads."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvkern.cache import BlockPool, KVCacheManager, Lease, PinHandle, sequence_hashes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(doc: int, n: int = 6, block_size: int = 4) -> list[int]:
    return sequence_hashes([doc * 1000 + i for i in range(n * block_size)], block_size)


DOCS = [chain(d) for d in range(3)]
ALL_HASHES = [h for doc in DOCS for h in doc]


def cached_blocks(pool: BlockPool, hashes) -> dict[int, int]:
    """hash -> the block the pool caches it in, for each of ``hashes`` it caches."""
    out = {}
    for h in hashes:
        ids = pool.match_prefix([h])
        if ids:
            out[h] = ids[0]
    return out


def assert_leak_free(pool: BlockPool) -> None:
    s = pool.stats()
    assert (s["referenced"], s["pinned"], s["pins"], s["leased"], s["leases"], s["private"]) == (
        0, 0, 0, 0, 0, 0
    ), s
    assert s["free"] == s["blocks"], s
    pool.check_invariants()


# ------------------------------------------------------------------------------ state machine


class PoolMachine(RuleBasedStateMachine):
    """Model: who holds which block. The pool must never hand out a held block, must keep
    pinned and leased hashes findable, and must end leak-free once every holder lets go."""

    requests = Bundle("requests")
    pins = Bundle("pins")
    leases = Bundle("leases")
    privates = Bundle("privates")

    @initialize(num_blocks=st.integers(4, 12))
    def setup(self, num_blocks):
        self.clock = FakeClock()
        self.pool = BlockPool(num_blocks, block_size=4, clock=self.clock)
        self.held_refs: dict[int, int] = {}  # block id -> refs held by live model requests
        self.pinned: dict[int, int] = {}
        self.live_pins: list[PinHandle] = []
        self.live_leases: list[Lease] = []
        self.private: set[int] = set()

    # helpers
    def _holders(self) -> set[int]:
        held = {b for b, k in self.held_refs.items() if k}
        held |= {b for b, k in self.pinned.items() if k}
        held |= set(self.private)
        for lease in self.live_leases:
            if lease.expires_at > self.clock.now:
                held |= set(lease.block_ids)
        return held

    def _ref(self, ids, d):
        for b in ids:
            self.held_refs[b] = self.held_refs.get(b, 0) + d
            assert self.held_refs[b] >= 0

    def _mapped_ids(self) -> dict[int, int]:
        return cached_blocks(self.pool, ALL_HASHES)

    def _expire_model(self):
        self.live_leases = [x for x in self.live_leases if x.expires_at > self.clock.now]

    # rules
    @rule(target=requests, n=st.integers(0, 4))
    def allocate(self, n):
        before = self.pool.num_free
        held = self._holders()
        ids = self.pool.allocate(n)
        if ids is None:
            assert before < n
            return ("none", [], None)
        assert len(ids) == n == len(set(ids))
        assert not set(ids) & held, f"allocate returned held blocks {set(ids) & held}"
        mapped = self._mapped_ids()
        assert not set(ids) & set(mapped.values()), "evicted block still findable"
        self._ref(ids, +1)
        return ("fresh", ids, None)

    @rule(target=requests, doc=st.integers(0, 2), k=st.integers(1, 6))
    def acquire(self, doc, k):
        expect = self.pool.match_prefix(DOCS[doc][:k])
        ids = self.pool.acquire_prefix(DOCS[doc][:k])
        assert ids == expect
        self._ref(ids, +1)
        return ("acquired", ids, None)

    @rule(req=requests, doc=st.integers(0, 2), start=st.integers(0, 5))
    def commit(self, req, doc, start):
        kind, ids, committed = req
        if kind != "fresh" or not ids or self.held_refs.get(ids[0], 0) == 0:
            return
        if any(self.held_refs.get(b, 0) == 0 for b in ids):
            return  # released already
        hashes = DOCS[doc][start : start + len(ids)]
        if len(hashes) < len(ids):
            return
        try:
            canon = self.pool.commit(ids, hashes)
        except ValueError as exc:
            assert "already committed under hash" in str(exc)
            return
        for b, h, ok in zip(ids, hashes, canon, strict=True):
            found = self.pool.match_prefix([h])
            assert found, f"committed hash {h} not findable"
            if ok:
                assert found == [b]

    @rule(req=consumes(requests))
    def release(self, req):
        kind, ids, _ = req
        if any(self.held_refs.get(b, 0) < ids.count(b) for b in set(ids)):
            return
        self.pool.release(ids)
        self._ref(ids, -1)

    @rule(target=pins, doc=st.integers(0, 2), start=st.integers(0, 5),
          k=st.integers(1, 6), require_all=st.booleans())
    def pin(self, doc, start, k, require_all):
        hashes = DOCS[doc][start : start + k]
        run = self.pool.match_prefix(hashes)
        handle = self.pool.pin(hashes, require_all=require_all)
        if handle is None:
            assert not run or (require_all and len(run) < len(hashes))
            return None
        assert list(handle.block_ids) == run
        for b in handle.block_ids:
            self.pinned[b] = self.pinned.get(b, 0) + 1
        self.live_pins.append(handle)
        return handle

    @rule(handle=consumes(pins))
    def unpin(self, handle):
        if handle is None:
            return
        self.pool.unpin(handle)
        self.live_pins.remove(handle)
        for b in handle.block_ids:
            self.pinned[b] -= 1
        with pytest.raises(ValueError, match=f"pin {handle.pin_id}"):
            self.pool.unpin(handle)

    @rule(target=privates, n=st.integers(1, 3))
    def allocate_private(self, n):
        held = self._holders()
        ids = self.pool.allocate_private(n)
        if ids is None:
            return None
        assert not set(ids) & held
        assert not set(ids) & set(self._mapped_ids().values()), "private block is findable"
        self.private |= set(ids)
        return ids

    @rule(ids=consumes(privates))
    def free_private(self, ids):
        if ids is None:
            return
        self.pool.free_private(ids)
        self.private -= set(ids)

    @rule(target=leases, ids=consumes(privates), doc=st.integers(0, 2),
          start=st.integers(0, 5), lease_s=st.one_of(st.none(), st.sampled_from([1.0, 5.0])))
    def commit_private(self, ids, doc, start, lease_s):
        if ids is None:
            return None
        hashes = DOCS[doc][start : start + len(ids)]
        if len(hashes) < len(ids):
            self.pool.free_private(ids)
            self.private -= set(ids)
            return None
        lease = self.pool.commit_private(ids, hashes, lease_s=lease_s)
        self.private -= set(ids)
        assert self.pool.longest_prefix(hashes) == len(hashes) or start > 0
        for h in hashes:
            assert self.pool.match_prefix([h]), f"committed received hash {h} not findable"
        if lease is None:
            assert lease_s is None
            return None
        assert lease.expires_at == self.clock.now + lease_s
        self.live_leases.append(lease)
        return lease

    @rule(lease=consumes(leases))
    def claim(self, lease):
        if lease is None:
            return
        expired = lease.expires_at <= self.clock.now
        ids = self.pool.claim(lease)
        self._expire_model()
        if expired:
            assert ids is None
            return
        assert ids == list(lease.block_ids)
        self.live_leases.remove(lease)
        self._ref(ids, +1)
        with pytest.raises(ValueError, match="already claimed"):
            self.pool.claim(lease)
        # The claimed blocks are now a request's references; give them back.
        self.pool.release(ids)
        self._ref(ids, -1)

    @rule(lease=consumes(leases))
    def release_lease(self, lease):
        if lease is None:
            return
        self.pool.release_lease(lease)
        if lease in self.live_leases:
            self.live_leases.remove(lease)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def advance_clock(self, dt):
        self.clock.now += dt
        self._expire_model()

    @rule(b=st.integers(0, 11))
    def double_free_is_refused(self, b):
        if b >= self.pool.num_blocks or self.held_refs.get(b, 0):
            return
        before = self.pool.stats()
        with pytest.raises(ValueError, match=f"block {b}"):
            self.pool.release([b])
        assert self.pool.stats() == before

    # invariants
    @invariant()
    def pool_invariants(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        s = self.pool.stats()
        assert s["free"] + s["used"] == s["blocks"]
        assert s["referenced"] == len({b for b, k in self.held_refs.items() if k})
        assert s["pinned"] == len({b for b, k in self.pinned.items() if k})
        assert s["private"] == len(self.private)
        live = [x for x in self.live_leases if x.expires_at > self.clock.now]
        assert s["leases"] == len(live)
        assert s["leased"] == len({b for x in live for b in x.block_ids})
        for handle in self.live_pins:  # pinned hashes stay findable, on the pinned block
            for h, b in zip(handle.hashes, handle.block_ids, strict=True):
                assert self.pool.match_prefix([h]) == [b]
        for lease in live:  # leased hashes too
            for h, b in zip(lease.hashes, lease.block_ids, strict=True):
                assert self.pool.match_prefix([h]) == [b]

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for handle in list(self.live_pins):
            self.pool.unpin(handle)
        for lease in list(self.live_leases):
            self.pool.release_lease(lease)
        refs = [b for b, k in self.held_refs.items() for _ in range(k)]
        if refs:
            self.pool.release(refs)
        if self.private:
            self.pool.free_private(sorted(self.private))
        assert_leak_free(self.pool)


PoolMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = PoolMachine.TestCase


# --------------------------------------------------------------------------- directed tests


def make(num_blocks=8, **kw):
    clock = FakeClock()
    return BlockPool(num_blocks, block_size=4, clock=clock, **kw), clock


def cache_doc(pool: BlockPool, hashes: list[int]) -> list[int]:
    ids = pool.allocate(len(hashes))
    assert ids is not None
    assert pool.commit(ids, hashes) == [True] * len(hashes)
    pool.release(ids)
    return ids


def test_implements_protocol():
    pool, _ = make()
    assert isinstance(pool, KVCacheManager)
    assert pool.block_size == 4 and pool.hash_scheme == "kvkern-blake2b-v1"


def test_uncached_blocks_used_before_any_eviction():
    pool, _ = make(8)
    ids = cache_doc(pool, DOCS[0][:4])
    fresh = pool.allocate(4)
    assert fresh is not None and not set(fresh) & set(ids)
    assert pool.longest_prefix(DOCS[0]) == 4
    assert pool.stats()["evictions"] == 0
    pool.release(fresh)
    pool.check_invariants()


def test_lru_eviction_and_tail_first_release():
    pool, _ = make(6)
    a = cache_doc(pool, DOCS[0][:3])  # released first -> least recently used
    cache_doc(pool, DOCS[1][:3])
    got = pool.allocate(1)
    # The victim is doc 0's *last* block: release walks blocks last to first.
    assert got == [a[2]]
    assert pool.longest_prefix(DOCS[0]) == 2
    assert pool.longest_prefix(DOCS[1]) == 3
    assert pool.stats()["evictions"] == 1
    pool.release(got)
    more = pool.allocate(3)  # uncached block first (the one just released), then LRU
    assert more is not None and more[0] == got[0]
    assert pool.longest_prefix(DOCS[0]) == 0
    assert pool.longest_prefix(DOCS[1]) == 3
    pool.release(more)
    pool.check_invariants()


def test_acquired_prefix_moves_to_mru():
    pool, _ = make(6)
    cache_doc(pool, DOCS[0][:3])
    cache_doc(pool, DOCS[1][:3])
    ids = pool.acquire_prefix(DOCS[0])
    assert len(ids) == 3
    assert pool.allocate(4) is None  # only doc 1's 3 blocks are free
    pool.release(ids)
    got = pool.allocate(3)
    assert got is not None
    assert pool.longest_prefix(DOCS[0]) == 3 and pool.longest_prefix(DOCS[1]) == 0
    pool.release(got)


def test_out_of_blocks_returns_none_and_changes_nothing():
    pool, _ = make(4)
    cache_doc(pool, DOCS[0][:2])
    held = pool.allocate(2)
    before = pool.stats()
    assert pool.allocate(3) is None
    assert pool.allocate_private(3) is None
    assert pool.stats() == before
    assert pool.allocate(0) == []
    pool.release(held)
    assert_leak_free(pool)


def test_pin_protects_cached_zero_ref_block_from_eviction():
    pool, _ = make(4)
    ids = cache_doc(pool, DOCS[0][:2])
    handle = pool.pin(DOCS[0][:2])
    assert handle is not None and list(handle.block_ids) == ids
    assert pool.num_pinned == 2 and pool.num_free == 2
    others = pool.allocate(2)
    assert others is not None and not set(others) & set(ids)
    assert pool.allocate(1) is None  # the pinned blocks cannot be evicted
    assert pool.match_prefix(DOCS[0][:2]) == ids
    pool.unpin(handle)
    assert pool.num_pinned == 0
    assert pool.allocate(2) is not None  # now they can
    assert pool.longest_prefix(DOCS[0]) == 0


def test_pin_counts_nest_and_require_all():
    pool, _ = make(8)
    cache_doc(pool, DOCS[0][:3])
    assert pool.pin(DOCS[0][:5], require_all=True) is None
    assert pool.num_pinned == 0
    h1 = pool.pin(DOCS[0][:5])
    h2 = pool.pin(DOCS[0][1:3])
    assert h1 is not None and len(h1.block_ids) == 3 and h1.hashes == tuple(DOCS[0][:3])
    assert h2 is not None and len(h2.block_ids) == 2
    assert pool.stats()["pins"] == 2 and pool.num_pinned == 3
    assert pool.pin(DOCS[1]) is None
    pool.unpin(h1)
    assert pool.num_pinned == 2
    pool.unpin(h2)
    assert_leak_free(pool)


def test_double_unpin_and_forged_handle_raise():
    pool, _ = make(4)
    cache_doc(pool, DOCS[0][:2])
    handle = pool.pin(DOCS[0][:2])
    assert handle is not None
    forged = PinHandle(pin_id=handle.pin_id, block_ids=(3,), hashes=(1,))
    with pytest.raises(ValueError, match=r"names blocks \[3\]"):
        pool.unpin(forged)
    pool.unpin(handle)
    with pytest.raises(ValueError, match=f"pin {handle.pin_id} .*not pinned"):
        pool.unpin(handle)
    assert_leak_free(pool)


def test_private_blocks_invisible_until_committed():
    pool, _ = make(8)
    priv = pool.allocate_private(3)
    assert priv is not None and pool.num_private == 3
    assert pool.longest_prefix(DOCS[0]) == 0
    assert pool.pin(DOCS[0][:3]) is None
    lease = pool.commit_private(priv, DOCS[0][:3], lease_s=10.0)
    assert lease is not None and list(lease.block_ids) == priv
    assert pool.num_private == 0 and pool.num_leased == 3
    assert pool.match_prefix(DOCS[0]) == priv
    pool.release_lease(lease)
    assert_leak_free(pool)
    assert pool.longest_prefix(DOCS[0]) == 3  # still cached, now evictable


def test_commit_private_without_lease_is_evictable():
    pool, _ = make(3)
    priv = pool.allocate_private(3)
    assert pool.commit_private(priv, DOCS[0][:3], lease_s=None) is None
    assert pool.longest_prefix(DOCS[0]) == 3
    assert pool.num_free == 3
    got = pool.allocate(1)
    assert got == [priv[2]]  # tail block evicted first
    pool.release(got)


def test_commit_private_keeps_existing_block_for_duplicate_hash():
    pool, _ = make(8)
    existing = cache_doc(pool, DOCS[0][:2])
    priv = pool.allocate_private(3)
    lease = pool.commit_private(priv, DOCS[0][:3], lease_s=5.0)
    assert lease.block_ids == (existing[0], existing[1], priv[2])
    assert pool.stats()["commit_duplicates"] == 2
    assert pool.num_leased == 3
    ids = pool.claim(lease)
    assert ids == list(lease.block_ids)
    pool.release(ids)
    assert_leak_free(pool)


def test_lease_keeps_blocks_until_expiry():
    pool, clock = make(3)
    priv = pool.allocate_private(3)
    lease = pool.commit_private(priv, DOCS[0][:3], lease_s=2.0)
    assert pool.allocate(1) is None  # everything leased
    clock.now += 1.999
    assert pool.num_leased == 3 and pool.allocate(1) is None
    clock.now += 0.001  # expires_at reached
    assert pool.num_leased == 0
    assert pool.stats()["leases_expired"] == 1
    assert pool.claim(lease) is None
    pool.release_lease(lease)  # benign after expiry
    assert pool.longest_prefix(DOCS[0]) == 3
    got = pool.allocate(3)
    assert got is not None and pool.longest_prefix(DOCS[0]) == 0
    pool.release(got)
    assert_leak_free(pool)


def test_claim_turns_lease_into_references():
    pool, clock = make(4)
    priv = pool.allocate_private(2)
    lease = pool.commit_private(priv, DOCS[0][:2], lease_s=1.0)
    ids = pool.claim(lease)
    assert ids == priv and pool.num_leased == 0
    clock.now += 100  # references do not expire
    assert pool.allocate(3) is None
    with pytest.raises(ValueError, match="already claimed"):
        pool.claim(lease)
    with pytest.raises(ValueError, match="already claimed"):
        pool.release_lease(lease)
    pool.release(ids)
    assert_leak_free(pool)


def test_a_lease_whose_end_the_history_forgot_is_treated_as_expired():
    """A claim or release that comes after its lease ended and the lease history has moved on
    falls back as for an expired lease (None), where it raised."""
    pool, clock = make(8, lease_history=2)
    priv = pool.allocate_private(1)
    lease = pool.commit_private(priv, [111], lease_s=1.0)
    clock.now += 2.0  # expired (applied lazily)
    for k in range(3):  # three more leases end: the history of two forgets the first
        other = pool.commit_private(pool.allocate_private(1), [1000 + k], lease_s=100.0)
        pool.release(pool.claim(other))
    assert pool.claim(lease) is None
    pool.release_lease(lease)
    assert_leak_free(pool)


def test_evict_applies_due_lease_expiry_first():
    pool, clock = make(4)
    pool.commit_private(pool.allocate_private(1), [42], lease_s=1.0)
    clock.now += 1.0
    assert pool.evict([42]) == {"evicted": [42], "held": [], "absent": []}
    assert_leak_free(pool)


def test_unknown_lease_raises():
    pool, _ = make(4)
    bogus = Lease(lease_id=99, block_ids=(0,), hashes=(1,), expires_at=0.0)
    with pytest.raises(ValueError, match="unknown lease 99"):
        pool.claim(bogus)


@pytest.mark.parametrize(
    "call,match",
    [
        pytest.param(lambda p: p.release([0]), r"block 0 .*ref_cnt is 0", id="release_unheld"),
        pytest.param(lambda p: p.release([8]), r"block id 8 out of range for pool of 8",
                     id="release_out_of_range"),
        pytest.param(lambda p: p.release([-1]), "block id -1", id="negative_id"),
        pytest.param(lambda p: p.release([True]), "block id True", id="bool_id"),
        pytest.param(lambda p: p.free_private([1]), "block 1 that is not private",
                     id="free_private_not_private"),
        pytest.param(lambda p: p.commit_private([1], [5], lease_s=1.0), "not private",
                     id="commit_private_not_private"),
        pytest.param(lambda p: p.commit([2], [5]), "commit of block 2 that no request holds",
                     id="commit_unheld"),
        pytest.param(lambda p: p.allocate(-1), "int >= 0", id="negative_count"),
        pytest.param(lambda p: p.commit_private(p.allocate_private(1), [5], lease_s=0),
                     "lease_s", id="zero_lease"),
        pytest.param(lambda p: p.commit_private(p.allocate_private(2), [5], lease_s=None),
                     "2 block ids but 1 hashes", id="length_mismatch"),
        pytest.param(lambda p: p.commit_private(p.allocate_private(2), [5, 5], lease_s=None),
                     "duplicate hashes", id="duplicate_hashes"),
        pytest.param(lambda p: p.free_private([p.allocate_private(1)[0]] * 2), "appears twice",
                     id="duplicate_ids"),
        pytest.param(lambda p: p.pin([1 << 64]), "outside u64", id="hash_too_big"),
    ],
)
def test_misuse_raises_naming_values_and_changes_nothing(call, match):
    pool, _ = make(8)
    with pytest.raises(ValueError, match=match):
        call(pool)
    pool.check_invariants()
    s = pool.stats()
    # Helpers that allocated private blocks before the failing call leave exactly those.
    assert s["free"] + s["private"] == 8 and s["referenced"] == 0


def test_double_release_of_shared_block():
    pool, _ = make(4)
    ids = cache_doc(pool, DOCS[0][:1])
    a = pool.acquire_prefix(DOCS[0][:1])
    b = pool.acquire_prefix(DOCS[0][:1])
    assert a == b == ids
    with pytest.raises(ValueError, match=r"release of block \d+ 3 time\(s\) but its ref_cnt is 2"):
        pool.release(a + b + a)
    pool.release(a + b)
    assert_leak_free(pool)


def test_commit_conflicting_hash_raises_and_idempotent_recommit():
    pool, _ = make(4)
    ids = pool.allocate(1)
    assert pool.commit(ids, [11]) == [True]
    assert pool.commit(ids, [11]) == [True]
    with pytest.raises(ValueError, match="already committed under hash 11, not 12"):
        pool.commit(ids, [12])
    other = pool.allocate(1)
    assert pool.commit(other, [11]) == [False]  # duplicate stays uncached
    pool.release(ids + other)
    assert pool.num_cached == 1
    assert_leak_free(pool)


def test_i64_hash_spelling_finds_u64_entry():
    pool, _ = make(4)
    h = (1 << 64) - 5
    cache_doc(pool, [h])
    assert pool.longest_prefix([-5]) == 1


def test_unknown_scheme_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown hash scheme 'nope'"):
        BlockPool(4, block_size=4, hash_scheme="nope")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, block_size=0)


def test_threads_leave_no_leaks():
    """The engine, the source service and the puller hammer one pool from three threads."""
    pool = BlockPool(32, block_size=4)
    errors: list[BaseException] = []

    def engine(seed):
        rng = random.Random(seed)
        for _ in range(300):
            doc = DOCS[rng.randrange(3)]
            have = pool.acquire_prefix(doc)
            new = pool.allocate(rng.randrange(0, 3))
            if new:
                hashes = doc[len(have) : len(have) + len(new)]
                if len(hashes) == len(new):
                    pool.commit(new, hashes)
                pool.release(new)
            pool.release(have)

    def source(seed):
        rng = random.Random(seed)
        for _ in range(300):
            h = pool.pin(DOCS[rng.randrange(3)][rng.randrange(3):])
            if h is not None:
                pool.unpin(h)

    def puller(seed):
        rng = random.Random(seed)
        for _ in range(300):
            priv = pool.allocate_private(2)
            if priv is None:
                continue
            if rng.random() < 0.3:
                pool.free_private(priv)
                continue
            doc = DOCS[rng.randrange(3)]
            lease = pool.commit_private(priv, doc[4:6], lease_s=60.0)
            got = pool.claim(lease)
            pool.release(got)

    def run(fn, seed):
        try:
            fn(seed)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f, i)) for i, f in
               enumerate([engine, engine, source, puller])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert_leak_free(pool)


def test_evict_named_hashes_spares_held_blocks():
    pool = BlockPool(8, block_size=4)
    hs = sequence_hashes(list(range(12)), 4)
    ids = pool.acquire_prefix(hs) or pool.allocate(3)
    pool.commit(ids, hs)
    pool.release(ids[1:])  # block 0 still referenced; 1 and 2 cached and free
    handle = pool.pin(hs[1:2])
    out = pool.evict([hs[0], hs[1], hs[2], 12345])
    assert out == {"evicted": [hs[2]], "held": [hs[0], hs[1]], "absent": [12345]}
    assert pool.longest_prefix(hs) == 2 and pool.match_prefix(hs[2:]) == []
    pool.unpin(handle)
    pool.release(ids[:1])
    pool.check_invariants()
    assert pool.num_free == 8
