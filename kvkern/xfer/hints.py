"""Router hints: one typed :class:`KvHint`, decoded strictly from every dialect a worker meets.

Entry point: :func:`decode_hint(request_body) -> HintResult`, where the result is a
:class:`KvHint` or a :class:`HintRejected` carrying a named ``reason`` (one of
:data:`REASONS`) and a ``detail``. Untrusted input never raises out of ``decode_hint``: a hint
is advisory, so every problem becomes a reason on the request outcome.

Where hints are found
---------------------
Each location is looked up in the body itself and then in ``body["extra_args"]`` (Dynamo's
pass-through), in this order of dialects::

    kvkern     kv_hint                                   this module's own schema (below), or
                                                         the kv_hints envelope (Dynamo's field
                                                         name for it)
    kv_hints   kv_hints                                  envelope, protocol "0.1", kv.fetch 1.0
    dynamo     kv_transfer_params.kv_hint                the kv_hints envelope, where Dynamo's vLLM
                                                         worker puts the request's ``kv_hint``
               kv_transfer_params.router_hint            {source_control_endpoint, block_hashes}
    llm-d      kv_transfer_params.remote_kv_source       {kv_request_id, remote_host, remote_port}
                                                         (vLLM's P2P tier; the older {host, port}
                                                         too); hashes computed locally
               kv_transfer_params.remote_prefiller       the same shape: the prefill worker of
                                                         llm-d's prefill/decode split

A location holding ``null`` counts as absent. The first dialect that yields a hint or a
rejection decides; a dialect that is *ignored* (unknown ``version`` / ``protocol_version``, no
``kv.fetch`` 1.0 action) falls through to the next, so a router may send several dialects for
workers of different vintages. A malformed hint is rejected, never skipped in favour of a lower
dialect (that would silently pull from a different source).

The ``kv_hint`` schema (kvkern's flat dialect; unknown fields are rejected)::

    {
      "version": 1,                        # optional int, default 1; other versions ignored
      "source": "10.0.0.5:8000",           # required: http(s) URL, host[:port] or tcp://host:port
      "block_hashes": [123, -5, ...],      # optional; absent -> hashes computed locally from the
                                           #   request's own tokens in the worker's scheme
      "hash_scheme": "public-xxh3-v1",     # optional, default public-xxh3-v1 (with block_hashes)
      "source_dp_rank": 0,                 # optional int >= 0
      "policy": "strict" | "best_effort",  # optional, default HintLimits.default_policy
      "mode": "copy" | "move",             # optional, default "copy"
      "no_retain": false,                  # optional bool: do not lease received blocks
      "metadata_timeout_s": 2.0,           # optional, > 0, clamped to HintLimits.max_*
      "transfer_timeout_s": 30.0,          # optional, > 0, clamped
      "deadline_s": 60.0,                  # optional, > 0, clamped
      "message_id": "abc"                  # optional str, for logs
    }

Foreign dialects (``router_hint``, the ``kv.fetch`` payload, ``remote_kv_source``) type their
known fields strictly and ignore unknown ones, so their owners can add fields. The KVCR parser
conventions apply to every payload: ``block_hashes`` non-empty, each ``0 <= h < 2**64``;
i64 bit-casts ``-2**63 <= h < 0`` are normalised to u64 (``h + 2**64``, see
``kvkern.cache.hashing.normalize_hash``); bools and floats are rejected; optional ``mode`` and
``no_retain``; ``source_dp_rank`` is a kvkern extension everywhere.

The ``block_hashes`` of ``router_hint`` and of a ``kv.fetch`` payload are the *engine's own*
block hashes (Dynamo's ``ExternalSequenceBlockHash``: for vLLM the low 64 bits of its sha256
block hash, for TRT-LLM its block key), so those hints carry ``hash_scheme`` :data:`ENGINE_SCHEME`
and are checked in the worker's own scheme. vLLM's ``Request.kv_hints`` (a msgspec
``KvHintsEnvelope``) decodes like the ``kv_hints`` field once turned into builtins.

For ``kv_hints`` the first ``kv.fetch`` 1.0 action is used (``kv.source_locations`` 1.0, its
earlier name, too); other action types and versions are skipped. ``message_id`` and
``action_id`` are carried on the hint for logs. An object at ``kv_hint`` that has no
``source`` and no ``version`` but a ``protocol_version`` or ``actions`` is that envelope
(Dynamo names its request field ``kv_hint``) and decodes as ``kv_hints``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

from kvkern.cache.hashing import HINT_SCHEME, known_schemes, normalize_hashes

__all__ = [
    "BODY_INVALID",
    "ENGINE_SCHEME",
    "BODY_TOO_LARGE",
    "HINT_INVALID",
    "NO_HINT",
    "REASONS",
    "TOO_MANY_HASHES",
    "UNKNOWN_HASH_SCHEME",
    "HintLimits",
    "HintRejected",
    "HintResult",
    "KvHint",
    "decode_hint",
    "strip_hints",
]

NO_HINT = "no_hint"
BODY_TOO_LARGE = "body_too_large"
BODY_INVALID = "body_invalid"
HINT_INVALID = "hint_invalid"
TOO_MANY_HASHES = "too_many_hashes"
UNKNOWN_HASH_SCHEME = "unknown_hash_scheme"
#: ``KvHint.hash_scheme`` of hints whose hashes are the engine's own block hashes.
ENGINE_SCHEME = "engine"
REASONS = (NO_HINT, BODY_TOO_LARGE, BODY_INVALID, HINT_INVALID, TOO_MANY_HASHES,
           UNKNOWN_HASH_SCHEME)

Policy = Literal["strict", "best_effort"]
Mode = Literal["copy", "move"]
Dialect = Literal["kvkern", "kv_hints", "dynamo", "llm-d"]
DIALECTS: tuple[str, ...] = ("kvkern", "kv_hints", "dynamo", "llm-d")

KV_HINTS_PROTOCOL = "0.1"
KV_FETCH = ("kv.fetch", "1.0")
# the fetch action as Dynamo named it before it was kv.fetch (same payload)
KV_FETCH_ACTIONS = frozenset({KV_FETCH, ("kv.source_locations", "1.0")})
KVKERN_HINT_VERSION = 1
MAX_KV_REQUEST_ID = 256


@dataclass(frozen=True, kw_only=True)
class HintLimits:
    """Caps and defaults applied while decoding. Timeouts in a hint are clamped to the maxima
    (never raised above them); a worker's own defaults apply where a hint names none."""

    max_body_bytes: int = 8 << 20
    max_hashes: int = 1 << 16
    max_actions: int = 64
    max_source_len: int = 2048
    max_metadata_timeout_s: float = 10.0
    max_transfer_timeout_s: float = 60.0
    max_deadline_s: float = 120.0
    default_policy: Policy = "strict"


