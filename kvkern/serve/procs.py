"""Worker processes for the demo and the tests: start ``kvkern worker`` on loopback, read its
``KVKERN_READY {json}`` line, health-check it, and always terminate it.

Only the READY line of stdout is parsed (UCX may print to stdout too); the rest is drained so
the pipe never fills, and the last lines of stdout and stderr are kept for error messages.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from kvkern.serve.httpjson import get_json

__all__ = ["WorkerProcess", "WorkerStartError", "start_workers"]

READY_PREFIX = "KVKERN_READY "


class WorkerStartError(RuntimeError):
    pass


class WorkerProcess:
    """One ``python -m kvkern worker`` child. Use as a context manager or call :meth:`stop`."""

    #: the program before the worker's own flags; subclasses run other worker entry points
    entry: tuple[str, ...] = (sys.executable, "-m", "kvkern", "worker")

    def __init__(self, name: str, args: list[str], *, threads: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = list(args)
        self.info: dict[str, Any] = {}
        self._stdout_tail: collections.deque[str] = collections.deque(maxlen=50)
        self._ready: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stderr = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 (closed in stop)
        child_env = {**os.environ, **(env or {})}
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            child_env[var] = str(threads)
        child_env["PYTHONUNBUFFERED"] = "1"
        cmd = [*self.entry, "--threads", str(threads), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, env=child_env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read_stdout, name=f"{name}-stdout",
                                        daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(READY_PREFIX):
                with contextlib.suppress(ValueError):
                    self._ready.put(json.loads(line[len(READY_PREFIX):]))
                    continue
            self._stdout_tail.append(line)

    @property
    def url(self) -> str:
        return self.info["url"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait for the READY line and a healthy ``/healthz``; raise with the child's output
        if it exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.info = self._ready.get(timeout=0.2)
                break
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise WorkerStartError(f"worker {self.name} exited with "
                                           f"{self.proc.returncode}\n{self.output()}") from None
                if time.monotonic() > deadline:
                    raise WorkerStartError(f"worker {self.name} not ready in {timeout:.0f} s\n"
                                           f"{self.output()}") from None
        while True:
            try:
                if get_json(f"{self.url}/healthz", timeout=2.0).get("status") == "ok":
                    return self.info
            except Exception:  # noqa: BLE001 (retry until the deadline)
                pass
            if time.monotonic() > deadline:
                raise WorkerStartError(f"worker {self.name} at {self.url} not healthy in "
                                       f"{timeout:.0f} s\n{self.output()}")
            time.sleep(0.1)

    def output(self, lines: int = 30) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        err = self._stderr.read().decode("utf-8", "replace").splitlines()[-lines:]
        out = list(self._stdout_tail)[-lines:]
        return "--- stdout ---\n" + "\n".join(out) + "\n--- stderr ---\n" + "\n".join(err)

    def kill(self) -> None:
        """SIGKILL now (fault tests)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(Exception):
            self._reader.join(2.0)
        with contextlib.suppress(Exception):
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        with contextlib.suppress(Exception):
            self._stderr.close()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_workers(specs: dict[str, list[str]], *, threads: int = 1, timeout: float = 90.0,
                  env: dict[str, str] | None = None,
                  worker_cls: type[WorkerProcess] = WorkerProcess,
                  envs: dict[str, dict[str, str]] | None = None) -> dict[str, WorkerProcess]:
    """Start every worker at once (they import and build in parallel), then wait for all.
    ``env`` is added to every worker's environment, ``envs[name]`` to that worker's only.
    On any failure every started worker is stopped before the error propagates."""
    procs: dict[str, WorkerProcess] = {}
    try:
        for name, args in specs.items():
            own = {**(env or {}), **((envs or {}).get(name) or {})}
            procs[name] = worker_cls(name, args, threads=threads, env=own or None)
        deadline = time.monotonic() + timeout
        for p in procs.values():
            p.wait_ready(max(1.0, deadline - time.monotonic()))
        return procs
    except BaseException:
        for p in procs.values():
            p.stop()
        raise
