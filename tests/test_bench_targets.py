"""The performance targets judged on one ``kvkern bench xfer`` result: which reshards a run
adds, one verdict per target and place, nothing met by default, and the report's table."""

from __future__ import annotations

import json

import pytest

from kvkern.tools import benchtargets
from tests.test_results_report import _report


def test_reshards_default_to_all_with_a_comparison_only():
    assert benchtargets.parse_reshards(None, compare=True) == tuple(benchtargets.RESHARDS)
    assert benchtargets.parse_reshards(None, compare=False) == ()
    assert benchtargets.parse_reshards("none", compare=True) == ()
    assert benchtargets.parse_reshards("TP2:1, pp1:2,tp2:1", compare=False) == ("tp2:1",
                                                                               "pp1:2")
    for bad in ("tp3:1", "", ",", "all,none"):
        with pytest.raises(ValueError, match="unknown reshards"):
            benchtargets.parse_reshards(bad, compare=False)


MiB64 = str(64 << 20)
MiB16 = str(16 << 20)


def _result() -> dict:
    return {
        "cases": {"pull": {MiB16: {"stream_ratio": 0.95, "stream_scattered_ratio": 0.4,
                                   "overhead_ms": 1.04},
                           MiB64: {"stream_ratio": 0.85},
                           "hint_to_first_byte_ms": 0.45, "one_block_overhead_ms": 0.51}},
        "compare": {"nixl": {"cases": {MiB64: {
            "kvkern_vs_nixl": 1.0, "kvkern_vs_nixl_scattered": 0.99,
            "kvkern_vs_nixl_per_request_scattered": 1.2,  # NIXL slower per request here
            "consecutive": {"gbps": 9.0, "gbps_range": [8.0, 10.0]},
            "scattered": {"gbps": 9.1, "gbps_range": [8.1, 10.1]}}}}},
        "reshards": {"tp2:1": {"cases": {"pull": {MiB64: {"ratio": 0.7},
                                                  "tp": "2:1"}}},
                     "pp1:2": {"error": "RuntimeError: peer died"}},
    }


def test_every_measured_place_gets_a_verdict_from_its_own_figure():
    got = {(v["target"], v["where"]): (v["value"], v["met"])
           for v in benchtargets.evaluate(_result())}
    assert got == {
        ("kvkern_vs_nixl", "64 MiB (NIXL's own run)"): (1.0, True),  # the bound itself is met
        ("kvkern_vs_nixl_scattered", "64 MiB (NIXL's own run)"): (0.99, False),  # NIXL's faster
        ("hint_to_first_byte_ms", "1 block"): (0.45, True),
        ("one_block_overhead_ms", "1 block"): (0.51, False),
        ("pull_overhead_ms", "16 MiB"): (1.04, False),  # every size's, not one block's alone
        ("stream_ratio", "16 MiB"): (0.95, True),
        ("stream_scattered_ratio", "16 MiB"): (0.4, False),
        ("stream_ratio", "64 MiB"): (0.85, False),
        ("reshard_vs_raw", "TP 2:1, 64 MiB"): (0.7, False),
    }  # nothing for what was not measured (64 MiB scattered stream, the failed reshard)


def test_a_targets_run_names_every_place_it_did_not_measure_as_not_met():
    """A targets run (``--compare``) that lacks a figure (a size not run, a reshard that
    failed, NIXL gone) does not pass by leaving the place out: each such place is a verdict,
    not met, with no value."""
    full = benchtargets.evaluate(_result(), complete=True)
    assert benchtargets.evaluate(_result()) == full[:len(benchtargets.evaluate(_result()))]
    missing = {(v["target"], v["where"]) for v in full if v.get("measured") is False}
    assert all(v["value"] is None and not v["met"] for v in full if v.get("measured") is False)
    assert ("reshard_vs_raw", "PP 1:2, 64 MiB") in missing  # its run failed
    assert ("kvkern_vs_nixl", "16 MiB") in missing and ("stream_ratio", "256 MiB") in missing
    assert ("stream_scattered_ratio", "64 MiB") in missing
    assert ("kvkern_vs_nixl", "64 MiB") not in missing  # NIXL's own run's figure counts
    assert ("stream_ratio", "64 MiB") not in missing and ("hint_to_first_byte_ms",
                                                          "1 block") not in missing
    # 2 one-block places and 5 + 4 reshards per size, less the 9 measured
    assert len(full) == 2 + 3 * (5 + len(benchtargets.RESHARDS))
    assert "    none  (want >= 0.9)" in "\n".join(benchtargets.format_lines(full))


