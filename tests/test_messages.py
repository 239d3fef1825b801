"""Control messages: round trips, strict rejection with typed reasons, and no ucxx import."""

from __future__ import annotations

import subprocess
import sys
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.xfer import messages as m
from kvkern.xfer.messages import (
    MAGIC,
    PREAMBLE_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Challenge,
    Codec,
    Hello,
    PlanPiece,
    Proof,
    ProtocolError,
    PullRequest,
    ReadAck,
    ReadDone,
    ReadGrant,
    Refusal,
    Status,
    StreamReply,
    decode,
    encode,
)

U64 = st.integers(0, 2**64 - 1)


def piece(offset=0, length=100, **kw) -> PlanPiece:
    base = dict(src_rank=0, layer_start=0, layer_stop=4, head_start=0, head_stop=8)
    return PlanPiece(**(base | kw), offset=offset, length=length)


def pull_request(**kw) -> PullRequest:
    base = dict(transfer_id=9, request_id="req-1", hash_scheme="xxh3-64/seed0",
                block_hashes=[1, 2**64 - 1, 3, 4], start=2, count=2,
                pieces=[piece(0, 100), piece(100, 50, src_rank=1)], chunk_bytes=4 << 20,
                deadline_ms=30_000)
    return PullRequest(**(base | kw))


def frame(body: dict | bytes, *, magic=MAGIC, version=PROTOCOL_VERSION, flags=0,
          fingerprint=None, length=None) -> bytes:
    raw = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
    fp = m.DEFAULT_CODEC.fingerprint if fingerprint is None else fingerprint
    n = len(raw) if length is None else length
    return m._PREAMBLE.pack(magic, version, flags, fp, n) + raw


PIECE = msgspec.structs.asdict(piece())


def reason_of(data) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    return info.value.reason


@pytest.mark.parametrize("msg", [
    pull_request(),
    StreamReply(transfer_id=9, status=Status.OK, served_blocks=2, block_hashes=[3, 4],
                total_bytes=150, n_chunks=2, chunk_sizes=[100, 50]),
    Refusal(transfer_id=9, status=Status.MISS, reason="evicted"),
    StreamReply(transfer_id=1, status=Status.OK),
    Cancel(transfer_id=2**30 - 1, reason="deadline"),
    pull_request(read=True, require_all=True),
    ReadGrant(transfer_id=9, status=Status.PARTIAL, served_blocks=2, block_hashes=[3, 4],
              total_bytes=8192, read_rkey=bytes(range(256)) * 3, read_base=2**64 - 1,
              read_stride=4096, read_blocks=[17, 0]),
    ReadDone(transfer_id=7),
    ReadAck(transfer_id=7, held=True),
    ReadAck(transfer_id=2**30 - 1, held=False, reason="deadline passed before ReadDone"),
    Hello(nonce=bytes(range(32)), peer_id="worker-a"),
    Challenge(nonce=b"\xff" * 32, peer_id="", proof=bytes(32)),
    Proof(proof=bytes(range(32))),
    pull_request(model="sha256:" + "ab" * 32),
], ids=["request", "reply-ok", "reply-miss", "reply-empty", "cancel", "request-read",
        "reply-read", "read-done", "read-ack-held", "read-ack-lost", "hello", "challenge",
        "proof", "request-model"])
def test_round_trip(msg):
    data = encode(msg)
    assert data[:4] == MAGIC and len(data) > PREAMBLE_BYTES
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg and decode(memoryview(data)) == msg


def test_request_helpers():
    assert pull_request().requested_hashes == [3, 4]


