"""Hostile input: hypothesis fuzzing of hint dialects (through ``decode_hint`` and a real
``Puller``), state responses (through the puller's state validation), control messages
(through the codec and the source's request validation) and block ids (into pack/unpack),
plus the SSRF corpus through the resolver and the puller.

Quick profile (default run): ``QUICK`` examples per target. Slow profile (``-m slow``):
``LONG`` (>= 10,000) examples per target. Nothing leaves 127.0.0.1: the puller's allowlist
admits only ``127.0.0.1:1`` (nothing listens there), names resolve through a fake DNS table,
and the state fuzz replaces the HTTP fetch with the fuzzed body.
"""

from __future__ import annotations

import importlib
import math
import struct
import time
from collections import Counter

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkern.cache.hashing import DEFAULT_SCHEME, HINT_SCHEME, local_block_hashes
from kvkern.cache.pool import BlockPool
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer.config import POLICIES, XferConfig
from kvkern.xfer.hints import REASONS, HintLimits, HintRejected, KvHint, decode_hint
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.messages import (
    DEFAULT_CODEC,
    MAGIC,
    PROTOCOL_VERSION,
    Cancel,
    PlanPiece,
    ProtocolError,
    PullRequest,
    Status,
    StreamReply,
)
from kvkern.xfer.outcome import Reason, RequestState
from kvkern.xfer.puller import Puller, parse_state
from kvkern.xfer.runtime import EventLoopThread
from tests.test_endpoint import ALLOW as SSRF_ALLOW
from tests.test_endpoint import CONFIG as SSRF_CONFIG
from tests.test_endpoint import HOSTILE, FakeDNS, verdict

pytestmark = pytest.mark.timeout(900)

# kvkern.kernels re-exports the function `pack`, shadowing the submodule's attribute name.
pack_mod = importlib.import_module("kvkern.kernels.pack")

QUICK = 150
LONG = 10_000
BS = 4
MODEL = ModelKVSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=BS, dtype="float16")
TOKENS = list(range(100, 100 + 6 * BS + 2))  # 6 full blocks and a partial one
GOOD_HASHES = local_block_hashes(TOKENS, BS, HINT_SCHEME)  # (a hint's, named by no scheme)
DEAD = "127.0.0.1:1"  # the only allowed endpoint; nothing listens there


def _settings(n: int):
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def make_group(num_blocks: int = 32) -> KVGroup:
    topo = Topology(model=MODEL, parallel=Parallelism())
    pool = BlockPool(num_blocks, block_size=BS)
    lay = topo.local_layout(0, num_blocks, "trtllm")
    gen = torch.Generator().manual_seed(3)
    return KVGroup(topo, 0, pool, {0: RankKV(0, lay, lay.allocate(fill="random",
                                                                  generator=gen))})


def assert_clean(group: KVGroup) -> None:
    st_ = group.manager.stats()
    leaks = {k: st_[k] for k in ("pinned", "pins", "leased", "leases", "private",
                                 "referenced") if st_[k]}
    assert not leaks and st_["free"] == st_["blocks"], st_
    group.manager.check_invariants()


@pytest.fixture(scope="module")
def loop():
    lt = EventLoopThread("test-hostile")
    try:
        yield lt
    finally:
        lt.close()


# ------------------------------------------------------------------------- strategies

leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24))
json_val = st.recursive(leaf, lambda ch: st.lists(ch, max_size=4)
                        | st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=10)
sources = st.one_of(
    st.sampled_from([DEAD, f"http://{DEAD}", f"http://{DEAD}/kvkern/v1/state",
                     "tcp://127.0.0.1:1", "localhost:1", "evil.example:8000", "[::1]:1",
                     "http://169.254.169.254/", "http://user@127.0.0.1:1/", "",
                     "127.0.0.1:1/admin", "http://0x7f.1:1"]),
    st.sampled_from([e for e, _ in HOSTILE]), st.text(max_size=40), leaf)
a_hash = st.one_of(st.sampled_from(GOOD_HASHES), st.integers(-(2**64), 2**65), leaf)
hashes = st.one_of(st.just(GOOD_HASHES), st.just(GOOD_HASHES[:3]),
                   st.lists(a_hash, max_size=10), json_val)
