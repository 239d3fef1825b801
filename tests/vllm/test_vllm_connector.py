"""kvkern inside real vLLM engines: engine ``b`` pulls hinted prefixes from engines ``a`` and
``c`` through :class:`kvkern.integrations.vllm.KvkernConnector`, in separate processes.

"Bit-identical" is checked against the source engine's own prefix-cache continuation of the
same prompt: its first token's logprobs, compared as exact floats, and the greedy tokens."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from kvkern.cache.hashing import vllm_block_digests, vllm_u64
from kvkern.xfer.auth import sign_hint
from kvkern.xfer.hints import KvHint, decode_hint
from tests.fleet import CREDENTIAL

pytestmark = pytest.mark.vllm

BS = 32
FULL = 4  # full blocks per prompt (the pulled prefix), then a partial block


def prompt(seed: int, blocks: int = FULL, extra: int = 5) -> list[int]:
    return [(seed * 7919 + i * 31 + i * i) % 990 + 5 for i in range(blocks * BS + extra)]


def engine_hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    """vLLM's own block hashes as Dynamo publishes them (low 64 bits)."""
    return [vllm_u64(d) for d in vllm_block_digests(tokens, BS, cache_salt=salt)]


def source_of(engine) -> str:
    return f"127.0.0.1:{engine.port}"


def hint_params(dialect: str, engine, tokens: list[int]) -> tuple[dict, dict | None]:
    """(kv_transfer_params, Request.kv_hints) naming ``engine`` as the source, in
    ``dialect``."""
    src = source_of(engine)
    fetch = {"source_control_endpoint": f"tcp://{src}",
             "block_hashes": engine_hashes(tokens)[:FULL]}
    envelope = {"protocol_version": "0.1", "message_id": "m-1",
                "actions": [{"action_id": "0", "action_type": "kv.fetch",
                             "action_version": "1.0", "payload": fetch}]}
    if dialect == "kv_hint":
        return {"kv_hint": {"source": src}}, None
    if dialect == "kv_hints":
        return {"kv_hints": envelope}, None
    if dialect == "dynamo.kv_hint":  # where Dynamo's vLLM worker puts its request's envelope
        return {"kv_hint": envelope}, None
    if dialect == "request.kv_hints":
        return {}, envelope
    if dialect == "router_hint":
        return {"router_hint": fetch}, None
    if dialect == "remote_kv_source":
        return {"remote_kv_source": {"kv_request_id": "p2p-1", "remote_host": "127.0.0.1",
                                     "remote_port": engine.port}}, None
    raise ValueError(dialect)


def request(rid: str, tokens: list[int], params: dict | None = None,
            envelope: dict | None = None, *, sign: bool = True, salt: str = "",
            max_tokens: int = 4) -> dict:
    """A request for an engine; its hint signed as ``kvkern router`` signs one."""
    params = dict(params or {})
    if sign and (params or envelope):
        body = {**params, "kv_transfer_params": params}
        if envelope is not None:
            body["kv_hints"] = envelope
        hint = decode_hint(body)
        assert isinstance(hint, KvHint), hint
        params.update(sign_hint(CREDENTIAL, hint, tokens, cache_salt=salt))
    return {"id": rid, "tokens": tokens, "kv_transfer_params": params or None,
            "kv_hints": envelope, "cache_salt": salt or None, "max_tokens": max_tokens}


def own_continuation(engine, tokens: list[int], rid: str, salt: str = "") -> dict:
    """The source computes the prompt, then continues it from its own prefix cache."""
    engine.generate(request(rid + "-fill", tokens, salt=salt))
    again = engine.generate(request(rid + "-hit", tokens, salt=salt))[rid + "-hit"]
    assert again["cached"] == FULL * BS, again
    return again


def counters(engine) -> dict:
    return engine.ask("stats")["counters"]


