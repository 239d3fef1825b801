"""The fleet credential: who may talk to a worker as a peer, and which hints a worker trusts.

Every worker, router and tool of one fleet holds the same secret (at least 32 bytes). Nothing
here encrypts: the secret only authenticates, with HMAC-SHA256 from the standard library
(:mod:`hmac`, :mod:`hashlib`, :mod:`secrets`). Each use derives its own key, so a MAC made for
one purpose never verifies for another::

    key(label) = HMAC-SHA256(secret, b"kvkern/auth/v1/" + label)
    mac(label, parts) = HMAC-SHA256(key(label), len-prefixed parts)

Three uses:

``ctl``  UCX control connections, a challenge-response bound to the connection (one round
         trip per connection, none per pull)::

             client                                         server
             Hello(nonce_c, id_c)            ─────────►
                                             ◄─────────     Challenge(nonce_s, id_s,
                                                              mac("ctl-server", nonce_c, nonce_s, id_c, id_s))
             check the server's MAC (a source without the secret fails here)
             Proof(mac("ctl-client", nonce_c, nonce_s, id_c, id_s))  ─────────►  check; else abort
             PullRequest ... (pipelined behind Proof)

         The server reads nothing but a small Hello and a Proof, each under a short timeout,
         before the peer is authenticated.

``http`` Peer HTTP endpoints (state document, block listing): each request carries
         ``X-Kvkern-Auth: v2 id=<peer> to=<host:port> ts=<unix ms> nonce=<hex> mac=<hex>``
         over the method, the path and query, the server it is sent to (the host and port
         dialed), the time and the nonce; the server accepts it only when ``to`` names it
         (:func:`addressed_to`), within :data:`HTTP_SKEW_S` of its clock and once per
         nonce, so a request seen by one host is no key to another; and signs its answer
         (``X-Kvkern-Auth-Response``: a MAC over the request's nonce and the body's SHA-256),
         so a destination also knows the state came from a fleet member.

``hint`` Router hints: the router signs what a hint asks for (source, hashes, dialect
         options), the request's tokens and cache salt, and an expiry; a worker uses a hint
         only with a valid, unexpired signature (or when its operator trusts unsigned hints).

Where the secret comes from: :meth:`Credential.from_env` reads ``KVKERN_FLEET_SECRET_FILE``
(a file holding the secret, hex or raw) or ``KVKERN_FLEET_SECRET`` (the secret, hex or text).
``kvkern secret`` prints a fresh one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvkern.xfer.tuning import DEFAULT_HINT_TTL_S, HTTP_SKEW_S, MAX_HINT_TTL_S
from kvkern.xfer.tuning import MAX_SEEN_NONCES as _MAX_SEEN_NONCES

__all__ = [
    "AUTH_HEADER",
    "FROM_ENV",
    "AUTH_RESPONSE_HEADER",
    "addressed_to",
    "authority",
    "serves_request",
    "Credential",
    "CredentialError",
    "HINT_AUTH_FIELD",
    "HTTP_SKEW_S",
    "HttpVerifier",
    "NONCE_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "check_hint",
    "generate_secret",
    "resolve",
    "sign_hint",
]

SECRET_ENV = "KVKERN_FLEET_SECRET"
SECRET_FILE_ENV = "KVKERN_FLEET_SECRET_FILE"
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_PEER_ID = 128
MAX_HINT_EXP_MS = 1 << 53  # a hint's expiry, Unix ms: exactly representable as a float
AUTH_HEADER = "X-Kvkern-Auth"
AUTH_RESPONSE_HEADER = "X-Kvkern-Auth-Response"
_HTTP_NONCE_BYTES = 16
_LABELS = frozenset({"ctl-server", "ctl-client", "http-request", "http-response", "hint"})


FROM_ENV = "from-env"  # a credential argument's default: Credential.from_env()


def resolve(credential: Credential | str | None, *, peer_id: str = "") -> Credential | None:
    """``credential`` itself, or for :data:`FROM_ENV` the environment's (None if unset)."""
    if credential == FROM_ENV:
        return Credential.from_env(peer_id=peer_id)
    if credential is not None and not isinstance(credential, Credential):
        raise TypeError(f"credential must be a Credential, None or FROM_ENV, got "
                        f"{type(credential).__name__}")
    return credential


class CredentialError(ValueError):
    """A secret that cannot be used (missing file, too short, unreadable)."""


