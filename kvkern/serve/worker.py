"""``kvkern worker``: one serving worker — model, paged KV pool with a prefix index, the source
service that lets peers pull its blocks, and the puller that pulls from a hinted peer.

Threads::

    main thread        parses flags, starts everything, prints KVKERN_READY, waits for a signal
    kvkern-xfer        asyncio loop: HTTP (API + state + metrics), UCXX listeners, the puller
    kvkern-pull-wait   waits (bounded) for a hinted request's pull, claims its blocks
    kvkern-engine      one forward at a time (Engine.generate)

HTTP API (one port: the source service's app, the worker's routes mounted on it)::

    POST /v1/generate   {"token_ids": [int, ...],            required, ids < vocab_size
                         "max_new_tokens": 16,               0 = prefill only (fills the cache)
                         "use_cache": true,                  false: no prefix reuse, no commit,
                                                             hint ignored (a cold recompute)
                         "return_logits": false,             first token's logits, base64 fp32
                         "request_id": "...",                optional
                         "cache_salt": "",                   the tenant's cache domain
                         ...plus a hint in any dialect of kvkern.xfer.hints (kv_hint, kv_hints,
                         kv_transfer_params.router_hint / remote_kv_source, or under
                         extra_args)}
                     -> {"request_id", "tokens", "prompt_tokens", "cached_tokens" (prefix read
                         from the pool: local + pulled), "local_tokens" (held here before any
                         pull), "pulled_tokens", "prefill_tokens", "ttft_s", "prefill_s",
                         "pull_wait_s", "total_s", "logits_sha256", ["logits"],
                         "hint": null | {"dialect", "source"} | {"rejected": reason},
                         "pull": null | PullOutcome.to_dict(),
                         "fallback": null | reason    (a hint that led to no used pull)}
    GET  /kvkern/v1/blocks   fleet members only: the router report {"worker_id",
                         "hash_scheme": "public-xxh3-v1", "block_size", "num_blocks",
                         "blocks": [{"hash", "parent", "local"}]} (chained router-domain
                         hashes of the blocks cached here)
    GET  /v1/info       model, layout, device, threads, pool stats, config
    GET  /kvkern/v1/state, /metrics, /healthz     the source service's

Start-up prints exactly one line ``KVKERN_READY {json}`` on stdout (url, port, worker_id,
pid, device, ...) once every server is listening; everything else goes to stderr (UCX may
still write to stdout, so parse only that line).

Threads and bit identity: torch is pinned to ``--threads`` intra-op threads (default 1) and
one inter-op thread. CPU kernels split work by thread count, so two workers agree bit for bit
only with the same ``--threads``; run every worker of a deployment with the same value.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from kvkern.serve.cliargs import (
    BIND_ERRNOS,
    LOG_LEVELS,
    Parser,
    UsageError,
    bind_error,
    check_port_free,
    credential_fix,
    nonneg_float,
    port,
    positive_float,
    positive_int,
    report,
)

__all__ = ["Worker", "WorkerOptions", "check_options", "main"]

log = logging.getLogger("kvkern.worker")

READY_PREFIX = "KVKERN_READY "
MAX_BODY_BYTES = 16 << 20
# A generate body holds at most the model's context in token ids (<= 11 bytes each in JSON)
# and hints of a few KiB; decoded JSON takes up to ~24x its bytes (small objects), so a
# body is bounded by what a request can use, not by the HTTP limit above.
GENERATE_BODY_BASE = 256 << 10
GENERATE_BODY_PER_TOKEN = 24
MAX_SALT_CHARS = 256
# Outcome fields a tenant's response leaves out: what the pull learned of the source.
TENANT_HIDDEN = frozenset({"detail", "worker_id", "incarnation"})


class WorkerOptions(argparse.Namespace):
    """Parsed flags (see :func:`build_parser`)."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvkern worker",
        description="One kvkern worker: model + paged KV pool + source service + puller, "
                    "with an HTTP API (POST /v1/generate) and peer endpoints under /kvkern/.")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1",
                     help="address the HTTP API binds (0.0.0.0 for other machines, with "
                          "--advertise-host)")
    net.add_argument("--port", type=port, default=0, help="HTTP port (0: the OS picks)")
    net.add_argument("--advertise-host", default=None,
                     help="address peers reach this worker's UCX listener at (default: --host; "
                          "required when --host is 0.0.0.0)")
    net.add_argument("--allow", action="append", default=[], metavar="SPEC",
                     help="allowlist entry for hint sources (repeat; CIDR, host[:ports], "
                          "*.suffix[:ports]); also KVKERN_ALLOWLIST. Without any, every "
                          "hint is refused (fail closed). Loopback needs an explicit entry such as "
                          "127.0.0.0/8")
    net.add_argument("--accept-from", action="append", default=[], metavar="NET",
                     help="network whose hosts may connect to this worker's UCX listener "
                          "(repeat; CIDR or address); also KVKERN_ACCEPT_FROM (default: "
                          "loopback when --host is loopback, else any address)")
    net.add_argument("--worker-id", default=None,
                     help="this worker's name in logs, metrics and its peers' quotas "
                          "(default: worker-<random>)")
    sec = p.add_argument_group("security")
    sec.add_argument("--fleet-secret-file", default=None, metavar="PATH",
                     help="file holding the fleet secret (make one with `kvkern secret`); "
                          "default: KVKERN_FLEET_SECRET_FILE or KVKERN_FLEET_SECRET. Without "
                          "one the worker serves no peers and pulls from none")
    sec.add_argument("--trust-unsigned-hints", action="store_true",
                     help="use hints the fleet's router did not sign (otherwise such a hint "
                          "is ignored with reason hint_untrusted)")
    sec.add_argument("--model-id", default=None,
                     help="the model identity peers must share (default: a fingerprint of "
                          "the model's configuration and weights)")
    model = p.add_argument_group("model and pool")
    model.add_argument("--model", choices=("tiny", "demo"), default="demo",
                       help="the built-in model: tiny (tests) or demo (~30 M parameters)")
    model.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    model.add_argument("--layout", default="trtllm",
                       choices=("trtllm", "vllm_flash", "vllm_nhd", "vllm_hnd", "cross_layer"),
                       help="the KV pool's memory layout")
    model.add_argument("--num-blocks", type=positive_int, default=1024,
                       help="KV blocks in the pool")
    model.add_argument("--hash-scheme", default="kvkern-blake2b-v1",
                       choices=("kvkern-blake2b-v1", "public-xxh3-v1", "trtllm-v1"),
                       help="block hash scheme of the prefix index (public-xxh3-v1 and "
                            "trtllm-v1 let a client plant KV under another's prompt: "
                            "kvkern.cache.hashing)")
    model.add_argument("--threads", type=positive_int, default=1,
                       help="torch intra-op threads; equal on every worker for bit identity")
    model.add_argument("--prefill-chunk", type=positive_int, default=None,
                       help="tokens per prefill step (default: the whole prompt at once)")
    model.add_argument("--max-new-tokens", type=positive_int, default=256,
                       help="cap on a request's max_new_tokens")
    _add_pull_flags(p.add_argument_group("pull policy and bounds"))
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="stderr log level; INFO shows one line per pull outcome")
    p.add_argument("--debug-send-delay-s", type=nonneg_float, default=0.0,
                   help=argparse.SUPPRESS)  # fault tests: the source stalls each send
    return p