number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**6), leaf)
kvkern_hint = st.fixed_dictionaries({"source": sources}, optional={
    "version": st.one_of(st.just(1), st.just(2), leaf), "block_hashes": hashes,
    "hash_scheme": st.one_of(st.sampled_from(["public-xxh3-v1", "trtllm-v1", "md5"]), leaf),
    "source_dp_rank": st.one_of(st.integers(-2, 3), leaf),
    "policy": st.one_of(st.sampled_from(POLICIES), leaf),
    "mode": st.one_of(st.sampled_from(["copy", "move", "steal"]), leaf),
    "no_retain": leaf, "metadata_timeout_s": number, "transfer_timeout_s": number,
    "deadline_s": number, "message_id": leaf, "surprise": leaf})
fetch_action = st.fixed_dictionaries({
    "action_type": st.one_of(st.just("kv.fetch"), leaf),
    "action_version": st.one_of(st.sampled_from(["1.0", "2.0"]), leaf),
    "payload": st.one_of(st.fixed_dictionaries(
        {"source_control_endpoint": sources},
        optional={"block_hashes": hashes, "mode": leaf, "no_retain": leaf,
                  "source_dp_rank": leaf}), json_val)},
    optional={"action_id": leaf})
kv_hints = st.fixed_dictionaries({
    "protocol_version": st.one_of(st.sampled_from(["0.1", "0.2"]), leaf),
    "actions": st.one_of(st.lists(fetch_action, max_size=3), json_val)},
    optional={"message_id": leaf})
router_hint = st.fixed_dictionaries({"source_control_endpoint": sources},
                                    optional={"block_hashes": hashes, "source_dp_rank": leaf})
remote = st.fixed_dictionaries({"host": st.one_of(st.sampled_from(
    ["127.0.0.1", "localhost", "169.254.169.254", "::1", ""]), leaf),
    "port": st.one_of(st.integers(-1, 70000), leaf)})
dialect_body = st.one_of(
    st.builds(lambda h: {"kv_hint": h}, st.one_of(kvkern_hint, json_val)),
    st.builds(lambda h: {"kv_hints": h}, st.one_of(kv_hints, json_val)),
    st.builds(lambda h: {"kv_transfer_params": {"router_hint": h}},
              st.one_of(router_hint, json_val)),
    st.builds(lambda h: {"kv_transfer_params": {"remote_kv_source": h}},
              st.one_of(remote, json_val)),
    st.builds(lambda h: {"kv_transfer_params": h}, json_val))
bodies = st.one_of(
    dialect_body,
    st.builds(lambda b: {"extra_args": b}, dialect_body),
    st.builds(lambda a, b: {**a, **b}, dialect_body, dialect_body),
    st.dictionaries(st.sampled_from(["kv_hint", "kv_hints", "kv_transfer_params",
                                     "extra_args", "prompt"]), json_val, max_size=3))
raw_bodies = st.one_of(st.binary(max_size=256),
                       st.builds(lambda b: msgspec.json.encode(b), bodies),
                       st.text(max_size=64))


# ---------------------------------------------------------------------- hint dialects


def _check_hint(res, limits: HintLimits) -> None:
    assert isinstance(res, (KvHint, HintRejected)), type(res)
    if isinstance(res, HintRejected):
        assert res.reason in REASONS, res
        return
    assert isinstance(res.source, str) and res.source
    assert res.policy in POLICIES
    if res.block_hashes is not None:
        assert 0 < len(res.block_hashes) <= limits.max_hashes
        assert all(type(h) is int and 0 <= h < 2**64 for h in res.block_hashes)
    for name, cap in (("metadata_timeout_s", limits.max_metadata_timeout_s),
                      ("transfer_timeout_s", limits.max_transfer_timeout_s),
                      ("deadline_s", limits.max_deadline_s)):
        v = getattr(res, name)
        assert v is None or (math.isfinite(v) and 0 < v <= cap), (name, v)
    assert res.source_dp_rank is None or (type(res.source_dp_rank) is int
                                          and res.source_dp_rank >= 0)


