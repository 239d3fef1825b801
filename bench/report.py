"""Write ``bench/RESULTS.md`` (and a plot) from the run records under ``bench/results/``.

Run ``make results`` (or ``python bench/report.py``) after adding a record; never edit
``RESULTS.md`` by hand (``tests/test_results_report.py`` fails when it differs from what this
script writes).

Records, one JSON object per file:

``bench/results/xfer/*.json``
    ``kvkern bench xfer --json | tail -1 > bench/results/xfer/NAME.json`` as it is: its
    ``by_size`` maps a byte count to the run's figures (``ratio``, ``scattered_ratio``,
    ``lanes1_ratio``, ``ucx_ratio``, ``stream_ratio``, ``stream_scattered_ratio``,
    ``into_ratio``, ``into_ucx_ratio``, ``into_stream_ratio``, ``raw_gbps``, ...) and ``env``
    holds its environment (``commit``, ``cpus``, versions).
    Add ``"pull_layout"`` when the run used ``--pull-layout`` (default ``trtllm``); a TP or
    PP reshard (``--pull-tp``, ``--pull-pp``) is read from ``cases.pull``. A record
    of several runs has a list of values per figure and ``"runs": N``; ``raw_gbps_range``
    is a ``[low, high]`` pair where only the range was kept. A run with ``--reshards``
    holds each reshard's run under ``reshards`` (shown with the reshard records) and a run
    of ``--compare nixl`` its ``targets`` (``kvkern/tools/benchtargets.py``).
``bench/results/cpu_kernels/*.json``
    ``make bench`` writes one to ``bench/out/cpu_kernels.json``: ``cases`` maps a case to
    GB/s of ``pack``, ``unpack``, ``per_block_loop`` and ``contiguous_copy``; ``env`` its
    environment.
``bench/results/vllm/*.json``
    ``make bench-vllm`` (``bench/vllm_ttft.py``) writes one: ``rows`` of ``prefix_tokens``,
    ``kv_mib``, ``pull_s`` and ``recompute_s`` (medians of TTFT with a pull and with the whole
    prompt recomputed, in the same run), ``read_s`` and ``ucx_s`` (read pulls, where
    measured), ``crossover_tokens``, ``model`` and ``env``.
``bench/results/kernel_aot.json``
    ``python -m kvkern.kernels.aot`` (ahead-of-time compile facts, no GPU needed).
``bench/results/gpu/*.json``
    ``bash bench/run_device.sh`` step files (``summary.json``, ``targets.json``, ...) of a
    GPU run, copied from its ``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
PLOT = "results/xfer_ratio.png"  # relative to bench/

XFER_METRICS = (("ratio", "`ratio` (2 lanes)"), ("copy_ratio", "copy alone"),
                ("scattered_ratio", "scattered"),
                ("granted_ratio", "granted"), ("lanes1_ratio", "one lane"),
                ("ucx_ratio", "through UCX"),
                ("stream_ratio", "stream"), ("stream_scattered_ratio", "stream scattered"),
                ("into_ratio", "into engine blocks"),
                ("into_ucx_ratio", "into engine blocks, through UCX"),
                ("into_stream_ratio", "into engine blocks, streamed"))


def _values(v: Any) -> list[float]:
    if v is None:
        return []
    return [float(x) for x in (v if isinstance(v, list) else [v])]


def _size(nbytes: str | int) -> str:
    n = int(nbytes)
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} B"


def _fmt(x: float) -> str:
    return f"{x:.2f}"


def summarize(values: list[float]) -> str:
    """``median [min-max] (n)``, or the one value."""
    if not values:
        return "-"
    if len(values) == 1:
        return _fmt(values[0])
    return (f"{_fmt(statistics.median(values))} [{_fmt(min(values))}-{_fmt(max(values))}] "
            f"({len(values)})")


def load(results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    def read_all(sub: str) -> list[tuple[str, dict]]:
        return [(p.name, json.loads(p.read_text()))
                for p in sorted((results_dir / sub).glob("*.json"))]

    aot = results_dir / "kernel_aot.json"
    return {"xfer": _with_reshards(read_all("xfer")), "cpu_kernels": read_all("cpu_kernels"),
            "vllm": read_all("vllm"),
            "gpu": read_all("gpu"), "kernel_aot": json.loads(aot.read_text())
            if aot.exists() else None}


def _with_reshards(records: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Each record, then the reshard runs it holds (``--reshards``) as records of their own,
    named ``NAME (tp2:1)``, with the record's environment."""
    out = []
    for name, rec in records:
        out.append((name, rec))
        for key, sub in rec.get("reshards", {}).items():
            if "cases" in sub:
                out.append((f"{name} ({key})", {**sub, "env": rec.get("env", {})}))
    return out


