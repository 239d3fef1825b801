"""Source endpoints: parse, resolve once, check against an allowlist, fetch state safely.

A hint names its source in one of three forms::

    http(s)://host[:port][/path][?query]  exact state URL (an empty path means the default
                                          state path; the port defaults to 80 / 443)
    host | host:port | [v6]:port          state URL http://host:port/kvkern/v1/state
                                          (EndpointConfig.default_scheme / default_port)
    tcp://host:port                       a control endpoint (Dynamo); see below

``tcp://`` control endpoints and attention-DP. Dynamo's rule: the control endpoint of local DP
rank ``N`` is ``control_port + N`` (``EndpointConfig.dp_port_stride``, default 1). kvkern
fetches state over HTTP, so the state port is derived from the rank-adjusted control port::

    control port  C            (as given)
    rank port     R = C + dp_rank * dp_port_stride
    state URL     {state_scheme}://host:(R + state_port_offset){state_path}

``state_port_offset`` has no safe universal default, so it is ``None`` by default and a tcp
endpoint is then refused with ``no_state_mapping``; a deployment sets it once. For http(s) and
host forms the DP rank does not move the port (it is carried on the result for the request).

Checks, in order (each refusal carries a reason name, :data:`REASONS`)::

    parse        bad_url  bad_scheme (only http, https, tcp)  userinfo (user@host)
                 bad_host bad_port   no_state_mapping
    allowlist    empty_allowlist (fails closed: an empty allowlist allows nothing)
    host name    metadata_address (metadata.google.internal and friends)
    resolve      resolve_failed (once; injectable resolver, default socket.getaddrinfo)
                 resolve_busy (resolve_endpoint_async: too many lookups pending)
    every addr   unspecified multicast reserved          never allowed
                 metadata_address link_local loopback    only if explicitly listed (below)
                 not_allowed  port_not_allowed

Host spellings are normalised before any check, as ``inet_aton`` and browsers read them:
``2130706433``, ``0177.0.0.1``, ``0x7f.1`` and ``127.1`` are all 127.0.0.1; IPv4-mapped and
IPv4-compatible IPv6 (``::ffff:127.0.0.1``) become the IPv4 address; a host whose last label
is numeric but is not a valid address is refused (``bad_host``), as are zone ids and
percent-encoding in hosts. For NAT64 (64:ff9b::/96) and 6to4 (2002::/16) addresses, the
embedded IPv4 address is classified too.

Allowlist entries (:meth:`Allowlist.parse`; a bad entry raises ValueError at configuration)::

    10.0.0.0/8            a CIDR            [fd00::/8]:9000   a v6 CIDR with a port
    10.0.0.5  0x0a000005  an address        [::1]:9000        a v6 address with a port
    host.example:8000     a host name       *.svc.cluster.local   any name *under* the suffix
    host:8000-8010        a port range      host:*  or  host   any port

A host-name entry matches the endpoint's name as written; the addresses it resolves to are
then still classified. Special addresses need an entry that names them explicitly: a metadata
address its exact address, a link-local or loopback address an IP/CIDR entry lying inside
that range (so ``0.0.0.0/0`` never unlocks them); loopback is also unlocked by a ``localhost``
or ``*.localhost`` name entry. Every resolved address must be allowed, so a name that
resolves to one allowed and one forbidden address (DNS rebinding) is refused, and the
connection goes to the first checked address (:class:`ResolvedEndpoint` pins it), never to a
second resolution.

:func:`fetch_state` performs the GET to the pinned address with the original host in the
``Host`` header (and as TLS ``server_hostname``), follows no redirects, ignores proxy
environment variables, refuses compressed bodies and stops reading at ``max_bytes``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ipaddress
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from kvkern.checks import check_non_negative_int
from kvkern.xfer.auth import AUTH_RESPONSE_HEADER

if TYPE_CHECKING:
    from kvkern.xfer.auth import Credential

__all__ = [
    "DEFAULT_STATE_PATH",
    "FETCH_REASONS",
    "REASONS",
    "AllowEntry",
    "Allowlist",
    "EndpointConfig",
    "EndpointVerdict",
    "FetchError",
    "ResolvedEndpoint",
    "check_endpoint_main",
    "fetch_state",
    "normalize_host",
    "resolve_endpoint",
    "resolve_endpoint_async",
    "pending_lookups",
    "system_resolver",
]

DEFAULT_STATE_PATH = "/kvkern/v1/state"
ALLOWED = "allowed"
REASONS = (
    ALLOWED, "bad_url", "bad_scheme", "userinfo", "bad_host", "bad_port", "no_state_mapping",
    "empty_allowlist", "metadata_address", "resolve_failed", "resolve_busy", "unspecified",
    "multicast", "reserved", "link_local", "loopback", "not_allowed", "port_not_allowed",
)
FETCH_REASONS = ("metadata_fetch_failed", "metadata_timeout", "response_too_large", "redirect",
                 "unauthenticated")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Sequence[str]]

METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OCI, OpenStack, DigitalOcean
    "169.254.170.2",    # AWS ECS task metadata
    "fd00:ec2::254",    # AWS IMDS over IPv6
    "fd20:ce::254",     # GCP metadata over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",      # Oracle Cloud Classic
))
METADATA_HOSTS = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "instance-data",
    "instance-data.ec2.internal",
})
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")
_SCHEME_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


class _Refuse(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- host spelling


def _legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """inet_aton's reading: 1-4 parts, each decimal, 0-octal or 0x-hex; the last part fills
    the remaining bytes (``127.1`` -> 127.0.0.1). ``None`` if ``host`` is not numeric."""
    parts = host.split(".")
    if not _NUMERIC_LABEL.match(parts[-1]):
        return None
    if len(parts) > 4:  # a name ending in a number is an address or nothing (WHATWG)
        raise _Refuse("bad_host", f"host {host!r} ends in a number but has {len(parts)} parts")
    values = []
    for part in parts:
        if len(part) > 34:  # (int() of 4301+ digits raises; no IPv4 spelling needs this)
            raise _Refuse("bad_host", f"host {host[:40]!r}... has a numeric part of "
                          f"{len(part)} characters")
        if re.fullmatch(r"0x[0-9a-f]*", part):
            values.append(int(part[2:] or "0", 16))
        elif re.fullmatch(r"0[0-7]*", part):
            values.append(int(part, 8))
        elif re.fullmatch(r"[1-9][0-9]*", part):
            values.append(int(part))
        else:
            raise _Refuse("bad_host", f"host {host!r} is numeric but not a valid IPv4 address")
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        raise _Refuse("bad_host", f"host {host!r} is numeric but out of IPv4 range")
    n = 0
    for v in head:
        n = (n << 8) | v
    n = (n << (8 * (4 - len(head)))) | last
    return ipaddress.IPv4Address(n)


def _canonical_ip(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        n = int(ip)
        if 1 < n < (1 << 32) and ip.scope_id is None:  # deprecated IPv4-compatible ::a.b.c.d
            return ipaddress.IPv4Address(n)
    return ip


def normalize_host(host: str, *, bracketed: bool = False) -> IPAddress | str:
    """An IP address for any numeric spelling, else the lower-cased, validated host name
    (trailing dot removed). Raises ``_Refuse('bad_host')`` (a ValueError-like refusal)."""
    h = host.lower()
    if not h or any(c in h for c in "%\\ \t\r\n") or not h.isascii():
        raise _Refuse("bad_host", f"host {host!r} has forbidden characters (zone ids, "
                      "percent-encoding, whitespace, non-ASCII)")
    if bracketed or ":" in h:
        try:
            return _canonical_ip(ipaddress.IPv6Address(h))
        except ValueError:
            raise _Refuse("bad_host", f"host {host!r} is not an IPv6 address") from None
    if h.endswith("."):
        h = h[:-1]
    try:
        return _canonical_ip(ipaddress.ip_address(h))
    except ValueError:
        pass
    legacy = _legacy_ipv4(h)
    if legacy is not None:
        return legacy
    if len(h) > 253 or not all(_LABEL.match(label) for label in h.split(".")):
        raise _Refuse("bad_host", f"host {host!r} is not a valid host name")
    return h


def _special(ip: IPAddress) -> str | None:
    """The class of a special address, or None for an ordinary one."""
    if ip.is_unspecified:
        return "unspecified"
    if ip in METADATA_ADDRESSES:
        return "metadata_address"
    if ip.is_link_local:
        return "link_local"
    if ip.is_loopback:
        return "loopback"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address):
        if ip.is_reserved or ip == ipaddress.IPv4Address("255.255.255.255") or int(ip) >> 24 == 0:
            return "reserved"
        return None
    if ip in _NAT64 or ip in _6TO4:
        n = int(ip)
        embedded = ipaddress.IPv4Address(n & 0xFFFFFFFF if ip in _NAT64 else (n >> 80) & 0xFFFFFFFF)
        inner = _special(embedded)
        if inner is not None:
            return inner
    if ip.is_reserved or ip.is_site_local:
        return "reserved"
    return None


# ------------------------------------------------------------------------------- allowlist


@dataclass(frozen=True, kw_only=True)
class AllowEntry:
    """One allowlist entry: exactly one of ``network`` / ``name`` / ``suffix`` is set;
    ``ports`` is an inclusive range or ``None`` for any port."""

    spec: str
    network: IPNetwork | None = None
    name: str | None = None
    suffix: str | None = None  # "*.svc.cluster.local" -> ".svc.cluster.local"
    ports: tuple[int, int] | None = None

    def port_ok(self, port: int) -> bool:
        return self.ports is None or self.ports[0] <= port <= self.ports[1]

    def matches_name(self, host: str | None) -> bool:
        if host is None:
            return False
        if self.name is not None:
            return host == self.name
        return self.suffix is not None and host.endswith(self.suffix)

    @classmethod
    def parse(cls, spec: str) -> AllowEntry:
        s = spec.strip().lower()
        if not s:
            raise ValueError(f"empty allowlist entry {spec!r}")
        port_text: str | None = None
        if s.startswith("["):
            end = s.find("]")
            if end < 0 or s[end + 1 :] not in ("",) and not s[end + 1 :].startswith(":"):
                raise ValueError(f"allowlist entry {spec!r}: bad bracketed IPv6")
            host, rest = s[1:end], s[end + 1 :]
            port_text = rest[1:] if rest else None
        elif s.count(":") >= 2:
            host = s  # bare IPv6 address or CIDR, no port
        elif ":" in s:
            host, port_text = s.rsplit(":", 1)
        else:
            host = s
        ports = _parse_ports(port_text, spec)
        if "/" in host:
            try:
                net = ipaddress.ip_network(host, strict=True)
            except ValueError as exc:
                raise ValueError(f"allowlist entry {spec!r}: {exc}") from None
            return cls(spec=spec, network=net, ports=ports)
        if host.startswith("*."):
            rest = host[2:].rstrip(".")
            if not rest or not all(_LABEL.match(x) for x in rest.split(".")):
                raise ValueError(f"allowlist entry {spec!r}: bad wildcard suffix")
            return cls(spec=spec, suffix="." + rest, ports=ports)
        if "*" in host:
            raise ValueError(
                f"allowlist entry {spec!r}: only a leading '*.' wildcard is supported "
                "(use 0.0.0.0/0 or ::/0 to allow every address explicitly)"
            )
        try:
            norm = normalize_host(host, bracketed=s.startswith("["))
        except _Refuse as exc:
            raise ValueError(f"allowlist entry {spec!r}: {exc.detail}") from None
        if isinstance(norm, str):
            return cls(spec=spec, name=norm, ports=ports)
        return cls(spec=spec, network=ipaddress.ip_network(norm), ports=ports)


def _parse_ports(text: str | None, spec: str) -> tuple[int, int] | None:
    if text is None or text == "*":
        return None
    m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", text)
    if not m:
        raise ValueError(f"allowlist entry {spec!r}: bad port {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2) or lo)
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"allowlist entry {spec!r}: port range {lo}-{hi} not in 1..65535")
    return (lo, hi)


@dataclass(frozen=True)
class Allowlist:
    """Parsed allowlist entries. Empty allows nothing."""

    entries: tuple[AllowEntry, ...] = ()

    @classmethod
    def parse(cls, specs: Iterable[str] | str) -> Allowlist:
        """Entries from strings; a single string may hold several separated by commas or
        whitespace (the ``KVKERN_ALLOWLIST`` environment variable's format)."""
        if isinstance(specs, str):
            specs = [specs]
        items = [x for s in specs for x in re.split(r"[,\s]+", s) if x]
        return cls(tuple(AllowEntry.parse(x) for x in items))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def check(self, ip: IPAddress, host: str | None, port: int) -> tuple[str, str]:
        """``(reason, detail)`` for one resolved address; reason ``allowed`` if it passes."""
        special = _special(ip)
        if special in ("unspecified", "multicast", "reserved"):
            return special, f"{ip} is a {special} address (never allowed)"
        if special is not None:
            covering = [e for e in self.entries if _unlocks(e, special, ip, host)]
            if not covering:
                what = {"metadata_address": "cloud metadata", "link_local": "link-local",
                        "loopback": "loopback"}[special]
                return special, (f"{ip} is a {what} address; only an entry naming it "
                                 "explicitly allows it")
        else:
            covering = [e for e in self.entries
                        if (e.network is not None and ip in e.network) or e.matches_name(host)]
            if not covering:
                return "not_allowed", f"{ip}{f' ({host})' if host else ''} matches no entry"
        ok = [e for e in covering if e.port_ok(port)]
        if not ok:
            return "port_not_allowed", (f"{_fmt_host(str(ip))} port {port} not allowed by "
                                        f"{', '.join(e.spec for e in covering)}")
        return ALLOWED, f"{_fmt_host(str(ip))}:{port} allowed by {ok[0].spec}"


def _unlocks(e: AllowEntry, special: str, ip: IPAddress, host: str | None) -> bool:
    if special == "loopback" and host is not None and e.network is None and e.matches_name(host):
        return host == "localhost" or host.endswith(".localhost")
    if e.network is None or ip not in e.network:
        return False
    if special == "metadata_address":
        return e.network.num_addresses == 1
    ranges = _LINK_LOCAL if special == "link_local" else _LOOPBACK
    return any(e.network.version == r.version and e.network.subnet_of(r) for r in ranges)


# ------------------------------------------------------------------------------ endpoints


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """How endpoint strings map to state URLs (see the module docstring)."""

    default_scheme: Literal["http", "https"] = "http"
    default_port: int = 8000
    state_path: str = DEFAULT_STATE_PATH
    dp_port_stride: int = 1
    state_port_offset: int | None = None
    state_scheme: Literal["http", "https"] = "http"
    max_addresses: int = 64


DEFAULT_CONFIG = EndpointConfig()


@dataclass(frozen=True, kw_only=True)
class ResolvedEndpoint:
    """A checked state endpoint. Connect to ``ip``:``port``; send ``host_header``; for https
    verify the certificate against ``host``. ``addresses`` are every resolved (and checked)
    address; ``control`` is the rank-adjusted control endpoint for tcp sources."""

    scheme: str
    host: str
    ip: str
    port: int
    path: str
    addresses: tuple[str, ...]
    dp_rank: int | None = None
    control: str | None = None

    @property
    def url(self) -> str:
        """The URL with the pinned address in place of the host."""
        return f"{self.scheme}://{_fmt_host(self.ip)}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        h = _fmt_host(self.host)
        return h if _SCHEME_PORTS.get(self.scheme) == self.port else f"{h}:{self.port}"

    @property
    def display_url(self) -> str:
        return f"{self.scheme}://{self.host_header}{self.path}"


@dataclass(frozen=True, kw_only=True)
class EndpointVerdict:
    """The outcome of :func:`resolve_endpoint`: ``reason`` is ``allowed`` or a refusal from
    :data:`REASONS`; ``endpoint`` is set only when allowed."""

    endpoint_spec: str
    allowed: bool
    reason: str
    detail: str
    endpoint: ResolvedEndpoint | None = None
    addresses: tuple[str, ...] = ()
    state_url: str | None = None  # with the original host, for display


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class _Parsed:
    scheme: str
    host: IPAddress | str
    port: int
    path: str
    control: str | None = None
    bracketed: bool = field(default=False)

    @property
    def state_url(self) -> str:
        """The state URL with the host as written (for display)."""
        return f"{self.scheme}://{_fmt_host(str(self.host))}:{self.port}{self.path}"


def _split_authority(authority: str, spec: str) -> tuple[str, str | None, bool]:
    if "@" in authority:
        raise _Refuse("userinfo", f"endpoint {spec!r} carries user info")
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise _Refuse("bad_host", f"endpoint {spec!r}: unterminated IPv6 bracket")
        rest = authority[end + 1 :]
        if rest and not rest.startswith(":"):
            raise _Refuse("bad_host", f"endpoint {spec!r}: junk after IPv6 bracket")
        return authority[1:end], (rest[1:] if rest else None), True
    if authority.count(":") == 1:
        host, port = authority.split(":")
        return host, port, False
    return authority, None, False


def _port(text: str | None, default: int | None, spec: str) -> int:
    if text is None:
        if default is None:
            raise _Refuse("bad_port", f"endpoint {spec!r} needs a port")
        return default
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 1 <= int(text) <= 65535:
        raise _Refuse("bad_port", f"endpoint {spec!r}: port {text!r} not in 1..65535")
    return int(text)


def _parse(spec: str, dp_rank: int | None, config: EndpointConfig) -> _Parsed:
    if not spec or any(not "\x21" <= c <= "\x7e" for c in spec) or "\\" in spec:
        raise _Refuse("bad_url", f"endpoint {spec!r} is empty or has whitespace, control or "
                      "non-ASCII characters or backslashes")
    if "#" in spec:
        raise _Refuse("bad_url", f"endpoint {spec!r} has a fragment")
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", spec)
    if m:
        scheme = m.group(1).lower()
        rest = spec[m.end() :]
        if scheme not in ("http", "https", "tcp"):
            raise _Refuse("bad_scheme", f"endpoint {spec!r}: scheme {scheme!r} not in "
                          "http, https, tcp")
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        authority, path = rest[:cut], rest[cut:]
    elif spec.startswith("/"):
        raise _Refuse("bad_url", f"endpoint {spec!r} has no host")
    else:
        if "/" in spec or "?" in spec:
            raise _Refuse("bad_url", f"endpoint {spec!r}: a path needs an http(s):// URL")
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:[^0-9]", spec) and spec.count(":") == 1:
            raise _Refuse("bad_scheme", f"endpoint {spec!r}: scheme not in http, https, tcp")
        scheme, authority, path = "", spec, ""
    if scheme == "" and authority.count(":") >= 2 and not authority.startswith("["):
        host_text, port_text, bracketed = authority, None, True  # bare IPv6 literal
    else:
        host_text, port_text, bracketed = _split_authority(authority, spec)
    if scheme in ("http", "https", "tcp") and authority.count(":") >= 2 and not bracketed:
        raise _Refuse("bad_host", f"endpoint {spec!r}: IPv6 literals in URLs need brackets")
    if not host_text:
        raise _Refuse("bad_host", f"endpoint {spec!r} has no host")
    host = normalize_host(host_text, bracketed=bracketed)
    if scheme == "tcp":
        if path not in ("", "/"):
            raise _Refuse("bad_url", f"endpoint {spec!r}: a tcp control endpoint has no path")
        ctrl = _port(port_text, None, spec)
        rank_port = ctrl + (dp_rank or 0) * config.dp_port_stride
        if rank_port > 65535:
            raise _Refuse("bad_port", f"endpoint {spec!r}: control port {ctrl} + dp rank "
                          f"{dp_rank} * {config.dp_port_stride} = {rank_port} > 65535")
        hs = _fmt_host(str(host))
        if config.state_port_offset is None:
            raise _Refuse("no_state_mapping", f"endpoint {spec!r} is a tcp control endpoint "
                          "and no state_port_offset is configured")
        state_port = rank_port + config.state_port_offset
        if not 1 <= state_port <= 65535:
            raise _Refuse("bad_port", f"endpoint {spec!r}: state port {rank_port} + "
                          f"{config.state_port_offset} = {state_port} not in 1..65535")
        return _Parsed(config.state_scheme, host, state_port, config.state_path,
                       control=f"tcp://{hs}:{rank_port}")
    if scheme == "":
        return _Parsed(config.default_scheme, host, _port(port_text, config.default_port, spec),
                       config.state_path)
    if path in ("", "/"):
        path = config.state_path
    elif path.startswith("?"):
        path = config.state_path + path
    return _Parsed(scheme, host, _port(port_text, _SCHEME_PORTS[scheme], spec), path)


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``socket.getaddrinfo`` gives for ``host`` (TCP), in its order."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def resolve_endpoint(
    endpoint: str,
    allowlist: Allowlist | Iterable[str],
    *,
    dp_rank: int | None = None,
    config: EndpointConfig = DEFAULT_CONFIG,
    resolver: Resolver | None = None,
) -> EndpointVerdict:
    """Parse ``endpoint``, resolve its host once and check every address against
    ``allowlist``. Never raises for a hostile endpoint (the verdict names the reason); raises
    ValueError for a bad allowlist entry or a negative ``dp_rank`` (configuration errors)."""
    allow = _allowlist(allowlist, dp_rank)
    screened = _screen(endpoint, allow, dp_rank, config)
    if isinstance(screened, EndpointVerdict):
        return screened
    return _look_up(endpoint, allow, screened, resolver or system_resolver, config, dp_rank)


