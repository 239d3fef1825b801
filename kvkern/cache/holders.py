"""The holder table of the reference block pool (:class:`kvkern.cache.pool.BlockPool`): each
block's bookkeeping (:class:`Block`), the free queue, the prefix index (:class:`BlockTable`),
and the tables of the two holders that have handles, pins (:class:`PinTable`) and leases
(:class:`LeaseTable`). The pool's module docstring describes the holders and the free-queue
order; these units keep them. None of them locks: the pool's lock guards every call.

When the table has a :class:`~kvkern.cache.directory.ReadDirectory`, the index's changes go
to it too: a block is published there when it becomes canonical for a hash, and withdrawn
before it loses its hash (so before allocation hands it out).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvkern.cache.hashing import normalize_hashes
from kvkern.cache.protocol import Lease, PinHandle

if TYPE_CHECKING:
    from kvkern.cache.directory import ReadDirectory

__all__ = ["DIRECTORY_GROUP", "MAX_GROUP", "Block", "BlockTable", "FreeQueue", "LeaseTable",
           "PinTable", "chain_records", "check_invariants"]

# A read directory places a chain's blocks this many at a time in consecutive buckets
# (kvkern.cache.directory): a look-up of k chained hashes reads about k / 16 + 1 spans of
# 4 KiB instead of k buckets, while a group's first block still scatters chains uniformly.
DIRECTORY_GROUP = 16
# The largest group a directory takes (and a reader accepts from a source's state).
MAX_GROUP = 1 << 12


class Block:
    """Bookkeeping of one block. ``prev``/``next`` belong to the free queue alone."""

    __slots__ = ("block_id", "ref_cnt", "pin_cnt", "lease_cnt", "private", "block_hash",
                 "chain", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.pin_cnt = 0
        self.lease_cnt = 0
        self.private = False
        self.block_hash: int | None = None
        # (position in its sequence, hash of its directory group's first block) while it is
        # canonical for block_hash and its position is known (see chain_records)
        self.chain: tuple[int, int] | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def held(self) -> bool:
        return bool(self.ref_cnt or self.pin_cnt or self.lease_cnt or self.private)

    def __repr__(self) -> str:
        return (f"Block(id={self.block_id}, ref={self.ref_cnt}, pin={self.pin_cnt}, "
                f"lease={self.lease_cnt}, private={self.private}, hash={self.block_hash})")


class FreeQueue:
    """Intrusive doubly linked list between two sentinels; every operation is O(1).

    A block is in the queue iff its ``prev`` is not ``None``."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def _link(self, b: Block, before: Block) -> None:
        after = before.next
        assert after is not None and b.prev is None and b.next is None
        b.prev, b.next = before, after
        before.next = b
        after.prev = b
        self._len += 1

    def append(self, b: Block) -> None:
        assert self._tail.prev is not None
        self._link(b, self._tail.prev)

    def appendleft(self, b: Block) -> None:
        self._link(b, self._head)

    def remove(self, b: Block) -> None:
        prev, nxt = b.prev, b.next
        assert prev is not None and nxt is not None, f"{b!r} is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        b.prev = b.next = None
        self._len -= 1

    def popleft(self) -> Block:
        b = self._head.next
        assert b is not None and b is not self._tail, "pop from an empty free queue"
        self.remove(b)
        return b

    def __iter__(self) -> Iterator[Block]:
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


def chain_records(index: dict[int, Block], hashes: Sequence[int], parent: int | None,
                  group: int) -> list[tuple[int, int] | None]:
    """Per hash of a chain, its ``(position, anchor)``: its position in its sequence and the
    hash at the start of its group (the position rounded down to a multiple of ``group``).
    ``parent`` is the hash before ``hashes[0]``, ``None`` when ``hashes[0]`` starts a
    sequence; a parent that ``index`` does not hold with a known position leaves every
    record ``None`` (such blocks are placed by hash alone)."""
    if parent is None:
        rec: tuple[int, int] | None = (-1, 0)
    else:
        known = index.get(parent)
        rec = None if known is None else known.chain
    out: list[tuple[int, int] | None] = []
    for h in hashes:
        if rec is not None:
            pos = rec[0] + 1
            rec = (pos, h if pos % group == 0 else rec[1])
        out.append(rec)
    return out


