"""The state document (``GET /kvkern/v1/state``): one typed definition that the source builds
and the puller decodes.

Protocol versions (:data:`PROTOCOL`, the document's ``protocol``; the control frames carry
their own :data:`kvkern.xfer.messages.PROTOCOL_VERSION`):

* ``kvkern/1``: topology, hash scheme, block size, codec fingerprint and the UCX address of
  each hosted rank; later additions are optional fields an older reader ignores: each rank's
  ``layout``, ``read``, ``read_worker`` and ``read_index`` (one-sided reads, capability
  ``read/1``; ``read_index``: the rank's registered segments and its block manager's read
  directory, for reads without a grant; ``read_local``: the process, for a destination on the
  same host) and the document's ``model``.

Decoding is strict where a pull depends on a value (a missing or mistyped field is a
``ValueError`` naming it: the puller's ``metadata_invalid``) and forward compatible where the
value is advisory: unknown fields are ignored, and a rank's ``read``, ``read_worker`` or
``layout`` that this reader does not understand means "stream from that rank".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import msgspec

from kvkern.layout.segments import layout_signature

if TYPE_CHECKING:
    from kvkern.layout.topology import Topology
    from kvkern.xfer.local_reads import LocalSource

__all__ = ["BLOCKS_PATH", "CAPABILITIES", "MAX_ID_CHARS", "PEER_PREFIX", "PROTOCOL", "READ_KINDS",
           "STATE_PATH", "DpGroupDoc", "RankDoc", "ReadIndex", "SourceState", "StateDoc",
           "decode_state", "parse_read_index", "parse_state"]

PROTOCOL = "kvkern/1"
STATE_PATH = "/kvkern/v1/state"
BLOCKS_PATH = "/kvkern/v1/blocks"
PEER_PREFIX = "/kvkern/"  # every path under it answers authenticated fleet members only
CAPABILITIES = ("pull/1", "strict", "best_effort", "sharded")
READ_KINDS = ("canonical", "native")  # how a rank's registered pool can be read
# characters of a state's worker_id and incarnation at most: both go into every outcome of a
# pull from that source (and its log line), so a longer one makes the state invalid
MAX_ID_CHARS = 256
_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]


class RankDoc(msgspec.Struct, omit_defaults=True):
    """One hosted rank: where its listener is, its layout, and how it can be read."""

    ucx_host: str
    ucx_port: int | None  # None before the service has started its listener
    layout: object = None  # KVLayout.describe(); advisory (native reads)
    read: object = None  # one of READ_KINDS when the rank's pool is registered; advisory
    read_worker: object = None  # hex of the UCX worker address read lanes dial; advisory
    read_index: object = None  # RegisteredPool.read_index(): reads without a grant; advisory
    read_local: object = None  # kvkern.xfer.local_reads.Beacon.doc(): same-host reads; advisory


class DpGroupDoc(msgspec.Struct):
    ranks: dict[str, RankDoc]


class StateDoc(msgspec.Struct):
    """The document. ``model`` and ``capabilities`` may be absent (an older source)."""

    protocol: str
    worker_id: _Id
    incarnation: _Id
    hash_scheme: str
    block_size: int
    codec_fingerprint: str  # 16 hex digits of Codec.fingerprint, zero padded
    topology: dict  # Topology.to_dict()
    dp_groups: dict[str, DpGroupDoc]
    model: str = ""
    capabilities: list[str] = []


@dataclass(frozen=True)
class ReadIndex:
    """A rank's registered pool and read directory as its state announces them: segment
    ``j`` of block ``b`` is ``segment_bytes`` at ``bases[j] + b * stride`` under the packed
    remote key ``keys[j]``; the directory's ``dir_buckets`` buckets
    (:mod:`kvkern.cache.directory`) are at ``dir_base`` under ``dir_key``, and it places
    ``dir_group`` positions of a chain together (0: every hash in its plain bucket);
    ``dir_check``: its slots carry check words (a directory without them has no slot a
    reader uses, so its ranks are asked for grants without reading it)."""

    keys: tuple[bytes, ...]
    bases: tuple[int, ...]
    stride: int
    segment_bytes: int
    blocks: int
    dir_key: bytes
    dir_base: int
    dir_buckets: int
    dir_group: int = 0
    dir_check: bool = False


@dataclass(frozen=True, kw_only=True)
class SourceState:
    """A decoded state document. ``ranks[(dp, rank)] = (ucx_host, ucx_port)``."""

    protocol: str
    worker_id: str
    incarnation: str
    hash_scheme: str
    block_size: int
    codec_fingerprint: int
    topology: Topology
    ranks: dict[tuple[int, int], tuple[str, int]]
    capabilities: tuple[str, ...]
    # (dp, rank) -> "canonical" | "native": how that rank's registered pool can be read
    reads: dict[tuple[int, int], str] = field(default_factory=dict)
    # (dp, rank) -> kvkern.layout.segments.layout_signature of its pool (native reads)
    layouts: dict[tuple[int, int], tuple] = field(default_factory=dict)
    # (dp, rank) -> the UCX worker address its read lanes open endpoints to
    read_workers: dict[tuple[int, int], bytes] = field(default_factory=dict)
    # (dp, rank) -> where its blocks and read directory are (reads without a grant)
    read_indexes: dict[tuple[int, int], ReadIndex] = field(default_factory=dict)
    # (dp, rank) -> its process, where it runs on this host (kvkern.xfer.local_reads)
    read_locals: dict[tuple[int, int], LocalSource] = field(default_factory=dict)
    model: str = ""  # the source's model fingerprint (KVGroup.model_id)


def decode_state(body: bytes | str | dict) -> StateDoc:
    """The typed document of a state body; ``ValueError`` naming the bad field otherwise."""
    try:
        d = json.loads(body) if isinstance(body, (bytes, str)) else body
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # (deep nesting)
        raise ValueError(f"state is not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"state is a JSON {type(d).__name__}, not an object")
    try:
        return msgspec.convert(d, StateDoc, strict=True)
    except msgspec.ValidationError as exc:
        raise ValueError(f"state invalid: {exc}") from None


def parse_state(body: bytes | str | dict) -> SourceState:
    """Decode and check a state body into a :class:`SourceState`; ``ValueError`` naming the
    bad field otherwise (the only error it raises)."""
    from kvkern.layout.topology import Topology  # noqa: PLC0415 (torch: only when pulling)

    doc = decode_state(body)
    try:
        fingerprint = int(doc.codec_fingerprint, 16)
    except ValueError:
        raise ValueError(f"state codec_fingerprint {doc.codec_fingerprint!r} is not hex") from None
    try:
        topology = Topology.from_dict(doc.topology)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # e.g. "model": null
        raise ValueError(f"state topology invalid: {type(exc).__name__}: {exc}") from None
    state = SourceState(protocol=doc.protocol, worker_id=doc.worker_id,
                        incarnation=doc.incarnation, hash_scheme=doc.hash_scheme,
                        block_size=doc.block_size, codec_fingerprint=fingerprint,
                        topology=topology, ranks={}, capabilities=tuple(doc.capabilities),
                        model=doc.model)
    for dp_text, group in doc.dp_groups.items():
        try:
            dp = int(dp_text)
            for r_text, info in group.ranks.items():
                _add_rank(state, (dp, int(r_text)), info)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state dp_groups[{dp_text!r}] invalid: {exc}") from None
    return state


def _add_rank(state: SourceState, key: tuple[int, int], info: RankDoc) -> None:
    host, port = info.ucx_host, info.ucx_port
    if port is None or not 0 < port < 65536:
        raise ValueError(f"ucx address {host!r}:{port!r}")
    state.ranks[key] = (host, port)
    if info.read in READ_KINDS:
        state.reads[key] = info.read
        worker = _worker_address(info.read_worker)
        if worker is not None:
            state.read_workers[key] = worker
            index = parse_read_index(info.read_index)
            if index is not None:
                state.read_indexes[key] = index
            if info.read_local is not None:
                from kvkern.xfer import local_reads  # noqa: PLC0415

                local = local_reads.parse(info.read_local)
                if local is not None:
                    state.read_locals[key] = local
    if isinstance(info.layout, dict):
        state.layouts[key] = layout_signature(info.layout)


def parse_read_index(doc: object) -> ReadIndex | None:
    """A rank's ``read_index`` as a :class:`ReadIndex`; None when absent or malformed in any
    way (the rank is then read by grant: the index is advisory). Every number is bounded so
    the addresses a destination computes from it stay within 64 bits."""
    from kvkern.cache.directory import BUCKET_BYTES, MAX_GROUP  # noqa: PLC0415
    from kvkern.xfer.messages import MAX_BLOCKS, MAX_READ_SEGMENTS, MAX_RKEY_BYTES  # noqa: PLC0415

    if not isinstance(doc, dict):
        return None
    try:
        keys = tuple(_hex(k, MAX_RKEY_BYTES) for k in doc["keys"])
        bases = tuple(_u64(b) for b in doc["bases"])
        stride, seg = _u64(doc["stride"]), _u64(doc["segment_bytes"])
        blocks, buckets = _u64(doc["blocks"]), _u64(doc["dir_buckets"])
        group = _u64(doc.get("dir_group", 0))  # (absent: a source that places by hash alone)
        check = doc.get("dir_check", 0)  # (absent: slots without check words)
        check = type(check) is int and check == 1
        index = ReadIndex(keys, bases, stride, seg, blocks, _hex(doc["dir_key"], MAX_RKEY_BYTES),
                          _u64(doc["dir_base"]), buckets, group, check)
    except (KeyError, TypeError, ValueError):
        return None
    top = (blocks - 1) * stride + seg
    if not (0 < len(keys) == len(bases) <= 1 + MAX_READ_SEGMENTS and 0 < seg <= stride
            and 0 < blocks <= MAX_BLOCKS and 0 < buckets <= 1 << 32 and group <= MAX_GROUP
            and buckets & (buckets - 1) == 0 and max(bases) + top < 1 << 64
            and index.dir_base + buckets * BUCKET_BYTES < 1 << 64):
        return None
    return index


def _hex(text: object, max_bytes: int) -> bytes:
    if not isinstance(text, str) or not 0 < len(text) <= 2 * max_bytes:
        raise ValueError("bad hex")
    return bytes.fromhex(text)


def _u64(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
        raise ValueError("not a u64")
    return v


def _worker_address(text: object) -> bytes | None:
    """A state's ``read_worker`` (hex of a UCX worker address) as bytes; None when absent or
    malformed (that rank is then streamed from)."""
    from kvkern.xfer.read_lanes import MAX_WORKER_ADDRESS_BYTES  # noqa: PLC0415

    if not isinstance(text, str) or not 0 < len(text) <= 2 * MAX_WORKER_ADDRESS_BYTES:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None
