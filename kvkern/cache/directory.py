"""A read directory: an index of a block pool's cached blocks laid out for one-sided reads.

A destination finds which block of a source's pool holds a chained hash by reading this table
straight out of the source's memory (a UCX one-sided read, RDMA or CMA), with no message to
the source and no lock. The source's pool maintains it under its own lock
(:meth:`kvkern.cache.pool.BlockPool.read_directory`).

Layout
------
One C-contiguous ``uint64`` array of shape ``(buckets, BUCKET_SLOTS, SLOT_WORDS)``, 4096-byte
aligned; ``buckets`` is a power of two, so a bucket is 256 bytes and a slot 32 bytes::

    slot   [ hash | block_id | tag | check ]      tag = seq << 2 | cached << 1 | changing
                                                   check = check_word(hash, block_id, tag)

A hash ``h`` lives in any slot of its *home* bucket or, when that is full, of its *plain*
bucket ``h & (buckets - 1)``. A block whose position ``p`` in its sequence is known sits
with its chain: its home is ``(a + p % group) & (buckets - 1)``, where ``a`` is the hash at
position ``p - p % group`` (the first of its group of ``group`` positions), so the blocks of
one group sit in consecutive buckets and a reader finds ``k`` consecutive hashes in about
``k / group + 1`` reads instead of ``k``. A block of unknown position has its plain bucket
as home. A slot counts only while its tag is ``TAG_CACHED`` without ``TAG_CHANGING``.

There is a bucket per block (rounded up to a power of two), so a bucket holds one block on
average and is full (nine or more) with probability about 1e-6; a block whose home and plain
buckets are both full is left out (counted in :attr:`ReadDirectory.unpublished`) and readers
take another path for it. (Half as many buckets fill one in fifty: a 512-block pull would
then miss one of its blocks four times in five.) Prefixes that share a group's first block
share that group's home buckets: many siblings that diverge inside one group fill them, and
the rest go to their plain buckets.

Writer (the pool, under its lock; ``s`` is the slot's current seq)
------------------------------------------------------------------
* publish ``(h, b)`` into a free slot: ``tag = (s+1) << 2 | CHANGING``; ``hash = h``;
  ``block_id = b``; ``check = check_word(h, b, T)``; ``tag = T``, where
  ``T = (s+1) << 2 | CACHED``. The pool publishes a block only once its bytes are final (a
  commit).
* withdraw ``b``: ``tag = (s+1) << 2 | CHANGING``; ``hash = block_id = check = 0``;
  ``tag = (s+1) << 2``. The pool withdraws a block before it can hand it to a writer
  (allocation's eviction, :meth:`~kvkern.cache.pool.BlockPool.evict`).

Each word is written by one aligned 8-byte store, in the order above, and a publish's last
store and the block's next writer are each behind a store fence (:func:`store_fence`): a
reader never sees a cached tag before the slot's hash and block id, nor a withdrawn block's
new bytes before its slot's new tag. x86-64 keeps store order by itself (the fence is then
nothing); weakly ordered processors (Arm, POWER) get one.

Reader
------
1. Read the home buckets of the wanted hashes (:func:`home_buckets`), :func:`find` each
   hash's slot (its check word right); read the plain buckets (:func:`bucket_of`) of those
   not found there.
2. Read the found blocks' bytes.
3. Read the same slots again; keep a block iff :func:`stable`: both reads show the wanted
   hash, the same block id, the same tag and check word, the tag cached and not changing,
   and the check word right.

Why that is enough: a slot's seq goes up by one at every change, so a given cached tag value
``T`` is held by the slot over one unbroken interval, during which the slot names one block
and that block holds the final bytes of its hash and is given to no writer. Both reads
seeing ``T`` puts the block read inside that interval. A read of a slot need not see it at
one moment, only each 8-byte word whole, its words in any order (a copy's loads, an RDMA
read's fragments): it may pair ``T`` with the hash and block words of an earlier or a later
publish of the slot. Only the publish that wrote ``T`` wrote a check word that fits ``T``,
and the check word fits one hash and block id with that tag (for a given tag, distinct
pairs with the same hash or the same block give distinct words, and others collide with
probability 2**-64), so words that pass the check are that publish's own.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvkern.cache.holders import DIRECTORY_GROUP, MAX_GROUP
from kvkern.checks import check_non_negative_int, check_positive_int

__all__ = ["BUCKET_BYTES", "BUCKET_SLOTS", "DIRECTORY_GROUP", "MAX_GROUP", "SLOT_BYTES",
           "SLOT_WORDS", "TAG_CACHED", "TAG_CHANGING", "ReadDirectory", "bucket_of",
           "check_word", "entries",
           "fence_for", "find", "home_buckets", "home_runs", "slot_offsets", "stable",
           "store_fence"]

BUCKET_SLOTS = 8
SLOT_WORDS = 4  # hash, block_id, tag, check
SLOT_BYTES = SLOT_WORDS * 8
BUCKET_BYTES = BUCKET_SLOTS * SLOT_BYTES
TAG_CHANGING = 1
TAG_CACHED = 2
ALIGN = 4096

_HASH, _BLOCK, _TAG, _CHECK = 0, 1, 2, 3
# check_word's odd multipliers (each a bijection of the 64-bit words)
_K_HASH, _K_BLOCK, _K_TAG = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
# Up to this many hashes the reader's functions loop in Python, below numpy's fixed cost per
# call. A pull's critical path runs them cold, where the loops win up to about 64 items (32
# hashes, a direct read's five reader calls: 163 us looped, 227 us vectorized; hot, even).
SMALL = 32
_STATE = TAG_CACHED | TAG_CHANGING
_FULL = (1 << BUCKET_SLOTS) - 1
_U64 = (1 << 64) - 1
# Processors whose stores become visible to other processors and devices in program order.
STORE_ORDERED_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
_held = threading.local()  # each thread's own lock, held between fences


def _no_fence() -> None:
    """Nothing: the processor keeps store order."""


def _lock_fence() -> None:
    """Release then acquire a lock this thread holds: a release followed by an acquire is a
    full fence on Arm (RCsc) and POWER, and Python offers no other."""
    lock = getattr(_held, "lock", None)
    if lock is None:
        lock = _held.lock = threading.Lock()
        lock.acquire()
    lock.release()
    lock.acquire()


def fence_for(machine: str) -> Callable[[], None]:
    """The store fence for a processor named as :func:`platform.machine` names it."""
    return _no_fence if machine.lower() in STORE_ORDERED_MACHINES else _lock_fence


# Every store issued before it becomes visible before every store issued after it (to other
# processes and to devices, whatever reads this memory).
store_fence = fence_for(platform.machine())


class ReadDirectory:
    """The directory of a pool of ``num_blocks`` blocks: which slot names which block.

    :attr:`table` is the memory readers read; :meth:`publish` and :meth:`withdraw` are its
    only writers. Not thread-safe: the owning pool's lock guards every call."""

    __slots__ = ("_num_blocks", "_group", "_buckets", "_buffer", "table", "_words", "_used",
                 "_slot_of", "_hash_of", "_home_of", "_unpublished", "_published")

    def __init__(self, num_blocks: int, group: int = DIRECTORY_GROUP) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("group", group)
        if group > MAX_GROUP:
            raise ValueError(f"group must be at most {MAX_GROUP}, got {group}")
        self._num_blocks = num_blocks
        self._group = group
        self._buckets = 1 << (num_blocks - 1).bit_length()  # a bucket per block (module doc)
        nbytes = self._buckets * BUCKET_BYTES
        self._buffer = np.zeros(nbytes + ALIGN, dtype=np.uint8)
        start = -self._buffer.ctypes.data % ALIGN
        self.table = self._buffer[start:start + nbytes].view(np.uint64).reshape(
            self._buckets, BUCKET_SLOTS, SLOT_WORDS)
        # The writer reaches the table's words (word 4 * flat_slot + k) and its per-block
        # arrays through memoryviews, not numpy scalars: 1.4-1.9 us a publish against 1.9-2.1.
        self._words = _words_of(self.table.reshape(-1))
        self._used = [0] * self._buckets  # per bucket, a bit per slot holding a block
        # per block: its flat slot and home bucket (-1) and its hash (0), while published
        self._slot_of = _words_of(np.full(num_blocks, -1, dtype=np.int64))
        self._hash_of = _words_of(np.zeros(num_blocks, dtype=np.uint64))
        self._home_of = _words_of(np.full(num_blocks, -1, dtype=np.int64))
        self._unpublished = 0
        self._published = 0

    # ------------------------------------------------------------------------- properties

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def group(self) -> int:
        """Positions per group of a chain placed in consecutive buckets (module docstring)."""
        return self._group

    @property
    def buckets(self) -> int:
        """Buckets in the table (a power of two)."""
        return self._buckets

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    @property
    def address(self) -> int:
        """Address of the table's first byte (4096-byte aligned), valid for this object's
        lifetime."""
        return self.table.ctypes.data

    @property
    def unpublished(self) -> int:
        """Publishes that found their bucket full (those blocks are not findable)."""
        return self._unpublished

    @property
    def published(self) -> int:
        """Slots naming a block now."""
        return self._published

    def slot_of(self, block_id: int) -> int:
        """The flat slot (``bucket * BUCKET_SLOTS + slot``) naming ``block_id``, or -1."""
        return self._slot_of[self._check_block(block_id)]

    def slot_address(self, flat_slot: int) -> int:
        """Address of a flat slot's first word."""
        check_non_negative_int("flat_slot", flat_slot)
        if flat_slot >= self._buckets * BUCKET_SLOTS:
            raise ValueError(f"flat_slot {flat_slot} out of range for "
                             f"{self._buckets * BUCKET_SLOTS} slots")
        return self.address + flat_slot * SLOT_BYTES

    # ---------------------------------------------------------------------------- writer

    def publish(self, block_id: int, h: int, chain: tuple[int, int] | None = None) -> bool:
        """Name ``block_id`` under hash ``h`` in a free slot of its home bucket, else of its
        plain bucket; ``chain`` is the block's ``(position, anchor)``
        (:func:`kvkern.cache.holders.chain_records`), None when unknown. False (and counted
        in :attr:`unpublished`) when both are full; ValueError if the block already holds a
        slot."""
        bid = self._check_block(block_id)
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= _U64:
            raise ValueError(f"hash must be an int in [0, 2**64), got {h!r}")
        if self._slot_of[bid] >= 0:
            raise ValueError(f"block {bid} is already published under hash "
                             f"{self._hash_of[bid]} (slot {self._slot_of[bid]})")
        home = self._home(h, chain)
        bucket = home
        used = self._used[bucket]
        if used == _FULL:
            bucket = h & (self._buckets - 1)
            used = self._used[bucket]
            if used == _FULL:
                self._unpublished += 1
                return False
        j = (~used & (used + 1)).bit_length() - 1  # lowest free slot
        flat = bucket * BUCKET_SLOTS + j
        w = self._words
        base = flat * SLOT_WORDS
        seq = (w[base + _TAG] >> 2) + 1
        tag = seq << 2 | TAG_CACHED
        w[base + _TAG] = seq << 2 | TAG_CHANGING
        w[base + _HASH] = h
        w[base + _BLOCK] = bid
        w[base + _CHECK] = check_word(h, bid, tag)
        store_fence()  # (the slot's other words before its cached tag)
        w[base + _TAG] = tag
        self._used[bucket] = used | 1 << j
        self._slot_of[bid] = flat
        self._hash_of[bid] = h
        self._home_of[bid] = home
        self._published += 1
        return True

    def withdraw_hash(self, h: int | None) -> list[int]:
        """Withdraw every block published under hash ``h`` (a hash that no longer names one
        content; None: every block); the block ids withdrawn."""
        published = np.frombuffer(self._slot_of, dtype=np.int64) >= 0
        if h is not None:
            published &= np.frombuffer(self._hash_of, dtype=np.uint64) == np.uint64(h)
        ids = np.flatnonzero(published).tolist()
        for bid in ids:
            self.withdraw(bid)
        return ids

    def withdraw(self, block_id: int) -> None:
        """Clear the slot naming ``block_id``, if it holds one."""
        bid = self._check_block(block_id)
        flat = self._slot_of[bid]
        if flat < 0:
            return
        w = self._words
        base = flat * SLOT_WORDS
        seq = (w[base + _TAG] >> 2) + 1
        w[base + _TAG] = seq << 2 | TAG_CHANGING
        # (changing before the slot's words change: else a weakly ordered processor may show
        # a reader the old hash and cached tag with the block word zeroed)
        store_fence()
        w[base + _HASH] = 0
        w[base + _BLOCK] = 0
        w[base + _CHECK] = 0
        w[base + _TAG] = seq << 2
        store_fence()  # (the new tag before anything the block's next writer stores)
        bucket, j = divmod(flat, BUCKET_SLOTS)
        self._used[bucket] &= ~(1 << j)
        self._slot_of[bid] = -1
        self._hash_of[bid] = 0
        self._home_of[bid] = -1
        self._published -= 1

    def _home(self, h: int, chain: tuple[int, int] | None) -> int:
        """The home bucket of hash ``h`` at ``chain`` (``(position, anchor)``, None: unknown)."""
        mask = self._buckets - 1
        return h & mask if chain is None else (chain[1] + chain[0] % self._group) & mask

    def _check_block(self, block_id: int) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not (
                0 <= block_id < self._num_blocks):
            raise ValueError(f"block id {block_id!r} out of range for a directory of "
                             f"{self._num_blocks} blocks")
        return block_id

    # -------------------------------------------------------------------------- checking

    def check(self, index: dict[int, int],
              chains: dict[int, tuple[int, int] | None] | None = None) -> None:
        """Raise AssertionError naming the first disagreement with ``index`` (``{hash:
        block_id}``, the pool's prefix index): every slot in use names a block indexed under
        its hash, in that hash's home or plain bucket, with its check word, and is the
        block's recorded slot; every block with a slot is indexed under its hash (and, given
        ``chains``, ``{block_id: chain}``, has the home its chain record gives); free slots
        are zero but for their tag; no tag is changing."""
        t = self.table
        tags = t[:, :, _TAG]
        if np.any(tags & TAG_CHANGING):
            raise AssertionError(f"changing tags at flat slots "
                                 f"{np.flatnonzero(tags & TAG_CHANGING).tolist()}")
        cached = (tags & TAG_CACHED) != 0
        free = t[~cached]
        if np.any(free[:, [_HASH, _BLOCK, _CHECK]]):
            raise AssertionError("a free slot's hash, block or check word is not zero")
        if np.any(t[cached][:, _CHECK] != _checks(t[cached])):
            raise AssertionError("a slot in use has a check word that does not fit it")
        masks = (cached.astype(np.int64) << np.arange(BUCKET_SLOTS)).sum(axis=1)
        wrong = np.flatnonzero(masks != np.array(self._used, dtype=np.int64))
        if len(wrong):
            b = int(wrong[0])
            raise AssertionError(f"bucket {b}: slots in use {int(masks[b]):#x}, recorded "
                                 f"{self._used[b]:#x}")
        flats = np.flatnonzero(cached.reshape(-1))
        if len(flats) != self._published:
            raise AssertionError(f"{len(flats)} slots in use, {self._published} counted")
        for flat in flats.tolist():
            h, bid = self._words[flat * SLOT_WORDS:flat * SLOT_WORDS + 2].tolist()
            if index.get(h) != bid:
                raise AssertionError(f"slot {flat} names block {bid} under hash {h}; the "
                                     f"index has {index.get(h)}")
            if bid >= self._num_blocks or self._slot_of[bid] != flat:
                raise AssertionError(f"slot {flat} names block {bid}, whose recorded slot "
                                     f"is not it")
            if flat // BUCKET_SLOTS not in (h & (self._buckets - 1), self._home_of[bid]):
                raise AssertionError(f"slot {flat}: hash {h} outside its home and plain "
                                     f"buckets")
        for bid in np.flatnonzero(np.asarray(self._slot_of) >= 0).tolist():
            h = self._hash_of[bid]
            if index.get(h) != bid:
                raise AssertionError(f"block {bid} is published under hash {h}; the index "
                                     f"has {index.get(h)}")
            if chains is not None:
                c = chains.get(bid)
                home = self._home(h, c)
                if self._home_of[bid] != home:
                    raise AssertionError(f"block {bid} (chain {c}) has home bucket "
                                         f"{self._home_of[bid]}, not {home}")


