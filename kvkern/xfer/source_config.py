"""Configuration of the source side of the pull path: one frozen :class:`SourceConfig`,
validated once (a bad value is a ``ValueError`` naming the field and the value), and the
per-peer :class:`PeerQuotas` it holds."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvkern.checks import (
    check_finite_positive,
    check_fraction,
    check_non_negative_int,
    check_positive_int,
)
from kvkern.xfer.httpguard import HttpLimits
from kvkern.xfer.networks import ANY, LOOPBACK, Networks, is_loopback_host
from kvkern.xfer.state import MAX_ID_CHARS
from kvkern.xfer.tuning import (
    DEFAULT_IDLE_CONNECTION_S,
    DEFAULT_MAX_SEND_S,
    DEFAULT_PROGRESS_TIMEOUT_S,
    DEFAULT_READ_HOLD_S,
    MIN_CHUNK_BYTES,
)

__all__ = ["DEFAULT_IDLE_CONNECTION_S", "DEFAULT_MAX_SEND_S", "DEFAULT_PROGRESS_TIMEOUT_S",
           "DEFAULT_READ_HOLD_S",
           "REMOTE_READ_MODES", "PeerQuotas", "SourceConfig"]

REMOTE_READ_MODES = ("off", "host", "all")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")


@dataclass(frozen=True, kw_only=True)
class PeerQuotas:
    """What one authenticated peer, and all peers together, may hold of a source.

    ``max_sends_per_peer``: admitted requests of one peer at a time. ``peer_pin_fraction``:
    the share of a rank's pool one peer may have pinned; ``total_pin_fraction``: the share
    all peers together may have pinned, so the rest always stays evictable for the source's
    own requests. A request over a quota gets BUSY (``source_busy`` at the destination)
    before anything is pinned.

    ``max_connections_per_peer``: authenticated control connections one peer may hold open
    to the service (all its ranks' listeners together; a destination process holds one per
    source rank it pulls from); ``max_connections``: those of all peers together. A
    connection over either is closed once it has authenticated, before it is served
    (``connection_limit``); peer ids are claimed by peers that hold the fleet secret, so
    ``max_connections`` is the bound that holds against one of them too."""

    max_sends_per_peer: int = 4
    peer_pin_fraction: float = 0.25
    total_pin_fraction: float = 0.5
    max_connections_per_peer: int = 64
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_sends_per_peer", "max_connections_per_peer", "max_connections"):
            check_positive_int(name, getattr(self, name))
        for name in ("peer_pin_fraction", "total_pin_fraction"):
            check_fraction(name, getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """Everything a :class:`~kvkern.xfer.source.SourceService` is tuned by.

    ``host`` is where HTTP and the listeners bind; ``advertise_host`` (default ``host``) is
    the address peers dial, required when ``host`` binds every interface. ``chunk_bytes`` caps
    a stream's packed chunks (a staging slot; runs of consecutive blocks sent straight from
    the pool keep to the request's limit only), and a request may not ask for chunks
    smaller than ``min_chunk_bytes`` (or one block's bytes, where smaller);
    ``chunks_in_flight`` caps the chunks packed ahead, ``max_concurrent_sends`` the admitted
    requests of all peers; ``max_send_s`` caps one request's time and
    ``progress_timeout_s`` a stream without progress.
    ``idle_connection_s``: an authenticated connection with no request open and no message
    for this long is closed (the destination opens a new one when it next asks).
    ``staging_cache_bytes`` of staging buffers are kept idle for reuse. ``remote_read``
    (``off``/``host``/``all``) registers pools for one-sided reads (an opt-in, see
    SECURITY.md), whose pins are held ``read_hold_s`` at most; with ``read_directory`` (the
    default when reads are on) the pool's read directory is registered too, so destinations
    read without asking first (:mod:`kvkern.cache.directory`).

    ``accept_from``: the networks (CIDRs or addresses) whose hosts may connect to the UCX
    listeners at all; a connection request from elsewhere is rejected before UCX makes an
    endpoint for it. UCX listens on every interface whatever ``host`` says, so the default
    is loopback only when ``host`` is a loopback address, and any address otherwise (name
    the fleet's networks: UCX queues, without bound, what a connected peer sends before it
    authenticates; see SECURITY.md). :attr:`accept_networks` is the result.

    ``proven_host_ttl_s``: of those, only hosts that presented the fleet credential in an
    HTTP request (a destination's signed state fetch) within this many seconds may connect
    (:class:`~kvkern.xfer.networks.ProvenHosts`); None lets every host of ``accept_from``
    connect and prove itself on the connection."""

    worker_id: str
    host: str = "127.0.0.1"
    http_port: int = 0
    advertise_host: str | None = None
    chunk_bytes: int = 16 << 20
    min_chunk_bytes: int = MIN_CHUNK_BYTES
    chunks_in_flight: int = 4
    max_concurrent_sends: int = 8
    max_send_s: float = DEFAULT_MAX_SEND_S
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S
    idle_connection_s: float = DEFAULT_IDLE_CONNECTION_S
    pack_threads: int = 2
    staging_cache_bytes: int = 256 << 20
    remote_read: str = "off"
    read_hold_s: float = DEFAULT_READ_HOLD_S
    read_directory: bool = True
    quotas: PeerQuotas = field(default_factory=PeerQuotas)
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    accept_from: tuple[str, ...] | None = None
    proven_host_ttl_s: float | None = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not 0 < len(self.worker_id) <= MAX_ID_CHARS:
            raise ValueError(f"worker_id must be a string of 1 to {MAX_ID_CHARS} characters "
                             f"(destinations refuse a state naming a longer one), got "
                             f"{str(self.worker_id)[:40]!r}")
        if self.accept_from is not None:
            if isinstance(self.accept_from, str):
                object.__setattr__(self, "accept_from", (self.accept_from,))
            Networks.parse(self.accept_from)  # (a ValueError naming the bad entry)
            object.__setattr__(self, "accept_from", tuple(self.accept_from))
        for name in ("chunk_bytes", "chunks_in_flight", "max_concurrent_sends",
                     "pack_threads"):
            check_positive_int(name, getattr(self, name))
        if self.remote_read not in REMOTE_READ_MODES:
            raise ValueError(f"remote_read must be one of {REMOTE_READ_MODES}, got "
                             f"{self.remote_read!r}")
        check_non_negative_int("staging_cache_bytes", self.staging_cache_bytes)
        check_non_negative_int("min_chunk_bytes", self.min_chunk_bytes)
        if not (isinstance(self.read_hold_s, (int, float)) and math.isfinite(self.read_hold_s)
                and 0 <= self.read_hold_s <= self.max_send_s):
            raise ValueError(f"read_hold_s must be a finite number in [0, max_send_s], got "
                             f"{self.read_hold_s!r}")
        for name in ("max_send_s", "progress_timeout_s", "idle_connection_s"):
            check_finite_positive(name, getattr(self, name))
        if self.proven_host_ttl_s is not None:
            check_finite_positive("proven_host_ttl_s", self.proven_host_ttl_s)
        if self.peer_host in _WILDCARD_HOSTS:
            raise ValueError(f"host {self.host!r} binds every interface; pass the address "
                             f"peers should dial as advertise_host (got "
                             f"{self.advertise_host!r})")
        object.__setattr__(self, "max_send_s", float(self.max_send_s))
        object.__setattr__(self, "progress_timeout_s", float(self.progress_timeout_s))
        object.__setattr__(self, "idle_connection_s", float(self.idle_connection_s))
        object.__setattr__(self, "read_hold_s", float(self.read_hold_s))

    @property
    def accept_networks(self) -> Networks:
        """Who may connect to the UCX listeners (see ``accept_from``)."""
        if self.accept_from is not None:
            return Networks.parse(self.accept_from)
        return LOOPBACK if is_loopback_host(self.host) else ANY

    @property
    def peer_host(self) -> str:
        """The address peers dial (``advertise_host``, else ``host``)."""
        return self.advertise_host or self.host

    def replace(self, **changes: object) -> SourceConfig:
        return dataclasses.replace(self, **changes)