def unpinned(engine, timeout: float = 10.0) -> dict:
    """The engine's stats once kvkern holds no pin there: a read's pins are let go when the
    destination's release arrives, which the reply's hold bounds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.ask("stats")
        if stats["pins"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_a_pulled_prefix_continues_bit_identically(engines):
    a, b = engines["a"], engines["b"]
    toks = prompt(1)
    want = own_continuation(a, toks, "t1")
    got = b.generate(request("t1-b", toks, *hint_params("kv_hint", a, toks)))["t1-b"]
    assert got["cached"] == FULL * BS, got  # vLLM ran on the pulled blocks
    assert got["logprobs"] == want["logprobs"] and got["tokens"] == want["tokens"]
    # the logprobs do tell prefixes apart: one changed prompt token changes them
    other = list(toks)
    other[3] += 1
    moved = b.generate(request("t1-other", other))["t1-other"]
    assert moved["logprobs"] != want["logprobs"]
    assert counters(b).get("kvkern_pulls_total[ok]", 0) >= 1
    # read one-sided into vLLM's blocks with no message to a (its read directory names
    # them): a serves reads and runs on this host
    assert counters(b).get("kvkern_pairs_pulled_total[direct]", 0) >= 1
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://{source_of(b)}/metrics", timeout=10) as page:  # what operators scrape
        assert 'kvkern_pulls_total{outcome="ok"}' in page.read().decode()


def test_a_prefix_read_through_ucx_into_vllms_blocks_continues_bit_identically(engines):
    """``b`` reads ``a``'s blocks through UCX, as from another host (its same-host reads
    off), one-sided and straight into the blocks vLLM allocated."""
    a, b = engines["a"], engines["b"]
    toks = prompt(2)
    want = own_continuation(a, toks, "u1")
    before = counters(b)
    b.ask("local_reads", on=False)
    try:
        got = b.generate(request("u1-b", toks, *hint_params("kv_hint", a, toks)))["u1-b"]
    finally:
        b.ask("local_reads", on=True)
    assert got["cached"] == FULL * BS, got
    assert got["logprobs"] == want["logprobs"] and got["tokens"] == want["tokens"]
    after = counters(b)
    pulled = {k: after.get(f"kvkern_pairs_pulled_total[{k}]", 0)
              - before.get(f"kvkern_pairs_pulled_total[{k}]", 0)
              for k in ("direct", "read", "stream")}
    assert pulled["stream"] == 0 and pulled["direct"] + pulled["read"] >= 1, pulled
    assert unpinned(a)["pins"] == 0


@pytest.mark.parametrize("dialect", ["kv_hints", "dynamo.kv_hint", "request.kv_hints",
                                     "router_hint", "remote_kv_source"])
def test_every_hint_dialect_pulls(engines, dialect):
    a, b = engines["a"], engines["b"]
    toks = prompt(10 + len(dialect))
    want = own_continuation(a, toks, f"d-{dialect}")
    got = b.generate(request(f"d-{dialect}-b", toks, *hint_params(dialect, a, toks)))
    got = got[f"d-{dialect}-b"]
    assert got["cached"] == FULL * BS, (dialect, got)
    assert got["logprobs"] == want["logprobs"] and got["tokens"] == want["tokens"]


def test_a_salted_tenant_pulls_only_under_its_salt(engines):
    a, b = engines["a"], engines["b"]
    toks = prompt(30)
    want = own_continuation(a, toks, "salt", salt="tenant-a")
    params, _ = hint_params("kv_hint", a, toks)
    other = b.generate(request("salt-b", toks, params, salt="tenant-b"))["salt-b"]
    assert other["cached"] == 0  # another tenant's blocks are not its blocks
    same = b.generate(request("salt-a", toks, params, salt="tenant-a"))["salt-a"]
    assert same["cached"] == FULL * BS and same["logprobs"] == want["logprobs"]


def test_wrong_stale_or_unsigned_hints_use_nothing(engines):
    a, b = engines["a"], engines["b"]
    toks, other, signless = prompt(40), prompt(41), prompt(43)
    want = own_continuation(a, toks, "w")
    own_continuation(a, signless, "w-s")
    before = counters(b)
    wrong = {"router_hint": {"source_control_endpoint": f"tcp://{source_of(a)}",
                             "block_hashes": engine_hashes(other)[:FULL]}}
    stale = prompt(42)  # never computed by the source
    unsigned, _ = hint_params("kv_hint", a, signless)
    t0 = time.monotonic()
    got = b.generate(request("w-wrong", toks, wrong),
                     request("w-stale", stale, *hint_params("kv_hint", a, stale)),
                     request("w-unsigned", signless, unsigned, sign=False))
    assert all(r["cached"] == 0 for r in got.values()), got
    assert time.monotonic() - t0 < 10.0  # a miss is one pull, then recompute
    assert got["w-wrong"]["tokens"] == want["tokens"]
    after = counters(b)
    for reason in ("hash_mismatch", "source_miss", "hint_untrusted"):
        key = f"kvkern_fallbacks_total[{reason}]"
        assert after.get(key, 0) == before.get(key, 0) + 1, (reason, after)


def test_fifty_hinted_requests_leave_both_pools_as_they_were(engines):
    a, b = engines["a"], engines["b"]
    base_a, base_b = a.ask("stats"), b.ask("stats")
    toks = [prompt(100 + i) for i in range(50)]
    a.generate(*[request(f"m{i}-a", t) for i, t in enumerate(toks)])
    got = b.generate(*[request(f"m{i}", t, *hint_params("kv_hint", a, t))
                       for i, t in enumerate(toks)])
    want = a.generate(*[request(f"m{i}-a2", t) for i, t in enumerate(toks)])
    assert [got[f"m{i}"]["tokens"] for i in range(50)] == \
        [want[f"m{i}-a2"]["tokens"] for i in range(50)]
    assert sum(r["cached"] == FULL * BS for r in got.values()) >= 4  # pulls happened
    for engine, base in ((a, base_a), (b, base_b)):
        now = unpinned(engine)
        assert now["free_blocks"] == base["free_blocks"] == now["num_blocks"] - 1, now
        assert now["pins"] == 0


def test_a_source_killed_mid_pull_leaves_the_request_to_recompute(engines):
    b, c = engines["b"], engines["c"]
    warm, toks = prompt(60), prompt(61)
    c.generate(request("k-warm", warm), request("k-fill", toks))
    streams = counters(b).get("kvkern_pairs_pulled_total[stream]", 0)
    first = b.generate(request("k-warm-b", warm, *hint_params("kv_hint", c, warm)))
    assert first["k-warm-b"]["cached"] == FULL * BS  # state cached, connection open
    assert counters(b)["kvkern_pairs_pulled_total[stream]"] == streams + 1  # c serves no reads
    want = c.generate(request("k-want", toks))["k-want"]
    base = b.ask("stats")
    c.signal(signal.SIGSTOP)  # the source stops answering mid-pull ...
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(
        b.generate(request("k-b", toks, *hint_params("kv_hint", c, toks)))))
    worker.start()
    time.sleep(1.0)
    c.signal(signal.SIGKILL)  # ... and dies
    worker.join(60)
    got = box["k-b"]
    assert got["cached"] == 0 and got["tokens"] == want["tokens"], got
    now = b.ask("stats")
    assert now["free_blocks"] == base["free_blocks"] == now["num_blocks"] - 1
    fallbacks = {k: v for k, v in now["counters"].items() if k.startswith("kvkern_fallbacks")}
    assert any(r in k for k in fallbacks for r in ("transfer_timeout", "transfer_failed",
                                                   "deadline_exceeded")), fallbacks



def test_a_busy_source_serves_while_its_scheduler_runs(engines):
    """The source's pins and vLLM's scheduler share the block pool: pulls from an engine that
    is computing (allocating, caching, freeing blocks every step) stay exact and leak no
    pin."""
    a, b = engines["a"], engines["b"]
    wanted = [prompt(300 + i) for i in range(6)]
    a.generate(*[request(f"bz{i}-fill", t) for i, t in enumerate(wanted)])
    expect = a.generate(*[request(f"bz{i}-hit", t) for i, t in enumerate(wanted)])
    box: dict = {}
    busy = threading.Thread(target=lambda: box.update(a.generate(
        *[request(f"load{i}", prompt(400 + i, blocks=8), max_tokens=48)
          for i in range(8)])))
    busy.start()
    time.sleep(0.3)  # A is mid-batch: prefills, then decode steps
    got = b.generate(*[request(f"bz{i}-b", t, *hint_params("kv_hint", a, t))
                       for i, t in enumerate(wanted)])
    busy.join(120)
    assert len(box) == 8
    pulled = 0
    for i in range(len(wanted)):
        mine, theirs = got[f"bz{i}-b"], expect[f"bz{i}-hit"]
        assert mine["tokens"] == theirs["tokens"]
        if mine["cached"]:  # beyond max_inflight_pulls (4) a request recomputes (busy)
            assert mine["cached"] == FULL * BS and mine["logprobs"] == theirs["logprobs"]
            pulled += 1
    assert pulled >= 4, got
    stats = unpinned(a)
    assert stats["pins"] == 0 and stats["free_blocks"] == stats["num_blocks"] - 1
