"""Who may open a connection to a source's UCX listeners at all: ``accept_from``, a set of IP
networks, and :class:`ProvenHosts`, the hosts that presented the fleet credential over HTTP
lately, that each connection request's client address is checked against before UCX makes
an endpoint for it (:class:`~kvkern.xfer.ucxcompat.ListenerRelay`). A request from elsewhere
is rejected, so its sender can make the source receive, or queue, nothing."""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable, Iterable, Sequence

__all__ = ["ANY", "IPV6_HOST_PREFIX", "LOGGED_ADDRESSES", "LOOPBACK", "FirstSeen", "Networks",
           "ProvenHosts", "host_key", "is_loopback_host"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Networks:
    """IP networks; ``address in networks`` for an address string (IPv4-mapped IPv6
    addresses count as their IPv4 address; None or a malformed address is in none)."""

    __slots__ = ("networks",)

    def __init__(self, networks: Iterable[IPNetwork]) -> None:
        self.networks = tuple(networks)

    @classmethod
    def parse(cls, specs: Sequence[str] | str, *, name: str = "accept_from") -> Networks:
        """Networks from CIDRs or single addresses; one string may hold several separated
        by commas or whitespace (an environment variable's format). ``ValueError`` names
        ``name`` and the bad entry, or says there was none."""
        if isinstance(specs, str):
            specs = [specs]
        if not isinstance(specs, (list, tuple)) or not all(isinstance(s, str) for s in specs):
            raise ValueError(f"{name} must be a string or a list of strings, got {specs!r}")
        items = [x for s in specs for x in re.split(r"[,\s]+", s) if x]
        if not items:
            raise ValueError(f"{name} names no network (0.0.0.0/0 and ::/0 accept any "
                             "address)")
        out = []
        for item in items:
            try:
                out.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                raise ValueError(f"{name} entry {item!r} is not an IP network or address "
                                 "(use CIDR such as 10.0.0.0/16, or one address)") from None
        return cls(out)

    def __contains__(self, address: object) -> bool:
        ip = _ip(address)
        return ip is not None and any(ip in n for n in self.networks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Networks) and other.networks == self.networks

    def __hash__(self) -> int:
        return hash(self.networks)

    def __str__(self) -> str:
        return ", ".join(str(n) for n in self.networks)

    def __repr__(self) -> str:
        return f"Networks({str(self)!r})"


LOOPBACK = Networks.parse(["127.0.0.0/8", "::1/128"])
ANY = Networks.parse(["0.0.0.0/0", "::/0"])


LOGGED_ADDRESSES = 64  # remote addresses a refusal log names (each once), then silence

# An IPv6 host is handed a /64 (RFC 7421): per-host bounds key IPv6 addresses by it.
IPV6_HOST_PREFIX = 64


def _ip(address: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` as an IP address (an IPv4-mapped IPv6 one as its IPv4 address, an IPv6
    zone dropped); None for anything else."""
    if not isinstance(address, str):
        return None
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def host_key(address: str) -> str:
    """The key per-host bounds count ``address`` under: an IPv4 address itself (also when
    IPv4-mapped), an IPv6 address's /64 network (one host may use every address in it), and
    anything that is not an IP address unchanged."""
    ip = _ip(address)
    if ip is None:
        return address
    if isinstance(ip, ipaddress.IPv4Address):
        return str(ip)
    return str(ipaddress.IPv6Network((ip, IPV6_HOST_PREFIX), strict=False))


class FirstSeen:
    """Remote addresses seen so far: :meth:`first` is True once for each address, for the
    first ``limit`` addresses only, so a log of refusals names who was refused without
    growing with each request."""

    __slots__ = ("limit", "_seen")

    def __init__(self, limit: int = LOGGED_ADDRESSES) -> None:
        self.limit = limit
        self._seen: set[str | None] = set()

    def first(self, address: str | None) -> bool:
        if address in self._seen or len(self._seen) >= self.limit:
            return False
        self._seen.add(address)
        return True


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a bind address or name) names the loopback interface."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ProvenHosts:
    """Hosts (:func:`host_key`) that presented the fleet credential in an HTTP request within
    the last ``ttl_s`` seconds: a source's UCX listeners take connection requests from these
    only, so a host without the credential cannot make a listener queue anything (UCX keeps
    every message that no receive matches, from any endpoint, before kvkern can check it).

    A destination fetches a source's state, signed and over HTTP, before it connects, and
    again at least every ``XferConfig.state_cache_ttl_s`` while it pulls; a connection
    refused after a long pause drops its cached state, and the next pull fetches it again.
    :meth:`note` runs on the event loop, ``in`` on UCX's progress thread. At most
    ``max_hosts`` are kept, the least recently proven dropped first."""

    __slots__ = ("ttl_s", "max_hosts", "_until", "_clock")

    def __init__(self, ttl_s: float = 3600.0, max_hosts: int = 4096, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0 or max_hosts < 1:
            raise ValueError(f"ProvenHosts: ttl_s must be > 0 and max_hosts >= 1, got "
                             f"{ttl_s!r}, {max_hosts!r}")
        self.ttl_s = ttl_s
        self.max_hosts = max_hosts
        self._until: dict[str, float] = {}
        self._clock = clock

    def note(self, address: str | None) -> None:
        """``address`` presented the credential just now."""
        if not address:
            return
        key = host_key(address)
        until = self._until
        until.pop(key, None)  # (to the end: the most recent)
        until[key] = self._clock() + self.ttl_s
        while len(until) > self.max_hosts:
            del until[next(iter(until))]

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, str):
            return False
        deadline = self._until.get(host_key(address))
        return deadline is not None and self._clock() < deadline

    def __len__(self) -> int:
        return len(self._until)
