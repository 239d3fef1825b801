"""Versioned control messages of the pull path, msgpack on the wire.

Every frame is a fixed binary preamble followed by a msgpack body::

    offset  size  field
    0       4     magic  b"KVKX"
    4       2     protocol version (u16, little endian)   == PROTOCOL_VERSION
    6       2     flags (u16), must be 0
    8       8     compatibility fingerprint (u64)         == codec.fingerprint
    16      4     body length in bytes (u32)              <= codec.max_body_bytes
    20      n     msgpack body: a map with a "kind" tag (Hello | Challenge | Proof |
                                                      PullRequest | StreamReply |
                                                      ReadGrant | Refusal | Cancel |
                                                      ReadDone | ReadAck)

A connection starts with the authentication exchange of :mod:`kvkern.xfer.auth` (Hello,
Challenge, Proof); a source reads nothing else before it.

The preamble is checked completely (magic, version, flags, fingerprint, length) before a
single byte of the body is decoded, so an incompatible or hostile peer is rejected cheaply.
The fingerprint hashes the message schema (so any field change changes it) plus optional
deployment compatibility bytes the caller mixes in (e.g. layout and hash-scheme ids).

Decoding is strict: unknown fields, unknown kinds, out-of-range integers and oversized lists
are :class:`ProtocolError` with a ``reason``; nothing else escapes :meth:`Codec.decode`.

Hashes are root-aligned: ``block_hashes[i]`` is the hash of block ``i`` of the prompt counted
from the root, and a request asks for ``block_hashes[start:start + count]``::

    block_hashes  [h0 h1 h2 h3 h4 h5 h6 h7]
                   └─ dst has ─┘└ pulled ┘      start=4, count=4

This module never imports ucxx.
"""

from __future__ import annotations

import hashlib
import struct
from enum import Enum
from typing import Annotated, Union

import msgspec

PROTOCOL_VERSION = 7  # 2: one-message frames, reads (ReadDone/ReadAck); 3: ReadDone.ack,
# segmented read replies (per-layer pools); 4: peer authentication (Hello/Challenge/Proof),
# PullRequest.model; 5: the reply as a tagged union (StreamReply | ReadGrant | Refusal);
# 6: PullRequest.chunk_blocks; 7: a trailer after each stream (kvkern.xfer.transport)
MAGIC = b"KVKX"
_PREAMBLE = struct.Struct("<4sHHQI")
PREAMBLE_BYTES = _PREAMBLE.size  # 20

# Caps on what a decoder accepts. 1 Mi hashes is ~16 M tokens at block size 16.
MAX_BODY_BYTES = 16 << 20
MAX_BLOCKS = 1 << 20
MAX_PIECES = 4096
MAX_CHUNKS = 1 << 20
MAX_TEXT = 256
READ_CAPABILITY = "read/1"  # a source whose state lists it answers PullRequest.read
MAX_RKEY_BYTES = 1 << 16  # a packed UCX remote key (a few hundred bytes in practice)
MAX_READ_SEGMENTS = 4096  # segments per block of a read reply (one per layer at most)