def check_word(h: int, block_id: int, tag: int) -> int:
    """A slot's check word: of its hash, block id and tag, as one publish writes them."""
    return ((h * _K_HASH) ^ (block_id * _K_BLOCK) ^ (tag * _K_TAG)) & _U64


def _checks(slots: np.ndarray) -> np.ndarray:
    """:func:`check_word` of each slot of a uint64 array whose last axis is a slot's words."""
    with np.errstate(over="ignore"):
        return ((slots[..., _HASH] * np.uint64(_K_HASH))
                ^ (slots[..., _BLOCK] * np.uint64(_K_BLOCK))
                ^ (slots[..., _TAG] * np.uint64(_K_TAG)))


def _words_of(a: np.ndarray) -> memoryview:
    """A memoryview of the 1-D 64-bit array ``a`` whose items are Python ints."""
    return memoryview(a.view(np.uint8)).cast("q" if a.dtype == np.int64 else "Q")


# ------------------------------------------------------------------------------- reader


def bucket_of(hashes: np.ndarray, buckets: int) -> np.ndarray:
    """The bucket of each hash in a table of ``buckets`` buckets (int64)."""
    check_positive_int("buckets", buckets)
    if buckets & (buckets - 1):
        raise ValueError(f"buckets must be a power of two, got {buckets}")
    hs = np.asarray(hashes, dtype=np.uint64)
    if hs.ndim == 1 and len(hs) <= SMALL:  # (below numpy's fixed cost per call)
        return np.array([h & (buckets - 1) for h in hs.tolist()], np.int64)
    return (hs & np.uint64(buckets - 1)).astype(np.int64)


