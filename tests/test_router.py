"""The KV-aware router: load picks the destination, the longest prefix elsewhere picks the
hint source, every dialect it writes decodes to the same hint, and its HTTP front forwards."""

from __future__ import annotations

import random

import pytest

from kvkern.cache.hashing import sequence_hashes
from kvkern.serve.router import DIALECTS, KVRouter, hint_fragment, router_hashes
from kvkern.xfer.auth import check_hint
from kvkern.xfer.hints import KvHint, decode_hint
from tests.fleet import CREDENTIAL, signed_listing

T = 4


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def two_workers(**kw) -> KVRouter:
    r = KVRouter(T, **kw)
    r.add_worker("a", "http://127.0.0.1:9001")
    r.add_worker("b", "http://127.0.0.1:9002")
    return r


def test_router_hashes_are_the_chained_public_scheme():
    t = toks(18)
    assert router_hashes(t, T) == sequence_hashes(t, T, "public-xxh3-v1")
    assert len(router_hashes(t, T)) == 4  # the partial block is never hashed


def test_idle_workers_alternate_and_load_wins():
    r = two_workers()
    d1 = r.route(toks(8, 1))
    d2 = r.route(toks(8, 2))
    assert {d1.destination, d2.destination} == {"a", "b"}
    r.finish(d2, ok=True)
    d3 = r.route(toks(8, 3))  # d1's worker still has one in flight
    assert d3.destination == d2.destination


def test_hint_names_the_longest_prefix_holder_when_it_beats_the_destination():
    r = two_workers()
    prefix = toks(32, 7)
    warm = r.route(prefix, destination="a")
    r.finish(warm, ok=True)  # a now holds 8 blocks
    prompt = prefix + toks(6, 8)
    d = r.route(prompt)
    assert d.destination == "b"  # a was chosen last
    assert d.matched == {"a": 8, "b": 0}
    assert d.hint_source == "a" and d.hint_blocks == 8
    assert d.hint["kv_hint"]["source"] == "http://127.0.0.1:9001"
    assert d.hint["kv_hint"]["block_hashes"] == router_hashes(prefix, T)
    r.finish(d, ok=True)
    # b learned the prompt: now neither beats the other, so no hint.
    again = r.route(prompt, destination="b")
    assert again.hint is None and again.matched["b"] == 9


def test_no_hint_when_destination_holds_as_much_or_margin_not_met():
    r = two_workers(min_hint_blocks=3)
    prefix = toks(16, 3)
    r.learn_tokens("a", prefix)           # 4 blocks
    r.learn_tokens("b", prefix[:8])       # 2 blocks
    d = r.route(prefix, destination="b")
    assert d.hint is None                 # beats by 2 < 3
    r.learn("b", router_hashes(prefix, T)[:1])
    d = r.route(prefix, destination="a")
    assert d.hint is None                 # the destination has the longest


def test_matching_needs_a_leading_run():
    r = two_workers()
    t = toks(16, 4)
    hs = router_hashes(t, T)
    r.learn("a", hs[1:])  # every block but the first: no prefix at all
    d = r.route(t, destination="b")
    assert d.matched["a"] == 0 and d.hint is None


def test_report_replaces_learned_hashes_and_checks_scheme_and_block_size():
    r = two_workers()
    t = toks(16, 5)
    r.learn_tokens("a", t)
    hs = router_hashes(t, T)
    n = r.load_report("a", {"hash_scheme": "public-xxh3-v1", "block_size": T,
                            "blocks": [{"hash": hs[0], "parent": None, "local": 1}]})
    assert n == 1 and r.route(t, destination="b").hint_blocks == 1
    with pytest.raises(ValueError, match="block size"):
        r.load_report("a", {"hash_scheme": "public-xxh3-v1", "block_size": 16, "blocks": []})
    with pytest.raises(ValueError, match="hash scheme"):
        r.load_report("a", {"hash_scheme": "trtllm-v1", "block_size": T, "blocks": []})


