"""The UCXX transport of the pull path: listener, connection pool, framed control messages
and chunked data streams, all under timeouts, with typed errors.

Tag scheme
----------
ucxx hashes a non-forced user tag together with the endpoint's private tag agreed at connect
time, so a tag is private to one connection; within it, ``tag_for`` gives each transfer and
chunk its own 60-bit integer (an int below 2**61 - 1 hashes to itself in every process; string
tags hash per process and never match, ``force_tag`` is worker-wide)::

    bit 59            30 29  28 27                 0
        [ transfer id   ][lane ][ chunk index        ]
          30 bits          2      28 bits

    lane 0 CONTROL  transfer id 0 index 0: the one well-known tag a source reads requests and
                    cancels from (any transfer of that connection)
    lane 1 REPLY    the source's PullReply for transfer id
    lane 2 DATA     chunk ``index`` of transfer id
    lane 3 TRAILER  the trailer of the stream of transfer id whose first chunk is ``index``

Stream trailers
---------------
A tag receive takes a message shorter than its buffer as if whole, and ucxx reports no
received length (only a longer one fails, as truncated). So after a stream's last chunk the
sender sends a trailer of :data:`TRAILER_BYTES`: the number of chunks it sent, their bytes, and
a digest of their lengths in order, each taken from the buffers it handed to UCX. The receiver
compares it with the buffers it received into and fails the stream (``protocol_error``) on
any difference, before returning. The trailer is the sender's word, so the receiver also
writes random bytes at the end of each host buffer before its receive (:class:`TailCanary`):
a chunk that stopped short leaves them in place and fails the stream even behind a trailer
that lies, and one that stopped fewer than :data:`CANARY_BYTES` short leaves random bytes,
never the buffer's old tail. The trailer's receive is posted right after the last chunk's.

The sender posts the trailer only once every chunk's send has completed. A receiver that
takes the same host's rendezvous chunks copies them out of the sender's memory itself, and
an abort of the sender's endpoint does not stop that copy: a buffer the sender reuses after
an abort (a staging slot packed again, a pool block unpinned and rewritten) could otherwise
still be read into a stream whose trailer had been sent. A completed send is one the
receiver has finished reading, so a stream that has its trailer holds every chunk as sent.

A control frame of up to ``CONTROL_FRAME_BYTES`` (64 KiB: every reply, cancel and ack, and
requests of up to ~7,000 block hashes) is ONE message on its tag, received into a buffer of
that size; its 20-byte preamble (:mod:`kvkern.xfer.messages`) is checked before the body is
decoded. A longer frame is two messages: its preamble alone (so the receiver learns the
length from the preamble, not from UCX), then the body. Each message costs a completion on
both sides, ~0.1-0.3 ms over TCP loopback, so the common case is kept to one. One sender lock per
connection keeps a split frame's parts adjacent; each tag has at most one reader at a time.

Authentication and bounds
-------------------------
With a credential (by default the environment's, :mod:`kvkern.xfer.auth`) a
:class:`ConnectionPool` runs :func:`authenticate_client` on every new connection and a
:class:`Listener` runs :func:`authenticate_server` before its handler sees one: Hello on the
control tag, Challenge on ``AUTH_REPLY_TAG``, Proof on the control tag; one round trip per
connection, and the first request follows the Proof without waiting. Before the exchange a
listener reads at most two :data:`AUTH_FRAME_BYTES` frames within
:data:`DEFAULT_AUTH_TIMEOUT_S`. After it, a connection accepts frames of at most
``max_frame_bytes`` (:data:`MAX_CONTROL_FRAME_BYTES`), refused from their preamble before
anything is allocated, and the body of a split frame must follow its preamble within
:data:`BODY_TIMEOUT_S` even where the caller waits for the preamble without a timeout.

Errors
------
Every operation is bounded. Failures raise :class:`TransportError` whose ``reason`` is one of
``transfer_timeout``, ``transfer_failed``, ``peer_closed``, ``connect_timeout``,
``connect_failed``, ``protocol_error``, ``auth_failed``, ``closed``. Any failure in the middle of an operation
aborts the connection before the error is raised: UCX may still own the buffers of
outstanding requests (a timed-out send is *not* cancelled by UCX) and only an endpoint abort
cancels them, so after the raise every caller buffer is free to reuse (a receiver on the same
host may still copy from a send's buffer, but no stream it counts: see "Stream trailers"). A
:class:`ConnectionPool` then reconnects on the next ``get``. The same rule holds before a
connection exists: connects and accepts run their first exchange through
:mod:`kvkern.xfer.handshake`, whose buffers outlive an exchange that ends early.

Progress mode
-------------
``thread`` (ucxx's default; set by :mod:`kvkern.xfer.ucx_env` unless ``UCXPY_PROGRESS_MODE``
is set). Measured with ``kvkern bench xfer`` on 2 CPU cores over loopback (table in
:mod:`kvkern.tools.benchcli`): polling wins latency (control round trip 72 us vs 0.25-2.5 ms) and a
single 256 MiB buffer (11 vs 5.4 GB/s), but loses chunked streams (2.2 vs 4.3 GB/s at 4 MiB x
4) and spins the event loop at 100% of a core in every process, starving the rest of a
serving worker (HTTP, scheduling) and, on a shared core, the peer. Thread progress keeps
the event loop free and lets a packer run while chunks fly. ucxx's ``blocking`` mode has the
shortest control round trip (0.17-0.25 ms against 1.06 ms, hint to first byte 0.67 against
2.39 ms, ``bench/results/xfer/*-progress-*.json``), and streams of 16-64 MiB took 17-58%
less time, because its event-loop tasks progress the worker without pause: an idle process
spends a whole core in it (2.97 CPU seconds in 3 idle seconds, against 0.17 in thread mode),
which on two cores halves the read lanes' copies (one-sided reads of 64 MiB in 26-28 ms
against 12.6-14.3 ms). A dedicated transfer process may still set
``UCXPY_PROGRESS_MODE=polling``. ``thread-polling`` collapsed on 2 cores (1.3 GB/s, 83 ms
round trip). Request completion uses ucxx's notifier thread (``UCXPY_ENABLE_PYTHON_FUTURE=1``,
see :mod:`kvkern.xfer.ucx_env` and :func:`bind_ucxx_loop`): in thread mode without it every
await spins the event loop, which put the control round trip at 3.6 ms against 0.58 ms with
it (same run, ``--cases messages``). Its body is kvkern's
(:func:`kvkern.xfer.ucxcompat.install_notifier`): one loop callback per batch of completions.

This module uses ucxx's public API only; what it needs of ucxx's internals (the notifier
thread, the application context's features) is in :mod:`kvkern.xfer.ucxcompat`.

One-sided reads
---------------
None on a connection: its worker's context has no RMA (:data:`ucxcompat.APP_FEATURES`).
Reads run on read lanes (:mod:`kvkern.xfer.read_lanes`), workers of their own.

Buffers
-------
Host memory: ``bytes``/``bytearray``/``memoryview``, numpy arrays, CPU torch tensors (any
dtype; sent as their raw bytes). Device memory: any object with
``__cuda_array_interface__`` and CUDA torch tensors go to UCX as is, and UCX's CUDA
transports move them (never run on a GPU yet). Non-contiguous buffers raise ``ValueError``:
ucxx would silently send the wrong bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import logging
import os
import secrets
import struct
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

from kvkern.checks import check_positive_int
from kvkern.xfer import handshake, ucxcompat
from kvkern.xfer.auth import FROM_ENV, NONCE_BYTES, Credential
from kvkern.xfer.auth import resolve as resolve_credential
from kvkern.xfer.messages import (
    DEFAULT_CODEC,
    PREAMBLE_BYTES,
    Codec,
    Message,
    ProtocolError,
)
from kvkern.xfer.tuning import (
    BODY_TIMEOUT_S,
    DEFAULT_AUTH_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_TIMEOUT_S,
    MAX_UNTRUSTED_CONNECTIONS,
)
from kvkern.xfer.ucx_env import import_ucxx, ucx_tls_problem

if TYPE_CHECKING:
    from ucxx._lib_async import Endpoint as UcxEndpoint
    from ucxx._lib_async import Listener as UcxListener

    from kvkern.xfer.networks import Networks, ProvenHosts
    from kvkern.xfer.quarantine import Outstanding
    from kvkern.xfer.seam import Buffer, BufferT

log = logging.getLogger(__name__)

TRANSFER_ID_BITS = 30
LANE_BITS = 2
INDEX_BITS = 28
MAX_TRANSFER_ID = (1 << TRANSFER_ID_BITS) - 1
MAX_CHUNK_INDEX = (1 << INDEX_BITS) - 1

CONTROL_FRAME_BYTES = 64 << 10  # control frames up to this size travel as one message
# The largest control frame a connection accepts (a request for ~110,000 blocks); a peer that
# announces more is cut off before anything is allocated.
MAX_CONTROL_FRAME_BYTES = 1 << 20
AUTH_FRAME_BYTES = 512  # Hello / Challenge / Proof frames are ~100 bytes


class Lane(IntEnum):
    CONTROL = 0
    REPLY = 1
    DATA = 2
    TRAILER = 3


def tag_for(transfer_id: int, lane: Lane | int, index: int = 0) -> int:
    """The integer tag of (transfer, lane, chunk index); see the module docstring."""
    if not 0 <= transfer_id <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer id {transfer_id} out of range [0, {MAX_TRANSFER_ID}]")
    if not 0 <= int(lane) < (1 << LANE_BITS):
        raise ValueError(f"lane {lane} out of range [0, {1 << LANE_BITS})")
    if not 0 <= index <= MAX_CHUNK_INDEX:
        raise ValueError(f"chunk index {index} out of range [0, {MAX_CHUNK_INDEX}]")
    return (transfer_id << (LANE_BITS + INDEX_BITS)) | (int(lane) << INDEX_BITS) | index


CONTROL_TAG = tag_for(0, Lane.CONTROL, 0)

# A stream's trailer: magic, chunks sent, their bytes, and an 8-byte digest of their lengths.
_TRAILER = struct.Struct("<4sIQ8s")
TRAILER_BYTES = _TRAILER.size
CANARY_BYTES = 8  # random bytes at the end of each chunk's host buffer (TailCanary)
_TRAILER_MAGIC = b"KVKt"


class ChunkLengths:
    """The chunk lengths of one stream, in order, as its trailer carries them."""

    __slots__ = ("count", "nbytes", "_digest")

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self._digest = hashlib.blake2b(digest_size=8)

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        self._digest.update(nbytes.to_bytes(8, "little"))

    def pack(self) -> bytes:
        return _TRAILER.pack(_TRAILER_MAGIC, self.count, self.nbytes, self._digest.digest())

    def check(self, trailer: Buffer) -> None:
        """Raise :class:`TransportError` ``protocol_error`` unless ``trailer`` (as the
        sender packed it) names exactly these chunk lengths."""
        magic, count, nbytes, digest = _TRAILER.unpack(bytes(memoryview(trailer).cast("B")))
        if magic != _TRAILER_MAGIC:
            raise TransportError("protocol_error", "the stream's trailer is short or malformed")
        if (count, nbytes, digest) != (self.count, self.nbytes, self._digest.digest()):
            raise TransportError(
                "protocol_error",
                f"chunk lengths differ from the sender's: it sent {count} chunks of "
                f"{nbytes} B in all, received into {self.count} buffers of {self.nbytes} B")


class TailCanary:
    """Random bytes written at the end of each host buffer a stream's chunk is received into,
    checked when the receive completes. UCX completes a receive of a shorter message as if
    whole, and the stream's trailer is the sender's word: a chunk that stopped at least
    :data:`CANARY_BYTES` short leaves the canary in place and fails the stream
    (``protocol_error``), and one that stopped fewer bytes short leaves random bytes, never
    what the buffer held before (a staging slot's or a freed block's earlier contents).
    Device buffers are not armed: their short chunks are caught by the trailer alone."""

    __slots__ = ("_bytes",)

    def __init__(self) -> None:
        self._bytes = np.frombuffer(os.urandom(CANARY_BYTES), np.uint8)

    def arm(self, ubuf: Buffer) -> None:
        tail = _host_tail(ubuf)
        if tail is not None:
            tail[...] = self._bytes[:len(tail)]

    def check(self, ubuf: Buffer, index: int) -> None:
        tail = _host_tail(ubuf)
        if tail is not None and len(tail) == CANARY_BYTES and (tail == self._bytes).all():
            raise TransportError("protocol_error", f"chunk {index} arrived shorter than the "
                                 f"{_nbytes(ubuf)} B announced for it")


def _host_tail(ubuf: Buffer) -> np.ndarray | None:
    """The last :data:`CANARY_BYTES` (at most) of a host receive buffer, as a writable
    view; None for device memory."""
    if isinstance(ubuf, np.ndarray):
        flat = ubuf.reshape(-1).view(np.uint8)
    elif isinstance(ubuf, (bytearray, memoryview)):
        flat = np.frombuffer(ubuf, np.uint8)
    else:
        return None
    return flat[-CANARY_BYTES:] if len(flat) else None


class TransportError(Exception):
    """A transport failure with a machine-readable ``reason`` (see the module docstring)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------- buffers