@settings(max_examples=150, deadline=None)
@given(hashes=st.lists(U64, min_size=1, max_size=64), data=st.data())
def test_round_trip_property(hashes, data):
    start = data.draw(st.integers(0, len(hashes) - 1))
    count = data.draw(st.integers(1, len(hashes) - start))
    lengths = data.draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=8))
    offs = [sum(lengths[:i]) for i in range(len(lengths))]
    req = pull_request(transfer_id=data.draw(st.integers(1, 2**30 - 1)), block_hashes=hashes,
                       start=start, count=count,
                       pieces=[piece(o, n, src_rank=i) for i, (o, n) in
                               enumerate(zip(offs, lengths, strict=True))],
                       request_id=data.draw(st.text(max_size=40)),
                       require_all=data.draw(st.booleans()), read=data.draw(st.booleans()))
    assert decode(encode(req)) == req


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    with pytest.raises(ProtocolError):
        decode(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_body_behind_valid_preamble_never_crashes(body):
    try:
        decode(frame(body))
    except ProtocolError as exc:
        assert exc.reason in ("invalid", "unknown_kind")


KINDS = ["hello", "challenge", "proof", "pull_request", "stream_reply", "read_grant", "refusal",
         "cancel", "read_done", "read_ack"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["kind", "transfer_id", "status", "reason", "start",
                                        "count", "pieces", "block_hashes", "chunk_sizes",
                                        "served_blocks", "total_bytes", "n_chunks", "read",
                                        "read_rkey", "read_base", "read_stride", "read_blocks",
                                        "held", "nonce", "peer_id", "proof", "model",
                                        "chunk_blocks"]),
                       st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                                 st.sampled_from(KINDS), st.booleans(), st.binary(max_size=8),
                                 st.lists(st.integers(-5, 5), max_size=3)), max_size=12))
def test_random_maps_never_crash(body):
    try:
        decode(frame(body))
    except ProtocolError as exc:
        assert exc.reason in ("invalid", "unknown_kind")


@pytest.mark.parametrize("data,reason", [
    (b"", "truncated"),
    (encode(Cancel(transfer_id=1))[:PREAMBLE_BYTES - 1], "truncated"),
    (frame({"kind": "cancel", "transfer_id": 1}, magic=b"KVKY"), "bad_magic"),
    (frame({"kind": "cancel", "transfer_id": 1}, version=PROTOCOL_VERSION + 1),
     "unsupported_version"),
    (frame({"kind": "cancel", "transfer_id": 1}, version=0), "unsupported_version"),
    (frame({"kind": "cancel", "transfer_id": 1}, flags=1), "bad_flags"),
    (frame({"kind": "cancel", "transfer_id": 1}, fingerprint=Codec(b"other").fingerprint),
     "fingerprint_mismatch"),
    (frame(b"", length=m.MAX_BODY_BYTES + 1), "too_large"),
    (frame({"kind": "cancel", "transfer_id": 1}) + b"x", "length_mismatch"),
    (encode(Cancel(transfer_id=1))[:-1], "length_mismatch"),
    (frame({"kind": "push_request", "transfer_id": 1}), "unknown_kind"),
    (frame({"transfer_id": 1}), "invalid"),
    (frame({"kind": "cancel", "transfer_id": 1, "extra": 1}), "invalid"),
    (frame({"kind": "cancel", "transfer_id": 0}), "invalid"),
    (frame({"kind": "cancel", "transfer_id": 2**30}), "invalid"),
    (frame({"kind": "cancel", "transfer_id": "1"}), "invalid"),
    (frame({"kind": "stream_reply", "transfer_id": 1, "status": "maybe"}), "invalid"),
    (frame({"kind": "stream_reply", "transfer_id": 1, "status": "ok", "n_chunks": 2,
            "chunk_sizes": [1]}), "invalid"),
    (frame({"kind": "stream_reply", "transfer_id": 1, "status": "ok", "total_bytes": 3,
            "n_chunks": 1, "chunk_sizes": [2]}), "invalid"),
    (frame({"kind": "refusal", "transfer_id": 1, "status": "miss", "n_chunks": 1,
            "total_bytes": 1, "chunk_sizes": [1]}), "invalid"),
    (frame({"kind": "stream_reply", "transfer_id": 1, "status": "ok", "served_blocks": 1,
            "block_hashes": [-1]}), "invalid"),
    (frame({"kind": "stream_reply", "transfer_id": 1, "status": "miss"}), "invalid"),
    (frame({"kind": "refusal", "transfer_id": 1, "status": "ok"}), "invalid"),
    (frame({"kind": "pull_reply", "transfer_id": 1, "status": "ok"}), "unknown_kind"),
    (frame(msgspec.msgpack.encode([1, 2, 3])), "invalid"),
    (frame(b"\xc1"), "invalid"),
], ids=["empty", "short-preamble", "magic", "newer-version", "version-0", "flags",
        "fingerprint", "too-large", "trailing-byte", "missing-byte", "unknown-kind",
        "no-kind", "unknown-field", "tid-0", "tid-too-big", "tid-str", "bad-status",
        "chunk-count", "chunk-sum", "miss-with-data", "negative-hash", "stream-that-misses",
        "refusal-that-serves", "untagged-reply-of-version-4", "array-body", "bad-msgpack"])
