"""vLLM's prefix-cache blocks as kvkern's source sees them: pins and lookups by the low 64
bits of vLLM's own block hashes, in vLLM's block pool, alongside vLLM's scheduler.

vLLM's scheduler is single-threaded and its block pool has no lock; a source serves from
another thread (kvkern's transfer loop). :meth:`VllmBlocks.bind` therefore puts one re-entrant
lock around every public method of the scheduler's ``KVCacheManager`` and ``BlockPool``, so a
pin (lookup, then ``touch``) and an unpin (``free_blocks``) run between the scheduler's own
calls, never inside one: ``allocate_slots`` checks the free blocks and takes them under the
same lock a pin holds while it takes cached free blocks out of the free queue.

The u64 index (low 64 bits -> the cached block) is filled with the full blocks vLLM caches
(``cache_full_blocks``) once their bytes are written, and checked on every use: the block must
still carry that hash and must not have been handed out since (``get_new_blocks``: vLLM may
evict a block, write other KV into it and cache it under the same hash again, in a step whose
forward pass has not run yet); two different vLLM hashes with the same low 64 bits make that
u64 ambiguous, and an ambiguous u64 is never served.

vLLM caches a block when it schedules the step that computes its last tokens, before that
step's forward pass writes them (vLLM's own requests cannot read it sooner). A peer could, so
a block enters the index only after its step's forward pass: the scheduler half closes each
step's cached blocks with :meth:`VllmBlocks.seal` (its number rides in the step's connector
metadata), and the worker half calls :meth:`VllmBlocks.written` once that step's forward pass
has written them (on a GPU, once the stream has passed an event recorded after it)::

    vLLM scheduler thread                 kvkern loop thread (source)
    allocate_slots --+ lock               pin(h0..h2) --+ lock
      cache_full_blocks -> step's list       steps written: their blocks -> index
    build_connector_meta: seal() -> step   index[h] -> block (still hashed h?)
    ---------------+ unlock                 touch(blocks): ref++ , out of the free queue
    forward pass; wait_for_save:          --------------+ unlock ... send ... unpin: free_blocks
      written(step)

The index also keeps a read directory (:meth:`VllmBlocks.read_directory`, the optional
capability of :mod:`kvkern.cache.protocol`), so that peers read the blocks without a message
(:mod:`kvkern.xfer.direct`): a block is published when it enters the index (placed by its
position in its request, as :func:`kvkern.cache.holders.chain_records` places a chain), and
withdrawn when vLLM hands it out again (``get_new_blocks``, before anything can write it),
clears its hash in place (``evict_blocks``, ``reset_prefix_cache``) or its u64 turns
ambiguous. A peer that read a block withdrawn meanwhile sees its slot changed
and does not use it.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvkern.cache.hashing import vllm_u64
from kvkern.cache.holders import DIRECTORY_GROUP
from kvkern.cache.protocol import Lease, PinHandle
from kvkern.xfer.tuning import DEFAULT_MAX_SEND_S

__all__ = ["VllmBlocks"]

log = logging.getLogger("kvkern.integrations.vllm")

_AMBIGUOUS = object()
# (block, its hash then, chain record, its hand-out count then: see VllmBlocks._handouts)
_Cached = tuple[Any, bytes, "tuple[int, int] | None", int]
#: Steps whose cached blocks may wait for their forward pass: beyond it the oldest step's
#: blocks are dropped unserved (a worker half that never reports its steps written).
MAX_UNWRITTEN_STEPS = 1024
# the longest a prefix-cache reset waits for peers' pins: a pin lasts one send, which the
# source bounds by its max_send_s (a granted read's hold is shorter)
RESET_PIN_WAIT_S = DEFAULT_MAX_SEND_S


def _u64(key: bytes) -> int:
    """The kvkern u64 of a ``BlockHashWithGroupId`` (hash bytes, then a 4-byte group id)."""
    return int.from_bytes(key[-12:-4], "big")


class VllmBlocks:
    """kvkern's :class:`~kvkern.cache.protocol.KVCacheManager` over vLLM's block pool, for the
    source side (``pin``, ``unpin``, ``longest_prefix``). The destination side never allocates
    here: vLLM allocates a pull's blocks and kvkern fills them (``Puller.pull_into``)."""

    def __init__(self, *, block_size: int, hash_scheme: str, group_id: int = 0) -> None:
        self._block_size = block_size
        self._hash_scheme = hash_scheme
        self._group_id = group_id
        self._lock = threading.RLock()
        self._pool: Any = None
        # u64 -> (cached KVCacheBlock, its hand-out count when indexed), or _AMBIGUOUS
        self._index: dict[int, Any] = {}
        # block id -> how often vLLM handed the block out (get_new_blocks): a block indexed
        # or cached under a hash is that hash's bytes only while this count is unchanged,
        # since vLLM may evict it, write other KV into it and cache it under the same hash
        # again before that step's forward pass
        self._handouts: dict[int, int] = {}
        self._pins: dict[int, list[Any]] = {}
        self._ids = itertools.count(1)
        # a prefix-cache reset waits for the pins to end (unpin notifies), refusing new ones
        self._unpinned = threading.Condition(self._lock)
        self._resetting_now = False
        # blocks cached in the step being scheduled (each with its hash then and its chain
        # record), the steps sealed but not yet written, and the writes reported (step,
        # ready check)
        self._cached: list[_Cached] = []
        self._unwritten: collections.deque[tuple[int, list[_Cached]]] = collections.deque()
        self._writes: collections.deque[tuple[int, Callable[[], bool] | None]] = \
            collections.deque()
        self._steps = itertools.count(1)
        self._dropped_steps = 0
        self._directory: Any = None  # a ReadDirectory once a source asks for one
        self._tensor_blocks: int | None = None  # blocks in vLLM's KV tensors (the worker's)

    # ------------------------------------------------------------------ binding to vLLM

    def bind(self, kv_cache_manager: Any) -> None:
        """Serialise vLLM's ``kv_cache_manager`` and its block pool with kvkern's pins, and
        index the full blocks it caches from now on. Called once, by the scheduler side."""
        with self._lock:
            if self._pool is not None:
                raise RuntimeError("VllmBlocks is bound to a block pool already")
            pool = kv_cache_manager.block_pool
            for obj in (kv_cache_manager, pool):
                for name, _ in inspect.getmembers(type(obj), inspect.isfunction):
                    if not name.startswith("_"):
                        setattr(obj, name, self._locked(getattr(obj, name)))
            pool.cache_full_blocks = self._indexing(pool.cache_full_blocks,
                                                    getattr(pool, "hash_block_size", None))
            pool.get_new_blocks = self._withdrawing(pool.get_new_blocks)
            for name, wrap in (("reset_prefix_cache", self._resetting),
                               ("evict_blocks", self._evicting)):  # (vLLM 0.32 has both)
                if hasattr(pool, name):
                    setattr(pool, name, wrap(getattr(pool, name)))
            self._pool = pool

    def _locked(self, method: Any) -> Any:
        lock = self._lock

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return method(*args, **kwargs)
        return call

    def _indexing(self, cache_full_blocks: Any, hash_block_size: int | None) -> Any:
        """``cache_full_blocks``, whose newly cached blocks wait for their step to be
        written. A block's chain record is its position in its request and the hash at its
        group's start, where the request's hashes are one per block (else None: the block
        is placed by its hash alone)."""
        signature = inspect.signature(cache_full_blocks)

        @functools.wraps(cache_full_blocks)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                out = cache_full_blocks(*args, **kwargs)
                bound = signature.bind(*args, **kwargs).arguments
                if bound.get("kv_cache_group_id", 0) == self._group_id:
                    first = bound["num_cached_blocks"]
                    blocks = bound["blocks"][first:bound["num_full_blocks"]]
                    hashes = getattr(bound.get("request"), "block_hashes", None)
                    per_block = hashes is not None and hash_block_size in (
                        None, bound.get("block_size"))
                    for pos, b in enumerate(blocks, first):
                        if b.block_hash is None:  # (a null block is skipped)
                            continue
                        anchor = pos - pos % DIRECTORY_GROUP
                        chain = (pos, vllm_u64(hashes[anchor])) if per_block and \
                            anchor < len(hashes) else None
                        self._cached.append((b, b.block_hash, chain,
                                             self._handouts.get(b.block_id, 0)))
                return out
        return call

    def _withdrawing(self, get_new_blocks: Any) -> Any:
        @functools.wraps(get_new_blocks)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                out = get_new_blocks(*args, **kwargs)
                handouts = self._handouts
                for b in out:  # handed out: about to be written
                    handouts[b.block_id] = handouts.get(b.block_id, 0) + 1
                    self._withdraw(b)
                return out
        return call

    def _resetting(self, reset_prefix_cache: Any) -> Any:
        """``reset_prefix_cache`` (after a weight update, say), which clears every block's
        hash at once: the index and the read directory forget every block with it, or
        peers would go on reading blocks named by hashes of the old weights' KV. vLLM
        refuses a reset while any block is in use, and its pause and sleep then fail: peers'
        pins (one send or read each, at most ``RESET_PIN_WAIT_S``) are waited out first,
        and no new one is granted meanwhile (peers then pull elsewhere or recompute). Where
        vLLM's own requests hold blocks too, it refuses whatever the pins do: nothing is
        waited for."""
        @functools.wraps(reset_prefix_cache)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._resetting_now = True
                try:
                    if self._pins and not self._requests_hold_blocks():
                        self._unpinned.wait_for(lambda: not self._pins, RESET_PIN_WAIT_S)
                    done = reset_prefix_cache(*args, **kwargs)
                finally:
                    self._resetting_now = False
                if done:
                    self._index.clear()
                    self._cached = []
                    self._unwritten.clear()
                    if self._directory is not None:
                        self._directory.withdraw_hash(None)
                return done
        return call

    def _requests_hold_blocks(self) -> bool:
        """Whether vLLM's own requests hold blocks (under the lock; vLLM refuses a
        prefix-cache reset then): blocks in use beyond the null block and the pinned ones,
        or a pinned block with more references than pins (a request hit its prefix)."""
        pool = self._pool
        pins: collections.Counter[int] = collections.Counter()
        refs = {}
        for blocks in self._pins.values():
            for b in blocks:
                pins[b.block_id] += 1
                refs[b.block_id] = b.ref_cnt
        if pool.num_gpu_blocks - pool.get_num_free_blocks() - 1 > len(pins):
            return True
        return any(refs[i] > n for i, n in pins.items())

    def _evicting(self, evict_blocks: Any) -> Any:
        """``evict_blocks`` (blocks whose KV vLLM found invalid), which clears their hashes
        in place: their read directory slots go with them."""
        @functools.wraps(evict_blocks)
        def call(block_ids: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                out = evict_blocks(block_ids, *args, **kwargs)
                d = self._directory
                for block_id in block_ids:
                    if d is not None and 0 <= block_id < d.num_blocks:
                        d.withdraw(block_id)
                return out
        return call

    # ------------------------------------------------------ steps: cached, then written

    def seal(self) -> int:
        """Close the step being scheduled: the blocks vLLM cached in it wait for
        :meth:`written` of the number returned (the scheduler half, once per step)."""
        with self._lock:
            step = next(self._steps)
            if self._cached:
                self._unwritten.append((step, self._cached))
                self._cached = []
                if len(self._unwritten) > MAX_UNWRITTEN_STEPS:
                    self._unwritten.popleft()
                    self._dropped_steps += 1
                    if self._dropped_steps == 1:
                        log.warning("kvkern: cached blocks of %d steps not reported written; "
                                    "the oldest are not served", MAX_UNWRITTEN_STEPS)
            return step

    def written(self, step: int, ready: Callable[[], bool] | None = None) -> None:
        """Step ``step``'s forward pass has written its blocks (those of every earlier step
        too), once ``ready()`` is true when given (a device event's ``query``): they may be
        served from then on (the worker half, once per step, in order)."""
        with self._lock:
            self._writes.append((step, ready))
            self._promote()

    def _promote(self) -> None:
        """Index the blocks of every step reported written (in order, each once its ready
        check passes) that still carry the hash they were cached under."""
        while self._writes:
            step, ready = self._writes[0]
            if ready is not None and not ready():
                return
            self._writes.popleft()
            while self._unwritten and self._unwritten[0][0] <= step:
                _, batch = self._unwritten.popleft()
                self._add([(b, chain, n) for b, key, chain, n in batch
                           if b.block_hash == key and self._handouts.get(b.block_id, 0) == n])

    def _live(self, entry: Any, h: int) -> Any:
        """The block of index ``entry`` if it still holds what it was indexed for under
        ``h``: it carries that u64 and vLLM has not handed it out since; else None."""
        if entry is None or entry is _AMBIGUOUS:
            return None
        block, n = entry
        key = block.block_hash
        if key is None or _u64(key) != h or self._handouts.get(block.block_id, 0) != n:
            return None
        return block

    def _add(self, blocks: Sequence[tuple[Any, tuple[int, int] | None, int]]) -> None:
        """Index (and publish) written ``(block, chain record, hand-out count)``."""
        index = self._index
        for block, chain, n in blocks:
            key = block.block_hash
            if key is None:
                continue
            h = _u64(key)
            have = index.get(h)
            live = self._live(have, h)
            if live is None:
                if have is not _AMBIGUOUS:
                    index[h] = (block, n)
                    self._publish(block, h, chain)
            elif live.block_hash != key:  # same low 64 bits, another vLLM hash
                index[h] = _AMBIGUOUS
                if self._directory is not None:  # every block it named, not just the last
                    self._directory.withdraw_hash(h)
                log.warning("two vLLM block hashes share the u64 %d: never served", h)
            else:
                index[h] = (block, n)  # the same prefix cached again in another block
                self._publish(block, h, chain)
        if len(index) > 2 * max(self._pool.num_gpu_blocks if self._pool is not None else 0,
                                1024):
            self._prune()

    def _publish(self, block: Any, h: int, chain: tuple[int, int] | None) -> None:
        if self._withdraw(block):  # (a slot under an earlier hash)
            self._directory.publish(block.block_id, h, chain)

    def _withdraw(self, block: Any) -> bool:
        """Clear ``block``'s slot in the read directory, if there is one; whether the
        directory covers the block."""
        d = self._directory
        if d is None or block.block_id >= d.num_blocks:
            return False
        d.withdraw(block.block_id)
        return True

    def tensor_blocks(self, n: int) -> None:
        """The worker half's count of blocks in vLLM's KV tensors: the read directory's size
        when it is made before the scheduler half binds the block pool (vLLM registers its
        KV caches first)."""
        with self._lock:
            self._tensor_blocks = n

    def read_directory(self) -> Any:
        """The read directory of the indexed blocks (made on the first call, with every block
        indexed then; the same object after): peers read it and the blocks it names without
        a message to this source (:mod:`kvkern.xfer.direct`)."""
        from kvkern.cache.directory import ReadDirectory  # noqa: PLC0415

        with self._lock:
            if self._directory is None:
                n = self._pool.num_gpu_blocks if self._pool is not None else self._tensor_blocks
                if not n:
                    raise ValueError("no read directory before the number of blocks is known")
                self._directory = ReadDirectory(n, DIRECTORY_GROUP)
                for h, entry in self._index.items():
                    block = self._live(entry, h)
                    if block is not None:
                        self._publish(block, h, None)
            return self._directory

    def _prune(self) -> None:
        stale = [h for h, entry in self._index.items()
                 if entry is not _AMBIGUOUS and self._live(entry, h) is None]
        for h in stale:
            del self._index[h]

    def _lookup(self, h: int) -> Any:
        entry = self._index.get(h)
        block = self._live(entry, h)
        if block is None and entry is not None and entry is not _AMBIGUOUS:
            del self._index[h]  # evicted, or handed out (and maybe cached again), since
        return block

    # ------------------------------------------------------- kvkern's manager contract

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_scheme(self) -> str:
        return self._hash_scheme

    @property
    def num_blocks(self) -> int | None:
        return None if self._pool is None else self._pool.num_gpu_blocks

    @property
    def pins_outstanding(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._pins.values())

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        with self._lock:
            self._promote()
            n = 0
            for h in hashes:
                if self._lookup(h) is None:
                    break
                n += 1
            return n

    def pin(self, hashes: Sequence[int], *, require_all: bool = False) -> PinHandle | None:
        with self._lock:
            if self._pool is None or self._resetting_now:
                return None
            self._promote()
            blocks = []
            for h in hashes:
                block = self._lookup(h)
                if block is None:
                    break
                blocks.append(block)
            if not blocks or (require_all and len(blocks) < len(hashes)):
                return None
            self._pool.touch(blocks)
            pin_id = next(self._ids)
            self._pins[pin_id] = blocks
            return PinHandle(pin_id=pin_id, block_ids=tuple(b.block_id for b in blocks),
                             hashes=tuple(hashes[:len(blocks)]))

    def unpin(self, handle: PinHandle) -> None:
        with self._lock:
            blocks = self._pins.pop(handle.pin_id, None)
            if blocks is None:
                raise ValueError(f"pin {handle.pin_id} is not pinned")
            # vLLM frees a request's blocks tail first, so the tail is evicted first
            self._pool.free_blocks(reversed(blocks))
            self._unpinned.notify_all()

    def allocate_private(self, n: int) -> list[int] | None:
        raise NotImplementedError("vLLM allocates a pull's blocks; kvkern fills them "
                                  "(Puller.pull_into)")

    def free_private(self, block_ids: Sequence[int]) -> None:
        raise NotImplementedError("vLLM frees its own blocks")

    def commit_private(self, block_ids: Sequence[int], hashes: Sequence[int], *,
                       lease_s: float | None) -> Lease | None:
        raise NotImplementedError("vLLM caches a pulled request's blocks itself")

    def claim(self, lease: Lease) -> list[int] | None:
        raise NotImplementedError("pulls into vLLM's blocks hold no lease")

    def release_lease(self, lease: Lease) -> None:
        raise NotImplementedError("pulls into vLLM's blocks hold no lease")