def _figure(rec: dict, size: int, key: str) -> Any:
    """A record's figure ``key`` at ``size``: from its ``by_size``, else from the pull case's
    own row of the same run (a figure ``by_size`` does not copy)."""
    row = rec["by_size"].get(str(size), {})
    if key in row:
        return row[key]
    pull = rec.get("cases", {}).get("pull", {})
    return pull.get(str(size), {}).get(key) if isinstance(pull, dict) else None


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _commit(rec: dict) -> str:
    commit = str(rec.get("commit") or rec.get("env", {}).get("commit") or "unknown")
    return commit + (" with uncommitted changes" if rec.get("env", {}).get("dirty") else "")


def _load(rec: dict) -> float:
    """The engine load the run ran under (``kvkern bench xfer --engine-load``), 0 when none."""
    return float((rec.get("env", {}).get("engine_load") or {}).get("fraction", 0.0))


def _record(name: str, rec: dict) -> str:
    """A record's name and commit, and the engine load it ran under, if any."""
    load = rec.get("env", {}).get("engine_load")
    return f"Record `{name}` (commit {_commit(rec)}" + (
        f"; under an engine load of {load['fraction']} in every process, the pulling "
        f"process's load thread computing {load['busy']} of the time" if load else "") + ")"


def _env_line(env: dict) -> str:
    return "; ".join(f"{k} {v}" for k, v in env.items() if not isinstance(v, dict))


def _xfer_section(records: list[tuple[str, dict]]) -> list[str]:
    out = ["## Pull vs raw UCXX (`kvkern bench xfer`)", "",
           "A pull of N blocks through the real source service and puller between two "
           "processes on one host, against a raw UCXX send of one buffer of the same bytes "
           "between the same processes, in the same repeats. `ratio` is pull / raw bytes per "
           "second (median of the run's repeats): above 1 the pull beats the single raw copy, "
           "because reads on two lanes copy in parallel. `copy alone` is the same bytes over the "
           "median of the headline pulls' copy phase alone (no look-up, confirmation or "
           "hand-off), against the same raw send. `one lane`, `connection` (reads on the "
           "control connection's worker), `granted` (every read asks the source first: a round "
           "trip and pins, where the headline reads directly, confirmed by the source's read "
           "directory), `through UCX` (the source's process on this host read through UCX's "
           "CMA transport rather than with kvkern's own system calls, as a source on another "
           "host is read) and `stream` (pack, send, unpack) are the same pull "
           "by other paths in the same runs (`-`: not measured by that record); "
           "`scattered` reads from a source whose blocks are "
           "shuffled in its pool. Cells are median [min-max] (runs) over the records. "
           "Records with a `granted` figure read directly in `ratio`, `scattered` and `one "
           "lane`; the older ones asked for a grant there.", ""]
    if not records:
        return out + ["No run is recorded.", ""]
    by_kind: dict[tuple[str, str, str, float], list[tuple[str, dict]]] = {}
    for name, rec in records:
        by_kind.setdefault(_pull_kind(rec), []).append((name, rec))
    for kind in sorted(by_kind, key=lambda k: (k[3], k[1:3] != ("1:1", "1:1"),
                                               k[0] != "trtllm", k)):
        recs = by_kind[kind]
        layout, tp, pp, load = kind
        runs = sum(int(r.get("runs", 1)) for _, r in recs)
        sizes = sorted({int(s) for _, r in recs for s in r.get("by_size", {})})
        reshard = ", ".join(f"{what} {split.replace(':', ' → ')}" for what, split
                            in (("TP", tp), ("PP", pp)) if split != "1:1")
        title = f"Reshard {reshard}, pool layout" if reshard else "Pool layout"
        under = f", under an engine load of {load}" if load else ""
        out += [f"### {title} `{layout}`{under} ({_count(runs, 'run')}, "
                f"{_count(len(recs), 'record')})", "",
                "| size | " + " | ".join(label for _, label in XFER_METRICS) + " | raw GB/s |",
                "|---|" + "---|" * (len(XFER_METRICS) + 1)]
        for size in sizes:
            cells = []
            for key, _ in XFER_METRICS:
                vals = [v for _, r in recs for v in _values(_figure(r, size, key))]
                cells.append(summarize(vals))
            raw = [v for _, r in recs for k in ("raw_gbps", "raw_gbps_range")
                   for v in _values(r["by_size"].get(str(size), {}).get(k))]
            raw_cell = f"{_fmt(min(raw))}-{_fmt(max(raw))}" if raw else "-"
            out.append(f"| {_size(size)} | " + " | ".join(cells) + f" | {raw_cell} |")
        out.append("")
        out.append("Records: " + ", ".join(
            f"`{name}` (commit {_commit(r)}, {_count(int(r.get('runs', 1)), 'run')})"
            for name, r in recs) + ".")
        out.append("")
    envs = {json.dumps(r.get("env", {}), sort_keys=True) for _, r in records}
    out += ["Environment" + ("s" if len(envs) > 1 else "") + ":", ""]
    out += [f"- {_env_line(json.loads(e))}" for e in sorted(envs)]
    notes = [(name, r["note"]) for name, r in records if r.get("note")]
    if notes:
        out += ["", "Notes:", ""] + [f"- `{name}`: {note}" for name, note in notes]
    out += _one_block_lines([(n, r) for n, r in records
                             if _pull_kind(r)[1:] == ("1:1", "1:1", 0.0)])
    out += _first_pull_lines([(n, r) for n, r in records
                              if _pull_kind(r)[1:] == ("1:1", "1:1", 0.0)])
    out += _past_ttl_lines(records)
    out += ["", f"![pull / raw per run]({PLOT})", ""]
    return out