def _allowlist(allowlist: Allowlist | Iterable[str], dp_rank: int | None) -> Allowlist:
    if dp_rank is not None:
        check_non_negative_int("dp_rank", dp_rank)
    return allowlist if isinstance(allowlist, Allowlist) else Allowlist.parse(allowlist)


def _refused(endpoint: str, exc: _Refuse, addresses: tuple[str, ...] = (),
             state_url: str | None = None) -> EndpointVerdict:
    return EndpointVerdict(endpoint_spec=endpoint, allowed=False, reason=exc.reason,
                           detail=exc.detail, addresses=addresses, state_url=state_url)


def _screen(endpoint: str, allow: Allowlist, dp_rank: int | None,
            config: EndpointConfig) -> _Parsed | EndpointVerdict:
    """The endpoint parsed and every check that needs no lookup: the parsed endpoint, or
    the refusal."""
    state_url = None
    try:
        p = _parse(endpoint, dp_rank, config)
        state_url = p.state_url
        if not allow:
            raise _Refuse("empty_allowlist", "no allowlist configured: outbound fetches are off")
        if isinstance(p.host, str):
            if p.host in METADATA_HOSTS and not any(e.name == p.host for e in allow.entries):
                raise _Refuse("metadata_address", f"host {p.host!r} is a cloud metadata "
                              "service name")
            if not any(e.matches_name(p.host) or e.network is not None
                       for e in allow.entries):
                raise _Refuse("not_allowed", f"host {p.host!r} matches no entry")
    except _Refuse as exc:
        return _refused(endpoint, exc, state_url=state_url)
    return p


