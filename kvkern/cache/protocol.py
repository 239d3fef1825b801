"""What the transfer path needs from an engine's KV cache manager.

The source service and the destination puller (``kvkern.xfer``) talk to the engine's block
manager only through :class:`KVCacheManager`. kvkern manages block *ids*; the KV tensors stay
with the engine. Hashes are the chained u64 block hashes of the manager's scheme
(``kvkern.cache.hashing``): ``hashes[i]`` names the prefix ``tokens[:(i + 1) * block_size]``,
so any suffix of a chain still names whole prefixes::

    request blocks   0    1    2    3    4    5
    hashes           h0   h1   h2   h3   h4   h5
    destination has  [ cached  ]                  longest_prefix(h0..h5) == 3
    puller asks for            [ h3   h4   h5 ]   source: pin(h3..h5)
    destination      allocate_private(3) -> [p3, p4, p5]; receive; commit_private(...)

Calls, and how they map onto the engines' own managers (what an adapter implements, not a
claim that the semantics are identical):

``longest_prefix``
    TRT-LLM V1: walk the reuse radix tree (``findMatchingBlock`` per ``BlockKey``).
    vLLM v1: ``KVCacheManager.get_computed_blocks`` / ``BlockPool.get_cached_block`` per hash.
    SGLang: ``RadixCache.match_prefix(key)`` -> length of ``device_indices`` in pages.
``allocate_private`` / ``free_private``
    TRT-LLM: ``getFreeBlock`` (evicting through the eviction policy) without storing the block
    in the tree; ``releaseBlocks`` of unstored blocks. vLLM: ``BlockPool.get_new_blocks(n)``
    after ``get_num_free_blocks()`` (vLLM raises where kvkern returns ``None``);
    ``free_blocks`` of never-cached blocks. SGLang: ``token_to_kv_pool_allocator.alloc(n *
    page_size)`` (``None`` when short) / ``.free(indices)``.
``pin`` / ``unpin``
    TRT-LLM: ``pinBlocks`` / ``unpinBlocks`` on tree blocks (PR #13055). vLLM:
    ``BlockPool.touch(blocks)`` (ref++, out of the free queue) / ``free_blocks``. SGLang:
    ``inc_lock_ref(node)`` / ``dec_lock_ref(node)``.
``commit_private``
    TRT-LLM: ``storeBlocks`` into the reuse tree. vLLM: ``BlockPool.cache_full_blocks``.
    SGLang: ``RadixCache.insert(key, indices)``.
``claim`` / ``release_lease``
    No engine has a lease: TRT-LLM's seed PR and vLLM's NIXL connector (delay-free) keep a
    request reference instead, SGLang HiCache a node lock. An adapter implements the lease as
    an extra reference with a deadline, dropped by ``release_lease`` or expiry.

Rules every implementation keeps (the reference :class:`kvkern.cache.pool.BlockPool` does):

* Running out of blocks returns ``None``; misuse (unknown ids, double free, unpin of a handle
  that is not pinned) raises ``ValueError`` naming the values.
* A pinned block is never evicted or reused until unpinned; a private block is invisible to
  lookups until committed; a leased block is not evicted until claimed, released or expired.
* A cached block is found (``longest_prefix``, ``pin``) only once its bytes are final: an
  engine that caches a block before its forward pass writes it (vLLM does) holds it back
  until then (:mod:`kvkern.integrations.vllm.blocks`).
* All calls are thread-safe: the source service and the puller run on an asyncio thread, the
  engine elsewhere.

Optional capability
-------------------
``read_directory() -> kvkern.cache.directory.ReadDirectory``
    A table of the cached blocks that destinations read with one-sided reads, without a
    message to the source (:mod:`kvkern.cache.directory`). It is not part of
    :class:`KVCacheManager`: a source looks it up with ``getattr(manager, "read_directory",
    None)`` and serves without it when absent. A manager that offers it returns the same
    directory on every call, keeps its memory valid for its own lifetime, publishes a block
    only once its bytes are final (in device memory: once the kernels that wrote it have
    completed, as a reader follows no stream order) and withdraws it before the block can be
    written again.
    Its ``commit_private`` accepts ``parent=`` (the chained hash before the first committed
    one, ``None`` at a sequence's start), which places a chain's blocks together in the
    directory. The reference :class:`kvkern.cache.pool.BlockPool` has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["KVCacheManager", "Lease", "PinHandle"]


@dataclass(frozen=True, kw_only=True)
class PinHandle:
    """Blocks pinned for one send. ``block_ids[i]`` holds the block named by ``hashes[i]``.

    Unpin exactly once; a second unpin raises ValueError."""

    pin_id: int
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Received, committed blocks kept from eviction for a waiting request.

    ``block_ids[i]`` is the canonical block for ``hashes[i]`` (when a hash was already cached,
    the existing block is leased and the received duplicate freed). ``expires_at`` is on the
    manager's clock."""

    lease_id: int
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    expires_at: float


@runtime_checkable
class KVCacheManager(Protocol):
    """The engine-side contract of the transfer path. See the module docstring."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def hash_scheme(self) -> str:
        """Name of the block-hash scheme (``kvkern.cache.hashing``) the hashes are in."""
        ...

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are cached (committed and not evicted). Read-only."""
        ...

    def allocate_private(self, n: int) -> list[int] | None:
        """``n`` fresh blocks owned by the caller and invisible to lookups, evicting
        least-recently-used cached blocks if needed; ``None`` (and nothing allocated) when
        fewer than ``n`` can be had."""
        ...

    def free_private(self, block_ids: Sequence[int]) -> None:
        """Give back private blocks that will not be committed (failure, abort)."""
        ...

    def commit_private(
        self, block_ids: Sequence[int], hashes: Sequence[int], *, lease_s: float | None
    ) -> Lease | None:
        """Publish validated private blocks under their chained hashes.

        With ``lease_s`` the blocks are leased atomically (no eviction window) and the lease is
        returned; with ``None`` they become ordinary evictable cached blocks and ``None`` is
        returned (the hint's ``no_retain``)."""
        ...

    def claim(self, lease: Lease) -> list[int] | None:
        """Turn a lease into references held by the request (release them like any request
        blocks). ``None`` when the lease had expired (the blocks may still be cached)."""
        ...

    def release_lease(self, lease: Lease) -> None:
        """Drop a lease without claiming; the blocks become evictable cached blocks."""
        ...

    def pin(self, hashes: Sequence[int], *, require_all: bool = False) -> PinHandle | None:
        """Pin the blocks of the longest cached leading run of ``hashes`` for a send.

        ``None`` when nothing is pinned (no leading hash cached, or ``require_all`` and the
        run is short). Pinning claims a cached zero-ref block out of the free queue."""
        ...

    def unpin(self, handle: PinHandle) -> None:
        """Release one send's pins, exactly once."""
        ...
