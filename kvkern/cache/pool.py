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

Thread safety: one lock around every public method. Misuse raises ``ValueError`` naming the
values and changes nothing; running out of blocks returns ``None``.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvkern.cache.hashing import DEFAULT_SCHEME, get_scheme, normalize_hashes
from kvkern.cache.protocol import Lease, PinHandle

__all__ = ["BlockPool"]


class _Block:
    """Bookkeeping of one block. ``prev``/``next`` belong to the free queue alone."""

    __slots__ = ("block_id", "ref_cnt", "pin_cnt", "lease_cnt", "private", "block_hash",
                 "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.pin_cnt = 0
        self.lease_cnt = 0
        self.private = False
        self.block_hash: int | None = None
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def held(self) -> bool:
        return bool(self.ref_cnt or self.pin_cnt or self.lease_cnt or self.private)

    def __repr__(self) -> str:
        return (f"_Block(id={self.block_id}, ref={self.ref_cnt}, pin={self.pin_cnt}, "
                f"lease={self.lease_cnt}, private={self.private}, hash={self.block_hash})")


class _FreeQueue:
    """Intrusive doubly linked list between two sentinels; every operation is O(1).

    A block is in the queue iff its ``prev`` is not ``None``."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Sequence[_Block]) -> None:
        self._head = _Block(-1)
        self._tail = _Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def _link(self, b: _Block, before: _Block) -> None:
        after = before.next
        assert after is not None and b.prev is None and b.next is None
        b.prev, b.next = before, after
        before.next = b
        after.prev = b
        self._len += 1

    def append(self, b: _Block) -> None:
        assert self._tail.prev is not None
        self._link(b, self._tail.prev)

    def appendleft(self, b: _Block) -> None:
        self._link(b, self._head)

    def remove(self, b: _Block) -> None:
        prev, nxt = b.prev, b.next
        assert prev is not None and nxt is not None, f"{b!r} is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        b.prev = b.next = None
        self._len -= 1

    def popleft(self) -> _Block:
        b = self._head.next
        assert b is not None and b is not self._tail, "pop from an empty free queue"
        self.remove(b)
        return b

    def __iter__(self) -> Iterator[_Block]:
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next

    def check(self) -> None:
        """Links agree in both directions and the length matches."""
        n = 0
        b = self._head
        while b.next is not None:
            if b.next.prev is not b:
                raise AssertionError(f"free queue link broken after {b!r}")
            b = b.next
            n += 1
        if b is not self._tail or n - 1 != self._len:
            raise AssertionError(f"free queue length {self._len} but {n - 1} linked blocks")


class BlockPool:
    """A paged block pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Implements :class:`kvkern.cache.protocol.KVCacheManager` plus the engine-facing calls a
    worker needs (``allocate``, ``match_prefix``, ``acquire_prefix``, ``commit``,
    ``release``). See the module docstring for the holders and the free-queue order.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int,
        hash_scheme: str = DEFAULT_SCHEME,
        clock: Callable[[], float] = time.monotonic,
        lease_history: int = 4096,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        get_scheme(hash_scheme)  # unknown names raise, listing the known ones
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._hash_scheme = hash_scheme
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free = _FreeQueue(self._blocks)
        self._index: dict[int, _Block] = {}
        self._pins: dict[int, PinHandle] = {}
        self._leases: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._lease_history: OrderedDict[int, str] = OrderedDict()
        self._lease_history_cap = lease_history
        self._next_pin_id = 1
        self._next_lease_id = 1
        self._num_pinned = 0
        self._num_leased = 0
        self._num_private = 0
        self._counters = {"evictions": 0, "leases_expired": 0, "leases_claimed": 0,
                          "leases_released": 0, "commit_duplicates": 0}

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
            self._expire_locked()
            return len(self._free)

    @property
    def num_used(self) -> int:
        """Held blocks: ``num_free + num_used == num_blocks``."""
        with self._lock:
            self._expire_locked()
            return self._num_blocks - len(self._free)

    @property
    def num_pinned(self) -> int:
        """Blocks pinned by at least one send."""
        with self._lock:
            self._expire_locked()
            return self._num_pinned

    @property
    def num_leased(self) -> int:
        """Blocks held by at least one live lease."""
        with self._lock:
            self._expire_locked()
            return self._num_leased

    @property
    def num_private(self) -> int:
        with self._lock:
            return self._num_private

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index (held or evictable)."""
        with self._lock:
            self._expire_locked()
            return len(self._index)

    def stats(self) -> dict[str, int]:
        """A snapshot of counts and cumulative counters, for metrics and leak checks.

        After every request has finished, ``pinned``, ``pins``, ``leased``, ``leases``,
        ``private`` and ``referenced`` must all be 0 and ``free == blocks``."""
        with self._lock:
            self._expire_locked()
            referenced = sum(1 for b in self._blocks if b.ref_cnt)
            return {
                "blocks": self._num_blocks,
                "free": len(self._free),
                "used": self._num_blocks - len(self._free),
                "cached": len(self._index),
                "referenced": referenced,
                "pinned": self._num_pinned,
                "pins": len(self._pins),
                "leased": self._num_leased,
                "leases": len(self._leases),
                "private": self._num_private,
                **self._counters,
            }

    # ------------------------------------------------------------------------- lookups

    def _run_locked(self, hashes: Sequence[int]) -> list[_Block]:
        out = []
        for h in normalize_hashes(hashes):
            b = self._index.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` that are cached. Read-only."""
        with self._lock:
            self._expire_locked()
            return len(self._run_locked(hashes))

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached leading run of ``hashes``. Read-only: another
        thread may evict them afterwards; use :meth:`acquire_prefix` to hold them."""
        with self._lock:
            self._expire_locked()
            return [b.block_id for b in self._run_locked(hashes)]

    def acquire_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Like :meth:`match_prefix`, and take one reference on each block atomically (a
        cached free block leaves the free queue). Give them back with :meth:`release`."""
        with self._lock:
            self._expire_locked()
            run = self._run_locked(hashes)
            for b in run:
                self._take_locked(b)
                b.ref_cnt += 1
            return [b.block_id for b in run]

    # ---------------------------------------------------------------------- engine calls

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with one reference each, evicting LRU cached blocks if needed;
        ``None`` (nothing taken) if fewer than ``n`` blocks are free."""
        return self._allocate(n, private=False)

    def commit(self, block_ids: Sequence[int], hashes: Sequence[int]) -> list[bool]:
        """Publish full blocks a request holds (``ref_cnt > 0``) under their chained hashes.

        Returns, per block, whether it is now the canonical block for its hash; ``False``
        means another block already caches that prefix (this one stays uncached). Committing
        a block again under the same hash is a no-op; under another hash it raises."""
        with self._lock:
            self._expire_locked()
            blocks = self._blocks_locked(block_ids, allow_repeats=False)
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
            out = []
            for b, h in zip(blocks, hs, strict=True):
                out.append(self._publish_locked(b, h) is b)
            return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block (a request finished or was preempted). Blocks
        are walked last to first; an unheld cached block goes to the free-queue tail, an
        unheld uncached one to the head."""
        with self._lock:
            self._expire_locked()
            blocks = self._blocks_locked(block_ids, allow_repeats=True)
            need: dict[int, int] = {}
            for b in blocks:
                need[b.block_id] = need.get(b.block_id, 0) + 1
            for bid, k in need.items():
                have = self._blocks[bid].ref_cnt
                if have < k:
                    raise ValueError(
                        f"release of block {bid} {k} time(s) but its ref_cnt is {have} "
                        "(double free?)"
                    )
            for b in reversed(blocks):
                b.ref_cnt -= 1
                self._maybe_free_locked(b)

    def evict(self, hashes: Sequence[int]) -> dict[str, list[int]]:
        """Drop the named cached blocks from the index now, as LRU eviction would (an
        operator flush, or a test making hints stale). Held blocks (referenced, pinned,
        leased) stay. Returns the hashes ``evicted``, ``held`` and ``absent``."""
        out: dict[str, list[int]] = {"evicted": [], "held": [], "absent": []}
        with self._lock:
            for h in normalize_hashes(hashes):
                b = self._index.get(h)
                if b is None:
                    out["absent"].append(h)
                elif b.held():
                    out["held"].append(h)
                else:
                    self._free.remove(b)
                    del self._index[h]
                    b.block_hash = None
                    self._free.appendleft(b)
                    self._counters["evictions"] += 1
                    out["evicted"].append(h)
        return out

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
            self._expire_locked()
            blocks = self._pop_free_locked(n)
            if blocks is None:
                return None
            for b in blocks:
                if private:
                    b.private = True
                else:
                    b.ref_cnt = 1
            if private:
                self._num_private += n
            return [b.block_id for b in blocks]

    def free_private(self, block_ids: Sequence[int]) -> None:
        """Return private blocks that will not be committed to the free-queue head."""
        with self._lock:
            blocks = self._blocks_locked(block_ids, allow_repeats=False)
            self._check_private(blocks, "free_private")
            for b in blocks:
                b.private = False
                self._num_private -= 1
                self._maybe_free_locked(b)

    def commit_private(
        self, block_ids: Sequence[int], hashes: Sequence[int], *, lease_s: float | None
    ) -> Lease | None:
        """Publish received private blocks under their chained hashes and, with ``lease_s``,
        lease the canonical blocks until claimed, released or ``lease_s`` has passed.

        A hash that is already cached keeps its existing block (which the lease then holds);
        the received duplicate goes back to the free queue uncached. Returns the lease, or
        ``None`` when ``lease_s`` is ``None`` (blocks become evictable cached blocks)."""
        if lease_s is not None and (
            isinstance(lease_s, bool)
            or not isinstance(lease_s, (int, float))
            or not math.isfinite(lease_s)
            or lease_s <= 0
        ):
            raise ValueError(f"lease_s must be a positive finite number or None, got {lease_s!r}")
        with self._lock:
            self._expire_locked()
            blocks = self._blocks_locked(block_ids, allow_repeats=False)
            hs = self._hashes_for(blocks, hashes)
            self._check_private(blocks, "commit_private")
            canonical: list[_Block] = []
            for b, h in zip(blocks, hs, strict=True):
                b.private = False
                self._num_private -= 1
                canonical.append(self._publish_locked(b, h))
            if lease_s is None:
                for b in reversed(blocks):
                    self._maybe_free_locked(b)
                return None
            for b in canonical:
                self._take_locked(b)
                if b.lease_cnt == 0:
                    self._num_leased += 1
                b.lease_cnt += 1
            for b in blocks:  # duplicates that lost to an existing block
                self._maybe_free_locked(b)
            lease = Lease(
                lease_id=self._next_lease_id,
                block_ids=tuple(b.block_id for b in canonical),
                hashes=tuple(hs),
                expires_at=self._clock() + float(lease_s),
            )
            self._next_lease_id += 1
            self._leases[lease.lease_id] = lease
            heapq.heappush(self._lease_heap, (lease.expires_at, lease.lease_id))
            return lease

    def claim(self, lease: Lease) -> list[int] | None:
        """Convert a live lease into one reference per block, held by the caller; ``None``
        if the lease already expired. Claiming twice, or after release, raises."""
        with self._lock:
            self._expire_locked()
            live = self._live_lease_locked(lease, "claim")
            if live is None:
                return None
            for bid in live.block_ids:
                self._blocks[bid].ref_cnt += 1
            self._end_lease_locked(live, "claimed")
            return list(live.block_ids)

    def release_lease(self, lease: Lease) -> None:
        """Drop a lease without claiming it; its blocks become evictable cached blocks.
        Releasing a lease that already expired is a no-op; twice, or after a claim, raises."""
        with self._lock:
            self._expire_locked()
            live = self._live_lease_locked(lease, "release")
            if live is not None:
                self._end_lease_locked(live, "released")

    def pin(self, hashes: Sequence[int], *, require_all: bool = False) -> PinHandle | None:
        """Pin the blocks of the longest cached leading run of ``hashes`` for one send.

        A cached block with no other holder is claimed out of the free queue, so eviction
        cannot reuse it while it is being read. ``None`` when nothing was pinned: no leading
        hash is cached, or ``require_all`` and fewer than ``len(hashes)`` are."""
        with self._lock:
            self._expire_locked()
            hs = normalize_hashes(hashes)
            run = self._run_locked(hs)
            if not run or (require_all and len(run) < len(hs)):
                return None
            for b in run:
                self._take_locked(b)
                if b.pin_cnt == 0:
                    self._num_pinned += 1
                b.pin_cnt += 1
            handle = PinHandle(
                pin_id=self._next_pin_id,
                block_ids=tuple(b.block_id for b in run),
                hashes=tuple(hs[: len(run)]),
            )
            self._next_pin_id += 1
            self._pins[handle.pin_id] = handle
            return handle

    def unpin(self, handle: PinHandle) -> None:
        """Release the pins of one :meth:`pin`; a second unpin of the same handle raises."""
        with self._lock:
            live = self._pins.get(handle.pin_id)
            if live is None:
                raise ValueError(
                    f"unpin of pin {handle.pin_id} (blocks {list(handle.block_ids)}) that is "
                    "not pinned (double unpin?)"
                )
            if live != handle:
                raise ValueError(
                    f"unpin handle for pin {handle.pin_id} names blocks "
                    f"{list(handle.block_ids)} but the pin holds {list(live.block_ids)}"
                )
            del self._pins[handle.pin_id]
            self._expire_locked()
            for bid in reversed(live.block_ids):
                b = self._blocks[bid]
                b.pin_cnt -= 1
                if b.pin_cnt == 0:
                    self._num_pinned -= 1
                self._maybe_free_locked(b)

    # -------------------------------------------------------------------------- internals

    @staticmethod
    def _check_count(n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"block count must be a non-negative int, got {n!r}")

    def _blocks_locked(self, block_ids: Sequence[int], *, allow_repeats: bool) -> list[_Block]:
        out = []
        seen: set[int] = set()
        for bid in block_ids:
            if isinstance(bid, bool) or not isinstance(bid, int) or not 0 <= bid < self._num_blocks:
                raise ValueError(
                    f"block id {bid!r} out of range for pool of {self._num_blocks} blocks"
                )
            if not allow_repeats:
                if bid in seen:
                    raise ValueError(f"block id {bid} appears twice in {list(block_ids)}")
                seen.add(bid)
            out.append(self._blocks[bid])
        return out

    @staticmethod
    def _hashes_for(blocks: list[_Block], hashes: Sequence[int]) -> list[int]:
        hs = normalize_hashes(hashes)
        if len(hs) != len(blocks):
            raise ValueError(f"{len(blocks)} block ids but {len(hs)} hashes")
        if len(set(hs)) != len(hs):
            raise ValueError(f"duplicate hashes in one commit: {hs}")
        return hs

    @staticmethod
    def _check_private(blocks: list[_Block], what: str) -> None:
        for b in blocks:
            if not b.private:
                raise ValueError(f"{what} of block {b.block_id} that is not private ({b!r})")

    def _take_locked(self, b: _Block) -> None:
        if b.prev is not None:
            self._free.remove(b)

    def _maybe_free_locked(self, b: _Block) -> None:
        if b.held() or b.prev is not None:
            return
        if b.block_hash is None:
            self._free.appendleft(b)
        else:
            self._free.append(b)

    def _pop_free_locked(self, n: int) -> list[_Block] | None:
        if len(self._free) < n:
            return None
        out = []
        for _ in range(n):
            b = self._free.popleft()
            if b.block_hash is not None:
                del self._index[b.block_hash]
                b.block_hash = None
                self._counters["evictions"] += 1
            out.append(b)
        return out

    def _publish_locked(self, b: _Block, h: int) -> _Block:
        """Index ``b`` under ``h`` unless another block has it; return the canonical block."""
        existing = self._index.get(h)
        if existing is None:
            self._index[h] = b
            b.block_hash = h
            return b
        if existing is not b:
            self._counters["commit_duplicates"] += 1
        return existing

    def _live_lease_locked(self, lease: Lease, what: str) -> Lease | None:
        live = self._leases.get(lease.lease_id)
        if live is not None:
            if live != lease:
                raise ValueError(
                    f"{what} of lease {lease.lease_id} naming blocks {list(lease.block_ids)} "
                    f"but the lease holds {list(live.block_ids)}"
                )
            return live
        outcome = self._lease_history.get(lease.lease_id)
        if outcome == "expired":
            return None
        if outcome is not None:
            raise ValueError(f"{what} of lease {lease.lease_id} that was already {outcome}")
        raise ValueError(
            f"{what} of unknown lease {lease.lease_id} (next lease id {self._next_lease_id}, "
            f"history keeps {self._lease_history_cap})"
        )

    def _end_lease_locked(self, lease: Lease, outcome: str) -> None:
        del self._leases[lease.lease_id]
        self._lease_history[lease.lease_id] = outcome
        while len(self._lease_history) > self._lease_history_cap:
            self._lease_history.popitem(last=False)
        self._counters[f"leases_{outcome}"] += 1
        for bid in reversed(lease.block_ids):
            b = self._blocks[bid]
            b.lease_cnt -= 1
            if b.lease_cnt == 0:
                self._num_leased -= 1
            self._maybe_free_locked(b)

    def _expire_locked(self) -> None:
        if not self._lease_heap:
            return
        now = self._clock()
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._end_lease_locked(lease, "expired")

    # -------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (for tests and debugging).

        * the free queue's links agree; its blocks are unheld, uncached ones before cached;
        * every unheld block is in the free queue (free + used == total);
        * no count is negative; the counters match a recount;
        * ``block_hash`` set <=> indexed under that hash; private blocks are not indexed;
        * pin and lease counts equal the live handles and leases naming each block.
        """
        with self._lock:
            self._free.check()
            seen_cached = False
            in_queue = 0
            for b in self._free:
                in_queue += 1
                if b.held():
                    raise AssertionError(f"held block in the free queue: {b!r}")
                if b.block_hash is not None:
                    seen_cached = True
                elif seen_cached:
                    raise AssertionError(f"uncached block behind a cached one: {b!r}")
            pins = [0] * self._num_blocks
            for handle in self._pins.values():
                for bid in handle.block_ids:
                    pins[bid] += 1
            leases = [0] * self._num_blocks
            for lease in self._leases.values():
                for bid in lease.block_ids:
                    leases[bid] += 1
            n_pinned = n_leased = n_private = 0
            for b in self._blocks:
                if min(b.ref_cnt, b.pin_cnt, b.lease_cnt) < 0:
                    raise AssertionError(f"negative count: {b!r}")
                if not b.held() and b.prev is None:
                    raise AssertionError(f"unheld block missing from the free queue: {b!r}")
                if b.pin_cnt != pins[b.block_id] or b.lease_cnt != leases[b.block_id]:
                    raise AssertionError(
                        f"{b!r}: {pins[b.block_id]} live pins, {leases[b.block_id]} leases"
                    )
                if b.block_hash is not None and self._index.get(b.block_hash) is not b:
                    raise AssertionError(f"{b!r} has a hash but is not indexed under it")
                if b.private and (b.block_hash is not None or b.ref_cnt or b.pin_cnt
                                  or b.lease_cnt):
                    raise AssertionError(f"private block with other state: {b!r}")
                n_pinned += b.pin_cnt > 0
                n_leased += b.lease_cnt > 0
                n_private += b.private
            for h, b in self._index.items():
                if b.block_hash != h:
                    raise AssertionError(f"index[{h}] -> {b!r}")
            if (n_pinned, n_leased, n_private) != (
                self._num_pinned, self._num_leased, self._num_private
            ):
                raise AssertionError(
                    f"recount pinned/leased/private {(n_pinned, n_leased, n_private)} vs "
                    f"counters {(self._num_pinned, self._num_leased, self._num_private)}"
                )
            if in_queue != len(self._free):
                raise AssertionError(f"free queue walk {in_queue} != length {len(self._free)}")
