"""HTTP hardening for kvkern's aiohttp servers: bounded header and body read time, a
connection limit, and JSON bodies whose every malformation is a 4xx, never a 500.

Three pieces, used together::

    limits = HttpLimits(max_body_bytes=16 << 20)
    app = web.Application()
    guard_app(app, limits)                     # before runner.setup(): middleware, body size
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = await start_guarded(runner, host, port, limits)   # instead of web.TCPSite
    port = runner.addresses[0][1]

    async def handler(request):
        body = await read_json_object(request, max_bytes=limits.max_body_bytes,
                                      timeout_s=limits.body_timeout_s)

- :class:`GuardedSite` (a :class:`aiohttp.web.TCPSite`) wraps each accepted connection. A
  connection must deliver a complete request head within ``header_timeout_s`` of connecting,
  or of the end of its previous request (keep-alive idle); otherwise it is closed (slowloris).
  While a response is still being written the deadline moves on as long as the peer keeps
  reading. Connections beyond ``max_connections``, or beyond ``max_connections_per_address``
  from one remote host (an IPv4 address, an IPv6 /64), get a one-line 503 and are closed at
  once, before aiohttp sees them. Counters: ``connections_open``, ``connections_total``,
  ``closed_header_timeout``, ``refused_limit``.
- :func:`guard_app` installs the outermost middleware. It tells the site when a request is in
  progress (its handler may take as long as it needs) and reads every request body up front
  under ``body_timeout_s`` and ``max_body_bytes`` (408 / 413, JSON), so no handler waits on a
  body that never comes; ``request.read()`` / ``read_json_body`` then return the read bytes.
  Counters on :func:`guard_stats`: ``body_timeouts`` (408), ``too_large`` (413: too
  large, or sent where nothing reads it).
- :func:`read_json_body` / :func:`read_json_object` / :func:`decode_json`: bounded read and a
  decode (msgspec) whose every failure — syntax, invalid UTF-8, NaN, nesting more than
  :data:`MAX_JSON_DEPTH` (64) arrays and objects deep, integers out of range — is a 400
  ``{"error": ...}``.
- :func:`log_refused`: a WARNING for a request the application refused (authentication, say),
  once per remote address, its path quoted and cut short: a flood of them writes little.

Every error body here is one line of JSON: ``{"error": "..."}``.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from kvkern.xfer.networks import LOGGED_ADDRESSES, FirstSeen, host_key

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout below 3.11
    from async_timeout import timeout as _timeout

__all__ = ["LOGGED_ADDRESSES", "MAX_JSON_DEPTH", "GuardStats", "GuardedSite", "HttpLimits",
           "decode_json", "guard_app", "guard_stats", "json_error", "log_refused",
           "read_json_body", "read_json_object", "reads_own_body", "require_object",
           "run_guarded", "start_guarded"]


@dataclass(frozen=True)
class HttpLimits:
    """Bounds for one HTTP server.

    header_timeout_s  a connection with no complete request head this long after connecting,
                      or after its previous request finished, is closed
    body_timeout_s    the whole request body must arrive within this (else 408)
    max_connections   open connections per site; more are answered 503 and closed
    max_connections_per_address
                      open connections from one remote host (an IPv4 address, an IPv6
                      /64); more are answered 503 and closed, so that one host cannot take
                      every slot. The default, half the default ``max_connections``, leaves
                      room for a ``kvkern router`` at its ``--max-forwards`` (64 to one
                      worker) beside its block listings; a proxy that forwards many clients
                      from one address shares this bound
    max_body_bytes    larger request bodies get 413 (Content-Length checked before reading,
                      the running size while reading)
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 256
    max_connections_per_address: int = 128
    max_body_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("HttpLimits: timeouts must be > 0")
        if (self.max_connections < 1 or self.max_connections_per_address < 1
                or self.max_body_bytes < 0):
            raise ValueError("HttpLimits: max_connections and max_connections_per_address "
                             "must be >= 1, max_body_bytes >= 0")


# ---------------------------------------------------------------------------- JSON bodies

