"""Hint dialects: each decodes to one KvHint; ignored versions fall through; malformed hints
come back as named reasons; a fuzz over arbitrary JSON and bytes never raises."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkern.xfer.hints import (
    REASONS,
    HintLimits,
    HintRejected,
    KvHint,
    decode_hint,
    strip_hints,
)

U64 = (1 << 64) - 1
HASHES = [5756925433886871916, 13958166640625465031]


def router_hint(**kw):
    hint = {"source_control_endpoint": "tcp://10.0.0.7:5600", "block_hashes": HASHES, **kw}
    return {"model": "m", "extra_args": {"kv_transfer_params": {"router_hint": hint}}}


def kv_hints(actions, version="0.1", **kw):
    return {"kv_hints": {"protocol_version": version, "message_id": "msg-1", "actions": actions,
                         **kw}}


def fetch_action(payload=None, action_type="kv.fetch", action_version="1.0", action_id="a-1"):
    payload = payload if payload is not None else {
        "source_control_endpoint": "tcp://10.0.0.7:5600", "block_hashes": HASHES}
    return {"action_id": action_id, "action_type": action_type,
            "action_version": action_version, "payload": payload}


def kvkern_hint(**kw):
    return {"kv_hint": {"source": "10.0.0.5:8000", "block_hashes": HASHES, **kw}}


def rejected(result, reason):
    assert isinstance(result, HintRejected), result
    assert result.reason == reason, result
    assert not result.ok
    return result


# --------------------------------------------------------------------------------- dialects


def test_kvkern_dialect_full():
    body = kvkern_hint(
        version=1, hash_scheme="trtllm-v1", source_dp_rank=2, policy="best_effort",
        mode="move", no_retain=True, metadata_timeout_s=1.5, transfer_timeout_s=20,
        deadline_s=30.0, message_id="r1",
    )
    for form in (body, json.dumps(body), json.dumps(body).encode()):
        h = decode_hint(form)
        assert isinstance(h, KvHint) and h.ok
        assert h == KvHint(
            source="10.0.0.5:8000", block_hashes=tuple(HASHES), hash_scheme="trtllm-v1",
            dialect="kvkern", source_dp_rank=2, policy="best_effort", mode="move",
            no_retain=True, metadata_timeout_s=1.5, transfer_timeout_s=20.0, deadline_s=30.0,
            message_id="r1",
        )


def test_kvkern_defaults_and_local_hashes():
    h = decode_hint({"kv_hint": {"source": "http://src:8000/kvkern/v1/state"}})
    assert isinstance(h, KvHint)
    assert h.hashes_local and h.block_hashes is None and h.hash_scheme is None
    assert (h.policy, h.mode, h.no_retain) == ("strict", "copy", False)
    h2 = decode_hint(kvkern_hint(), limits=HintLimits(default_policy="best_effort"))
    assert h2.policy == "best_effort" and h2.hash_scheme == "public-xxh3-v1"


def test_timeouts_are_clamped_to_limits():
    limits = HintLimits(max_metadata_timeout_s=2.0, max_transfer_timeout_s=10.0,
                        max_deadline_s=20.0)
    h = decode_hint(kvkern_hint(metadata_timeout_s=100, transfer_timeout_s=5,
                                deadline_s=1e300), limits=limits)
    assert (h.metadata_timeout_s, h.transfer_timeout_s, h.deadline_s) == (2.0, 5.0, 20.0)
    assert h.clamped == ("metadata_timeout_s", "deadline_s")


def test_dynamo_router_hint():
    h = decode_hint(router_hint(mode="move", no_retain=True, future_field={"x": 1}))
    assert isinstance(h, KvHint)
    assert (h.dialect, h.source, h.block_hashes) == ("dynamo", "tcp://10.0.0.7:5600",
                                                     tuple(HASHES))
    assert (h.mode, h.no_retain, h.hash_scheme) == ("move", True, "engine")  # engine hashes
    # Also accepted at the top level.
    top = {"kv_transfer_params": router_hint()["extra_args"]["kv_transfer_params"]}
    assert decode_hint(top).dialect == "dynamo"


def test_kv_hints_envelope_skips_unknown_actions():
    body = kv_hints([
        fetch_action(action_type="kv.evict"),
        fetch_action(action_version="2.0"),
        fetch_action(action_id="the-one"),
        fetch_action(action_id="second", payload={"source_control_endpoint": "tcp://x:1",
                                                  "block_hashes": [1]}),
    ])
    h = decode_hint(body)
    assert isinstance(h, KvHint)
    assert (h.dialect, h.message_id, h.action_id) == ("kv_hints", "msg-1", "the-one")
    assert h.source == "tcp://10.0.0.7:5600" and h.block_hashes == tuple(HASHES)


def test_kv_hints_unknown_protocol_version_is_ignored():
    r = rejected(decode_hint(kv_hints([fetch_action()], version="0.2")), "no_hint")
    assert "protocol_version '0.2' not supported" in r.detail


def test_kv_hints_without_fetch_action_is_no_hint():
    r = rejected(decode_hint(kv_hints([fetch_action(action_type="kv.prefetch")])), "no_hint")
    assert "kv.prefetch@1.0" in r.detail


def test_ignored_dialect_falls_through_to_the_next():
    body = {**kv_hints([fetch_action()], version="9.9"), **router_hint()}
    assert decode_hint(body).dialect == "dynamo"
    body = {"kv_hint": {"version": 2, "source": "x"}, **router_hint()}
    assert decode_hint(body).dialect == "dynamo"


def test_malformed_higher_dialect_does_not_fall_through():
    body = {**kv_hints([fetch_action(payload={"source_control_endpoint": "tcp://a:1",
                                              "block_hashes": []})]), **router_hint()}
    r = rejected(decode_hint(body), "hint_invalid")
    assert r.dialect == "kv_hints" and "empty" in r.detail


def test_llmd_remote_kv_source():
    h = decode_hint({"kv_transfer_params": {"remote_kv_source": {"host": "10.1.2.3",
                                                                 "port": 8200}}})
    assert isinstance(h, KvHint)
    assert (h.dialect, h.source, h.hashes_local) == ("llm-d", "10.1.2.3:8200", True)
    h6 = decode_hint({"kv_transfer_params": {"remote_kv_source": {"host": "fd00::5",
                                                                  "port": 1}}})
    assert h6.source == "[fd00::5]:1"


def test_llmd_real_vllm_p2p_shape():
    """vLLM's P2P tier sends {kv_request_id, remote_host, remote_port} (what llm-d drives)."""
    h = decode_hint({"kv_transfer_params": {"remote_kv_source": {
        "kv_request_id": "cmpl-7", "remote_host": "10.1.2.3", "remote_port": 8200}}})
    assert isinstance(h, KvHint)
    assert (h.dialect, h.source, h.hashes_local, h.message_id) == (
        "llm-d", "10.1.2.3:8200", True, "cmpl-7")
    for bad in ({"remote_host": "h"}, {"remote_host": "h", "remote_port": 0},
                {"remote_host": "h", "remote_port": 1, "kv_request_id": "x" * 300},
                {"remote_host": "h", "remote_port": 1, "host": "g"}):
        got = decode_hint({"kv_transfer_params": {"remote_kv_source": bad}})
        assert got.reason == "hint_invalid", (bad, got)
    # llm-d's decode leg names its prefill worker the same way
    pre = decode_hint({"kv_transfer_params": {"remote_prefiller": {
        "kv_request_id": "pd-1", "remote_host": "10.1.2.4", "remote_port": 5710}}})
    assert (pre.dialect, pre.source, pre.hashes_local) == ("llm-d", "10.1.2.4:5710", True)
    # a field vLLM or llm-d may add is not ours to refuse
    more = decode_hint({"kv_transfer_params": {"remote_kv_source": {
        "remote_host": "h", "remote_port": 1, "remote_engine_id": "e"}}})
    assert more.ok and more.source == "h:1"


