"""The first exchange on a new UCX connection, with buffers that outlive every request on them.

ucxx gives every endpoint its message tags in a first exchange on the UCX stream API: each side
sends 16 bytes, ``struct.pack("QQ", tag, hash64bits(tag))``, the accepting side first. ucxx's
own ``exchange_peer_info`` bounds each wait with a timeout and lets its buffers go when that
timeout, or a cancellation, ends the wait, while the receive is still posted: when the peer's
bytes arrive later, UCX writes them into memory Python has handed to other objects. Seen: a
destination whose connect was cancelled (a sibling pair of its pull failed) crashed with a
corrupted list; a source is exposed the same way to any client that connects and answers
after the timeout, before any credential is checked.

:class:`Handshake` keeps the buffers and requests of one exchange. Whatever ends a wait early
(a timeout, a cancellation, an error) closes the endpoint first, which cancels its requests,
and the handshake object is kept until those requests have completed; one whose requests never
complete stays for the life of the process (32 bytes and two request objects). The handshake
also installs the endpoint's only close callback (:class:`~kvkern.xfer.ucxcompat.CloseWatch`),
which the connection built on it hears through. :func:`connect`
and :func:`create_listener` are ucxx's ``create_endpoint`` and ``create_listener`` built on it,
on the same wire format, so either side may be stock ucxx.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import struct
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from kvkern.xfer import ucxcompat
from kvkern.xfer.networks import FirstSeen, Networks, ProvenHosts, host_key

__all__ = ["Gate", "Handshake", "HandshakeError", "abandoned", "connect", "create_listener"]

log = logging.getLogger("kvkern.xfer")

_FORMAT = "QQ"  # (the sender's message tag, its checksum), as ucxx's exchange_peer_info
_abandoned: list[Handshake] = []  # ended early, some request still open (see abandon)


class HandshakeError(Exception):
    """The peer's tags did not arrive intact."""


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def abandoned() -> int:
    """Handshakes ended early whose requests are still open (their buffers are kept)."""
    _sweep()
    return len(_abandoned)


def _sweep() -> None:
    _abandoned[:] = [h for h in _abandoned if not h.settled]


class Handshake:
    """One exchange of message tags on ``ucx_ep`` (a ``UCXEndpoint``); :meth:`run` returns the
    peer's tag. Holds its buffers and requests until they are safe to drop."""

    def __init__(self, ucx_ep: Any, *, accepting: bool) -> None:
        self.ep = ucx_ep
        self.accepting = accepting
        self.tag = ucxcompat.tags_checksum("msg_tag", os.urandom(16), ucx_ep.handle)
        self._mine = struct.pack(_FORMAT, self.tag, ucxcompat.tags_checksum(self.tag))
        self._theirs = bytearray(struct.calcsize(_FORMAT))
        self._arrays = (ucxcompat.stream_buffer(self._mine),
                        ucxcompat.stream_buffer(self._theirs))
        self._reqs: list[Any] = []
        self.closing = ucxcompat.CloseWatch.install(ucx_ep)

    @property
    def settled(self) -> bool:
        """Every request posted has completed (UCX holds none of the buffers)."""
        return all(req.completed for req in self._reqs)

    async def run(self, timeout: float) -> int:
        """Send ours and receive theirs (the accepting side sends first) within ``timeout``
        seconds; the peer's tag. On any early end the endpoint is closed (:meth:`abandon`).
        An endpoint that fails meanwhile (nothing listens at the address any more) ends the
        exchange at once: UCX does not complete a stream request posted on it."""
        send, recv = self._arrays
        steps = ((True, send), (False, recv)) if self.accepting else ((False, recv), (True, send))
        loop = asyncio.get_running_loop()
        failed = loop.create_future()

        def on_failure() -> None:  # UCX's progress thread
            with contextlib.suppress(RuntimeError):  # (a loop already closed)
                loop.call_soon_threadsafe(_settle, failed)

        self.closing.add(on_failure)
        try:
            async with asyncio.timeout(timeout):
                for sending, arr in steps:
                    req = self.ep.stream_send(arr) if sending else self.ep.stream_recv(arr)
                    self._reqs.append(req)
                    if not self.ep.alive:
                        raise ConnectionError("the endpoint failed before the handshake")
                    waiting = asyncio.ensure_future(req.wait())
                    try:
                        await asyncio.wait((waiting, failed),
                                           return_when=asyncio.FIRST_COMPLETED)
                        if not waiting.done():
                            raise ConnectionError("the endpoint failed during the handshake")
                        waiting.result()
                    finally:  # (a timeout or a failure leaves no task waiting on UCX)
                        waiting.cancel()
        except BaseException:
            self.abandon()
            raise
        finally:
            self.closing.remove(on_failure)
        tag, checksum = struct.unpack(_FORMAT, self._theirs)
        if ucxcompat.tags_checksum(tag) != checksum:
            self.abandon()
            raise HandshakeError(f"peer tags fail their checksum ({checksum:#x})")
        return tag

    def abandon(self) -> None:
        """Close the endpoint (cancelling its requests); keep this object while any request
        is still open, so UCX never writes into freed memory."""
        ucxcompat.close_endpoint(self.ep)
        _sweep()
        if not self.settled:
            _abandoned.append(self)
            log.debug("a connection handshake ended with requests open: its buffers are "
                      "kept (%d such)", len(_abandoned))