class BlockTable:
    """Every block, the free queue of the unheld ones and the prefix index; counters of
    evictions, duplicate commits and ended leases; and the read directory that mirrors the
    index, once attached (``None`` until then)."""

    __slots__ = ("blocks", "free", "index", "counters", "num_private", "directory", "group")

    def __init__(self, num_blocks: int, group: int = DIRECTORY_GROUP) -> None:
        self.group = group  # the directory's (chain_records)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeQueue(self.blocks)
        self.index: dict[int, Block] = {}
        self.counters = {"evictions": 0, "leases_expired": 0, "leases_claimed": 0,
                         "leases_released": 0, "commit_duplicates": 0}
        self.num_private = 0
        self.directory: ReadDirectory | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, block_ids: Sequence[int], *, allow_repeats: bool) -> list[Block]:
        """The blocks of ``block_ids``; ValueError for an id out of range (or repeated)."""
        out = []
        seen: set[int] = set()
        n = len(self.blocks)
        for bid in block_ids:
            if isinstance(bid, bool) or not isinstance(bid, int) or not 0 <= bid < n:
                raise ValueError(f"block id {bid!r} out of range for pool of {n} blocks")
            if not allow_repeats:
                if bid in seen:
                    raise ValueError(f"block id {bid} appears twice in {list(block_ids)}")
                seen.add(bid)
            out.append(self.blocks[bid])
        return out

    def run(self, hashes: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest leading run of ``hashes``."""
        out = []
        for h in normalize_hashes(hashes):
            b = self.index.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, b: Block) -> None:
        """A holder takes ``b``: it leaves the free queue (if it was there)."""
        if b.prev is not None:
            self.free.remove(b)

    def maybe_free(self, b: Block) -> None:
        """``b`` lost a holder: unheld, it returns to the free queue (cached to the tail,
        uncached to the head)."""
        if b.held() or b.prev is not None:
            return
        if b.block_hash is None:
            self.free.appendleft(b)
        else:
            self.free.append(b)

    def pop_free(self, n: int) -> list[Block] | None:
        """``n`` blocks off the free-queue head, cached ones evicted; None if short."""
        if len(self.free) < n:
            return None
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if b.block_hash is not None:
                if self.directory is not None:
                    self.directory.withdraw(b.block_id)
                del self.index[b.block_hash]
                b.block_hash = b.chain = None
                self.counters["evictions"] += 1
            out.append(b)
        return out

    def publish(self, b: Block, h: int, chain: tuple[int, int] | None = None) -> Block:
        """Index ``b`` under ``h`` (at ``chain``, see :func:`chain_records`) unless another
        block has it; return the canonical block."""
        existing = self.index.get(h)
        if existing is None:
            self.index[h] = b
            b.block_hash = h
            b.chain = chain
            if self.directory is not None:
                self.directory.publish(b.block_id, h, chain)
            return b
        if existing is not b:
            self.counters["commit_duplicates"] += 1
        return existing

    def evict(self, hashes: Sequence[int]) -> dict[str, list[int]]:
        """Drop the named unheld cached blocks from the index (see BlockPool.evict)."""
        out: dict[str, list[int]] = {"evicted": [], "held": [], "absent": []}
        for h in normalize_hashes(hashes):
            b = self.index.get(h)
            if b is None:
                out["absent"].append(h)
            elif b.held():
                out["held"].append(h)
            else:
                self.free.remove(b)
                if self.directory is not None:
                    self.directory.withdraw(b.block_id)
                del self.index[h]
                b.block_hash = b.chain = None
                self.free.appendleft(b)
                self.counters["evictions"] += 1
                out["evicted"].append(h)
        return out


class PinTable:
    """The live pins (one :class:`PinHandle` per send) and how many blocks they hold."""

    __slots__ = ("_table", "handles", "_next_id", "num_pinned")

    def __init__(self, table: BlockTable) -> None:
        self._table = table
        self.handles: dict[int, PinHandle] = {}
        self._next_id = 1
        self.num_pinned = 0

    def pin(self, run: list[Block], hashes: Sequence[int]) -> PinHandle:
        """Pin the blocks of ``run`` (cached under ``hashes``) for one send."""
        free = self._table.free
        fresh = 0
        for b in run:  # (BlockTable.take inlined: the loop runs once per pinned block)
            if b.prev is not None:
                free.remove(b)
            if not b.pin_cnt:
                fresh += 1
            b.pin_cnt += 1
        self.num_pinned += fresh
        handle = PinHandle(pin_id=self._next_id, block_ids=tuple([b.block_id for b in run]),
                           hashes=tuple(hashes))
        self._next_id += 1
        self.handles[handle.pin_id] = handle
        return handle

    def check_live(self, handle: PinHandle) -> PinHandle:
        """The live pin ``handle`` names; ValueError after its unpin or for another pin's."""
        live = self.handles.get(handle.pin_id)
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
        return live

    def unpin(self, live: PinHandle) -> None:
        """Release a live pin (checked by :meth:`check_live`), last block first."""
        del self.handles[live.pin_id]
        for bid in reversed(live.block_ids):
            b = self._table.blocks[bid]
            b.pin_cnt -= 1
            if b.pin_cnt == 0:
                self.num_pinned -= 1
            self._table.maybe_free(b)


class LeaseTable:
    """The live leases, their expiry heap on ``clock`` and the outcomes of the last
    ``history`` ended ones (so a late claim or release is told what happened)."""

    __slots__ = ("_table", "_clock", "leases", "_heap", "_history", "history_cap",
                 "next_id", "num_leased")

    def __init__(self, table: BlockTable, clock: Callable[[], float], history: int) -> None:
        self._table = table
        self._clock = clock
        self.leases: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []
        self._history: OrderedDict[int, str] = OrderedDict()
        self.history_cap = history
        self.next_id = 1
        self.num_leased = 0

    def grant(self, canonical: list[Block], hashes: Sequence[int], lease_s: float) -> Lease:
        """Lease ``canonical`` (held from now on) until claimed, released or expired."""
        for b in canonical:
            self._table.take(b)
            if b.lease_cnt == 0:
                self.num_leased += 1
            b.lease_cnt += 1
        lease = Lease(lease_id=self.next_id, block_ids=tuple(b.block_id for b in canonical),
                      hashes=tuple(hashes), expires_at=self._clock() + float(lease_s))
        self.next_id += 1
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._heap, (lease.expires_at, lease.lease_id))
        return lease

    def live(self, lease: Lease, what: str) -> Lease | None:
        """The live lease ``lease`` names; None if it expired, or ended so long ago that the
        history no longer holds its outcome (a late claim falls back, as for an expired
        lease); ValueError if it was claimed or released already, was never granted, or
        names other blocks."""
        live = self.leases.get(lease.lease_id)
        if live is not None:
            if live != lease:
                raise ValueError(
                    f"{what} of lease {lease.lease_id} naming blocks {list(lease.block_ids)} "
                    f"but the lease holds {list(live.block_ids)}"
                )
            return live
        outcome = self._history.get(lease.lease_id)
        if outcome == "expired":
            return None
        if outcome is not None:
            raise ValueError(f"{what} of lease {lease.lease_id} that was already {outcome}")
        if 0 < lease.lease_id < self.next_id:
            return None  # (ended, its outcome forgotten)
        raise ValueError(
            f"{what} of unknown lease {lease.lease_id} (next lease id {self.next_id}, "
            f"history keeps {self.history_cap})"
        )

    def end(self, lease: Lease, outcome: str) -> None:
        """End a live lease (``claimed``, ``released`` or ``expired``), last block first."""
        del self.leases[lease.lease_id]
        self._history[lease.lease_id] = outcome
        while len(self._history) > self.history_cap:
            self._history.popitem(last=False)
        self._table.counters[f"leases_{outcome}"] += 1
        for bid in reversed(lease.block_ids):
            b = self._table.blocks[bid]
            b.lease_cnt -= 1
            if b.lease_cnt == 0:
                self.num_leased -= 1
            self._table.maybe_free(b)

    def expire(self) -> None:
        """End every lease whose time has come (applied lazily by each pool call)."""
        if not self._heap:
            return
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._heap)
            lease = self.leases.get(lease_id)
            if lease is not None:
                self.end(lease, "expired")