_DECODER = msgspec.json.Decoder()


def json_error(cls: type[web.HTTPException], message: str, *, close: bool = False,
               **kwargs: Any) -> web.HTTPException:
    """An aiohttp HTTP exception of class ``cls`` whose body is ``{"error": message}``
    (``kwargs``: the class's own arguments); ``close``: the connection closes after it (the
    body may be unread)."""
    exc = cls(text=json.dumps({"error": message}), content_type="application/json", **kwargs)
    if close:
        exc.force_close()
    return exc


MAX_JSON_DEPTH = 64  # arrays and objects one inside another; json.dumps stops near 990

# outside strings, "[" and "{" count +1, "]" and "}" -1 (as signed bytes), the rest is dropped
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _too_deep(raw: bytes | bytearray) -> bool:
    """Whether ``raw`` nests arrays and objects more than :data:`MAX_JSON_DEPTH` deep,
    from the brackets outside strings, in loops that run in C: O(n), ~0.3 s for 16 MiB of
    brackets (decoding those takes ~2 s), nothing for a body with at most 64 of them. Exact
    for valid JSON, in which a backslash only starts an escape inside a string: with the
    ``\\\\`` and ``\\"`` escapes gone, every ``"`` left opens or closes a string. (Invalid
    JSON is a 400 either way.)"""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # (every ordinary body)
        return False
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    steps = b"".join(raw.split(b'"')[::2]).translate(_BRACKETS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", steps)), default=0) > MAX_JSON_DEPTH


def decode_json(raw: bytes | bytearray | memoryview | str) -> Any:
    """Strict JSON (RFC 8259, UTF-8, no NaN) -> Python objects, at most
    :data:`MAX_JSON_DEPTH` arrays and objects deep (so that code encoding it again with
    ``json.dumps`` or walking it recursively never meets the recursion limit); any malformed
    input, and a deeper one (checked before it is decoded), raises ``web.HTTPBadRequest``
    with a JSON error body."""
    data = raw if isinstance(raw, (bytes, bytearray)) else (
        raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw))
    if _too_deep(data):
        raise json_error(web.HTTPBadRequest, f"body nests arrays and objects more than "
                                             f"{MAX_JSON_DEPTH} levels deep")
    try:
        return _DECODER.decode(raw)
    # msgspec.DecodeError (a ValueError) for syntax, UTF-8 and range; RecursionError for
    # nesting past the recursion limit (the depth check is exact for valid JSON only)
    except (ValueError, RecursionError) as exc:
        raise json_error(web.HTTPBadRequest,
                         f"body is not JSON: {type(exc).__name__}: {exc}") from None


def require_object(body: Any) -> dict[str, Any]:
    """``body`` if it is a JSON object, else ``web.HTTPBadRequest`` (JSON error body)."""
    if not isinstance(body, dict):
        raise json_error(web.HTTPBadRequest,
                         f"body must be a JSON object, not {type(body).__name__}")
    return body


def _too_large(max_bytes: int) -> web.HTTPException:
    return json_error(web.HTTPRequestEntityTooLarge, f"body larger than {max_bytes} bytes",
                      close=True, max_size=max_bytes)


def _unreadable(exc: BaseException) -> web.HTTPException:
    return json_error(web.HTTPBadRequest, f"body could not be read: {exc}", close=True)


def _no_body(method: str) -> web.HTTPException:
    return json_error(web.HTTPRequestEntityTooLarge, f"this {method} takes no request body",
                      close=True, max_size=0)


def reads_own_body(handler: _Handler) -> _Handler:
    """Mark an aiohttp handler that reads its own body with :func:`read_json_body` (bounded
    in size and time), when it is ready to (after a concurrency limit, say): :func:`guard_app`
    passes its requests on unread instead of reading every body up front."""
    target = getattr(handler, "__func__", handler)  # (a bound method's function)
    target._kvkern_reads_own_body = True
    return handler


def _body_timeout(timeout_s: float) -> web.HTTPException:
    return json_error(web.HTTPRequestTimeout,
                      f"request body not received within {timeout_s:g} s", close=True)


