"""Helpers of ``test_zero_trust.py``: the fleet of worker processes it attacks, a raw UCX
client (an in-process :class:`~kvkern.xfer.transport.ConnectionPool` on its own event loop
thread), raw HTTP, a counting / lying local HTTP "source", and small readers of a worker's
``/metrics``, ``/v1/info`` and ``/proc/<pid>/status``.

Everything listens and connects on 127.0.0.1 only; every socket and HTTP call has a timeout;
every process and thread started here is stopped by whoever started it, in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import itertools
import json
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvkern.cache.hashing import salt_key, sequence_hashes
from kvkern.serve.httpjson import get_json, get_text
from kvkern.serve.procs import start_workers
from kvkern.xfer.auth import AUTH_HEADER, AUTH_RESPONSE_HEADER, Credential
from kvkern.xfer.messages import (
    _PREAMBLE,
    DEFAULT_CODEC,
    MAGIC,
    PROTOCOL_VERSION,
    PlanPiece,
    PullReply,
    PullRequest,
)
from kvkern.xfer.runtime import EventLoopThread
from kvkern.xfer.transport import CONTROL_TAG, ConnectionPool, Lane, TransportError, tag_for
from tests.reliability.harness import SCHEME, FaultWorker, T

HOST = "127.0.0.1"
NUM_BLOCKS = 256
BLOCK_BYTES = 2048  # one block of the tiny model: 2 layers x K,V x 2 heads x 4 tokens x 16 fp32
COMMON = ["--model", "tiny", "--num-blocks", str(NUM_BLOCKS), "--allow", "127.0.0.0/8",
          "--cost-guard", "off", "--log-level", "ERROR", "--metadata-timeout-s", "2",
          "--transfer-timeout-s", "5", "--deadline-s", "8"]
# A well-formed fleet secret that is not the test fleet's (tests/conftest.py's "5e" * 32).
OTHER_SECRET = "7f" * 32
FULL_PIECE = [PlanPiece(src_rank=0, layer_start=0, layer_stop=2, head_start=0, head_stop=2,
                        offset=0, length=BLOCK_BYTES)]
_TIDS = itertools.count(1)


# ------------------------------------------------------------------------------ the fleet


def start_fleet(specs: dict[str, tuple[list[str], dict[str, str] | None]], *,
                timeout: float = 120.0) -> dict[str, FaultWorker]:
    """Start every worker at once, each with its own extra environment, then wait for all."""
    return start_workers({n: args for n, (args, _) in specs.items()}, timeout=timeout,
                         worker_cls=FaultWorker,
                         envs={n: env for n, (_, env) in specs.items() if env})


def ucx_port(w: FaultWorker) -> int:
    return int(w.info["ucx_ports"]["0"])


def pool_stats(w: FaultWorker) -> dict[str, int]:
    """The pool counters from the real worker route ``/v1/info``."""
    return get_json(f"{w.url}/v1/info", timeout=10)["pool"]


def metric(w: FaultWorker, name: str, **labels: str) -> float:
    """One sample of the worker's ``/metrics`` (0 when absent)."""
    text = get_text(f"{w.url}/metrics", timeout=10)
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pat = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", re.M)
    for m in pat.finditer(text):
        got = ",".join(sorted((m.group(1) or "").split(","))) if m.group(1) else ""
        if got == want:
            return float(m.group(2))
    return 0.0


def metric_sum(w: FaultWorker, name: str) -> float:
    """The sum of every labelled sample of ``name``."""
    text = get_text(f"{w.url}/metrics", timeout=10)
    pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(1)) for m in pat.finditer(text))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def hashes(tokens: Sequence[int], salt: str = "") -> list[int]:
    """The pool hashes of ``tokens``' full blocks under a request's ``cache_salt``."""
    return sequence_hashes(list(tokens), T, SCHEME, cache_salt=salt_key(salt))