def _add_pull_flags(pull: argparse._ArgumentGroup) -> None:
    pull.add_argument("--policy", choices=("strict", "best_effort"), default="strict",
                      help="strict: all hinted blocks or none; best_effort: the longest "
                           "prefix served")
    pull.add_argument("--metadata-timeout-s", type=positive_float, default=2.0,
                      help="bound on fetching a source's state document")
    pull.add_argument("--transfer-timeout-s", type=positive_float, default=10.0,
                      help="bound on a transfer without progress")
    pull.add_argument("--deadline-s", type=positive_float, default=15.0,
                      help="bound on a whole pull")
    pull.add_argument("--lease-s", type=positive_float, default=30.0,
                      help="how long pulled blocks wait for their request to claim them")
    pull.add_argument("--cost-guard", choices=("on", "off"), default="on",
                      help="skip pulls estimated slower than recompute (not_worth_it)")
    pull.add_argument("--max-inflight-pulls", type=positive_int, default=4,
                      help="pulls at once; more are refused with reason busy")
    pull.add_argument("--chunk-mib", type=positive_int, default=16,
                      help="stream chunk size in MiB (at most 16384)")
    pull.add_argument("--remote-read", choices=("host", "off"), default="off",
                      help="one-sided reads of whole blocks: 'host' offers this worker's host "
                           "pool for remote read to authenticated peers. The "
                           "UCX transports available without InfiniBand (TCP, CMA) do not "
                           "bound a remote key to its grant, so every fleet member could "
                           "read the whole pool: opt in only where that is acceptable "
                           "(see SECURITY.md). 'off' streams")
    pull.add_argument("--direct-reads", choices=("on", "off"), default="on",
                      help="read a source that publishes its read directory (remote read on "
                           "its side) without a message to it, confirmed by the directory; "
                           "'off' asks the source for a grant before every read")
    pull.add_argument("--local-reads", choices=("on", "off"), default="on",
                      help="read a source on this host with process_vm_readv calls of up to "
                           "1024 pieces rather than through UCX's CMA transport (16 per "
                           "call); 'off' reads every source through UCX")