def test_dynamos_kv_hint_envelope_where_dynamo_puts_it():
    """Dynamo names its request's envelope field ``kv_hint`` (kvkern's own dialect's name)
    and its vLLM worker puts it in ``kv_transfer_params["kv_hint"]``: both decode as the
    envelope; kvkern's flat ``kv_hint`` (it has a ``source``) as before."""
    envelope = kv_hints([fetch_action()])["kv_hints"]
    for body in ({"token_ids": [1, 2], "kv_hint": envelope},
                 {"kv_transfer_params": {"kv_hint": envelope}},
                 {"extra_args": {"kv_transfer_params": {"kv_hint": envelope}}}):
        h = decode_hint(body)
        assert isinstance(h, KvHint), (body, h)
        assert (h.dialect, h.source, h.block_hashes, h.hash_scheme) == (
            "kv_hints", "tcp://10.0.0.7:5600", tuple(HASHES), "engine")
    assert decode_hint(kvkern_hint()).dialect == "kvkern"
    # a kv_hint of a later kvkern version stays ignored, whatever else it carries
    later = decode_hint({"kv_hint": dict(envelope, version=2)})
    assert later.reason == "no_hint" and "version 2" in later.detail
    bad = dict(envelope, actions=[fetch_action(payload={"source_control_endpoint": "x"})])
    assert decode_hint({"kv_hint": bad}).reason == "hint_invalid"
    assert decode_hint({"kv_transfer_params": {"kv_hint": {"x": 1}}}).reason == "no_hint"
    assert "kv_hint" not in strip_hints({"kv_transfer_params": {"kv_hint": envelope}})[
        "kv_transfer_params"]


