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