def wait_for(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> float:
    """Poll ``pred`` until true; returns the seconds it took (AssertionError past timeout)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------ raw HTTP


def http_request(url: str, method: str = "GET", path: str = "/", *,
                 headers: dict[str, str] | None = None, body: bytes | None = None,
                 timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One request (no proxy, no redirects); returns (status, headers, body) for any status."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class RawHttp:
    """A raw socket that sends ``data`` to ``url``'s port and then neither finishes nor
    closes; a daemon thread records when the server answered (or closed) and what.
    Bounded by ``timeout``; :meth:`close` in ``finally``."""

    def __init__(self, url: str, data: bytes, *, timeout: float = 60.0) -> None:
        u = urllib.parse.urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=10)
        self.sock.settimeout(timeout)
        self.sent_at = time.monotonic()
        self.sock.sendall(data)
        self.answer: bytes | None = None
        self.answered_at: float | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="raw-http")
        self._thread.start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if self.answered_at is None:
                    self.answered_at = time.monotonic()
                if not chunk:
                    break
                buf += chunk
                if b"\r\n\r\n" in buf and len(buf) > 4096:
                    break
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.answer = buf
        self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    @property
    def status(self) -> int | None:
        if not self.answer:
            return None
        first = self.answer.split(b"\r\n", 1)[0].split()
        return int(first[1]) if len(first) >= 2 and first[1].isdigit() else None

    @property
    def elapsed_s(self) -> float | None:
        return None if self.answered_at is None else self.answered_at - self.sent_at

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        self._thread.join(5)


class FakeSource:
    """A local HTTP server posing as a source's state endpoint. ``handler(path, headers)``
    returns (status, extra headers, body); every request is counted in ``requests``."""

    def __init__(self, handler: Callable[[str, dict[str, str]], tuple[int, dict, bytes]]
                 | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        outer = self
        handler = handler or (lambda path, headers: (404, {}, b"{}"))

        class H(http.server.BaseHTTPRequestHandler):
            timeout = 10

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hdrs = {k: v for k, v in self.headers.items()}
                outer.requests.append((self.path, hdrs))
                status, extra, body = handler(self.path, hdrs)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), H)
        self.server.daemon_threads = True
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def relay_state(src_url: str, rewrite: Callable[[dict], dict] | None) -> Callable:
    """A FakeSource handler that forwards the (signed) request to the real source and
    returns its answer, a state with the body rewritten by ``rewrite`` (None: replayed
    without the source's response signature)."""

    def handler(path: str, headers: dict[str, str]) -> tuple[int, dict, bytes]:
        fwd = {k: v for k, v in headers.items() if k.lower() == AUTH_HEADER.lower()}
        status, hdrs, body = http_request(src_url, "GET", path, headers=fwd)
        extra = {}
        if rewrite is not None and status == 200:
            body = json.dumps(rewrite(json.loads(body))).encode()
            if AUTH_RESPONSE_HEADER.lower() in hdrs:  # the source's MAC, over another body
                extra[AUTH_RESPONSE_HEADER] = hdrs[AUTH_RESPONSE_HEADER.lower()]
        return status, extra, body

    return handler


# ------------------------------------------------------------------------------ raw UCX


def pull_request(block_hashes: Sequence[int], *, model: str, count: int | None = None,
                 read: bool = False, deadline_ms: int = 5000,
                 require_all: bool = False) -> PullRequest:
    return PullRequest(transfer_id=next(_TIDS), request_id="zero-trust", hash_scheme=SCHEME,
                       block_hashes=list(block_hashes), start=0,
                       count=len(block_hashes) if count is None else count, pieces=FULL_PIECE,
                       chunk_bytes=1 << 20, deadline_ms=deadline_ms, require_all=require_all,
                       read=read, model=model)


def preamble(body_bytes: int) -> bytes:
    """A valid control-frame preamble (this build's magic, version, fingerprint) announcing
    a body of ``body_bytes``."""
    return _PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, 0, DEFAULT_CODEC.fingerprint, body_bytes)


class UcxClient:
    """Raw UCX peers in the test process: pools are created and used on one event loop
    thread; :meth:`run` runs a coroutine there (bounded)."""

    def __init__(self) -> None:
        self.rt = EventLoopThread("zero-trust-client")
        self._pools: list[ConnectionPool] = []

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.rt.run(coro, timeout)

    def pool(self, credential: Credential | None) -> ConnectionPool:
        """A new pool (one connection per port) authenticating with ``credential``."""
        p = ConnectionPool(credential=credential, connect_timeout=5.0)
        self._pools.append(p)
        return p

    async def ask(self, conn: Any, req: PullRequest, timeout: float = 5.0) -> PullReply:
        await conn.send_msg(req, CONTROL_TAG, timeout=timeout)
        reply = await conn.recv_msg(tag_for(req.transfer_id, Lane.REPLY), timeout=timeout)
        assert isinstance(reply, PullReply) and reply.transfer_id == req.transfer_id, reply
        return reply

    async def recv_stream(self, conn: Any, reply: PullReply, timeout: float = 10.0
                          ) -> np.ndarray:
        bufs = [np.full(s, 0xA5, np.uint8) for s in reply.chunk_sizes]
        if bufs:
            await conn.recv_chunks(reply.transfer_id, bufs, timeout=timeout)
        return np.concatenate(bufs) if bufs else np.empty(0, np.uint8)

    @staticmethod
    async def wait_dead(conn: Any, timeout: float) -> float | None:
        """Seconds until the peer closed ``conn`` (None: still alive after ``timeout``)."""
        t0 = time.monotonic()
        while conn.alive:
            if time.monotonic() - t0 > timeout:
                return None
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    def close(self) -> None:
        async def close_all() -> None:
            for p in self._pools:
                with contextlib.suppress(Exception):
                    await p.close()

        with contextlib.suppress(Exception):
            self.rt.run(close_all(), 15)
        self.rt.close()


__all__ = ["BLOCK_BYTES", "COMMON", "FULL_PIECE", "HOST", "NUM_BLOCKS", "OTHER_SECRET",
           "FakeSource", "RawHttp", "TransportError", "UcxClient", "hashes", "http_request",
           "metric", "metric_sum", "pool_stats", "preamble", "pull_request", "relay_state",
           "rss_mib", "start_fleet", "ucx_port", "wait_for"]