def run_hint_fuzz(loop, record, case: str, n: int) -> None:
    group = make_group()
    puller = Puller(group, config=XferConfig(allowlist=DEAD, metadata_timeout_s=0.5,
                                             transfer_timeout_s=0.5, deadline_s=1.0,
                                             cost_guard=False),
                    loop=loop, resolver=FakeDNS())
    limits = HintLimits()
    counts: Counter = Counter()
    t0 = time.perf_counter()

    @_settings(n)
    @given(body=bodies, raw=raw_bodies)
    def fuzz(body, raw):
        counts["inputs"] += 2
        _check_hint(decode_hint(body, limits=limits), limits)
        _check_hint(decode_hint(raw, limits=limits), limits)
        rid = f"h{counts['inputs']}"
        puller.submit(rid, TOKENS, body)
        o = puller.result(rid, 10)
        counts[o.reason.value] += 1
        assert o.reason is not Reason.INTERNAL_ERROR, o
        assert not o.used or o.reason in (Reason.OK, Reason.PARTIAL)
        if o.used:
            puller.release(rid)
        assert puller.state(rid) is RequestState.CONTEXT_INIT

    try:
        fuzz()
        assert_clean(group)
        assert puller.inflight == 0
    finally:
        puller.close()
        record("hostile", case, target="hint dialects -> decode_hint + Puller.submit",
               inputs_tried=counts.pop("inputs", 0), examples=n,
               seconds=round(time.perf_counter() - t0, 2), reasons=dict(counts),
               internal_errors=counts.get("internal_error", 0), leaks=0)


def test_hint_fuzz_quick(loop, record):
    run_hint_fuzz(loop, record, "hint_dialects_quick", QUICK)


@pytest.mark.slow
def test_hint_fuzz_long(loop, record):
    run_hint_fuzz(loop, record, "hint_dialects_long", LONG)


# ---------------------------------------------------------------------- state responses


def _good_state() -> dict:
    topo = Topology(model=MODEL, parallel=Parallelism())
    return {"protocol": "kvkern/1", "worker_id": "w", "incarnation": "i1",
            "hash_scheme": DEFAULT_SCHEME, "block_size": BS,
            "codec_fingerprint": f"{DEFAULT_CODEC.fingerprint:016x}",
            "topology": topo.to_dict(),
            "dp_groups": {"0": {"ranks": {"0": {"ucx_host": "127.0.0.1", "ucx_port": 2}}}},
            "capabilities": ["pull/1", "strict", "best_effort", "sharded"]}


def _mutate(d, path, value, delete):
    if not path or not isinstance(d, dict) or not d:
        return value
    d = dict(d)
    key = sorted(d, key=str)[path[0] % len(d)]
    if delete and len(path) == 1:
        del d[key]
    else:
        d[key] = _mutate(d[key], path[1:], value, delete)
    return d


_FIELD_VALUES = {
    "protocol": st.sampled_from(["kvkern/1", "kvkern/2", ""]),
    "hash_scheme": st.sampled_from(["public-xxh3-v1", "trtllm-v1", "nope"]),
    "block_size": st.integers(-2, 64), "codec_fingerprint": st.text("0123456789abcdefx", max_size=18),
    "capabilities": st.lists(st.sampled_from(["pull/1", "strict", "x"]), max_size=3),
    "topology": st.builds(lambda k, v: {**_good_state()["topology"], k: v},
                          st.sampled_from(["model", "parallel", "x"]), json_val),
    "dp_groups": st.builds(lambda dp, r, host, port: {dp: {"ranks": {r: {
        "ucx_host": host, "ucx_port": port}}}}, st.sampled_from(["0", "1", "-1", "x"]),
        st.sampled_from(["0", "1", "7", "x"]),
        st.sampled_from(["127.0.0.1", "10.9.9.9", "localhost", "::1", "0x7f.1", ""]),
        st.one_of(st.integers(-1, 70000), st.just(1), leaf)),
}
one_field = st.sampled_from(sorted(_FIELD_VALUES)).flatmap(
    lambda k: _FIELD_VALUES[k].map(lambda v, k=k: {**_good_state(), k: v}))