DEFAULT_LIMITS = HintLimits()


@dataclass(frozen=True, kw_only=True)
class KvHint:
    """A decoded, validated hint. ``block_hashes is None`` means "compute the hashes locally
    from the request's tokens" (llm-d, or a ``kv_hint`` without hashes); then
    ``hash_scheme`` is ``None`` too (the worker's own scheme applies). ``hash_scheme``
    :data:`ENGINE_SCHEME` means the hashes are the engine's own block hashes (Dynamo's
    dialects), in whatever scheme the worker uses."""

    source: str
    block_hashes: tuple[int, ...] | None
    hash_scheme: str | None
    dialect: Dialect
    source_dp_rank: int | None = None
    policy: Policy = "strict"
    mode: Mode = "copy"
    no_retain: bool = False
    metadata_timeout_s: float | None = None
    transfer_timeout_s: float | None = None
    deadline_s: float | None = None
    clamped: tuple[str, ...] = ()
    message_id: str | None = None
    action_id: str | None = None
    # what the hint itself says of the fields a worker fills in or clamps by its own limits
    # (policy and the three timeouts; None where it says nothing): a signature covers these,
    # so that a router and a worker with other limits agree on it
    stated: tuple[str | float | None, ...] = field(default=(None, None, None, None),
                                                   compare=False)

    ok = True

    @property
    def hashes_local(self) -> bool:
        return self.block_hashes is None


