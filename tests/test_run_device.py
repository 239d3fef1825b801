"""``bench/run_device.sh``: the dry run on CPU writes every step's JSON; the pieces that
judge a GPU run (targets, NVML peak, step recording) are checked on synthetic input."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("device_run", ROOT / "bench" / "device_run.py")
device_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_run)

GPU_STREAM_TESTS = ["test_gpu_source_and_destination_on_side_streams_are_bit_exact",
                    "test_gpu_pack_on_a_side_stream_overlaps_a_matmul",
                    "test_gpu_publish_orders_the_compute_stream_after_the_unpack",
                    "test_gpu_staging_slot_waits_for_its_unpack_event"]
# (the pull's targets first: a GPU is lent for minutes, and a step past the budget is skipped)
STEPS = ["env", "gpu_facts", "ucx_transports", "xfer", "demo", "pytest_gpu", "kernels",
         "xfer_window", "autotune"]


def test_dry_run_writes_every_steps_json(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "OUT")}
    env |= {"OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "run_device.sh"), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True and list(summary["steps"]) == STEPS
    for name in STEPS:
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        assert doc["step"] == name and "rc" in doc and "seconds" in doc
        # a failed step carries its reason; the run went on to the next one
        assert doc["ok"] or doc.get("error"), doc
    steps = summary["steps"]
    assert steps["gpu_facts"]["skipped"].startswith("dry run")
    assert steps["autotune"]["skipped"] == "needs a GPU"
    assert steps["xfer_window"]["skipped"] == "needs device pools"
    for name in ("env", "kernels", "pytest_gpu"):  # only torch, Triton and pytest needed
        assert steps[name]["ok"], steps[name]
    ucx = json.loads((tmp_path / "ucx_transports.json").read_text())["result"]
    assert "tcp" in ucx["transports"] and set(ucx["cuda"]) == {"cuda_copy", "cuda_ipc", "gdr_copy"}
    assert ucx["ucx_env"]["UCXPY_PROGRESS_MODE"] == "thread"
    kernels = json.loads((tmp_path / "kernels.json").read_text())["result"]
    assert kernels["bit_exact"] and len(kernels["rows"]) == 2
    assert all(r["pack_vs_copy"] > 0 and r["run_bytes"] > 0 for r in kernels["rows"])
    gpu = json.loads((tmp_path / "pytest_gpu.json").read_text())["result"]
    assert gpu["tests"] >= 1 and gpu["skipped"] == gpu["tests"] and gpu["failures"] == 0
    ran = set(gpu["test_names"])  # the device-stream tests run on the first GPU
    assert {f"tests.test_devstream::{name}" for name in GPU_STREAM_TESTS} <= ran, ran
    assert ucx["cuda_tls_gaps"] == [] or "UCX_TLS" in os.environ
    xfer = json.loads((tmp_path / "xfer.json").read_text())
    assert xfer["device_pools"] is False
    assert xfer["ok"] == ("ratio" in (xfer.get("result") or {}))
    demo = json.loads((tmp_path / "demo.json").read_text())
    assert demo["ok"] == bool(demo.get("exact"))
    targets = json.loads((tmp_path / "targets.json").read_text())
    assert set(targets) == set(device_run.TARGETS) == set(summary["targets"])
    assert all(t["meaningful"] is False and t["threshold"] > 0 for t in targets.values())
    assert summary["seconds"] < summary["budget_s"]


def _row(name, run, pack, unpack, loop=20.0, heads="0:8", unit=8192, max_programs=""):
    return {"name": name, "run_bytes": run, "pack_vs_copy": pack, "unpack_vs_copy": unpack,
            "pack_vs_loop": loop, "heads": heads, "H": 8, "loop_unit_bytes": unit,
            "max_programs": max_programs}


def test_targets_pick_the_worst_case_of_each_class():
    rows = [_row("run-4096B", 4096, 0.97, 0.99), _row("run-2048B", 2048, 0.99, 0.94),
            _row("run-256B", 256, 0.9, 0.86, loop=9.0), _row("big", 65536, 1.0, 1.0, loop=2.0,
                                                             unit=65536),
            _row("tp4", 4096, 0.91, 0.96, heads="2:4"),
            _row("32prog", 4096, 0.5, 0.5, max_programs=32)]
    t = device_run.evaluate_targets(rows, {"ratio": 0.93, "pull_gbps": 93.0, "raw_gbps": 100.0},
                                    device_pools=True, meaningful=True)
    # whole-head packs on the whole device: the head slice and the capped launch are not in it
    ge2k = t["pack_unpack_vs_copy_runs_ge_2KiB"]
    assert (ge2k["pass"], ge2k["worst"], ge2k["worst_case"], ge2k["cases"]) == (
        False, 0.94, "run-2048B", 3)
    assert (t["pack_unpack_vs_copy_runs_256B"]["pass"], t["pack_unpack_vs_copy_runs_256B"]["worst"]) \
        == (True, 0.86)
    # the 64 KiB loop unit is outside the <= 32 KiB target; the 256 B case is the worst inside
    assert t["pack_vs_block_loop_le_32KiB"]["worst_case"] == "run-256B"
    assert t["pack_vs_block_loop_le_32KiB"]["pass"] is False
    assert t["head_sliced_pack_vs_copy"]["pass"] is True and t["head_sliced_pack_vs_copy"]["cases"] == 1
    assert t["d2d_pull_vs_raw_ucxx"]["pass"] is True
    # a run of several sizes is judged on its worst, not on the largest its top level holds
    sizes = {"ratio": 0.95, "bytes": 256 << 20, "by_size": {
        str(16 << 20): {"ratio": 0.71, "bytes": 16 << 20}, str(256 << 20): {"ratio": 0.95}}}
    d2d = device_run.evaluate_targets([], sizes, device_pools=True,
                                      meaningful=True)["d2d_pull_vs_raw_ucxx"]
    assert (d2d["pass"], d2d["worst"], d2d["bytes"]) == (False, 0.71, 16 << 20)
    sizes["by_size"][str(16 << 20)] = {"error": "the pull failed"}  # not judged on the rest
    d2d = device_run.evaluate_targets([], sizes, device_pools=True,
                                      meaningful=True)["d2d_pull_vs_raw_ucxx"]
    assert d2d["pass"] is None and f"at {16 << 20} B" in d2d["reason"]
    host = device_run.evaluate_targets([], {"ratio": 0.5}, device_pools=False, meaningful=True)
    assert host["d2d_pull_vs_raw_ucxx"]["pass"] is None and "host memory" in host[
        "d2d_pull_vs_raw_ucxx"]["reason"]
    assert host["pack_unpack_vs_copy_runs_256B"]["pass"] is None


def test_gpu_facts_peak_bandwidth_from_nvml(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        __version__="13.0", NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetMaxClockInfo=lambda h, kind: {1: 1980, 2: 3201}[kind],
        nvmlDeviceGetMemoryBusWidth=lambda h: 6144,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=143771 << 20),
        nvmlSystemGetDriverVersion=lambda: b"575.57",
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    facts = device_run.gpu_facts()
    assert calls == ["init", "shutdown"]
    # 2 x 3201 MHz x 6144 bit / 8 = 4916.7 GB/s (the H200's 4.8 TB/s class)
    assert facts["peak_memory_gbps"] == pytest.approx(4916.7, abs=0.1)
    assert facts["name"] == "NVIDIA H200" and facts["driver"] == "575.57"
    assert facts["max_sm_clock_mhz"] == 1980 and facts["memory_bus_width_bits"] == 6144


def test_a_failing_or_hanging_step_is_recorded(tmp_path):
    failed = device_run.run_step([sys.executable, "-c", "print('x'); raise SystemExit(3)"],
                                 tmp_path / "f.log", 30)
    assert failed["rc"] == 3 and failed["error"] == "x" and not failed["timed_out"]
    hung = device_run.run_step([sys.executable, "-c", "import time; time.sleep(60)"],
                               tmp_path / "h.log", 1)
    assert hung["timed_out"] and hung["error"].startswith("timed out") and hung["seconds"] < 30
    ok = device_run.run_step([sys.executable, "-c", "print('{\"a\": 1}')"], tmp_path / "o.log", 30)
    assert ok["rc"] == 0 and "error" not in ok
    assert device_run.last_json_line((tmp_path / "o.log").read_text()) == {"a": 1}


def test_outside_a_dry_run_no_cuda_and_every_gpu_test_skipped_are_failures():
    """pytest exits 0 when every test skipped, so on a machine (or a Python) without CUDA
    the device check would otherwise report its GPU steps fine."""
    assert device_run.env_result(cuda=False, dry=False)["rc"] == 1
    assert device_run.env_result(cuda=False, dry=True)["rc"] == 0
    assert device_run.env_result(cuda=True, dry=False)["rc"] == 0
    skipped = {"tests": 4, "skipped": 4, "failures": 0, "errors": 0}
    res = device_run.gpu_tests_result({"rc": 0}, skipped, dry=False)
    assert res["rc"] == 1 and "none ran" in res["error"]
    assert device_run.gpu_tests_result({"rc": 0}, skipped, dry=True)["rc"] == 0
    assert device_run.gpu_tests_result({"rc": 5}, {}, dry=False)["rc"] == 1
    ran = device_run.gpu_tests_result({"rc": 0}, dict(skipped, skipped=1), dry=False)
    assert ran["rc"] == 0 and "error" not in ran
    assert device_run.gpu_tests_result({"rc": 1}, skipped, dry=False)["rc"] == 1