def test_unhealthy_workers_are_neither_destination_nor_source():
    r = two_workers()
    t = toks(16, 6)
    r.learn_tokens("a", t)
    r.set_healthy("a", False)
    d = r.route(t)
    assert d.destination == "b" and d.hint is None
    r.set_healthy("b", False)
    with pytest.raises(LookupError):
        r.route(t)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_dialect_decodes_to_the_same_source(dialect):
    hs = router_hashes(toks(12, 9), T)
    body = {"token_ids": [1, 2, 3], **hint_fragment(dialect, "http://127.0.0.1:9001", hs)}
    hint = decode_hint(body)
    assert isinstance(hint, KvHint), hint
    if dialect == "llm-d":
        assert hint.source == "127.0.0.1:9001" and hint.block_hashes is None
    else:
        assert hint.source == "http://127.0.0.1:9001"
        assert list(hint.block_hashes) == hs
        # Dynamo's dialects carry engine hashes: the worker checks them in its own scheme
        engine = dialect in ("kv_hints", "dynamo")
        assert hint.hash_scheme == ("engine" if engine else "public-xxh3-v1")


def test_engine_hash_dialects_go_only_to_workers_hashing_like_the_router():
    r = KVRouter(T, dialect="dynamo", min_hint_blocks=1)
    for w in ("a", "b"):
        r.add_worker(w, f"http://127.0.0.1:{9000 + ord(w)}")
    t = toks(12, 11)
    r.learn_tokens("a", t)
    assert r.route(t, destination="b").hint_dialect == "dynamo"
    r.load_report("b", {"hash_scheme": "public-xxh3-v1", "pool_hash_scheme": "trtllm-v1",
                        "block_size": T, "blocks": []})
    d = r.route(t, destination="b")
    assert d.hint_dialect == "kvkern" and "kv_hint" in d.hint


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="dialect"):
        KVRouter(T, dialect="carrier-pigeon")
    with pytest.raises(ValueError, match="block_size"):
        KVRouter(0)
    r = two_workers()
    with pytest.raises(ValueError, match="already"):
        r.add_worker("a", "http://127.0.0.1:1")
    with pytest.raises(KeyError):
        r.route([1], destination="zz")
    with pytest.raises(ValueError, match="at least one"):
        hint_fragment("kv_hint", "x:1", [])


async def test_http_front_forwards_with_the_hint():
    """A fake worker records what the router forwarded; the router answers with its
    decision and learns the prompt."""
    import asyncio  # noqa: PLC0415

    from aiohttp import ClientSession, ClientTimeout, web  # noqa: PLC0415

    from kvkern.serve.router import build_app  # noqa: PLC0415

    seen: list[dict] = []

    async def fake_generate(request):
        body = await request.json()
        seen.append(body)
        return web.json_response({"tokens": [1]})

    async def fake_blocks(request):  # a fleet member's listing: signed, for a signed request
        return signed_listing(request, {"hash_scheme": "public-xxh3-v1", "block_size": T,
                                        "blocks": []})

    runners = []

    async def serve(app) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    try:
        workers = []
        for _ in range(2):
            app = web.Application()
            app.add_routes([web.post("/v1/generate", fake_generate),
                            web.get("/kvkern/v1/blocks", fake_blocks)])
            workers.append(await serve(app))
        router = KVRouter(T)
        router.add_worker("a", workers[0])
        router.add_worker("b", workers[1])
        router_url = await serve(build_app(router, refresh_s=None))  # reads empty reports
        prefix = toks(16, 11)
        router.learn_tokens("a", prefix)
        async with ClientSession(trust_env=False, timeout=ClientTimeout(total=10)) as s:
            # the client's own hint (naming an attacker's host) is dropped
            async with s.post(f"{router_url}/v1/generate",
                              json={"token_ids": prefix + [1, 2], "max_new_tokens": 1,
                                    "destination": "b",
                                    "kv_transfer_params": {"remote_kv_source": {
                                        "host": "10.9.9.9", "port": 1}},
                                    "kv_hint": {"source": "10.9.9.9:1"}}) as r:
                out = await r.json()
            assert r.status == 200
            async with s.get(f"{router_url}/v1/workers") as r:
                listing = await r.json()
        assert out["router"]["destination"] == "b" and out["router"]["hint_source"] == "a"
        assert seen[0]["kv_hint"]["source"] == workers[0]
        assert "destination" not in seen[0] and seen[0]["kv_transfer_params"] == {}
        hint = decode_hint(seen[0])
        assert check_hint(CREDENTIAL, seen[0], hint, prefix + [1, 2]) is None  # signed
        by_id = {w["worker_id"]: w for w in listing["workers"]}
        assert by_id["b"]["blocks"] == 4 and by_id["b"]["in_flight"] == 0
    finally:
        for runner in runners:
            await asyncio.wait_for(runner.cleanup(), 10)