state_bodies = st.one_of(
    st.builds(_good_state), one_field, one_field,
    st.builds(lambda muts: _apply(muts), st.lists(
        st.tuples(st.lists(st.integers(0, 20), min_size=1, max_size=4), json_val,
                  st.booleans()), min_size=1, max_size=4)),
    st.builds(lambda v: {**_good_state(), "topology": v}, json_val),
    st.builds(lambda v: {**_good_state(), "dp_groups": v}, json_val),
    st.binary(max_size=200), json_val)


def _apply(muts) -> dict:
    d = _good_state()
    for path, value, delete in muts:
        d = _mutate(d, path, value, delete)
    return d


def run_state_fuzz(loop, record, monkeypatch, case: str, n: int) -> None:
    import kvkern.xfer.endpoint as endpoint_mod

    current: dict = {}

    async def fake_fetch(resolved, *, timeout_s, max_bytes, headers=None, credential=None):
        return current["body"]

    monkeypatch.setattr(endpoint_mod, "fetch_state", fake_fetch)
    group = make_group()
    puller = Puller(group, config=XferConfig(allowlist=DEAD, transfer_timeout_s=0.5,
                                             deadline_s=1.0, cost_guard=False),
                    loop=loop, resolver=FakeDNS())
    counts: Counter = Counter()
    t0 = time.perf_counter()

    @_settings(n)
    @given(body=state_bodies)
    def fuzz(body):
        counts["inputs"] += 1
        raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
        try:
            parse_state(raw)
            counts["parsed"] += 1
        except ValueError:
            pass  # the only error parse_state may raise
        current["body"] = raw
        rid = f"s{counts['inputs']}"
        hint = {"kv_hint": {"source": f"http://{DEAD}/kvkern/v1/state?n={rid}",
                            "block_hashes": GOOD_HASHES}}
        puller.submit(rid, TOKENS, hint)
        o = puller.result(rid, 10)
        counts[o.reason.value] += 1
        assert o.reason is not Reason.INTERNAL_ERROR, o
        assert not o.used, o

    try:
        fuzz()
        assert_clean(group)
    finally:
        puller.close()
        record("hostile", case, target="state responses -> parse_state + Puller state checks",
               inputs_tried=counts.pop("inputs", 0), examples=n,
               seconds=round(time.perf_counter() - t0, 2), reasons=dict(counts),
               internal_errors=counts.get("internal_error", 0), leaks=0)


def test_state_fuzz_quick(loop, record, monkeypatch):
    run_state_fuzz(loop, record, monkeypatch, "state_responses_quick", QUICK)


@pytest.mark.slow
def test_state_fuzz_long(loop, record, monkeypatch):
    run_state_fuzz(loop, record, monkeypatch, "state_responses_long", LONG)


# ---------------------------------------------------------------------- control messages

u64 = st.integers(0, 2**64 - 1)
# msgpack carries integers in [-2**63, 2**64): the wire cannot hold bigger ones.
mp_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24),
                    st.binary(max_size=16))
mp_val = st.recursive(mp_leaf, lambda ch: st.lists(ch, max_size=4)
                      | st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=10)
pieces = st.lists(st.builds(
    lambda r, l0, dl, h0, dh, off, ln: {"src_rank": r, "layer_start": l0,
                                        "layer_stop": l0 + dl, "head_start": h0,
                                        "head_stop": h0 + dh, "offset": off, "length": ln},
    st.integers(0, 2), st.integers(0, 3), st.integers(-1, 3), st.integers(0, 5),
    st.integers(-1, 5), st.integers(-1, 1 << 14), st.integers(-1, 1 << 14)), max_size=4)