def test_rejections(data, reason):
    assert reason_of(data) == reason


@pytest.mark.parametrize("kw,match", [
    (dict(start=3, count=2), "exceeds"),
    (dict(pieces=[piece(0, 100), piece(50, 10)]), "overlaps"),
    (dict(pieces=[PIECE | {"layer_start": 3, "layer_stop": 3}]), "layer range"),
    (dict(pieces=[PIECE | {"head_start": 5, "head_stop": 4}]), "head range"),
    (dict(chunk_blocks=[1, 1]), "one piece"),
    (dict(pieces=[piece(0, 100)], chunk_blocks=[1, 2]), "3 blocks for 2"),
    (dict(pieces=[piece(0, 100)], chunk_blocks=[2, 0]), "invalid"),
], ids=["range-past-hashes", "overlapping-pieces", "empty-layers", "reversed-heads",
        "chunk-plan-of-two-pieces", "chunk-plan-sum", "empty-chunk-in-plan"])
def test_invalid_request_rejected_on_decode(kw, match):
    bad = msgspec.structs.asdict(pull_request())
    bad["pieces"] = [msgspec.structs.asdict(p) for p in bad["pieces"]]
    for k, v in kw.items():
        if k == "pieces":
            v = [p if isinstance(p, dict) else msgspec.structs.asdict(p) for p in v]
        bad[k] = v
    with pytest.raises(ProtocolError, match=match) as info:
        decode(frame({"kind": "pull_request", **bad}))
    assert info.value.reason == "invalid"


# ------------------------------------------------------------------ every message kind

TIDS = st.integers(1, 2**30 - 1)
TEXT = st.text(max_size=30)


@st.composite
def requests(draw) -> PullRequest:
    hashes = draw(st.lists(U64, min_size=1, max_size=8))
    start = draw(st.integers(0, len(hashes) - 1))
    return pull_request(transfer_id=draw(TIDS), block_hashes=hashes, start=start,
                        count=draw(st.integers(1, len(hashes) - start)),
                        require_all=draw(st.booleans()), read=draw(st.booleans()),
                        deadline_ms=draw(st.integers(0, 24 * 3600 * 1000)))


@st.composite
def stream_replies(draw) -> StreamReply | Refusal:
    status = draw(st.sampled_from(list(Status)))
    if status not in (Status.OK, Status.PARTIAL):
        return Refusal(transfer_id=draw(TIDS), status=status, reason=draw(TEXT))
    served = draw(st.integers(0, 6))
    sizes = draw(st.lists(st.integers(0, 2**40), max_size=6))
    return StreamReply(transfer_id=draw(TIDS), status=status, served_blocks=served,
                       block_hashes=draw(st.lists(U64, min_size=served, max_size=served)),
                       total_bytes=sum(sizes), n_chunks=len(sizes), chunk_sizes=sizes)


