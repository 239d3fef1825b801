"""The UCX environment kvkern needs, applied before ``import ucxx``.

UCX reads its configuration once, from the environment, when the first context is created,
and ucxx creates that context on first use; so every setting here must be in ``os.environ``
before ``import ucxx``. :func:`import_ucxx` is the only way kvkern imports ucxx: it applies
:func:`configure_ucx_env` first. Values the user already set are never overridden.

Why each setting (ucxx 0.52, libucx 1.21, two processes on 127.0.0.1):

* ``UCX_POSIX_ERROR_HANDLING=y``, ``UCX_SYSV_ERROR_HANDLING=y``, ``UCX_CMA_MEMORY_INVALIDATE=y``:
  endpoints from a listener always ask for peer error handling, which in UCX 1.21 rules
  out the shared-memory and CMA zero-copy transports unless these are set, and UCX falls back
  to TCP on loopback. Measured with ``kvkern bench xfer`` (thread progress, median):
  without them (``--ucx-env off``) 0.79-0.85 GB/s for 64-256 MiB, i.e. TCP; with them
  4.5-5.4 GB/s for one 64-256 MiB buffer (p80 8.6) and 9.0 GB/s as 16 MiB chunks 8 in
  flight: shared memory / CMA.
* ``UCX_CMA_SEG_SIZE=4M``: UCX moves one segment of a CMA copy (a rendezvous receive, a
  one-sided read) per progress call, holding the worker meanwhile, so every other call on
  that worker waits for it. On ucxx's worker (control messages, streams), during 64 MiB
  streams other calls waited 0.06-0.14 ms at p90 with UCX's 512 KiB, 0.8 ms with 4 MiB and
  3.6 ms with 16 MiB; a raw 64 MiB send took 9.2-9.9 ms at 512 KiB against 7.0-7.1 ms at
  4 MiB and 6.9-9.4 ms at 16 MiB. The read lanes' own workers copy 16 MiB per call
  (:data:`kvkern.xfer.tuning.LANE_UCX_CONFIG`).
* ``UCX_WARN_UNUSED_ENV_VARS=n``: UCX prints a warning on stdout for every ``UCX_*`` variable
  a transport did not consume; these settings are exactly such variables on some builds.
* ``UCX_TLS``: left alone. If the user restricts it, it must keep ``tcp`` for listener
  endpoints (the connection manager runs over sockets): without it ``create_endpoint`` fails
  after 5 s. :func:`ucx_tls_problem` names that misconfiguration so callers fail fast. The
  contexts of one-sided reads take the same list without ``tcp`` (:func:`rma_tls`).

Device memory (pools and staging on a GPU). UCX's default ``UCX_TLS=all`` already includes
every CUDA transport a node has, and that is the choice: an explicit list makes UCX 1.21 warn
at every context creation on a node lacking one of its names ("transports 'cuda','rc','dc'
are not available"), and a list fixed for one node shape would drop a faster transport on
another. The transports device memory uses (:data:`CUDA_TRANSPORTS`):

* ``cuda_copy``: required. It detects device memory and copies between device and host;
  without it UCX cannot send a device buffer at all (:func:`ucx_tls_problem` with
  ``device_memory=True`` names a ``UCX_TLS`` that rules it out).
* ``cuda_ipc``: between processes on one node, device to device over NVLink or PCIe
  without the host; without it an intra-node pull stages through host memory.
* ``gdr_copy``: GPUDirect copies with GDRCopy, where the driver is installed; it serves small
  (eager) device messages, while kvkern's chunks are large and go by rendezvous.
* ``rc`` / ``dc`` (InfiniBand, RoCE): device memory straight to the NIC with GPUDirect RDMA
  where the ``nvidia-peermem`` module is loaded (UCX's ``UCX_IB_GPU_DIRECT_RDMA=try``).

:func:`cuda_tls_gaps` lists those a user's ``UCX_TLS`` rules out; a process whose pools are on
a GPU logs them once (:func:`kvkern.xfer.devstream.for_device`). Two settings concern device
memory only and are applied everywhere (UCX 1.21's defaults, pinned so the behaviour does not
depend on the UCX version; no effect on host memory):

* ``UCX_MEMTYPE_REG_WHOLE_ALLOC_TYPES=cuda``: registering a device buffer registers the whole
  allocation it lies in (one PyTorch caching-allocator segment holds a pool or many staging
  buffers), so one registration and one CUDA IPC handle serve every block and staging slice
  in it, instead of one per buffer.
* ``UCX_CUDA_IPC_CACHE=y``: a peer keeps the IPC mappings it opened (opening one costs up to
  hundreds of milliseconds); pools and pooled staging buffers live as long as the worker, so
  every pull after the first reuses them.
* ``UCX_RCACHE_MAX_UNRELEASED=1024``: UCX's registration cache cleans up the regions of
  freed memory once they pass this many bytes, instead of never (1.21's default, ``inf``):
  unbounded, that garbage grew a serving process without end (vLLM issue 24264); NIXL
  applies the same value.
* ``UCXPY_PROGRESS_MODE=thread`` (the ucxx default, made explicit): see
  :mod:`kvkern.xfer.transport` for the measurement behind the choice.
* ``UCXPY_ENABLE_PYTHON_FUTURE=1``: without it every pending ucxx request (a source's idle
  control receive included) is awaited by re-scheduling itself with ``asyncio.sleep(0)``,
  so each process burns a core while it waits; with it a notifier thread completes asyncio
  futures when UCX does. Measured with ``kvkern bench xfer`` over loopback:
  control round trip 3.6 ms -> 0.58 ms, one 64 MiB buffer 4.8-7 -> 12 GB/s. The notifier serves one
  event loop; :func:`kvkern.xfer.transport.bind_ucxx_loop` moves it to the loop in use.

The full table (progress modes, chunk sizes, per-message cost) is in kvkern.tools.benchcli.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from types import ModuleType

# Settings kvkern applies when the user has not set them. Order is irrelevant.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_POSIX_ERROR_HANDLING": "y",
    "UCX_SYSV_ERROR_HANDLING": "y",
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_CMA_SEG_SIZE": "4M",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCX_MEMTYPE_REG_WHOLE_ALLOC_TYPES": "cuda",
    "UCX_CUDA_IPC_CACHE": "y",
    "UCX_RCACHE_MAX_UNRELEASED": "1024",
}

# UCX transports that carry device memory, and what a pull loses without each (docstring).
CUDA_TRANSPORTS: dict[str, str] = {
    "cuda_copy": "device buffers cannot be sent or received at all",
    "cuda_ipc": "device-to-device pulls on one node stage through host memory",
    "gdr_copy": "small device messages go through cuda_copy instead of GPUDirect copies",
    "rc": "no GPUDirect RDMA over InfiniBand / RoCE (device memory stages through the host)",
}
# UCX_TLS aliases that name several transports (UCX's own ``ucx_info -d`` names)
_TLS_ALIASES: dict[str, frozenset[str]] = {
    "cuda": frozenset({"cuda_copy", "cuda_ipc", "gdr_copy"}),
    "ib": frozenset({"rc", "dc", "ud"}),
    "rc_v": frozenset({"rc"}), "rc_x": frozenset({"rc"}),
    "rc_verbs": frozenset({"rc"}), "rc_mlx5": frozenset({"rc"}),
}


def configure_ucx_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set kvkern's UCX defaults in ``environ`` (``os.environ`` by default) where unset.

    Returns the settings this call applied (name -> value); names the user had set are left
    untouched and are not in the result. Idempotent. Must run before ``import ucxx`` to have
    any effect; :func:`import_ucxx` guarantees that ordering.
    """
    env = os.environ if environ is None else environ
    applied: dict[str, str] = {}
    for name, value in UCX_DEFAULTS.items():
        if name not in env:
            env[name] = value
            applied[name] = value
    return applied