def _pull_kind(rec: dict) -> tuple[str, str, str, float]:
    """A record's pool layout, its TP and PP ``source:destination`` sizes (the TP one naming
    the destination's rank when the run hosted one rank of several) and its engine load."""
    pull = rec.get("cases", {}).get("pull", {})
    tp = pull.get("tp", "1:1")
    if pull.get("one_rank"):  # --pull-one-rank
        tp += f", destination rank {pull['ranks'][0]} alone"
    return (rec.get("pull_layout", pull.get("layout", "trtllm")), tp, pull.get("pp", "1:1"),
            _load(rec))


def _one_block_lines(records: list[tuple[str, dict]]) -> list[str]:
    """One-block pulls on a warm connection: per record that measured both, the direct and the
    granted path; the older records' hint-to-first-byte range (granted reads) after them."""
    rows, older = [], []
    for name, r in records:
        pull = r.get("cases", {}).get("pull", {})
        granted = pull.get("granted")
        if isinstance(granted, dict) and "one_block_overhead_ms" in granted \
                and "one_block_overhead_ms" in pull:
            thread = pull.get("lane_thread") or {}
            rows.append(f"| `{name}` | {_fmt(pull['hint_to_first_byte_ms'])} | "
                        f"{_fmt(pull['one_block_overhead_ms'])} | "
                        f"{_fmt(pull['one_block_total_ms'])} | "
                        f"{_two(pull.get('one_block_cpu_ms'))} | "
                        f"{_two(thread.get('hint_to_first_byte_ms'))} | "
                        f"{_two(thread.get('one_block_overhead_ms'))} | "
                        f"{_fmt(granted['hint_to_first_byte_ms'])} | "
                        f"{_fmt(granted['one_block_overhead_ms'])} | "
                        f"{_fmt(granted['one_block_total_ms'])} | "
                        f"{_two(granted.get('one_block_cpu_ms'))} |")
        else:
            older += _values(r.get("hint_to_first_byte_ms"))
    out = []
    if rows:
        out += ["", "One-block pulls (512 KiB) on a warm connection, medians in ms: the time from "
                "the hint to the first byte, the overhead (the whole pull less its block's "
                "copy), the whole pull and the destination process's CPU time per pull (all "
                "threads; `-`: not measured); direct reads (on the event loop's loop lane where "
                "the record has the lane-thread columns: the same reads on the first read "
                "lane's thread) against granted ones in the same run.",
                "", "| record | direct: first byte | overhead | whole | CPU | lane thread: first "
                "byte | overhead | granted: first byte | overhead | whole | CPU |",
                "|---|---|---|---|---|---|---|---|---|---|---|", *rows]
    if older:
        out += ["", f"Hint to first byte in records before direct reads (1 block, warm "
                    f"connection, granted reads): {_fmt(min(older))}-{_fmt(max(older))} ms."]
    return out


