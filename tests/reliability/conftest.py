"""Reliability suite fixtures: the worker cluster on 127.0.0.1 and the ``record`` fixture.

``record(section, case, **figures)`` keeps a case's figures; after the test's call phase they
are written, with whether the test passed, to ``tests/reliability/.results/`` (one JSON file
per case; the first record of a session clears the files of the previous run).
``python -m kvkern.reliability`` turns them into ``RELIABILITY.md``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.reliability.harness import COMMON, start_fault_workers, stop_hard

RESULTS = Path(__file__).parent / ".results"
_SESSION: dict = {}


def _start_run(config: pytest.Config) -> None:
    if _SESSION.get("started"):
        return
    RESULTS.mkdir(exist_ok=True)
    for f in RESULTS.glob("*.json"):
        f.unlink()
    _SESSION["started"] = True
    (RESULTS / "run.json").write_text(json.dumps({
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "t0": time.time(),
        "markexpr": config.getoption("markexpr", default="") or "",
        "args": [str(a) for a in config.args]}, indent=1))


@pytest.fixture
def record(request):
    _start_run(request.config)
    profile = "slow" if request.node.get_closest_marker("slow") else "quick"

    def rec(section: str, case: str, **figures) -> None:
        request.node._kvk_records.append({"section": section, "case": case,
                                          "profile": profile, "nodeid": request.node.nodeid,
                                          **figures})

    request.node._kvk_records = []
    return rec


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    records = getattr(item, "_kvk_records", None)
    if report.when != "call" or not records:
        return
    for r in records:
        r["passed"] = report.passed
        r["test_duration_s"] = round(report.duration, 3)
        if not report.passed:
            r["failure"] = str(report.longrepr)[-1500:]
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{r['section']}__{r['case']}")
        (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=1, default=str))


@pytest.fixture(scope="session")
def cluster():
    """S: the source; K, K2: two more sources, which the stream and the read kill cases
    kill; D1..D4: destinations. D1, the fault matrix's, asks the source for every read
    (``--direct-reads off``: the faults act on that exchange); D4 (trtllm, as S) reads S
    directly under load. All are fault workers (the real ``kvkern worker`` plus test routes)
    on 127.0.0.1."""
    t0 = time.monotonic()
    specs = {"S": [*COMMON, "--worker-id", "S"], "K": [*COMMON, "--worker-id", "K"],
             "K2": [*COMMON, "--worker-id", "K2"]}
    for i in range(1, 5):
        specs[f"D{i}"] = [*COMMON, "--worker-id", f"D{i}",
                          "--direct-reads", "off" if i == 1 else "on",
                          "--layout", ("trtllm", "vllm_flash", "vllm_nhd", "trtllm")[i - 1]]
    procs = start_fault_workers(specs, env={"KVKERN_TEST_MAX_SENDS": "64"})
    procs["_startup_s"] = time.monotonic() - t0
    try:
        yield procs
    finally:
        for name, p in procs.items():
            if not name.startswith("_"):
                stop_hard(p)
