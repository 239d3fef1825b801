"""bench/RESULTS.md is generated from the run records under bench/results/ (never edited by
hand), and a record as `kvkern bench xfer --json` prints it goes into the tables as is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_md_is_what_the_records_give():
    report = _report()
    assert (ROOT / "bench" / "RESULTS.md").read_text() == report.render(report.load()), \
        "bench/RESULTS.md differs from its records: run `make results`"


def test_summaries_are_median_and_range():
    report = _report()
    assert report.summarize([1.0, 3.0, 2.0]) == "2.00 [1.00-3.00] (3)"
    assert report.summarize([1.5]) == "1.50"
    assert report.summarize([]) == "-"


def test_a_bench_xfer_json_record_is_read_as_printed(tmp_path):
    """The headline object of `kvkern bench xfer --json` (scalars per size, env with its
    commit), dropped into results/xfer, shows in the layout's table."""
    report = _report()
    (tmp_path / "xfer").mkdir()
    native = {"bench": "xfer", "bytes": 64 << 20, "ratio": 1.3,
              "by_size": {str(64 << 20): {"ratio": 1.3, "raw_gbps": 5.0, "lanes1_ratio": 0.9,
                                          "stream_ratio": 0.8, "into_ratio": 1.1,
                                          "into_ucx_ratio": 1.05}},
              "env": {"commit": "abc1234", "cpus": 8, "python": "3.11.7"}}
    (tmp_path / "xfer" / "run.json").write_text(json.dumps(native))
    text = report.render(report.load(tmp_path))
    assert "### Pool layout `trtllm` (1 run, 1 record)" in text
    assert "| 64 MiB | 1.30 | - | - | - | 0.90 | - | 0.80 | - | 1.10 | 1.05 | - | 5.00-5.00 |" \
        in text
    assert "`run.json` (commit abc1234, 1 run)" in text
    assert "No GPU run is recorded." in text and "cpus 8" in text


# a direct read's steps at 16 MiB, ms
PHASES_16MIB = {"queue": 0.2, "metadata": 0.01, "plan": 0.06, "allocate": 0.03, "handoff": 0.25,
                "lookup": 0.3, "data": 1.5, "confirm": 0.15, "validate": 0.01, "commit": 0.04,
                "rest": 0.05, "total": 2.6, "direct": 2.2}


def test_a_pulls_steps_show_beside_nixl(tmp_path):
    """A record whose pull has its direct-read steps (``rest`` among them) gets a row of
    where the time went, beside NIXL's faster way from the same run."""
    report = _report()
    (tmp_path / "xfer").mkdir()
    size = str(16 << 20)
    phases = PHASES_16MIB
    rec = {"bench": "xfer", "by_size": {}, "env": {"commit": "abc1234"},
           "cases": {"pull": {size: {"phases_ms": phases, "bytes": 16 << 20, "raw_ms": 4.0,
                                     "stream_scattered_pack_ms": 3.5,
                                     "stream_scattered_pack_gbps": 4.79,
                                     "stream_scattered_pull_gbps": 2.097152}}},
           "compare": {"nixl": {"cases": {size: {
               way: {"ms": ms, "gbps": 9.0, "gbps_range": [8.0, 10.0]}
               for way, ms in (("consecutive", 1.9), ("consecutive_per_request", 1.8),
                               ("scattered", 2.0), ("scattered_per_request", 2.1))}}}}}
    (tmp_path / "xfer" / "run.json").write_text(json.dumps(rec))
    text = report.render(report.load(tmp_path))
    assert "## Where a pull's time goes" in text
    assert ("| 16 MiB | 1.80 | 2.60 | 1.50 | 0.20 | 0.10 | 0.25 | 0.30 | 0.15 | 0.05 "
            "| 0.05 |") in text
    # a scattered stream's pack at the source, beside the raw send and the whole pull
    assert "| 16 MiB | 4.00 | 3.50 (4.79) | 8.00 |" in text


def test_nixl_interleaved_with_the_pulls_is_shown_and_used(tmp_path):
    """A record whose pull case interleaved NIXL's READs shows them in a table of their own,
    with kvkern / NIXL against the faster of NIXL's two ways, and its step table sets the
    pull beside those READs rather than NIXL's own later run."""
    report = _report()
    (tmp_path / "xfer").mkdir()
    size = str(64 << 20)
    phases = {**PHASES_16MIB, "handoff": 0.4, "lookup": 0.5, "data": 4.5, "confirm": 0.3,
              "commit": 0.14, "rest": 0.1, "total": 6.25, "direct": 5.7}

    def way(ms: float) -> dict:
        return {"ms": ms, "gbps": round(67.108864 / ms, 3), "gbps_range": [9.0, 11.0]}

    rec = {"bench": "xfer", "by_size": {}, "env": {"commit": "abc1234"},
           "cases": {"pull": {size: {
               "phases_ms": phases, "bytes": 64 << 20, "pull_gbps": 10.7,
               "scattered_pull_gbps": 9.5,
               "nixl": {"consecutive": way(6.0), "consecutive_per_request": way(6.5),
                        "scattered": way(7.0), "scattered_per_request": way(7.2)},
               "kvkern_vs_nixl": 0.96, "kvkern_vs_nixl_per_request": 1.04,
               "kvkern_vs_nixl_scattered": 0.99,
               "kvkern_vs_nixl_per_request_scattered": 1.02}}},
           "compare": {"nixl": {"agents": ["lean"], "cases": {size: {
               k: way(9.0) for k in ("consecutive", "consecutive_per_request", "scattered",
                                     "scattered_per_request")}}}}}
    (tmp_path / "xfer" / "run.json").write_text(json.dumps(rec))
    text = report.render(report.load(tmp_path))
    assert ("| 64 MiB | 11.19 [9.00-11.00] | 10.32 [9.00-11.00] | 9.59 [9.00-11.00] "
            "| 9.32 [9.00-11.00] | 10.70 | 9.50 | 0.96 | 0.99 |") in text
    assert "| 64 MiB | 6.00 | 6.25 | 4.50 |" in text  # the interleaved READ, not 9.00