@dataclass(frozen=True, kw_only=True)
class HintRejected:
    """No usable hint: ``reason`` is one of :data:`REASONS`; ``dialect`` is the dialect that
    was being decoded (``None`` for body-level problems and for ``no_hint``)."""

    reason: str
    detail: str = ""
    dialect: Dialect | None = None

    ok = False


HintResult = KvHint | HintRejected


# ----------------------------------------------------------------------------- wire structs


class _KvkernHint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    version: int = KVKERN_HINT_VERSION
    source: str
    block_hashes: list[int] | None = None
    hash_scheme: str | None = None
    source_dp_rank: int | None = None
    policy: Policy | None = None
    mode: Mode = "copy"
    no_retain: bool = False
    metadata_timeout_s: float | None = None
    transfer_timeout_s: float | None = None
    deadline_s: float | None = None
    message_id: str | None = None


class _FetchPayload(msgspec.Struct, kw_only=True):
    """Dynamo ``router_hint`` and the ``kv.fetch`` 1.0 payload (unknown fields ignored)."""

    source_control_endpoint: str
    block_hashes: list[int]
    mode: Mode = "copy"
    no_retain: bool = False
    source_dp_rank: int | None = None


class _RemoteKvSource(msgspec.Struct, kw_only=True):
    """vLLM's P2P tier (the shape llm-d drives): ``{kv_request_id, remote_host,
    remote_port}`` (unknown fields ignored)."""

    remote_host: str
    remote_port: int
    kv_request_id: str | None = None


