"""kvkern's pins in vLLM's own block pool (:class:`kvkern.integrations.vllm.blocks.VllmBlocks`)
and vLLM's own block hashes, without an engine: vLLM's ``BlockPool`` and ``Request``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kvkern.cache.hashing import sequence_hashes, vllm_u64
from kvkern.integrations.vllm.blocks import VllmBlocks

pytestmark = pytest.mark.vllm

BS = 4


@pytest.fixture
def vllm_pool():
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    kv_cache_utils.init_none_hash(sha256)
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)

    class Manager:  # stands for vLLM's KVCacheManager: it owns the pool
        block_pool = pool

        def allocate_slots(self, hold_s: float = 0.0):
            time.sleep(hold_s)
            return pool.get_new_blocks(1)

    blocks = VllmBlocks(block_size=BS, hash_scheme="vllm-sha256-v1")
    manager = Manager()
    blocks.bind(manager)
    return pool, manager, blocks


def index_written(blocks: VllmBlocks, block) -> None:
    """Index ``block`` as written under its hash now (as its step's write would)."""
    blocks._add([(block, None, blocks._handouts.get(block.block_id, 0))])


def vllm_request(tokens: list[int], rid: str):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def cached_request(pool, tokens: list[int], rid: str = "r", blocks=None, *,
                   written: bool = True):
    """A vLLM request whose full blocks vLLM computed and cached; with ``blocks`` (the index
    bound to ``pool``), in a step of their own, reported written unless ``written`` is
    false."""
    req = vllm_request(tokens, rid)
    n = len(tokens) // BS
    got = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, got, 0, n, BS, 0)
    if blocks is not None and written:
        blocks.written(blocks.seal())  # the step's forward pass wrote them
    pool.free_blocks(reversed(got))  # the request finished: cached, evictable
    return req, got


def test_vllms_hashes_are_kvkerns_vllm_scheme(vllm_pool):
    pool, _, _ = vllm_pool
    tokens = list(range(40, 52))
    req, _ = cached_request(pool, tokens)
    assert [vllm_u64(h) for h in req.block_hashes] == \
        sequence_hashes(tokens, BS, "vllm-sha256-v1")


def test_pin_holds_cached_blocks_and_unpin_gives_them_back(vllm_pool):
    pool, _, blocks = vllm_pool
    req, got = cached_request(pool, list(range(12)), blocks=blocks)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    free = pool.get_num_free_blocks()
    handle = blocks.pin(hashes, require_all=True)
    assert handle.block_ids == tuple(b.block_id for b in got)
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_num_free_blocks() == free - 3  # out of the free queue: never evicted
    assert blocks.longest_prefix(hashes + [12345]) == 3
    assert blocks.pin(hashes + [12345], require_all=True) is None  # nothing pinned
    assert blocks.pins_outstanding == 3
    blocks.unpin(handle)
    assert [b.ref_cnt for b in got] == [0, 0, 0] and pool.get_num_free_blocks() == free
    with pytest.raises(ValueError, match="not pinned"):
        blocks.unpin(handle)
    assert blocks.longest_prefix(hashes) == 3  # still cached


def test_a_cached_block_is_served_only_once_its_step_is_written(vllm_pool):
    """vLLM caches a block when it schedules the step that computes it, before the forward
    pass writes it: the index serves it only after the step is sealed and reported written
    (and its ready check passes), and a later step's blocks wait for that step."""
    pool, _, blocks = vllm_pool
    first, _ = cached_request(pool, list(range(300, 308)), "first", blocks, written=False)
    early = [vllm_u64(h) for h in first.block_hashes]
    assert blocks.longest_prefix(early) == 0 and blocks.pin(early) is None  # not sealed
    step = blocks.seal()
    later, _ = cached_request(pool, list(range(400, 408)), "later", blocks, written=False)
    late = [vllm_u64(h) for h in later.block_hashes]
    next_step = blocks.seal()
    ready = []
    blocks.written(step, lambda: bool(ready))  # forward issued, its event not passed yet
    assert blocks.longest_prefix(early) == 0 and blocks.pin(early) is None
    ready.append(True)
    assert blocks.longest_prefix(early) == 2 and blocks.longest_prefix(late) == 0
    blocks.written(next_step)
    assert blocks.longest_prefix(late) == 2