def test_a_first_pull_is_shown(tmp_path):
    """A record's first pull (``cases.pull.first_pull``) gets a row: the whole pull, its state
    fetch, look-up and copy, and all but the copy."""
    report = _report()
    (tmp_path / "xfer").mkdir()
    rec = {"bench": "xfer", "by_size": {}, "env": {"commit": "abc1234"},
           "cases": {"pull": {"first_pull": {"blocks": 512, "total_ms": 31.5, "phases_ms": {
               "metadata": 6.0, "lookup": 3.75, "data": 18.0, "total": 31.5}}}}}
    (tmp_path / "xfer" / "run.json").write_text(json.dumps(rec))
    text = report.render(report.load(tmp_path))
    assert "| `run.json` | 512 | 31.50 | 6.00 | 3.75 | 18.00 | 13.50 |" in text


def test_a_run_under_an_engine_load_stands_apart(tmp_path):
    """A run under ``--engine-load`` gets a table of its own, named by its load, and never
    enters the idle runs' ranges."""
    report = _report()
    (tmp_path / "xfer").mkdir()

    def rec(ratio: float, load: dict | None) -> dict:
        env = {"commit": "abc1234", "cpus": 2}
        if load:
            env["engine_load"] = load
        return {"bench": "xfer", "bytes": 64 << 20, "ratio": ratio,
                "by_size": {str(64 << 20): {"ratio": ratio, "raw_gbps": 5.0}}, "env": env}

    (tmp_path / "xfer" / "idle.json").write_text(json.dumps(rec(1.3, None)))
    (tmp_path / "xfer" / "busy.json").write_text(json.dumps(
        rec(0.4, {"fraction": 0.5, "busy": 0.55})))
    text = report.render(report.load(tmp_path))
    idle = text.index("### Pool layout `trtllm` (1 run, 1 record)")
    busy = text.index("### Pool layout `trtllm`, under an engine load of 0.5 (1 run, 1 record)")
    assert idle < busy
    assert "| 64 MiB | 1.30 |" in text[idle:busy] and "0.40" not in text[idle:busy]
    assert "| 64 MiB | 0.40 |" in text[busy:]


def test_a_vllm_record_shows_the_read_pull_where_it_has_one(tmp_path):
    """``make bench-vllm`` records: a streamed pull and recomputation per prefix, and where
    the record has them the pulls read into vLLM's blocks too, with every crossover."""
    report = _report()
    (tmp_path / "vllm").mkdir()
    row = {"prefix_tokens": 2048, "kv_mib": 16.0, "pull_s": 0.2, "recompute_s": 1.0}
    old = {"rows": [row], "crossover_tokens": 2048, "env": {"commit": "abc1234"}}
    new = {"rows": [dict(row, read_s=0.1)], "crossover_tokens": 2048,
           "read_crossover_tokens": 512, "env": {"commit": "def5678"}}
    ucx = {"rows": [dict(row, read_s=0.1, ucx_s=0.125)], "crossover_tokens": 2048,
           "read_crossover_tokens": 512, "ucx_crossover_tokens": 1024,
           "env": {"commit": "0a1b2c3"}}
    (tmp_path / "vllm" / "a.json").write_text(json.dumps(old))
    (tmp_path / "vllm" / "b.json").write_text(json.dumps(new))
    (tmp_path / "vllm" / "c.json").write_text(json.dumps(ucx))
    text = report.render(report.load(tmp_path))
    assert "| 2048 | 16.0 | 0.200 | 1.000 | 5.0 |" in text
    assert "Crossover: 2048 tokens." in text
    assert "| 2048 | 16.0 | 0.200 | 0.100 | 1.000 | 5.0 | 10.0 |" in text
    assert "Crossover: 2048 tokens streamed, 512 read." in text
    # and read through UCX, as from another host, where the record has that too
    assert "| read (s) | read through UCX (s) | TTFT recomputing (s) |" in text
    assert "| 2048 | 16.0 | 0.200 | 0.100 | 0.125 | 1.000 | 5.0 | 10.0 | 8.0 |" in text
    assert "Crossover: 2048 tokens streamed, 512 read, 1024 through UCX." in text
