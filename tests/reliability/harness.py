"""Helpers of the reliability suite: fault-worker processes on 127.0.0.1, their admin routes,
leak checks and small statistics. Every process is killed by whoever started it, in
``finally``; every HTTP call has a timeout."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvkern.cache.hashing import DEFAULT_SCHEME, sequence_hashes
from kvkern.serve.httpjson import get_json, post_json
from kvkern.serve.procs import WorkerProcess, WorkerStartError, start_workers
from kvkern.xfer.hints import decode_hint
from tests.fleet import signed

PEERS = Path(__file__).parent / "peers"
T = 4  # ModelConfig.tiny().block_size
VOCAB = 256
SCHEME = DEFAULT_SCHEME  # the workers' pool scheme (kvkern worker default)
# Pool counters that must be back at their baseline (0) once every request has ended.
LEAK_FIELDS = ("used", "referenced", "pinned", "pins", "leased", "leases", "private")
COMMON = ["--model", "tiny", "--num-blocks", "8192", "--allow", "127.0.0.0/8",
          "--cost-guard", "off", "--metadata-timeout-s", "2", "--transfer-timeout-s", "5",
          "--deadline-s", "8", "--max-inflight-pulls", "16", "--log-level", "ERROR",
          "--remote-read", "host"]


class FaultWorker(WorkerProcess):
    """``tests/reliability/peers/fault_worker.py`` (the real worker plus test routes) as a
    child process; the parent class reads its READY line, health-checks and stops it."""

    entry = (sys.executable, str(PEERS / "fault_worker.py"))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGCONT first: a frozen (SIGSTOPped) child cannot handle SIGTERM."""
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(self.pid, signal.SIGCONT)
        super().stop(timeout=timeout)

    # ---- admin routes

    def stats(self, timeout: float = 10.0) -> dict:
        return get_json(f"{self.url}/test/stats", timeout=timeout)

    def faults(self, **knobs: Any) -> dict:
        return post_json(f"{self.url}/test/faults", knobs, timeout=10)

    def digests(self, hashes: list[int]) -> dict[str, str | None]:
        return post_json(f"{self.url}/test/blocks", {"hashes": hashes}, timeout=30)

    def generate(self, body: dict, timeout: float = 60.0) -> dict:
        """POST ``body``; a hint in it is signed first, as the fleet's router signs it."""
        if decode_hint(body).ok:
            body = signed(body)
        return post_json(f"{self.url}/v1/generate", body, timeout=timeout)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def leaks(self) -> dict[str, int]:
        """Leak counters now: pool fields plus the source's pins and the puller's pulls."""
        st = self.stats()
        out = {k: st["pool"][k] for k in LEAK_FIELDS}
        out.update(pins_outstanding=st["pins_outstanding"], active_sends=st["active_sends"],
                   puller_inflight=st["puller_inflight"], prefetching=st["prefetching"])
        return out

    def wait_clean(self, timeout: float = 10.0) -> dict[str, int]:
        """Poll until every leak counter is 0; returns the last counters (nonzero = leak)."""
        deadline = time.monotonic() + timeout
        while True:
            lk = self.leaks()
            if not any(lk.values()) or time.monotonic() > deadline:
                return lk
            time.sleep(0.05)


def start_fault_workers(specs: dict[str, list[str]], *, timeout: float = 150.0,
                        env: dict[str, str] | None = None) -> dict[str, FaultWorker]:
    return start_workers(specs, timeout=timeout, env=env, worker_cls=FaultWorker)


def stop_hard(p: WorkerProcess) -> None:
    """SIGCONT (a frozen child cannot handle SIGTERM), then SIGTERM, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError, OSError):
        os.kill(p.pid, signal.SIGCONT)
    WorkerProcess.stop(p, timeout=10.0)


def toks(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def pool_hashes(tokens: list[int]) -> list[int]:
    return sequence_hashes(tokens, T, SCHEME)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles (``p50``...) of ``values``; empty -> {}."""
    if not values:
        return {}
    v = sorted(values)
    out = {}
    for q in qs:
        k = max(0, min(len(v) - 1, -(-q * len(v) // 100) - 1))
        out[f"p{q}"] = v[k]
    return out


__all__ = ["COMMON", "LEAK_FIELDS", "T", "FaultWorker", "WorkerStartError", "percentiles",
           "pool_hashes", "start_fault_workers", "stop_hard", "toks"]