def as_send_buffer(buf: Buffer) -> Buffer:
    """``buf`` as an object ucxx can send, after checking it is one contiguous run."""
    return _as_ucx_buffer(buf, writable=False)


def as_recv_buffer(buf: Buffer) -> Buffer:
    """``buf`` as an object ucxx can receive into (contiguous and writable)."""
    return _as_ucx_buffer(buf, writable=True)


def _as_ucx_buffer(buf: Buffer, *, writable: bool) -> Buffer:
    mod = type(buf).__module__
    if mod.startswith("torch"):
        if not buf.is_contiguous():
            raise ValueError(f"torch tensor of shape {tuple(buf.shape)} and strides "
                             f"{buf.stride()} is not contiguous; ucxx would send wrong bytes")
        flat = buf.detach().reshape(-1)
        import torch  # noqa: PLC0415 (only reached with a tensor in hand)

        flat = flat.view(torch.uint8)  # any dtype (bf16, fp8) as raw bytes
        return flat if flat.is_cuda else flat.numpy()
    if mod.startswith("numpy"):
        if not buf.flags.c_contiguous:
            raise ValueError(f"numpy array of shape {buf.shape} and strides {buf.strides} is "
                             "not C-contiguous; ucxx would send wrong bytes")
        if writable and not buf.flags.writeable:
            raise ValueError("numpy array is read-only; cannot receive into it")
        return buf
    if hasattr(buf, "__cuda_array_interface__"):
        cai = buf.__cuda_array_interface__
        if cai.get("strides") is not None:
            raise ValueError(f"device buffer with strides {cai['strides']} is not "
                             "C-contiguous (or says so explicitly); pass a dense buffer")
        return buf
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"cannot use {type(buf).__name__} as a transfer buffer") from None
    if not view.c_contiguous:
        raise ValueError(f"memoryview of shape {view.shape} and strides {view.strides} is "
                         "not C-contiguous; ucxx would send wrong bytes")
    if writable and view.readonly:
        raise ValueError(f"{type(buf).__name__} is read-only; cannot receive into it")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _nbytes(ucx_buf: Buffer) -> int:
    if isinstance(ucx_buf, memoryview):
        return ucx_buf.nbytes
    if hasattr(ucx_buf, "nbytes"):
        return int(ucx_buf.nbytes)
    return int(ucx_buf.numel() * ucx_buf.element_size())