async def _read_capped(request: web.BaseRequest, max_bytes: int) -> bytes:
    if request.content.at_eof():  # already read (guard_app's middleware) or empty
        return await request.read()
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


async def read_json_body(request: web.BaseRequest, *, max_bytes: int,
                         timeout_s: float) -> Any:
    """The request body decoded as JSON, read within ``timeout_s`` (else 408) and at most
    ``max_bytes`` long (else 413, from Content-Length before reading and from the running
    size while reading); malformed JSON is a 400. Every error is an aiohttp HTTP exception
    with a JSON body. Consumes the body: a later ``request.read()`` returns it only if it was
    already read before (as :func:`guard_app`'s middleware does)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise _too_large(max_bytes)
    try:
        async with _timeout(timeout_s):
            raw = await _read_capped(request, max_bytes)
    except asyncio.TimeoutError:
        raise _body_timeout(timeout_s) from None
    except web.RequestPayloadError as exc:  # bad chunking or Content-Encoding
        raise _unreadable(exc) from None
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    return decode_json(raw)


async def read_json_object(request: web.BaseRequest, *, max_bytes: int,
                           timeout_s: float) -> dict[str, Any]:
    """:func:`read_json_body` that also requires a JSON object (400 otherwise)."""
    return require_object(await read_json_body(request, max_bytes=max_bytes,
                                               timeout_s=timeout_s))


# ---------------------------------------------------------------------------- connections


class _Conn(asyncio.Protocol):
    """One accepted connection: aiohttp's protocol inside, a head deadline around it."""

    __slots__ = ("_site", "_inner", "transport", "address", "deadline", "handle", "busy",
                 "_unsent")

    def __init__(self, site: GuardedSite) -> None:
        self._site = site
        self._inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.address: str | None = None  # the peer's host (host_key), None where unknown
        self.deadline = 0.0
        self.handle: asyncio.TimerHandle | None = None
        self.busy = 0
        self._unsent = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        peer = transport.get_extra_info("peername")
        address = host_key(peer[0]) if isinstance(peer, tuple) and peer else None
        if site.connections_open >= site.limits.max_connections or (
                address is not None
                and site._from.get(address, 0) >= site.limits.max_connections_per_address):
            site.refused_limit += 1
            transport.write(_REFUSED)  # type: ignore[attr-defined]
            transport.close()
            return
        self.transport = transport  # type: ignore[assignment]
        self.address = address
        if address is not None:
            site._from[address] = site._from.get(address, 0) + 1
        site.connections_open += 1
        site.connections_total += 1
        site._registry[transport] = self
        self.arm()
        self._inner = site._protocol_factory()
        self._inner.connection_made(transport)

    def arm(self) -> None:
        """(Re)start the head deadline: from now, ``header_timeout_s``."""
        loop = self._site._loop
        self.deadline = loop.time() + self._site.limits.header_timeout_s
        if self.handle is None:
            self.handle = loop.call_at(self.deadline, self._expire)

    def _expire(self) -> None:
        self.handle = None
        transport = self.transport
        if self.busy or transport is None or transport.is_closing():
            return  # a request in progress re-arms when it finishes
        loop = self._site._loop
        now = loop.time()
        if now < self.deadline:  # re-armed since this timer was set
            self.handle = loop.call_at(self.deadline, self._expire)
            return
        unsent = transport.get_write_buffer_size()
        if unsent and unsent != self._unsent:  # a response still going out, the peer reading
            self._unsent = unsent
            self.arm()
            return
        self._site.closed_header_timeout += 1
        if unsent:
            transport.abort()
        else:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        inner = self._inner
        if inner is None:
            return
        self._inner = None
        site = self._site
        site.connections_open -= 1
        address = self.address
        if address is not None:
            left = site._from[address] - 1
            if left:
                site._from[address] = left
            else:
                del site._from[address]
        site._registry.pop(self.transport, None)
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.transport = None
        inner.connection_lost(exc)

    # the rest of asyncio.Protocol, passed through to aiohttp's protocol
    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