async def connect(host: str, port: int, timeout: float) -> Any:
    """ucxx's ``create_endpoint(host, port)`` with error handling on: the connected ucxx
    ``Endpoint``, or the exchange's exception (``TimeoutError`` after ``timeout`` s)."""
    ucx_ep, ctx = ucxcompat.new_client_endpoint(host, port)
    hs = Handshake(ucx_ep, accepting=False)
    peer = await hs.run(timeout)
    return ucxcompat.endpoint_with_tags(ucx_ep, ctx, send_tag=peer, recv_tag=hs.tag,
                                       closing=hs.closing)


class Gate:
    """Only connection requests from ``accept_from`` (any address where None) and, with
    ``proven``, from a host that presented the fleet credential over HTTP lately become
    connections: :meth:`admits` is asked on UCX's progress thread, before any endpoint
    exists, and :meth:`reject` counts each one it turned down (``rejected``).

    At most ``limit`` connections at once between their arrival and :meth:`leave`, which
    the listener's owner calls once it trusts the connection (after its authentication), or
    :meth:`drop` when it turns it away, and at most ``per_address`` of them from one remote
    host (default ``min(limit, PER_ADDRESS)``: one host cannot take every slot; an IPv6
    host is its /64, :func:`~kvkern.xfer.networks.host_key`);
    ``refused`` counts those turned away at once. ``on_refuse(reason)`` hears of every
    connection rejected (``address_not_accepted``, ``address_not_proven``), refused
    (``untrusted_limit``) or dropped (the reason given to :meth:`drop`)."""

    PER_ADDRESS = 64  # a quarter of the default limit: four hosts to fill it

    def __init__(self, limit: int, on_refuse: Callable[[str], None] | None = None, *,
                 per_address: int | None = None, accept_from: Networks | None = None,
                 proven: ProvenHosts | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.per_address = min(limit, self.PER_ADDRESS) if per_address is None else per_address
        if self.per_address < 1:
            raise ValueError(f"per_address must be >= 1, got {per_address}")
        self.inside = 0
        self.refused = 0
        self._from: collections.Counter[str] = collections.Counter()
        self._on_refuse = on_refuse
        self.accept_from = accept_from
        self.proven = proven
        self.rejected = 0
        self._logged = FirstSeen()  # rejected addresses named in the log

    def admits(self, address: str | None) -> bool:
        """Whether a connection request from ``address`` (None where unknown) may become a
        connection at all; called on UCX's progress thread."""
        return ((self.accept_from is None or address in self.accept_from)
                and (self.proven is None or address in self.proven))

    def reject(self, address: str | None) -> None:
        """Count a connection request :meth:`admits` turned down (on the loop)."""
        self.rejected += 1
        accepted = self.accept_from is None or address in self.accept_from
        if self._logged.first(address):
            if accepted:
                log.warning("rejected a UCX connection from %s: the host has not presented "
                            "the fleet credential over HTTP lately (a destination fetches "
                            "the source's state before it connects)",
                            address or "an unknown address")
            else:
                log.warning("rejected a UCX connection from %s: not in accept_from (%s)",
                            address or "an unknown address", self.accept_from)
        self._tell("address_not_proven" if accepted else "address_not_accepted")

    def enter(self, address: str = "") -> bool:
        """Let a connection from ``address`` (the remote IP; "" where unknown, counted
        against ``limit`` only) in, or refuse it."""
        key = host_key(address) if address else ""
        if self.inside >= self.limit or (key and self._from[key] >= self.per_address):
            self.refused += 1
            self._tell("untrusted_limit")
            return False
        self.inside += 1
        if key:
            self._from[key] += 1
        return True

    def leave(self, address: str = "") -> None:
        self.inside -= 1
        if address:
            key = host_key(address)
            self._from[key] -= 1
            if self._from[key] <= 0:
                del self._from[key]

    def drop(self, reason: str, address: str = "") -> None:
        """:meth:`leave` for a connection turned away (``reason``)."""
        self.leave(address)
        self._tell(reason)

    def _tell(self, reason: str) -> None:
        if self._on_refuse is not None:
            with contextlib.suppress(Exception):  # (a metrics hook never breaks an accept)
                self._on_refuse(reason)


def create_listener(callback: Callable[[Any], Awaitable[None]], *, port: int,
                    timeout: float, gate: Gate) -> Any:
    """ucxx's ``create_listener(callback, port)`` with error handling on: a ucxx
    ``Listener`` whose connections run :class:`Handshake` (``timeout`` s) before
    ``callback(endpoint)``; a connection that fails it is closed and never seen. A request
    that ``gate`` does not admit is rejected before it has an endpoint; each connection
    enters ``gate`` (closed at once when it is full); the handshake leaves it on failure,
    ``callback`` owns the leave after that."""
    return ucxcompat.new_listener(port, _on_request, (callback, timeout, gate),
                                  admit=gate.admits, on_reject=gate.reject)


def _on_request(ucx_ep: Any, loop: asyncio.AbstractEventLoop, ctx_ref: weakref.ref,
                tracker: Any, callback: Callable[[Any], Awaitable[None]],
                timeout: float, gate: Gate) -> None:
    """On UCX's progress thread: the accepted endpoint's handler goes to the loop."""
    tracker.submit(_accept(ucx_ep, ctx_ref, callback, timeout, gate), loop)


async def _accept(ucx_ep: Any, ctx_ref: weakref.ref,
                  callback: Callable[[Any], Awaitable[None]], timeout: float,
                  gate: Gate) -> None:
    ctx = ctx_ref()
    if ctx is None:  # the context went first: nothing to hand the connection to
        ucxcompat.close_endpoint(ucx_ep)
        return
    address = ucxcompat.endpoint_remote_ip(int(ucx_ep.handle)) or ""
    if not gate.enter(address):
        log.debug("refused a connection from %s: %d not yet trusted (the limit)",
                  address or "an unknown address", gate.inside)
        ucxcompat.close_endpoint(ucx_ep)
        return
    hs = Handshake(ucx_ep, accepting=True)
    try:
        peer = await hs.run(timeout)
    except BaseException as exc:
        gate.drop("handshake", address)
        if not isinstance(exc, Exception):
            raise
        log.debug("dropped a connection whose handshake failed: %s: %s",
                  type(exc).__name__, exc)
        return
    ep = ucxcompat.endpoint_with_tags(ucx_ep, ctx, send_tag=peer, recv_tag=hs.tag,
                                      closing=hs.closing)
    ep.kvkern_address = address  # (the callback leaves the gate with it)
    try:
        await callback(ep)
    except Exception:
        log.exception("listener callback failed")