# ------------------------------------------------------------------------------- connection


class Connection:
    """One UCX endpoint with kvkern's framing, timeouts and error mapping.

    Created by :class:`Listener` (accepted, ``peer`` is None) or :class:`ConnectionPool`.
    After any failure the connection is aborted (``alive`` False) and stays dead.
    """

    def __init__(self, ep: UcxEndpoint, *, peer: tuple[str, int] | None, codec: Codec,
                 max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES) -> None:
        self._ep: UcxEndpoint | None = ep
        self.peer = peer
        self.codec = codec
        self.max_frame_bytes = max_frame_bytes
        self.peer_id: str | None = None  # the authenticated peer (None: not authenticated)
        self.auth_s = 0.0  # seconds the client's authentication exchange took
        self.failure: str | None = None  # reason of the failure that killed it
        self._peer_closed = False  # set from the UCX progress thread: a plain flag only
        self._send_lock = asyncio.Lock()
        # UCX's close callback refers to this connection weakly: a cycle through the
        # callback's dict, which C++ holds a bare pointer to, would leave the dict to the
        # garbage collector, which may free it before the endpoint drops the pointer.
        method = weakref.WeakMethod(self._on_peer_close)

        def on_close(*_: object) -> None:
            if (heard := method()) is not None:
                heard()

        closing = getattr(ep, "kvkern_closing", None)  # (see ucxcompat.CloseWatch)
        if closing is not None:
            closing.add(on_close)
        else:  # an endpoint made by stock ucxx, with no callback yet
            ep.set_close_callback(on_close)

    def _on_peer_close(self, *_: object) -> None:
        self._peer_closed = True

    @property
    def alive(self) -> bool:
        return self._ep is not None and not self._peer_closed and not self._ep.closed

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"dead({self.failure or 'closed'})"
        return f"Connection(peer={self.peer}, {state})"

    def abort(self, reason: str = "closed") -> None:
        """Close the endpoint now, cancelling every outstanding request. Idempotent."""
        ep, self._ep = self._ep, None
        if self.failure is None:
            self.failure = reason
        if ep is not None:
            try:
                ep.abort()
            except Exception as exc:  # noqa: BLE001 (closing a broken endpoint may complain)
                log.debug("abort of %r raised %r", self, exc)

    close = abort

    def _require(self) -> UcxEndpoint:
        if self._ep is None:
            raise TransportError("closed", f"connection already closed ({self.failure})")
        if self._peer_closed:
            self.abort("peer_closed")
            raise TransportError("peer_closed", "peer closed the connection")
        return self._ep

    def _fail(self, exc: BaseException, what: str) -> TransportError:
        """Abort and map ``exc`` to a TransportError (the caller raises it)."""
        if isinstance(exc, TransportError):
            self.abort(exc.reason)
            return exc
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            reason, detail = "transfer_timeout", f"{what} timed out"
        elif isinstance(exc, ProtocolError):
            reason, detail = "protocol_error", f"{what}: {exc}"
        else:
            ucxx = import_ucxx()
            ex = ucxx.exceptions
            closed_types = (ex.UCXConnectionResetError, ex.UCXCloseError,
                            ex.UCXNotConnectedError, ex.UCXEndpointTimeoutError,
                            ex.UCXUnreachableError)
            if self._peer_closed or isinstance(exc, closed_types):
                reason = "peer_closed"
            else:
                reason = "transfer_failed"
            detail = f"{what}: {type(exc).__name__}: {exc}"
        self.abort(reason)
        err = TransportError(reason, detail)
        err.__cause__ = exc
        return err

    # ---- single messages

    async def _post_send(self, buf: Buffer, tag: int) -> None:
        await self._require().send(buf, tag=tag)

    async def _post_recv(self, buf: Buffer, tag: int) -> None:
        await self._require().recv(buf, tag=tag)

    async def send_bytes(self, buf: Buffer, tag: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Send one contiguous buffer on ``tag``; on timeout the connection is aborted."""
        ubuf = as_send_buffer(buf)
        try:
            await asyncio.wait_for(self._post_send(ubuf, tag), timeout)
        except asyncio.CancelledError:
            self.abort("cancelled")
            raise
        except Exception as exc:
            raise self._fail(exc, f"send of {_nbytes(ubuf)} B on tag {tag:#x}") from exc

    async def recv_bytes(self, buf: Buffer, tag: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Receive one message on ``tag`` into ``buf`` (exactly its size is expected)."""
        ubuf = as_recv_buffer(buf)
        try:
            await asyncio.wait_for(self._post_recv(ubuf, tag), timeout)
        except asyncio.CancelledError:
            self.abort("cancelled")
            raise
        except Exception as exc:
            raise self._fail(exc, f"receive of {_nbytes(ubuf)} B on tag {tag:#x}") from exc

    # ---- control frames

    async def send_msg(self, msg: Message, tag: int = CONTROL_TAG, *,
                       timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Send one control message on ``tag``: one UCX message when the frame fits in
        :data:`CONTROL_FRAME_BYTES`, else the preamble and then the body (see the module
        docstring)."""
        frame = self.codec.encode(msg)
        view = memoryview(frame)
        parts = ([view] if len(frame) <= CONTROL_FRAME_BYTES
                 else [view[:PREAMBLE_BYTES], view[PREAMBLE_BYTES:]])
        try:
            async with asyncio.timeout(timeout), self._send_lock:
                for part in parts:  # one sender at a time keeps a split frame's parts adjacent
                    await self._post_send(part, tag)
        except asyncio.CancelledError:
            self.abort("cancelled")
            raise
        except Exception as exc:
            raise self._fail(exc, f"send of {type(msg).__name__}") from exc

    async def recv_msg(self, tag: int = CONTROL_TAG, *,
                       timeout: float | None = DEFAULT_TIMEOUT_S,
                       max_bytes: int | None = None) -> Message:
        """Receive one control message on ``tag``. ``timeout=None`` waits until the peer
        sends or goes away (a source's request loop); the body of a split frame must then
        follow its preamble within :data:`BODY_TIMEOUT_S`. A frame longer than ``max_bytes``
        (default :attr:`max_frame_bytes`) is refused before anything is allocated for it.
        Bad frames abort the connection and raise ``TransportError('protocol_error')`` with
        the ProtocolError as ``__cause__``."""
        limit = self.max_frame_bytes if max_bytes is None else max_bytes
        try:
            async with asyncio.timeout(timeout):
                # a longer single message is a UCX truncation error
                first = bytearray(min(CONTROL_FRAME_BYTES, limit))
                await self._post_recv(first, tag)
                total = self.codec.frame_length(first)  # fingerprint etc. before the body
                if total > limit:
                    raise ProtocolError("too_large", f"frame of {total} bytes exceeds this "
                                        f"connection's {limit}-byte limit")
                if total <= len(first):
                    return self.codec.decode(memoryview(first)[:total])
                frame = bytearray(total)  # announced in a preamble of its own: body follows
                frame[:PREAMBLE_BYTES] = first[:PREAMBLE_BYTES]
                async with asyncio.timeout(BODY_TIMEOUT_S if timeout is None else None):
                    await self._post_recv(memoryview(frame)[PREAMBLE_BYTES:], tag)
                return self.codec.decode(frame)
        except asyncio.CancelledError:
            self.abort("cancelled")
            raise
        except Exception as exc:
            raise self._fail(exc, f"receive of a control message on tag {tag:#x}") from exc

    # ---- chunk streams

    @contextlib.contextmanager
    def _aborting_streams(self, inflight: collections.deque, what: str):
        """Any failure of a stream aborts the connection (cancelling every posted operation
        in ``inflight``) before it propagates; transport failures become TransportError."""
        try:
            yield
        except ValueError:
            self._abort_streams(inflight, "bad_buffer")
            raise
        except asyncio.CancelledError:
            self._abort_streams(inflight, "cancelled")
            raise
        except Exception as exc:
            err = self._fail(exc, what)
            self._abort_streams(inflight, err.reason)
            raise err from exc

    async def send_stream(
        self,
        transfer_id: int,
        produce_chunk: Callable[[int], Buffer | Awaitable[Buffer]],
        n_chunks: int,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        first_index: int = 0,
        trailer: bool = True,
    ) -> int:
        """Send chunks ``0..n_chunks-1`` of ``transfer_id``, producing each on demand, then
        the stream's trailer (see the module docstring).

        ``produce_chunk(i)`` returns the buffer of chunk ``i`` (or an awaitable of it); it is
        called while earlier chunks are still in flight, so packing chunk k+1 overlaps sending
        chunk k. When ``produce_chunk(i)`` runs, every chunk ``<= i - max_in_flight`` has been
        sent completely, so a ring of ``max_in_flight`` staging buffers is safe to reuse.
        ``timeout`` bounds the time without progress (no chunk completing). Returns the
        bytes sent. On any failure the connection is aborted before raising. ``trailer=False``
        sends none (a bare stream, whose receiver must not expect one).
        """
        _check_stream_args(transfer_id, n_chunks, max_in_flight, first_index)
        inflight: collections.deque[tuple[int, asyncio.Task]] = collections.deque()
        lengths = ChunkLengths()
        with self._aborting_streams(inflight, f"send of transfer {transfer_id}"):
            for i in range(n_chunks):
                while len(inflight) >= max_in_flight:
                    await self._retire_oldest(inflight, timeout, "send")
                buf = produce_chunk(i)
                if inspect.isawaitable(buf):
                    buf = await buf
                ubuf = as_send_buffer(buf)
                lengths.add(_nbytes(ubuf))
                tag = tag_for(transfer_id, Lane.DATA, first_index + i)
                inflight.append((i, asyncio.ensure_future(self._post_send(ubuf, tag))))
            if n_chunks and trailer:
                # (after every chunk's send completed: see "Stream trailers")
                while inflight:
                    await self._retire_oldest(inflight, timeout, "send")
                tag = tag_for(transfer_id, Lane.TRAILER, first_index)
                inflight.append((n_chunks, asyncio.ensure_future(
                    self._post_send(as_send_buffer(lengths.pack()), tag))))
            while inflight:
                await self._retire_oldest(inflight, timeout, "send")
            return lengths.nbytes

    async def send_chunks(self, transfer_id: int, buffers: Sequence[Buffer], *,
                          timeout: float = DEFAULT_TIMEOUT_S,
                          max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> int:
        """Send ``buffers`` as chunks ``0..len-1`` of ``transfer_id``; see send_stream."""
        for b in buffers:  # reject every bad buffer before the first byte moves
            as_send_buffer(b)
        return await self.send_stream(transfer_id, buffers.__getitem__, len(buffers),
                                      timeout=timeout, max_in_flight=max_in_flight)

    async def recv_stream(
        self,
        transfer_id: int,
        buffer_for: Callable[[int], BufferT],
        n_chunks: int,
        *,
        on_chunk: Callable[[int, BufferT], Awaitable[None] | None] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = 2 * DEFAULT_MAX_IN_FLIGHT,
        first_index: int = 0,
        trailer: bool = True,
    ) -> int:
        """Receive chunks ``0..n_chunks-1`` of ``transfer_id`` and check them against the
        stream's trailer (see the module docstring).

        ``buffer_for(i)`` gives the buffer chunk ``i`` lands in, sized exactly as the sender's
        chunk. ``on_chunk(i, buf)`` (sync or async) runs in index order as chunks complete, so
        unpacking chunk k overlaps receiving chunk k+1; ``buffer_for(i)`` is called only after
        ``on_chunk`` returned for every chunk ``<= i - max_in_flight`` (ring reuse is safe).
        ``timeout`` bounds the time without progress. Returns the bytes received. On any
        failure the connection is aborted (cancelling every posted receive) before raising;
        chunks whose lengths differ from the sender's raise ``protocol_error`` after every
        ``on_chunk`` ran, so a caller keeps nothing of the stream until this returns.
        ``trailer=False`` expects none (a bare stream).
        """
        _check_stream_args(transfer_id, n_chunks, max_in_flight, first_index)
        inflight: collections.deque[tuple[int, asyncio.Task]] = collections.deque()
        bufs: dict[int, tuple[BufferT, Buffer]] = {}
        lengths = ChunkLengths()
        sent = bytearray(TRAILER_BYTES)  # the sender's trailer lands here
        checked = trailer and n_chunks > 0
        canary = TailCanary()

        async def landed(j: int) -> None:
            buf, ubuf = bufs.pop(j)
            canary.check(ubuf, j)
            await _call_maybe_async(on_chunk, j, buf)

        with self._aborting_streams(inflight, f"receive of transfer {transfer_id}"):
            for i in range(n_chunks):
                while len(inflight) >= max_in_flight:
                    await landed(await self._retire_oldest(inflight, timeout, "receive"))
                buf = buffer_for(i)
                ubuf = as_recv_buffer(buf)
                bufs[i] = (buf, ubuf)
                lengths.add(_nbytes(ubuf))
                canary.arm(ubuf)
                tag = tag_for(transfer_id, Lane.DATA, first_index + i)
                inflight.append((i, asyncio.ensure_future(self._post_recv(ubuf, tag))))
            if checked:
                tag = tag_for(transfer_id, Lane.TRAILER, first_index)
                inflight.append((n_chunks, asyncio.ensure_future(
                    self._post_recv(as_recv_buffer(sent), tag))))
            while inflight:
                j = await self._retire_oldest(inflight, timeout, "receive")
                if j < n_chunks:
                    await landed(j)
            if checked:
                lengths.check(sent)
            return lengths.nbytes

    async def recv_chunks(self, transfer_id: int, buffers: Sequence[Buffer], *,
                          timeout: float = DEFAULT_TIMEOUT_S,
                          max_in_flight: int = 2 * DEFAULT_MAX_IN_FLIGHT) -> int:
        """Receive chunks ``0..len-1`` of ``transfer_id`` into ``buffers``; see recv_stream."""
        for b in buffers:
            as_recv_buffer(b)
        return await self.recv_stream(transfer_id, buffers.__getitem__, len(buffers),
                                      timeout=timeout, max_in_flight=max_in_flight)

    async def _retire_oldest(self, inflight: collections.deque, timeout: float,
                             what: str) -> int:
        """Wait until the oldest in-flight op is done; fail fast if any op fails; raise
        TimeoutError when no op completes for ``timeout`` seconds. Returns its index."""
        oldest_i, oldest = inflight[0]
        while not oldest.done():
            # only ops still running: a later one already done would end every wait at once
            done, _ = await asyncio.wait([t for _, t in inflight if not t.done()],
                                         timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise asyncio.TimeoutError(f"no chunk {what} completed in {timeout} s")
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        inflight.popleft()
        oldest.result()
        return oldest_i

    def _abort_streams(self, inflight: collections.deque, reason: str) -> None:
        # Abort first: only an endpoint abort makes UCX let go of posted buffers (ucxx's
        # close blocks until every request in flight on the endpoint, a receive matched and
        # mid-rendezvous included, has completed its cancellation, for up to 10 s).
        self.abort(reason)
        for _, t in inflight:
            t.cancel()
        for _, t in inflight:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: no "exception never retrieved" noise


def _check_stream_args(transfer_id: int, n_chunks: int, max_in_flight: int,
                       first_index: int) -> None:
    if not 1 <= transfer_id <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer id {transfer_id} out of range [1, {MAX_TRANSFER_ID}]")
    if n_chunks < 0 or first_index < 0 or first_index + n_chunks > MAX_CHUNK_INDEX + 1:
        raise ValueError(f"chunks [{first_index}, {first_index + n_chunks}) out of range "
                         f"[0, {MAX_CHUNK_INDEX + 1})")
    check_positive_int("max_in_flight", max_in_flight)


async def _call_maybe_async(fn: Callable[..., Awaitable[None] | None] | None,
                            *args: object) -> None:
    if fn is None:
        return
    out = fn(*args)
    if inspect.isawaitable(out):
        await out


class ReadsStuck(TransportError):
    """One-sided reads outlived the abort of their endpoint: the local memory they target
    must not be reused (the caller quarantines it). ``outstanding``: those reads
    (:class:`kvkern.xfer.quarantine.Outstanding`), to free the memory once they have ended;
    None: not tracked, held for good."""

    def __init__(self, detail: str, outstanding: Outstanding | None = None) -> None:
        super().__init__("transfer_failed", detail)
        self.outstanding = outstanding


def _check_config() -> None:
    problem = ucx_tls_problem()
    if problem is not None:
        raise TransportError("connect_failed", problem)
    bind_ucxx_loop()


_NOTIFIER_LOOP: asyncio.AbstractEventLoop | None = None


def bind_ucxx_loop() -> None:
    """Make ucxx complete requests on the running event loop.

    With ``UCXPY_ENABLE_PYTHON_FUTURE=1`` (kvkern's default, see :mod:`kvkern.xfer.ucx_env`)
    ucxx's notifier thread resolves request futures on the loop it was started for, which is
    whatever loop was current when ucxx's context was created. A process runs kvkern's UCX
    work on one loop (:class:`kvkern.xfer.runtime.EventLoopThread`); when that loop changes
    (a new runtime, a test module), the notifier is restarted for it. Requests still
    pending on the old loop are not served any more. Called by :class:`Listener` and
    :class:`ConnectionPool` before they touch UCX.
    """
    global _NOTIFIER_LOOP
    loop = asyncio.get_running_loop()
    if _NOTIFIER_LOOP is loop:
        return
    # ucxx's context is created here (and bound to this loop) on first use
    if ucxcompat.rebind_notifier(loop) and _NOTIFIER_LOOP is None:
        _register_exit_hook()
    _NOTIFIER_LOOP = loop


def _register_exit_hook() -> None:
    """Stop the notifier at exit (:func:`kvkern.xfer.ucxcompat.stop_notifier_at_exit`: seen
    without it, pytest hanging after its summary)."""
    ucxcompat.stop_notifier_at_exit()


def stop_ucxx_notifier() -> None:
    """Stop ucxx's notifier thread for good (process exit): requests awaiting it afterwards
    are never completed. Wakes it first, so exit does not wait out its 1 s poll."""
    global _NOTIFIER_LOOP
    if ucxcompat.stop_notifier():
        _NOTIFIER_LOOP = None


# --------------------------------------------------------------------------------- listener


Handler = Callable[[Connection], Awaitable[None]]


# --------------------------------------------------------------------- authentication

AUTH_REPLY_TAG = tag_for(0, Lane.REPLY, 0)


@contextlib.contextmanager
def _auth_failure(conn: Connection):
    """Any failure of the exchange aborts ``conn`` and is ``TransportError('auth_failed')``."""
    try:
        yield
    except TransportError as exc:
        conn.abort("auth_failed")
        if exc.reason == "auth_failed":
            raise
        raise TransportError("auth_failed", f"authentication exchange: {exc}") from exc


async def authenticate_server(conn: Connection, credential: Credential, *,
                              timeout: float = DEFAULT_AUTH_TIMEOUT_S) -> str:
    """The server's half of :mod:`kvkern.xfer.auth`'s ``ctl`` exchange. Reads at most two
    small frames within ``timeout``; returns the client's peer id (also set as
    ``conn.peer_id``) or raises ``TransportError('auth_failed')`` after aborting ``conn``."""
    from kvkern.xfer.messages import Challenge, Hello, Proof  # noqa: PLC0415

    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(deadline - time.monotonic(), 0.001)

    with _auth_failure(conn):
        hello = await conn.recv_msg(CONTROL_TAG, timeout=left(), max_bytes=AUTH_FRAME_BYTES)
        if not isinstance(hello, Hello):
            raise TransportError("auth_failed", f"first frame is {type(hello).__name__}, "
                                 "not Hello")
        nonce_s = secrets.token_bytes(NONCE_BYTES)
        proof = credential.server_proof(hello.nonce, nonce_s, hello.peer_id,
                                        credential.peer_id)
        await conn.send_msg(Challenge(nonce=nonce_s, peer_id=credential.peer_id, proof=proof),
                            AUTH_REPLY_TAG, timeout=left())
        answer = await conn.recv_msg(CONTROL_TAG, timeout=left(), max_bytes=AUTH_FRAME_BYTES)
        if not isinstance(answer, Proof) or not credential.verify(
                "ctl-client", answer.proof, hello.nonce, nonce_s, hello.peer_id,
                credential.peer_id):
            raise TransportError("auth_failed", f"peer {hello.peer_id!r} did not prove the "
                                 "fleet secret")
    conn.peer_id = hello.peer_id
    return hello.peer_id


async def authenticate_client(conn: Connection, credential: Credential, *,
                              timeout: float = DEFAULT_AUTH_TIMEOUT_S) -> str:
    """The client's half: one round trip (Hello -> Challenge); the Proof is sent without
    waiting for an answer, so the first request follows it at once. Returns the server's
    peer id or raises ``TransportError('auth_failed')`` (a server without the fleet secret
    fails its proof here) after aborting ``conn``."""
    from kvkern.xfer.messages import Challenge, Hello, Proof  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    with _auth_failure(conn):
        await conn.send_msg(Hello(nonce=nonce_c, peer_id=credential.peer_id), CONTROL_TAG,
                            timeout=timeout)
        ch = await conn.recv_msg(AUTH_REPLY_TAG, timeout=max(deadline - time.monotonic(), 0.001),
                                 max_bytes=AUTH_FRAME_BYTES)
        if not isinstance(ch, Challenge) or not credential.verify(
                "ctl-server", ch.proof, nonce_c, ch.nonce, credential.peer_id, ch.peer_id):
            raise TransportError("auth_failed", "the source did not prove the fleet secret")
        await conn.send_msg(Proof(proof=credential.client_proof(
            nonce_c, ch.nonce, credential.peer_id, ch.peer_id)), CONTROL_TAG,
            timeout=max(deadline - time.monotonic(), 0.001))
    conn.peer_id = ch.peer_id
    return ch.peer_id


class Listener:
    """Accepts connections and runs ``handler(conn)`` for each; the connection is closed when
    the handler returns. ``close()`` stops listening, aborts every accepted connection and
    cancels running handlers.

    ucxx's listener binds every interface (its API takes no address); ``host`` is the address
    this listener advertises in ``address``. With a ``credential`` (by default the
    environment's, :meth:`Credential.from_env`) every connection must pass
    :func:`authenticate_server` before the handler sees it (failures are counted in
    ``auth_failures``); with ``credential=None`` the handler gets every connection. At most
    ``max_untrusted`` connections are held between arrival and authentication; more are
    closed as they arrive. With ``accept_from``, a connection request from an address
    outside those networks is rejected before UCX makes an endpoint for it (nothing its
    sender writes is received or queued), and with ``proven`` one from a host that has not
    presented the fleet credential over HTTP lately
    (:class:`~kvkern.xfer.networks.ProvenHosts`). ``on_refused(reason)`` hears of every
    connection turned away:
    ``address_not_accepted``, ``address_not_proven``, ``untrusted_limit``, ``handshake`` (its
    first exchange failed or timed out) or ``unauthenticated``.
    """

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 0,
                 codec: Codec = DEFAULT_CODEC, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 credential: Credential | str | None = FROM_ENV,
                 max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES,
                 max_untrusted: int = MAX_UNTRUSTED_CONNECTIONS,
                 on_refused: Callable[[str], None] | None = None,
                 accept_from: Networks | None = None,
                 proven: ProvenHosts | None = None) -> None:
        self._handler = handler
        # connections between their arrival and their authentication (the handshake and
        # the proof, each bounded in time): more are closed as they arrive
        self._gate = handshake.Gate(max_untrusted, on_refuse=on_refused,
                                    accept_from=accept_from, proven=proven)
        self.credential = resolve_credential(credential)
        self.max_frame_bytes = max_frame_bytes
        self.auth_failures = 0
        self.host = host
        self._port = port
        self.codec = codec
        self.connect_timeout = connect_timeout
        self._listener: UcxListener | None = None
        self._conns: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self.accepted = 0  # connections accepted so far

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("listener not started")
        return int(self._listener.port)

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def untrusted_connections(self) -> int:
        """Connections arrived and not yet authenticated (or dropped)."""
        return self._gate.inside

    @property
    def refused_untrusted(self) -> int:
        """Connections closed as they arrived because ``max_untrusted`` were pending."""
        return self._gate.refused

    @property
    def rejected_connections(self) -> int:
        """Connection requests rejected for their address (not in ``accept_from``, or its
        host not proven)."""
        return self._gate.rejected

    @property
    def running_handlers(self) -> int:
        return len(self._tasks)

    async def start(self) -> Listener:
        if self._listener is not None:
            raise RuntimeError("listener already started")
        _check_config()
        self._listener = handshake.create_listener(self._on_accept, port=self._port,
                                                   timeout=self.connect_timeout,
                                                   gate=self._gate)
        return self

    async def _on_accept(self, ep: UcxEndpoint) -> None:
        """A connection past the handshake: authenticate it (it then leaves the gate of
        untrusted connections), then serve it until it ends."""
        untrusted = [True]
        address = getattr(ep, "kvkern_address", "")

        def trusted() -> None:
            if untrusted[0]:
                untrusted[0] = False
                self._gate.leave(address)

        def refused(reason: str) -> None:
            if untrusted[0]:
                untrusted[0] = False
                self._gate.drop(reason, address)

        try:
            await self._serve_accepted(ep, trusted, refused)
        finally:
            trusted()

    async def _serve_accepted(self, ep: UcxEndpoint, trusted: Callable[[], None],
                              refused: Callable[[str], None]) -> None:
        if self._closing:
            ep.abort()
            return
        try:
            conn = Connection(ep, peer=None, codec=self.codec,
                              max_frame_bytes=self.max_frame_bytes)
        except RuntimeError as exc:  # the peer went between the handshake and here
            log.debug("accepted connection already closed: %s", exc)
            with contextlib.suppress(Exception):
                ep.abort()
            return
        task = asyncio.current_task()
        self._conns.add(conn)
        if task is not None:
            self._tasks.add(task)
        self.accepted += 1
        try:
            if self.credential is not None:
                try:
                    await authenticate_server(conn, self.credential)
                except TransportError as exc:
                    self.auth_failures += 1
                    log.warning("refused an unauthenticated peer on port %s: %s",
                                self._port or "?", exc.detail or exc.reason)
                    refused("unauthenticated")
                    return
            trusted()
            await self._handler(conn)
        except asyncio.CancelledError:
            pass
        except TransportError as exc:
            log.debug("handler for %r ended with %s", conn, exc.reason)
        except Exception:
            log.exception("listener handler failed")
        finally:
            conn.abort("closed")
            self._conns.discard(conn)
            if task is not None:
                self._tasks.discard(task)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening, abort every accepted connection, cancel and await handlers."""
        self._closing = True
        listener, self._listener = self._listener, None
        if listener is not None:
            ucxcompat.close_listener(listener)
        for conn in list(self._conns):
            conn.abort("closed")
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self._conns.clear()

    async def __aenter__(self) -> Listener:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------------------- pool


class ConnectionPool:
    """One connection per source ``(host, port)``: created on first use, reused while alive,
    replaced after a failure, all closed by ``close()``. Concurrent ``get``s of one source
    share a single connect. With a ``credential`` (by default the environment's) each new
    connection runs :func:`authenticate_client` before it is handed out."""

    def __init__(self, *, codec: Codec = DEFAULT_CODEC,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 credential: Credential | str | None = FROM_ENV,
                 max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES) -> None:
        self.codec = codec
        self.connect_timeout = connect_timeout
        self.credential = resolve_credential(credential)
        self.max_frame_bytes = max_frame_bytes
        self._conns: dict[tuple[str, int], Connection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._closed = False
        self.connects = 0  # endpoints created so far (reconnects included)

    def __len__(self) -> int:
        return sum(1 for c in self._conns.values() if c.alive)

    async def get(self, host: str, port: int) -> Connection:
        if self._closed:
            raise TransportError("closed", "connection pool is closed")
        key = (host, int(port))
        conn = self._conns.get(key)
        if conn is not None and conn.alive:
            return conn
        self._sweep(key)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._conns.get(key)
            if conn is not None and conn.alive:
                return conn
            if conn is not None:
                conn.abort(conn.failure or "closed")
            conn = await self._connect(key)
            if self._closed:  # (closed while this connected: the pool keeps nothing now)
                conn.abort("closed")
                raise TransportError("closed", "connection pool closed while connecting")
            self._conns[key] = conn
            return conn

    def _sweep(self, but: tuple[str, int]) -> None:
        """Abort and forget the dead connections of other sources (a source that went away,
        or restarted on another port, is never asked for again), with their locks."""
        for key, conn in list(self._conns.items()):
            lock = self._locks.get(key)
            if key != but and not conn.alive and not (lock is not None and lock.locked()):
                conn.abort(conn.failure or "closed")
                del self._conns[key]
                self._locks.pop(key, None)

    async def _connect(self, key: tuple[str, int]) -> Connection:
        _check_config()
        host, port = key
        started = time.monotonic()
        try:  # (a connect ended early closes its endpoint before its buffers go)
            ep = await handshake.connect(host, port, self.connect_timeout)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise TransportError("connect_timeout", f"{host}:{port} did not accept within "
                                 f"{self.connect_timeout} s") from exc
        except Exception as exc:
            raise TransportError("connect_failed", f"{host}:{port}: {type(exc).__name__}: "
                                 f"{exc} after {time.monotonic() - started:.2f} s") from exc
        self.connects += 1
        conn = Connection(ep, peer=key, codec=self.codec, max_frame_bytes=self.max_frame_bytes)
        if self.credential is not None:
            t0 = time.perf_counter()
            await authenticate_client(conn, self.credential, timeout=self.connect_timeout)
            conn.auth_s = time.perf_counter() - t0
        return conn

    def discard(self, conn: Connection) -> None:
        """Abort ``conn`` and forget it; the next ``get`` reconnects."""
        conn.abort(conn.failure or "closed")
        if conn.peer is not None and self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._conns.values()):
            conn.abort("closed")
        self._conns.clear()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def reset_ucx() -> None:
    """Best effort: let ucxx tear its context down (tests, clean process exit)."""
    ucxx = import_ucxx()
    with contextlib.suppress(Exception):
        ucxx.stop_notifier_thread()
