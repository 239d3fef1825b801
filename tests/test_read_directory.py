"""The read directory: its layout, publish/withdraw and the seq of a slot, the vectorized reader
against a plain reference, a state machine keeping a pool's directory equal to a model of its
index, and the seqlock check refusing a block that changed between two reads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvkern.cache import BlockPool, directory
from kvkern.cache.directory import (
    BUCKET_BYTES,
    BUCKET_SLOTS,
    DIRECTORY_GROUP,
    MAX_GROUP,
    SLOT_BYTES,
    SLOT_WORDS,
    SMALL,
    TAG_CACHED,
    TAG_CHANGING,
    ReadDirectory,
    bucket_of,
    entries,
    find,
    home_buckets,
    home_runs,
    slot_offsets,
    stable,
)
from tests.test_cache_pool import cached_blocks

U64 = 2**64 - 1


def read(d: ReadDirectory, hashes, homes=None) -> tuple[np.ndarray, ...]:
    """What a remote reader does: copy the home buckets of ``hashes`` (``homes``; default
    their plain buckets) and find them there, then the plain buckets of those not found.
    Returns (want, slot, block, the matched slots' words, the bucket of each)."""
    want = np.asarray(hashes, dtype=np.uint64)
    plain = bucket_of(want, d.buckets)
    where = plain.copy() if homes is None else np.asarray(homes, np.int64).copy()
    slot, block, tag = find(d.table[where].copy(), want)
    miss = block < 0
    where[miss] = plain[miss]
    slot2, block2, tag2 = find(d.table[where[miss]].copy(), want[miss])
    slot[miss], block[miss], tag[miss] = slot2, block2, tag2
    pre = entries(d.table[where].copy(), slot)
    assert np.array_equal(pre[:, 2], tag)
    return want, slot, block, pre, where


def reread(d: ReadDirectory, where: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """The same slots read again (zeros where nothing was found)."""
    return entries(d.table[where].copy(), slot)


def findable(d: ReadDirectory, hashes, homes=None) -> dict[int, int]:
    want, _, block, _, _ = read(d, list(hashes), homes)
    return {int(h): int(b) for h, b in zip(want, block, strict=True) if b >= 0}


def in_table(d: ReadDirectory) -> dict[int, int]:
    """Every (hash, block) a cached, settled slot names."""
    slots = d.table.reshape(-1, SLOT_WORDS)
    ok = (slots[:, 2] & np.uint64(TAG_CACHED | TAG_CHANGING)) == np.uint64(TAG_CACHED)
    out = {int(h): int(b) for h, b in slots[ok, :2]}
    assert len(out) == int(ok.sum()) == d.published
    return out


# ------------------------------------------------------------------------------ layout, writer


@pytest.mark.parametrize("num_blocks, buckets", [(1, 1), (4, 4), (5, 8), (16, 16), (17, 32),
                                                 (1000, 1024), (4096, 4096)])
def test_size_alignment_and_zeroed(num_blocks, buckets):
    d = ReadDirectory(num_blocks)
    assert d.buckets == buckets and d.num_blocks == num_blocks
    assert d.buckets >= num_blocks  # a bucket per block: one full in about a million
    assert d.nbytes == buckets * BUCKET_BYTES == buckets * BUCKET_SLOTS * SLOT_BYTES
    assert d.address % 4096 == 0 and d.address == d.table.ctypes.data
    assert d.table.dtype == np.uint64 and d.table.flags.c_contiguous
    assert d.table.shape == (buckets, BUCKET_SLOTS, SLOT_WORDS)
    assert not d.table.any() and d.published == d.unpublished == 0
    assert d.slot_address(0) == d.address
    assert d.slot_address(buckets * BUCKET_SLOTS - 1) == d.address + d.nbytes - SLOT_BYTES
    with pytest.raises(ValueError, match="out of range"):
        d.slot_address(buckets * BUCKET_SLOTS)


def test_publish_find_withdraw():
    d = ReadDirectory(16)
    hs = [0, 5, U64, 2**63 + 4]
    for bid, h in enumerate(hs):
        assert d.publish(bid + 3, h)
    assert findable(d, hs + [7, 9]) == {h: i + 3 for i, h in enumerate(hs)}
    assert in_table(d) == {h: i + 3 for i, h in enumerate(hs)}
    flat = d.slot_of(4)
    assert flat >= 0 and d.table.reshape(-1, SLOT_WORDS)[flat, 0] == 5
    assert d.slot_address(flat) == d.address + flat * SLOT_BYTES
    _, slot, _, _, where = read(d, [5])
    assert slot_offsets(where, slot)[0] == flat * SLOT_BYTES
    d.check({h: i + 3 for i, h in enumerate(hs)})

    d.withdraw(4)
    assert d.slot_of(4) == -1 and d.published == 3
    assert findable(d, hs) == {0: 3, U64: 5, 2**63 + 4: 6}
    slot_words = d.table.reshape(-1, SLOT_WORDS)[flat]
    assert slot_words[0] == slot_words[1] == 0 and not slot_words[2] & (TAG_CACHED | TAG_CHANGING)
    d.withdraw(4)  # holds no slot: nothing happens
    d.withdraw(0)
    assert d.published == 3
    d.check({0: 3, U64: 5, 2**63 + 4: 6})

    with pytest.raises(ValueError, match="already published"):
        d.publish(3, 99)
    for bad in (-1, 16, True, 1.0):
        with pytest.raises(ValueError, match="block id"):
            d.publish(bad, 1)
    for bad in (-1, 2**64, False, 1.5):
        with pytest.raises(ValueError, match="hash"):
            d.publish(1, bad)
    with pytest.raises(ValueError, match="num_blocks"):
        ReadDirectory(0)


def test_withdraw_hash_clears_every_block_named_by_it():
    d = ReadDirectory(16)
    for bid, h in ((1, 9), (2, 9), (3, 4), (0, 9)):
        assert d.publish(bid, h)
    d.withdraw(0)
    assert d.withdraw_hash(9) == [1, 2]
    assert findable(d, [9, 4]) == {4: 3} and d.published == 1
    assert d.withdraw_hash(9) == [] and d.withdraw_hash(U64) == []
    d.check({4: 3})


def test_full_bucket_refuses_and_counts():
    d = ReadDirectory(16)  # 16 buckets: hashes 16k all land in bucket 0
    for i in range(BUCKET_SLOTS):
        assert d.publish(i, 16 * (i + 1))
    assert not d.publish(8, 1600) and d.unpublished == 1
    assert d.slot_of(8) == -1
    assert 1600 not in findable(d, [1600])
    assert d.publish(9, 1601) and d.unpublished == 1  # another bucket has room
    d.withdraw(8)  # never published: nothing happens
    d.withdraw(2)  # frees a slot of bucket 0
    assert d.publish(8, 1600) and findable(d, [1600]) == {1600: 8}
    assert d.slot_of(8) == 2  # the lowest free slot


def test_seq_strictly_increases_and_never_repeats():
    d = ReadDirectory(1)  # one bucket
    seen = [int(d.table[0, 0, 2])]
    for round_ in range(20):
        assert d.publish(0, 100 + round_)
        assert d.slot_of(0) == 0
        seen.append(int(d.table[0, 0, 2]))
        assert seen[-1] & (TAG_CACHED | TAG_CHANGING) == TAG_CACHED
        d.withdraw(0)
        seen.append(int(d.table[0, 0, 2]))
        assert seen[-1] & (TAG_CACHED | TAG_CHANGING) == 0
    seqs = [t >> 2 for t in seen]
    assert seqs == list(range(len(seen)))


def test_check_names_disagreements():
    d = ReadDirectory(8)
    d.publish(1, 10)
    d.check({10: 1, 11: 2})  # an indexed block need not be published
    with pytest.raises(AssertionError, match="hash 10"):
        d.check({10: 2})
    with pytest.raises(AssertionError, match="hash 10"):
        d.check({})
    d.table.reshape(-1)[2] |= np.uint64(TAG_CHANGING)
    with pytest.raises(AssertionError, match="changing"):
        d.check({10: 1})


# ------------------------------------------------------------------------------ reader


def ref_check(h: int, b: int, t: int) -> int:
    """A slot's check word, as the wire format defines it."""
    return (h * 0x9E3779B97F4A7C15 ^ b * 0xC2B2AE3D27D4EB4F ^ t * 0x165667B19E3779F9) % 2**64


def ref_find(rows, want):
    slots, blocks, tags = [], [], []
    for row, w in zip(rows.tolist(), want.tolist(), strict=True):
        for j, (h, b, t, c) in enumerate(row):
            if h == w and t & 3 == TAG_CACHED and c == ref_check(h, b, t):
                slots.append(j)
                blocks.append(b)
                tags.append(t)
                break
        else:
            slots.append(-1)
            blocks.append(-1)
            tags.append(0)
    return slots, blocks, tags


def ref_stable(pre, post, want):
    return [p == q and p[0] == w and p[2] & 3 == TAG_CACHED and p[3] == ref_check(*p[:3])
            for p, q, w in zip(pre.tolist(), post.tolist(), want.tolist(), strict=True)]


@pytest.mark.parametrize("seed", range(20))
def test_find_and_stable_match_a_plain_reference(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, 40))
    pool_of_hashes = np.array([0, 1, 7, U64, 2**63, 12345], dtype=np.uint64)
    rows = np.zeros((k, BUCKET_SLOTS, SLOT_WORDS), dtype=np.uint64)
    rows[:, :, 0] = rng.choice(pool_of_hashes, size=(k, BUCKET_SLOTS))
    rows[:, :, 1] = rng.integers(0, 50, size=(k, BUCKET_SLOTS), dtype=np.uint64)
    rows[:, :, 2] = (rng.integers(0, 4, size=(k, BUCKET_SLOTS), dtype=np.uint64) << np.uint64(2)
                     | rng.integers(0, 4, size=(k, BUCKET_SLOTS), dtype=np.uint64))
    for i, j in np.ndindex(k, BUCKET_SLOTS):  # mostly the right check word, else a torn one
        h, b, t = (int(x) for x in rows[i, j, :3])
        rows[i, j, 3] = ref_check(h, b, t) if rng.random() < 0.8 else ref_check(h, b, t ^ 4)
    want = rng.choice(pool_of_hashes, size=k)

    slot, block, tag = find(rows, want)
    assert (slot.dtype, block.dtype, tag.dtype) == (np.int64, np.int64, np.uint64)
    assert (slot.tolist(), block.tolist(), tag.tolist()) == ref_find(rows, want)

    pre = entries(rows, slot)
    post = pre.copy()
    flip = rng.random(k) < 0.5
    word = rng.integers(0, SLOT_WORDS, size=k)
    post[flip, word[flip]] ^= np.uint64(1) << rng.integers(0, 64, size=int(flip.sum()),
                                                           dtype=np.uint64)
    if k:
        pre[0, 2] |= np.uint64(TAG_CHANGING)  # a torn read: the writer was mid-change
        post[0] = pre[0]
    got = stable(pre, post, want)
    assert got.dtype == bool and got.tolist() == ref_stable(pre, post, want)


@pytest.mark.parametrize("seed", range(30))
def test_the_small_and_vectorized_readers_agree(seed, monkeypatch):
    """Up to ``SMALL`` hashes the reader loops in Python: the same answers as numpy's, block
    ids of 2**63 and above included (read as int64, like numpy's cast)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, directory.SMALL + 1))
    pool_of_hashes = np.array([0, 1, 7, U64, 2**63, 12345], dtype=np.uint64)
    rows = np.zeros((k, BUCKET_SLOTS, SLOT_WORDS), dtype=np.uint64)
    rows[:, :, 0] = rng.choice(pool_of_hashes, size=(k, BUCKET_SLOTS))
    rows[:, :, 1] = rng.choice(np.array([0, 3, 2**63, U64], np.uint64), size=(k, BUCKET_SLOTS))
    rows[:, :, 2] = rng.integers(0, 1 << 62, size=(k, BUCKET_SLOTS), dtype=np.uint64)
    want = rng.choice(pool_of_hashes, size=k)
    post = rows[:, 0].copy()
    post[rng.random(k) < 0.3, 2] ^= np.uint64(4)

    def answers():
        slot, block, tag = find(rows, want)
        pre = entries(rows, slot)
        return (slot, block, tag, pre, stable(pre, pre, want), stable(pre, post, want))

    small = answers()
    monkeypatch.setattr(directory, "SMALL", -1)  # every call vectorized
    for a, b in zip(small, answers(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()


def test_reader_refuses_bad_shapes():
    rows = np.zeros((2, BUCKET_SLOTS, SLOT_WORDS), dtype=np.uint64)
    with pytest.raises(ValueError, match="want"):
        find(rows, np.zeros(3, dtype=np.uint64))
    with pytest.raises(ValueError, match="rows"):
        find(rows.astype(np.int64), np.zeros(2, dtype=np.uint64))
    with pytest.raises(ValueError, match="post"):
        stable(np.zeros((2, 4), np.uint64), np.zeros((2, 3), np.uint64), np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="power of two"):
        bucket_of(np.zeros(1, np.uint64), 3)
    with pytest.raises(ValueError, match="slot"):
        entries(rows, np.array([0, BUCKET_SLOTS]))
    with pytest.raises(ValueError, match="slots"):
        slot_offsets(np.array([1, 2]), np.array([0, -1]))
    big = np.zeros(SMALL + 1, np.int64)
    for slots in (np.array([0, -1]), np.array([0, BUCKET_SLOTS])):
        with pytest.raises(ValueError, match="slots"):
            slot_offsets(np.resize(big, len(slots)) + 1, slots)
    with pytest.raises(ValueError, match="slots"):
        slot_offsets(big - 1, big)  # a negative bucket, the vectorized path
    with pytest.raises(ValueError, match="slots"):
        slot_offsets(np.array([1]), np.array([0, 1]))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 2 * SMALL), seed=st.integers(0, 2**32 - 1),
       log_buckets=st.integers(0, 20))
def test_reader_helpers_loop_and_vectorized_agree(n, seed, log_buckets):
    """bucket_of and slot_offsets loop in Python up to SMALL entries: the same values,
    dtype and shape as the vectorized formulas."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    buckets = 1 << log_buckets
    got = bucket_of(hashes, buckets)
    want = (hashes & np.uint64(buckets - 1)).astype(np.int64)
    assert got.dtype == np.int64 and got.shape == (n,) and np.array_equal(got, want)
    slots = rng.integers(0, BUCKET_SLOTS, n)
    got = slot_offsets(want, slots)
    assert got.dtype == np.int64 and got.shape == (n,)
    assert np.array_equal(got, (want * BUCKET_SLOTS + slots) * SLOT_BYTES)


# ------------------------------------------------------------------------------ the pool


def cache(pool: BlockPool, hashes: list[int]) -> list[int]:
    ids = pool.allocate(len(hashes))
    assert ids is not None and all(pool.commit(ids, hashes))
    pool.release(ids)
    return ids


def test_pool_directory_created_once_with_what_is_cached():
    pool = BlockPool(16, block_size=4)
    ids = cache(pool, [4, 8, 13])
    d = pool.read_directory()
    assert pool.read_directory() is d and d.num_blocks == 16 and d.group == DIRECTORY_GROUP
    homes = home_buckets([4, 8, 13, 99], 0, 4, d.buckets, d.group)
    assert homes.tolist() == [4, 5, 6, 7]  # one chain: consecutive buckets
    assert findable(d, [4, 8, 13, 99], homes) == dict(zip([4, 8, 13], ids, strict=True))
    assert findable(d, [8, 13]) == {}  # not in their plain buckets
    pool.evict([8])
    assert findable(d, [4, 8, 13], homes[:3]) == {4: ids[0], 13: ids[2]}
    pool.check_invariants()
    d.table.reshape(-1)[d.slot_of(ids[0]) * SLOT_WORDS] = 5  # corrupt the hash word
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_the_writer_fences_before_a_slot_counts_and_after_it_is_withdrawn(monkeypatch):
    """The store fence sits where a weakly ordered processor needs one: a publish's slot
    holds its hash and block id, still changing, at the fence before its cached tag; a
    withdrawal's slot is changing, its words untouched, at the fence before they are
    zeroed, and final (not cached, zeroed, a new tag) at the fence that precedes the
    block's next writer."""
    d = ReadDirectory(16)
    seen: list[np.ndarray] = []
    monkeypatch.setattr(directory, "store_fence", lambda: seen.append(d.table.copy()))
    assert d.publish(3, 0xABC)
    flat = d.slot_of(3)
    at_fence = seen[-1].reshape(-1, SLOT_WORDS)[flat]
    assert at_fence.tolist()[:3] == [0xABC, 3, (1 << 2) | TAG_CHANGING]
    assert d.table.reshape(-1, SLOT_WORDS)[flat, 2] == (1 << 2) | TAG_CACHED
    d.withdraw(3)
    assert len(seen) == 3
    assert seen[1].reshape(-1, SLOT_WORDS)[flat].tolist()[:3] == [0xABC, 3,
                                                                  (2 << 2) | TAG_CHANGING]
    assert seen[-1].reshape(-1, SLOT_WORDS)[flat].tolist()[:3] == [0, 0, 2 << 2]
    assert np.array_equal(seen[-1], d.table)  # (nothing stored after it)


@pytest.mark.parametrize("machine,fenced", [("x86_64", False), ("AMD64", False),
                                            ("aarch64", True), ("arm64", True),
                                            ("ppc64le", True)])
def test_the_fence_is_nothing_only_where_stores_keep_their_order(machine, fenced):
    assert (directory.fence_for(machine) is directory._lock_fence) == fenced


def test_the_lock_fence_runs_on_many_threads_at_once():
    """Each thread releases and takes back a lock of its own: fences on several threads at
    once never release another's lock."""
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(20_000):
                directory._lock_fence()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_allocation_withdraws_before_handing_out():
    pool = BlockPool(4, block_size=4)
    ids = cache(pool, [1, 2, 3, 4])
    d = pool.read_directory()
    got = pool.allocate(2)  # evicts the two least recently used cached blocks
    assert got is not None and d.published == 2
    assert not set(got) & set(in_table(d).values())
    pool.release(got)
    assert pool.allocate_private(4) is not None and d.published == 0 and not in_table(d)
    assert ids  # every cached block was evicted


# --------------------------------------------------------------------------- state machine

# Hashes crowded into bucket 0 of a 16-block pool's 4 buckets, so that buckets fill up.
CROWD = [4 * k for k in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)] + [0, 2**64 - 4]
SPREAD = [1, 6, 11, U64, 2**63 + 2, 2**63 + 7]
DOCS = [CROWD[:6], CROWD[6:], SPREAD]
UNIVERSE = CROWD + SPREAD


