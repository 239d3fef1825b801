"""The connector's settings, read from ``KVTransferConfig.kv_connector_extra_config``.

Only three things are needed, and all three have safe defaults for one host::

    listen       "host:port" the peer endpoint binds (state document and block requests);
                 default "127.0.0.1:0" (loopback, any free port, logged at start)
    allowlist    sources this engine may pull from: CIDRs, hosts, "host:port-range";
                 default "127.0.0.1"
    fleet_secret_file   the fleet credential (else KVKERN_FLEET_SECRET_FILE /
                 KVKERN_FLEET_SECRET); without one the engine serves no peer and pulls from
                 none (every hint falls back with ``unauthenticated``)

Optional: ``advertise_host`` (the address peers and routers use when ``listen`` binds a
wildcard), ``accept_from`` (the networks, CIDRs or addresses, whose hosts may connect to
this engine's UCX listeners; default loopback when ``listen`` is loopback, else any
address: name the fleet's networks, see SECURITY.md), ``trust_unsigned_hints`` (accept
hints not signed by ``kvkern router``; for a router that cannot sign, with engines that
clients cannot reach directly), ``model_id``
(default: derived from the model, its revision, dtypes and the hash settings), ``kv_layout``
(``vllm_cpu`` / ``vllm_v1``; default by device), ``serve`` (false: pull only),
``remote_read`` (``off``, ``host`` or ``all``: the source's pools that peers may read
one-sided, an opt-in, see SECURITY.md; other engines then read a host pool straight
into the blocks vLLM allocated instead of asking for a stream), ``policy``,
``metadata_timeout_s``, ``transfer_timeout_s``, ``deadline_s``, ``max_inflight_pulls``,
``gil_switch_interval_s`` (the engine process's ``sys.setswitchinterval``; ``null`` keeps
the interpreter's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvkern.xfer.networks import Networks
from kvkern.xfer.source_config import REMOTE_READ_MODES

__all__ = ["ConnectorConfig"]


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """Validated connector settings (see the module docstring)."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None
    allowlist: tuple[str, ...] = ("127.0.0.1",)
    accept_from: tuple[str, ...] | None = None
    fleet_secret_file: str | None = None
    trust_unsigned_hints: bool = False
    model_id: str | None = None
    kv_layout: str | None = None
    serve: bool = True
    remote_read: str = "off"
    policy: str = "strict"
    metadata_timeout_s: float = 2.0
    transfer_timeout_s: float = 10.0
    deadline_s: float = 15.0
    max_inflight_pulls: int = 4
    # kvkern's transfer threads share the engine process's GIL with vLLM's busy loop; the
    # engine thread hands the GIL over after Python's switch interval (5 ms by default),
    # which every hop of a pull pays. None leaves the interpreter's setting alone.
    gil_switch_interval_s: float | None = 0.0005

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Settings from ``kv_connector_extra_config``; ValueError naming a bad or unknown
        key."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)} - {"listen_host", "listen_port"} | {"listen"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kvkern connector setting(s) {unknown}; known: "
                             f"{sorted(known)}")
        kw: dict[str, Any] = {}
        if "listen" in extra:
            kw["listen_host"], kw["listen_port"] = _host_port(extra.pop("listen"))
        for name in ("allowlist", "accept_from"):
            if name in extra:
                kw[name] = _strings(name, extra.pop(name))
        if "accept_from" in kw:
            Networks.parse(kw["accept_from"])  # (a ValueError naming the bad entry)
        for name in ("trust_unsigned_hints", "serve"):
            if name in extra:
                kw[name] = _flag(name, extra.pop(name))
        if "gil_switch_interval_s" in extra:
            raw = extra.pop("gil_switch_interval_s")
            kw["gil_switch_interval_s"] = None if raw is None else _seconds(
                "gil_switch_interval_s", raw)
        for name in ("metadata_timeout_s", "transfer_timeout_s", "deadline_s"):
            if name in extra:
                kw[name] = _seconds(name, extra.pop(name))
        if "max_inflight_pulls" in extra:
            n = extra.pop("max_inflight_pulls")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max_inflight_pulls must be an int >= 1, got {n!r}")
            kw["max_inflight_pulls"] = n
        if extra.get("remote_read", "off") not in REMOTE_READ_MODES:
            raise ValueError(f"remote_read must be one of {list(REMOTE_READ_MODES)}, got "
                             f"{extra['remote_read']!r}")
        if extra.get("policy", "strict") not in ("strict", "best_effort"):
            raise ValueError(f"policy must be 'strict' or 'best_effort', got "
                             f"{extra['policy']!r}")
        for name, value in extra.items():
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
            kw[name] = value
        return cls(**kw)


def _strings(name: str, raw: Any) -> tuple[str, ...]:
    """A comma-separated string or a list of strings, as a tuple of its non-empty items."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"{name} must be a string or a list of strings, got {raw!r}")
    return tuple(i.strip() for i in items if i.strip())


def _host_port(raw: Any) -> tuple[str, int]:
    if not isinstance(raw, str) or ":" not in raw:
        raise ValueError(f"listen must be 'host:port', got {raw!r}")
    host, _, port = raw.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen must be 'host:port' with a port in [0, 65535], got {raw!r}")
    return host, int(port)


def _flag(name: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"{name} must be true or false, got {raw!r}")
    return raw


def _seconds(name: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) \
            or raw <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return float(raw)