def test_the_fetch_actions_earlier_name_is_read():
    h = decode_hint(kv_hints([fetch_action(action_type="kv.source_locations")]))
    assert isinstance(h, KvHint) and h.source == "tcp://10.0.0.7:5600"


def test_i64_hashes_normalised():
    h = decode_hint(router_hint(block_hashes=[-1, -(1 << 63), 0, U64]))
    assert h.block_hashes == (U64, 1 << 63, 0, U64)


def test_no_hint_and_null_locations():
    assert rejected(decode_hint({"model": "m", "prompt": "hi"}), "no_hint").detail
    rejected(decode_hint({"kv_hint": None, "kv_hints": None}), "no_hint")
    rejected(decode_hint({"kv_transfer_params": {"do_remote_prefill": True}}), "no_hint")
    rejected(decode_hint({"extra_args": "not a dict"}), "no_hint")


# ------------------------------------------------------------------------------ rejections

BAD = [
    pytest.param(kvkern_hint(block_hashes=[]), "hint_invalid", "empty", id="empty_hashes"),
    pytest.param(kvkern_hint(block_hashes=[True]), "hint_invalid", "bool", id="bool_hash"),
    pytest.param(kvkern_hint(block_hashes=[1.0]), "hint_invalid", "float", id="float_hash"),
    pytest.param(kvkern_hint(block_hashes=["1"]), "hint_invalid", "str", id="str_hash"),
    pytest.param(kvkern_hint(block_hashes=[1 << 64]), "hint_invalid", "outside u64",
                 id="hash_2_64"),
    pytest.param(kvkern_hint(block_hashes=[-(1 << 63) - 1]), "hint_invalid", "outside u64",
                 id="hash_below_i64"),
    pytest.param(kvkern_hint(block_hashes=7), "hint_invalid", "array", id="hashes_not_list"),
    pytest.param(kvkern_hint(block_hashes=list(range(65537))), "too_many_hashes", "65537",
                 id="too_many_hashes"),
    pytest.param(kvkern_hint(mode="steal"), "hint_invalid", "mode", id="bad_mode"),
    pytest.param(kvkern_hint(policy="yolo"), "hint_invalid", "policy", id="bad_policy"),
    pytest.param(kvkern_hint(no_retain="yes"), "hint_invalid", "no_retain", id="bad_no_retain"),
    pytest.param(kvkern_hint(no_retain=1), "hint_invalid", "no_retain", id="int_no_retain"),
    pytest.param(kvkern_hint(deadline_s=0), "hint_invalid", "deadline_s", id="zero_deadline"),
    pytest.param(kvkern_hint(deadline_s=-1.0), "hint_invalid", "deadline_s",
                 id="negative_deadline"),
    pytest.param(kvkern_hint(deadline_s=float("inf")), "hint_invalid", "deadline_s",
                 id="inf_deadline"),
    pytest.param(kvkern_hint(transfer_timeout_s="5"), "hint_invalid", "transfer_timeout_s",
                 id="str_timeout"),
    pytest.param(kvkern_hint(source_dp_rank=-1), "hint_invalid", "source_dp_rank",
                 id="negative_dp_rank"),
    pytest.param(kvkern_hint(source_dp_rank=True), "hint_invalid", "source_dp_rank",
                 id="bool_dp_rank"),
    pytest.param(kvkern_hint(unknown=1), "hint_invalid", "unknown field", id="unknown_field"),
    pytest.param(kvkern_hint(source=""), "hint_invalid", "empty", id="empty_source"),
    pytest.param(kvkern_hint(source="a b"), "hint_invalid", "printable", id="space_source"),
    pytest.param(kvkern_hint(source="x" * 3000), "hint_invalid", "3000", id="long_source"),
    pytest.param(kvkern_hint(source=5), "hint_invalid", "source", id="int_source"),
    pytest.param(kvkern_hint(hash_scheme="vllm-sha256"), "unknown_hash_scheme",
                 "public-xxh3-v1", id="unknown_scheme"),
    pytest.param({"kv_hint": {"source": "x", "hash_scheme": "trtllm-v1"}}, "hint_invalid",
                 "without block_hashes", id="scheme_without_hashes"),
    pytest.param({"kv_hint": "x"}, "hint_invalid", "object", id="kvkern_not_object"),
    pytest.param({"kv_hint": {"block_hashes": [1]}}, "hint_invalid", "source",
                 id="kvkern_missing_source"),
    pytest.param(router_hint(block_hashes=None), "hint_invalid", "block_hashes",
                 id="router_null_hashes"),
    pytest.param({"kv_transfer_params": {"router_hint": {"source_control_endpoint": "tcp://a:1"}}},
                 "hint_invalid", "required", id="router_missing_hashes"),
    pytest.param(router_hint(source_control_endpoint=None), "hint_invalid",
                 "source_control_endpoint", id="router_null_source"),
    pytest.param(router_hint(mode="copy", no_retain=None), "hint_invalid", "no_retain",
                 id="router_null_no_retain"),
    pytest.param({"kv_transfer_params": {"router_hint": [1]}}, "hint_invalid", "object",
                 id="router_not_object"),
    pytest.param(kv_hints([fetch_action()], version=1), "hint_invalid", "protocol_version",
                 id="envelope_int_version"),
    pytest.param(kv_hints("x"), "hint_invalid", "actions", id="envelope_actions_not_list"),
    pytest.param(kv_hints([5]), "hint_invalid", "actions[0]", id="envelope_action_not_object"),
    pytest.param(kv_hints([fetch_action(action_type=None)]), "hint_invalid", "action_type",
                 id="envelope_action_type_null"),
    pytest.param(kv_hints([fetch_action(payload="x")]), "hint_invalid", "payload",
                 id="envelope_payload_not_object"),
    pytest.param(kv_hints([fetch_action(action_id=3)]), "hint_invalid", "action_id",
                 id="envelope_action_id_int"),
    pytest.param(kv_hints([fetch_action()], message_id=[]), "hint_invalid", "message_id",
                 id="envelope_message_id_list"),
    pytest.param(kv_hints([fetch_action(action_type="kv.other")] * 65), "hint_invalid",
                 "65 actions", id="envelope_too_many_actions"),
    pytest.param({"kv_transfer_params": {"remote_kv_source": {"host": "h", "port": 0}}},
                 "hint_invalid", "port 0", id="llmd_port_0"),
    pytest.param({"kv_transfer_params": {"remote_kv_source": {"host": "h", "port": 70000}}},
                 "hint_invalid", "port", id="llmd_port_big"),
    pytest.param({"kv_transfer_params": {"remote_kv_source": {"host": "h", "port": "80"}}},
                 "hint_invalid", "port", id="llmd_port_str"),
    pytest.param({"kv_transfer_params": {"remote_kv_source": {"host": "u@h", "port": 80}}},
                 "hint_invalid", "bare host", id="llmd_userinfo"),
    pytest.param({"kv_transfer_params": {"remote_kv_source": {"port": 80}}}, "hint_invalid",
                 "host", id="llmd_missing_host"),
    pytest.param(b"{", "body_invalid", "not JSON", id="truncated_json"),
    pytest.param(b"\xff\xfe", "body_invalid", "not JSON", id="not_utf8"),
    pytest.param("[1, 2]", "body_invalid", "list", id="json_list"),
    pytest.param(b"null", "body_invalid", "NoneType", id="json_null"),
    pytest.param("\ud800", "body_invalid", "not JSON", id="lone_surrogate"),
    pytest.param(b"[" * 50000 + b"]" * 50000, "body_invalid", "not JSON", id="deep_nesting"),
    pytest.param(42, "body_invalid", "int", id="int_body"),
]


