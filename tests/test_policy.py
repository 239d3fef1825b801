"""Unit tests of the pure parts of the puller: config validation, policies, the cost guard and
the outcome record."""

from __future__ import annotations

import json
import sys

import pytest

from kvkern.xfer.config import XferConfig
from kvkern.xfer.outcome import REASON_DOCS, PullOutcome, Reason, RequestState
from kvkern.xfer.policy import CostGuard, apply_policy

# ------------------------------------------------------------------------------- config


def test_config_defaults_are_safe():
    c = XferConfig()
    assert c.allowlist == ()  # fails closed
    assert c.metadata_timeout_s == 2.0 and c.transfer_timeout_s == 10.0 and c.deadline_s == 15.0
    assert c.default_policy == "strict" and c.cost_guard and c.dedup
    assert c.max_inflight_pulls == 4 and c.chunk_bytes == 16 << 20


@pytest.mark.parametrize("field,value", [
    ("metadata_timeout_s", 0), ("transfer_timeout_s", -1.0), ("deadline_s", float("inf")),
    ("deadline_s", float("nan")), ("max_inflight_pulls", 0), ("max_inflight_pulls", 1.5),
    ("chunk_bytes", True), ("default_policy", "yolo"), ("ewma_alpha", 0.0),
    ("prefill_s_per_token", -1e-3), ("default_state_port", 70000), ("state_path", "x"),
    ("dedup", 1), ("allowlist", ["bad*entry"]), ("allowlist", 42),
    ("read_min_run_bytes", -1), ("read_min_run_bytes", 1.5), ("read_min_run_bytes", True),
    ("state_max_stale_s", -1.0), ("state_max_stale_s", float("inf")),
    ("state_max_stale_s", False), ("state_max_stale_s", "60"),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError):
        XferConfig(**{field: value})


def test_config_timeout_above_cap_rejected_and_hint_values_clamped():
    with pytest.raises(ValueError, match="deadline_s 200.*max_deadline_s 120"):
        XferConfig(deadline_s=200)
    c = XferConfig()
    assert c.effective_timeouts() == (2.0, 10.0, 15.0)
    assert c.effective_timeouts(metadata_timeout_s=0.5, transfer_timeout_s=1e9,
                                deadline_s=-3) == (0.5, 60.0, 15.0)


def test_config_allowlist_specs_parsed_once():
    c = XferConfig(allowlist="127.0.0.1/32, 10.0.0.0/8:8000-8010")
    assert len(c.allowlist.entries) == 2
    assert XferConfig(allowlist=c.allowlist).allowlist is c.allowlist
    ep = c.replace(state_port_offset=100).endpoint_config()
    assert ep.state_port_offset == 100 and ep.dp_port_stride == 1


def test_import_config_stays_light():
    import subprocess

    code = ("import sys, kvkern.xfer.config, kvkern.xfer.policy, kvkern.xfer.outcome;"
            "bad=[m for m in ('torch','ucxx','aiohttp','prometheus_client') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------ policies


@pytest.mark.parametrize("policy,served,keep,reason", [
    ("strict", [6], 6, Reason.OK),
    ("strict", [6, 6], 6, Reason.OK),
    ("strict", [6, 4], 0, Reason.SOURCE_MISS),
    ("strict", [0], 0, Reason.SOURCE_MISS),
    ("best_effort", [6, 6], 6, Reason.OK),
    ("best_effort", [6, 4], 4, Reason.PARTIAL),
    ("best_effort", [3, 5, 4], 3, Reason.PARTIAL),
    ("best_effort", [6, 0], 0, Reason.SOURCE_MISS),
], ids=lambda v: str(v))
def test_apply_policy(policy, served, keep, reason):
    d = apply_policy(policy, 6, served)
    assert (d.keep, d.reason) == (keep, reason)
    assert d.keep + d.skipped == 6
    assert d.used == (keep > 0)


@pytest.mark.parametrize("args", [("nope", 3, [3]), ("strict", 0, [0]), ("strict", 3, []),
                                  ("strict", 3, [4]), ("best_effort", 3, [-1])])
def test_apply_policy_rejects_misuse(args):
    with pytest.raises(ValueError):
        apply_policy(*args)


# ------------------------------------------------------------------------------ cost guard


def test_cost_guard_unknown_prefill_cost_passes():
    g = CostGuard(XferConfig())
    ok, detail = g.check(blocks=10, nbytes=1 << 30, tokens=160)
    assert ok and "unknown" in detail


def test_cost_guard_configured_prefill():
    g = CostGuard(XferConfig(prefill_s_per_token=1e-4, bandwidth_prior_bps=1e9,
                             rtt_prior_s=1e-3))
    # 1 MiB: 1 ms + 1.05 ms vs 1000 tokens * 0.1 ms = 100 ms -> pull
    assert g.check(blocks=4, nbytes=1 << 20, tokens=1000)[0]
    # 1 GiB: ~1.07 s vs 0.1 s -> recompute
    ok, detail = g.check(blocks=4, nbytes=1 << 30, tokens=1000)
    assert not ok and "recompute 100.000 ms" in detail


def test_cost_guard_learns_from_observations():
    g = CostGuard(XferConfig(bandwidth_prior_bps=1e9, rtt_prior_s=1e-3, ewma_alpha=0.5))
    g.observe_prefill(1000, 0.1)  # 1e-4 s/token
    assert g.prefill_s_per_token == pytest.approx(1e-4)
    g.observe_prefill(1000, 0.3)
    assert g.prefill_s_per_token == pytest.approx(2e-4)
    g.observe_pull(1 << 20, 1.0, rtt_s=0.5)  # first measurement replaces the prior
    assert g.bandwidth_bps == pytest.approx(1 << 20) and g.rtt_s == 0.5
    g.observe_pull(3 << 20, 1.0, rtt_s=0.1)
    assert g.bandwidth_bps == pytest.approx(2 << 20) and g.rtt_s == pytest.approx(0.3)
    # 2 MiB at 2 MiB/s + 0.3 s = 1.3 s vs 1000 tokens * 2e-4 = 0.2 s
    assert not g.check(blocks=8, nbytes=2 << 20, tokens=1000)[0]
    g.observe_pull(0, 1.0)  # ignored
    g.observe_pull(10, 0.0)  # ignored
    assert g.pulls_observed == 2
    with pytest.raises(ValueError):
        g.observe_prefill(0, 1.0)
    with pytest.raises(ValueError):
        g.observe_prefill(10, float("nan"))


def test_cost_guard_configured_beats_learned_and_off_switch_and_min_blocks():
    g = CostGuard(XferConfig(prefill_s_per_token=1.0))
    g.observe_prefill(10, 1e-9)
    assert g.prefill_s_per_token == 1.0
    off = CostGuard(XferConfig(prefill_s_per_token=1e-12, cost_guard=False))
    assert off.check(blocks=1, nbytes=1 << 30, tokens=1)[0]
    mb = CostGuard(XferConfig(min_blocks=4, cost_guard=False))
    ok, detail = mb.check(blocks=3, nbytes=1, tokens=48)
    assert not ok and "min_blocks 4" in detail


# ------------------------------------------------------------------------------- outcome


def test_every_reason_documented_and_a_label():
    assert set(REASON_DOCS) == set(Reason)
    for r in Reason:
        assert r.value.replace("_", "").isalpha() and r.value.islower()


def test_outcome_log_line_and_consistency():
    o = PullOutcome(request_id="r1", used=True, reason="partial", policy="best_effort",
                    source="127.0.0.1:8000", blocks_hinted=8, blocks_local=2,
                    blocks_requested=6, blocks_transferred=4, blocks_skipped=2,
                    bytes_transferred=4096, phases={"total": 0.0123456789})
    line = o.to_log()
    assert "\n" not in line
    d = json.loads(line)
    assert d["event"] == "kvkern.pull" and d["reason"] == "partial" and d["used"] is True
    assert d["phases"]["total"] == pytest.approx(0.012346)
    assert o.total_s == pytest.approx(0.0123456789)
    with pytest.raises(ValueError):
        PullOutcome(request_id="r", used=True, reason=Reason.SOURCE_MISS)
    with pytest.raises(ValueError):
        PullOutcome(request_id="r", used=False, reason="not_a_reason")


def test_request_state_schedulable():
    assert RequestState.CONTEXT_INIT.schedulable
    assert RequestState.CONTEXT_PREFETCH_COMPLETE.schedulable
    assert not RequestState.CONTEXT_PREFETCH_INIT.schedulable
    assert not RequestState.CONTEXT_PREFETCH_IN_PROGRESS.schedulable


def test_source_caches_stay_bounded():
    from kvkern.xfer.discovery import bounded_put

    cache: dict = {}
    for i in range(10):
        bounded_put(cache, i, i, limit=4)
    assert list(cache) == [6, 7, 8, 9]
    bounded_put(cache, 7, "fresh", limit=4)  # re-insert becomes the newest
    assert list(cache) == [6, 8, 9, 7] and cache[7] == "fresh"
