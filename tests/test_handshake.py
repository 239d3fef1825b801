"""The first exchange on a new connection (kvkern.xfer.handshake): interoperable with stock
ucxx on both sides, and a handshake ended early (a timeout, a peer that never answers or
answers late) closes its endpoint and keeps its buffers while any request on them is open, so
late bytes never land in freed memory. In one process on 127.0.0.1, one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import struct

import pytest

from kvkern.xfer import handshake, transport, ucxcompat
from kvkern.xfer.transport import CONTROL_TAG, ConnectionPool, Listener
from kvkern.xfer.ucx_env import import_ucxx

pytestmark = pytest.mark.timeout(60)
aio = pytest.mark.asyncio(loop_scope="module")
HOST = "127.0.0.1"


def _ucx():
    transport.bind_ucxx_loop()  # (ucxx serves one loop: this module's)
    ucxx = import_ucxx()
    import ucxx._lib.libucxx as ucx_api

    return ucxx, ucx_api, ucxx.core._get_ctx()


class RawListener:
    """A UCX listener that accepts and then says nothing (its endpoints kept for a late
    answer): what a stalled or hostile source looks like to a connecting client."""

    def __init__(self) -> None:
        _, ucx_api, ctx = _ucx()
        ctx.continuous_ucx_progress()
        self.endpoints: list = []
        self._listener = ucx_api.UCXListener.create(
            worker=ctx.worker, port=0, cb_func=self.endpoints.append, cb_args=(),
            deliver_endpoint=True)
        self.port = self._listener.port


def _late_info() -> bytes:
    from ucxx._lib_async.utils import hash64bits

    return struct.pack("QQ", 12345, hash64bits(12345))


def _watch_abandons(monkeypatch) -> list:
    seen: list = []
    real = handshake.Handshake.abandon

    def abandon(self):
        seen.append(self)
        real(self)

    monkeypatch.setattr(handshake.Handshake, "abandon", abandon)
    return seen


async def _round_trip(client, server_ep_future) -> None:
    """One message each way on tag CONTROL_TAG between two connected ucxx endpoints."""
    server = await server_ep_future
    await client.send(bytearray(b"ping"), tag=CONTROL_TAG)
    got = bytearray(4)
    await server.recv(got, tag=CONTROL_TAG)
    assert got == b"ping"
    await server.send(bytearray(b"pong"), tag=CONTROL_TAG)
    await client.recv(got, tag=CONTROL_TAG)
    assert got == b"pong"
    client.abort()
    server.abort()


@aio
async def test_stock_ucxx_on_either_side_interoperates():
    ucxx, _, _ = _ucx()
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future = loop.create_future()

    async def keep(ep):
        accepted.set_result(ep)
        await asyncio.sleep(1)

    ours = handshake.create_listener(keep, port=0, timeout=5, gate=handshake.Gate(8))
    client = await ucxx.create_endpoint(HOST, ours.port)  # stock client, our listener
    await _round_trip(client, accepted)
    ucxcompat.close_listener(ours)

    accepted = loop.create_future()
    stock = ucxx.create_listener(keep, port=0)
    client = await handshake.connect(HOST, stock.port, 5)  # our client, stock listener
    await _round_trip(client, accepted)
    stock.close()


@aio
async def test_a_connect_to_a_silent_listener_ends_and_a_late_answer_lands_nowhere(
        monkeypatch):
    seen = _watch_abandons(monkeypatch)
    _ucx()
    silent = RawListener()
    with pytest.raises(TimeoutError):
        await handshake.connect(HOST, silent.port, 0.3)
    (hs,) = seen
    # the endpoint is closed; its receive is done, or its buffer is kept until it is
    assert hs.settled or hs in handshake._abandoned
    from ucxx._lib.arr import Array

    late = _late_info()
    for ep in silent.endpoints:  # the listener answers after all (the client closed)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ep.stream_send(Array(late)).wait(), 2)
    await asyncio.sleep(0.2)
    gc.collect()  # (a write into freed memory shows up as a corrupt object here, or later)
    assert all(not h.settled for h in handshake._abandoned)  # kept only while open


@aio
async def test_a_client_that_never_answers_is_dropped_before_the_handler(monkeypatch):
    """A client that connects and stays silent: the listener gives up after its timeout,
    closes the endpoint, never calls the handler, and keeps serving."""
    seen = _watch_abandons(monkeypatch)
    handled: list = []

    async def handler(conn):
        handled.append(conn)
        await asyncio.sleep(30)  # (the listener closes a connection when its handler returns)

    async with Listener(handler, connect_timeout=0.3, credential=None) as lst:
        _, ucx_api, ctx = _ucx()
        raw = ucx_api.UCXEndpoint.create(ctx.worker, HOST, lst.port, True)
        await asyncio.sleep(0.8)  # past the listener's handshake timeout
        assert len(seen) == 1 and not handled and lst.accepted == 0
        assert seen[0].settled or seen[0] in handshake._abandoned
        from ucxx._lib.arr import Array

        late = _late_info()
        with contextlib.suppress(Exception):  # (the listener closed the endpoint)
            await asyncio.wait_for(raw.stream_send(Array(late)).wait(), 2)
        gc.collect()
        async with ConnectionPool(credential=None, connect_timeout=5) as pool:
            conn = await pool.get(HOST, lst.port)  # the listener still serves
            assert conn.alive
            await asyncio.sleep(0.1)
        assert lst.accepted == 1 and len(handled) == 1


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@aio
async def test_a_connect_where_nothing_listens_fails_at_once(monkeypatch):
    """Nothing listens at the address (a source that died or restarted elsewhere): the
    connect fails with the endpoint, well before its timeout, every time, and the pool
    names it ``connect_failed``."""
    seen = _watch_abandons(monkeypatch)
    _ucx()
    loop = asyncio.get_running_loop()
    for _ in range(5):
        t0 = loop.time()
        with pytest.raises(Exception) as info:
            await handshake.connect(HOST, _closed_port(), 5.0)
        assert not isinstance(info.value, TimeoutError), info.value
        assert loop.time() - t0 < 1.0
    assert len(seen) == 5 and all(h.settled or h in handshake._abandoned for h in seen)
    async with ConnectionPool(credential=None, connect_timeout=5) as pool:
        t0 = loop.time()
        with pytest.raises(transport.TransportError) as info:
            await pool.get(HOST, _closed_port())
        assert info.value.reason == "connect_failed" and loop.time() - t0 < 1.0


class _FailingEndpoint:
    """An endpoint that fails while a stream receive waits on it: UCX calls its close
    callback from the progress thread and never completes the receive."""

    def __init__(self) -> None:
        self.alive, self.closed, self.handle = True, False, 0
        self._callback = None

    def set_close_callback(self, cb, cb_args=None, cb_kwargs=None) -> None:
        self._callback = cb

    def stream_recv(self, arr):
        class Pending:
            completed = False

            async def wait(self):
                await asyncio.Event().wait()

        return Pending()

    stream_send = stream_recv

    def fail_later(self, delay: float) -> None:
        import threading

        def fail() -> None:
            self.alive = False
            self._callback()

        threading.Timer(delay, fail).start()

    def close_blocking(self, **_) -> None:
        self.closed = True


@aio
async def test_an_endpoint_failing_during_the_handshake_ends_it_at_once(monkeypatch):
    monkeypatch.setattr(handshake.ucxcompat, "tags_checksum", lambda *a: 7)
    ep = _FailingEndpoint()
    hs = handshake.Handshake(ep, accepting=False)
    ep.fail_later(0.05)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(ConnectionError):
        await hs.run(5.0)
    assert asyncio.get_running_loop().time() - t0 < 1.0
    assert ep.closed and hs in handshake._abandoned  # its receive never completed: kept
    handshake._abandoned.remove(hs)


async def _until(cond, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@aio
async def test_a_client_that_leaves_mid_handshake_frees_its_slot_at_once():
    """A client that connects and goes away before answering: the listener's side of the
    handshake ends with its endpoint, long before its timeout, and the slot it held among
    the untrusted connections is free again."""
    async def handler(conn):
        raise AssertionError("no connection gets this far")

    async with Listener(handler, connect_timeout=5, credential=None, max_untrusted=3) as lst:
        _, ucx_api, ctx = _ucx()
        raw = ucx_api.UCXEndpoint.create(ctx.worker, HOST, lst.port, True)
        await _until(lambda: lst.untrusted_connections == 1, 2)
        raw.close_blocking(period=10**9, max_attempts=1)
        await _until(lambda: lst.untrusted_connections == 0, 1.0)
        assert lst.accepted == 0


def test_the_gate_counts_and_refuses_past_its_limit():
    told: list[str] = []
    gate = handshake.Gate(2, on_refuse=told.append)
    assert gate.enter() and gate.enter() and not gate.enter()
    gate.leave()
    assert gate.enter() and (gate.inside, gate.refused) == (2, 1)
    gate.drop("handshake")
    assert gate.inside == 1 and told == ["untrusted_limit", "handshake"]
    with pytest.raises(ValueError):
        handshake.Gate(0)

    def broken(reason):
        raise RuntimeError("a metrics hook failing")

    quiet = handshake.Gate(1, on_refuse=broken)  # never breaks an accept
    assert quiet.enter() and not quiet.enter()


def test_the_gate_admits_only_accept_from_and_names_each_rejected_address_once(caplog):
    from kvkern.xfer.networks import Networks

    told: list[str] = []
    gate = handshake.Gate(4, on_refuse=told.append, accept_from=Networks.parse("10.0.0.0/8"))
    assert gate.admits("10.1.2.3") and gate.admits("::ffff:10.0.0.1")
    assert not gate.admits("192.168.0.1") and not gate.admits(None) and not gate.admits("")
    with caplog.at_level("WARNING", logger="kvkern.xfer"):
        for address in ("192.168.0.1", "192.168.0.1", None):
            gate.reject(address)
    assert gate.rejected == 3 and told == ["address_not_accepted"] * 3
    assert gate.inside == 0 and gate.refused == 0  # (nothing entered)
    named = [r.getMessage() for r in caplog.records if "rejected a UCX connection" in r.message]
    assert len(named) == 2 and "192.168.0.1" in named[0] and "10.0.0.0/8" in named[0]
    assert handshake.Gate(1).admits("203.0.113.1")  # (no accept_from: any address)


def test_one_address_takes_at_most_its_share_of_the_gate():
    gate = handshake.Gate(8, per_address=2)
    assert gate.enter("10.0.0.1") and gate.enter("10.0.0.1") and not gate.enter("10.0.0.1")
    assert gate.enter("10.0.0.2") and gate.enter("")  # (an unknown address: the limit only)
    gate.leave("10.0.0.1")
    assert gate.enter("10.0.0.1") and (gate.inside, gate.refused) == (4, 1)
    gate.drop("handshake", "10.0.0.1")
    gate.leave("10.0.0.1")
    assert gate.enter("10.0.0.1") and gate.enter("10.0.0.1")
    assert handshake.Gate(256).per_address == handshake.Gate.PER_ADDRESS
    assert handshake.Gate(3).per_address == 3


def test_the_addresses_of_one_ipv6_host_share_its_share_of_the_gate():
    gate = handshake.Gate(8, per_address=2)
    assert gate.enter("2001:db8::1") and gate.enter("2001:db8::2")
    assert not gate.enter("2001:db8::ffff:3")  # (the same /64: the same host)
    assert gate.enter("2001:db8:0:1::1")  # (another /64)
    gate.leave("2001:db8::1")
    assert gate.enter("2001:db8::9") and dict(gate._from) == {"2001:db8::/64": 2,
                                                              "2001:db8:0:1::/64": 1}


@aio
async def test_the_gate_counts_an_accepted_connection_by_its_remote_address(monkeypatch):
    """The listener learns each connection's remote IP from UCX (its sockaddr) and enters
    the gate with it."""
    seen: list[str] = []
    real = handshake.Gate.enter

    def enter(self, address: str = "") -> bool:
        seen.append(address)
        return real(self, address)

    monkeypatch.setattr(handshake.Gate, "enter", enter)

    async def handler(conn):
        await asyncio.sleep(30)  # (the listener closes a connection when its handler returns)

    async with Listener(handler, connect_timeout=5, credential=None) as lst, \
            ConnectionPool(credential=None, connect_timeout=5) as pool:
        assert (await pool.get(HOST, lst.port)).alive
    assert seen == [HOST]


@aio
async def test_connections_not_yet_trusted_are_bounded():
    """A listener holds at most max_untrusted connections that have not authenticated:
    silent clients past that are closed as they arrive; once the silent ones time out the
    count is back to 0 and a real client gets in."""
    handled: list = []

    async def handler(conn):
        handled.append(conn)
        await asyncio.sleep(30)  # (the listener closes a connection when its handler returns)

    told: list[str] = []
    async with Listener(handler, connect_timeout=0.5, credential=None,
                        max_untrusted=3, on_refused=told.append) as lst:
        _, ucx_api, ctx = _ucx()
        raws = [ucx_api.UCXEndpoint.create(ctx.worker, HOST, lst.port, True) for _ in range(5)]
        await _until(lambda: lst.refused_untrusted == 2, 5)
        assert lst.untrusted_connections == 3  # (the refused went before the first timed out)
        await _until(lambda: lst.untrusted_connections == 0, 5)  # the silent three dropped
        assert not handled and lst.refused_untrusted == 2
        for raw in raws:
            with contextlib.suppress(Exception):
                raw.close_blocking(period=10**9, max_attempts=1)
        async with ConnectionPool(credential=None, connect_timeout=5) as pool:
            assert (await pool.get(HOST, lst.port)).alive
            await asyncio.sleep(0.1)
        assert len(handled) == 1 and lst.untrusted_connections == 0
    assert sorted(told) == ["handshake"] * 3 + ["untrusted_limit"] * 2


def test_a_close_watch_runs_each_hook_once_and_a_late_hook_at_once():
    from kvkern.xfer.ucxcompat import CloseWatch

    class Ep:
        calls = 0

        def set_close_callback(self, cb, cb_args=None, cb_kwargs=None) -> None:
            self.calls += 1
            self.cb = cb

    ep = Ep()
    watch = CloseWatch.install(ep)
    heard: list[str] = []
    watch.add(lambda: heard.append("a"))
    gone = lambda: heard.append("removed")  # noqa: E731
    watch.add(gone)
    watch.remove(gone)
    watch.remove(gone)  # (removing twice is harmless)

    def broken() -> None:
        raise RuntimeError("a hook that fails")

    watch.add(broken)
    watch.add(lambda: heard.append("b"))
    ep.cb("status")  # UCX's call, with whatever arguments
    ep.cb()  # a second close runs nothing twice
    assert heard == ["a", "b"] and watch.closed
    watch.add(lambda: heard.append("late"))
    assert heard == ["a", "b", "late"] and ep.calls == 1


@aio
async def test_an_endpoint_keeps_the_one_close_callback_its_handshake_set():
    """ucxx frees a replaced close callback while UCX may still call it, so each side's
    endpoint has one callback for its life: the handshake's watch, where the connection adds
    its hook once the handshake is over. The peer's abort still reaches the connection."""
    accepted: list = []
    done = asyncio.Event()

    async def handler(conn):
        accepted.append(conn)
        await done.wait()  # (the listener closes a connection when its handler returns)

    async with Listener(handler, connect_timeout=5, credential=None) as lst, \
            ConnectionPool(credential=None, connect_timeout=5) as pool:
        conn = await pool.get(HOST, lst.port)
        await _until(lambda: accepted, 5)
        for c in (conn, accepted[0]):
            hooks = c._ep.kvkern_closing._hooks
            assert len(hooks) == 1 and "Connection" in hooks[0].__qualname__  # handshake's left
        closing = conn._ep.kvkern_closing
        accepted[0].abort()
        await _until(lambda: closing.closed, 5)  # (UCX's progress thread runs the hooks)
        assert conn._peer_closed and not conn.alive
        done.set()