request_maps = st.fixed_dictionaries({
    "kind": st.one_of(st.sampled_from(["pull_request", "stream_reply", "read_grant", "refusal",
                                       "cancel", "x"]), mp_leaf),
    "transfer_id": st.one_of(st.integers(-1, 2**31), mp_leaf),
    "request_id": st.one_of(st.text(max_size=300), mp_leaf),
    "hash_scheme": st.one_of(st.sampled_from(["public-xxh3-v1", "trtllm-v1"]), mp_leaf),
    "block_hashes": st.one_of(st.lists(st.one_of(u64, st.integers(-5, -1)), max_size=8), mp_leaf),
    "start": st.one_of(st.integers(-1, 10), mp_leaf), "count": st.one_of(st.integers(-1, 10), mp_leaf),
    "pieces": st.one_of(pieces, mp_leaf), "chunk_bytes": st.one_of(st.integers(-1, 2**35), mp_leaf),
    "deadline_ms": st.one_of(st.integers(-1, 10**9), mp_leaf)},
    optional={"status": st.one_of(st.sampled_from([s.value for s in Status]), mp_leaf),
              "served_blocks": st.integers(-1, 10), "n_chunks": st.integers(-1, 10),
              "chunk_sizes": st.lists(st.integers(-1, 1 << 20), max_size=4),
              "total_bytes": st.integers(-1, 1 << 22), "reason": mp_leaf, "extra": mp_leaf})


def _frame(body: bytes, *, magic=MAGIC, version=PROTOCOL_VERSION, flags=0, fp=None,
           length=None) -> bytes:
    fp = DEFAULT_CODEC.fingerprint if fp is None else fp
    n = len(body) if length is None else length
    return struct.pack("<4sHHQI", magic, version, flags, fp, n) + body


def _valid_frames() -> list[bytes]:
    req = PullRequest(transfer_id=5, request_id="r", hash_scheme="public-xxh3-v1",
                      block_hashes=GOOD_HASHES, start=1, count=4,
                      pieces=[PlanPiece(src_rank=0, layer_start=0, layer_stop=2, head_start=0,
                                        head_stop=4, offset=0, length=2048)],
                      chunk_bytes=1 << 20, deadline_ms=1000)
    rep = StreamReply(transfer_id=5, status=Status.OK, served_blocks=1,
                      block_hashes=[GOOD_HASHES[1]], total_bytes=2048, n_chunks=1,
                      chunk_sizes=[2048])
    return [DEFAULT_CODEC.encode(m) for m in (req, rep, Cancel(transfer_id=5, reason="x"))]


frames = st.one_of(
    st.binary(max_size=120),
    st.builds(lambda m: _frame(msgspec.msgpack.encode(m)), request_maps),
    st.builds(lambda m: _frame(msgspec.msgpack.encode(m)), mp_val),
    st.builds(lambda i, pos, bit: _flip(_valid_frames()[i], pos, bit), st.integers(0, 2),
              st.integers(0, 10_000), st.integers(0, 7)),
    st.builds(lambda i, cut: _valid_frames()[i][:cut], st.integers(0, 2), st.integers(0, 200)),
    st.builds(lambda i, extra: _valid_frames()[i] + extra, st.integers(0, 2),
              st.binary(min_size=1, max_size=8)),
    st.builds(lambda b, ver, flags, fp, ln: _frame(b, version=ver, flags=flags, fp=fp,
                                                   length=ln),
              st.binary(max_size=40), st.integers(0, 3), st.integers(0, 2),
              st.one_of(st.none(), u64), st.one_of(st.none(), st.integers(0, 2**32 - 1))))


def _flip(frame: bytes, pos: int, bit: int) -> bytes:
    b = bytearray(frame)
    b[pos % len(b)] ^= 1 << bit
    return bytes(b)


