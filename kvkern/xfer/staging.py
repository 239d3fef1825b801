"""Reusable staging buffers for streams, shared by the sends of a source and the receive
rings of a puller (loop thread only)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvkern.layout.hostmem import host_buffer
from kvkern.xfer.devstream import Ready

__all__ = ["StagingPool"]


class StagingPool:
    """Reusable staging buffers, by (device, size class); sizes are powers of two.

    Reusing send buffers saves page faults on the host (measured: a fresh 16 MiB buffer costs
    ~2-4 ms of first-touch faults on a 2-core host) and, on GPUs and RDMA NICs, UCX
    memory registrations (its registration cache keys on addresses). At most ``max_bytes``
    are kept idle; a buffer is given back only when no send or receive can still touch it.

    A device kernel may still be reading a buffer when it is given back (the destination's
    unpack of its last chunks runs on a side stream, :mod:`kvkern.xfer.devstream`): ``give``
    then takes that kernel's event, and the buffer is neither taken again nor dropped to
    the allocator before the event fired.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._pending: list[tuple[torch.Tensor, Ready]] = []  # given back, event not fired

    @staticmethod
    def size_class(nbytes: int) -> int:
        return 1 << max(nbytes - 1, 1).bit_length()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    @property
    def pending(self) -> int:
        """Buffers given back whose event has not fired yet."""
        return len(self._pending)

    def take(self, device: torch.device, nbytes: int) -> torch.Tensor:
        size = self.size_class(nbytes)
        self._settle()
        free = self._free.get((str(device), size))
        if free:
            self._idle_bytes -= size
            return free.pop()
        if device.type == "cpu":  # huge pages: UCX's CMA reads them 2-5x faster (hostmem)
            return host_buffer(size)
        return torch.empty(size, dtype=torch.uint8, device=device)

    def prewarm(self, device: torch.device, nbytes: int, count: int) -> None:
        """Keep ``count`` buffers of ``nbytes``'s size class ready, their pages faulted in
        now: a pull's first touch of fresh huge-page memory stalled 50-150 ms on this
        machine (THP compaction), once per new size class, on the first pulls of a worker."""
        size = self.size_class(nbytes)
        have = len(self._free.get((str(device), size), []))
        fresh = [self.take(device, size) for _ in range(max(0, count - have))]
        for b in fresh:
            b.zero_()
        if fresh and torch.device(device).type == "cuda":
            # done before UCX or a side stream, which this stream does not order, writes them
            # (with their device current: a CUDA call on a thread with none makes GPU 0's
            # context)
            with torch.cuda.device(device):
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(device))
                done.synchronize()
        self.give(fresh)

    def give(self, bufs: Iterable[torch.Tensor], ready: Ready | None = None) -> None:
        """Keep ``bufs`` for reuse (or drop them past ``max_bytes``) once ``ready`` fired:
        the event after the last kernel that reads or writes them (None: nothing does)."""
        self._settle()
        if ready is not None and not ready.query():
            self._pending.extend((b, ready) for b in bufs)
            return
        self._keep(bufs)

    def _settle(self) -> None:
        if self._pending:
            fired = [r for r in {id(r): r for _, r in self._pending}.values() if r.query()]
            done = {id(r) for r in fired}
            self._keep(b for b, r in self._pending if id(r) in done)
            self._pending = [(b, r) for b, r in self._pending if id(r) not in done]

    def _keep(self, bufs: Iterable[torch.Tensor]) -> None:
        for b in bufs:
            size = b.numel()
            if self._idle_bytes + size > self.max_bytes:
                continue  # dropped: the allocator gets it back
            self._free.setdefault((str(b.device), size), []).append(b)
            self._idle_bytes += size

    def clear(self) -> None:
        """Drop the idle buffers; those whose event has not fired stay until it has."""
        self._free.clear()
        self._idle_bytes = 0
        self._pending = [(b, r) for b, r in self._pending if not r.query()]