@aio
async def test_a_dropped_connection_is_freed_by_reference_counting():
    """The close callback holds its connection weakly: a connection dropped without a close
    is freed at once, not left in a cycle through the dict ucxx hands UCX a bare pointer
    to (the garbage collector could free that dict while UCX still holds the pointer)."""
    import weakref

    async def handler(conn):
        await asyncio.sleep(0.2)

    async with Listener(handler, connect_timeout=5, credential=None) as lst, \
            ConnectionPool(credential=None, connect_timeout=5) as pool:
        conn = await pool.get(HOST, lst.port)
        pool.discard(conn)
        ref = weakref.ref(conn)
        gc.disable()
        try:
            del conn
            assert ref() is None
        finally:
            gc.enable()


@aio
async def test_a_connection_request_after_the_listener_closed_calls_into_no_freed_memory():
    """An endpoint accepted from a listener keeps UCX's listener alive after the listener is
    closed and freed (here the test holds one), and UCX goes on accepting through the
    callback ucxx keeps in a dict it hands UCX a bare pointer to. That dict is kept: a
    request arriving then is rejected, and none of the objects that would take the freed
    dict's place is called."""
    kept: list = []

    async def handler(conn):
        kept.append(conn._ep._ep)  # its UCXEndpoint, beyond the connection's abort
        await asyncio.sleep(30)

    lst = await Listener(handler, connect_timeout=5, credential=None).start()
    port = lst.port
    async with ConnectionPool(credential=None, connect_timeout=5) as pool:
        await pool.get(HOST, port)
        await _until(lambda: kept, 5)
        await lst.close()
        called: list = []
        squatters = [{"cb_func": (lambda *a, i=i: called.append(i)), "cb_args": (),
                      "cb_kwargs": {}} for i in range(20000)]
        del lst
        gc.collect()
        with pytest.raises(transport.TransportError):
            await ConnectionPool(credential=None, connect_timeout=1).get(HOST, port)
        assert not called and len(squatters) == 20000
    kept.clear()


@aio
async def test_the_listener_callback_dict_is_found_and_kept():
    """ucxx's listener keeps its callback in a dict of its own: found and kept (a ucxx
    release that stores it differently fails here, not by a crash after a close)."""
    _ucx()
    lst = await Listener(lambda conn: asyncio.sleep(0), credential=None).start()
    try:
        kept = ucxcompat._kept_listener_callbacks[-1]
        assert isinstance(kept, dict) and isinstance(kept["cb_func"], ucxcompat.ListenerRelay)
    finally:
        await lst.close()
    assert kept["cb_func"]._target is None  # emptied by the close
