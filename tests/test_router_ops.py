"""`kvkern router` as operators see it: Prometheus metrics on /metrics, health changes in the
log, one request id from the client through the router to the worker, and the dialect named
alike in the router's summary and by the worker that decodes the hint."""

from __future__ import annotations

import asyncio
import logging
import random
import socket

from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client.parser import text_string_to_metric_families

from kvkern.serve.router import KVRouter, build_app
from kvkern.xfer.hints import decode_hint
from tests.fleet import CREDENTIAL, signed_listing, to_of

T = 4


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def sample(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


class FakeWorker:
    """A worker's two endpoints the router uses; records forwarded bodies; its block listing
    can be made to fail."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.listing_fails = False
        self.app = web.Application()
        self.app.add_routes([web.post("/v1/generate", self.generate),
                             web.get("/kvkern/v1/blocks", self.blocks)])

    async def generate(self, request):
        body = await request.json()
        self.seen.append(body)
        hint = decode_hint(body)
        return web.json_response({"request_id": body.get("request_id"), "tokens": [1],
                                  "hint": {"dialect": getattr(hint, "dialect", None)}})

    async def blocks(self, request):
        if self.listing_fails:
            return web.json_response({"error": "down"}, status=500)
        return signed_listing(request, {"hash_scheme": "public-xxh3-v1", "block_size": T,
                                        "blocks": []})


async def serve_on(runners: list[web.AppRunner], app: web.Application) -> str:
    """``app`` served on a port of 127.0.0.1 (its runner kept in ``runners``); its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    runners.append(runner)
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def test_metrics_request_ids_and_health_changes(caplog):
    caplog.set_level(logging.INFO, logger="kvkern.serve.router")
    runners: list[web.AppRunner] = []
    blocker = socket.socket()

    async def serve(app) -> str:
        return await serve_on(runners, app)

    try:
        a, b, c = FakeWorker(), FakeWorker(), FakeWorker()
        c.listing_fails = True
        urls = [await serve(w.app) for w in (a, b, c)]
        # bound and never listening, for the whole test: a connection there is refused, and
        # no server of this test can take the port over (a port freed at once may be reused)
        blocker.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{blocker.getsockname()[1]}"
        router = KVRouter(T)
        for wid, url in zip("abc", urls, strict=True):
            router.add_worker(wid, url)
        router.add_worker("d", dead)
        router_url = await serve(build_app(router, refresh_s=None, credential=CREDENTIAL))
        prefix = toks(16, 3)
        router.learn_tokens("a", prefix)
        async with ClientSession(trust_env=False, timeout=ClientTimeout(total=20)) as s:
            # the client names no request id: the router makes one and the worker gets it
            async with s.post(f"{router_url}/v1/generate",
                              json={"token_ids": prefix + [1], "destination": "b"}) as r:
                assert r.status == 200
                first = await r.json()
                header_id = r.headers["X-Request-Id"]
            # the client's own id travels unchanged
            async with s.post(f"{router_url}/v1/generate",
                              json={"token_ids": toks(9, 4), "destination": "a",
                                    "request_id": "client-id-7"}) as r:
                second = await r.json()
            async with s.post(f"{router_url}/v1/generate",
                              json={"token_ids": [1, 2, 3], "destination": "d"}) as r:
                assert r.status == 502
                failed = await r.json()
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": []}) as r:
                assert r.status == 400
            c.listing_fails = False
            async with s.post(f"{router_url}/v1/refresh") as r:
                assert r.status == 401  # fleet members only
            headers, _ = CREDENTIAL.sign_request("POST", "/v1/refresh", to=to_of(router_url))
            async with s.post(f"{router_url}/v1/refresh", headers=headers) as r:
                assert r.status == 200
            async with s.post(f"{router_url}/v1/refresh", headers=headers) as r:
                assert r.status == 401  # (a replay)
            async with s.get(f"{router_url}/metrics") as r:
                assert r.status == 200 and r.content_type == "text/plain"
                text = await r.text()

        rid = first["request_id"]
        assert rid and rid == header_id == b.seen[0]["request_id"]
        assert first["router"]["request_id"] == rid
        assert second["request_id"] == "client-id-7" == a.seen[0]["request_id"]
        assert failed["request_id"] and "d did not answer" in failed["error"]
        # the router and the worker name the dialect alike
        assert first["router"]["hint_dialect"] == first["hint"]["dialect"] == "kvkern"
        assert second["router"]["hint_dialect"] is None
        assert second["router"]["no_hint_reason"] == "no_longer_prefix"

        assert sample(text, "kvkern_router_routes_total", worker="b") == 1
        assert sample(text, "kvkern_router_routes_total", worker="a") == 1
        assert sample(text, "kvkern_router_hints_sent_total", dialect="kvkern") == 1
        assert sample(text, "kvkern_router_hints_not_sent_total", reason="no_longer_prefix") >= 1
        assert sample(text, "kvkern_router_forward_errors_total", worker="d",
                      kind="unreachable") == 1
        assert sample(text, "kvkern_router_request_seconds_count", endpoint="generate") == 4
        assert sample(text, "kvkern_router_requests_total", endpoint="generate",
                      status="400") == 1
        assert sample(text, "kvkern_router_worker_healthy", worker="c") == 1  # back
        assert sample(text, "kvkern_router_worker_healthy", worker="d") == 0
        assert sample(text, "kvkern_router_refresh_failures_total", worker="c") == 1

        changes = [(rec.levelname, rec.getMessage()) for rec in caplog.records
                   if "healthy" in rec.getMessage()]
        assert any(lvl == "WARNING" and "worker c " in msg and "unhealthy" in msg
                   for lvl, msg in changes), changes
        assert any(lvl == "INFO" and "worker c " in msg and "healthy again" in msg
                   for lvl, msg in changes), changes
        assert any(lvl == "WARNING" and "worker d " in msg for lvl, msg in changes), changes
    finally:
        blocker.close()
        for runner in runners:
            await asyncio.wait_for(runner.cleanup(), 10)


async def test_two_router_apps_keep_their_own_metrics():
    """Each app has its own registry: building a second one neither fails on duplicate
    metric names nor shares counts."""
    one, two = KVRouter(T), KVRouter(T)
    one.add_worker("a", "http://127.0.0.1:1")
    two.add_worker("a", "http://127.0.0.1:1")
    build_app(one, refresh_s=None, credential=CREDENTIAL)
    build_app(two, refresh_s=None, credential=CREDENTIAL)


async def test_malformed_bodies_are_400_and_an_uncached_request_teaches_nothing():
    """Token ids outside u32 and a destination that is not a worker id are the client's
    error (400, never a 500); a request that bypassed the cache (``use_cache: false``)
    left nothing on its destination, so the router does not learn its prefix there."""
    runners: list[web.AppRunner] = []

    async def serve(app) -> str:
        return await serve_on(runners, app)

    try:
        a = FakeWorker()
        router = KVRouter(T)
        router.add_worker("a", await serve(a.app))
        router_url = await serve(build_app(router, refresh_s=None, credential=CREDENTIAL))
        prompt = toks(12, 5)
        async with ClientSession(trust_env=False, timeout=ClientTimeout(total=20)) as s:
            for body in ({"token_ids": [-1, 2, 3, 4]}, {"token_ids": [1 << 32, 2, 3, 4]},
                         {"token_ids": prompt, "destination": []},
                         {"token_ids": prompt, "destination": 7}):
                async with s.post(f"{router_url}/v1/generate", json=body) as r:
                    assert r.status == 400, (body, r.status, await r.text())
            async with s.post(f"{router_url}/v1/generate",
                              json={"token_ids": prompt, "use_cache": False}) as r:
                assert r.status == 200
            assert router.route(prompt).matched["a"] == 0  # (nothing learned)
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": prompt}) as r:
                assert r.status == 200
            assert router.route(prompt).matched["a"] == 3
        assert not a.seen[0].get("destination")
    finally:
        for runner in runners:
            await runner.cleanup()