def _look_up(endpoint: str, allow: Allowlist, p: _Parsed, resolver: Resolver,
             config: EndpointConfig, dp_rank: int | None) -> EndpointVerdict:
    """A screened endpoint's host resolved (a name: through ``resolver``, once) and every
    address checked."""
    host_name = p.host if isinstance(p.host, str) else None
    state_url = p.state_url
    addresses: tuple[str, ...] = ()
    try:
        if host_name is not None:
            ips = _resolve(host_name, p.port, resolver, config)
        else:
            assert not isinstance(p.host, str)
            ips = [p.host]
        addresses = tuple(str(ip) for ip in ips)
        for ip in ips:
            reason, detail = allow.check(ip, host_name, p.port)
            if reason != ALLOWED:
                raise _Refuse(reason, detail)
    except _Refuse as exc:
        return _refused(endpoint, exc, addresses, state_url)
    resolved = ResolvedEndpoint(
        scheme=p.scheme, host=host_name or str(ips[0]), ip=str(ips[0]), port=p.port,
        path=p.path, addresses=addresses, dp_rank=dp_rank, control=p.control,
    )
    return EndpointVerdict(endpoint_spec=endpoint, allowed=True, reason=ALLOWED,
                           detail=f"{len(ips)} address(es) checked; {detail}",
                           endpoint=resolved, addresses=addresses,
                           state_url=resolved.display_url)