def _first_pull_lines(records: list[tuple[str, dict]]) -> list[str]:
    """The headline puller's first pull of each record that has it (the process's first:
    the source's state fetched, its connections and read lanes' endpoints made)."""
    rows = []
    for name, r in records:
        first = r.get("cases", {}).get("pull", {}).get("first_pull")
        if not isinstance(first, dict) or "total_ms" not in first:
            continue
        ph = first.get("phases_ms", {})
        copy = ph.get("data", ph.get("read"))
        rest = None if copy is None else first["total_ms"] - copy
        rows.append(f"| `{name}` | {first.get('blocks', '-')} | {_fmt(first['total_ms'])} | "
                    f"{_two(ph.get('metadata'))} | {_two(ph.get('lookup'))} | {_two(copy)} | "
                    f"{_two(rest)} |")
    if not rows:
        return []
    return ["", "A process's first pull (the bench's largest size, its headline puller's first, "
            "ms): the whole pull, the source's state fetched, the look-up (with the read "
            "lanes' first endpoints to the source), the copy, and all but the copy.", "",
            "| record | blocks | whole | state fetch | look-up | copy | all but the copy |",
            "|---|---|---|---|---|---|---|", *rows]


def _past_ttl_lines(records: list[tuple[str, dict]]) -> list[str]:
    """Pulls whose source state is past its time to live, per record and size measured:
    used while fetched again, and waited for, against a fresh state in the same run."""
    rows = []
    for name, r in records:
        past = r.get("cases", {}).get("pull", {}).get("past_ttl")
        if not isinstance(past, dict):
            continue
        if "fresh" in past:  # one size only: one block
            past = {str(r["cases"]["pull"].get("block_bytes", 0)): past}
        for size, row in past.items():
            if size.isdigit() and all(k in row for k in ("fresh", "stale", "refetch")):
                rows.append(f"| `{name}` | {_size(int(size))} | "
                            f"{_fmt(row['fresh']['total_ms'])} | "
                            f"{_fmt(row['stale']['total_ms'])} | "
                            f"{_fmt(row['stale']['metadata_ms'])} | "
                            f"{_fmt(row['refetch']['total_ms'])} | "
                            f"{_fmt(row['refetch']['metadata_ms'])} |")
    if not rows:
        return []
    return ["", "Pulls after a pause past the source state's time to live (as from a source "
            "pulled from rarely), medians in ms: with the state fresh, with the state used "
            "while it is fetched again (`state_max_stale_s`), and waiting for the fetch, "
            "alternated in the same run.",
            "", "| record | pull | fresh: whole | stale, used: whole | metadata | fetched "
            "first: whole | metadata |", "|---|---|---|---|---|---|---|", *rows]


def _two(x: float | None) -> str:
    return "-" if x is None else _fmt(x)


