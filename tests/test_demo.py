"""`kvkern demo` at a small size: the correctness check (pulled logits bit-identical to the
source's own continuation, tokens equal to a full prefill), its JSON contract, and the
source killed mid-pull with the request completing by recompute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvkern.tools.demo import DemoOptions, _crossover, run_kill_check

SMALL = ["--model", "tiny", "--prefix-tokens", "64", "--question-tokens", "6",
         "--new-tokens", "4", "--sweep", "8,32", "--repeats", "1"]


def test_demo_json_is_correct(tmp_path):
    """The whole CLI, as `make demo` runs it, at a small size: two processes, router,
    pull, checks; one JSON object on the last line."""
    plot = tmp_path / "demo.png"
    proc = subprocess.run([sys.executable, "-m", "kvkern", "demo", *SMALL, "--json",
                           "--plot", str(plot), "--dialect", "kv_hints"],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["correct"] is True and res["bit_identical"] is True
    assert res["tokens_equal"] is True and res["max_abs_diff_vs_recompute"] < 1e-3
    assert res["source"] != res["destination"]
    assert res["blocks_transferred"] == 64 // 4
    assert res["bytes_transferred"] == 16 * 2 * 2 * 2 * 4 * 16 * 4  # blocks*L*kv*H*T*D*fp32
    assert res["ttft_pull_s"] > 0 and res["ttft_recompute_s"] > 0
    assert "crossover_tokens" in res and "crossover_below" in res and res["fallbacks"] == {}
    assert res["hint_dialect"] == "kv_hints"
    assert all(r.get("repeats", 1) == 1 for r in res["sweep"])
    assert [r["prefix_tokens"] for r in res["sweep"]] == [8, 32, 64]
    assert all(r["tokens_equal"] for r in res["sweep"])
    if plot.exists():  # matplotlib is in the bench extra
        assert plot.stat().st_size > 1000
    assert "sweep:" in proc.stderr  # progress goes to stderr with --json
    assert "crossover: " in proc.stderr and "crossover: None" not in proc.stderr


def test_killing_the_source_mid_pull_completes_by_recompute():
    res = run_kill_check(DemoOptions(model="tiny", prefix_tokens=64, question_tokens=6,
                                     new_tokens=4), stall_s=30.0)
    assert res["send_in_flight_at_kill"], res
    assert res["ok"], res
    assert res["fallback"] in ("transfer_failed", "transfer_timeout", "deadline_exceeded")
    assert res["tokens"] == res["expected_tokens"]
    assert res["recovered_s"] < 15


@pytest.mark.parametrize("pairs, expect", [
    ([(16, 0.10, 0.05), (64, 0.20, 0.10)], (None, 16)),          # wins everywhere: below 16
    ([(16, 0.10, 0.20), (64, 0.20, 0.10)], (64, None)),          # loses at 16, wins at 64
    ([(16, 0.10, 0.20), (32, 0.2, 0.1), (64, 0.2, 0.3), (128, 0.4, 0.1)], (128, None)),
    ([(16, 0.10, 0.20), (64, 0.10, 0.30)], (None, None)),        # never
], ids=["below", "crosses", "wins-again-after-a-loss", "never"])
def test_crossover_is_a_measured_length(pairs, expect):
    rows = [{"prefix_tokens": n, "ttft_pull_s": pull, "ttft_recompute_s": rec,
             "fallback": None} for n, rec, pull in pairs]
    tokens, below, note = _crossover(rows)
    assert (tokens, below) == expect
    assert note.startswith(f"below {below} tokens" if below else
                           f"{tokens} tokens" if tokens else "none")
