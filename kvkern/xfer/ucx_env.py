"""The UCX environment kvkern needs, applied before ``import ucxx``.

UCX reads its configuration once, from the environment, when the first context is created,
and ucxx creates that context on first use; so every setting here must be in ``os.environ``
before ``import ucxx``. :func:`import_ucxx` is the only way kvkern imports ucxx: it applies
:func:`configure_ucx_env` first. Values the user already set are never overridden.

Why each setting (ucxx 0.52, libucx 1.21, two processes on 127.0.0.1, 2 shared CPU cores):

* ``UCX_POSIX_ERROR_HANDLING=y``, ``UCX_SYSV_ERROR_HANDLING=y``, ``UCX_CMA_MEMORY_INVALIDATE=y``:
  endpoints from a listener always ask for peer error handling, which in UCX 1.21 rules
  out the shared-memory and CMA zero-copy transports unless these are set, and UCX falls back
  to TCP on loopback. Measured here with ``kvkern bench xfer`` (thread progress, median):
  without them (``--ucx-env off``) 0.79-0.85 GB/s for 64-256 MiB, i.e. TCP; with them
  4.5-5.4 GB/s for one 64-256 MiB buffer (p80 8.6) and 9.0 GB/s as 16 MiB chunks 8 in
  flight: shared memory / CMA. (2 cores shared with other jobs; see kvkern.tools.benchcli.)
* ``UCX_WARN_UNUSED_ENV_VARS=n``: UCX prints a warning on stdout for every ``UCX_*`` variable
  a transport did not consume; these settings are exactly such variables on some builds.
* ``UCX_TLS``: left alone. If the user restricts it, it must keep ``tcp`` for listener
  endpoints (the connection manager runs over sockets): without it ``create_endpoint`` fails
  after 5 s. :func:`ucx_tls_problem` names that misconfiguration so callers fail fast.
* ``UCXPY_PROGRESS_MODE=thread`` (the ucxx default, made explicit): see
  :mod:`kvkern.xfer.transport` for the measurement behind the choice.
* ``UCXPY_ENABLE_PYTHON_FUTURE=1``: without it every pending ucxx request (a source's idle
  control receive included) is awaited by re-scheduling itself with ``asyncio.sleep(0)``,
  so each process burns a core while it waits; with it a notifier thread completes asyncio
  futures when UCX does. Measured with ``kvkern bench xfer`` on 2 CPU cores over loopback:
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
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
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


def ucx_tls_problem(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Why the user's ``UCX_TLS`` cannot carry listener endpoints, or ``None`` if it can.

    ``UCX_TLS`` unset, ``all``, or a ``^``-exclusion list that does not exclude tcp is fine;
    an explicit list must name ``tcp``.
    """
    env = os.environ if environ is None else environ
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
