"""`kvkern router` against hostile tenants and busy workers: no request body, however built,
makes a worker unhealthy for the next tenant; forwards waiting on a busy worker neither delay
its block listing nor queue without bound; prompts and bodies are bounded before per-token
work; a request id that cannot be a response header is refused before anything is forwarded."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from kvkern.serve.router import (
    DEFAULT_MAX_FORWARDS,
    DEFAULT_MAX_TOKENS,
    KVRouter,
    body_bytes,
    build_app,
    build_parser,
)
from kvkern.xfer import httpguard
from tests.fleet import CREDENTIAL, to_of
from tests.test_router_ops import FakeWorker, serve_on

T = 4


class HeldWorker(FakeWorker):
    """A :class:`FakeWorker` whose generate waits until :attr:`release` is set (a worker busy
    with earlier requests); :attr:`waiting` counts the requests it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.waiting = 0

    async def generate(self, request):
        self.waiting += 1
        try:
            await self.release.wait()
        finally:
            self.waiting -= 1
        return await super().generate(request)


class RawWorker(FakeWorker):
    """A :class:`FakeWorker` that never decodes what it is sent (it records the byte count)
    and answers ``answer`` as is."""

    def __init__(self, answer: bytes = b'{"tokens": [1]}') -> None:
        super().__init__()
        self.answer = answer
        self.sizes: list[int] = []

    async def generate(self, request):
        self.sizes.append(len(await request.read()))
        return web.Response(body=self.answer, content_type="application/json")


async def healthy(s: ClientSession, router_url: str) -> dict[str, bool]:
    async with s.get(f"{router_url}/v1/workers") as r:
        return {w["worker_id"]: w["healthy"] for w in (await r.json())["workers"]}


def client() -> ClientSession:
    return ClientSession(trust_env=False, timeout=ClientTimeout(total=10))


@contextlib.asynccontextmanager
async def routed(worker: FakeWorker, **build: object):
    """A router over one worker ``worker`` (named "a"), both served on 127.0.0.1, the
    router built with ``build``: (the router, its URL)."""
    runners: list[web.AppRunner] = []
    try:
        router = KVRouter(T)
        router.add_worker("a", await serve_on(runners, worker.app))
        yield router, await serve_on(runners, build_app(router, refresh_s=None,
                                                        credential=CREDENTIAL, **build))
    finally:
        for runner in runners:
            await asyncio.wait_for(runner.cleanup(), 10)


async def test_deeply_nested_bodies_leave_the_worker_healthy(monkeypatch):
    """A body nested just under the decoder's recursion bound is forwarded as decoded, or
    refused as the client's 400, never a 502 that marks the worker unhealthy for the next
    tenant. (Any depth bound of the shared JSON decoder is lifted here, so the forward meets
    the deepest body the decoder takes.)"""
    monkeypatch.setattr(httpguard, "MAX_JSON_DEPTH", 1 << 20, raising=False)
    a = RawWorker()
    async with routed(a) as (router, router_url):
        statuses = set()
        async with client() as s:
            for depth in range(940, 1000, 3):
                body = '{"token_ids":[1,2],"x":' + "[" * depth + "]" * depth + "}"
                async with s.post(f"{router_url}/v1/generate", data=body) as r:
                    statuses.add(r.status)
                    assert r.status in (200, 400), (depth, r.status, await r.text())
                assert await healthy(s, router_url) == {"a": True}, depth
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": [1, 2]}) as r:
                assert r.status == 200, await r.text()
        assert 200 in statuses  # (the depths reach past what is forwarded, too)
        assert router.worker("a").in_flight == 0


async def test_a_body_that_cannot_be_encoded_is_a_400_and_nothing_is_forwarded(monkeypatch):
    """Building the forward is the router's and the client's business: when the body cannot
    be encoded the client gets a 400, the worker is neither sent anything nor marked."""
    import msgspec  # noqa: PLC0415

    def refuse(obj):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON array")

    a = RawWorker()
    async with routed(a) as (router, router_url):
        async with client() as s:
            monkeypatch.setattr(msgspec.json, "encode", refuse)
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": [1, 2]}) as r:
                assert r.status == 400
                assert "cannot be forwarded: RecursionError" in (await r.json())["error"]
            monkeypatch.undo()
            assert await healthy(s, router_url) == {"a": True}
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": [1, 2]}) as r:
                assert r.status == 200
        assert len(a.sizes) == 1 and router.worker("a").in_flight == 0


async def test_an_unreadable_answer_is_a_502_and_the_worker_stays_healthy():
    """The worker answered (not JSON): the request failed, the worker did not; only a
    worker that cannot be connected to is marked unhealthy."""
    a = RawWorker(answer=b"not json")
    async with routed(a) as (router, router_url), client() as s:
        async with s.post(f"{router_url}/v1/generate", json={"token_ids": [1, 2]}) as r:
            assert r.status == 502
            assert "a did not answer" in (await r.json())["error"]
        assert await healthy(s, router_url) == {"a": True}


