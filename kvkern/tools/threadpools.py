"""Idle thread pools in a benchmark's processes.

torch runs its CPU operations on an OpenMP pool whose threads, by default, keep spinning
after each operation ends: after a 64 MiB ``fill_`` the pool burned 6-9 ms of CPU while its
caller slept. On a host with few cores, a benchmark that interleaves transfers then takes a
core from whichever transfer comes next: the one after a NIXL READ's verification, or after
a stream's unpack or a scattered source's pack.

So every process of ``kvkern bench xfer`` and of :mod:`kvkern.tools.nixlbench` runs with
``OMP_WAIT_POLICY=PASSIVE`` (a pool's threads sleep once their work is done) unless the
caller's environment names a policy. OpenMP reads the variable when torch loads it, so
:func:`settle` runs before the process imports torch, and the processes it starts inherit it;
each run's record says which policy it had (:func:`record`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["POLICY", "POLICY_ENV", "record", "settle"]

POLICY_ENV = "OMP_WAIT_POLICY"
POLICY = "PASSIVE"
_late = False  # settle() ran after this process had loaded torch: its own pool may spin


def settle(env: MutableMapping[str, str] | None = None) -> None:
    """Give ``env`` (this process's environment by default) :data:`POLICY` unless it names a
    policy already."""
    global _late
    if env is None:
        env = os.environ
        if POLICY_ENV not in env and "torch" in sys.modules:
            _late = True
    env.setdefault(POLICY_ENV, POLICY)


def record() -> dict[str, str | bool | None]:
    """This process's OpenMP wait policy, for a run's environment record; ``omp_late`` when
    it was set only after torch had loaded (this process's own pool kept the default)."""
    out: dict[str, str | bool | None] = {"omp_wait_policy": os.environ.get(POLICY_ENV)}
    if _late:
        out["omp_late"] = True
    return out