# msgpack integers stop at 2**64 - 1, so ge=0 is the whole u64 check (msgspec rejects an
# upper bound beyond int64 in Meta).
U64 = Annotated[int, msgspec.Meta(ge=0)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
# Transfer ids live in the transport's tag (see kvkern.xfer.transport.tag_for): 30 bits, 0 is
# the control channel.
TransferId = Annotated[int, msgspec.Meta(ge=1, le=(1 << 30) - 1)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]


class ProtocolError(Exception):
    """A frame that cannot be accepted. ``reason`` is one of: ``truncated``, ``bad_magic``,
    ``unsupported_version``, ``bad_flags``, ``fingerprint_mismatch``, ``too_large``,
    ``length_mismatch``, ``unknown_kind``, ``invalid``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Status(str, Enum):
    """Outcome of a pull as the source reports it."""

    OK = "ok"  # every requested block served
    PARTIAL = "partial"  # a prefix of the requested blocks served (served_blocks < count)
    MISS = "miss"  # none of the requested blocks held any more
    REJECTED = "rejected"  # request invalid for this source (scheme, plan, rank)
    BUSY = "busy"  # source at its in-flight limit; retry elsewhere or recompute
    ERROR = "error"  # source-side failure; reason says which


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
            tag_field="kind"):
    pass


class PlanPiece(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One piece of the staging stream a destination rank receives: source rank ``src_rank``
    packs layers ``[layer_start, layer_stop)`` × heads ``[head_start, head_stop)`` (source-local
    ranges) of every served block. ``offset`` and ``length`` are PER BLOCK: for ``n`` served
    blocks the piece occupies bytes ``[offset * n, (offset + length) * n)`` of the stream
    (the layout of ``kvkern.kernels.sharded.pack_for_peer``)."""

    src_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    layer_start: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    layer_stop: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    head_start: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    head_stop: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    offset: NonNeg
    length: NonNeg

    def __post_init__(self) -> None:
        if self.layer_stop <= self.layer_start:
            raise ValueError(f"empty layer range [{self.layer_start}, {self.layer_stop})")
        if self.head_stop <= self.head_start:
            raise ValueError(f"empty head range [{self.head_start}, {self.head_stop})")

    @property
    def layers(self) -> tuple[int, int]:
        return (self.layer_start, self.layer_stop)

    @property
    def heads(self) -> tuple[int, int]:
        return (self.head_start, self.head_stop)


class PullRequest(_Base, tag="pull_request"):
    """Destination → source: send blocks ``block_hashes[start:start + count]``.

    ``deadline_ms`` is relative (milliseconds the source may spend, counted from receipt), so
    clock skew between hosts does not matter. ``chunk_bytes`` is the largest chunk the source
    may send (a chunk the source packs keeps to its own chunk size too; a planned run that
    lands in place may be larger than one the destination stages); the reply's
    ``chunk_sizes`` give the actual sizes. ``require_all`` (a strict
    destination): a source that cannot serve all ``count`` blocks answers ``MISS`` without
    pinning or sending anything, instead of a PARTIAL the destination would have to cancel
    (which aborts the connection and every other transfer on it). ``read``: the destination
    can read the served blocks one-sided from the source's pool (a :class:`ReadGrant`)
    instead of receiving a stream; the source decides, and streams when it cannot.
    ``chunk_blocks`` (a stream of one piece only; empty: the source's own plan) is the
    destination's chunk plan in blocks, summing to ``count``: the source cuts the stream at
    these boundaries, and each chunk further to its chunk limit, so that the destination's
    runs of consecutive receive blocks each take whole chunks and land in place
    (:func:`kvkern.layout.chunks.stream_plan`).
    """

    transfer_id: TransferId
    request_id: Text
    hash_scheme: Text
    block_hashes: Annotated[list[U64], msgspec.Meta(max_length=MAX_BLOCKS)]
    start: NonNeg
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]
    pieces: Annotated[list[PlanPiece], msgspec.Meta(min_length=1, max_length=MAX_PIECES)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]
    deadline_ms: Annotated[int, msgspec.Meta(ge=0, le=24 * 3600 * 1000)]
    require_all: bool = False
    read: bool = False
    model: Text = ""  # the destination's model fingerprint; the source refuses another
    chunk_blocks: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]],
                            msgspec.Meta(max_length=MAX_BLOCKS)] = []

    def __post_init__(self) -> None:
        if self.start + self.count > len(self.block_hashes):
            raise ValueError(f"start {self.start} + count {self.count} exceeds "
                             f"{len(self.block_hashes)} block hashes")
        if self.chunk_blocks:
            if len(self.pieces) != 1:
                raise ValueError(f"a chunk plan in blocks is for a stream of one piece, not "
                                 f"{len(self.pieces)}")
            if sum(self.chunk_blocks) != self.count:
                raise ValueError(f"chunk plan of {sum(self.chunk_blocks)} blocks for "
                                 f"{self.count} requested")
        end = 0
        for p in sorted(self.pieces, key=lambda p: p.offset):
            if p.offset < end:
                raise ValueError(f"plan piece at offset {p.offset} overlaps the previous "
                                 f"piece ending at {end}")
            end = p.offset + p.length

    @property
    def requested_hashes(self) -> list[int]:
        return self.block_hashes[self.start:self.start + self.count]


