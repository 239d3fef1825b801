"""An engine's own Python work beside a benchmark's transfers.

kvkern runs inside a serving engine's process, whose threads (scheduler, model runner, the
KV connector's callers) spend much of each step in Python and so hold the interpreter lock.
Every kvkern step that runs Python then waits for the lock: up to the interpreter's switch
interval (``sys.getswitchinterval()``, 5 ms by default) each time a thread of kvkern's wakes
while the engine's thread computes. A benchmark on an otherwise idle process never sees that.

:class:`EngineLoad` is that engine: a thread that computes in pure Python for ``fraction`` of
every ``period_s`` and sleeps for the rest, as an engine step does between its waits.
``kvkern bench xfer --engine-load F`` sets :data:`ENV`, and every process of the run (the
pulling process, its source, NIXL's initiator and target) starts one with :func:`from_env`,
so kvkern and NIXL are measured under the same load. The run's record holds the fraction
asked for and the one the pulling process's thread reached (``env.engine_load``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping

__all__ = ["ENV", "PERIOD_S", "EngineLoad", "engine_cpu_s", "from_env", "parse_fraction"]

ENV = "KVKERN_BENCH_ENGINE_LOAD"
PERIOD_S = 0.01  # one engine step: its Python, then its wait
_SPINS = 200  # pure-Python additions between two looks at the clock (a few microseconds)


def parse_fraction(text: str) -> float:
    """A load fraction from the command line or :data:`ENV`: a number in [0, 1)."""
    value = float(text)
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"engine load must be a fraction in [0, 1), got {text!r}")
    return value


class EngineLoad:
    """A daemon thread that holds the interpreter busy for ``fraction`` of each ``period_s``
    (pure-Python arithmetic: it gives the lock up only when the interpreter forces a switch)
    and sleeps for the rest."""

    def __init__(self, fraction: float, period_s: float = PERIOD_S) -> None:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s!r}")
        self.fraction, self.period_s = fraction, period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy_s = 0.0
        self._t0 = self._t1 = 0.0

    def start(self) -> EngineLoad:
        if self._thread is None:
            self._t0 = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="kvkern-engine-load",
                                            daemon=True)
            self._thread.start()
            with _started_lock:
                _started.append(self)
        return self

    def cpu_s(self) -> float:
        """The CPU time its thread has used so far (0 before it started or once it ended)."""
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, AttributeError):  # (ended meanwhile; a platform without the call)
            return 0.0

    def stop(self) -> float:
        """Stop the thread; the fraction of the wall time it spent computing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with _started_lock:
            if self in _started:
                _started.remove(self)
        return self.busy_fraction()

    def busy_fraction(self) -> float:
        end = self._t1 if self._stop.is_set() and self._t1 else time.perf_counter()
        wall = end - self._t0
        return round(self._busy_s / wall, 3) if self._thread is not None and wall > 0 else 0.0

    def _run(self) -> None:
        busy = self.fraction * self.period_s
        clock = time.perf_counter
        x = 0
        while not self._stop.is_set():
            t = clock()
            end = t + busy
            while clock() < end:
                for _ in range(_SPINS):
                    x += 1
            now = clock()
            self._busy_s += now - t
            self._stop.wait(max(0.0, self.period_s - (now - t)))
        self._t1 = clock()


_started: list[EngineLoad] = []  # this process's loads, started and not stopped
_started_lock = threading.Lock()


def engine_cpu_s() -> float:
    """The CPU time this process's running loads' threads have used: what a benchmark
    subtracts from the process's own to count the transfers' CPU alone."""
    with _started_lock:
        loads = list(_started)
    return sum(load.cpu_s() for load in loads)


def from_env(env: Mapping[str, str] = os.environ) -> EngineLoad | None:
    """The load :data:`ENV` asks this process for, started; None when it asks for none."""
    text = env.get(ENV, "")
    if not text:
        return None
    fraction = parse_fraction(text)
    return EngineLoad(fraction).start() if fraction > 0 else None