def _peer_section(records: list[tuple[str, dict]]) -> list[str]:
    """NIXL's READ against kvkern's pull in the same runs, and the authentication cost."""
    out = ["## kvkern against NIXL (`kvkern bench xfer --compare nixl`)", "",
           "NIXL's block-list READ (descriptors prepared once, no per-transfer control "
           "message, as vLLM's connector uses it) between two processes on pools of the same "
           "512 KiB blocks and sizes, interleaved with kvkern's pulls where the run records it "
           "and in a run of its own right after. Every NIXL READ is compared with the "
           "target's bytes; kvkern's timed pulls are not, but each variant pulls once "
           "per size, untimed, into poisoned blocks, every block compared (records with "
           "`checked`). Cells: GB/s median [min-max] of the run's repeats (interleaved "
           "rows: [p20-p80] where the record has them, for both).", ""]
    runs = [(name, r) for name, r in records
            if isinstance(r.get("compare", {}).get("nixl", {}).get("cases"), dict)]
    if not runs:
        out += ["No run is recorded.", ""]
    for name, rec in runs:
        nixl, pull = rec["compare"]["nixl"], rec.get("cases", {}).get("pull", {})
        per_request = any("consecutive_per_request" in r for r in nixl["cases"].values())
        out += [f"{_record(name, rec)}:", ""]
        out += _interleaved_lines(pull)
        if len(nixl.get("agents", [])) > 1:
            won = sorted({c["agent"] for r in nixl["cases"].values() for c in r.values()
                          if isinstance(c, dict) and "agent" in c})
            out += [f"NIXL ran with each of its agent configurations "
                    f"({', '.join(nixl['agents'])}); each cell is the faster "
                    f"(taken from: {', '.join(won)}).", ""]
        if per_request:
            out += [f"NIXL also issued every READ as vLLM's connector issues a request "
                    f"(descriptor ids, `make_prepped_xfer` with `notif_msg`, `transfer`, "
                    f"until DONE; {nixl.get('notifications', '?')} notifications, each "
                    f"received by the target): GB/s per request, consecutive / scattered, "
                    f"and kvkern / NIXL against those.", ""]
        out += ["| size | NIXL READ | NIXL READ scattered | kvkern pull | kvkern scattered | "
                "kvkern / NIXL | scattered |"
                + (" NIXL per request | kvkern / NIXL per request |" if per_request else ""),
                "|---|---|---|---|---|---|---|" + ("---|---|" if per_request else "")]
        for size in sorted(nixl["cases"], key=int):
            row, ours = nixl["cases"][size], pull.get(size, {})

            def gb(c: dict) -> str:
                lo, hi = c["gbps_range"]
                return f"{_fmt(c['gbps'])} [{_fmt(lo)}-{_fmt(hi)}]"

            line = (f"| {_size(size)} | {gb(row['consecutive'])} | {gb(row['scattered'])} "
                    f"| {_two(ours.get('pull_gbps'))} | {_two(ours.get('scattered_pull_gbps'))}"
                    f" | {_two(row.get('kvkern_vs_nixl'))} "
                    f"| {_two(row.get('kvkern_vs_nixl_scattered'))} |")
            if per_request:
                a, b = row.get("consecutive_per_request"), row.get("scattered_per_request")
                line += (f" {_two(a and a['gbps'])} / {_two(b and b['gbps'])} "
                         f"| {_two(row.get('kvkern_vs_nixl_per_request'))} / "
                         f"{_two(row.get('kvkern_vs_nixl_per_request_scattered'))} |")
            out.append(line)
        out.append("")
    auth = [(name, r["cases"]["messages"]) for name, r in records
            if "auth_ms" in r.get("cases", {}).get("messages", {})]
    if auth:
        med = [m["auth_ms"] for _, m in auth]
        rtt = [m["control_rtt_us"] / 1000 for _, m in auth]
        out += ["Peer authentication costs one exchange per connection, never per pull: "
                f"{_fmt(min(med))}-{_fmt(max(med))} ms median per connection over "
                f"{_count(len(auth), 'run')}, against a control round trip of "
                f"{_fmt(min(rtt))}-{_fmt(max(rtt))} ms in the same runs.", ""]
    return out


# A direct read's steps (kvkern.tools.benchcli.DIRECT_STEPS) as the columns of the time table
TIME_COLUMNS = (("data", ("data",)), ("queue", ("queue",)),
                ("state, plan, allocate", ("metadata", "plan", "allocate")),
                ("hand-offs", ("handoff",)), ("look-up", ("lookup",)),
                ("confirm", ("confirm",)), ("validate, commit", ("validate", "commit")),
                ("rest", ("rest",)))