Served = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)]
Hashes = Annotated[list[U64], msgspec.Meta(max_length=MAX_BLOCKS)]
RKey = Annotated[bytes, msgspec.Meta(max_length=MAX_RKEY_BYTES)]
SERVING = (Status.OK, Status.PARTIAL)  # the statuses of a reply that serves blocks


def _check_served(status: Status, served: int, hashes: list[int]) -> None:
    if status not in SERVING:
        raise ValueError(f"a reply that serves blocks has status ok/partial, not "
                         f"{status.value}")
    if len(hashes) != served:
        raise ValueError(f"served_blocks {served} but {len(hashes)} block hashes")


class StreamReply(_Base, tag="stream_reply"):
    """Source → destination: ``n_chunks`` chunks of sizes ``chunk_sizes`` (sum
    ``total_bytes``) follow on the data tags of ``transfer_id``. ``block_hashes`` are the
    served blocks' hashes, a prefix of the requested ones; ``status`` is ok or partial."""

    transfer_id: TransferId
    status: Status
    served_blocks: Served = 0
    block_hashes: Hashes = []
    total_bytes: NonNeg = 0
    n_chunks: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHUNKS)] = 0
    chunk_sizes: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_CHUNKS)] = []
    reason: Text = ""

    def __post_init__(self) -> None:
        _check_served(self.status, self.served_blocks, self.block_hashes)
        if len(self.chunk_sizes) != self.n_chunks:
            raise ValueError(f"n_chunks {self.n_chunks} but {len(self.chunk_sizes)} sizes")
        if sum(self.chunk_sizes) != self.total_bytes:
            raise ValueError(f"chunk sizes sum to {sum(self.chunk_sizes)}, "
                             f"total_bytes is {self.total_bytes}")


class ReadGrant(_Base, tag="read_grant"):
    """Source → destination, only to a request with ``read``: no chunks follow; the served
    blocks are pinned for one-sided reads. Served block ``i`` is the ``total_bytes /
    served_blocks`` bytes at ``read_base + read_blocks[i] * read_stride`` of the source's
    memory registered under the packed UCX remote key ``read_rkey``. The source keeps the
    blocks pinned until it receives :class:`ReadDone` or :class:`Cancel`, and in any case
    for ``read_hold_ms`` counted from its receipt of the request: a destination whose reads
    all completed within ``read_hold_ms`` of sending the request may commit them without
    waiting for :class:`ReadAck`; otherwise only ``ReadAck(held=True)`` makes them count.

    With ``read_segment_bytes`` the grant describes the source's **whole** blocks, of
    which the destination reads the parts its plan pieces name (a TP or PP reshard reads a
    head or layer range): a block is ``1 + len(read_more_rkeys)`` segments of
    ``read_segment_bytes`` (a per-layer pool: one per layer); segment ``0`` is at
    ``read_base + read_blocks[i] * read_stride`` under ``read_rkey``, segment ``j >= 1`` at
    ``read_more_bases[j-1] + read_blocks[i] * read_stride`` under ``read_more_rkeys[j-1]``,
    and segment ``j`` holds the block's canonical ``[L, 2, H, T, D]`` bytes ``[j * seg,
    (j + 1) * seg)``. Without it a block is the one segment of ``total_bytes /
    served_blocks`` bytes at ``read_base``. With ``read_native`` the segments are the
    block's bytes in the source pool's own order instead (a layout whose canonical bytes
    are not contiguous, e.g. vLLM NHD): only a destination with the same layout reads
    them, whole blocks, segment ``j`` into its segment ``j``.
    """

    transfer_id: TransferId
    status: Status
    served_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]
    block_hashes: Hashes
    total_bytes: NonNeg
    read_rkey: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_RKEY_BYTES)]
    read_base: U64
    read_stride: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
    read_blocks: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_BLOCKS)]
    read_hold_ms: Annotated[int, msgspec.Meta(ge=0, le=24 * 3600 * 1000)] = 0
    read_segment_bytes: NonNeg = 0
    read_more_rkeys: Annotated[list[RKey], msgspec.Meta(max_length=MAX_READ_SEGMENTS)] = []
    read_more_bases: Annotated[list[U64], msgspec.Meta(max_length=MAX_READ_SEGMENTS)] = []
    read_native: bool = False
    reason: Text = ""

    def __post_init__(self) -> None:
        _check_served(self.status, self.served_blocks, self.block_hashes)
        if self.served_blocks < 1 or not self.read_rkey or self.read_stride < 1:
            raise ValueError(f"a read grant serves at least one block ({self.served_blocks}), "
                             f"under a remote key ({len(self.read_rkey)} B) and with a block "
                             f"stride ({self.read_stride})")
        if len(self.read_blocks) != self.served_blocks \
                or self.total_bytes % self.served_blocks:
            raise ValueError(f"a read grant needs one pool block per served block "
                             f"({len(self.read_blocks)} for {self.served_blocks}) and whole "
                             f"blocks ({self.total_bytes} B)")
        if len(self.read_more_bases) != len(self.read_more_rkeys) or \
                (self.read_more_rkeys and not self.read_segment_bytes):
            raise ValueError(f"a read grant's {1 + len(self.read_more_rkeys)} segments "
                             f"need as many bases ({1 + len(self.read_more_bases)}) and "
                             f"a segment size ({self.read_segment_bytes} B)")


