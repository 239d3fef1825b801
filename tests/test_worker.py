"""`kvkern worker`: the engine's block accounting and prefix reuse in-process, then two real
worker processes on loopback: generate, the router report, hinted pulls in every dialect,
refused hints falling back with a named reason, and bad requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import types

import pytest
import torch

from kvkern.serve.engine import Engine, decode_logits
from kvkern.serve.httpjson import HTTPError, get_json, post_json
from kvkern.serve.model import ModelConfig
from kvkern.serve.procs import start_workers
from kvkern.serve.router import DIALECTS, KVRouter, hint_fragment, router_hashes
from kvkern.serve.worker import Worker, build_parser
from kvkern.xfer.httpguard import HttpLimits, guard_app, reads_own_body, start_guarded
from tests.fleet import peer_get, signed

T = 4  # ModelConfig.tiny().block_size
VOCAB = 256


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- engine


def test_engine_reuses_its_prefix_and_releases_every_block():
    e = Engine(ModelConfig.tiny(), num_blocks=32, layout_name="vllm_nhd")
    prompt = toks(30, 1)
    cold = e.generate(prompt, 4, arrival=time.perf_counter(), use_cache=False)
    assert e.pool.stats()["cached"] == 0  # use_cache=False commits nothing
    warm = e.generate(prompt[:17], 1, arrival=time.perf_counter())
    assert warm.cached_tokens == 0 and warm.blocks_committed == 4
    hot = e.generate(prompt, 4, arrival=time.perf_counter())
    assert hot.cached_tokens == 16 and hot.prefill_tokens == 14
    assert hot.tokens == cold.tokens
    assert torch.equal(hot.first_logits, cold.first_logits) or torch.allclose(
        hot.first_logits, cold.first_logits, rtol=1e-4, atol=1e-4)
    stats = e.pool.stats()
    assert stats["referenced"] == 0 and stats["free"] == 32, stats
    e.pool.check_invariants()


def test_engine_uses_the_hashes_its_caller_computed():
    """The worker hashes a prompt once and hands the hashes to the local-prefix check, the
    pull and the prefill: the same cache hits and commits as hashing each time."""
    e = Engine(ModelConfig.tiny(), num_blocks=32)
    prompt = toks(30, 2)
    hashes = e.pool_hashes(prompt, "t")
    first = e.generate(prompt, 2, arrival=time.perf_counter(), cache_salt="t", hashes=hashes)
    assert first.blocks_committed == 7
    assert e.cached_prefix_tokens(prompt, "t", hashes=hashes) == \
        e.cached_prefix_tokens(prompt, "t") == 7 * e.block_size
    again = e.generate(prompt, 2, arrival=time.perf_counter(), cache_salt="t", hashes=hashes)
    assert again.cached_tokens == 7 * e.block_size and again.tokens == first.tokens
    assert e.cached_prefix_tokens(prompt, "other") == 0
    e.pool.check_invariants()


def test_engine_caps_a_full_hit_so_the_last_token_is_computed():
    e = Engine(ModelConfig.tiny(), num_blocks=16)
    prompt = toks(12, 2)  # exactly 3 blocks
    first = e.generate(prompt, 2, arrival=time.perf_counter())
    again = e.generate(prompt, 2, arrival=time.perf_counter())
    assert again.cached_tokens == 8 and again.prefill_tokens == 4
    assert again.tokens == first.tokens
    assert e.pool.stats()["referenced"] == 0


def test_engine_report_lists_router_hashes_of_cached_blocks():
    e = Engine(ModelConfig.tiny(), num_blocks=8)
    prompt = toks(9, 3)
    e.generate(prompt, 1, arrival=time.perf_counter())
    report = e.report("w")
    assert [b["hash"] for b in report["blocks"]] == router_hashes(prompt, T)
    assert report["blocks"][1]["parent"] == report["blocks"][0]["hash"]
    # A request needing every block evicts them all: the report forgets them.
    e.generate(toks(31, 10), 1, arrival=time.perf_counter(), use_cache=False)
    assert e.pool.stats()["cached"] == 0
    assert e.report("w")["blocks"] == []


def test_engine_out_of_blocks_raises_and_leaks_nothing():
    e = Engine(ModelConfig.tiny(), num_blocks=2)
    with pytest.raises(RuntimeError, match="exhausted"):
        e.generate(toks(20, 4), 1, arrival=time.perf_counter())
    assert e.pool.stats()["free"] == 2


def test_engine_trtllm_scheme_pool_still_reports_router_hashes():
    e = Engine(ModelConfig.tiny(), num_blocks=8, hash_scheme="trtllm-v1")
    prompt = toks(8, 5)
    e.generate(prompt, 1, arrival=time.perf_counter())
    assert [b["hash"] for b in e.report("w")["blocks"]] == router_hashes(prompt, T)


# ---------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def workers():
    common = ["--model", "tiny", "--num-blocks", "256", "--allow", "127.0.0.0/8",
              "--cost-guard", "off", "--metadata-timeout-s", "2", "--transfer-timeout-s", "5",
              "--deadline-s", "10", "--log-level", "ERROR"]
    reads = ["--remote-read", "host"]
    procs = start_workers({"A": [*common, *reads, "--worker-id", "A", "--layout", "trtllm"],
                           # B logs at INFO: its per-pull outcome lines are checked
                           "B": [*common, *reads, "--worker-id", "B", "--layout", "vllm_flash",
                                 "--log-level", "INFO"],
                           # C: no allowlist, so every hint is refused (fail closed)
                           "C": ["--model", "tiny", "--num-blocks", "64", "--worker-id", "C",
                                 "--cost-guard", "off", "--log-level", "ERROR",
                                 "--remote-read", "off"]},
                          timeout=90)
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def gen(url: str, body: dict) -> dict:
    return post_json(f"{url}/v1/generate", body, timeout=60)


def test_ready_line_and_info(workers):
    a = workers["A"]
    assert a.info["worker_id"] == "A" and a.info["threads"] == 1 and a.info["puller"]
    assert a.url.startswith("http://127.0.0.1:")
    info = get_json(f"{a.url}/v1/info", timeout=10)
    assert info["layout"] == "trtllm" and info["block_size"] == T
    state = peer_get(a.url, "/kvkern/v1/state")
    assert state["protocol"] == "kvkern/1" and state["worker_id"] == "A"
    # A's TRT-LLM host pool and B's per-layer vLLM flash pool are offered for one-sided
    # reads (B's in its own order: to pools of its layout, whole blocks); C was started with
    # --remote-read off
    states = {n: peer_get(w.url, "/kvkern/v1/state") for n, w in workers.items()}
    offered = {n: "read/1" in st["capabilities"] for n, st in states.items()}
    assert offered == {"A": True, "B": True, "C": False}
    assert states["A"]["dp_groups"]["0"]["ranks"]["0"]["read"] == "canonical"
    assert states["B"]["dp_groups"]["0"]["ranks"]["0"]["read"] == "native"


def test_generate_commits_and_reports(workers):
    a = workers["A"]
    prompt = toks(22, 20)
    out = gen(a.url, {"token_ids": prompt, "max_new_tokens": 3})
    assert len(out["tokens"]) == 3 and out["hint"] is None and out["fallback"] is None
    assert out["blocks_committed"] == 5 and out["ttft_s"] > 0
    again = gen(a.url, {"token_ids": prompt, "max_new_tokens": 3})
    assert again["cached_tokens"] == 20 and again["tokens"] == out["tokens"]
    third = gen(a.url, {"token_ids": prompt, "max_new_tokens": 3})
    assert third["logits_sha256"] == again["logits_sha256"]  # same cached_len: same bits
    report = peer_get(a.url, "/kvkern/v1/blocks")
    assert set(router_hashes(prompt, T)) <= {b["hash"] for b in report["blocks"]}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_hinted_pull_in_every_dialect_continues_bit_identically(workers, dialect):
    a, b = workers["A"], workers["B"]
    seed = 100 + DIALECTS.index(dialect)
    # A question shorter than a block: the prompt's full blocks are the prefix, which an
    # llm-d hint (no hashes: every full block of the prompt) needs under the strict policy.
    prefix, question = toks(32, seed), toks(3, seed + 50)
    prompt = prefix + question
    gen(a.url, {"token_ids": prefix, "max_new_tokens": 1})
    hint = hint_fragment(dialect, a.url, router_hashes(prefix, T))
    pulled = gen(b.url, signed({"token_ids": prompt, "max_new_tokens": 4,
                                "return_logits": True, **hint}))
    assert pulled["fallback"] is None, pulled
    assert pulled["pull"]["reason"] in ("ok", "partial")
    assert pulled["pulled_tokens"] == 32 and pulled["cached_tokens"] == 32
    ref = gen(a.url, {"token_ids": prompt, "max_new_tokens": 4, "return_logits": True})
    assert ref["cached_tokens"] == 32
    assert pulled["tokens"] == ref["tokens"]
    assert torch.equal(decode_logits(pulled["logits"]).view(torch.int32),
                       decode_logits(ref["logits"]).view(torch.int32))


def test_refused_hints_fall_back_with_a_reason(workers):
    a, c = workers["A"], workers["C"]
    prefix = toks(16, 300)
    gen(a.url, {"token_ids": prefix, "max_new_tokens": 1})
    prompt = prefix + [1, 2]
    cold = gen(c.url, {"token_ids": prompt, "max_new_tokens": 2, "use_cache": False})
    # C has no allowlist: fails closed.
    out = gen(c.url, signed({"token_ids": prompt, "max_new_tokens": 2,
                             **hint_fragment("kv_hint", a.url, router_hashes(prefix, T))}))
    assert out["fallback"] == "source_not_allowed" and out["tokens"] == cold["tokens"]
    # A malformed hint is a reason too, never an error.
    out = gen(c.url, {"token_ids": prompt, "max_new_tokens": 2, "kv_hint": {"source": 5}})
    assert out["fallback"] == "hint_invalid" and out["tokens"] == cold["tokens"]
    # Hashes that do not name this prompt.
    b_out = gen(workers["B"].url, signed({"token_ids": prompt, "max_new_tokens": 2,
                                          **hint_fragment("kv_hint", a.url, [1, 2, 3])}))
    assert b_out["fallback"] == "hash_mismatch" and b_out["tokens"] == cold["tokens"]


def test_router_learns_from_reports_and_routes_with_a_hint(workers):
    a, b = workers["A"], workers["B"]
    prefix = toks(24, 400)
    gen(a.url, {"token_ids": prefix, "max_new_tokens": 1})
    router = KVRouter(T)
    router.add_worker("A", a.url)
    router.add_worker("B", b.url)
    for wid, p in (("A", a), ("B", b)):
        router.load_report(wid, peer_get(p.url, "/kvkern/v1/blocks"))
    d = router.route(prefix + [7, 7, 7], destination="B")
    assert d.hint_source == "A" and d.hint_blocks == 6
    out = gen(b.url, signed({"token_ids": prefix + [7, 7, 7], "max_new_tokens": 1,
                             "request_id": d.request_id, **d.hint}))
    router.finish(d, ok=True)
    assert out["pulled_tokens"] == 24 and out["request_id"] == d.request_id
    # the pull's outcome line at INFO carries the router's request id
    deadline = time.monotonic() + 5
    while True:
        lines = [ln for ln in b.output(400).splitlines()
                 if " INFO " in ln and '"event":"kvkern.pull"' in ln
                 and f'"request_id":"{d.request_id}/' in ln]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) == 1 and '"reason":"ok"' in lines[0], b.output(20)


@pytest.mark.parametrize("body, status", [
    ({"token_ids": []}, 400),
    ({"token_ids": [1, 2, "x"]}, 400),
    ({"token_ids": [1, VOCAB]}, 400),
    ({"token_ids": [1], "max_new_tokens": -1}, 400),
    ({"token_ids": [1], "max_new_tokens": 10_000}, 400),
    ({"token_ids": [1] * 600, "max_new_tokens": 1}, 400),  # beyond max_seq_len 512
], ids=["empty", "not-int", "out-of-vocab", "negative-new", "too-many-new", "too-long"])
def test_bad_requests_are_400(workers, body, status):
    with pytest.raises(HTTPError) as exc:
        gen(workers["A"].url, body)
    assert exc.value.status == status


def test_a_generate_body_larger_than_a_request_can_use_is_413(workers):
    """The tiny model's context is 512 tokens: a body is at most 256 KiB + 24 B a token,
    not the 16 MiB of JSON objects that decode to hundreds of MiB."""
    cap = (256 << 10) + 24 * 512
    filler = {"x": [{}] * (cap // 3)}  # 3 bytes a "{}," : just over the cap
    with pytest.raises(HTTPError) as exc:
        gen(workers["A"].url, {"token_ids": [1, 2], "max_new_tokens": 1, **filler})
    assert exc.value.status == 413
    assert gen(workers["A"].url, {"token_ids": [1, 2], "max_new_tokens": 1})["tokens"]


# ---------------------------------------------------------------------------- admission


@contextlib.asynccontextmanager
async def generate_only(args: list[str], limits: HttpLimits):
    """(worker, port): a tiny-model :class:`Worker` in this process, not started, whose
    ``POST /v1/generate`` handler alone is served on a guarded site with ``limits``."""
    from aiohttp import web  # noqa: PLC0415

    worker = Worker(build_parser().parse_args(["--model", "tiny", "--device", "cpu", *args]))
    worker.source = types.SimpleNamespace(http_limits=limits)  # (what the handler reads)
    app = web.Application()
    app.router.add_post("/v1/generate", reads_own_body(worker._http_generate))
    guard_app(app, limits)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await start_guarded(runner, "127.0.0.1", 0, limits)
        yield worker, int(runner.addresses[0][1])
    finally:
        await asyncio.wait_for(runner.cleanup(), 5.0)
        worker.close()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(ln.split(b":")[1]) for ln in lines if ln.lower().startswith(
        b"content-length:"))
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def test_generate_waits_for_admission_at_most_the_head_timeout():
    """Requests past the generate limit (2 with --max-inflight-pulls 1) wait for a slot with
    their bodies unread for at most the head timeout, then get 503 and a closed connection:
    heads sent without a body cannot queue on the limit for ever, holding connections."""
    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=3.0)
    body = b'{"token_ids": [1, 2, 3], "max_new_tokens": 1, "use_cache": false}'
    head = (b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    async with generate_only(["--max-inflight-pulls", "1"], limits) as (_, port):
        holders = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _, w in holders:  # admitted: both wait for their bodies
            w.write(head)
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        writer.write(head)  # the third: waits for a slot, then 503
        status, got = await asyncio.wait_for(_answer(reader), 2.0)
        assert status == 503 and "busy" in json.loads(got)["error"], got
        assert limits.header_timeout_s * 0.9 <= time.monotonic() - t0 < 1.5
        assert await asyncio.wait_for(reader.read(), 1.0) == b""  # closed, the body unsent
        writer.close()
        for r, w in holders:  # the admitted ones are served once their bodies come
            w.write(body)
            status, got = await asyncio.wait_for(_answer(r), 5.0)
            assert status == 200 and len(json.loads(got)["tokens"]) == 1, got
            w.close()