class _LegacyRemoteKvSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``{host, port}`` shape earlier kvkern routers sent."""

    host: str
    port: int


class _Reject(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _Ignored(Exception):
    """The dialect is present but not for us (unknown version): fall through."""


# --------------------------------------------------------------------------------- helpers


_T = TypeVar("_T")


def _convert(raw: Any, typ: type[_T], what: str) -> _T:
    try:
        return msgspec.convert(raw, typ, strict=True)
    except msgspec.ValidationError as exc:
        raise _Reject(HINT_INVALID, f"{what}: {exc}") from None


def _hashes(raw: Any, what: str, limits: HintLimits) -> tuple[int, ...]:
    # Count before converting so a huge list costs nothing.
    if isinstance(raw, (list, tuple)) and len(raw) > limits.max_hashes:
        raise _Reject(
            TOO_MANY_HASHES, f"{what}: {len(raw)} block_hashes > limit {limits.max_hashes}"
        )
    values = _convert(raw, list[int], f"{what}.block_hashes")
    if not values:
        raise _Reject(HINT_INVALID, f"{what}: block_hashes is empty")
    try:
        return tuple(normalize_hashes(values))
    except ValueError as exc:
        raise _Reject(HINT_INVALID, f"{what}: {exc}") from None


def _source(value: str, what: str, limits: HintLimits) -> str:
    if not value:
        raise _Reject(HINT_INVALID, f"{what}: source endpoint is empty")
    if len(value) > limits.max_source_len:
        raise _Reject(
            HINT_INVALID,
            f"{what}: source endpoint of {len(value)} chars > limit {limits.max_source_len}",
        )
    bad = next((c for c in value if not "\x21" <= c <= "\x7e"), None)
    if bad is not None:
        raise _Reject(
            HINT_INVALID, f"{what}: source endpoint contains {bad!r} (printable ASCII only)"
        )
    return value


def _dp_rank(value: int | None, what: str) -> int | None:
    if value is not None and not 0 <= value < (1 << 16):
        raise _Reject(HINT_INVALID, f"{what}: source_dp_rank {value} not in [0, 65536)")
    return value


def _timeout(name: str, value: float | None, cap: float, clamped: list[str]) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        raise _Reject(HINT_INVALID, f"{name} {value!r} must be a positive finite number")
    if value > cap:
        clamped.append(name)
        return cap
    return float(value)


def _get(container: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(container, dict):
            return None
        container = container.get(key)
    return container


# -------------------------------------------------------------------------------- dialects


def _is_envelope(raw: Any) -> bool:
    """A ``kv_hints`` envelope where a ``kv_hint`` was looked for (Dynamo's field name)."""
    return isinstance(raw, dict) and "source" not in raw and "version" not in raw and (
        "protocol_version" in raw or "actions" in raw)


def _decode_kvkern(raw: Any, limits: HintLimits) -> KvHint:
    if _is_envelope(raw):
        return _decode_kv_hints(raw, limits)
    hashes: tuple[int, ...] | None = None
    if isinstance(raw, dict):
        version = raw.get("version", KVKERN_HINT_VERSION)
        if isinstance(version, int) and not isinstance(version, bool) and (
            version != KVKERN_HINT_VERSION
        ):
            raise _Ignored(f"kv_hint version {version} not supported (this worker reads "
                           f"{KVKERN_HINT_VERSION})")
        if isinstance(raw.get("block_hashes"), (list, tuple)):
            hashes = _hashes(raw["block_hashes"], "kv_hint", limits)
            raw = {k: v for k, v in raw.items() if k != "block_hashes"}
    h = _convert(raw, _KvkernHint, "kv_hint")
    scheme = h.hash_scheme
    if scheme is not None and scheme not in known_schemes():
        raise _Reject(
            UNKNOWN_HASH_SCHEME,
            f"kv_hint: hash_scheme {scheme!r} unknown; known: {', '.join(known_schemes())}",
        )
    if hashes is None and scheme is not None:
        raise _Reject(HINT_INVALID, "kv_hint: hash_scheme given without block_hashes")
    clamped: list[str] = []
    return KvHint(
        source=_source(h.source, "kv_hint", limits),
        block_hashes=hashes,
        hash_scheme=None if hashes is None else (scheme or HINT_SCHEME),
        dialect="kvkern",
        source_dp_rank=_dp_rank(h.source_dp_rank, "kv_hint"),
        policy=h.policy or limits.default_policy,
        mode=h.mode,
        no_retain=h.no_retain,
        metadata_timeout_s=_timeout(
            "metadata_timeout_s", h.metadata_timeout_s, limits.max_metadata_timeout_s, clamped
        ),
        transfer_timeout_s=_timeout(
            "transfer_timeout_s", h.transfer_timeout_s, limits.max_transfer_timeout_s, clamped
        ),
        deadline_s=_timeout("deadline_s", h.deadline_s, limits.max_deadline_s, clamped),
        clamped=tuple(clamped),
        message_id=h.message_id,
        stated=(h.policy, h.metadata_timeout_s, h.transfer_timeout_s, h.deadline_s),
    )


def _decode_fetch_payload(
    raw: Any, what: str, dialect: Dialect, limits: HintLimits, **extra: Any
) -> KvHint:
    if not isinstance(raw, dict):
        raise _Reject(HINT_INVALID, f"{what}: expected an object, got {type(raw).__name__}")
    hashes = _hashes(raw.get("block_hashes"), what, limits) if "block_hashes" in raw else None
    body = {k: v for k, v in raw.items() if k != "block_hashes"}
    body["block_hashes"] = []  # validated above; keep the struct's required field satisfied
    p = _convert(body, _FetchPayload, what)
    if hashes is None:
        raise _Reject(HINT_INVALID, f"{what}: block_hashes is required")
    return KvHint(
        source=_source(p.source_control_endpoint, what, limits),
        block_hashes=hashes,
        hash_scheme=ENGINE_SCHEME,
        dialect=dialect,
        source_dp_rank=_dp_rank(p.source_dp_rank, what),
        policy=limits.default_policy,
        mode=p.mode,
        no_retain=p.no_retain,
        **extra,
    )


def _decode_kv_hints(raw: Any, limits: HintLimits) -> KvHint:
    if not isinstance(raw, dict):
        raise _Reject(HINT_INVALID, f"kv_hints: expected an object, got {type(raw).__name__}")
    version = raw.get("protocol_version")
    if not isinstance(version, str):
        raise _Reject(HINT_INVALID, f"kv_hints: protocol_version {version!r} is not a string")
    if version != KV_HINTS_PROTOCOL:
        raise _Ignored(f"kv_hints protocol_version {version!r} not supported "
                       f"(this worker reads {KV_HINTS_PROTOCOL!r})")
    message_id = raw.get("message_id")
    if message_id is not None and not isinstance(message_id, str):
        raise _Reject(HINT_INVALID, f"kv_hints: message_id {message_id!r} is not a string")
    actions = raw.get("actions")
    if not isinstance(actions, list):
        raise _Reject(HINT_INVALID, f"kv_hints: actions must be a list, got "
                      f"{type(actions).__name__}")
    if len(actions) > limits.max_actions:
        raise _Reject(HINT_INVALID, f"kv_hints: {len(actions)} actions > limit "
                      f"{limits.max_actions}")
    skipped = []
    for i, action in enumerate(actions):
        where = f"kv_hints.actions[{i}]"
        if not isinstance(action, dict):
            raise _Reject(HINT_INVALID, f"{where}: expected an object, got "
                          f"{type(action).__name__}")
        kind, kind_version = action.get("action_type"), action.get("action_version")
        if not isinstance(kind, str) or not isinstance(kind_version, str):
            raise _Reject(HINT_INVALID, f"{where}: action_type {kind!r} / action_version "
                          f"{kind_version!r} must be strings")
        if (kind, kind_version) not in KV_FETCH_ACTIONS:
            skipped.append(f"{kind}@{kind_version}")
            continue
        action_id = action.get("action_id")
        if action_id is not None and not isinstance(action_id, str):
            raise _Reject(HINT_INVALID, f"{where}: action_id {action_id!r} is not a string")
        return _decode_fetch_payload(
            action.get("payload"), f"{where}.payload", "kv_hints", limits,
            message_id=message_id, action_id=action_id,
        )
    raise _Ignored("kv_hints: no kv.fetch 1.0 action"
                   + (f" (skipped {', '.join(skipped[:8])})" if skipped else ""))


def _decode_dynamo(raw: Any, limits: HintLimits) -> KvHint:
    return _decode_fetch_payload(raw, "router_hint", "dynamo", limits)


def _decode_dynamo_envelope(raw: Any, limits: HintLimits) -> KvHint:
    if not _is_envelope(raw):
        raise _Ignored("kv_transfer_params.kv_hint is not a kv_hints envelope")
    return _decode_kv_hints(raw, limits)


def _decode_llmd(raw: Any, limits: HintLimits) -> KvHint:
    if isinstance(raw, dict) and ("remote_host" in raw or "remote_port" in raw):
        if "host" in raw or "port" in raw:
            raise _Reject(HINT_INVALID, "remote_kv_source: both the {remote_host, "
                          "remote_port} and the {host, port} shapes")
        real = _convert(raw, _RemoteKvSource, "remote_kv_source")
        src_host, port, kv_request_id = real.remote_host, real.remote_port, real.kv_request_id
    else:
        legacy = _convert(raw, _LegacyRemoteKvSource, "remote_kv_source")
        src_host, port, kv_request_id = legacy.host, legacy.port, None
    if kv_request_id is not None and len(kv_request_id) > MAX_KV_REQUEST_ID:
        raise _Reject(HINT_INVALID, f"remote_kv_source: kv_request_id of {len(kv_request_id)} "
                      f"characters > {MAX_KV_REQUEST_ID}")
    if not 1 <= port <= 65535:
        raise _Reject(HINT_INVALID, f"remote_kv_source: port {port} not in [1, 65535]")
    host = _source(src_host, "remote_kv_source", limits)
    if any(c in host for c in "/@?#"):
        raise _Reject(HINT_INVALID, f"remote_kv_source: host {host!r} is not a bare host")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return KvHint(
        source=f"{host}:{port}",
        block_hashes=None,
        hash_scheme=None,
        dialect="llm-d",
        policy=limits.default_policy,
        message_id=kv_request_id,
    )


_DIALECTS = (
    ("kvkern", ("kv_hint",), _decode_kvkern),
    ("kv_hints", ("kv_hints",), _decode_kv_hints),
    ("dynamo", ("kv_transfer_params", "kv_hint"), _decode_dynamo_envelope),
    ("dynamo", ("kv_transfer_params", "router_hint"), _decode_dynamo),
    ("llm-d", ("kv_transfer_params", "remote_kv_source"), _decode_llmd),
    ("llm-d", ("kv_transfer_params", "remote_prefiller"), _decode_llmd),
)


# ------------------------------------------------------------------------------ entry point


def _parse_body(body: Any, limits: HintLimits) -> dict | HintRejected:
    if isinstance(body, dict):
        return body
    if isinstance(body, (bytes, bytearray, memoryview, str)):
        size = len(body) if not isinstance(body, memoryview) else body.nbytes
        if size > limits.max_body_bytes:
            return HintRejected(
                reason=BODY_TOO_LARGE,
                detail=f"request body of {size} bytes > limit {limits.max_body_bytes}",
            )
        try:
            if isinstance(body, str):
                body = body.encode("utf-8")
            decoded = msgspec.json.decode(body)
        except (msgspec.DecodeError, UnicodeError, RecursionError, ValueError) as exc:
            return HintRejected(reason=BODY_INVALID, detail=f"request body is not JSON: {exc}")
        if not isinstance(decoded, dict):
            return HintRejected(
                reason=BODY_INVALID,
                detail=f"request body is a JSON {type(decoded).__name__}, not an object",
            )
        return decoded
    return HintRejected(
        reason=BODY_INVALID, detail=f"request body of type {type(body).__name__} not supported"
    )


def decode_hint(request_body: dict | bytes | str, *, limits: HintLimits = DEFAULT_LIMITS
                ) -> HintResult:
    """Find and decode the hint in a request body (see the module docstring).

    Returns a :class:`KvHint`, or a :class:`HintRejected` whose ``reason`` is one of
    :data:`REASONS`; it does not raise on any input."""
    body = _parse_body(request_body, limits)
    if isinstance(body, HintRejected):
        return body
    containers = [body]
    if isinstance(body.get("extra_args"), dict):
        containers.append(body["extra_args"])
    ignored: list[str] = []
    for dialect, path, decode in _DIALECTS:
        for container in containers:
            raw = _get(container, *path)
            if raw is None:
                continue
            try:
                return decode(raw, limits)
            except _Ignored as exc:
                ignored.append(str(exc))
            except _Reject as exc:
                return HintRejected(reason=exc.reason, detail=exc.detail, dialect=dialect)
            except (msgspec.MsgspecError, RecursionError, TypeError, ValueError) as exc:
                return HintRejected(
                    reason=HINT_INVALID, detail=f"{dialect}: {exc}", dialect=dialect
                )
    return HintRejected(reason=NO_HINT, detail="; ".join(ignored) or "no hint in request")


def strip_hints(request_body: dict) -> dict:
    """A shallow copy of ``request_body`` without any hint a client put in it (every dialect's
    location, in the body and in ``extra_args``) and without a hint signature: what a router
    forwards before it attaches its own signed hint."""
    from kvkern.xfer.auth import HINT_AUTH_FIELD  # noqa: PLC0415

    out = {k: v for k, v in request_body.items() if k not in ("kv_hint", "kv_hints",
                                                               HINT_AUTH_FIELD)}
    for key in ("kv_transfer_params",):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items()
                        if k not in ("kv_hint", "router_hint", "remote_kv_source",
                                     "remote_prefiller")}
    extra = out.get("extra_args")
    if isinstance(extra, dict):
        out["extra_args"] = strip_hints(extra)
    return out