def generate_secret() -> str:
    """A fresh fleet secret: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(32)


def _parse_secret(raw: bytes, where: str) -> bytes:
    text = raw.strip()
    try:
        decoded = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        decoded = text
    if len(decoded) < MIN_SECRET_BYTES:
        raise CredentialError(f"{where}: a fleet secret needs at least {MIN_SECRET_BYTES} bytes "
                              f"({2 * MIN_SECRET_BYTES} hex digits), got {len(decoded)}; "
                              "make one with `kvkern secret`")
    if len(decoded) > MAX_SECRET_BYTES:
        raise CredentialError(f"{where}: a fleet secret of {len(decoded)} bytes is longer than "
                              f"{MAX_SECRET_BYTES}")
    return decoded


def _frame(parts: Sequence[bytes | str | int]) -> bytes:
    """Length-prefixed concatenation, so no two part lists encode alike."""
    out = bytearray()
    for p in parts:
        if isinstance(p, str):
            p = p.encode("utf-8")
        elif isinstance(p, int):
            p = str(p).encode("ascii")
        out += struct.pack("<I", len(p)) + p
    return bytes(out)


class Credential:
    """The fleet secret and this holder's peer id (the name it authenticates as, logged by
    the other side and used for per-peer quotas)."""

    __slots__ = ("_keys", "peer_id")

    def __init__(self, secret: bytes | str, *, peer_id: str = "") -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        self._init(_parse_secret(raw, "fleet secret"), peer_id)

    def _init(self, key: bytes, peer_id: str) -> None:
        """Derive the per-purpose keys from ``key``, the secret's bytes as parsed once (a
        parsed key is binary: parsing it again would strip whitespace bytes off its ends)."""
        if len(peer_id) > MAX_PEER_ID:
            raise CredentialError(f"peer id of {len(peer_id)} characters is longer than "
                                  f"{MAX_PEER_ID}")
        self.peer_id = peer_id or f"peer-{secrets.token_hex(4)}"
        self._keys = {label: hmac.new(key, b"kvkern/auth/v1/" + label.encode(),
                                      hashlib.sha256).digest() for label in _LABELS}

    @classmethod
    def _from_key(cls, key: bytes, peer_id: str) -> Credential:
        out = object.__new__(cls)
        out._init(key, peer_id)
        return out

    def __repr__(self) -> str:  # never the secret
        return f"Credential(peer_id={self.peer_id!r})"

    @classmethod
    def from_file(cls, path: str, *, peer_id: str = "") -> Credential:
        try:
            with open(path, "rb") as f:
                raw = f.read(2 * MAX_SECRET_BYTES + 64)
        except OSError as exc:
            raise CredentialError(f"cannot read the fleet secret file {path!r}: "
                                  f"{exc.strerror or exc}") from None
        return cls._from_key(_parse_secret(raw, path), peer_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 peer_id: str = "") -> Credential | None:
        """The credential named by ``KVKERN_FLEET_SECRET_FILE`` or ``KVKERN_FLEET_SECRET``
        (the file wins), or None when neither is set."""
        env = os.environ if env is None else env
        path = env.get(SECRET_FILE_ENV, "")
        if path:
            return cls.from_file(path, peer_id=peer_id)
        value = env.get(SECRET_ENV, "")
        if value:
            return cls._from_key(_parse_secret(value.encode(), SECRET_ENV), peer_id)
        return None

    def with_peer_id(self, peer_id: str) -> Credential:
        out = object.__new__(Credential)
        out._keys = self._keys
        if len(peer_id) > MAX_PEER_ID:
            raise CredentialError(f"peer id of {len(peer_id)} characters is longer than "
                                  f"{MAX_PEER_ID}")
        out.peer_id = peer_id
        return out

    def mac(self, label: str, *parts: bytes | str | int) -> bytes:
        return hmac.new(self._keys[label], _frame(parts), hashlib.sha256).digest()

    def verify(self, label: str, mac: bytes | str, *parts: bytes | str | int) -> bool:
        if isinstance(mac, str):
            try:
                mac = bytes.fromhex(mac)
            except ValueError:
                return False
        return len(mac) == MAC_BYTES and hmac.compare_digest(self.mac(label, *parts), mac)

    # ---- control connections

    def server_proof(self, nonce_c: bytes, nonce_s: bytes, id_c: str, id_s: str) -> bytes:
        return self.mac("ctl-server", nonce_c, nonce_s, id_c, id_s)

    def client_proof(self, nonce_c: bytes, nonce_s: bytes, id_c: str, id_s: str) -> bytes:
        return self.mac("ctl-client", nonce_c, nonce_s, id_c, id_s)

    # ---- HTTP

    def sign_request(self, method: str, path_qs: str, *, to: str, now: float | None = None
                     ) -> tuple[dict[str, str], str]:
        """The header that authenticates one request sent to the server ``to`` (the
        ``host:port`` dialed, :func:`authority`), and its nonce (to check the answer with
        :meth:`verify_response`)."""
        if not _AUTHORITY.fullmatch(to):
            raise ValueError(f"to must be a host:port, got {to!r}")
        ts = int((time.time() if now is None else now) * 1000)
        nonce = secrets.token_hex(_HTTP_NONCE_BYTES)
        mac = self.mac("http-request", method.upper(), path_qs, to, ts, nonce, self.peer_id)
        value = f"v2 id={self.peer_id} to={to} ts={ts} nonce={nonce} mac={mac.hex()}"
        return {AUTH_HEADER: value}, nonce

    def response_mac(self, nonce: str, body: bytes) -> str:
        return self.mac("http-response", nonce, hashlib.sha256(body).digest()).hex()

    def verify_response(self, nonce: str, body: bytes, header: str | None) -> bool:
        return header is not None and self.verify("http-response", header.strip(), nonce,
                                                  hashlib.sha256(body).digest())


# host:port as a request names its server: a DNS name or IPv4 address, or [IPv6]
_AUTHORITY = re.compile(r"(?:[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")


def authority(host: str, port: int) -> str:
    """The ``host:port`` a request to ``host`` (a name, or an IPv4 or IPv6 address) on
    ``port`` names its server with: lower case, an IPv6 address in brackets."""
    host = host.strip("[]").split("%")[0].lower().rstrip(".")  # (no IPv6 zone)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def addressed_to(to: str, local: tuple | None, names: Iterable[str] = ()) -> bool:
    """Whether ``to`` (a signed request's ``host:port``) names the server that took the
    request on a socket bound at ``local`` (its ``sockname``: address, port, ...): the same
    port, and as host that address or one of ``names`` (the names peers dial it by, such as
    its advertised host)."""
    if not local or not _AUTHORITY.fullmatch(to):
        return False
    host, _, port = to.rpartition(":")
    if int(port) != local[1]:
        return False
    host = host.strip("[]")
    try:
        here = _unmapped(ipaddress.ip_address(local[0].split("%")[0]))
    except (ValueError, AttributeError):
        return False
    try:
        return _unmapped(ipaddress.ip_address(host)) == here
    except ValueError:
        pass
    if host.lower() == "localhost":
        return here.is_loopback
    return any(authority(n, 0) == authority(host, 0) for n in names if n)


def serves_request(request, names: Iterable[str] = ()) -> Callable[[str], bool]:
    """:meth:`HttpVerifier.check`'s ``serves`` for an aiohttp ``request``: whether a signed
    ``to`` names the server that took it (:func:`addressed_to` on its socket's address)."""
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    return lambda to: addressed_to(to, local, names)


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address
              ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 address seen through a dual-stack socket (``::ffff:a.b.c.d``) as itself."""
    return getattr(ip, "ipv4_mapped", None) or ip


@dataclass(frozen=True)
class HttpAuthResult:
    ok: bool
    peer_id: str = ""
    nonce: str = ""
    why: str = ""


class HttpVerifier:
    """Checks ``X-Kvkern-Auth`` headers: the MAC, the clock window and nonce reuse (each
    nonce once within the window; at most :data:`_MAX_SEEN_NONCES` remembered, the oldest
    forgotten first, which only shortens how long a replay is refused below the window when
    more than that many requests arrive within it). Thread-safe."""

    def __init__(self, credential: Credential, *, skew_s: float = HTTP_SKEW_S) -> None:
        self.credential = credential
        self.skew_s = skew_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, method: str, path_qs: str, header: str | None, *,
              serves: Callable[[str], bool], now: float | None = None) -> HttpAuthResult:
        """``serves(to)``: whether the server checking is the one the request names (see
        :func:`addressed_to`)."""
        if not header:
            return HttpAuthResult(False, why="no credentials")
        if len(header) > 1024:
            return HttpAuthResult(False, why="malformed credentials")
        fields = dict(kv.split("=", 1) for kv in header.split()[1:] if "=" in kv)
        if not header.startswith("v2 ") or set(fields) != {"id", "to", "ts", "nonce", "mac"} \
                or not _AUTHORITY.fullmatch(fields["to"]):
            return HttpAuthResult(False, why="malformed credentials")
        stamp = fields["ts"]
        if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 15):  # (Unix ms)
            return HttpAuthResult(False, why="malformed credentials")
        ts = int(stamp)
        now = time.time() if now is None else now
        if abs(now - ts / 1000) > self.skew_s:
            return HttpAuthResult(False, why="stale or future timestamp")
        peer, nonce, to = fields["id"], fields["nonce"], fields["to"]
        if not self.credential.verify("http-request", fields["mac"], method.upper(), path_qs,
                                      to, ts, nonce, peer):
            return HttpAuthResult(False, why="bad signature")
        if not serves(to):
            return HttpAuthResult(False, why=f"signed for another server ({to})")
        with self._lock:
            # a nonce is kept until its timestamp leaves the window (then the clock check
            # alone refuses it), not for a window from its first use
            while self._seen and (next(iter(self._seen.values())) < now
                                  or len(self._seen) >= _MAX_SEEN_NONCES):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return HttpAuthResult(False, why="replayed request")
            self._seen[nonce] = ts / 1000 + self.skew_s
        return HttpAuthResult(True, peer_id=peer, nonce=nonce)


# ------------------------------------------------------------------------------ hints

HINT_AUTH_FIELD = "kvkern_hint_auth"


def _hint_digest(hint, token_ids: Sequence[int], cache_salt: str) -> bytes:
    """SHA-256 over what a hint asks for (its decoded fields, so every dialect and every
    JSON spelling of the same hint agree; the policy and timeouts as the hint states them,
    before a worker's own defaults and caps) and the request it belongs to."""
    import msgspec  # noqa: PLC0415

    what = [hint.dialect, hint.source, hint.source_dp_rank,
            None if hint.block_hashes is None else list(hint.block_hashes), hint.hash_scheme,
            list(hint.stated), hint.mode, hint.no_retain, hint.message_id, hint.action_id]
    h = hashlib.sha256(msgspec.msgpack.encode(what))
    h.update(msgspec.msgpack.encode([int(t) for t in token_ids]))
    h.update(msgspec.msgpack.encode(cache_salt))
    return h.digest()


def sign_hint(credential: Credential, hint, token_ids: Sequence[int], *,
              cache_salt: str = "", ttl_s: float = DEFAULT_HINT_TTL_S,
              now: float | None = None) -> dict:
    """The body field that makes a worker trust ``hint`` (a decoded
    :class:`kvkern.xfer.hints.KvHint`) for exactly this request, until ``ttl_s`` from now."""
    if not 0 < ttl_s <= MAX_HINT_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_HINT_TTL_S}], got {ttl_s!r}")
    exp = int(((time.time() if now is None else now) + ttl_s) * 1000)
    mac = credential.mac("hint", _hint_digest(hint, token_ids, cache_salt), exp,
                         credential.peer_id)
    return {HINT_AUTH_FIELD: {"v": 1, "by": credential.peer_id, "exp": exp, "mac": mac.hex()}}


def check_hint(credential: Credential | None, body: Mapping, hint, token_ids: Sequence[int],
               *, cache_salt: str = "", now: float | None = None) -> str | None:
    """None when ``body`` carries a valid, unexpired signature for ``hint`` on this request;
    else why not (for logs: the tenant only learns ``hint_untrusted``)."""
    if credential is None:
        return "this worker has no fleet credential to check hint signatures with"
    auth = body.get(HINT_AUTH_FIELD)
    if auth is None:
        return "the hint is not signed"
    if not isinstance(auth, Mapping) or auth.get("v") != 1:
        return "the hint signature is malformed"
    exp, by, mac = auth.get("exp"), auth.get("by"), auth.get("mac")
    # (exp bounded before any arithmetic: a JSON integer may have hundreds of digits)
    if (isinstance(exp, bool) or not isinstance(exp, int) or not 0 < exp < MAX_HINT_EXP_MS
            or not isinstance(by, str) or not isinstance(mac, str) or len(by) > MAX_PEER_ID
            or len(mac) > 2 * MAC_BYTES):
        return "the hint signature is malformed"
    now = time.time() if now is None else now
    if exp / 1000 < now:
        return f"the hint expired {now - exp / 1000:.1f} s ago"
    if exp / 1000 > now + MAX_HINT_TTL_S + HTTP_SKEW_S:
        return "the hint expires too far in the future"
    if not credential.verify("hint", mac, _hint_digest(hint, token_ids, cache_salt), exp, by):
        return "the hint signature does not match this request"
    return None


def secret_main(argv: Sequence[str] | None = None) -> int:
    """``kvkern secret``: print a fresh fleet secret (64 hex digits) on stdout."""
    import argparse  # noqa: PLC0415

    argparse.ArgumentParser(
        prog="kvkern secret",
        description="Print a fresh fleet secret. Store it in a file readable only by the "
                    "service user and pass it as --fleet-secret-file or "
                    "KVKERN_FLEET_SECRET_FILE to every worker and the router.").parse_args(argv)
    print(generate_secret())
    return 0