def test_a_block_cached_again_waits_for_its_new_step(vllm_pool):
    """A block evicted and cached under another hash before its first step is written is
    served under neither hash then, and under the new one once the new step is written."""
    pool, _, blocks = vllm_pool
    first, got = cached_request(pool, list(range(500, 504)), "first", blocks, written=False)
    step = blocks.seal()
    held = pool.get_new_blocks(pool.get_num_free_blocks())  # vLLM reuses every free block
    assert got[0] in held and got[0].block_hash is None
    second = vllm_request(list(range(600, 604)), "second")
    pool.cache_full_blocks(second, got, 0, 1, BS, 0)  # the same block, a new prefix
    next_step = blocks.seal()
    old, new = (vllm_u64(r.block_hashes[0]) for r in (first, second))
    blocks.written(step)
    assert blocks.longest_prefix([old]) == 0 and blocks.longest_prefix([new]) == 0
    blocks.written(next_step)
    assert blocks.longest_prefix([new]) == 1 and blocks.longest_prefix([old]) == 0
    pool.free_blocks(held)


def test_a_block_reused_and_cached_again_under_its_old_hash_waits_for_its_new_step(vllm_pool):
    """vLLM evicts a served block, writes another request's KV into it, and later caches it
    under the same hash again for a request whose step has not run: no peer gets it (its
    bytes are still the other request's) until that step is written."""
    pool, _, blocks = vllm_pool
    tokens = list(range(800, 804))
    first, got = cached_request(pool, tokens, "first", blocks)
    h = vllm_u64(first.block_hashes[0])
    directory = blocks.read_directory()
    assert blocks.longest_prefix([h]) == 1 and found_at_home(directory, [h]) == [
        got[0].block_id]  # (served; its request done: cached, evictable)
    other = pool.get_new_blocks(pool.get_num_free_blocks())  # evicts it: another's KV
    assert got[0] in other and got[0].block_hash is None
    blocks.written(blocks.seal())
    pool.free_blocks(reversed(other))  # (no hash: back at the head of the free queue)
    again = vllm_request(tokens, "again")
    (b,) = pool.get_new_blocks(1)
    assert b is got[0]
    pool.cache_full_blocks(again, [b], 0, 1, BS, 0)  # the old hash, before its forward pass
    step = blocks.seal()
    assert blocks.longest_prefix([h]) == 0 and blocks.pin([h]) is None
    assert found_at_home(directory, [h]) == [-1]
    blocks.written(step)
    assert blocks.longest_prefix([h]) == 1
    assert found_at_home(directory, [h]) == [b.block_id]


def test_a_step_written_late_does_not_serve_a_block_reused_since(vllm_pool):
    """A block cached under a hash in a step not yet written, then evicted, reused and cached
    under the same hash in a later step, is served once the later step is written, not when
    the earlier one is."""
    pool, _, blocks = vllm_pool
    tokens = list(range(900, 904))
    first, got = cached_request(pool, tokens, "first", blocks, written=False)
    early = blocks.seal()
    other = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks(reversed(other))
    (b,) = pool.get_new_blocks(1)
    assert b is got[0]
    pool.cache_full_blocks(vllm_request(tokens, "again"), [b], 0, 1, BS, 0)
    late = blocks.seal()
    h = vllm_u64(first.block_hashes[0])
    blocks.written(early)
    assert blocks.longest_prefix([h]) == 0 and blocks.pin([h]) is None
    blocks.written(late)
    assert blocks.longest_prefix([h]) == 1


def test_steps_never_reported_written_are_bounded(vllm_pool, monkeypatch):
    """Without a worker half reporting its steps, at most MAX_UNWRITTEN_STEPS steps' cached
    blocks wait: older ones are dropped, never served."""
    from kvkern.integrations.vllm import blocks as blocks_mod

    monkeypatch.setattr(blocks_mod, "MAX_UNWRITTEN_STEPS", 2)
    pool, _, blocks = vllm_pool
    reqs = []
    for i in range(3):
        req, _ = cached_request(pool, list(range(700 + 4 * i, 704 + 4 * i)), f"s{i}", blocks,
                                written=False)
        reqs.append(req)
        last = blocks.seal()
    assert len(blocks._unwritten) == 2
    blocks.written(last)
    assert [blocks.longest_prefix([vllm_u64(r.block_hashes[0])]) for r in reqs] == [0, 1, 1]


