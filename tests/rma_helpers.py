"""What the read tests share (test_ucp_rma: reads on a connection; test_read_lanes: reads on
read lanes): a random source buffer, and stand-ins for :class:`kvkern.xfer.ucp_rma.ReadBatch`."""

from __future__ import annotations

import asyncio
import time

import torch

from kvkern.layout.hostmem import host_buffer
from kvkern.xfer import ucp_rma


def random_host_buffer(nbytes: int, seed: int = 20261130) -> torch.Tensor:
    """``nbytes`` (a multiple of 8) of seeded random bytes in host memory."""
    buf = host_buffer(nbytes)
    g = torch.Generator().manual_seed(seed)
    buf.view(torch.int64).copy_(torch.randint(-2**63, 2**63 - 1, (nbytes // 8,),
                                              dtype=torch.int64, generator=g))
    return buf


async def until(condition, timeout: float = 10.0) -> None:
    """Wait on the loop until ``condition()`` holds; an AssertionError after ``timeout``
    seconds. (A fixed sleep before an assertion fails on a slow host.)"""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not so within {timeout} s"
        await asyncio.sleep(0.001)


def held_batch_class(made: list) -> type:
    """A ReadBatch whose real requests' completion polling is held until its wait gave up
    (a CMA read is done before it could time out or be stopped); each one is appended to
    ``made``."""

    class HeldBatch(ucp_rma.ReadBatch):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.hold = True
            made.append(self)

        def poll(self):
            return False if self.hold else super().poll()

        def waiting(self, timeout, cancelled=None):
            try:
                return (yield from super().waiting(timeout, cancelled))
            finally:
                self.hold = False

    return HeldBatch


class NeverDone:
    """A batch that never completes, not even after its endpoint is aborted or closed."""

    stuck = True
    posted = 1

    def __init__(self, key, runs, **kw):
        pass

    def post(self, ep_handle):
        pass

    def wait(self, timeout, cancelled=None):
        raise TimeoutError("never")

    def waiting(self, timeout, cancelled=None):
        raise TimeoutError("never")
        yield  # (steps, as ReadBatch.waiting)

    def poll(self):
        return False
