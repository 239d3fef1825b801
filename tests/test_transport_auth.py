"""Peer authentication and frame bounds on real UCX endpoints (listener and pool in this
process, over loopback): the challenge-response of kvkern.xfer.auth, what a listener reads
before it, and the caps on what it reads after."""

from __future__ import annotations

import asyncio
import struct

import pytest

from kvkern.xfer import transport
from kvkern.xfer.auth import Credential
from kvkern.xfer.messages import (
    DEFAULT_CODEC,
    MAGIC,
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    PlanPiece,
    PullRequest,
)
from kvkern.xfer.transport import (
    CONTROL_TAG,
    ConnectionPool,
    Listener,
    TransportError,
)

pytestmark = pytest.mark.timeout(60)
aio = pytest.mark.asyncio(loop_scope="module")
HOST = "127.0.0.1"
FLEET = Credential("11" * 32, peer_id="source")
CLIENT = FLEET.with_peer_id("client")
STRANGER = Credential("22" * 32, peer_id="client")


def _request() -> PullRequest:
    return PullRequest(transfer_id=1, request_id="r", hash_scheme="s", block_hashes=[1],
                       start=0, count=1, chunk_bytes=1 << 20, deadline_ms=1000,
                       pieces=[PlanPiece(src_rank=0, layer_start=0, layer_stop=1,
                                         head_start=0, head_stop=1, offset=0, length=8)])


def _preamble(body_bytes: int) -> bytes:
    return struct.pack("<4sHHQI", MAGIC, PROTOCOL_VERSION, 0, DEFAULT_CODEC.fingerprint,
                       body_bytes)


class _Server:
    """A listener that records who its handler saw and what it read."""

    def __init__(self, credential: Credential | None = FLEET) -> None:
        self.seen: list[str | None] = []
        self.errors: list[str] = []
        self.messages: list[object] = []
        self.listener = Listener(self.handle, credential=credential)

    async def handle(self, conn) -> None:
        self.seen.append(conn.peer_id)
        try:
            while True:
                self.messages.append(await conn.recv_msg(CONTROL_TAG, timeout=None))
        except TransportError as exc:
            self.errors.append(f"{exc.reason}: {exc.detail}")

    async def __aenter__(self) -> _Server:
        await self.listener.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.listener.close()


async def _until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@aio
async def test_fleet_members_authenticate_each_other():
    async with _Server() as srv, ConnectionPool(credential=CLIENT) as pool:
        conn = await pool.get(HOST, srv.listener.port)
        assert conn.peer_id == "source"
        await conn.send_msg(_request(), CONTROL_TAG, timeout=5)
        await _until(lambda: srv.messages)
        assert srv.seen == ["client"] and isinstance(srv.messages[0], PullRequest)
        assert srv.listener.auth_failures == 0


@aio
async def test_a_peer_with_another_secret_is_refused_both_ways():
    async with _Server() as srv, ConnectionPool(credential=STRANGER) as pool:
        with pytest.raises(TransportError) as info:
            await pool.get(HOST, srv.listener.port)
        assert info.value.reason == "auth_failed"  # the client sees the source's bad proof
        assert srv.seen == []  # the handler never ran


@aio
async def test_a_peer_without_credentials_gets_nothing_served():
    async with _Server() as srv, ConnectionPool(credential=None) as pool:
        conn = await pool.get(HOST, srv.listener.port)  # no exchange: a stranger's client
        await conn.send_msg(_request(), CONTROL_TAG, timeout=5)
        await _until(lambda: srv.listener.auth_failures == 1)
        with pytest.raises(TransportError):
            await conn.recv_msg(transport.AUTH_REPLY_TAG, timeout=3)
        assert srv.seen == [] and srv.messages == []


@aio
async def test_a_large_first_frame_is_cut_off_unread():
    async with _Server() as srv, ConnectionPool(credential=None) as pool:
        conn = await pool.get(HOST, srv.listener.port)
        await conn.send_bytes(_preamble(100 << 10) + bytes(100 << 10), CONTROL_TAG, timeout=5)
        await _until(lambda: srv.listener.auth_failures == 1)
        assert srv.seen == []


@aio
async def test_a_forged_proof_is_refused():
    async with _Server() as srv, ConnectionPool(credential=None) as pool:
        conn = await pool.get(HOST, srv.listener.port)
        await conn.send_msg(Hello(nonce=bytes(32), peer_id="x"), CONTROL_TAG, timeout=5)
        challenge = await conn.recv_msg(transport.AUTH_REPLY_TAG, timeout=5)
        assert FLEET.verify("ctl-server", challenge.proof, bytes(32), challenge.nonce, "x",
                            "source")
        # a replayed or guessed proof: the server's own proof is not the client's
        from kvkern.xfer.messages import Proof  # noqa: PLC0415

        await conn.send_msg(Proof(proof=challenge.proof), CONTROL_TAG, timeout=5)
        await _until(lambda: srv.listener.auth_failures == 1)
        assert srv.seen == []


@aio
async def test_a_client_meeting_a_source_without_the_exchange_times_out():
    async with _Server(credential=None) as srv, \
            ConnectionPool(credential=CLIENT, connect_timeout=1.0) as pool:
        with pytest.raises(TransportError) as info:
            await pool.get(HOST, srv.listener.port)
        assert info.value.reason == "auth_failed"


@aio
async def test_frames_over_the_limit_are_refused_before_allocation():
    async with _Server() as srv, ConnectionPool(credential=CLIENT) as pool:
        conn = await pool.get(HOST, srv.listener.port)
        await conn.send_bytes(_preamble(16 << 20), CONTROL_TAG, timeout=5)  # 16 MiB announced
        await _until(lambda: srv.errors)
        assert srv.errors[0].startswith("protocol_error") and "too_large" in srv.errors[0]


@aio
async def test_a_body_that_never_follows_its_preamble_times_out(monkeypatch):
    monkeypatch.setattr(transport, "BODY_TIMEOUT_S", 0.3)
    async with _Server() as srv, ConnectionPool(credential=CLIENT) as pool:
        conn = await pool.get(HOST, srv.listener.port)
        await conn.send_bytes(_preamble(512 << 10), CONTROL_TAG, timeout=5)  # body withheld
        await _until(lambda: srv.errors, timeout=3)
        assert srv.errors[0].startswith("transfer_timeout")
        # a connection that sends whole frames is unaffected
        conn2 = await ConnectionPool(credential=CLIENT).get(HOST, srv.listener.port)
        await conn2.send_msg(Cancel(transfer_id=3), CONTROL_TAG, timeout=5)
        await _until(lambda: any(isinstance(m, Cancel) for m in srv.messages))
        conn2.abort()
