"""Collects each benchmark's median and prints GB/s and ratios against the baselines of the
same case, measured in the same run; writes them with the run's environment to
bench/out/cpu_kernels.json, a record ``bench/report.py`` reads (copy it into
bench/results/cpu_kernels/ to keep it)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections import defaultdict
from pathlib import Path

import pytest

from kvkern.tools.provenance import git_state

RESULTS: dict[str, dict[str, dict]] = defaultdict(dict)


@pytest.fixture
def record(benchmark):
    """record(case, method, nbytes) after the benchmark call stores its GB/s."""
    def _record(case: str, method: str, nbytes: int) -> None:
        if benchmark.stats is None:  # --benchmark-disable: nothing was timed
            return
        st = benchmark.stats.stats
        RESULTS[case][method] = {"median_s": st.median, "gbps": nbytes / st.median / 1e9,
                                 "gbps_q1": nbytes / st.q3 / 1e9, "gbps_q3": nbytes / st.q1 / 1e9,
                                 "bytes": nbytes}
    return _record


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("kvkern GB/s and ratios (same run)")
    for case, methods in sorted(RESULTS.items()):
        base = methods.get("contiguous_copy", {}).get("gbps")
        loop = methods.get("per_block_loop", {}).get("gbps")
        parts = []
        for m, r in sorted(methods.items()):
            s = f"{m}={r['gbps']:.2f}"
            if base and m in ("pack", "unpack"):
                s += f" ({r['gbps'] / base:.2f}x copy"
                s += f", {r['gbps'] / loop:.1f}x loop)" if loop else ")"
            parts.append(s)
        tr.write_line(f"{case}: " + "  ".join(parts))
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    record = {"bench": "cpu_kernels", "command": "make bench", "env": _environment(),
              "unit": "GB/s of payload (staging bytes per second), medians",
              "cases": {case: {m: round(r["gbps"], 2) for m, r in methods.items()}
                        for case, methods in sorted(RESULTS.items())},
              "detail": RESULTS}
    (out / "cpu_kernels.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _environment() -> dict:
    import torch  # noqa: PLC0415

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.machine(), "processor": platform.processor() or "unknown",
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    with contextlib.suppress(OSError):
        env["load_average"] = round(os.getloadavg()[0], 2)
    env.update(git_state(Path(__file__).parent))
    return env
