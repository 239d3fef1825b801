"""The source's book of the connections it serves (loop thread only).

Per authenticated connection: whether its peer may hold it (the connection caps of
:class:`~kvkern.xfer.source_config.PeerQuotas`, counted by the
:class:`~kvkern.xfer.send.PeerLedger`), how many requests (and acks) it has open, at most
:data:`~kvkern.xfer.tuning.MAX_OPEN_REQUESTS_PER_CONNECTION`, and when it last had traffic: a
sweep closes a connection with nothing open and no message for ``idle_s``. A connection the
source closes is asked on again from a new one: the destination's request on a connection
closed under it is sent once more on a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kvkern.xfer.messages import ReadAck
from kvkern.xfer.send import count_down
from kvkern.xfer.transport import Lane, TransportError, tag_for
from kvkern.xfer.tuning import IDLE_SWEEP_MAX_S, MAX_OPEN_REQUESTS_PER_CONNECTION, REFUSAL_SEND_S

if TYPE_CHECKING:
    from kvkern.xfer.metrics import XferMetrics
    from kvkern.xfer.send import PeerLedger
    from kvkern.xfer.transport import Connection

__all__ = ["ServedConnections"]

log = logging.getLogger("kvkern.xfer.source")


class ServedConnections:
    """The served connections of one source (see the module docstring). ``spawn(coro)``
    runs the idle sweep as one of the service's background tasks; ``closing()`` ends it."""

    def __init__(self, ledger: PeerLedger, metrics: XferMetrics, idle_s: float, *,
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task],
                 closing: Callable[[], bool]) -> None:
        self.ledger, self.metrics, self.idle_s = ledger, metrics, idle_s
        self._spawn, self._closing = spawn, closing
        self.open: dict[Connection, int] = {}  # requests (and acks) open, per connection
        self._seen: dict[Connection, float] = {}  # when each last had traffic (monotonic)
        self._sweep: asyncio.Task | None = None

    def enter(self, conn: Connection, rank: int) -> bool:
        """Count an authenticated connection in, or close it (False) when its peer, or all
        peers, hold as many as their quotas allow."""
        peer, ledger = conn.peer_id or "", self.ledger
        if not ledger.may_connect(peer):
            log.warning("rank %d: closed a connection of peer %r: it holds %d, all peers %d "
                        "(max_connections_per_peer %d, max_connections %d)", rank, peer,
                        ledger.peer_connections.get(peer, 0), ledger.connections,
                        ledger.quotas.max_connections_per_peer, ledger.quotas.max_connections)
            self.metrics.source_connection_refused("connection_limit")
            conn.abort("connection_limit")
            return False
        ledger.connected(peer)
        self.metrics.source_connections.inc()
        self._seen[conn] = time.monotonic()
        if self._sweep is None or self._sweep.done():
            self._sweep = self._spawn(self._close_idle())
        return True

    def leave(self, conn: Connection) -> None:
        """A connection :meth:`enter` let in has ended."""
        self._seen.pop(conn, None)
        self.ledger.disconnected(conn.peer_id or "")
        self.metrics.source_connections.dec()

    def heard(self, conn: Connection) -> None:
        """A message arrived on ``conn``."""
        self._seen[conn] = time.monotonic()

    def may_open(self, conn: Connection, what: str) -> bool:
        """Whether ``conn`` may have one more request (or ack) open; if not, it is closed
        (``what`` names the kind, for the log)."""
        if self.open.get(conn, 0) < MAX_OPEN_REQUESTS_PER_CONNECTION:
            return True
        log.warning("peer %r has %d %s open on one connection: closing it", conn.peer_id,
                    MAX_OPEN_REQUESTS_PER_CONNECTION, what)
        self.metrics.source_connection_closed("too_many_requests")
        conn.abort("too_many_requests")  # (its request loop ends with the connection)
        return False

    def opened(self, conn: Connection) -> None:
        self.open[conn] = self.open.get(conn, 0) + 1

    def ended(self, conn: Connection) -> None:
        """One of ``conn``'s open requests (or acks) has ended: an idle connection's time
        runs from its last one."""
        count_down(self.open, conn)
        if conn in self._seen:
            self._seen[conn] = time.monotonic()

    def ack_unknown(self, conn: Connection, tid: int) -> None:
        """Answer a ReadDone that asks for an ack of a transfer nothing is pinned for. These
        answers count with the connection's open requests: a peer that asks for more than
        MAX_OPEN_REQUESTS_PER_CONNECTION at once (and reads none) loses the connection."""
        if not self.may_open(conn, "requests and acks"):
            return
        self.opened(conn)

        async def send() -> None:
            try:
                with contextlib.suppress(TransportError):
                    await conn.send_msg(ReadAck(transfer_id=tid, held=False,
                                                reason="no read of this transfer is pinned"),
                                        tag_for(tid, Lane.REPLY, 1), timeout=REFUSAL_SEND_S)
            finally:
                self.ended(conn)

        self._spawn(send())

    async def _close_idle(self) -> None:
        """While connections are served: close each one with no request open and no
        message for ``idle_s``."""
        idle = self.idle_s
        while self._seen and not self._closing():
            await asyncio.sleep(min(idle / 4, IDLE_SWEEP_MAX_S))
            now = time.monotonic()
            for conn, seen in list(self._seen.items()):
                if now - seen >= idle and not self.open.get(conn):
                    log.info("closing a connection of peer %r idle for %.0f s",
                             conn.peer_id, now - seen)
                    self._seen.pop(conn, None)
                    self.metrics.source_connection_closed("idle")
                    conn.abort("idle")