def _check_positions(chained: Sequence[int], start: int, count: int, buckets: int,
                     group: int) -> None:
    check_positive_int("buckets", buckets)
    check_positive_int("group", group)
    check_non_negative_int("start", start)
    check_non_negative_int("count", count)
    if buckets & (buckets - 1):
        raise ValueError(f"buckets must be a power of two, got {buckets}")
    if start + count > len(chained):
        raise ValueError(f"positions {start}..{start + count} beyond {len(chained)} hashes")


def home_buckets(chained: Sequence[int], start: int, count: int, buckets: int,
                 group: int) -> np.ndarray:
    """The home bucket of each of ``chained[start:start + count]`` (int64), where
    ``chained[p]`` is the hash at position ``p`` of a sequence, in a table of ``buckets``
    buckets that places ``group`` positions together (module docstring)."""
    _check_positions(chained, start, count, buckets, group)
    mask = buckets - 1
    if count <= SMALL:  # (below numpy's fixed cost per call)
        return np.array([(int(chained[p - p % group]) + p % group) & mask
                         for p in range(start, start + count)], np.int64)
    first = start - start % group
    pos = np.arange(start, start + count, dtype=np.int64)
    anchors = np.asarray(chained[first:start + count], dtype=np.uint64)[pos - pos % group - first]
    return ((anchors + (pos % group).astype(np.uint64)) & np.uint64(mask)).astype(np.int64)