class Refusal(_Base, tag="refusal"):
    """Source → destination: nothing is served and nothing follows; ``status`` (miss,
    rejected, busy or error) and ``reason`` (``"<code>: <detail>"``, see
    :class:`kvkern.xfer.codes.RejectCode`) say why."""

    transfer_id: TransferId
    status: Status
    reason: Text = ""

    def __post_init__(self) -> None:
        if self.status in SERVING:
            raise ValueError(f"a refusal cannot have status {self.status.value}")


# The source's answer to a PullRequest, on tag_for(transfer_id, REPLY): a tagged union.
PullReply = StreamReply | ReadGrant | Refusal


class Cancel(_Base, tag="cancel"):
    """Either side → the other: abandon ``transfer_id`` (the source unpins; the destination
    stops waiting). Sending it is best effort; each side also has its own deadline."""

    transfer_id: TransferId
    reason: Text = ""


class ReadDone(_Base, tag="read_done"):
    """Destination → source, on the control tag: every read of ``transfer_id`` completed;
    release the pins and, when ``ack``, confirm with :class:`ReadAck`. A destination whose
    reads all completed inside the granted hold needs no confirmation and sends
    ``ack=False`` (one message less per pull; the source then answers nothing)."""

    transfer_id: TransferId
    ack: bool = True


class ReadAck(_Base, tag="read_ack"):
    """Source → destination, on ``tag_for(transfer_id, REPLY, 1)``: ``held`` is True when the
    served blocks stayed pinned from the reply until :class:`ReadDone` arrived, so what the
    destination read is what the reply promised. Only then may it commit the blocks."""

    transfer_id: TransferId
    held: bool
    reason: Text = ""


Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
PeerId = Annotated[str, msgspec.Meta(max_length=128)]


class Hello(_Base, tag="hello"):
    """Client → server, the first frame of a connection: a fresh nonce and who it is."""

    nonce: Nonce
    peer_id: PeerId


class Challenge(_Base, tag="challenge"):
    """Server → client, on ``tag_for(0, REPLY)``: the server's nonce and id and its proof of
    the fleet secret over both nonces and both ids (:meth:`Credential.server_proof`)."""

    nonce: Nonce
    peer_id: PeerId
    proof: Nonce


class Proof(_Base, tag="proof"):
    """Client → server: the client's proof of the fleet secret
    (:meth:`Credential.client_proof`). Nothing else is read before it checks out."""

    proof: Nonce


Message = Union[PullRequest, StreamReply, ReadGrant, Refusal, Cancel,  # noqa: UP007
                ReadDone, ReadAck, Hello, Challenge, Proof]
MESSAGE_TYPES: tuple[type, ...] = (PullRequest, StreamReply, ReadGrant, Refusal, Cancel,
                                   ReadDone, ReadAck, Hello, Challenge, Proof)


def _strip_prose(node):
    """The schema without titles and descriptions: docstrings are not wire format."""
    if isinstance(node, dict):
        return {k: _strip_prose(v) for k, v in node.items() if k not in ("title", "description")}
    if isinstance(node, list):
        return [_strip_prose(v) for v in node]
    return node


