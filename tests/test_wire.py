"""Wire types without a network: the state document both sides use, and the failure-code
tables (:mod:`kvkern.xfer.state`, :mod:`kvkern.xfer.codes`)."""

from __future__ import annotations

import msgspec
import pytest

from kvkern.xfer.codes import (
    RejectCode,
    fetch_reason,
    reject_reason,
    reply_text,
    transport_reason,
)
from kvkern.xfer.messages import MAX_TEXT
from kvkern.xfer.outcome import Reason
from kvkern.xfer.state import PROTOCOL, DpGroupDoc, RankDoc, StateDoc, parse_state


def _doc(**kw) -> StateDoc:
    from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology

    topo = Topology(model=ModelKVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4,
                                      dtype="float16"), parallel=Parallelism())
    fields = dict(protocol=PROTOCOL, worker_id="w", incarnation="i", hash_scheme="s",
                  block_size=4, codec_fingerprint=f"{7:016x}", topology=topo.to_dict(),
                  dp_groups={"0": DpGroupDoc(ranks={"0": RankDoc(
                      ucx_host="127.0.0.1", ucx_port=5000, read="canonical",
                      read_worker="abcd")})},
                  model="m", capabilities=["pull/1", "read/1"])
    fields.update(kw)
    return StateDoc(**fields)


def test_state_round_trips_through_json():
    st = parse_state(msgspec.json.encode(_doc()))
    assert st.ranks == {(0, 0): ("127.0.0.1", 5000)}
    assert st.reads == {(0, 0): "canonical"} and st.read_workers == {(0, 0): b"\xab\xcd"}
    assert st.codec_fingerprint == 7 and st.model == "m" and st.capabilities[-1] == "read/1"


def test_advisory_rank_fields_a_reader_does_not_know_mean_stream():
    body = msgspec.to_builtins(_doc())
    body["dp_groups"]["0"]["ranks"]["0"].update(read="telepathy", layout=[1], extra=1)
    st = parse_state(body)
    assert st.reads == {} and st.layouts == {} and st.ranks


@pytest.mark.parametrize("change,field", [
    ({"block_size": True}, "block_size"),
    ({"protocol": None}, "protocol"),
    ({"codec_fingerprint": "xyz"}, "codec_fingerprint"),
    ({"capabilities": "pull/1"}, "capabilities"),
])
def test_a_bad_field_is_a_value_error_naming_it(change, field):
    body = {**msgspec.to_builtins(_doc()), **change}
    with pytest.raises(ValueError, match=field):
        parse_state(body)


@pytest.mark.parametrize("body", [b"[" * 200_000, b"\xff{}", b"{", b"[1, 2]"],
                         ids=["deep", "not-utf8", "truncated", "array"])
def test_a_body_that_is_not_a_state_object_is_a_value_error(body):
    """parse_state raises ValueError only, whatever the bytes (nesting past Python's
    recursion limit included)."""
    with pytest.raises(ValueError, match="state is"):
        parse_state(body)


def test_a_rank_without_a_port_is_invalid():
    body = msgspec.to_builtins(_doc())
    body["dp_groups"]["0"]["ranks"]["0"]["ucx_port"] = None
    with pytest.raises(ValueError, match="dp_groups"):
        parse_state(body)


def test_reject_codes_map_to_reasons_by_code_not_by_text():
    assert reject_reason(reply_text(RejectCode.HASH_SCHEME_MISMATCH, "a != b")) \
        is Reason.HASH_SCHEME_MISMATCH
    assert reject_reason(reply_text(RejectCode.INCOMPATIBLE_MODEL, "x")) \
        is Reason.INCOMPATIBLE_MODEL
    assert reject_reason(reply_text(RejectCode.BAD_PIECE, "scheme")) is Reason.TRANSFER_FAILED
    assert reject_reason("nonsense") is Reason.TRANSFER_FAILED
    assert len(reply_text(RejectCode.INTERNAL, "x" * 1000)) == MAX_TEXT


def test_transport_and_fetch_failures_map_through_one_table():
    assert transport_reason("transfer_timeout") is Reason.TRANSFER_TIMEOUT
    assert transport_reason("auth_failed") is Reason.UNAUTHENTICATED
    assert transport_reason("peer_closed") is Reason.TRANSFER_FAILED
    assert transport_reason("new_kind") is Reason.TRANSFER_FAILED
    assert fetch_reason("metadata_timeout") is Reason.METADATA_TIMEOUT
    assert fetch_reason("unauthenticated") is Reason.UNAUTHENTICATED
    assert fetch_reason("redirect") is Reason.METADATA_FETCH_FAILED


def test_the_package_exports_what_users_need_lazily():
    import subprocess
    import sys

    import kvkern.xfer as xfer

    for name in xfer.__all__:
        assert getattr(xfer, name) is not None, name
    code = ("import sys, kvkern.xfer; print(sorted(m for m in ('msgspec', 'aiohttp', 'ucxx') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_the_ucxx_transport_implements_the_seam():
    from kvkern.xfer import seam
    from kvkern.xfer.transport import Connection, ConnectionPool

    for proto in (seam.TransferConnection, seam.Connector):
        impl = Connection if proto is seam.TransferConnection else ConnectionPool
        for name in proto.__protocol_attrs__ if hasattr(proto, "__protocol_attrs__") else ():
            if name != "codec":  # an instance attribute of the pool
                assert hasattr(impl, name), (impl.__name__, name)
    for name in ("alive", "send_msg", "recv_msg", "recv_stream"):
        assert hasattr(Connection, name), name
    # no reads on a connection: its worker's context has no RMA (ucxcompat.APP_FEATURES)
    assert not hasattr(Connection, "read_parts") and not hasattr(Connection, "read")
    assert hasattr(ConnectionPool, "get")
