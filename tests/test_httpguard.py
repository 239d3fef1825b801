"""kvkern.xfer.httpguard against a real aiohttp server on 127.0.0.1 (port 0): malformed and
oversize bodies, a lying Content-Length, slowloris, the connection limit, keep-alive idle.
Attacks use raw sockets; every wait is bounded (timeouts of a fraction of a second)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import signal
import socket
import subprocess
import sys
import time

import pytest
from aiohttp import web

from kvkern.xfer.httpguard import (
    LOGGED_ADDRESSES,
    MAX_JSON_DEPTH,
    GuardedSite,
    HttpLimits,
    decode_json,
    guard_app,
    guard_stats,
    read_json_body,
    read_json_object,
    reads_own_body,
    require_object,
    start_guarded,
)

HOST = "127.0.0.1"
LIMITS = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=64,
                    max_body_bytes=1 << 20)


# ---------------------------------------------------------------------------- decode


@pytest.mark.parametrize("raw", [
    b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000,
    b'{"a": "\xff\xfe"}', b"\xff", b"", b"NaN", b'{"a": 1} x', b"{'a': 1}",
    b'"\\ud800"', b"1" * 5000, '{"a": 1}'.encode("utf-16"),
], ids=["deep[", "deep[]", "deep{", "utf8", "utf8-bare", "empty", "nan", "trailing",
        "quotes", "surrogate", "hugeint", "utf16"])
def test_decode_json_malformed_is_400(raw):
    with pytest.raises(web.HTTPBadRequest) as ei:
        decode_json(raw)
    assert ei.value.content_type == "application/json"
    assert "error" in json.loads(ei.value.text)


def test_decode_json_and_require_object():
    assert decode_json(b'{"token_ids": [1, 2, 18446744073709551615]}') == {
        "token_ids": [1, 2, 18446744073709551615]}
    assert decode_json(b"[" * 64 + b"]" * 64)
    assert require_object({"a": 1}) == {"a": 1}
    for bad in ([], 3, "x", None):
        with pytest.raises(web.HTTPBadRequest):
            require_object(bad)


def _nested(depth: int) -> bytes:
    """A JSON object ``depth`` arrays and objects deep, with brackets, quotes and escapes
    inside its strings (which do not nest)."""
    inner: object = {"s": '[{"\\[', "t": "]]}}\\", "u": [1, 2]}  # 2 deep
    for i in range(depth - 2):
        inner = [inner] if i % 2 else {"k": inner}
    return json.dumps(inner).encode()


def test_decode_json_nesting_past_64_is_400():
    """Code that encodes a body again (json.dumps) or walks it recursively fails near 990
    levels: a body nesting more than 64 arrays and objects is a 400 before it is decoded."""
    assert MAX_JSON_DEPTH == 64
    assert decode_json(_nested(64)) == json.loads(_nested(64))
    assert decode_json(_nested(64).decode()) == json.loads(_nested(64))
    assert decode_json(b'{"a": "' + b"[" * 5000 + b'"}') == {"a": "[" * 5000}
    for raw in (_nested(65), b"[" * 65 + b"]" * 65, b'{"a":' * 65 + b"1" + b"}" * 65,
                b"[" * 975 + b"]" * 975, _nested(65).decode()):
        with pytest.raises(web.HTTPBadRequest) as ei:
            decode_json(raw)
        assert "more than 64 levels deep" in json.loads(ei.value.text)["error"]


async def test_nesting_past_64_is_400_through_the_server():
    async with serve() as (_, port, _app):
        assert (await request(port, "POST", "/json", _nested(64)))[0] == 200
        status, _, body = await request(port, "POST", "/json", _nested(65))
        assert status == 400 and "levels deep" in error_of(body)


def test_limits_validate():
    with pytest.raises(ValueError):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError):
        HttpLimits(max_connections_per_address=0)
    assert HttpLimits().max_connections_per_address == HttpLimits().max_connections // 2


# ---------------------------------------------------------------------------- server


async def _json(request: web.Request) -> web.Response:
    body = await read_json_body(request, max_bytes=LIMITS.max_body_bytes,
                                timeout_s=LIMITS.body_timeout_s)
    return web.json_response({"type": type(body).__name__})


async def _obj(request: web.Request) -> web.Response:
    body = await read_json_object(request, max_bytes=LIMITS.max_body_bytes,
                                  timeout_s=LIMITS.body_timeout_s)
    return web.json_response({"keys": sorted(body)})


async def _small(request: web.Request) -> web.Response:  # a tighter cap than the app's
    body = await read_json_body(request, max_bytes=100, timeout_s=LIMITS.body_timeout_s)
    return web.json_response({"type": type(body).__name__})


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query["s"]))
    return web.Response(text="slow ok")


BIG = 32 << 20  # more than loopback socket buffers hold


async def _big(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * BIG)


_OWN_STARTED = asyncio.Event()  # (set by /own's handler before it reads its body)


@reads_own_body
async def _own(request: web.Request) -> web.Response:
    _OWN_STARTED.set()
    body = await read_json_body(request, max_bytes=100, timeout_s=2.0)
    return web.json_response(body)


def _app() -> web.Application:
    app = web.Application()
    app.add_routes([web.post("/json", _json), web.post("/obj", _obj),
                    web.post("/small", _small), web.get("/ok", _ok), web.get("/slow", _slow),
                    web.get("/big", _big), web.post("/own", _own)])
    return app


@contextlib.asynccontextmanager
async def serve(limits: HttpLimits = LIMITS, *, guarded: bool = True):
    """(site, port, app) of a running server; plain web.TCPSite when not guarded."""
    app = _app()
    if guarded:
        guard_app(app, limits)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        if guarded:
            site = await start_guarded(runner, HOST, 0, limits)
        else:
            site = web.TCPSite(runner, HOST, 0)
            await site.start()
        yield site, int(runner.addresses[0][1]), app
    finally:
        await asyncio.wait_for(runner.cleanup(), 5.0)


def _tiny_source(**settings):
    """A SourceService of one 4-block pool (not started)."""
    from kvkern.cache.pool import BlockPool  # noqa: PLC0415
    from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology  # noqa: PLC0415
    from kvkern.xfer.kvgroup import KVGroup, RankKV  # noqa: PLC0415
    from kvkern.xfer.source import SourceService  # noqa: PLC0415

    model = ModelKVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4,
                        dtype="float16")
    topo = Topology(model=model, parallel=Parallelism())
    layout = topo.local_layout(0, 4, "trtllm")
    group = KVGroup(topo, 0, BlockPool(4, block_size=4),
                    {0: RankKV(0, layout, layout.allocate())})
    return SourceService([group], worker_id="src", **settings)


async def read_response(reader: asyncio.StreamReader, timeout: float = 3.0):
    """(status, headers, body) of one HTTP/1.1 response with a Content-Length."""
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip()
                   for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def request(port: int, method: str, path: str, body: bytes | None = None, *,
                  headers: str = "", timeout: float = 3.0):
    """One request on a fresh connection: (status, headers, body)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        extra = f"Content-Length: {len(body)}\r\n" if body is not None else ""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     f"{extra}{headers}\r\n".encode() + (body or b""))
        await writer.drain()
        return await read_response(reader, timeout)
    finally:
        writer.close()


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    """True if the peer closes (EOF or reset) within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(4096):
                pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


# ---------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "read_json_body-only"])
async def test_malformed_bodies_are_400_json(guarded):
    async with serve(guarded=guarded) as (_, port, _app):
        for path, raw in [("/json", b"[" * 100_000), ("/json", b'{"a": "\xff"}'),
                          ("/json", b"{"), ("/obj", b"[1, 2]"), ("/obj", b'"s"')]:
            status, headers, body = await request(port, "POST", path, raw)
            assert status == 400, (path, raw[:20], body)
            assert headers["content-type"].startswith("application/json")
            assert error_of(body)
        status, _, body = await request(port, "POST", "/obj", b'{"b": 1, "a": [[]]}')
        assert (status, json.loads(body)) == (200, {"keys": ["a", "b"]})


async def test_malformed_chunked_encoding_is_not_500():
    async with serve() as (_, port, _app):
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"POST /json HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"zz\r\nhello\r\n0\r\n\r\n")
        status, _, _ = await read_response(reader)
        writer.close()
        assert 400 <= status < 500
        assert (await request(port, "GET", "/ok"))[0] == 200


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "read_json_body-only"])
async def test_content_encoding_bad_is_400_bomb_is_413(guarded):
    async with serve(guarded=guarded) as (_, port, _app):
        status, _, body = await request(port, "POST", "/json", b"hello",
                                        headers="Content-Encoding: gzip\r\n")
        assert status == 400 and "could not be read" in error_of(body)
        bomb = gzip.compress(b"[" + b" " * (8 << 20) + b"]")  # 8 KiB -> 8 MiB
        status, _, body = await request(port, "POST", "/json", bomb,
                                        headers="Content-Encoding: gzip\r\n")
        assert status == 413 and error_of(body)
        ok = gzip.compress(b'{"a": [1]}')
        status, _, body = await request(port, "POST", "/obj", ok,
                                        headers="Content-Encoding: gzip\r\n")
        assert (status, json.loads(body)) == (200, {"keys": ["a"]})


async def test_oversize_body_is_413_before_and_while_reading():
    async with serve() as (_, port, app):
        # honest Content-Length over the limit: 413 before a byte of the body is sent
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(f"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: {(1 << 20) + 1}"
                     "\r\n\r\n".encode())
        status, _, body = await read_response(reader)
        assert status == 413 and "larger than" in error_of(body)
        writer.close()
        # no Content-Length (chunked), more than the limit: 413 from the running size
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"POST /json HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))
        with contextlib.suppress(ConnectionError):
            for _ in range(20):  # 1.25 MiB
                writer.write(chunk)
                await writer.drain()
        status, _, body = await read_response(reader)
        assert status == 413 and error_of(body)
        writer.close()
        assert guard_stats(app).too_large == 2
        # read_json_body's own cap below the app's: honest and chunked both 413
        assert (await request(port, "POST", "/small", b" " * 101))[0] == 413
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"POST /small HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"c8\r\n" + b" " * 200 + b"\r\n0\r\n\r\n")
        assert (await read_response(reader))[0] == 413
        writer.close()
        assert (await request(port, "POST", "/small", b"[1]"))[0] == 200


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "read_json_body-only"])
async def test_lying_content_length_is_408_and_others_are_served(guarded):
    async with serve(guarded=guarded) as (_, port, app):
        reader, writer = await asyncio.open_connection(HOST, port)
        t0 = time.monotonic()
        writer.write(b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                     b'{"a": 1234')  # 10 of the 1000 bytes, then nothing; kept open
        await writer.drain()
        assert (await request(port, "GET", "/ok"))[0] == 200  # served meanwhile
        status, headers, body = await read_response(reader, timeout=3.0)
        elapsed = time.monotonic() - t0
        assert status == 408 and "not received within" in error_of(body)
        assert headers.get("connection", "").lower() == "close"
        assert LIMITS.body_timeout_s * 0.9 <= elapsed < LIMITS.body_timeout_s + 1.0
        writer.close()
        if guarded:
            assert guard_stats(app).body_timeouts == 1
        assert (await request(port, "GET", "/ok"))[0] == 200


@pytest.mark.parametrize("method, path", [("GET", "/ok"), ("POST", "/nowhere"),
                                          ("PUT", "/json")],
                         ids=["get-with-a-body", "no-such-path", "no-such-method"])
async def test_a_body_nothing_reads_is_refused_unread(method, path):
    """A body that no handler takes (a GET's, or one sent to a path or method no route
    serves) is refused at once, before any of it is read or buffered, and the connection
    closed: nothing holds up to ``max_body_bytes`` of it for the body timeout."""
    async with serve() as (_, port, app):
        reader, writer = await asyncio.open_connection(HOST, port)
        t0 = time.monotonic()
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
                     "\r\n".encode())  # and not one byte of the body
        await writer.drain()
        status, headers, body = await read_response(reader, timeout=3.0)
        assert status == 413 and "takes no request body" in error_of(body)
        assert time.monotonic() - t0 < LIMITS.body_timeout_s
        assert headers.get("connection", "").lower() == "close"
        assert guard_stats(app).body_timeouts == 0
        assert await closed_by_peer(reader, 1.0)
        writer.close()


async def test_a_handler_that_reads_its_own_body_gets_the_request_unread():
    """A handler marked ``reads_own_body`` runs before its body has arrived (and reads it
    itself, bounded), so requests waiting in it for a limit hold no body."""
    _OWN_STARTED.clear()
    async with serve() as (_, port, _app):
        reader, writer = await asyncio.open_connection(HOST, port)
        body = b'{"a": 1}'
        writer.write(b"POST /own HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        await asyncio.wait_for(_OWN_STARTED.wait(), 2.0)  # before one byte of the body
        writer.write(body)
        await writer.drain()
        status, _, got = await read_response(reader)
        assert status == 200 and json.loads(got) == {"a": 1}
        writer.close()


# ---------------------------------------------------------------------------- connections


async def test_slowloris_sockets_are_closed_while_normal_clients_are_served():
    async with serve() as (site, port, _app):
        conns = [await asyncio.open_connection(HOST, port) for _ in range(50)]
        t0 = time.monotonic()
        for _, w in conns:
            w.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n")
        for i in range(3):  # trickle a header line now and then: no extension of the deadline
            await asyncio.sleep(0.1)
            for _, w in conns:
                with contextlib.suppress(ConnectionError):
                    w.write(f"X-Pad-{i}: y\r\n".encode())
            assert (await request(port, "GET", "/ok"))[0] == 200  # during the attack
        closed = await asyncio.gather(*(closed_by_peer(r, 2.0) for r, _ in conns))
        elapsed = time.monotonic() - t0
        assert all(closed)
        assert elapsed < LIMITS.header_timeout_s + 1.0
        assert site.closed_header_timeout == 50
        for _, w in conns:
            w.close()
        assert (await request(port, "GET", "/ok"))[0] == 200
        await _until(lambda: site.connections_open == 0)


async def _until(cond, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def test_connection_limit_refuses_the_excess_and_recovers():
    limits = HttpLimits(header_timeout_s=5.0, body_timeout_s=1.0, max_connections=4)
    async with serve(limits) as (site, port, _app):
        held = [await asyncio.open_connection(HOST, port) for _ in range(4)]
        await _until(lambda: site.connections_open == 4)
        reader, writer = await asyncio.open_connection(HOST, port)  # the 5th
        status, headers, body = await read_response(reader)
        assert status == 503 and error_of(body) == "too many connections"
        assert await closed_by_peer(reader, 1.0)
        writer.close()
        assert site.refused_limit == 1 and site.connections_open == 4
        for _, w in held[:2]:
            w.close()
        await _until(lambda: site.connections_open == 2)
        assert (await request(port, "GET", "/ok"))[0] == 200
        assert site.connections_total == 5
        for _, w in held[2:]:
            w.close()


async def test_one_address_cannot_take_every_connection():
    """Keep-alive connections from one address that keep requesting (and so are never idle
    for a head timeout) hold at most ``max_connections_per_address`` slots: another host is
    still served, and a slot freed is one the address may take again."""
    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=64,
                        max_connections_per_address=2)
    async with serve(limits) as (site, port, _app):
        stop = asyncio.Event()

        async def holder(reader, writer) -> int:
            served = 0
            while not stop.is_set():
                writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await read_response(reader))[0] == 200
                served += 1
                await asyncio.sleep(0.1)
            return served

        conns = [await asyncio.open_connection(HOST, port) for _ in range(3)]
        status, _, body = await read_response(conns[2][0])  # the third: refused at once
        assert status == 503 and error_of(body) == "too many connections"
        holders = [asyncio.ensure_future(holder(r, w)) for r, w in conns[:2]]
        await asyncio.sleep(0.8)  # past a head timeout: the two admitted are kept alive
        reader, writer = await asyncio.open_connection(HOST, port)  # this address: still full
        assert (await read_response(reader))[0] == 503
        writer.close()
        reader, writer = await asyncio.open_connection(HOST, port, local_addr=("127.0.0.2", 0))
        writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await read_response(reader))[0] == 200  # another host is served
        writer.close()
        stop.set()
        assert min(await asyncio.gather(*holders)) > 4
        assert site.refused_limit == 2 and site._from == {HOST: 2}
        for _, w in conns:
            w.close()
        await _until(lambda: site.connections_open == 0 and not site._from)
        assert (await request(port, "GET", "/ok"))[0] == 200  # its slots are free again


async def test_an_ipv6_host_is_counted_by_its_slash_64():
    """A host given an IPv6 /64 may connect from any address in it: the per-address bound
    counts the /64, so changing addresses inside it takes no further slot."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    limits = HttpLimits(header_timeout_s=2.0, max_connections_per_address=1)
    app = guard_app(_app(), limits)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = await start_guarded(runner, "::1", 0, limits)
        port = int(runner.addresses[0][1])
        reader, writer = await asyncio.open_connection("::1", port)
        await _until(lambda: site._from == {"::/64": 1})
        reader2, writer2 = await asyncio.open_connection("::1", port)
        assert (await read_response(reader2))[0] == 503 and site.refused_limit == 1
        writer.close()
        writer2.close()
        await _until(lambda: not site._from)
    finally:
        await asyncio.wait_for(runner.cleanup(), 5.0)