def check_options(opts: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for flag values the worker cannot start with (beyond what
    the parser's types check): the allowlist, the device, the listen addresses."""
    from kvkern.xfer.endpoint import Allowlist  # noqa: PLC0415

    for spec in allow_specs(opts):
        try:
            Allowlist.parse([spec])
        except ValueError as exc:
            raise UsageError(f"bad allowlist entry: {exc}; use CIDR (10.0.0.0/8), "
                             "host[:port[-port]] or *.suffix[:ports]") from None
    from kvkern.xfer.state import MAX_ID_CHARS  # noqa: PLC0415

    if opts.worker_id is not None and not 0 < len(opts.worker_id) <= MAX_ID_CHARS:
        raise UsageError(f"--worker-id must be 1 to {MAX_ID_CHARS} characters, got "
                         f"{len(opts.worker_id)}")
    accept = accept_specs(opts)
    if accept is not None:
        from kvkern.xfer.networks import Networks  # noqa: PLC0415

        try:
            Networks.parse(accept, name="--accept-from")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if opts.host in ("0.0.0.0", "::") and not opts.advertise_host:
        raise UsageError(f"--host {opts.host} needs --advertise-host (the address peers reach "
                         "the worker at)")
    if opts.chunk_mib > 16384:
        raise UsageError(f"--chunk-mib {opts.chunk_mib} exceeds 16384 (16 GiB)")
    _check_device(opts.device)
    check_port_free(opts.host, opts.port)


def _specs(given: list[str], env_name: str) -> list[str]:
    """A repeated flag's entries followed by those of ``env_name`` (commas or spaces)."""
    env = os.environ.get(env_name, "")
    return list(given) + [s for s in env.replace(",", " ").split() if s]


def accept_specs(opts: argparse.Namespace) -> tuple[str, ...] | None:
    """``--accept-from`` entries followed by those of ``KVKERN_ACCEPT_FROM``; None where
    neither names any (the source's default)."""
    return tuple(_specs(opts.accept_from, "KVKERN_ACCEPT_FROM")) or None


def allow_specs(opts: argparse.Namespace) -> list[str]:
    """``--allow`` entries followed by those of ``KVKERN_ALLOWLIST``."""
    return _specs(opts.allow, "KVKERN_ALLOWLIST")


def _check_device(name: str) -> None:
    if name in ("auto", "cpu"):
        return
    head, _, index = name.partition(":")
    if head != "cuda" or (index and not index.isdigit()):
        raise UsageError(f"--device {name!r} is not one of cpu, cuda, cuda:N, auto")
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available to this process; "
                         "use --device cpu (or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this process sees {torch.cuda.device_count()} CUDA "
                         f"device(s); use cuda:0..cuda:{torch.cuda.device_count() - 1}")


def _pin_threads(threads: int) -> None:
    import torch  # noqa: PLC0415

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
        torch.set_num_interop_threads(1)


def _device(name: str) -> str:
    import torch  # noqa: PLC0415

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class Worker:
    """Everything of one worker, started by :meth:`start` and stopped by :meth:`close`."""

    def __init__(self, opts: argparse.Namespace) -> None:
        from kvkern.serve.engine import MODELS, Engine  # noqa: PLC0415

        self.opts = opts
        self.worker_id = opts.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.credential = self._credential()  # first: a bad secret fails before the model loads
        self.device = _device(opts.device)
        config = MODELS[opts.model]()
        self.engine = Engine(config, device=self.device, layout_name=opts.layout,
                             num_blocks=opts.num_blocks, hash_scheme=opts.hash_scheme,
                             prefill_chunk=opts.prefill_chunk)
        self.model_id = opts.model_id or self.engine.model.fingerprint()
        self.runtime = None
        self.source = None
        self.puller = None
        self.metrics = None
        self._engine_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvkern-engine")
        self._wait_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, opts.max_inflight_pulls), thread_name_prefix="kvkern-pull-wait")
        self.generate_body_bytes = GENERATE_BODY_BASE + GENERATE_BODY_PER_TOKEN * (
            config.max_seq_len)
        # requests read and decoded at once; the rest wait with their bodies unread, each for
        # at most the HTTP head timeout (then 503), as long as a connection may take for a head
        self._generating: asyncio.Semaphore | None = None
        self.url: str | None = None

    # ---------------------------------------------------------------------- lifecycle

    def _credential(self):
        from kvkern.xfer.auth import Credential  # noqa: PLC0415

        if self.opts.fleet_secret_file:
            return Credential.from_file(self.opts.fleet_secret_file, peer_id=self.worker_id)
        return Credential.from_env(peer_id=self.worker_id)

    def _xfer_config(self):
        from kvkern.xfer.config import XferConfig  # noqa: PLC0415

        o = self.opts
        allow = allow_specs(o)
        return XferConfig(
            metadata_timeout_s=o.metadata_timeout_s,
            transfer_timeout_s=o.transfer_timeout_s,
            deadline_s=o.deadline_s,
            max_metadata_timeout_s=max(10.0, o.metadata_timeout_s),
            max_transfer_timeout_s=max(60.0, o.transfer_timeout_s),
            max_deadline_s=max(120.0, o.deadline_s),
            lease_s=o.lease_s, default_policy=o.policy, cost_guard=o.cost_guard == "on",
            max_inflight_pulls=o.max_inflight_pulls, chunk_bytes=o.chunk_mib << 20,
            allowlist=allow, remote_read=True,  # read where a source offers it
            direct_reads=o.direct_reads == "on",
            local_reads=o.local_reads == "on",
        )

    def _group(self):
        from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology  # noqa: PLC0415
        from kvkern.xfer.kvgroup import KVGroup, RankKV  # noqa: PLC0415

        c = self.engine.config
        topo = Topology(model=ModelKVSpec(num_layers=c.n_layers, num_kv_heads=c.n_kv_heads,
                                          head_dim=c.head_dim, block_size=c.block_size,
                                          dtype=c.dtype),
                        parallel=Parallelism())
        return KVGroup(topology=topo, dp_rank=0, manager=self.engine.pool,
                       ranks={0: RankKV(0, self.engine.layout, self.engine.kv)},
                       model_id=self.model_id)

    def start(self, timeout: float = 60.0) -> Worker:
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.httpguard import HttpLimits, reads_own_body  # noqa: PLC0415
        from kvkern.xfer.metrics import XferMetrics  # noqa: PLC0415
        from kvkern.xfer.runtime import EventLoopThread  # noqa: PLC0415
        from kvkern.xfer.source import BLOCKS_PATH, SourceService  # noqa: PLC0415

        o = self.opts
        check_options(o)
        self.metrics = XferMetrics()
        self.runtime = EventLoopThread()
        group = self._group()
        config = self._xfer_config()
        if not config.allowlist:
            log.warning("no source is allowed (no --allow, KVKERN_ALLOWLIST unset): every hint "
                        "is refused with source_not_allowed; add --allow for the peers' "
                        "network, e.g. --allow 10.0.0.0/8:8000-8100")
        if self.credential is None:
            log.warning("no fleet credential (--fleet-secret-file, KVKERN_FLEET_SECRET_FILE, "
                        "KVKERN_FLEET_SECRET): this worker serves no peers and pulls from "
                        "none; make a secret with `kvkern secret`")
        routes = [web.post("/v1/generate", reads_own_body(self._http_generate)),
                  web.get(BLOCKS_PATH, self._http_blocks),  # fleet members only
                  web.get("/v1/info", self._http_info)]
        source_cls = SourceService
        if o.debug_send_delay_s > 0:
            source_cls = _stalling_source(SourceService, o.debug_send_delay_s)
        self.source = source_cls(
            [group], worker_id=self.worker_id, host=o.host, http_port=o.port,
            advertise_host=o.advertise_host or (None if o.host in ("0.0.0.0", "::") else o.host),
            chunk_bytes=o.chunk_mib << 20, metrics=self.metrics, extra_routes=routes,
            remote_read=o.remote_read, credential=self.credential,
            http_limits=HttpLimits(max_body_bytes=MAX_BODY_BYTES), accept_from=accept_specs(o))
        from kvkern.xfer.hints import HintLimits  # noqa: PLC0415

        self._limits = HintLimits(max_metadata_timeout_s=config.max_metadata_timeout_s,
                                  max_transfer_timeout_s=config.max_transfer_timeout_s,
                                  max_deadline_s=config.max_deadline_s,
                                  default_policy=config.default_policy)
        try:
            self.runtime.run(self.source.start(), timeout)
        except OSError as exc:
            if exc.errno not in BIND_ERRNOS:
                raise
            raise bind_error(exc, o.host, o.port) from None
        try:
            from kvkern.xfer.puller import Puller  # noqa: PLC0415
        except ImportError as exc:  # the puller lands separately; run without it meanwhile
            log.warning("no puller (%s): hints will fall back", exc)
        else:
            self.puller = Puller(group, config=config, metrics=self.metrics,
                                 loop=self.runtime, credential=self.credential)
        host = o.advertise_host or o.host
        self.url = f"http://{_fmt_host(host)}:{self.source.http_port}"
        return self

    def close(self) -> None:
        if self.puller is not None:
            with contextlib.suppress(Exception):
                close = getattr(self.puller, "close", None)
                if close is not None:
                    res = close()
                    if asyncio.iscoroutine(res):
                        self.runtime.run(res, 10.0)
        if self.source is not None and self.runtime is not None:
            with contextlib.suppress(Exception):
                self.runtime.run(self.source.close(), 15.0)
        if self.runtime is not None:
            self.runtime.close()
        self._wait_pool.shutdown(wait=False, cancel_futures=True)
        self._engine_pool.shutdown(wait=False, cancel_futures=True)

    def ready_info(self) -> dict[str, Any]:
        import torch  # noqa: PLC0415

        return {"url": self.url, "port": self.source.http_port, "worker_id": self.worker_id,
                "pid": os.getpid(), "device": self.device, "model": self.opts.model,
                "layout": self.opts.layout, "block_size": self.engine.block_size,
                "num_blocks": self.opts.num_blocks, "threads": torch.get_num_threads(),
                "ucx_ports": {str(k): v for k, v in self.source.ucx_ports.items()},
                "puller": self.puller is not None}

    # ---------------------------------------------------------------------- requests

    def handle_generate(self, body: dict[str, Any], arrival: float) -> tuple[int, dict]:
        """Validate, pull if hinted, generate. Runs on a pull-wait thread (never the loop).
        Returns (HTTP status, JSON)."""
        from kvkern.xfer.auth import check_hint  # noqa: PLC0415
        from kvkern.xfer.hints import HintRejected, KvHint, decode_hint  # noqa: PLC0415

        cfg = self.engine.config
        tokens = body.get("token_ids")
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            return 400, {"error": "token_ids must be a non-empty list of ints"}
        if not all(0 <= t < cfg.vocab_size for t in tokens):
            return 400, {"error": f"token ids must lie in [0, {cfg.vocab_size})"}
        max_new = body.get("max_new_tokens", 16)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or not (
                0 <= max_new <= self.opts.max_new_tokens):
            return 400, {"error": f"max_new_tokens must be an int in [0, "
                                  f"{self.opts.max_new_tokens}], got {max_new!r}"}
        if len(tokens) + max_new > cfg.max_seq_len:
            return 400, {"error": f"{len(tokens)} + {max_new} tokens exceed max_seq_len "
                                  f"{cfg.max_seq_len}"}
        use_cache = body.get("use_cache", True) is not False
        return_logits = body.get("return_logits", False) is True
        salt = body.get("cache_salt", "")
        if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
            return 400, {"error": f"cache_salt must be a string of at most {MAX_SALT_CHARS} "
                                  "characters"}
        request_id = body.get("request_id") or uuid.uuid4().hex
        if not isinstance(request_id, str) or len(request_id) > MAX_SALT_CHARS:
            return 400, {"error": f"request_id must be a string of at most {MAX_SALT_CHARS} "
                                  "characters"}

        out: dict[str, Any] = {"request_id": request_id, "hint": None, "pull": None,
                               "fallback": None, "pulled_tokens": 0, "pull_wait_s": 0.0}
        # the prompt's pool hashes, once: the local prefix, the pull and the prefill use them
        hashes = self.engine.pool_hashes(tokens, salt) if use_cache else []
        local_tokens = (self.engine.cached_prefix_tokens(tokens, salt, hashes=hashes)
                        if use_cache else 0)
        out["local_tokens"] = local_tokens
        held: list[int] = []
        hint = decode_hint(body, limits=self._limits) if use_cache else None
        if isinstance(hint, KvHint) and not self.opts.trust_unsigned_hints:
            why = check_hint(self.credential, body, hint, tokens, cache_salt=salt)
            if why is not None:
                log.warning("request %s: hint naming %r not used: %s", request_id,
                            hint.source, why)
                self.metrics.hint_received()
                self.metrics.hint_ignored("hint_untrusted")
                hint = HintRejected(reason="hint_untrusted", detail=why)
        if isinstance(hint, KvHint):
            out["hint"] = {"dialect": hint.dialect, "source": hint.source}
            if self.puller is None:
                out["fallback"] = "closed"
            else:
                t0 = time.perf_counter()
                # The puller's request ids are this worker's own: a tenant's id names its
                # request in this response and the logs only, so no tenant can collide with
                # (or learn of) another's request in flight.
                pull_id = f"{request_id}/{uuid.uuid4().hex}"
                held, outcome = self._pull(pull_id, tokens, hint, salt, hashes)
                out["pull_wait_s"] = time.perf_counter() - t0
                # What the pull learned of the source stays in this worker's log: a tenant
                # sees the outcome, not the detail (ports, fields, redirects, counts) nor the
                # source's identity (its worker id and incarnation).
                out["pull"] = {k: v for k, v in outcome.to_dict().items()
                               if k not in TENANT_HIDDEN}
                out["pull"]["request_id"] = request_id
                if not outcome.used or not held:
                    out["fallback"] = outcome.reason.value if not outcome.used else "lease_expired"
                else:
                    out["pulled_tokens"] = outcome.blocks_transferred * cfg.block_size
        elif hint is not None and hint.reason != "no_hint":
            log.info("request %s: hint rejected: %s: %s", request_id, hint.reason, hint.detail)
            out["hint"] = {"rejected": hint.reason}
            out["fallback"] = hint.reason

        on_prefill = getattr(self.puller, "observe_prefill", None)
        fut = self._engine_pool.submit(self.engine.generate, tokens, max_new, arrival=arrival,
                                       use_cache=use_cache, held=held, on_prefill=on_prefill,
                                       cache_salt=salt, hashes=hashes)
        try:
            res = fut.result()
        except RuntimeError as exc:  # pool exhausted (the model's allocator message)
            return 503, {**out, "error": str(exc)}
        out.update(res.to_json(return_logits=return_logits))
        return 200, out

    def _pull(self, request_id: str, tokens: list[int], hint, salt: str = "",
              hashes: list[int] | None = None) -> tuple[list[int], Any]:
        """Submit the pull (with the prompt's pool hashes, when given), wait for its outcome
        (bounded), claim its blocks. Returns the claimed block ids (empty when the pull was
        not used) and the outcome."""
        p = self.puller
        bound = self.opts.deadline_s + self.opts.metadata_timeout_s + 5.0
        p.submit(request_id, tokens, hint, cache_salt=salt, block_hashes=hashes)
        try:
            outcome = p.result(request_id, timeout=bound)
        except Exception:
            with contextlib.suppress(Exception):
                p.cancel(request_id)
            outcome = p.result(request_id, timeout=10.0)
        held: list[int] = []
        if outcome.used:
            claimed = p.claim(request_id)
            held = list(claimed or [])
        return held, outcome

    # ---------------------------------------------------------------------- HTTP

    async def _http_generate(self, request):
        from aiohttp import web  # noqa: PLC0415

        from kvkern.xfer.httpguard import read_json_object  # noqa: PLC0415

        arrival = time.perf_counter()
        if request.content_length is not None and \
                request.content_length > self.generate_body_bytes:  # (before any wait)
            return _closing(web.json_response(
                {"error": f"body larger than {self.generate_body_bytes} bytes"}, status=413))
        if self._generating is None:  # (made on the loop that serves HTTP)
            self._generating = asyncio.Semaphore(self._generating_limit())
        limits = self.source.http_limits
        try:  # (waiting requests wait with their bodies unread, as long as a head may take)
            await asyncio.wait_for(self._generating.acquire(), limits.header_timeout_s)
        except asyncio.TimeoutError:
            return _closing(web.json_response(
                {"error": f"busy: {self._generating_limit()} requests already generating and "
                          f"none finished within {limits.header_timeout_s:g} s; retry later"},
                status=503))
        loop = asyncio.get_running_loop()
        try:
            body = await read_json_object(request, max_bytes=self.generate_body_bytes,
                                          timeout_s=limits.body_timeout_s)
            try:
                status, out = await loop.run_in_executor(self._wait_pool,
                                                         self.handle_generate, body, arrival)
            except Exception as exc:  # noqa: BLE001 (report, keep serving)
                log.exception("generate failed")
                status, out = 500, {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._generating.release()
        return web.json_response(out, status=status)

    def _generating_limit(self) -> int:
        """Generate requests read, decoded and served at once."""
        return 2 * max(1, self.opts.max_inflight_pulls)

    async def _http_blocks(self, request):
        from aiohttp import web  # noqa: PLC0415

        return web.json_response(self.engine.report(self.worker_id))

    async def _http_info(self, request):
        from aiohttp import web  # noqa: PLC0415

        c = self.engine.config
        return web.json_response({
            **self.ready_info(), "pool": self.engine.pool.stats(),
            "model_config": {"vocab_size": c.vocab_size, "hidden": c.hidden,
                             "n_layers": c.n_layers, "n_kv_heads": c.n_kv_heads,
                             "head_dim": c.head_dim, "block_size": c.block_size,
                             "kv_bytes_per_token": c.kv_bytes_per_token,
                             "max_seq_len": c.max_seq_len},
            "policy": self.opts.policy, "cost_guard": self.opts.cost_guard,
        })


def _stalling_source(base: type, delay_s: float) -> type:
    """A source that sleeps before every chunk and before offering a read (fault tests: a
    window in which to kill it mid-transfer)."""

    class StallingSource(base):
        async def _before_chunk(self, transfer_id: int, index: int) -> None:
            await asyncio.sleep(delay_s)

        async def _before_read_reply(self, transfer_id: int) -> None:
            await asyncio.sleep(delay_s)

    return StallingSource


def _closing(resp: Any) -> Any:
    """``resp`` (an aiohttp response) sent with ``Connection: close``: the connection ends
    after it, what comes of the unread body meanwhile dropped (for at most the head timeout,
    after which the HTTP guard closes a connection that has no request in progress)."""
    resp.force_close()
    return resp


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def setup_logging(level: str) -> None:
    """Log lines on stderr at ``level``; aiohttp's per-request access lines only at DEBUG."""
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if level != "DEBUG":
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    from kvkern.xfer.auth import CredentialError  # noqa: PLC0415

    prog = "kvkern worker"
    opts = build_parser().parse_args(argv)
    setup_logging(opts.log_level)
    try:
        check_options(opts)
    except UsageError as exc:
        return report(prog, str(exc))
    _pin_threads(opts.threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker = None
    try:
        worker = Worker(opts)
        worker.start()
        # What start-up made (model, pools, imports) lives as long as the process: frozen, a
        # full collection no longer walks it (unfrozen, one took 93-110 ms, inside pulls).
        gc.freeze()
        print(READY_PREFIX + json.dumps(worker.ready_info()), flush=True)
        while not stop.wait(1.0):
            pass
    except UsageError as exc:
        return report(prog, str(exc))
    except CredentialError as exc:
        return report(prog, credential_fix(exc))
    finally:
        if worker is not None:
            worker.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
