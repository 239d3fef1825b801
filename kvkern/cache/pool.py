"""Reference paged block pool: reference counts, an O(1) LRU free queue, a prefix index over
chained block hashes, pins for sends, private receive blocks and retention leases.

The pool manages block *ids* only; the KV tensor lives with the engine or worker.

Who holds a block
-----------------
A block is *held* while any of these is non-zero / set, and is in the free queue otherwise:

=============  =========================================  ===================================
holder         taken by                                   dropped by
=============  =========================================  ===================================
``ref_cnt``    allocate, acquire_prefix, claim            release
``pin_cnt``    pin (a send on the source)                 unpin
``lease_cnt``  commit_private(lease_s=...)                claim, release_lease, expiry
``private``    allocate_private                           commit_private, free_private
=============  =========================================  ===================================

Free queue
----------
An intrusive doubly linked list of the unheld blocks. Uncached blocks sit at the head, cached
(evictable) blocks behind them in least-recently-released order::

    head -> [u u u][c_lru ... c_mru] <- tail
            uncached  cached, evicted from the left

Allocation pops from the head, so an uncached block is always used before a cached block is
evicted; eviction removes the block's hash from the index. A released cached block goes to the
tail, an uncached one to the head. Releasing a request's blocks walks them last to first, so a
prefix's tail is evicted before its root and lookups (leading runs) lose as little as possible.

Prefix index
------------
``dict[chained hash -> block]``. A chained hash names a whole prefix, so a lookup is the
longest leading run of hits. Private blocks are absent until committed. When a committed hash
is already cached by another block, the existing block stays canonical and the new one stays
uncached (it returns to the free queue once unheld).

Leases
------
``commit_private(..., lease_s=...)`` publishes received blocks and leases them in one step, so
nothing can evict them before the waiting request runs. The request calls :meth:`claim` (the
lease becomes references it releases like any other) or :meth:`release_lease`; otherwise the
lease expires ``lease_s`` after commit on the injectable ``clock`` and its blocks become
evictable cached blocks. Expiry is applied lazily at the start of every call.

The bookkeeping units are in :mod:`kvkern.cache.holders` (the block table with the free queue
and the index, the pin table, the lease table); this class is the locked, checked API over
them.

Read directory
--------------
:meth:`BlockPool.read_directory` adds a table of the cached blocks that peers read with
one-sided reads, without a message and without this lock (:mod:`kvkern.cache.directory`
gives its layout and the reader's check). Once created it follows every change of the index.
It places each chain's blocks ``directory_group`` at a time in consecutive buckets, which
needs each block's position in its sequence: a commit's ``parent`` (the hash before its
first one, ``None`` at a sequence's start) continues the position recorded for the parent's
block.

Thread safety: one lock around every public method. Misuse raises ``ValueError`` naming the
values and changes nothing; running out of blocks returns ``None``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvkern.cache.hashing import DEFAULT_SCHEME, get_scheme, normalize_hashes
from kvkern.cache.holders import (
    DIRECTORY_GROUP,
    MAX_GROUP,
    Block,
    BlockTable,
    LeaseTable,
    PinTable,
    chain_records,
    check_invariants,
)
from kvkern.cache.protocol import Lease, PinHandle
from kvkern.checks import check_finite_positive, check_non_negative_int, check_positive_int

if TYPE_CHECKING:
    from kvkern.cache.directory import ReadDirectory

__all__ = ["BlockPool"]


class BlockPool:
    """A paged block pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Implements :class:`kvkern.cache.protocol.KVCacheManager` plus the engine-facing calls a
    worker needs (``allocate``, ``match_prefix``, ``acquire_prefix``, ``commit``,
    ``release``). See the module docstring for the holders and the free-queue order;
    ``directory_group`` is how many positions of a chain the read directory places
    together.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int,
        hash_scheme: str = DEFAULT_SCHEME,
        clock: Callable[[], float] = time.monotonic,
        lease_history: int = 4096,
        directory_group: int = DIRECTORY_GROUP,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        check_positive_int("directory_group", directory_group)
        if directory_group > MAX_GROUP:
            raise ValueError(f"directory_group must be at most {MAX_GROUP}, got "
                             f"{directory_group}")
        get_scheme(hash_scheme)  # unknown names raise, listing the known ones
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._hash_scheme = hash_scheme
        self._lock = threading.Lock()
        self._table = BlockTable(num_blocks, directory_group)
        self._pins = PinTable(self._table)
        self._leases = LeaseTable(self._table, clock, lease_history)

    # ------------------------------------------------------------------ properties, counters

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_scheme(self) -> str:
        return self._hash_scheme

    @property
    def num_free(self) -> int:
        """Blocks in the free queue (uncached, or cached and evictable)."""
        with self._lock:
            self._leases.expire()
            return len(self._table.free)

    @property
    def num_used(self) -> int:
        """Held blocks: ``num_free + num_used == num_blocks``."""
        with self._lock:
            self._leases.expire()
            return self._num_blocks - len(self._table.free)

    @property
    def num_pinned(self) -> int:
        """Blocks pinned by at least one send."""
        with self._lock:
            self._leases.expire()
            return self._pins.num_pinned

    @property
    def num_leased(self) -> int:
        """Blocks held by at least one live lease."""
        with self._lock:
            self._leases.expire()
            return self._leases.num_leased

    @property
    def num_private(self) -> int:
        with self._lock:
            return self._table.num_private

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index (held or evictable)."""
        with self._lock:
            self._leases.expire()
            return len(self._table.index)

    def stats(self) -> dict[str, int]:
        """A snapshot of counts and cumulative counters, for metrics and leak checks.

        After every request has finished, ``pinned``, ``pins``, ``leased``, ``leases``,
        ``private`` and ``referenced`` must all be 0 and ``free == blocks``."""
        with self._lock:
            self._leases.expire()
            table = self._table
            referenced = sum(1 for b in table.blocks if b.ref_cnt)
            return {
                "blocks": self._num_blocks,
                "free": len(table.free),
                "used": self._num_blocks - len(table.free),
                "cached": len(table.index),
                "referenced": referenced,
                "pinned": self._pins.num_pinned,
                "pins": len(self._pins.handles),
                "leased": self._leases.num_leased,
                "leases": len(self._leases.leases),
                "private": table.num_private,
                **table.counters,
            }

    # ------------------------------------------------------------------------- lookups

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` that are cached. Read-only."""
        with self._lock:
            self._leases.expire()
            return len(self._table.run(hashes))

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached leading run of ``hashes``. Read-only: another
        thread may evict them afterwards; use :meth:`acquire_prefix` to hold them."""
        with self._lock:
            self._leases.expire()
            return [b.block_id for b in self._table.run(hashes)]

    def acquire_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Like :meth:`match_prefix`, and take one reference on each block atomically (a
        cached free block leaves the free queue). Give them back with :meth:`release`."""
        with self._lock:
            self._leases.expire()
            run = self._table.run(hashes)
            for b in run:
                self._table.take(b)
                b.ref_cnt += 1
            return [b.block_id for b in run]

    # ---------------------------------------------------------------------- engine calls

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with one reference each, evicting LRU cached blocks if needed;
        ``None`` (nothing taken) if fewer than ``n`` blocks are free."""
        return self._allocate(n, private=False)

    def commit(self, block_ids: Sequence[int], hashes: Sequence[int], *,
               parent: int | None = None) -> list[bool]:
        """Publish full blocks a request holds (``ref_cnt > 0``) under their chained hashes.

        Returns, per block, whether it is now the canonical block for its hash; ``False``
        means another block already caches that prefix (this one stays uncached). Committing
        a block again under the same hash is a no-op; under another hash it raises.

        ``parent`` is the chained hash of the block before ``hashes[0]`` in its sequence,
        ``None`` when ``hashes[0]`` is a sequence's first block. It places the blocks in the
        read directory (:func:`~kvkern.cache.holders.chain_records`) and changes nothing
        else: a wrong one only makes peers' direct reads of these blocks fall back to a
        grant."""
        with self._lock:
            self._leases.expire()
            blocks = self._table.lookup(block_ids, allow_repeats=False)
            hs = self._hashes_for(blocks, hashes)
            for b, h in zip(blocks, hs, strict=True):
                if b.ref_cnt <= 0 or b.private:
                    raise ValueError(
                        f"commit of block {b.block_id} that no request holds "
                        f"(ref_cnt {b.ref_cnt}, private {b.private})"
                    )
                if b.block_hash is not None and b.block_hash != h:
                    raise ValueError(
                        f"block {b.block_id} already committed under hash {b.block_hash}, "
                        f"not {h}"
                    )
            chains = chain_records(self._table.index, hs, parent, self._table.group)
            return [self._table.publish(b, h, c) is b
                    for b, h, c in zip(blocks, hs, chains, strict=True)]

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block (a request finished or was preempted). Blocks
        are walked last to first; an unheld cached block goes to the free-queue tail, an
        unheld uncached one to the head."""
        with self._lock:
            self._leases.expire()
            blocks = self._table.lookup(block_ids, allow_repeats=True)
            need: dict[int, int] = {}
            for b in blocks:
                need[b.block_id] = need.get(b.block_id, 0) + 1
            for bid, k in need.items():
                have = self._table.blocks[bid].ref_cnt
                if have < k:
                    raise ValueError(
                        f"release of block {bid} {k} time(s) but its ref_cnt is {have} "
                        "(double free?)"
                    )
            for b in reversed(blocks):
                b.ref_cnt -= 1
                self._table.maybe_free(b)

    def evict(self, hashes: Sequence[int]) -> dict[str, list[int]]:
        """Drop the named cached blocks from the index now, as LRU eviction would (an
        operator flush, or a test making hints stale). Held blocks (referenced, pinned,
        leased) stay. Returns the hashes ``evicted``, ``held`` and ``absent``."""
        with self._lock:
            self._leases.expire()
            return self._table.evict(hashes)

    # ------------------------------------------------------------------ transfer protocol

    def allocate_private(self, n: int) -> list[int] | None:
        """``n`` private receive blocks, invisible to lookups until :meth:`commit_private`;
        ``None`` (nothing taken) if fewer than ``n`` blocks are free."""
        return self._allocate(n, private=True)

    def _allocate(self, n: int, *, private: bool) -> list[int] | None:
        """Pop ``n`` free blocks (evicting LRU cached ones) as request blocks with one
        reference each, or as private receive blocks; ``None`` and nothing taken if short."""
        self._check_count(n)
        with self._lock:
            self._leases.expire()
            blocks = self._table.pop_free(n)
            if blocks is None:
                return None
            for b in blocks:
                if private:
                    b.private = True
                else:
                    b.ref_cnt = 1
            if private:
                self._table.num_private += n
            return [b.block_id for b in blocks]

    def free_private(self, block_ids: Sequence[int]) -> None:
        """Return private blocks that will not be committed to the free-queue head."""
        with self._lock:
            blocks = self._table.lookup(block_ids, allow_repeats=False)
            self._check_private(blocks, "free_private")
            for b in blocks:
                b.private = False
                self._table.num_private -= 1
                self._table.maybe_free(b)

    def commit_private(
        self, block_ids: Sequence[int], hashes: Sequence[int], *, lease_s: float | None,
        parent: int | None = None,
    ) -> Lease | None:
        """Publish received private blocks under their chained hashes and, with ``lease_s``,
        lease the canonical blocks until claimed, released or ``lease_s`` has passed.
        ``parent`` is as in :meth:`commit`.

        A hash that is already cached keeps its existing block (which the lease then holds);
        the received duplicate goes back to the free queue uncached. Returns the lease, or
        ``None`` when ``lease_s`` is ``None`` (blocks become evictable cached blocks)."""
        if lease_s is not None:
            check_finite_positive("lease_s", lease_s)
        with self._lock:
            self._leases.expire()
            blocks = self._table.lookup(block_ids, allow_repeats=False)
            hs = self._hashes_for(blocks, hashes)
            self._check_private(blocks, "commit_private")
            canonical: list[Block] = []
            chains = chain_records(self._table.index, hs, parent, self._table.group)
            for b, h, c in zip(blocks, hs, chains, strict=True):
                b.private = False
                self._table.num_private -= 1
                canonical.append(self._table.publish(b, h, c))
            if lease_s is None:
                for b in reversed(blocks):
                    self._table.maybe_free(b)
                return None
            lease = self._leases.grant(canonical, hs, lease_s)
            for b in blocks:  # duplicates that lost to an existing block
                self._table.maybe_free(b)
            return lease

    def claim(self, lease: Lease) -> list[int] | None:
        """Convert a live lease into one reference per block, held by the caller; ``None``
        if the lease already expired. Claiming twice, or after release, raises."""
        with self._lock:
            self._leases.expire()
            live = self._leases.live(lease, "claim")
            if live is None:
                return None
            for bid in live.block_ids:
                self._table.blocks[bid].ref_cnt += 1
            self._leases.end(live, "claimed")
            return list(live.block_ids)

    def release_lease(self, lease: Lease) -> None:
        """Drop a lease without claiming it; its blocks become evictable cached blocks.
        Releasing a lease that already expired is a no-op; twice, or after a claim, raises."""
        with self._lock:
            self._leases.expire()
            live = self._leases.live(lease, "release")
            if live is not None:
                self._leases.end(live, "released")

    def pin(self, hashes: Sequence[int], *, require_all: bool = False) -> PinHandle | None:
        """Pin the blocks of the longest cached leading run of ``hashes`` for one send.

        A cached block with no other holder is claimed out of the free queue, so eviction
        cannot reuse it while it is being read. ``None`` when nothing was pinned: no leading
        hash is cached, or ``require_all`` and fewer than ``len(hashes)`` are."""
        with self._lock:
            self._leases.expire()
            hs = normalize_hashes(hashes)
            run = self._table.run(hs)
            if not run or (require_all and len(run) < len(hs)):
                return None
            return self._pins.pin(run, hs[: len(run)])

    def unpin(self, handle: PinHandle) -> None:
        """Release the pins of one :meth:`pin`; a second unpin of the same handle raises."""
        with self._lock:
            live = self._pins.check_live(handle)
            self._leases.expire()
            self._pins.unpin(live)

    # --------------------------------------------------------------------- read directory

    def read_directory(self) -> ReadDirectory:
        """The pool's :class:`~kvkern.cache.directory.ReadDirectory`, created on the first
        call with every block cached then, and kept up to date by every call after it; later
        calls return the same object. Its memory (``address``, ``nbytes``) stays valid for the
        pool's lifetime, so it can be registered once for one-sided reads."""
        with self._lock:
            if self._table.directory is None:
                # numpy is loaded only by pools that serve one-sided reads
                from kvkern.cache.directory import ReadDirectory

                directory = ReadDirectory(self._num_blocks, self._table.group)
                for h, b in self._table.index.items():
                    directory.publish(b.block_id, h, b.chain)
                self._table.directory = directory
            return self._table.directory

    # -------------------------------------------------------------------------- internals

    @staticmethod
    def _check_count(n: int) -> None:
        check_non_negative_int("block count", n)

    @staticmethod
    def _hashes_for(blocks: list[Block], hashes: Sequence[int]) -> list[int]:
        hs = normalize_hashes(hashes)
        if len(hs) != len(blocks):
            raise ValueError(f"{len(blocks)} block ids but {len(hs)} hashes")
        if len(set(hs)) != len(hs):
            raise ValueError(f"duplicate hashes in one commit: {hs}")
        return hs

    @staticmethod
    def _check_private(blocks: list[Block], what: str) -> None:
        for b in blocks:
            if not b.private:
                raise ValueError(f"{what} of block {b.block_id} that is not private ({b!r})")

    # -------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (for tests and debugging).

        * the free queue's links agree; its blocks are unheld, uncached ones before cached;
        * every unheld block is in the free queue (free + used == total);
        * no count is negative; the counters match a recount;
        * ``block_hash`` set <=> indexed under that hash; private blocks are not indexed;
        * pin and lease counts equal the live handles and leases naming each block;
        * the read directory, once created, agrees with the index (see
          :meth:`kvkern.cache.directory.ReadDirectory.check`).
        """
        with self._lock:
            check_invariants(self._table, self._pins, self._leases)