def run_codec_fuzz(record, case: str, n: int) -> None:
    from kvkern.xfer.send import RankCtx, Rejected, validate_request
    from kvkern.xfer.source import SourceService

    group = make_group()
    service = SourceService([group], worker_id="fuzz")
    ctx = RankCtx(group, group.ranks[0])
    lay = group.ranks[0].layout
    counts: Counter = Counter()
    t0 = time.perf_counter()

    @_settings(n)
    @given(frame=frames)
    def fuzz(frame):
        counts["inputs"] += 1
        try:
            msg = DEFAULT_CODEC.decode(frame)
        except ProtocolError as exc:
            counts[f"refused_{exc.reason}"] += 1
            return
        counts[f"decoded_{type(msg).__name__}"] += 1
        assert DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(msg)) == msg  # round trip
        if isinstance(msg, PullRequest):  # the source's request validation
            try:
                valid = validate_request(ctx, msg, model_id=service.model_id,
                                         chunk_bytes=service.config.chunk_bytes)
            except Exception as exc:  # noqa: BLE001 (only Rejected is allowed)
                assert isinstance(exc, Rejected), repr(exc)
                counts["request_rejected"] += 1
                return
            counts["request_valid"] += 1
            for p in valid:  # ranges that passed validation are safe to pack
                assert p.layer_stop <= lay.num_layers and p.head_stop <= lay.num_heads
                pack_mod.pack(group.ranks[0].pool, lay, [0],
                              layers=(p.layer_start, p.layer_stop),
                              heads=(p.head_start, p.head_stop))

    try:
        fuzz()
    finally:
        record("hostile", case, target="control frames -> Codec.decode + source validation",
               inputs_tried=counts.pop("inputs", 0), examples=n,
               seconds=round(time.perf_counter() - t0, 2), reasons=dict(counts), leaks=0)


def test_codec_fuzz_quick(record):
    run_codec_fuzz(record, "control_messages_quick", QUICK * 2)


@pytest.mark.slow
def test_codec_fuzz_long(record):
    run_codec_fuzz(record, "control_messages_long", LONG)


# ---------------------------------------------------------------------- ids into kernels

NB = 8
id_items = st.one_of(st.integers(-3, NB + 3), st.integers(-(2**70), 2**70), st.booleans(),
                     st.floats(allow_nan=True), st.text(max_size=3), st.none())
id_inputs = st.one_of(
    st.lists(st.integers(-2, NB - 1), max_size=6),  # mostly valid
    st.lists(id_items, max_size=6),
    st.builds(lambda v, dt: torch.tensor(v, dtype=dt),
              st.lists(st.integers(-3, NB + 3), max_size=6),
              st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32,
                               torch.bool])),
    st.builds(lambda v: torch.tensor(v, dtype=torch.int64).reshape(-1, 1),
              st.lists(st.integers(0, NB - 1), min_size=1, max_size=4)))


def _expected_valid(ids, unique: bool) -> bool:
    if isinstance(ids, torch.Tensor):
        if ids.dtype in (torch.float32, torch.bool) or ids.dim() != 1:
            return False
        vals = ids.tolist()
    else:
        if any(type(v) is not int for v in ids):
            return False
        vals = ids
    if any(v >= NB or v < -(2**63) for v in vals):
        return False
    nonneg = [v for v in vals if v >= 0]
    return not unique or len(nonneg) == len(set(nonneg))


def run_ids_fuzz(record, monkeypatch, case: str, n: int) -> None:

    lay = Topology(model=MODEL, parallel=Parallelism()).local_layout(0, NB, "trtllm")
    pool = lay.allocate(fill="random", generator=torch.Generator().manual_seed(1))
    reached: list = []
    real_copy = pack_mod._torch_copy

    def spy(tensors, layout, ids, staging, *args, **kw):
        reached.append(ids.clone())
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert ids.numel() == 0 or int(ids.max()) < layout.num_blocks, ids
        return real_copy(tensors, layout, ids, staging, *args, **kw)

    monkeypatch.setattr(pack_mod, "_torch_copy", spy)
    counts: Counter = Counter()
    t0 = time.perf_counter()

    @_settings(n)
    @given(ids=id_inputs, op=st.sampled_from(["pack", "unpack"]))
    def fuzz(ids, op):
        counts["inputs"] += 1
        valid = _expected_valid(ids, unique=op == "unpack")
        before = len(reached)
        try:
            if op == "pack":
                out = pack_mod.pack(pool, lay, ids)
                k = out.shape[0]
            else:
                k = len(ids)
                target = pool.clone()
                staging = torch.zeros((k, lay.num_layers, 2, lay.num_heads, lay.block_size,
                                       lay.head_dim), dtype=lay.dtype)
                pack_mod.unpack(staging, target, lay, ids)
        except (ValueError, TypeError) as exc:
            assert not valid, f"valid ids {ids!r} refused: {exc}"
            assert len(reached) == before, "malformed ids reached the kernel"
            counts["refused"] += 1
            return
        assert valid, f"malformed ids {ids!r} accepted"
        assert k == (ids.numel() if isinstance(ids, torch.Tensor) else len(ids))
        counts["accepted"] += 1

    try:
        fuzz()
        counts["kernel_calls"] = len(reached)
    finally:
        record("hostile", case, target="block ids -> pack/unpack (kernel reached only by "
               "valid ids)", inputs_tried=counts.pop("inputs", 0), examples=n,
               seconds=round(time.perf_counter() - t0, 2), reasons=dict(counts), leaks=0)