def home_runs(chained: Sequence[int], start: int, count: int, buckets: int,
              group: int) -> list[tuple[int, int]]:
    """:func:`home_buckets` as runs of consecutive buckets, in order: ``(first bucket,
    length)`` per group of positions (more where its buckets wrap past the table's end).
    Same checks; no array is made."""
    _check_positions(chained, start, count, buckets, group)
    mask, end, runs = buckets - 1, start + count, []
    for g0 in range(start - start % group, end, group):
        lo, hi = max(start, g0), min(end, g0 + group)
        first, n = (int(chained[g0]) + lo - g0) & mask, hi - lo
        while n:  # (a run wraps past the last bucket to the first)
            take = min(n, buckets - first)
            runs.append((first, take))
            first, n = 0, n - take
    return runs


def slot_offsets(buckets: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Byte offsets in the table of slot ``slots[i]`` of bucket ``buckets[i]`` (int64);
    ValueError for a slot outside ``[0, BUCKET_SLOTS)`` (such as find's -1) or a negative
    bucket."""
    b = np.asarray(buckets, dtype=np.int64)
    s = np.asarray(slots, dtype=np.int64)
    if b.shape != s.shape:
        raise ValueError(f"{b.shape} buckets but {s.shape} slots")
    if b.ndim == 1 and len(b) <= SMALL:  # (below numpy's fixed cost per call)
        bl, sl = b.tolist(), s.tolist()
        if not all(0 <= x < BUCKET_SLOTS for x in sl) or not all(x >= 0 for x in bl):
            raise ValueError(f"slots must be in [0, {BUCKET_SLOTS}) and buckets >= 0")
        return np.array([(x * BUCKET_SLOTS + y) * SLOT_BYTES
                         for x, y in zip(bl, sl, strict=True)], np.int64)
    if np.any((s < 0) | (s >= BUCKET_SLOTS)) or np.any(b < 0):
        raise ValueError(f"slots must be in [0, {BUCKET_SLOTS}) and buckets >= 0")
    return (b * BUCKET_SLOTS + s) * SLOT_BYTES


def _rows(rows: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = np.asarray(rows)
    w = np.asarray(want, dtype=np.uint64)
    if r.dtype != np.uint64 or r.ndim != 3 or r.shape[1:] != (BUCKET_SLOTS, SLOT_WORDS):
        raise ValueError(f"rows must be uint64 of shape (k, {BUCKET_SLOTS}, {SLOT_WORDS}), "
                         f"got {r.dtype} {r.shape}")
    if w.shape != (r.shape[0],):
        raise ValueError(f"{r.shape[0]} bucket rows but want has shape {w.shape}")
    return r, w


def find(rows: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Look each ``want[i]`` up in ``rows[i]``, a copy of its bucket.

    Returns per hash the slot in its bucket (int64, -1 when absent), the block id (int64, -1
    when absent) and the slot's tag (uint64, 0 when absent). A slot matches when its hash is
    ``want[i]``, its tag is cached and not changing and its check word fits it; of several,
    the first."""
    r, w = _rows(rows, want)
    return _find_small(r, w) if len(w) <= SMALL else _find_numpy(r, w)


def _find_small(r: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    slots, blocks, tags = [], [], []
    for bucket, h in zip(r.tolist(), w.tolist(), strict=True):
        for i, (sh, sb, st, sc) in enumerate(bucket):
            if sh == h and st & _STATE == TAG_CACHED and sc == check_word(sh, sb, st):
                slots.append(i)
                blocks.append(sb - (1 << 64) if sb >> 63 else sb)  # as int64, like numpy's
                tags.append(st)
                break
        else:
            slots.append(-1)
            blocks.append(-1)
            tags.append(0)
    return (np.array(slots, np.int64), np.array(blocks, np.int64),
            np.array(tags, np.uint64))


def _find_numpy(r: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    match = r[:, :, _HASH] == w[:, None]
    match &= (r[:, :, _TAG] & np.uint64(_STATE)) == np.uint64(TAG_CACHED)
    match &= r[:, :, _CHECK] == _checks(r)
    slot = match.argmax(axis=1).astype(np.int64, copy=False)  # (0 where none matches)
    at = np.arange(len(w))
    picked = r[at, slot]
    block, tag = picked[:, _BLOCK].astype(np.int64), picked[:, _TAG]
    hit = match[at, slot]
    if hit.all():  # (every hash found: the usual look-up)
        return slot, block, tag
    miss = ~hit
    slot[miss], block[miss], tag[miss] = -1, -1, 0
    return slot, block, tag


def entries(rows: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """The words of slot ``slot[i]`` of ``rows[i]``, shape ``(k, SLOT_WORDS)``; zeros where
    ``slot[i]`` is -1."""
    r = np.asarray(rows)
    s = np.asarray(slot, dtype=np.int64)
    if r.dtype != np.uint64 or r.ndim != 3 or r.shape[1:] != (BUCKET_SLOTS, SLOT_WORDS):
        raise ValueError(f"rows must be uint64 of shape (k, {BUCKET_SLOTS}, {SLOT_WORDS}), "
                         f"got {r.dtype} {r.shape}")
    small = len(s) <= SMALL
    if s.shape != (r.shape[0],) or (
            not all(-1 <= x < BUCKET_SLOTS for x in s.tolist()) if small
            else np.any((s < -1) | (s >= BUCKET_SLOTS))):
        raise ValueError(f"slot must hold {r.shape[0]} values in [-1, {BUCKET_SLOTS})")
    if small:
        out = np.zeros((len(s), SLOT_WORDS), np.uint64)
        for i, x in enumerate(s.tolist()):
            if x >= 0:
                out[i] = r[i, x]
        return out
    out = r[np.arange(len(s)), np.maximum(s, 0)].copy()
    out[s < 0] = 0
    return out


def stable(pre: np.ndarray, post: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Which reads to keep: ``pre[i]`` and ``post[i]`` are the words of the slot found for
    ``want[i]``, read before and after its block's bytes. True iff both are identical, name
    ``want[i]``, and their tag is cached and not changing and their check word fits them."""
    a = np.asarray(pre)
    b = np.asarray(post)
    w = np.asarray(want, dtype=np.uint64)
    if w.ndim != 1:
        raise ValueError(f"want must be one-dimensional, got shape {w.shape}")
    for name, x in (("pre", a), ("post", b)):
        if x.dtype != np.uint64 or x.shape != (len(w), SLOT_WORDS):
            raise ValueError(f"{name} must be uint64 of shape ({len(w)}, {SLOT_WORDS}), got "
                             f"{x.dtype} {x.shape}")
    if len(w) <= SMALL:
        return np.array([x == y and h == x[_HASH] and x[_TAG] & _STATE == TAG_CACHED
                         and x[_CHECK] == check_word(*x[:_CHECK])
                         for x, y, h in zip(a.tolist(), b.tolist(), w.tolist(), strict=True)],
                        dtype=bool).reshape(len(w))
    return ((a == b).all(axis=1) & (a[:, _HASH] == w)
            & ((a[:, _TAG] & np.uint64(_STATE)) == np.uint64(TAG_CACHED))
            & (a[:, _CHECK] == _checks(a)))