def found_at_home(directory, hashes: list[int]) -> list[int]:
    """The block ids a destination's direct read finds for a sequence's ``hashes`` in their
    home buckets (kvkern.xfer.direct's first round), -1 where absent."""
    import numpy as np

    from kvkern.cache.directory import find, home_buckets

    home = home_buckets(hashes, 0, len(hashes), directory.buckets, directory.group)
    return find(directory.table[home], np.asarray(hashes, dtype=np.uint64))[1].tolist()


def test_the_read_directory_names_written_blocks_until_vllm_hands_them_out(vllm_pool):
    """The read directory a source registers for direct reads names a block from when its
    step is written, in the home bucket a destination reads first, and no longer once vLLM
    hands the block out again (before anything writes it) or its u64 turns ambiguous."""
    pool, _, blocks = vllm_pool
    directory = blocks.read_directory()
    assert blocks.read_directory() is directory
    req, got = cached_request(pool, list(range(800, 812)), "d", blocks, written=False)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    assert found_at_home(directory, hashes) == [-1, -1, -1]  # cached, not written
    blocks.written(blocks.seal())
    assert found_at_home(directory, hashes) == [b.block_id for b in got]
    directory.check({h: b.block_id for h, b in zip(hashes, got, strict=True)})
    held = pool.get_new_blocks(pool.get_num_free_blocks())  # vLLM reuses every free block
    assert found_at_home(directory, hashes) == [-1, -1, -1] and directory.published == 0
    pool.free_blocks(held)
    one = SimpleNamespace(block_id=5, block_hash=b"A" * 24 + b"12345678" + b"\0\0\0\0")
    two = SimpleNamespace(block_id=6, block_hash=b"B" * 24 + b"12345678" + b"\0\0\0\0")
    index_written(blocks, one)
    assert directory.slot_of(5) >= 0
    index_written(blocks, two)  # the u64 turns ambiguous: neither block is named
    assert directory.slot_of(5) == directory.slot_of(6) == -1


def test_an_evicted_block_is_not_served(vllm_pool):
    pool, _, blocks = vllm_pool
    req, _ = cached_request(pool, list(range(100, 108)), blocks=blocks)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    pool.get_new_blocks(pool.get_num_free_blocks())  # vLLM reuses every free block
    assert blocks.pin(hashes) is None and blocks.longest_prefix(hashes) == 0


def test_two_vllm_hashes_with_one_u64_are_never_served(vllm_pool):
    _, _, blocks = vllm_pool
    one = SimpleNamespace(block_id=5, block_hash=b"A" * 24 + b"12345678" + b"\0\0\0\0")
    two = SimpleNamespace(block_id=6, block_hash=b"B" * 24 + b"12345678" + b"\0\0\0\0")
    index_written(blocks, one)
    h = vllm_u64(one.block_hash[:-4])
    assert blocks.longest_prefix([h]) == 1
    index_written(blocks, two)
    assert blocks.longest_prefix([h]) == 0 and blocks.pin([h]) is None


def test_pins_wait_for_the_scheduler_call_in_progress(vllm_pool):
    pool, manager, blocks = vllm_pool
    req, _ = cached_request(pool, list(range(200, 208)), blocks=blocks)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    busy = threading.Thread(target=manager.allocate_slots, args=(0.3,))
    busy.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    handle = blocks.pin(hashes)  # waits until allocate_slots has returned
    waited = time.monotonic() - t0
    busy.join()
    assert handle is not None and waited >= 0.2, waited
    blocks.unpin(handle)