def _resolve(host: str, port: int, resolver: Resolver, config: EndpointConfig) -> list[IPAddress]:
    try:
        raw = list(resolver(host, port))
    except (OSError, UnicodeError, ValueError) as exc:
        raise _Refuse("resolve_failed", f"resolving {host!r}: {exc}") from None
    out: list[IPAddress] = []
    for text in raw:
        try:
            ip = _canonical_ip(ipaddress.ip_address(text))
        except ValueError:
            raise _Refuse("resolve_failed", f"resolver gave {text!r} for {host!r}") from None
        if ip not in out:
            out.append(ip)
    if not out:
        raise _Refuse("resolve_failed", f"{host!r} resolved to no address")
    if len(out) > config.max_addresses:
        raise _Refuse("resolve_failed", f"{host!r} resolved to {len(out)} addresses > "
                      f"{config.max_addresses}")
    return out


# Host names are looked up on threads of their own, never on the event loop's default
# executor: getaddrinfo blocks for as long as the system's resolver retries (seconds when a
# name server is down), and lookups that hold every thread of a shared executor would stall
# whatever else waits there. At most MAX_PENDING_LOOKUPS wait or run at once; a hint whose
# name would be one more is refused at once (``resolve_busy``).
LOOKUP_THREADS = 4
MAX_PENDING_LOOKUPS = 64
_lookups: concurrent.futures.ThreadPoolExecutor | None = None
_lookups_lock = threading.Lock()
_pending_lookups = 0


