"""The vLLM connector's worker half reports each step's forward pass to the block index
(:meth:`WorkerSide.forward_done`), which serves the blocks vLLM cached for that step only from
then on; on a GPU, only once the compute stream has passed the event recorded at that point.
vLLM itself is not needed: a stand-in block pool with vLLM's ``cache_full_blocks`` signature."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvkern.integrations.vllm.blocks import VllmBlocks
from kvkern.integrations.vllm.scheduler import LoadMetadataBase
from kvkern.integrations.vllm.worker import WorkerSide


class _Pool:
    """The part of vLLM's ``BlockPool`` that the index binds to."""

    num_gpu_blocks = 8

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks,
                          block_size, kv_cache_group_id):
        for i, b in enumerate(blocks[num_cached_blocks:num_full_blocks]):
            b.block_hash = request.keys[i]

    def touch(self, blocks):
        pass

    def get_new_blocks(self, num_blocks):
        return []

    def free_blocks(self, blocks):
        pass


def _u64_key(h: int) -> bytes:
    """A vLLM ``BlockHashWithGroupId`` whose low 64 bits are ``h`` (group 0)."""
    return bytes(24) + h.to_bytes(8, "big") + bytes(4)


def _step(index: VllmBlocks, pool: _Pool, hashes: list[int]) -> int:
    """vLLM schedules a step that caches blocks for ``hashes``; the step's number."""
    blocks = [SimpleNamespace(block_id=i, block_hash=None) for i in range(len(hashes))]
    pool.cache_full_blocks(SimpleNamespace(keys=[_u64_key(h) for h in hashes]), blocks, 0,
                           len(blocks), 16, 0)
    return index.seal()


@pytest.fixture
def bound():
    index = VllmBlocks(block_size=16, hash_scheme="vllm-sha256-v1")
    pool = _Pool()
    index.bind(SimpleNamespace(block_pool=pool))
    worker = WorkerSide(SimpleNamespace(blocks=index))
    return index, pool, worker


def test_a_steps_blocks_are_served_after_its_forward_pass_on_the_cpu(bound):
    index, pool, worker = bound
    step = _step(index, pool, [11, 12])
    assert index.longest_prefix([11, 12]) == 0  # cached, not yet written
    worker.forward_done(LoadMetadataBase([], step=step))
    assert index.longest_prefix([11, 12]) == 2
    worker.forward_done(LoadMetadataBase([]))  # metadata without a step: nothing to report
    assert index.longest_prefix([11, 12]) == 2


@pytest.mark.gpu
def test_on_a_gpu_a_steps_blocks_wait_for_the_stream_to_pass_its_forward_pass(bound):
    index, pool, worker = bound
    worker._on_device = True
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    step = _step(index, pool, [21])
    for _ in range(40):  # the step's forward pass, still running when it is reported
        a = a @ a / 4096
    worker.forward_done(LoadMetadataBase([], step=step))
    assert index.longest_prefix([21]) == 0
    torch.cuda.synchronize()
    assert index.longest_prefix([21]) == 1


class _ReusingPool(_Pool):
    """A pool that hands its free blocks out again, front first, evicting their hashes (as
    vLLM's ``get_new_blocks``), and takes freed ones back at the end."""

    def __init__(self, n: int) -> None:
        self.free = [SimpleNamespace(block_id=i, block_hash=None) for i in range(n)]

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks,
                          block_size, kv_cache_group_id):
        for b, key in zip(blocks[num_cached_blocks:num_full_blocks], request.keys,
                          strict=False):
            b.block_hash = key

    def get_new_blocks(self, num_blocks):
        out, self.free = self.free[:num_blocks], self.free[num_blocks:]
        for b in out:
            b.block_hash = None
        return out

    def free_blocks(self, blocks):
        self.free.extend(blocks)


@pytest.mark.parametrize("late", [False, True], ids=["served-first", "step-written-late"])
def test_a_block_handed_out_and_cached_again_under_its_hash_waits_for_its_new_step(late):
    """vLLM may evict a cached block, write other KV into it and cache it under the same
    hash again before that step's forward pass: it is served again only once that step is
    written (also when the first step that cached it is reported written only then)."""
    index = VllmBlocks(block_size=16, hash_scheme="vllm-sha256-v1")
    pool = _ReusingPool(1)
    index.bind(SimpleNamespace(block_pool=pool))
    key = SimpleNamespace(keys=[_u64_key(41)])
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(key, [b], 0, 1, 16, 0)
    first = index.seal()
    if not late:
        index.written(first)
        assert index.longest_prefix([41]) == 1
    pool.free_blocks([b])
    (other,) = pool.get_new_blocks(1)  # another request's KV goes in
    assert other is b
    pool.free_blocks([other])
    (again,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(key, [again], 0, 1, 16, 0)
    step = index.seal()
    index.written(first)
    assert again is b and index.longest_prefix([41]) == 0 and index.pin([41]) is None
    index.written(step)
    assert index.longest_prefix([41]) == 1