def test_a_prefix_cache_reset_or_eviction_withdraws_what_the_directory_named(vllm_pool):
    """vLLM clears block hashes in place when its prefix cache is reset (after a weight
    update, say) and when it evicts blocks whose KV it found invalid: the read directory
    then names none of them, so no peer reads KV of the old weights (or invalid KV) under
    a hash it still matches; blocks cached after the reset are served again."""
    pool, _, blocks = vllm_pool
    directory = blocks.read_directory()
    req, got = cached_request(pool, list(range(800, 812)), "d", blocks)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    assert found_at_home(directory, hashes) == [b.block_id for b in got]
    assert pool.reset_prefix_cache()
    assert found_at_home(directory, hashes) == [-1] * len(hashes)
    assert directory.published == 0 and blocks.longest_prefix(hashes) == 0
    req, got = cached_request(pool, list(range(800, 812)), "again", blocks)
    assert found_at_home(directory, hashes) == [b.block_id for b in got]
    assert blocks.longest_prefix(hashes) == len(hashes)
    pool.evict_blocks({got[1].block_id})
    assert found_at_home(directory, hashes) == [got[0].block_id, -1, got[2].block_id]


def test_a_u64_turned_ambiguous_leaves_the_directory_in_every_block_it_named():
    """The same vLLM hash cached in two blocks names both in the read directory; once
    another vLLM hash with the same low 64 bits arrives, neither may be read directly any
    more, as neither is pinned."""
    import numpy as np

    from kvkern.cache.directory import bucket_of, find
    from kvkern.integrations.vllm.blocks import _u64

    blocks = VllmBlocks(block_size=BS, hash_scheme="vllm-sha256-v1")
    blocks.tensor_blocks(16)
    directory = blocks.read_directory()
    key, other = b"A" * 24 + b"12345678" + bytes(4), b"B" * 24 + b"12345678" + bytes(4)
    first, again = (SimpleNamespace(block_id=i, block_hash=key) for i in (5, 6))
    clash = SimpleNamespace(block_id=7, block_hash=other)
    index_written(blocks, first)
    index_written(blocks, again)
    assert directory.slot_of(5) >= 0 and directory.slot_of(6) >= 0
    index_written(blocks, clash)
    h = np.array([_u64(key)], np.uint64)
    assert find(directory.table[bucket_of(h, directory.buckets)], h)[1].tolist() == [-1]
    assert directory.published == 0 and blocks.longest_prefix([int(h[0])]) == 0


def test_a_prefix_cache_reset_waits_for_peers_pins_and_grants_none_meanwhile(vllm_pool):
    """vLLM's sleep and pause (clear_cache) reset the prefix cache and fail when a block is
    still in use: the reset waits for a peer's pin to end, and a pin asked for meanwhile is
    refused (that peer pulls elsewhere or recomputes)."""
    pool, _, blocks = vllm_pool
    req, _ = cached_request(pool, list(range(900, 912)), "p", blocks)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    held = blocks.pin(hashes)
    refused: list = []

    def peer() -> None:
        time.sleep(0.1)
        refused.append(blocks.pin(hashes))  # during the reset's wait
        time.sleep(0.1)
        blocks.unpin(held)

    t = threading.Thread(target=peer)
    t.start()
    t0 = time.monotonic()
    assert pool.reset_prefix_cache()
    waited = time.monotonic() - t0
    t.join()
    assert refused == [None] and 0.15 <= waited < 5, (refused, waited)
    assert blocks.longest_prefix(hashes) == 0 and blocks.pins_outstanding == 0
    assert blocks.pin(hashes) is None  # (forgotten with the reset)


@pytest.mark.parametrize("held", ["other blocks", "the pinned blocks"])
def test_a_prefix_cache_reset_that_vllm_refuses_anyway_waits_for_no_pin(vllm_pool, held):
    """While vLLM's own requests hold blocks it refuses a reset whatever peers pin, also
    when a request hit the very blocks a peer pinned (a second reference, no block more in
    use): the reset answers at once instead of holding the engine for a pin's time."""
    pool, _, blocks = vllm_pool
    req, got = cached_request(pool, list(range(920, 932)), "q", blocks)
    hashes = [vllm_u64(h) for h in req.block_hashes]
    pinned = blocks.pin(hashes)
    if held == "other blocks":
        running = pool.get_new_blocks(2)  # a request's blocks, in use
    else:
        pool.touch(got)  # a running request's prefix-cache hit on the pinned blocks
        running = got
    t0 = time.monotonic()
    assert not pool.reset_prefix_cache()
    assert time.monotonic() - t0 < 1.0 and blocks.pins_outstanding == len(hashes)
    pool.free_blocks(running)
    blocks.unpin(pinned)
    assert pool.reset_prefix_cache()