def pending_lookups() -> int:
    """Host name lookups waiting for or running on the lookup threads, in this process."""
    return _pending_lookups


async def resolve_endpoint_async(
    endpoint: str,
    allowlist: Allowlist | Iterable[str],
    *,
    dp_rank: int | None = None,
    config: EndpointConfig = DEFAULT_CONFIG,
    resolver: Resolver | None = None,
) -> EndpointVerdict:
    """:func:`resolve_endpoint`, its lookup of a host name on the lookup threads (module
    comment above); an endpoint that names an address, or is refused before any lookup, on
    this thread. A name past :data:`MAX_PENDING_LOOKUPS` is refused as ``resolve_busy``."""
    global _lookups, _pending_lookups
    allow = _allowlist(allowlist, dp_rank)
    screened = _screen(endpoint, allow, dp_rank, config)
    if isinstance(screened, EndpointVerdict):
        return screened
    resolver = resolver or system_resolver
    if not isinstance(screened.host, str):
        return _look_up(endpoint, allow, screened, resolver, config, dp_rank)
    with _lookups_lock:
        if _pending_lookups >= MAX_PENDING_LOOKUPS:
            return _refused(endpoint, _Refuse(
                "resolve_busy", f"{_pending_lookups} host name lookups pending (at most "
                f"{MAX_PENDING_LOOKUPS})"))
        if _lookups is None:
            _lookups = concurrent.futures.ThreadPoolExecutor(
                LOOKUP_THREADS, thread_name_prefix="kvkern-lookup")
        _pending_lookups += 1
    try:
        fut = _lookups.submit(_look_up, endpoint, allow, screened, resolver, config, dp_rank)
    except RuntimeError as exc:  # (the interpreter is shutting down)
        _lookup_done(None)
        return _refused(endpoint, _Refuse("resolve_busy", f"no lookup thread: {exc}"))
    except BaseException:
        _lookup_done(None)
        raise
    fut.add_done_callback(_lookup_done)
    return await asyncio.wrap_future(fut)