_REFUSED_BODY = b'{"error": "too many connections"}'
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(_REFUSED_BODY), _REFUSED_BODY))


class GuardedSite(web.TCPSite):
    """A :class:`aiohttp.web.TCPSite` that closes connections with no complete request head
    within ``limits.header_timeout_s`` (from connect, or from the end of the previous request)
    and keeps at most ``limits.max_connections`` open, at most
    ``limits.max_connections_per_address`` of them from one remote host (an IPv4 address, an
    IPv6 /64). The runner's application must have been passed to :func:`guard_app` (the
    middleware tells the site when a request is in progress). Counters (plain ints, read them for metrics)::

        connections_open        now
        connections_total       admitted since start
        closed_header_timeout   closed for no complete head in time (slowloris, idle)
        refused_limit           answered 503 and closed for max_connections or
                                max_connections_per_address
    """

    def __init__(self, runner: web.BaseRunner, host: str | None = None,
                 port: int | None = None, *, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        app = getattr(runner, "app", None)
        registry = app.get(_REGISTRY) if app is not None else None
        if registry is None:
            raise RuntimeError("GuardedSite: call guard_app(app, limits) before runner.setup()")
        self.limits = limits
        self._registry: dict[asyncio.BaseTransport, _Conn] = registry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._protocol_factory: Callable[[], asyncio.Protocol] | None = None
        self.connections_open = 0
        self.connections_total = 0
        self.closed_header_timeout = 0
        self.refused_limit = 0
        self._from: dict[str, int] = {}  # open connections by remote host (host_key)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start is replaced here
        self._protocol_factory = self._runner.server  # aiohttp's web.Server: one per connection
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Conn(self), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    def stats(self) -> dict[str, int]:
        """The counters as a dict."""
        return {"connections_open": self.connections_open,
                "connections_total": self.connections_total,
                "closed_header_timeout": self.closed_header_timeout,
                "refused_limit": self.refused_limit}


# ---------------------------------------------------------------------------- application


class GuardStats:
    """Counters of :func:`guard_app`'s middleware: ``body_timeouts`` (408), ``too_large``
    (413: a body too large, or one sent where nothing reads it); and the remote addresses
    :func:`log_refused` has named in the log."""

    __slots__ = ("body_timeouts", "too_large", "refusals_logged")

    def __init__(self) -> None:
        self.body_timeouts = 0
        self.too_large = 0
        self.refusals_logged = FirstSeen()


_REGISTRY: web.AppKey[dict[asyncio.BaseTransport, _Conn]] = web.AppKey(
    "kvkern_httpguard_conns", dict)
_STATS: web.AppKey[GuardStats] = web.AppKey("kvkern_httpguard_stats", GuardStats)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def guard_app(app: web.Application, limits: HttpLimits) -> web.Application:
    """Install the guard middleware (outermost) and ``client_max_size = max_body_bytes`` on
    ``app``, which must not be frozen yet (call before ``runner.setup()``). Returns ``app``.

    The middleware reads each request's body before the handler runs: within
    ``body_timeout_s`` (else 408) and at most ``max_body_bytes`` (else 413, from Content-Length
    first; the decoded size while reading), 400 if it cannot be decoded (Content-Encoding);
    each closes the connection. Handlers then get the bytes from ``request.read()``,
    ``request.json()`` or :func:`read_json_body` at once. A body sent with a GET, HEAD or
    OPTIONS, or to a path or method no route serves, is refused (413) unread, and so is
    nothing of it buffered before the handler that would answer it runs (an authentication
    middleware, say); a handler marked :func:`reads_own_body` gets its request unread. A
    request without a body costs two attribute writes and a clock read."""
    if app.frozen:
        raise RuntimeError("guard_app: the application is frozen (call before runner.setup())")
    if _REGISTRY in app:
        raise RuntimeError("guard_app: already guarded")
    registry: dict[asyncio.BaseTransport, _Conn] = {}
    stats = GuardStats()
    app[_REGISTRY] = registry
    app[_STATS] = stats
    # Application takes client_max_size only in its constructor; request.read() enforces it
    app._client_max_size = limits.max_body_bytes
    max_bytes, body_timeout_s = limits.max_body_bytes, limits.body_timeout_s

    @web.middleware
    async def httpguard(request: web.Request, handler: _Handler) -> web.StreamResponse:
        conn = registry.get(request.transport)
        if conn is not None:
            conn.busy += 1
        try:
            if request.body_exists and (
                    request.method in _NO_BODY_METHODS
                    or request.match_info.http_exception is not None):
                stats.too_large += 1
                raise _no_body(request.method)  # (404, 405, a GET: nothing reads it)
            if request.body_exists and not getattr(request.match_info.handler,
                                                   "_kvkern_reads_own_body", False):
                length = request.content_length
                if length is not None and length > max_bytes:
                    stats.too_large += 1
                    raise _too_large(max_bytes)
                try:
                    async with _timeout(body_timeout_s):
                        await request.read()
                except asyncio.TimeoutError:
                    stats.body_timeouts += 1
                    raise _body_timeout(body_timeout_s) from None
                except web.HTTPRequestEntityTooLarge:
                    stats.too_large += 1
                    raise _too_large(max_bytes) from None
                except web.RequestPayloadError as exc:  # bad chunking or Content-Encoding
                    raise _unreadable(exc) from None
            return await handler(request)
        finally:
            if conn is not None:
                conn.busy -= 1
                if not conn.busy:
                    conn.arm()

    app.middlewares.insert(0, httpguard)
    return app


def guard_stats(app: web.Application) -> GuardStats:
    """The middleware counters of an application passed to :func:`guard_app`."""
    return app[_STATS]


_LOGGED_PATH_CHARS = 200


def log_refused(logger: logging.Logger, request: web.BaseRequest, why: str) -> None:
    """Log a refused request (a WARNING naming its method, path and remote address, and
    ``why``), once for each remote address and for the first :data:`LOGGED_ADDRESSES`
    addresses of an application passed to :func:`guard_app`: the caller counts every
    refusal, the log names who was refused without growing with each request. The path is
    the one sent (still percent-encoded), quoted with ``repr`` and cut to 200 characters, so
    no request can write its own log lines nor long ones."""
    stats = request.app.get(_STATS)
    address = request.remote
    if stats is not None and not stats.refusals_logged.first(address):
        return
    path = request.raw_path
    cut = f" (+{len(path) - _LOGGED_PATH_CHARS} characters)" \
        if len(path) > _LOGGED_PATH_CHARS else ""
    logger.warning("refused %s %r%s from %s: %s (further refusals from this address are "
                   "counted, not logged)", request.method[:16], path[:_LOGGED_PATH_CHARS], cut,
                   address or "an unknown address", why)


async def start_guarded(runner: web.BaseRunner, host: str | None, port: int,
                        limits: HttpLimits) -> GuardedSite:
    """Start a :class:`GuardedSite` on ``host:port`` for a set-up runner whose application
    went through :func:`guard_app`; returns it (its counters; ``runner.addresses`` as for a
    ``web.TCPSite``)."""
    site = GuardedSite(runner, host, port, limits=limits)
    await site.start()
    return site


def run_guarded(app: web.Application, *, host: str, port: int, limits: HttpLimits,
                access_log: logging.Logger | None = None,
                on_listening: Callable[[int], None] | None = None) -> None:
    """Serve ``app`` on a :class:`GuardedSite` until SIGINT or SIGTERM, then clean up and
    return: ``web.run_app`` with the guard (``app`` goes through :func:`guard_app` here unless
    it already did). ``on_listening(port)`` is called once the site listens (the bound port,
    also for ``port=0``)."""
    if _REGISTRY not in app:
        guard_app(app, limits)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(app, access_log=access_log, handle_signals=False)
        await runner.setup()
        try:
            await start_guarded(runner, host, port, limits)
            if on_listening is not None:
                on_listening(runner.addresses[0][1])
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