def _tls_allows(tls: str | None, transport: str) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX use ``transport`` (aliases expanded)."""
    items = [t.strip().lower() for t in (tls or "").split(",") if t.strip()]
    if not items:
        return True
    exclude = items[0].startswith("^")
    if exclude:
        items[0] = items[0][1:]
    named = any(t == transport or transport in _TLS_ALIASES.get(t, ()) for t in items)
    if exclude:
        return not named
    return named or "all" in items


def rma_tls(environ: MutableMapping[str, str] | None = None) -> str | None:
    """``UCX_TLS`` for a context that registers memory for peers' one-sided reads, or reads
    a peer's: the user's ``UCX_TLS`` without ``tcp``; None when nothing else is left.

    Over TCP, UCX emulates one-sided reads and writes in software, and a worker whose context
    enables RMA answers them from any endpoint that reaches it, at any address, with no remote
    key and before kvkern authenticates anyone (SECURITY.md). Such contexts keep to transports
    that reach no further than the host (shared memory, CMA, CUDA IPC) or the RDMA fabric;
    a source reachable over TCP only is streamed to."""
    env = os.environ if environ is None else environ
    items = [t.strip() for t in (env.get("UCX_TLS") or "").split(",") if t.strip()]
    if not items or "all" in (t.lower() for t in items):
        return "^tcp"
    if items[0].startswith("^"):
        excluded = [items[0][1:], *items[1:]]
        return "^" + ",".join(dict.fromkeys(
            [t for t in excluded if t] + (["tcp"] if "tcp" not in excluded else [])))
    kept = [t for t in items if t.lower() not in ("tcp", "all")]
    return ",".join(kept) or None


def cuda_tls_gaps(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """The :data:`CUDA_TRANSPORTS` the user's ``UCX_TLS`` rules out (empty when unset)."""
    env = os.environ if environ is None else environ
    return [t for t in CUDA_TRANSPORTS if not _tls_allows(env.get("UCX_TLS"), t)]


