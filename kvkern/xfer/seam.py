"""The transport seam of the pull path: the small Protocols the destination's roles need
from a transport. :class:`kvkern.xfer.transport.Connection` and
:class:`~kvkern.xfer.transport.ConnectionPool` (UCXX) implement them; the runner and the
receivers (:mod:`kvkern.xfer.runner`, :mod:`kvkern.xfer.receive`) are typed against them, so
another implementation (an in-memory one for tests, NIXL) can sit behind the same calls.

Failures are :class:`kvkern.xfer.transport.TransportError` with a
:class:`kvkern.xfer.codes.TransportFailure` reason; every call is bounded by its timeout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar, runtime_checkable

from kvkern.xfer.messages import Codec, Message

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["Buffer", "BufferT", "ControlChannel", "Connector", "OneSidedReader", "ReadPart",
           "StreamReceiving", "TransferConnection"]

# (packed remote key, runs of (local address, remote address, nbytes))
ReadPart = tuple[bytes, Sequence[tuple[int, int, int]]]

# One contiguous buffer a message or chunk travels in: a tensor (host or device), a numpy
# array or a buffer-protocol object; an object with ``__cuda_array_interface__`` is accepted
# too (:func:`kvkern.xfer.transport.as_send_buffer` checks contiguity at run time).
Buffer: TypeAlias = "torch.Tensor | np.ndarray | memoryview | bytearray | bytes"
# The buffer a stream's ``buffer_for`` returns is the one its ``on_chunk`` gets back.
BufferT = TypeVar("BufferT", bound="Buffer")


@runtime_checkable
class ControlChannel(Protocol):
    """Typed control messages on tags (:func:`kvkern.xfer.transport.tag_for`)."""

    @property
    def alive(self) -> bool: ...

    async def send_msg(self, msg: Message, tag: int = ..., *, timeout: float = ...) -> None: ...

    async def recv_msg(self, tag: int = ..., *, timeout: float | None = ...,
                       max_bytes: int | None = ...) -> Message: ...


@runtime_checkable
class StreamReceiving(Protocol):
    """A transfer's chunks, each received into the buffer ``buffer_for(i)`` returns."""

    async def recv_stream(self, transfer_id: int, buffer_for: Callable[[int], BufferT],
                          n_chunks: int, *,
                          on_chunk: Callable[[int, BufferT], Awaitable[None] | None] | None = ...,
                          timeout: float = ..., max_in_flight: int = ...) -> int: ...


@runtime_checkable
class OneSidedReader(Protocol):
    """One-sided reads of a peer's registered memory on the connection itself; returns when
    the first byte landed. Optional: a UCX connection has none (its worker's context has no
    RMA; reads run on read lanes, :mod:`kvkern.xfer.read_lanes`), the in-process transport
    (:mod:`kvkern.xfer.memtransport`) reads this way."""

    async def read_parts(self, parts: Sequence[ReadPart], *,
                         timeout: float = ...) -> float | None: ...


@runtime_checkable
class TransferConnection(ControlChannel, StreamReceiving, Protocol):
    """Everything one pair of a pull uses on its connection to a source rank (and
    :class:`OneSidedReader` where the connection reads)."""


@runtime_checkable
class Connector(Protocol):
    """Connections to source ranks, one per address, shared by concurrent pulls."""

    codec: Codec

    async def get(self, host: str, port: int) -> TransferConnection: ...