@pytest.mark.parametrize("body,reason,detail", BAD)
def test_malformed_hints_are_named(body, reason, detail):
    r = rejected(decode_hint(body), reason)
    assert detail in r.detail, r.detail


def test_body_too_large():
    limits = HintLimits(max_body_bytes=100)
    body = json.dumps(kvkern_hint(block_hashes=list(range(50))))
    rejected(decode_hint(body, limits=limits), "body_too_large")
    rejected(decode_hint(body.encode(), limits=limits), "body_too_large")


def test_hash_cap_is_configurable_and_checked_before_decoding():
    limits = HintLimits(max_hashes=4)
    assert decode_hint(router_hint(block_hashes=[1, 2, 3, 4]), limits=limits).ok
    rejected(decode_hint(router_hint(block_hashes=[object()] * 5), limits=limits),
             "too_many_hashes")


# ------------------------------------------------------------------------------------ fuzz

KEYS = ["kv_hint", "kv_hints", "extra_args", "kv_transfer_params", "router_hint",
        "remote_kv_source", "block_hashes", "source", "source_control_endpoint", "actions",
        "protocol_version", "action_type", "action_version", "payload", "host", "port", "mode",
        "no_retain", "version", "policy", "deadline_s", "hash_scheme", "source_dp_rank"]
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["0.1", "1.0", "kv.fetch", "copy", "move", "strict", "tcp://a:1",
                     "public-xxh3-v1", "", "h"]),
    st.text(max_size=8),
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=4)), inner,
                        max_size=6),
    ),
    max_leaves=30,
)