async def test_keepalive_idle_connection_is_closed_after_the_timeout():
    async with serve() as (site, port, _app):
        reader, writer = await asyncio.open_connection(HOST, port)
        for _ in range(2):  # reused while active
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(reader))[0] == 200
            await asyncio.sleep(LIMITS.header_timeout_s / 2)
        t0 = time.monotonic()
        assert await closed_by_peer(reader, 2.0)
        assert LIMITS.header_timeout_s / 2 - 0.1 < time.monotonic() - t0 < 1.0
        assert site.closed_header_timeout == 1
        writer.close()


async def test_long_request_is_not_cut_off_by_the_header_timeout():
    async with serve() as (site, port, _app):
        reader, writer = await asyncio.open_connection(HOST, port)
        s = LIMITS.header_timeout_s * 2.5
        writer.write(f"GET /slow?s={s} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        status, _, body = await read_response(reader, timeout=s + 2)
        assert (status, body) == (200, b"slow ok")
        writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection is still usable
        assert (await read_response(reader))[0] == 200
        assert site.closed_header_timeout == 0
        writer.close()


async def test_response_to_a_slow_reader_goes_out_a_stalled_one_is_dropped():
    async with serve() as (site, port, _app):
        # pauses longer than header_timeout before reading, then reads: served in full
        reader, writer = await asyncio.open_connection(HOST, port, limit=1 << 20)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(LIMITS.header_timeout_s * 1.4)
        status, _, body = await read_response(reader, timeout=5.0)
        assert status == 200 and len(body) == BIG
        assert site.closed_header_timeout == 0
        writer.close()
        # never reads: dropped once a whole header_timeout passes without progress
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        await _until(lambda: site.closed_header_timeout == 1, timeout=3.0)
        writer.close()
        await _until(lambda: site.connections_open == 0)


async def test_guarded_site_needs_a_guarded_app():
    runner = web.AppRunner(_app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        with pytest.raises(RuntimeError, match="guard_app"):
            GuardedSite(runner, HOST, 0, limits=LIMITS)
    finally:
        await runner.cleanup()
    app = _app()
    guard_app(app, LIMITS)
    with pytest.raises(RuntimeError, match="already"):
        guard_app(app, LIMITS)


async def test_refused_peer_requests_are_logged_once_per_address_and_quoted(caplog):
    """A source refuses unauthenticated requests under /kvkern/: each is counted, but only
    the first from each address is logged (for at most 64 addresses), with the path as sent
    (percent-encoded, quoted, cut to 200 characters): a flood of requests whose decoded path
    holds line breaks neither forges log lines nor fills the log."""
    from kvkern.xfer.auth import Credential  # noqa: PLC0415

    svc = _tiny_source(credential=Credential("b" * 64, peer_id="src"))
    forged = "/kvkern/x%0a2030-01-01%20CRITICAL%20kvkern:%20forged" + "A" * 7000
    caplog.set_level(logging.WARNING, logger="kvkern.xfer.source")
    await svc.start()
    try:
        reader, writer = await asyncio.open_connection(HOST, svc.http_port)
        writer.write(f"GET {forged} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 200)
        for _ in range(200):
            assert (await read_response(reader))[0] == 401
        writer.close()
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 1 and svc.auth_refusals == 200, lines[:3]
        assert "\n" not in lines[0] and "'/kvkern/x%0a2030-01-01%20CRITICAL" in lines[0]
        assert len(lines[0]) < 400 and f"(+{len(forged) - 200} characters)" in lines[0]
        for i in range(2, LOGGED_ADDRESSES + 8):  # other addresses: each once, 64 in all
            reader, writer = await asyncio.open_connection(
                HOST, svc.http_port, local_addr=(f"127.0.0.{i}", 0))
            writer.write(b"GET /kvkern/v1/state HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
            assert [(await read_response(reader))[0] for _ in range(2)] == [401, 401]
            writer.close()
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == LOGGED_ADDRESSES and svc.auth_refusals == 200 + 2 * 70
        assert "from 127.0.0.64:" in lines[-1] and "no credentials" in lines[-1]
        scraped = svc.metrics.registry.get_sample_value(
            "kvkern_source_http_refused_total", {"reason": "unauthenticated"})
        assert scraped == 200 + 2 * 70
    finally:
        await svc.close()


def test_run_guarded_serves_and_stops_on_sigterm():
    code = ("import sys; from aiohttp import web; "
            "from kvkern.xfer.httpguard import HttpLimits, guard_app, run_guarded; "
            "app = web.Application(); "
            "app.router.add_get('/ok', lambda r: web.Response(text='ok')); "
            "guard_app(app, HttpLimits()); "
            "run_guarded(app, host='127.0.0.1', port=int(sys.argv[1]), limits=HttpLimits())")
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)])
    try:
        from kvkern.serve.httpjson import get_text  # noqa: PLC0415

        deadline = time.monotonic() + 10
        while True:
            try:
                assert get_text(f"http://{HOST}:{port}/ok", timeout=1.0) == "ok"
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_source_reports_every_http_refusal_as_a_metric():
    """Connections past the limits and heads that never come are counted on the source's
    ``kvkern_source_http_refused_total``, beside refused credentials."""
    from kvkern.xfer.metrics import HTTP_REFUSALS  # noqa: PLC0415

    limits = HttpLimits(header_timeout_s=0.3, max_connections_per_address=1, max_body_bytes=8)
    svc = _tiny_source(credential=None, http_limits=limits)

    def scraped() -> dict[str, float]:
        return {r: svc.metrics.registry.get_sample_value(
            "kvkern_source_http_refused_total", {"reason": r}) for r in HTTP_REFUSALS}

    await svc.start()
    try:
        assert set(scraped().values()) == {0}
        reader, writer = await asyncio.open_connection(HOST, svc.http_port)  # silent
        reader2, writer2 = await asyncio.open_connection(HOST, svc.http_port)
        assert (await read_response(reader2))[0] == 503  # one address, one connection
        assert await closed_by_peer(reader, 2.0)  # no head in time
        writer.close()
        writer2.close()
        await _until(lambda: svc._site.connections_open == 0)
        assert (await request(svc.http_port, "POST", "/healthz", body=b"x" * 64))[0] == 413
        assert scraped() == {"unauthenticated": 0, "connection_limit": 1,
                             "header_timeout": 1, "body_timeout": 0, "body_refused": 1}
    finally:
        await svc.close()