def _interleaved_lines(pull: dict) -> list[str]:
    """NIXL's READs (lean agent) interleaved with the pulls, round by round, where the run
    has them: the figures the targets judge."""
    sizes = sorted((k for k in pull if k.isdigit() and "nixl" in pull[k]), key=int)
    if not sizes:
        return []

    def gb(c: dict) -> str:
        lo, hi = (c["gbps_p20"], c["gbps_p80"]) if "gbps_p20" in c else c["gbps_range"]
        return f"{_fmt(c['gbps'])} [{_fmt(lo)}-{_fmt(hi)}]"

    def ours(row: dict, key: str) -> str:  # kvkern's, with its p20-p80 where recorded
        lo, hi = row.get(f"{key}_p20"), row.get(f"{key}_p80")
        got = _two(row.get(key))
        return got if lo is None or hi is None else f"{got} [{_fmt(lo)}-{_fmt(hi)}]"

    out = ["NIXL's READ of the same blocks as one more variant of the pull case, in the same "
           "shuffled rounds as kvkern's pulls (lean agent; per request: descriptor ids and "
           "notification included, as vLLM's connector issues them). kvkern / NIXL is the "
           "pull against each, the lower of the two judged:", "",
           "| size | NIXL READ | per request | scattered | scattered per request | kvkern pull "
           "| kvkern scattered | kvkern / NIXL | scattered |",
           "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        row, ways = pull[size], pull[size]["nixl"]

        def worst(suffix: str, row: dict = row) -> str:
            got = [row.get(f"kvkern_vs_nixl{suffix}"),
                   row.get(f"kvkern_vs_nixl_per_request{suffix}")]
            return _two(min((g for g in got if g is not None), default=None))

        out.append(f"| {_size(size)} | {gb(ways['consecutive'])} "
                   f"| {gb(ways['consecutive_per_request'])} | {gb(ways['scattered'])} "
                   f"| {gb(ways['scattered_per_request'])} | {ours(row, 'pull_gbps')} "
                   f"| {ours(row, 'scattered_pull_gbps')} | {worst('')} "
                   f"| {worst('_scattered')} |")
    return [*out, "", "NIXL's own run after kvkern's, both agent configurations:", ""]


def _time_section(records: list[tuple[str, dict]]) -> list[str]:
    """Where a pull's time goes, step by step, beside NIXL's READ of the same bytes (the
    runs with a NIXL comparison)."""
    runs = [(name, r) for name, r in records if "nixl" in r.get("compare", {})
            and any("rest" in v.get("phases_ms", {})
                    for v in r.get("cases", {}).get("pull", {}).values() if isinstance(v, dict))]
    if not runs:
        return []
    out = ["## Where a pull's time goes", "",
           "The headline pull (direct reads) step by step, medians of the run's repeats in ms: "
           "`data` is the copy of the blocks; `queue` the hint's admission on the caller's "
           "thread and its hand-off onto kvkern's loop; `hand-offs` the read's setup and its "
           "hand-offs onto the first read lane's thread and back; `look-up` and `confirm` the "
           "read directory's two reads with the work on them; `rest` what no step covers. "
           "NIXL's READ of the same blocks (its faster way) from the same run.", ""]
    for name, rec in runs:
        pull = rec["cases"]["pull"]
        nixl = rec.get("compare", {}).get("nixl", {}).get("cases", {})
        out += [f"{_record(name, rec)}:", "",
                "| size | NIXL READ | pull | " + " | ".join(c for c, _ in TIME_COLUMNS) + " |",
                "|---|---|---|" + "---|" * len(TIME_COLUMNS)]
        for size in sorted((k for k in pull if k.isdigit()), key=int):
            ph = pull[size].get("phases_ms", {})
            if "rest" not in ph:
                continue
            # NIXL interleaved with the pulls where the run has it, else its own run
            ways = [pull[size].get("nixl", nixl.get(size, {})).get(k, {}).get("ms")
                    for k in ("consecutive", "consecutive_per_request")]
            ways = [w for w in ways if w is not None]
            cells = [_fmt(sum(ph.get(k, 0.0) for k in keys)) for _, keys in TIME_COLUMNS]
            out.append(f"| {_size(size)} | {_fmt(min(ways)) if ways else '-'} "
                       f"| {_fmt(ph['total'])} | " + " | ".join(cells) + " |")
        out.append("")
        out += _pack_lines(pull)
    return out


def _pack_lines(pull: dict) -> list[str]:
    """A scattered stream's pack at the source against the raw send of the same bytes (the
    runs that measured it)."""
    sizes = sorted((k for k in pull if k.isdigit() and "stream_scattered_pack_ms" in pull[k]),
                   key=int)
    if not sizes:
        return []
    out = ["The stream from a source whose blocks are scattered packs each chunk into staging "
           "before it is sent: a second pass over the bytes beside the send's copy. Its pack "
           "time per pull at the source (the source's `kvkern_source_pack_seconds`) beside the "
           "raw send of the same bytes and the scattered stream's whole pull, ms:", "",
           "| size | raw send | pack at the source (GB/s) | stream scattered pull |",
           "|---|---|---|---|"]
    for size in sizes:
        r = pull[size]
        whole = r["bytes"] / (r["stream_scattered_pull_gbps"] * 1e6)
        out.append(f"| {_size(size)} | {_fmt(r['raw_ms'])} | {_fmt(r['stream_scattered_pack_ms'])}"
                   f" ({_fmt(r['stream_scattered_pack_gbps'])}) | {_fmt(whole)} |")
    return [*out, ""]


def _targets_section(records: list[tuple[str, dict]]) -> list[str]:
    """The targets judged on one run (``targets`` of a record, kvkern.tools.benchtargets)."""
    runs = [(name, r) for name, r in records if r.get("targets")]
    if not runs:
        return []
    out = ["## Targets judged on one run", "",
           "`kvkern bench xfer --compare nixl` judges each target on figures of its own run "
           "(`kvkern/tools/benchtargets.py`): the pull against NIXL, one-block pulls, the "
           "stream and the reshards against a raw send of the same bytes.", ""]
    for name, rec in runs:
        met = sum(1 for t in rec["targets"] if t["met"])
        out += [f"{_record(name, rec)}: {met} of {len(rec['targets'])} met.",
                "", "| target | where | value | wanted | met |", "|---|---|---|---|---|"]
        out += [f"| {t['what']} | {t['where']} | "
                f"{'not measured' if t['value'] is None else format(t['value'], '.3f')} | "
                f"{t['bound']} | {'yes' if t['met'] else 'no'} |" for t in rec["targets"]]
        out.append("")
    return out


def _cpu_section(records: list[tuple[str, dict]]) -> list[str]:
    out = ["## Kernels on CPU (`make bench`)", "",
           "The torch pack/unpack path against a per-block `copy_` loop and one contiguous "
           "`copy_` of the same bytes, measured in the same run. Read the ratios: on a shared "
           "machine the absolute figures move between runs.", ""]
    if not records:
        return out + ["No run is recorded.", ""]
    for name, rec in records:
        out += [f"### `{name}` (commit {_commit(rec)})", "",
                "; ".join(x for x in (rec.get("unit", "GB/s"), rec.get("moved")) if x)
                + f". Environment: {_env_line(rec.get('env', {}))}.", "",
                "| case | pack | unpack | per-block loop | contiguous copy | pack / copy "
                "| unpack / copy | pack / loop |", "|---|---|---|---|---|---|---|---|"]
        for case, m in rec["cases"].items():
            p, u, loop, copy = (m.get("pack"), m.get("unpack"), m.get("per_block_loop"),
                                m.get("contiguous_copy"))
            cells = [_cell(p), _cell(u), _cell(loop), _cell(copy), _ratio(p, copy, 2),
                     _ratio(u, copy, 2), _ratio(p, loop, 1)]
            out.append(f"| {case} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _vllm_section(records: list[tuple[str, dict]]) -> list[str]:
    out = ["## Time to first token in vLLM (`make bench-vllm`)", "",
           "vLLM engines (CPU build) with the kvkern connector, one process each: B serves a "
           "prompt whose prefix a source computed, with a signed hint naming it (B pulls the "
           "prefix, then prefills 16 more tokens), and a prompt as long without one (B "
           "prefills it all), on fresh prompts. The source streams the blocks (A), or lets B "
           "read them straight into the blocks vLLM allocated (R, `remote_read: host`, on "
           "B's host) where the record has that column: with B's own same-host calls, and "
           "through UCX with those refused, as from another host, where it has that one. "
           "Medians of the runs; the crossover is the shortest measured prefix from which the "
           "pull wins.", ""]
    if not records:
        return out + ["No run is recorded.", ""]
    for name, rec in records:
        model = ", ".join(f"{k} {v}" for k, v in rec.get("model", {}).items())
        # the read columns each record has: (key, TTFT heading, ratio heading, crossover)
        reads = [c for c in (("read_s", "read (s)", "recompute / read", "read"),
                             ("ucx_s", "read through UCX (s)", "recompute / through UCX",
                              "through UCX"))
                 if all(c[0] in r for r in rec["rows"])]
        out += [f"### `{name}` (commit {_commit(rec)})", "",
                f"Model: {model}. Environment: {_env_line(rec.get('env', {}))}.", ""]
        pulled = "TTFT with the pull, streamed (s)" if reads else "TTFT with the pull (s)"
        versus = "recompute / streamed" if reads else "recompute / pull"
        heads = ["prefix tokens", "KV MiB", pulled, *(c[1] for c in reads),
                 "TTFT recomputing (s)", versus, *(c[2] for c in reads)]
        out += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for r in rec["rows"]:
            cells = [str(r["prefix_tokens"]), f"{r['kv_mib']:.1f}", f"{r['pull_s']:.3f}"]
            cells += [f"{r[c[0]]:.3f}" for c in reads]
            cells += [f"{r['recompute_s']:.3f}", f"{r['recompute_s'] / r['pull_s']:.1f}"]
            cells += [f"{r['recompute_s'] / r[c[0]]:.1f}" for c in reads]
            out.append("| " + " | ".join(cells) + " |")
        crossover = f"Crossover: {rec.get('crossover_tokens')} tokens"
        if reads:
            crossover += " streamed" + "".join(
                f", {rec.get(c[0].replace('_s', '_crossover_tokens'))} {c[3]}" for c in reads)
        out += ["", crossover + ".", ""]
    return out


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(a: float | None, b: float | None, digits: int) -> str:
    return "-" if not a or not b else f"{a / b:.{digits}f}"


def _gpu_section(gpu: list[tuple[str, dict]], aot: dict | None) -> list[str]:
    out = ["## GPU", ""]
    if gpu:
        out += ["Step files of a `bash bench/run_device.sh` run:", ""]
        for name, rec in gpu:
            status = rec.get("rc", rec.get("status", ""))
            out.append(f"- `{name}`" + (f": {status}" if status != "" else ""))
        out.append("")
    else:
        out += ["No GPU run is recorded. `bash bench/run_device.sh` on a GPU machine writes one "
                "(its step files go under `bench/results/gpu/`); "
                "[docs/performance.md](../docs/performance.md) explains each step.", ""]
    if aot:
        cases = aot.get("cases", [])
        archs = sorted({c.get("arch") for c in cases if c.get("arch")})
        spills = sum(1 for c in cases if c.get("n_spills"))
        regs = [c["n_regs"] for c in cases if "n_regs" in c]
        out += ["### Kernels compiled ahead of time (no GPU)", "",
                f"`kernel_aot.json`: {len(cases)} pack/unpack launches compiled for "
                f"{', '.join(archs)} (Triton {aot.get('triton')}); registers "
                f"{min(regs)}-{max(regs)} per thread, {spills} with spills, "
                f"{len(aot.get('failures', []))} failures; without 16-byte data accesses: "
                + (", ".join(f"`{c}`" for c in aot.get("not_16B", [])) or "none") + ".", ""]
    return out


def render(data: dict[str, Any]) -> str:
    lines = ["# Recorded benchmark runs", "",
             "Generated by `make results` (`bench/report.py`) from the run records under "
             "`bench/results/`; add a record there and regenerate, never edit this file. "
             "Every figure was measured in the run its record names; ratios compare figures "
             "measured in the same run. How to run each benchmark: "
             "[docs/performance.md](../docs/performance.md).", ""]
    lines += _gpu_section(data["gpu"], data["kernel_aot"])
    lines += _xfer_section(data["xfer"])
    lines += _peer_section(data["xfer"])
    lines += _time_section(data["xfer"])
    lines += _targets_section(data["xfer"])
    lines += _vllm_section(data.get("vllm", []))
    lines += _cpu_section(data["cpu_kernels"])
    return "\n".join(lines).rstrip() + "\n"


def plot(data: dict[str, Any], path: Path) -> bool:
    """Each recorded run's pull / raw ratio by size and path (needs matplotlib)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    recs = [r for _, r in data["xfer"] if _pull_kind(r) == ("trtllm", "1:1", "1:1", 0.0)]
    sizes = sorted({int(s) for r in recs for s in r["by_size"]})
    n = len(XFER_METRICS)
    step = 0.8 / n  # every metric's points within its size's tick, in the order listed
    colors = plt.get_cmap("tab20").colors
    for j, (key, label) in enumerate(XFER_METRICS):
        xs, ys = [], []
        for i, size in enumerate(sizes):
            vals = [v for r in recs for v in _values(_figure(r, size, key))]
            xs += [i + (j - (n - 1) / 2) * step] * len(vals)
            ys += vals
        ax.scatter(xs, ys, s=14, color=colors[j % len(colors)],
                   marker="os^D"[j // len(colors) % 4], label=label.replace("`", ""))
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(sizes)), [_size(s) for s in sizes])
    ax.set_ylabel("pull / raw UCXX send (bytes per second)")
    ax.set_title("kvkern bench xfer: one point per recorded run")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/report.py", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if RESULTS.md differs from what the records give")
    p.add_argument("--no-plot", action="store_true", help="do not redraw the plot")
    args = p.parse_args(argv)
    data = load()
    text = render(data)
    if args.check:
        same = RESULTS_MD.read_text() == text
        print("RESULTS.md is up to date" if same else "RESULTS.md differs: run make results")
        return 0 if same else 1
    RESULTS_MD.write_text(text)
    drawn = not args.no_plot and plot(data, HERE / PLOT)
    print(f"wrote {RESULTS_MD}" + (f" and {HERE / PLOT}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