def check_outcome(result):
    assert isinstance(result, (KvHint, HintRejected)), result
    if isinstance(result, HintRejected):
        assert result.reason in REASONS, result
        return
    assert result.source and len(result.source) <= 2048
    if result.block_hashes is not None:
        assert 0 < len(result.block_hashes) <= 1 << 16
        assert all(type(h) is int and 0 <= h <= U64 for h in result.block_hashes)
    for t in (result.metadata_timeout_s, result.transfer_timeout_s, result.deadline_s):
        assert t is None or 0 < t <= 120.0
    assert result.policy in ("strict", "best_effort") and result.mode in ("copy", "move")
    assert type(result.no_retain) is bool


@given(JSONISH)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_arbitrary_json_objects(value):
    for body in ({"kv_hint": value}, {"kv_hints": value},
                 {"extra_args": {"kv_transfer_params": {"router_hint": value}}},
                 {"kv_transfer_params": {"remote_kv_source": value}},
                 {"kv_hints": {"protocol_version": "0.1", "actions": [value]}},
                 value if isinstance(value, dict) else {"x": value}):
        check_outcome(decode_hint(body))
        try:
            text = json.dumps(body, allow_nan=False)
        except (ValueError, TypeError):
            continue
        check_outcome(decode_hint(text))
        check_outcome(decode_hint(text.encode()))


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_fuzz_arbitrary_bytes(data):
    check_outcome(decode_hint(data))
    check_outcome(decode_hint(b'{"kv_hint": ' + data + b"}"))


@given(st.text(max_size=100))
@settings(max_examples=150, deadline=None)
def test_fuzz_arbitrary_text(text):
    check_outcome(decode_hint(text))