async def test_busy_worker_forwards_are_bounded_and_its_listing_still_reads():
    """``max_forwards`` forwards held by a busy worker: the next is a 503 naming the bound
    (not queued), and a refresh still reads the worker's listing on its own connection, so
    the worker stays healthy; the held requests then finish."""
    a = HeldWorker()
    async with routed(a, max_forwards=2, report_timeout_s=2.0) as (router, router_url):
        async with client() as s:
            async def one(seed: int) -> int:
                async with s.post(f"{router_url}/v1/generate",
                                  json={"token_ids": [seed, 2, 3]}) as r:
                    return r.status

            held = [asyncio.create_task(one(i)) for i in range(2)]
            for _ in range(200):
                if a.waiting == 2:
                    break
                await asyncio.sleep(0.01)
            assert a.waiting == 2
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": [9]}) as r:
                assert r.status == 503
                error = (await r.json())["error"]
            assert "2 requests in flight" in error and "retry" in error, error
            headers, _ = CREDENTIAL.sign_request("POST", "/v1/refresh", to=to_of(router_url))
            async with s.post(f"{router_url}/v1/refresh", headers=headers) as r:
                assert r.status == 200
                assert await r.json() == {"a": 0}  # (a block count, not "unreachable")
            assert await healthy(s, router_url) == {"a": True}
            a.release.set()
            assert await asyncio.gather(*held) == [200, 200]
            async with s.post(f"{router_url}/v1/generate", json={"token_ids": [9]}) as r:
                assert r.status == 200
        assert router.worker("a").in_flight == 0


async def test_a_forward_that_times_out_is_a_502_and_the_worker_stays_healthy():
    """A slow worker is busy, not down: the listing refresh judges its health."""
    a = HeldWorker()
    async with routed(a, request_timeout_s=0.3) as (router, router_url), client() as s:
        async with s.post(f"{router_url}/v1/generate", json={"token_ids": [1, 2]}) as r:
            assert r.status == 502
            assert "within 0.3 s" in (await r.json())["error"]
        assert await healthy(s, router_url) == {"a": True}
        a.release.set()
        async with s.post(f"{router_url}/v1/generate", json={"token_ids": [1, 2]}) as r:
            assert r.status == 200


async def test_prompts_and_bodies_are_bounded_before_per_token_work():
    """Past ``max_tokens`` prompt tokens (default :data:`DEFAULT_MAX_TOKENS`) a request is a
    413 whatever its token values, and a body past :func:`body_bytes` is a 413 before it is
    decoded; nothing reaches the worker."""
    runners: list[web.AppRunner] = []
    try:
        a = FakeWorker()
        small, default = KVRouter(T), KVRouter(T)
        url = await serve_on(runners, a.app)
        small.add_worker("a", url)
        default.add_worker("a", url)
        small_url = await serve_on(runners, build_app(small, refresh_s=None,
                                                      credential=CREDENTIAL, max_tokens=8))
        default_url = await serve_on(runners, build_app(default, refresh_s=None,
                                                        credential=CREDENTIAL))
        async with client() as s:
            for path in ("/v1/generate", "/v1/route"):
                # (the ids are out of range too: the count is checked first)
                async with s.post(f"{small_url}{path}", json={"token_ids": [-1] * 9}) as r:
                    assert r.status == 413
                    assert "9 prompt tokens exceed" in (await r.json())["error"]
            async with s.post(f"{small_url}/v1/generate", json={"token_ids": [1] * 8}) as r:
                assert r.status == 200
            big = {"token_ids": [1], "cache_salt": "x" * body_bytes(8)}
            async with s.post(f"{small_url}/v1/generate", json=big) as r:
                assert r.status == 413
            async with s.post(f"{default_url}/v1/generate",
                              json={"token_ids": [7] * (DEFAULT_MAX_TOKENS + 1)}) as r:
                assert r.status == 413
            body = b'{"token_ids":[' + b",".join([b"7"] * (body_bytes(DEFAULT_MAX_TOKENS)
                                                           // 2)) + b"]}"
            async with s.post(f"{default_url}/v1/generate", data=body) as r:
                assert r.status == 413
        assert [len(b["token_ids"]) for b in a.seen] == [8]
    finally:
        for runner in runners:
            await asyncio.wait_for(runner.cleanup(), 10)


@pytest.mark.parametrize("request_id", ["a\r\nSet-Cookie: x=1", "a\x00b", "a\tb", "a b",
                                        "caf\u00e9", "\u20ac", "x" * 257],
                         ids=["crlf", "nul", "tab", "space", "latin1", "euro", "too-long"])
async def test_request_ids_that_cannot_be_headers_are_refused_before_forwarding(request_id):
    a = FakeWorker()
    async with routed(a) as (router, router_url):
        async with client() as s:
            body = json.dumps({"token_ids": [1, 2, 3, 4], "request_id": request_id})
            async with s.post(f"{router_url}/v1/generate", data=body) as r:
                assert r.status == 400
                assert "request_id" in (await r.json())["error"]
            fine = "tenant-7/req_1.2:3+x=~"
            async with s.post(f"{router_url}/v1/generate",
                              json={"token_ids": [1, 2, 3, 4], "request_id": fine}) as r:
                assert r.status == 200 and r.headers["X-Request-Id"] == fine
        assert [b["request_id"] for b in a.seen] == [fine]
        assert router.worker("a").in_flight == 0 and router.worker("a").routed == 1


def test_cli_bounds_default_and_parse():
    p = build_parser()
    args = p.parse_args(["--worker", "a=http://127.0.0.1:1"])
    assert (args.max_tokens, args.max_forwards) == (DEFAULT_MAX_TOKENS, DEFAULT_MAX_FORWARDS)
    args = p.parse_args(["--worker", "a=http://127.0.0.1:1", "--max-tokens", "4096",
                         "--max-forwards", "8"])
    assert (args.max_tokens, args.max_forwards) == (4096, 8)
    with pytest.raises(SystemExit):
        p.parse_args(["--worker", "a=http://127.0.0.1:1", "--max-forwards", "0"])