@st.composite
def read_replies(draw) -> ReadGrant:
    served = draw(st.integers(1, 6))
    return ReadGrant(transfer_id=draw(TIDS), status=draw(st.sampled_from([Status.OK,
                                                                          Status.PARTIAL])),
                     served_blocks=served,
                     block_hashes=draw(st.lists(U64, min_size=served, max_size=served)),
                     read_rkey=draw(st.binary(min_size=1, max_size=700)), read_base=draw(U64),
                     read_stride=draw(st.integers(1, 2**63 - 1)),
                     read_blocks=draw(st.lists(st.integers(0, 2**63 - 1), min_size=served,
                                               max_size=served)),
                     read_hold_ms=draw(st.integers(0, 24 * 3600 * 1000)),
                     **draw(segments(served)))


@st.composite
def segments(draw, served: int) -> dict:
    """Segment fields of a read reply: none, or k >= 2 segments per block."""
    k = draw(st.integers(1, 5))
    if k == 1:
        return {"total_bytes": served * draw(st.integers(0, 2**34)),
                "read_segment_bytes": draw(st.sampled_from([0, 1, 2**20]))}
    seg = draw(st.integers(1, 2**30))
    return {"total_bytes": served * draw(st.integers(0, k * seg)), "read_segment_bytes": seg,
            "read_more_rkeys": draw(st.lists(st.binary(min_size=1, max_size=300),
                                             min_size=k - 1, max_size=k - 1)),
            "read_more_bases": draw(st.lists(U64, min_size=k - 1, max_size=k - 1))}


MESSAGES = st.one_of(
    requests(), stream_replies(), read_replies(),
    st.builds(Cancel, transfer_id=TIDS, reason=TEXT),
    st.builds(ReadDone, transfer_id=TIDS),
    st.builds(ReadAck, transfer_id=TIDS, held=st.booleans(), reason=TEXT))


def test_message_types_cover_every_kind():
    assert set(m.MESSAGE_TYPES) == set(typing.get_args(m.Message))
    assert {t.__struct_config__.tag for t in m.MESSAGE_TYPES} == set(KINDS)


