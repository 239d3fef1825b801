"""The transport seam of the pull path: the small Protocols the destination's roles need
from a transport. :class:`kvkern.xfer.transport.Connection` and
:class:`~kvkern.xfer.transport.ConnectionPool` (UCXX) implement them; the runner and the
receivers (:mod:`kvkern.xfer.runner`, :mod:`kvkern.xfer.receive`) are typed against them, so
another implementation (an in-memory one for tests, NIXL) can sit behind the same calls.

Failures are :class:`kvkern.xfer.transport.TransportError` with a
:class:`kvkern.xfer.codes.TransportFailure` reason; every call is bounded by its timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvkern.xfer.messages import Codec, Message

__all__ = ["ControlChannel", "Connector", "OneSidedReader", "ReadPart", "StreamReceiving",
           "TransferConnection"]

# (packed remote key, runs of (local address, remote address, nbytes))
ReadPart = tuple[bytes, Sequence[tuple[int, int, int]]]


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

    async def recv_stream(self, transfer_id: int, buffer_for: Callable[[int], Any],
                          n_chunks: int, *, on_chunk: Callable[[int, Any], Any] | None = ...,
                          timeout: float = ..., max_in_flight: int = ...) -> int: ...


@runtime_checkable
class OneSidedReader(Protocol):
    """One-sided reads of a peer's registered memory; returns when the first byte landed."""

    async def read_parts(self, parts: Sequence[ReadPart], *,
                         timeout: float = ...) -> float | None: ...


@runtime_checkable
class TransferConnection(ControlChannel, StreamReceiving, OneSidedReader, Protocol):
    """Everything one pair of a pull uses on its connection to a source rank."""


@runtime_checkable
class Connector(Protocol):
    """Connections to source ranks, one per address, shared by concurrent pulls."""

    codec: Codec

    async def get(self, host: str, port: int) -> TransferConnection: ...