def schema_fingerprint(compat: bytes = b"") -> int:
    """u64 over the JSON schema of every message (field names, types, constraints, tags),
    the protocol version and ``compat``. Any schema change changes it."""
    schema = msgspec.json.encode(_strip_prose(msgspec.json.schema(Message)), order="sorted")
    h = hashlib.blake2b(digest_size=8)
    h.update(MAGIC + PROTOCOL_VERSION.to_bytes(2, "little") + schema + b"\0" + compat)
    return int.from_bytes(h.digest(), "little")


class Codec:
    """Encoder/decoder bound to one compatibility fingerprint.

    ``compat`` is mixed into the fingerprint: two peers interoperate only if they were built
    with the same message schema, protocol version and ``compat`` bytes.
    """

    def __init__(self, compat: bytes = b"", *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if not 0 < max_body_bytes <= 0xFFFFFFFF:
            raise ValueError(f"max_body_bytes {max_body_bytes} not in (0, 2**32)")
        self.fingerprint = schema_fingerprint(compat)
        self.max_body_bytes = max_body_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    @property
    def max_frame_bytes(self) -> int:
        return PREAMBLE_BYTES + self.max_body_bytes

    def encode(self, msg: Message) -> bytes:
        if not isinstance(msg, MESSAGE_TYPES):
            raise TypeError(f"cannot encode {type(msg).__name__}; expected one of "
                            f"{[t.__name__ for t in MESSAGE_TYPES]}")
        body = self._encoder.encode(msg)
        if len(body) > self.max_body_bytes:
            raise ValueError(f"{type(msg).__name__} body of {len(body)} bytes exceeds the "
                             f"{self.max_body_bytes}-byte cap")
        return _PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, 0, self.fingerprint, len(body)) + body

    def frame_length(self, preamble: bytes | bytearray | memoryview) -> int:
        """Total frame length announced by a (validated) preamble; raises ProtocolError."""
        if len(preamble) < PREAMBLE_BYTES:
            raise ProtocolError("truncated", f"{len(preamble)} bytes is shorter than the "
                                f"{PREAMBLE_BYTES}-byte preamble")
        magic, version, flags, fingerprint, n = _PREAMBLE.unpack_from(preamble)
        if magic != MAGIC:
            raise ProtocolError("bad_magic", f"magic {magic!r} is not {MAGIC!r}")
        if version != PROTOCOL_VERSION:
            raise ProtocolError("unsupported_version",
                                f"peer speaks version {version}, we speak {PROTOCOL_VERSION}")
        if flags != 0:
            raise ProtocolError("bad_flags", f"flags {flags:#x} set; none are defined")
        if fingerprint != self.fingerprint:
            raise ProtocolError("fingerprint_mismatch", f"peer fingerprint {fingerprint:#018x}"
                                f" != ours {self.fingerprint:#018x}")
        if n > self.max_body_bytes:
            raise ProtocolError("too_large", f"body of {n} bytes exceeds the "
                                f"{self.max_body_bytes}-byte cap")
        return PREAMBLE_BYTES + n

    def decode(self, frame: bytes | bytearray | memoryview) -> Message:
        """Decode one complete frame (exactly its bytes). Raises only ProtocolError."""
        view = memoryview(frame)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        total = self.frame_length(view)
        if len(view) != total:
            raise ProtocolError("length_mismatch", f"preamble announces {total} bytes, "
                                f"frame has {len(view)}")
        try:
            return self._decoder.decode(view[PREAMBLE_BYTES:])
        except msgspec.ValidationError as exc:
            text = str(exc)
            reason = "unknown_kind" if "`$.kind`" in text else "invalid"
            raise ProtocolError(reason, text) from None
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
            raise ProtocolError("invalid", f"{type(exc).__name__}: {exc}") from None


DEFAULT_CODEC = Codec()


def encode(msg: Message) -> bytes:
    """Encode with the default (no deployment compat bytes) codec."""
    return DEFAULT_CODEC.encode(msg)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Decode with the default codec; raises only :class:`ProtocolError`."""
    return DEFAULT_CODEC.decode(frame)
