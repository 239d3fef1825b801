"""Pull policies and the cost guard. Pure: no I/O, no clocks, no locks except the guard's.

Policies decide how many of the requested blocks a pull keeps, given what each
(source rank, destination rank) pair served (every pair must deliver a block's slice for the
block to be whole on every destination rank)::

    requested            [b0 b1 b2 b3 b4 b5]
    pair s0->d0 served   [b0 b1 b2 b3 b4 b5]
    pair s1->d0 served   [b0 b1 b2 b3]
    strict               nothing kept (source_miss); every received block freed
    best_effort          [b0 b1 b2 b3] kept (partial), [b4 b5] skipped and freed

The cost guard skips pulls that cannot beat recompute::

    pull      = fixed + bytes / bandwidth        (EWMA of measured pulls' fixed cost and copy
                                                  rate; priors before any)
    recompute = tokens * prefill_s_per_token     (configured, else EWMA of observe_prefill,
                                                  else the prior; unknown -> the guard passes)
    skip (not_worth_it) when pull * margin >= recompute
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvkern.checks import check_positive_int
from kvkern.xfer.config import POLICIES, XferConfig
from kvkern.xfer.outcome import Reason

__all__ = ["CostEstimate", "CostGuard", "PolicyDecision", "apply_policy"]


@dataclass(frozen=True, kw_only=True)
class PolicyDecision:
    """``keep`` leading requested blocks are committed; the rest are freed. ``reason`` is
    ``ok`` / ``partial`` when something is kept, else the fallback reason."""

    keep: int
    skipped: int
    reason: Reason

    @property
    def used(self) -> bool:
        return self.keep > 0


def apply_policy(policy: str, requested: int, served: Sequence[int]) -> PolicyDecision:
    """Decide what to keep from ``served[i]`` (validated leading blocks of pair ``i``).

    ``strict``: all ``requested`` from every pair, else nothing (``source_miss``).
    ``best_effort``: the minimum over pairs (``partial`` if short, ``source_miss`` if 0).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} not in {POLICIES}")
    check_positive_int("requested", requested)
    if not served:
        raise ValueError("served is empty: a pull has at least one rank pair")
    for s in served:
        if not 0 <= s <= requested:
            raise ValueError(f"a pair served {s} blocks of {requested} requested")
    low = min(served)
    if low == requested:
        return PolicyDecision(keep=requested, skipped=0, reason=Reason.OK)
    if policy == "strict" or low == 0:
        return PolicyDecision(keep=0, skipped=requested, reason=Reason.SOURCE_MISS)
    return PolicyDecision(keep=low, skipped=requested - low, reason=Reason.PARTIAL)


@dataclass(frozen=True, kw_only=True)
class CostEstimate:
    pull_s: float
    recompute_s: float | None  # None: no prefill cost known yet
    worth_it: bool

    def describe(self) -> str:
        rc = "unknown" if self.recompute_s is None else f"{self.recompute_s * 1e3:.3f} ms"
        return f"estimated pull {self.pull_s * 1e3:.3f} ms vs recompute {rc}"


class CostGuard:
    """Estimates pull and recompute time; learns bandwidth, RTT and prefill cost as EWMAs.
    Thread-safe."""

    def __init__(self, config: XferConfig) -> None:
        self._cfg = config
        self._lock = threading.Lock()
        self._alpha = config.ewma_alpha
        self._bw = config.bandwidth_prior_bps
        self._rtt = config.rtt_prior_s
        self._rtt_observed = False  # (the first fixed cost measured replaces the prior)
        self._prefill: float | None = None  # learned s/token
        self.pulls_observed = 0
        self.prefills_observed = 0

    # ---- learning

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self._alpha) * old + self._alpha * new

    def observe_pull(self, nbytes: int, seconds: float, rtt_s: float | None = None) -> None:
        """A finished pull of ``nbytes`` whose bytes moved in ``seconds`` and whose other
        steps (admission, look-ups, round trips, commit: its fixed cost) took ``rtt_s``."""
        if nbytes <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            bw = nbytes / seconds
            self._bw = bw if self.pulls_observed == 0 else self._ewma(self._bw, bw)
            if rtt_s is not None and rtt_s >= 0 and math.isfinite(rtt_s):
                self._rtt = rtt_s if not self._rtt_observed else self._ewma(self._rtt, rtt_s)
                self._rtt_observed = True
            self.pulls_observed += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled ``tokens`` tokens in ``seconds`` (feeds the recompute side
        when ``prefill_s_per_token`` is not configured)."""
        check_positive_int("tokens", tokens)
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        with self._lock:
            self._prefill = self._ewma(self._prefill, seconds / tokens)
            self.prefills_observed += 1

    # ---- estimates

    @property
    def bandwidth_bps(self) -> float:
        return self._bw

    @property
    def rtt_s(self) -> float:
        return self._rtt

    @property
    def prefill_s_per_token(self) -> float | None:
        cfg = self._cfg
        if cfg.prefill_s_per_token is not None:
            return cfg.prefill_s_per_token
        if self._prefill is not None:
            return self._prefill
        return cfg.prefill_prior_s_per_token

    def estimate(self, *, nbytes: int, tokens: int) -> CostEstimate:
        with self._lock:
            pull = self._rtt + nbytes / self._bw
        per_tok = self.prefill_s_per_token
        if per_tok is None:
            return CostEstimate(pull_s=pull, recompute_s=None, worth_it=True)
        recompute = tokens * per_tok
        return CostEstimate(pull_s=pull, recompute_s=recompute,
                            worth_it=pull * self._cfg.cost_margin < recompute)

    def check(self, *, blocks: int, nbytes: int, tokens: int) -> tuple[bool, str]:
        """``(worth_it, detail)`` for pulling ``blocks`` blocks (``nbytes``) instead of
        prefilling ``tokens`` tokens. Always worth it when the guard is off."""
        if blocks < self._cfg.min_blocks:
            return False, f"{blocks} missing block(s) < min_blocks {self._cfg.min_blocks}"
        if not self._cfg.cost_guard:
            return True, "cost guard off"
        est = self.estimate(nbytes=nbytes, tokens=tokens)
        return est.worth_it, est.describe()