def test_nixl_is_judged_by_its_faster_way():
    res = {"compare": {"nixl": {"cases": {MiB64: {"kvkern_vs_nixl": 1.1,
                                                  "kvkern_vs_nixl_per_request": 0.97}}}}}
    (v,) = benchtargets.evaluate(res)
    assert (v["target"], v["value"], v["met"]) == ("kvkern_vs_nixl", 0.97, False)


def test_nixl_interleaved_with_the_pulls_is_the_figure_judged():
    """Where the pull case interleaved NIXL's READs with its pulls, those ratios are judged
    (same conditions), not those of NIXL's own later run; a size only the later run has is
    still judged on it."""
    res = {"cases": {"pull": {MiB64: {"nixl": {}, "kvkern_vs_nixl": 0.93,
                                      "kvkern_vs_nixl_per_request": 0.95,
                                      "kvkern_vs_nixl_scattered": 1.04},
                              MiB16: {"stream_ratio": None}}},
           "compare": {"nixl": {"cases": {MiB64: {"kvkern_vs_nixl": 1.2,
                                                  "kvkern_vs_nixl_scattered": 1.3},
                                          MiB16: {"kvkern_vs_nixl": 0.6}}}}}
    got = {(v["target"], v["where"]): v["value"] for v in benchtargets.evaluate(res)}
    assert got == {("kvkern_vs_nixl", "16 MiB (NIXL's own run)"): 0.6,
                   ("kvkern_vs_nixl", "64 MiB"): 0.93, ("kvkern_vs_nixl_scattered", "64 MiB"): 1.04}


def test_nothing_measured_means_no_verdict():
    assert benchtargets.evaluate({}) == []
    assert benchtargets.evaluate({"cases": {"pull": {MiB64: {"stream_ratio": None}}}}) == []


def test_a_failed_reshard_run_is_recorded_and_the_next_runs():
    seen = []

    def run(s):
        seen.append((s.pull_tp, s.pull_pp, s.cases, s.all_variants))
        if s.pull_tp == (2, 1):
            raise RuntimeError("bench peer exited with 1 before listening")
        return {"cases": {"pull": {}}, "env": {"commit": "x"}}

    from kvkern.tools.benchcli import Settings

    out = benchtargets.run_reshards(Settings(), ("tp2:1", "pp1:2"), run)
    assert out["tp2:1"] == {"error": "RuntimeError: bench peer exited with 1 before listening"}
    assert out["pp1:2"] == {"cases": {"pull": {}}}  # the main run holds the environment
    assert seen == [((2, 1), (1, 1), ("raw", "pull"), False),
                    ((1, 1), (1, 2), ("raw", "pull"), False)]


def test_the_report_shows_the_targets_and_the_reshard_runs(tmp_path):
    report = _report()
    (tmp_path / "xfer").mkdir()
    rec = _result()
    rec["reshards"]["tp2:1"]["by_size"] = {MiB64: {"ratio": 0.7, "raw_gbps": 6.0}}
    rec |= {"by_size": {}, "env": {"commit": "abc1234"},
            "targets": benchtargets.evaluate(rec, complete=True)}
    (tmp_path / "xfer" / "run.json").write_text(json.dumps(rec))
    text = report.render(report.load(tmp_path))
    assert f"Record `run.json` (commit abc1234): 3 of {len(rec['targets'])} met." in text
    assert "| stream / raw send, scattered blocks | 256 MiB | not measured | >= 0.8 | no |" \
        in text
    assert ("| a reshard's pull / raw send of its bytes | TP 2:1, 64 MiB | 0.700 | >= 0.9 "
            "| no |") in text
    assert "### Reshard TP 2 → 1, pool layout `trtllm` (1 run, 1 record)" in text
    assert "`run.json (tp2:1)` (commit abc1234, 1 run)" in text