class DirectoryMachine(RuleBasedStateMachine):
    """Model: the directory names exactly the indexed hashes that found room in their bucket
    when they were published, in publish order; a full bucket counts one unpublished."""

    requests = Bundle("requests")
    privates = Bundle("privates")
    pins = Bundle("pins")

    @initialize(num_blocks=st.integers(8, 16), attach_now=st.booleans(),
                group=st.sampled_from([1, 2, 3, DIRECTORY_GROUP]))
    def setup(self, num_blocks, attach_now, group):
        self.pool = BlockPool(num_blocks, block_size=4, directory_group=group)
        self.group = group
        self.d: ReadDirectory | None = None
        self.model: dict[int, int] = {}
        self.where: dict[int, int] = {}  # the bucket the model's hashes sit in
        self.chain: dict[int, tuple[int, int]] = {}  # (position, anchor) of indexed hashes
        self.unpublished = 0
        self.index = self._index()
        if attach_now:
            self.attach()

    def _index(self) -> dict[int, int]:
        return cached_blocks(self.pool, UNIVERSE)

    def _home(self, h: int) -> int:
        mask = self.pool.num_blocks - 1 if self.d is None else self.d.buckets - 1
        c = self.chain.get(h)
        return h & mask if c is None else (c[1] + c[0] % self.group) & mask

    def _records(self, hashes: list[int], parent: int | None) -> list:
        """The chain records of a commit, computed apart from the pool's."""
        rec = (-1, 0) if parent is None else self.chain.get(parent)
        out = []
        for h in hashes:
            if rec is not None:
                rec = (rec[0] + 1, h if (rec[0] + 1) % self.group == 0 else rec[1])
            out.append(rec)
        return out

    def _sync(self, published_order: list[int] = (), records: list = ()) -> None:
        """Fold one call's index change into the model (a call only publishes or only
        withdraws)."""
        new = self._index()
        for h in list(self.chain):
            if new.get(h) != self.index.get(h):
                del self.chain[h]
        added = [h for h in published_order if h in new and h not in self.index]
        assert set(added) == set(new) - set(self.index)
        for h, rec in zip(published_order, records, strict=False):
            if h in added and rec is not None:
                self.chain[h] = rec
        if self.d is not None:
            for h in list(self.model):
                if new.get(h) != self.model[h]:
                    del self.model[h], self.where[h]
            for h in added:
                for bucket in (self._home(h), h & (self.d.buckets - 1)):
                    if sum(1 for g in self.where.values() if g == bucket) < BUCKET_SLOTS:
                        self.model[h], self.where[h] = new[h], bucket
                        break
                else:
                    self.unpublished += 1
        self.index = new

    @rule()
    def attach(self):
        d = self.pool.read_directory()
        if self.d is not None:
            assert d is self.d
            return
        self.d = d
        assert d.unpublished + d.published == len(self.index)
        self.model = in_table(d)
        self.where = {h: d.slot_of(b) // BUCKET_SLOTS for h, b in self.model.items()}
        self.unpublished = d.unpublished
        for h, b in self.index.items():  # an indexed hash left out had both buckets full
            if h not in self.model:
                for bucket in (self._home(h), h & (d.buckets - 1)):
                    assert sum(1 for g in self.where.values() if g == bucket) == BUCKET_SLOTS
            else:
                assert self.model[h] == b
                assert self.where[h] in (self._home(h), h & (d.buckets - 1))

    @rule(target=requests, n=st.integers(1, 4))
    def allocate(self, n):
        ids = self.pool.allocate(n)
        self._sync()
        return ids or []

    @staticmethod
    def _parent(doc: int, start: int, told: bool) -> int | None:
        """The parent a commit of ``DOCS[doc][start:]`` names: the right one, or (not
        ``told``) None, as a caller that does not know it would."""
        return DOCS[doc][start - 1] if told and start else None

    @rule(req=requests, doc=st.integers(0, 2), start=st.integers(0, 5), told=st.booleans())
    def commit(self, req, doc, start, told):
        hashes = DOCS[doc][start:start + len(req)]
        if not req or len(hashes) < len(req):
            return
        parent = self._parent(doc, start, told)
        records = self._records(hashes, parent)
        try:
            self.pool.commit(req, hashes, parent=parent)
        except ValueError:  # released already, or committed under other hashes
            return
        self._sync(hashes, records)

    @rule(doc=st.integers(0, 2), start=st.integers(0, 5), told=st.booleans())
    def cache_doc(self, doc, start, told):
        """A request computes the rest of a document, commits it and finishes."""
        hashes = DOCS[doc][start:]
        ids = self.pool.allocate(len(hashes))
        self._sync()
        if ids is None:
            return
        parent = self._parent(doc, start, told)
        records = self._records(hashes, parent)
        self.pool.commit(ids, hashes, parent=parent)
        self._sync(hashes, records)
        self.pool.release(ids)
        self._sync()

    @rule(req=consumes(requests))
    def release(self, req):
        try:
            self.pool.release(req)
        except ValueError:
            return
        self._sync()

    @rule(hashes=st.lists(st.sampled_from(UNIVERSE), max_size=4))
    def evict(self, hashes):
        self.pool.evict(hashes)
        self._sync()

    @rule(target=privates, n=st.integers(1, 3))
    def allocate_private(self, n):
        ids = self.pool.allocate_private(n)
        self._sync()
        return ids or []

    @rule(ids=consumes(privates), doc=st.integers(0, 2), start=st.integers(0, 5),
          leased=st.booleans(), told=st.booleans())
    def commit_private(self, ids, doc, start, leased, told):
        hashes = DOCS[doc][start:start + len(ids)]
        if not ids or len(hashes) < len(ids):
            return
        parent = self._parent(doc, start, told)
        records = self._records(hashes, parent)
        lease = self.pool.commit_private(ids, hashes, lease_s=60.0 if leased else None,
                                         parent=parent)
        self._sync(hashes, records)
        if lease is not None:
            self.pool.release_lease(lease)

    @rule(ids=consumes(privates))
    def free_private(self, ids):
        if ids:
            self.pool.free_private(ids)
        self._sync()

    @rule(target=pins, doc=st.integers(0, 2), start=st.integers(0, 5))
    def pin(self, doc, start):
        return self.pool.pin(DOCS[doc][start:])

    @rule(handle=consumes(pins))
    def unpin(self, handle):
        if handle is not None:
            self.pool.unpin(handle)

    @invariant()
    def directory_is_the_model(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        if self.d is None:
            return
        assert findable(self.d, UNIVERSE, [self._home(h) for h in UNIVERSE]) == self.model
        assert in_table(self.d) == self.model
        assert {h: self.d.slot_of(b) // BUCKET_SLOTS for h, b in self.model.items()} == \
            self.where
        assert self.d.unpublished == self.unpublished
        for h, b in self.model.items():
            assert self.index[h] == b


DirectoryMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDirectoryMachine = DirectoryMachine.TestCase


# ------------------------------------------------------------------------------ seqlock


@pytest.mark.parametrize("again", ["same hash", "other hash"])
def test_stable_refuses_a_block_reused_between_the_reads(again):
    pool = BlockPool(4, block_size=4)
    d = pool.read_directory()
    (bid,) = cache(pool, [8])
    want, slot, block, pre, where = read(d, [8])
    assert block.tolist() == [bid]
    assert stable(pre, reread(d, where, slot), want).tolist() == [True]  # nothing changed

    assert pool.evict([8])["evicted"] == [8]
    assert pool.allocate(1) == [bid]  # the evicted block is reused at once
    # ... a writer fills it; then it is cached again, in the same slot of the same bucket
    assert pool.commit([bid], [8 if again == "same hash" else 12]) == [True]
    post = reread(d, where, slot)
    assert post[0, 1] == bid and post[0, 2] & 3 == TAG_CACHED
    if again == "same hash":  # only the seq (and the check word that covers it) differ
        assert np.array_equal(post[0, [0, 1]], pre[0, [0, 1]]) and post[0, 3] != pre[0, 3]
        assert post[0, 2] >> np.uint64(2) == (pre[0, 2] >> np.uint64(2)) + np.uint64(2)
    assert stable(pre, post, want).tolist() == [False]
    # A fresh read finds the block again and is stable until the next change.
    want2, slot2, block2, pre2, where2 = read(d, [8])
    if again == "same hash":
        assert block2.tolist() == [bid]
        assert stable(pre2, reread(d, where2, slot2), want2).tolist() == [True]
    else:
        assert slot2.tolist() == [-1]
        assert stable(pre2, reread(d, where2, slot2), want2).tolist() == [False]
    pool.release([bid])
    pool.check_invariants()


def test_stable_refuses_a_withdrawn_block():
    pool = BlockPool(4, block_size=4)
    (bid,) = cache(pool, [8])
    d = pool.read_directory()
    want, slot, _, pre, where = read(d, [8])
    pool.allocate_private(4)  # evicts every cached block
    assert stable(pre, reread(d, where, slot), want).tolist() == [False]
    assert read(d, [8])[2].tolist() == [-1]


@pytest.mark.parametrize("num_blocks", [512, 520, 8192])
def test_a_full_pool_of_chained_hashes_is_all_published(num_blocks):
    """A pool full of one prefix's blocks (a long prompt, the pull benchmark's source):
    every block is findable, so a pull of all of them reads directly."""
    from kvkern.cache.hashing import sequence_hashes  # noqa: PLC0415
    from kvkern.cache.pool import BlockPool  # noqa: PLC0415

    pool = BlockPool(num_blocks, block_size=16)
    hashes = sequence_hashes(list(range(num_blocks * 16)), 16)
    ids = pool.allocate(num_blocks)
    pool.commit(ids, hashes)
    pool.release(ids)
    d = pool.read_directory()
    assert d.unpublished == 0 and d.published == num_blocks
    homes = home_buckets(hashes, 0, num_blocks, d.buckets, d.group)
    assert findable(d, hashes, homes) == dict(zip(hashes, ids, strict=True))
    # ... in about one read of adjacent buckets per group of the chain
    from kvkern.xfer.direct import look_up_reads, read_spans  # noqa: PLC0415

    reads = read_spans(homes * BUCKET_BYTES, BUCKET_BYTES, 0)[1]
    groups = look_up_reads(0, num_blocks, d.group)
    assert groups == -(-num_blocks // d.group) and len(reads) <= groups + 2


# ---------------------------------------------------------------------- chain placement


def test_a_chain_sits_in_consecutive_buckets_when_its_parent_is_known():
    pool = BlockPool(64, block_size=4, directory_group=4)
    d = pool.read_directory()
    mask = d.buckets - 1
    a = [1000 + 97 * i for i in range(8)]

    def bucket(h):
        return d.slot_of(pool.match_prefix([h])[0]) // BUCKET_SLOTS

    cache(pool, a[:6])  # from the sequence's start
    assert [bucket(h) for h in a[:6]] == [(a[0] + i) & mask for i in range(4)] + [
        (a[4] + i) & mask for i in range(2)]
    ids = pool.allocate(1)
    pool.commit(ids, a[6:7], parent=a[5])  # the chain goes on from its parent
    pool.release(ids)
    assert bucket(a[6]) == (a[4] + 2) & mask
    pool.evict([a[6], a[5]])
    ids = pool.allocate(2)
    pool.commit(ids, a[6:8], parent=a[5])  # a parent the pool no longer holds
    pool.release(ids)
    assert [bucket(h) for h in a[6:8]] == [a[6] & mask, a[7] & mask]  # by hash alone
    homes = home_buckets(a, 0, 8, d.buckets, d.group)
    found = findable(d, a, homes)
    assert set(found) == set(a) - {a[5]}
    pool.check_invariants()
    with pytest.raises(ValueError, match="directory_group"):
        BlockPool(4, block_size=4, directory_group=0)
    with pytest.raises(ValueError, match="directory_group"):
        BlockPool(4, block_size=4, directory_group=MAX_GROUP + 1)


def test_siblings_that_fill_their_shared_home_buckets_go_to_their_plain_ones():
    """Prompts that share a group's first block and diverge after it share that group's
    home buckets: past eight of them the rest sit in their plain buckets, all findable."""
    pool = BlockPool(256, block_size=4, directory_group=16)
    d = pool.read_directory()
    root = 4096 * 7 + 3
    cache(pool, [root])
    kids = [root * 31 + k for k in range(1, 13)]  # 12 siblings at position 1
    for h in kids:
        ids = pool.allocate(1)
        pool.commit(ids, [h], parent=root)
        pool.release(ids)
    home = (root + 1) & (d.buckets - 1)
    at_home = [h for h in kids if d.slot_of(pool.match_prefix([h])[0]) // BUCKET_SLOTS == home]
    assert len(at_home) == BUCKET_SLOTS and d.unpublished == 0
    assert findable(d, kids, [home] * len(kids)) == {
        h: pool.match_prefix([h])[0] for h in kids}
    pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(chained=st.lists(st.integers(0, U64), min_size=1, max_size=90),
       data=st.data(), group=st.sampled_from([1, 3, 16]), log_buckets=st.integers(0, 12))
def test_home_buckets_loop_and_vectorized_agree(chained, data, group, log_buckets):
    start = data.draw(st.integers(0, len(chained) - 1))
    count = data.draw(st.integers(0, len(chained) - start))
    buckets = 1 << log_buckets
    want = [(chained[p - p % group] + p % group) % 2**64 & (buckets - 1)
            for p in range(start, start + count)]
    got = home_buckets(chained, start, count, buckets, group)
    assert got.dtype == np.int64 and got.tolist() == want
    # as runs of consecutive buckets within the table, in order (a group's buckets that
    # wrap past the last one, more than once where the group is larger than the table)
    runs = home_runs(chained, start, count, buckets, group)
    assert all(n > 0 and first + n <= buckets for first, n in runs)
    assert [first + i for first, n in runs for i in range(n)] == want
    for make in (home_buckets, home_runs):
        with pytest.raises(ValueError, match="beyond"):
            make(chained, start, len(chained) - start + 1, buckets, group)
