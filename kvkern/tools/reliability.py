"""``python -m kvkern.reliability``: turn the reliability suite's results into ``RELIABILITY.md``.

The suite (``tests/reliability``) records one JSON file per case under
``tests/reliability/.results/`` (the fault matrix, the load runs, the hostile-input runs) and a
``run.json`` describing the run. This module reads them and writes a report: a summary, then a
table per section, the environment, the commit and the date.

Exit status: 0 when every recorded case passed with no leak, no corrupted block and no
internal error, and every section is present (with ``--require-slow``, the long profiles
too); 1 otherwise (the report is written either way, with the failures named); 2 when there
are no results at all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from kvkern.tools.provenance import git_state

__all__ = ["load_results", "main", "render"]

DEFAULT_RESULTS = Path("tests/reliability/.results")
DEFAULT_OUT = Path("RELIABILITY.md")
SECTIONS = ("faults", "load", "hostile", "zero_trust")
# record keys every section has; the zero-trust table shows the rest as the case's figures
_COMMON_KEYS = {"section", "case", "profile", "nodeid", "passed", "test_duration_s", "failure"}
SLOW_CASES = ("load/long_512x4", "hostile/hint_dialects_long", "hostile/state_responses_long",
              "hostile/control_messages_long", "hostile/kernel_ids_long")


def load_results(results: Path) -> tuple[dict, list[dict]]:
    run_file = results / "run.json"
    run = json.loads(run_file.read_text()) if run_file.exists() else {}
    records = []
    for f in sorted(results.glob("*.json")):
        if f.name != "run.json":
            records.append(json.loads(f.read_text()))
    return run, records


def environment() -> dict[str, str]:
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpus": str(os.cpu_count())}
    for mod in ("torch", "ucxx", "hypothesis", "aiohttp", "msgspec"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (report what is there)
            env[mod] = "not installed"
    git = git_state(length=12)
    env["commit"] = str(git["commit"]) + (" (working tree has uncommitted changes)"
                                          if git["dirty"] else "")
    return env


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in sorted(v.items(), key=lambda kv: str(kv[0])))
    return str(v)


def _count_of(v: Any) -> int:
    """A leak or error figure as one count: a number, or per-worker counts summed."""
    if isinstance(v, dict):
        return sum(_count_of(x) for x in v.values())
    return int(v or 0)


def _status(r: dict) -> str:
    return "PASS" if r.get("passed") else "**FAIL**"


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        out.append("| " + " | ".join(_fmt(c).replace("|", "/") for c in row) + " |")
    return out


def problems(records: list[dict], *, require_slow: bool) -> list[str]:
    """Why this run does not meet the bar (empty: it does)."""
    out = []
    by_section = {s: [r for r in records if r["section"] == s] for s in SECTIONS}
    for s, rs in by_section.items():
        if not rs:
            out.append(f"no {s} results")
    for r in records:
        name = f"{r['section']}/{r['case']}"
        if not r.get("passed"):
            out.append(f"{name} failed")
        for key in ("leaks", "leaks_dst", "leaks_src", "blocks_corrupted", "blocks_missing",
                    "internal_errors"):
            if _count_of(r.get(key)):
                out.append(f"{name}: {key} = {r[key]}")
        if r["section"] == "faults" and r.get("observed") != r.get("expected"):
            out.append(f"{name}: reason {r.get('observed')} != expected {r.get('expected')}")
    if require_slow:
        have = {f"{r['section']}/{r['case']}" for r in records}
        out += [f"{c} (long profile) missing" for c in SLOW_CASES if c not in have]
        for r in records:
            if r["section"] == "hostile" and r["case"].endswith("_long") \
                    and r.get("inputs_tried", 0) < 10_000:
                out.append(f"hostile/{r['case']}: {r.get('inputs_tried')} inputs < 10,000")
    return out


def render(run: dict, records: list[dict], env: dict[str, str], issues: list[str]) -> str:
    faults = [r for r in records if r["section"] == "faults"]
    load = [r for r in records if r["section"] == "load"]
    hostile = [r for r in records if r["section"] == "hostile"]
    zero_trust = [r for r in records if r["section"] == "zero_trust"]
    lines = _summary(run, records, env, issues, faults, load, hostile)
    lines += _faults_section(faults)
    lines += _load_section(load)
    lines += _hostile_section(hostile)
    lines += _zero_trust_section(zero_trust)
    if issues:
        lines += ["", "## Problems", ""] + [f"- {i}" for i in issues]
    return "\n".join(lines) + "\n"


def _summary(run: dict, records: list[dict], env: dict[str, str], issues: list[str],
             faults: list[dict], load: list[dict], hostile: list[dict]) -> list[str]:
    leaks = sum(_count_of(r.get("leaks")) + _count_of(r.get("leaks_dst"))
                + _count_of(r.get("leaks_src"))
                for r in records)
    survived = sum(1 for r in faults if r.get("passed") and r.get("observed") == r.get("expected"))
    inputs = sum(r.get("inputs_tried", 0) for r in hostile)
    verified = sum(r.get("blocks_verified", 0) + r.get("next_blocks_verified", 0)
                   for r in records)
    corrupted = sum(r.get("blocks_corrupted", 0) for r in load)
    held = sum(r.get("requests", 0) for r in load if r.get("passed"))
    lines = [
        "# kvkern reliability report",
        "",
        "Generated by `python -m kvkern.reliability` from the results of the reliability suite "
        "(`tests/reliability`): real worker processes on 127.0.0.1 for the fault matrix and the "
        "load, hypothesis for hostile input. Regenerate with `make reliability`.",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; suite run started {run.get('started', '?')}"
        f" (pytest `-m {run.get('markexpr')!r}`)" if run else "- date: " + time.strftime("%Y-%m-%d"),
        f"- commit: {env['commit']}",
        "- environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "commit"),
        "",
        "## Summary",
        "",
    ]
    lines += _table(["figure", "value"], [
        ["verdict", "PASS: nothing lost, nothing leaked" if not issues
         else "FAIL: " + "; ".join(issues[:10])],
        ["faults survived", f"{survived} of {len(faults)} cases (right reason, within bound, "
                            "both pools at baseline, next request served)"],
        ["load held", f"{held} hinted requests in {len(load)} run(s), every one answered with "
                      "an allowed reason"],
        ["blocks verified by checksum against the source", verified],
        ["corrupted blocks", corrupted],
        ["hostile inputs tried", inputs],
        ["leaks found (blocks, pins, leases, private blocks, sends, pulls)", leaks],
    ])
    return lines


def _faults_section(faults: list[dict]) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Fault matrix", "",
              "Destination D1 and sources are real `kvkern worker` processes (plus test routes, "
              "`tests/reliability/peers/fault_worker.py`). Hint bounds unless stated: metadata "
              "1 s, transfer 2 s, deadline 3 s. *Fallback* is the puller's measured time from "
              "submit to outcome; *bound* is the wait the fault exhausts. *Same as no hint*: "
              "tokens and logits bits equal a cold recompute. *Leaks*: nonzero leak counters "
              "after the case on the destination / source (– : the source was killed). *Next*: "
              "the following hinted pull from the living source succeeded and its blocks "
              "matched the source's by sha256.", ""]
    lines += _table(
        ["case", "fault", "expected", "observed", "fallback s", "bound s", "same as no hint",
         "leaks dst/src", "next", "result"],
        [[r["case"], r.get("what"), r.get("expected"), r.get("observed"), r.get("fallback_s"),
          r.get("bound_s"), r.get("same_as_no_hint", "partial kept (verified)"
                                  if r.get("observed") == "partial" else None),
          f"{_fmt(r.get('leaks_dst'))}/{_fmt(r.get('leaks_src'))}", r.get("next_pull"),
          _status(r)] for r in faults])
    return lines


def _load_section(load: list[dict]) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Load", "",
              "One source, four destination processes (trtllm, vllm_flash, vllm_nhd, trtllm "
              "pools), random shared prefixes, all four hint dialects. Latency is the client's "
              "request time (pull + prefill + 2 decode steps); pull is the puller's time for "
              "network pulls. Every pulled block is compared with the source's by sha256.", ""]
    lines += _table(
        ["case", "requests", "in flight", "wall s", "req/s", "pulls", "blocks pulled",
         "verified / corrupted / missing", "MB/s pulled", "latency p50/p90/p99 s",
         "pull p50/p90/p99 s", "reasons", "outputs", "leaks", "result"],
        [[r["case"], r.get("requests"), r.get("concurrency"), r.get("wall_s"),
          r.get("requests_per_s"), r.get("pulls"), r.get("blocks_pulled"),
          f"{r.get('blocks_verified')} / {r.get('blocks_corrupted')} / "
          f"{r.get('blocks_missing')}", r.get("pulled_mb_per_s"),
          "/".join(_fmt(r.get("latency_s", {}).get(q)) for q in ("p50", "p90", "p99")),
          "/".join(_fmt(r.get("pull_s", {}).get(q)) for q in ("p50", "p90", "p99")),
          r.get("reasons"), r.get("outputs"), r.get("leaks"), _status(r)] for r in load])
    return lines


def _hostile_section(hostile: list[dict]) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Hostile input", "",
              "Hypothesis profiles: quick (default `make test`) and long (`-m slow`, >= 10,000 "
              "examples per target). *Inputs* counts every input fed (the hint fuzz feeds a "
              "dict body and a raw body per example). *Outcomes*: reasons, refusal codes or "
              "accept/refuse counts seen.", ""]
    lines += _table(
        ["case", "target", "profile", "inputs", "seconds", "outcomes", "internal errors",
         "leaks", "result"],
        [[r["case"], r.get("target"), r.get("profile"), r.get("inputs_tried"), r.get("seconds"),
          r.get("reasons"), r.get("internal_errors", 0), r.get("leaks"), _status(r)]
         for r in hostile])
    return lines


def _zero_trust_section(zero_trust: list[dict]) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Hostile peers and tenants", "",
              "Real `kvkern worker` processes on 127.0.0.1 attacked as an outsider, a greedy or "
              "malicious fleet member, and a hostile tenant would (`tests/reliability/"
              "test_zero_trust.py`; threat model in SECURITY.md). *Figures* are what the case "
              "measured: status codes, bytes or keys obtained, pins and memory before and "
              "after, fallback reasons.", ""]
    lines += _table(
        ["case", "figures", "seconds", "result"],
        [[r["case"], {k: v for k, v in r.items() if k not in _COMMON_KEYS},
          r.get("test_duration_s"), _status(r)] for r in zero_trust])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvkern.reliability", description=__doc__
                                 .splitlines()[0])
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--require-slow", action="store_true",
                    help="fail unless the long profiles (load, >= 10,000 fuzz examples) ran")
    args = ap.parse_args(argv)
    run, records = load_results(args.results)
    if not records:
        print(f"no results under {args.results}; run the suite first "
              "(pytest -m '' tests/reliability)", file=sys.stderr)
        return 2
    issues = problems(records, require_slow=args.require_slow)
    args.out.write_text(render(run, records, environment(), issues))
    print(f"wrote {args.out}: {len(records)} cases, "
          + ("all passed" if not issues else f"{len(issues)} problem(s)"))
    for i in issues:
        print(f"  {i}", file=sys.stderr)
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