def ucx_tls_problem(environ: MutableMapping[str, str] | None = None, *,
                    device_memory: bool = False) -> str | None:
    """Why the user's ``UCX_TLS`` cannot carry listener endpoints (or, with
    ``device_memory``, device buffers), or ``None`` if it can.

    ``UCX_TLS`` unset, ``all``, or a ``^``-exclusion list that does not exclude tcp is fine;
    an explicit list must name ``tcp``. Device memory also needs ``cuda_copy``.
    """
    env = os.environ if environ is None else environ
    if device_memory and not _tls_allows(env.get("UCX_TLS"), "cuda_copy"):
        return (f"UCX_TLS={env.get('UCX_TLS')!r} rules out cuda_copy; device pools need it "
                f"({CUDA_TRANSPORTS['cuda_copy']})")
    tls = env.get("UCX_TLS")
    if tls is None:
        return None
    items = [t.strip().lower() for t in tls.split(",") if t.strip()]
    if not items:
        return None
    if items[0].startswith("^"):
        excluded = {items[0][1:], *items[1:]}
        if "tcp" in excluded:
            return f"UCX_TLS={tls!r} excludes tcp, which listener endpoints need"
        return None
    if "all" in items or "tcp" in items:
        return None
    return (f"UCX_TLS={tls!r} lacks tcp; listener endpoints need it "
            "(create_endpoint would fail after its 5 s connect timeout)")


def import_ucxx() -> ModuleType:
    """Import and return ``ucxx`` after applying :func:`configure_ucx_env`.

    If ucxx was already imported by someone else the environment can no longer change what
    UCX does; the settings are still applied for child processes.
    """
    configure_ucx_env()
    import ucxx  # noqa: PLC0415 (lazy on purpose: ucxx is heavy and optional at import time)

    return ucxx
