"""NIXL's side of ``kvkern bench xfer --compare nixl`` (optional: ``make bench-nixl`` installs
nixl): both of its ways of reading with each agent configuration, every transfer verified,
each per-request notification received by the target, and the faster configuration kept."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from kvkern.tools import nixlbench

WAYS = ("consecutive", "scattered", "consecutive_per_request", "scattered_per_request")


def test_nixl_reads_alone_and_per_request_with_notifications():
    pytest.importorskip("nixl")
    out = subprocess.run([sys.executable, "-m", "kvkern.tools.nixlbench", "--sizes", "1MiB",
                          "--repeats", "2", "--json"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["agents"] == list(nixlbench.AGENTS)
    row = res["cases"][str(1 << 20)]
    for key in WAYS:
        assert row[key]["gbps"] > 0 and row[key]["verified"] == 3, row
        assert row[key]["agent"] in nixlbench.AGENTS
    # per-request READs, warm-up included, for each of the two configurations
    assert res["notifications"] == 2 * 3 * len(nixlbench.AGENTS)
    assert res["env"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def test_the_server_reads_on_request_and_counts_its_notifications():
    """``Server``: NIXL's READs one at a time, on request, between the caller's own
    transfers; a bad request is an error reply and the server goes on; at the end every
    per-request notification was received by the target."""
    pytest.importorskip("nixl")

    async def drive() -> tuple[list[float], int | None]:
        server = await nixlbench.Server.start(4)
        try:
            times = [await server.read(2, "consecutive"),
                     await server.read(4, "scattered", per_request=True)]
            with pytest.raises(RuntimeError, match="NIXL server: ValueError"):
                await server.read(5, "consecutive")  # more blocks than the pools hold
            with pytest.raises(RuntimeError, match="mapping must be"):
                await server.read(1, "sideways")
            times.append(await server.read(1, "consecutive", per_request=True))
        finally:
            sent = await server.close()
        return times, sent

    times, sent = asyncio.run(asyncio.wait_for(drive(), 180))
    assert all(t > 0 for t in times) and sent == 2


def _run(agent: str, gbps: dict[str, float]) -> dict:
    return {"bench": "nixl_read", "agents": [agent], "notifications": 6,
            "cases": {"1048576": {"bytes": 1 << 20, "blocks": 2, **{
                k: {"gbps": g, "gbps_range": [g, g], "ms": 1.0 / g, "verified": 3,
                    "agent": agent} for k, g in gbps.items()}}}}


def test_the_faster_configuration_is_kept_per_size_and_way():
    lean = _run("lean", dict(zip(WAYS, (6.5, 6.4, 6.3, 6.2), strict=True)))
    vllm = _run("vllm", dict(zip(WAYS, (3.0, 7.0, 6.3, 2.0), strict=True)))
    res = nixlbench.faster([lean, vllm])
    row = res["cases"]["1048576"]
    assert [row[k]["agent"] for k in WAYS] == ["lean", "vllm", "lean", "lean"]
    assert [row[k]["gbps"] for k in WAYS] == [6.5, 7.0, 6.3, 6.2]
    assert row["bytes"] == 1 << 20 and row["blocks"] == 2
    assert res["agents"] == ["lean", "vllm"] and res["notifications"] == 12


def test_an_unknown_agent_configuration_is_refused():
    with pytest.raises(ValueError, match="agent must be one of"):
        nixlbench.run([1 << 20], agent="fast")


def test_a_nixl_server_that_fails_is_dropped_and_its_figures_with_it():
    """A NIXL READ that fails mid-run stops the server and records why; the pulls go on,
    and no size keeps NIXL's interleaved figures (its notifications were never confirmed)."""
    import asyncio

    from kvkern.tools import benchcli

    class Failing:
        closed = 0

        async def read(self, n, mapping, per_request):
            raise RuntimeError("NIXL server: READ failed")

        async def close(self):
            Failing.closed += 1

    pb = type("PB", (), {})()
    pb.nixl, pb.nixl_error = Failing(), None
    assert asyncio.run(benchcli._nixl_read(pb, 4, "consecutive", False)) is None
    assert pb.nixl is None and Failing.closed == 1
    assert pb.nixl_error == "RuntimeError: NIXL server: READ failed"
    assert asyncio.run(benchcli._nixl_read(pb, 4, "consecutive", False)) is None  # no retry
    out = {"layout": "trtllm", str(16 << 20): {"pull_gbps": 3.0, "nixl": {}, "kvkern_vs_nixl": 0.5,
                                       "kvkern_vs_nixl_per_request_scattered": 0.4}}
    benchcli._drop_nixl_figures(out)
    assert out == {"layout": "trtllm", str(16 << 20): {"pull_gbps": 3.0}}


def test_nixls_scattered_read_takes_the_positions_of_kvkerns_scattered_source():
    """A READ of n scattered blocks reads where kvkern's scattered source keeps the first n
    blocks of its pool of n_max (not a shuffle of n blocks among themselves: those sit
    closer together than kvkern's), and the ratios beside the judged ones say what the
    pull through UCX and its copy alone give against NIXL's READ."""
    from kvkern.tools import nixlbench

    order = nixlbench.scattered_order(512)
    assert sorted(order) == list(range(512)) and order != sorted(order)
    assert nixlbench._remote_ids(32, "scattered", 512) == order[:32]
    assert nixlbench._remote_ids(3, "consecutive", 512) == [0, 1, 2]
    ways = {"consecutive": {"gbps": 10.0}, "scattered": {"gbps": 8.0},
            "consecutive_per_request": {"gbps": 9.0}}
    got = nixlbench.kvkern_ratios({"pull_gbps": 7.0, "scattered_pull_gbps": 4.0,
                                   "ucx_pull_gbps": 5.0, "copy_gbps": 12.0}, ways)
    assert got == {"kvkern_vs_nixl": 0.7, "kvkern_vs_nixl_per_request": 0.778,
                   "kvkern_vs_nixl_scattered": 0.5, "kvkern_ucx_vs_nixl": 0.5,
                   "kvkern_copy_vs_nixl": 1.2}
    s = nixlbench.summary(1 << 20, [0.001, 0.002, 0.003, 0.004, 0.005])
    assert s["gbps_range"][0] < s["gbps_p20"] <= s["gbps"] <= s["gbps_p80"] < s["gbps_range"][1]