@settings(max_examples=300, deadline=None)
@given(MESSAGES)
def test_every_kind_round_trips(msg):
    assert decode(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(MESSAGES, st.data())
def test_mutated_frames_of_every_kind_never_crash(msg, data):
    """A valid frame of any kind with body bytes overwritten, cut or appended: decoding
    yields a message or a ProtocolError, nothing else."""
    frame_ = bytearray(encode(msg))
    body = frame_[PREAMBLE_BYTES:]
    edit = data.draw(st.sampled_from(["overwrite", "cut", "append"]))
    if edit == "overwrite":
        for _ in range(data.draw(st.integers(1, 4))):
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    elif edit == "cut":
        body = body[:data.draw(st.integers(0, len(body) - 1))]
    else:
        body += data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = decode(frame(bytes(body)))
    except ProtocolError as exc:
        assert exc.reason in ("invalid", "unknown_kind")
    else:
        assert isinstance(out, m.MESSAGE_TYPES)


READ_REPLY = dict(transfer_id=5, status="ok", served_blocks=2, block_hashes=[7, 8],
                  total_bytes=8192, read_rkey=b"rk", read_base=4096, read_stride=4096,
                  read_blocks=[3, 1])


def test_segmented_read_reply_round_trips():
    """A per-layer pool's read reply: each block is 1 + len(read_more_rkeys) segments."""
    reply = ReadGrant(**(READ_REPLY | {"status": Status.OK, "read_segment_bytes": 1024,
                                       "read_more_rkeys": [b"k1", b"k2", b"k3"],
                                       "read_more_bases": [1 << 40, 0, 2**64 - 1]}))
    assert decode(encode(reply)) == reply


def test_read_reply_defaults_and_old_bodies():
    """A request or reply body without the read fields (what a peer of the same schema
    may omit: they have defaults) decodes as a stream request / reply."""
    body = msgspec.structs.asdict(pull_request())
    body["pieces"] = [msgspec.structs.asdict(p) for p in body["pieces"]]
    del body["read"], body["require_all"]
    req = decode(frame({"kind": "pull_request", **body}))
    assert req.read is False and req == pull_request()
    reply = decode(frame({"kind": "stream_reply", "transfer_id": 1, "status": "ok"}))
    assert reply == StreamReply(transfer_id=1, status=Status.OK) and reply.n_chunks == 0
    assert decode(frame({"kind": "read_grant", **READ_REPLY})) == ReadGrant(
        **(READ_REPLY | {"status": Status.OK}))


@pytest.mark.parametrize("kw,match", [
    (dict(read_blocks=[3]), "one pool block per served block"),
    (dict(read_blocks=[3, 1, 2]), "one pool block per served block"),
    (dict(read_stride=0), "a block stride"),
    (dict(read_rkey=b""), "a remote key"),
    (dict(status="miss", reason="x"), "status ok/partial"),
    (dict(served_blocks=0, block_hashes=[], read_blocks=[], total_bytes=0),
     "at least one block"),
    (dict(total_bytes=READ_REPLY["total_bytes"] + 1), "whole blocks"),
    (dict(read_more_rkeys=[b"a"], read_more_bases=[0]), "need as many bases"),
    (dict(read_segment_bytes=2048, read_more_rkeys=[b"a"], read_more_bases=[]),
     "need as many bases"),
], ids=["too-few-read-blocks", "too-many-read-blocks", "zero-stride", "empty-rkey",
        "miss-with-rkey", "no-served-blocks", "partial-block-bytes", "segments-without-size",
        "segment-bases-missing"])
def test_invalid_read_grant_rejected(kw, match):
    bad = READ_REPLY | kw
    with pytest.raises(ValueError, match=match):
        ReadGrant(**(bad | {"status": Status(bad["status"])}))
    with pytest.raises(ProtocolError) as info:
        decode(frame({"kind": "read_grant", **bad}))
    assert info.value.reason == "invalid"


@pytest.mark.parametrize("kind,kw", [
    ("read_grant", dict(n_chunks=1, chunk_sizes=[8192])),
    ("stream_reply", dict(read_blocks=[3, 1])),
    ("stream_reply", dict(read_rkey=b"rk")),
    ("refusal", dict(read_rkey=b"rk")),
], ids=["grant-with-chunks", "stream-with-read-blocks", "stream-with-rkey", "refusal-with-rkey"])
def test_reply_kinds_do_not_mix_fields(kind, kw):
    """A stream reply carries no read fields and a grant no chunks: each kind's fields are
    its own, so a mixed body is an unknown field."""
    base = {"transfer_id": 5, "status": "ok" if kind != "refusal" else "miss"}
    assert reason_of(frame({"kind": kind, **base, **kw})) == "invalid"


@pytest.mark.parametrize("kw", [
    dict(read_rkey=b"k" * (m.MAX_RKEY_BYTES + 1)),
    dict(read_rkey="rk"),  # text, not bytes
    dict(read_base=-1),
    dict(read_stride=-4096),
    dict(read_stride=2**63),
    dict(read_blocks=[3, -1]),
    dict(read_blocks=[3, "1"]),
    dict(read_hold_ms=-1),
    dict(read_hold_ms=24 * 3600 * 1000 + 1),
], ids=["oversize-rkey", "rkey-as-text", "negative-base", "negative-stride", "stride-past-i64",
        "negative-block", "block-as-text", "negative-hold", "hold-past-a-day"])
def test_read_reply_field_types_checked_on_decode(kw):
    """Type and range constraints are msgspec's: checked when decoding (construction does
    not check msgspec.Meta constraints, for these fields as for every other)."""
    body = {"kind": "read_grant", **(READ_REPLY | kw)}
    assert reason_of(frame(body)) == "invalid"


def test_rkey_size_limit_is_inclusive():
    ok = ReadGrant(**(READ_REPLY | {"status": Status.OK,
                                    "read_rkey": b"k" * m.MAX_RKEY_BYTES}))
    assert decode(encode(ok)) == ok
    assert m.READ_CAPABILITY == "read/1"


@pytest.mark.parametrize("body", [
    {"kind": "read_done", "transfer_id": 0},
    {"kind": "read_done", "transfer_id": 1, "held": True},
    {"kind": "read_done"},
    {"kind": "read_ack", "transfer_id": 1},
    {"kind": "read_ack", "transfer_id": 1, "held": 1},
    {"kind": "read_ack", "transfer_id": 1, "held": True, "reason": "x" * (m.MAX_TEXT + 1)},
    {"kind": "pull_request", **{k: v for k, v in msgspec.structs.asdict(
        pull_request()).items() if k != "pieces"}, "pieces": [PIECE], "read": "yes"},
], ids=["done-tid-0", "done-extra-field", "done-no-tid", "ack-no-held", "ack-held-int",
        "ack-reason-too-long", "request-read-not-bool"])
def test_read_messages_rejected_on_decode(body):
    assert reason_of(frame(body)) == "invalid"


def _rebuilt(cls, drop=()):
    """``cls`` redefined from its fields (minus ``drop``) under the same name and tag."""
    fields = []
    for f in msgspec.structs.fields(cls):
        if f.name in drop:
            continue
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(cls.__name__, fields, bases=(m._Base,),
                             tag=cls.__struct_config__.tag)


def test_fingerprint_follows_the_schema(monkeypatch):
    """A schema change (e.g. the read path's PullRequest.read, ReadGrant, ReadDone, ReadAck,
    or a reply field) changes the fingerprint, so a peer built before it is refused at the
    preamble."""
    current = m.schema_fingerprint()
    assert current == m.DEFAULT_CODEC.fingerprint

    def fingerprint_with(*types) -> int:
        monkeypatch.setattr(m, "Message", typing.Union[types])  # noqa: UP007 (runtime Union)
        return m.schema_fingerprint()

    kinds = (m.PullRequest, m.StreamReply, m.ReadGrant, m.Refusal, m.Cancel, m.ReadDone,
             m.ReadAck, m.Hello, m.Challenge, m.Proof)
    assert fingerprint_with(*kinds) == current
    assert fingerprint_with(_rebuilt(m.PullRequest), *kinds[1:]) == current  # same fields
    seen = {current}
    variants = [
        (_rebuilt(m.PullRequest, drop=("read",)), *kinds[1:]),
        (*kinds[:2], _rebuilt(m.ReadGrant, drop=("read_rkey",)), *kinds[3:]),
        (*kinds[:2], _rebuilt(m.ReadGrant, drop=("read_base", "read_stride", "read_blocks")),
         *kinds[3:]),
        (m.PullRequest, _rebuilt(m.StreamReply, drop=("chunk_sizes",)), *kinds[2:]),
        (*kinds[:5], m.ReadDone),
        (*kinds[:5], m.ReadAck),
        kinds[:5],
        (*kinds[:6], _rebuilt(m.ReadAck, drop=("reason",))),
    ]
    for types in variants:
        fp = fingerprint_with(*types)
        assert fp not in seen, [t.__name__ for t in types]
        seen.add(fp)
    monkeypatch.undo()
    monkeypatch.setattr(m, "PROTOCOL_VERSION", m.PROTOCOL_VERSION + 1)
    assert m.schema_fingerprint() not in seen
    monkeypatch.undo()
    assert m.schema_fingerprint() == current


def test_list_caps():
    body = {"kind": "stream_reply", "transfer_id": 1, "status": "ok",
            "served_blocks": m.MAX_BLOCKS + 1, "block_hashes": [0] * (m.MAX_BLOCKS + 1)}
    assert reason_of(frame(body)) == "invalid"


def test_codec_compat_and_caps():
    a, b = Codec(b"layout=A"), Codec(b"layout=B")
    assert a.fingerprint != b.fingerprint != m.DEFAULT_CODEC.fingerprint
    assert Codec(b"layout=A").fingerprint == a.fingerprint  # deterministic
    msg = Cancel(transfer_id=3)
    assert a.decode(a.encode(msg)) == msg
    with pytest.raises(ProtocolError) as info:
        b.decode(a.encode(msg))
    assert info.value.reason == "fingerprint_mismatch"
    small = Codec(max_body_bytes=64)
    with pytest.raises(ValueError, match="cap"):
        small.encode(pull_request(block_hashes=list(range(100)), start=0, count=100))
    with pytest.raises(ProtocolError) as info:
        small.decode(encode(pull_request(block_hashes=list(range(100)), start=0, count=100)))
    assert info.value.reason == "too_large"
    with pytest.raises(TypeError):
        encode({"kind": "cancel"})  # type: ignore[arg-type]


def test_importing_messages_does_not_import_ucxx():
    code = ("import sys, kvkern, kvkern.xfer.messages, kvkern.xfer.ucx_env; "
            "assert 'ucxx' not in sys.modules, 'ucxx imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ucx_env_never_overrides_user():
    from kvkern.xfer.ucx_env import UCX_DEFAULTS, configure_ucx_env, ucx_tls_problem

    env = {"UCX_POSIX_ERROR_HANDLING": "n"}
    applied = configure_ucx_env(env)
    assert env["UCX_POSIX_ERROR_HANDLING"] == "n" and "UCX_POSIX_ERROR_HANDLING" not in applied
    assert env["UCX_SYSV_ERROR_HANDLING"] == "y" == env["UCX_CMA_MEMORY_INVALIDATE"]
    assert set(applied) == set(UCX_DEFAULTS) - {"UCX_POSIX_ERROR_HANDLING"}
    assert configure_ucx_env(env) == {}
    assert ucx_tls_problem({}) is None
    assert ucx_tls_problem({"UCX_TLS": "sm,tcp"}) is None
    assert ucx_tls_problem({"UCX_TLS": "^ib"}) is None
    assert "lacks tcp" in ucx_tls_problem({"UCX_TLS": "sm,cma"})
    assert "excludes tcp" in ucx_tls_problem({"UCX_TLS": "^tcp,ib"})


def test_read_contexts_keep_the_users_transports_but_tcp():
    """Contexts that hold or read memory for one-sided reads never use TCP, where UCX
    answers reads and writes in software at any address (kvkern.xfer.ucx_env.rma_tls)."""
    from kvkern.xfer.ucx_env import rma_tls

    for tls, want in [(None, "^tcp"), ("", "^tcp"), ("all", "^tcp"), ("sm,tcp,all", "^tcp"),
                      ("^ib", "^ib,tcp"), ("^tcp,ib", "^tcp,ib"), ("sm,cma,tcp,rc", "sm,cma,rc"),
                      ("tcp", None), ("TCP,sm", "sm")]:
        env = {} if tls is None else {"UCX_TLS": tls}
        assert rma_tls(env) == want, (tls, rma_tls(env))


def test_the_read_target_and_the_lanes_use_no_tcp():
    from kvkern.xfer import read_lanes, ucp_rma, ucxcompat

    if (why := ucp_rma.rma_unavailable()) is not None:
        pytest.skip(why)
    assert ucxcompat.read_target().context.config["TLS"] == "^tcp"
    assert read_lanes._lane_context().config["TLS"] == "^tcp"
    assert ucxcompat.read_target() is ucxcompat.read_target()