def test_ids_fuzz_quick(record, monkeypatch):
    run_ids_fuzz(record, monkeypatch, "kernel_ids_quick", QUICK * 2)


@pytest.mark.slow
def test_ids_fuzz_long(record, monkeypatch):
    run_ids_fuzz(record, monkeypatch, "kernel_ids_long", LONG)


# ---------------------------------------------------------------------- SSRF corpus


def test_ssrf_corpus(loop, record, monkeypatch):
    """Every corpus endpoint is refused by the resolver with its named reason, and as a hint
    to a real puller ends as source_not_allowed / hint_invalid without any state fetch."""
    import kvkern.xfer.endpoint as endpoint_mod

    fetched: list = []

    async def no_fetch(resolved, **kw):
        fetched.append(resolved)
        raise AssertionError(f"fetched {resolved}")

    monkeypatch.setattr(endpoint_mod, "fetch_state", no_fetch)
    refused = Counter()
    for endpoint, reason in HOSTILE:
        v = verdict(endpoint)
        assert not v.allowed and v.reason == reason, (endpoint, v)
        refused[reason] += 1
    group = make_group()
    puller = Puller(group, config=XferConfig(allowlist=SSRF_ALLOW, state_port_offset=1000,
                                             cost_guard=False),
                    loop=loop, resolver=FakeDNS())
    outcomes = Counter()
    try:
        for i, (endpoint, _) in enumerate(HOSTILE):
            for body in ({"kv_hint": {"source": endpoint}},
                         {"kv_hint": {"source": endpoint, "block_hashes": GOOD_HASHES}}):
                rid = f"ssrf{i}-{len(body['kv_hint'])}"
                puller.submit(rid, TOKENS, body)
                o = puller.result(rid, 10)
                outcomes[o.reason.value] += 1
                assert o.reason in (Reason.SOURCE_NOT_ALLOWED, Reason.HINT_INVALID), (endpoint, o)
        assert not fetched
        assert_clean(group)
    finally:
        puller.close()
        record("hostile", "ssrf_corpus", target="SSRF corpus -> resolver and Puller",
               inputs_tried=len(HOSTILE) * 3, examples=len(HOSTILE),
               reasons={**{f"resolver_{k}": v for k, v in refused.items()},
                        **{f"puller_{k}": v for k, v in outcomes.items()}},
               state_fetches=len(fetched), leaks=0, config=str(SSRF_CONFIG))


def test_state_with_null_model_is_metadata_invalid(loop, monkeypatch):
    """Regression (found by the long state fuzz): ``"topology": {"model": null, ...}`` made
    parse_state raise AttributeError, which the puller reported as internal_error."""
    import kvkern.xfer.endpoint as endpoint_mod

    body = {**_good_state(), "topology": {**_good_state()["topology"], "model": None}}
    with pytest.raises(ValueError, match="topology invalid"):
        parse_state(msgspec.json.encode(body))

    async def fake_fetch(resolved, **kw):
        return msgspec.json.encode(body)

    monkeypatch.setattr(endpoint_mod, "fetch_state", fake_fetch)
    group = make_group()
    puller = Puller(group, config=XferConfig(allowlist=DEAD, cost_guard=False), loop=loop,
                    resolver=FakeDNS())
    try:
        puller.submit("null-model", TOKENS, {"kv_hint": {
            "source": f"http://{DEAD}/kvkern/v1/state", "block_hashes": GOOD_HASHES}})
        assert puller.result("null-model", 10).reason is Reason.METADATA_INVALID
        assert_clean(group)
    finally:
        puller.close()