def check_invariants(table: BlockTable, pins: PinTable, leases: LeaseTable) -> None:
    """Raise AssertionError naming the first broken invariant (see
    :meth:`kvkern.cache.pool.BlockPool.check_invariants`)."""
    table.free.check()
    seen_cached = False
    in_queue = 0
    for b in table.free:
        in_queue += 1
        if b.held():
            raise AssertionError(f"held block in the free queue: {b!r}")
        if b.block_hash is not None:
            seen_cached = True
        elif seen_cached:
            raise AssertionError(f"uncached block behind a cached one: {b!r}")
    n = len(table)
    pin_counts = [0] * n
    for handle in pins.handles.values():
        for bid in handle.block_ids:
            pin_counts[bid] += 1
    lease_counts = [0] * n
    for lease in leases.leases.values():
        for bid in lease.block_ids:
            lease_counts[bid] += 1
    n_pinned = n_leased = n_private = 0
    for b in table.blocks:
        _check_block(table, b, pin_counts[b.block_id], lease_counts[b.block_id])
        n_pinned += b.pin_cnt > 0
        n_leased += b.lease_cnt > 0
        n_private += b.private
    for h, b in table.index.items():
        if b.block_hash != h:
            raise AssertionError(f"index[{h}] -> {b!r}")
    for b in table.blocks:
        if b.chain is not None and (b.block_hash is None or b.chain[0] < 0 or (
                b.chain[0] % table.group == 0 and b.chain[1] != b.block_hash)):
            raise AssertionError(f"chain record {b.chain} of {b!r}")
    if (n_pinned, n_leased, n_private) != (pins.num_pinned, leases.num_leased,
                                           table.num_private):
        raise AssertionError(
            f"recount pinned/leased/private {(n_pinned, n_leased, n_private)} vs "
            f"counters {(pins.num_pinned, leases.num_leased, table.num_private)}"
        )
    if in_queue != len(table.free):
        raise AssertionError(f"free queue walk {in_queue} != length {len(table.free)}")
    if table.directory is not None:
        table.directory.check({h: b.block_id for h, b in table.index.items()},
                              {b.block_id: b.chain for b in table.index.values()})


def _check_block(table: BlockTable, b: Block, pins: int, leases: int) -> None:
    if min(b.ref_cnt, b.pin_cnt, b.lease_cnt) < 0:
        raise AssertionError(f"negative count: {b!r}")
    if not b.held() and b.prev is None:
        raise AssertionError(f"unheld block missing from the free queue: {b!r}")
    if b.pin_cnt != pins or b.lease_cnt != leases:
        raise AssertionError(f"{b!r}: {pins} live pins, {leases} leases")
    if b.block_hash is not None and table.index.get(b.block_hash) is not b:
        raise AssertionError(f"{b!r} has a hash but is not indexed under it")
    if b.private and (b.block_hash is not None or b.ref_cnt or b.pin_cnt or b.lease_cnt):
        raise AssertionError(f"private block with other state: {b!r}")