def _lookup_done(_: object) -> None:
    global _pending_lookups
    with _lookups_lock:
        _pending_lookups -= 1


def _forget_lookups() -> None:
    """In a forked child: the parent's lookup threads do not exist there."""
    global _lookups, _lookups_lock, _pending_lookups
    _lookups, _lookups_lock, _pending_lookups = None, threading.Lock(), 0


os.register_at_fork(after_in_child=_forget_lookups)


# ----------------------------------------------------------------------------- state fetch


class FetchError(Exception):
    """A failed state fetch; ``reason`` is one of :data:`FETCH_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


async def fetch_state(
    resolved: ResolvedEndpoint,
    *,
    timeout_s: float,
    max_bytes: int,
    headers: dict[str, str] | None = None,
    credential: Credential | None = None,
) -> bytes:
    """GET the state from the pinned address and return the body (at most ``max_bytes``).

    The whole exchange (connect, headers, body) is bounded by ``timeout_s``. A 3xx is a
    ``redirect`` error (never followed), other non-2xx ``metadata_fetch_failed``; a body over
    ``max_bytes`` (by Content-Length or while streaming) ``response_too_large``; a timeout
    ``metadata_timeout``. With a ``credential`` (:class:`kvkern.xfer.auth.Credential`) the
    request is signed and the answer must carry the source's signature over it
    (``unauthenticated`` otherwise, and for a 401)."""
    import aiohttp  # heavy: only when fetching
    import yarl

    if not (timeout_s > 0) or max_bytes < 0:
        raise ValueError(f"timeout_s {timeout_s!r} must be > 0 and max_bytes {max_bytes!r} >= 0")
    url = yarl.URL(resolved.url, encoded=True)
    send_headers = {"Accept-Encoding": "identity", **(headers or {}),
                    "Host": resolved.host_header}
    nonce = None
    if credential is not None:
        from kvkern.xfer.auth import authority  # noqa: PLC0415

        signed, nonce = credential.sign_request(
            "GET", url.raw_path_qs, to=authority(resolved.host, resolved.port))
        send_headers.update(signed)
    extra = {"server_hostname": resolved.host} if resolved.scheme == "https" else {}

    async def go() -> bytes:
        connector = aiohttp.TCPConnector(force_close=True, use_dns_cache=False, limit=1)
        async with aiohttp.ClientSession(
            connector=connector, trust_env=False, auto_decompress=False
        ) as session, session.get(
            url, headers=send_headers, allow_redirects=False, **extra
        ) as resp:
            if resp.status == 401:
                raise FetchError("unauthenticated", f"{resolved.display_url} refused this "
                                 "worker's fleet credential")
            if 300 <= resp.status < 400:
                raise FetchError("redirect", f"{resolved.display_url} answered "
                                 f"{resp.status} to {resp.headers.get('Location')!r}; "
                                 "redirects are not followed")
            if not 200 <= resp.status < 300:
                raise FetchError("metadata_fetch_failed",
                                 f"{resolved.display_url} answered {resp.status}")
            encoding = resp.headers.get("Content-Encoding", "identity").lower()
            if encoding not in ("", "identity"):
                raise FetchError("metadata_fetch_failed",
                                 f"unexpected Content-Encoding {encoding!r}")
            length = resp.content_length
            if length is not None and length > max_bytes:
                raise FetchError("response_too_large",
                                 f"Content-Length {length} > max_bytes {max_bytes}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > max_bytes:
                    raise FetchError("response_too_large",
                                     f"body exceeded max_bytes {max_bytes}")
            if nonce is not None and not credential.verify_response(
                    nonce, bytes(body), resp.headers.get(AUTH_RESPONSE_HEADER)):
                raise FetchError("unauthenticated", f"{resolved.display_url} did not sign "
                                 "its answer with the fleet secret")
            return bytes(body)

    try:
        return await asyncio.wait_for(go(), timeout_s)
    except FetchError:
        raise
    except asyncio.TimeoutError:
        raise FetchError("metadata_timeout", f"{resolved.display_url} ({resolved.ip}) did not "
                         f"answer within {timeout_s} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise FetchError("metadata_fetch_failed",
                         f"{resolved.display_url} ({resolved.ip}): {exc!r}") from None


# ------------------------------------------------------------------------------------ CLI


def check_endpoint_main(argv: Sequence[str] | None = None) -> int:
    """``kvkern check-endpoint URL --allow SPEC ...``: exit 0 allowed, 3 refused, 2 usage."""
    from kvkern.serve.cliargs import DefaultsFormatter  # noqa: PLC0415

    ap = argparse.ArgumentParser(
        prog="kvkern check-endpoint",
        description="Resolve a source endpoint once and check every address against an "
                    "allowlist. Without --allow, KVKERN_ALLOWLIST (comma or space separated) "
                    "is used; an empty allowlist refuses everything.",
        formatter_class=DefaultsFormatter,
    )
    ap.add_argument("endpoint", help="http(s) URL, host[:port] or tcp://host:port")
    ap.add_argument("--allow", action="append", default=[], metavar="SPEC",
                    help="allowlist entry: 10.0.0.0/8, host:8000, [::1]:9000, "
                         "*.svc.cluster.local, host:8000-8010 (repeatable; default: "
                         "KVKERN_ALLOWLIST)")
    ap.add_argument("--dp-rank", type=int, default=None,
                    help="source attention-DP rank (default: none, the endpoint as given)")
    ap.add_argument("--dp-port-stride", type=int, default=1,
                    help="tcp control port of DP rank N = port + N * stride")
    ap.add_argument("--state-port-offset", type=int, default=None,
                    help="state port = rank-adjusted tcp control port + OFFSET (default: "
                         "none, tcp:// endpoints are refused)")
    ap.add_argument("--default-port", type=int, default=DEFAULT_CONFIG.default_port,
                    help="state port for host-only endpoints")
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: text)")
    try:
        ns = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    specs = ns.allow or [os.environ.get("KVKERN_ALLOWLIST", "")]
    try:
        allow = Allowlist.parse(specs)
        config = EndpointConfig(default_port=ns.default_port, dp_port_stride=ns.dp_port_stride,
                                state_port_offset=ns.state_port_offset)
        verdict = resolve_endpoint(ns.endpoint, allow, dp_rank=ns.dp_rank, config=config)
    except ValueError as exc:
        print(f"kvkern check-endpoint: {exc}", file=sys.stderr)
        return 2
    ep = verdict.endpoint
    if ns.json:
        out = {"endpoint": ns.endpoint, "allowed": verdict.allowed, "reason": verdict.reason,
               "detail": verdict.detail, "addresses": list(verdict.addresses),
               "state_url": verdict.state_url, "dp_rank": ns.dp_rank,
               "resolved": asdict(ep) | {"url": ep.url, "host_header": ep.host_header}
               if ep else None}
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"endpoint   {ns.endpoint}" + (f"  (dp rank {ns.dp_rank})" if ns.dp_rank else ""))
        if ep is not None and ep.control:
            print(f"control    {ep.control}")
        if verdict.state_url:
            print(f"state url  {verdict.state_url}")
        print(f"addresses  {', '.join(verdict.addresses) or '-'}")
        if ep is not None:
            print(f"connect    {ep.url}  (Host: {ep.host_header})")
            print(f"verdict    allowed ({verdict.detail})")
        else:
            print(f"verdict    refused: {verdict.reason} ({verdict.detail})")
    return 0 if verdict.allowed else 3
