"""Control messages: round trips, strict rejection with typed reasons, and no ucxx import."""

from __future__ import annotations

import subprocess
import sys

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
    Codec,
    PlanPiece,
    ProtocolError,
    PullReply,
    PullRequest,
    Status,
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
    PullReply(transfer_id=9, status=Status.OK, served_blocks=2, block_hashes=[3, 4],
              total_bytes=150, n_chunks=2, chunk_sizes=[100, 50]),
    PullReply(transfer_id=9, status=Status.MISS, reason="evicted"),
    PullReply(transfer_id=1, status=Status.OK),
    Cancel(transfer_id=2**30 - 1, reason="deadline"),
], ids=["request", "reply-ok", "reply-miss", "reply-empty", "cancel"])
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
                       request_id=data.draw(st.text(max_size=40)))
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


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["kind", "transfer_id", "status", "reason", "start",
                                        "count", "pieces", "block_hashes", "chunk_sizes"]),
                       st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                                 st.sampled_from(["pull_request", "pull_reply", "cancel"]),
                                 st.lists(st.integers(-5, 5), max_size=3)), max_size=9))
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
    (frame({"kind": "pull_reply", "transfer_id": 1, "status": "maybe"}), "invalid"),
    (frame({"kind": "pull_reply", "transfer_id": 1, "status": "ok", "n_chunks": 2,
            "chunk_sizes": [1]}), "invalid"),
    (frame({"kind": "pull_reply", "transfer_id": 1, "status": "ok", "total_bytes": 3,
            "n_chunks": 1, "chunk_sizes": [2]}), "invalid"),
    (frame({"kind": "pull_reply", "transfer_id": 1, "status": "miss", "n_chunks": 1,
            "total_bytes": 1, "chunk_sizes": [1]}), "invalid"),
    (frame({"kind": "pull_reply", "transfer_id": 1, "status": "ok", "served_blocks": 1,
            "block_hashes": [-1]}), "invalid"),
    (frame(msgspec.msgpack.encode([1, 2, 3])), "invalid"),
    (frame(b"\xc1"), "invalid"),
], ids=["empty", "short-preamble", "magic", "newer-version", "version-0", "flags",
        "fingerprint", "too-large", "trailing-byte", "missing-byte", "unknown-kind",
        "no-kind", "unknown-field", "tid-0", "tid-too-big", "tid-str", "bad-status",
        "chunk-count", "chunk-sum", "miss-with-data", "negative-hash", "array-body",
        "bad-msgpack"])
def test_rejections(data, reason):
    assert reason_of(data) == reason


@pytest.mark.parametrize("kw,match", [
    (dict(start=3, count=2), "exceeds"),
    (dict(pieces=[piece(0, 100), piece(50, 10)]), "overlaps"),
    (dict(pieces=[PIECE | {"layer_start": 3, "layer_stop": 3}]), "layer range"),
    (dict(pieces=[PIECE | {"head_start": 5, "head_stop": 4}]), "head range"),
], ids=["range-past-hashes", "overlapping-pieces", "empty-layers", "reversed-heads"])
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


def test_list_caps():
    body = {"kind": "pull_reply", "transfer_id": 1, "status": "ok",
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
