"""The bench's engine load (:mod:`kvkern.tools.engineload`): it holds the interpreter for the
fraction asked, a thread of kvkern's then waits for the lock, and a bench run under it
records what it asked and what the pulling process computed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvkern.tools import engineload
from kvkern.tools.engineload import EngineLoad, from_env, parse_fraction
from kvkern.xfer.ucp_rma import rma_unavailable


@pytest.mark.parametrize("text,value", [("0", 0.0), ("0.5", 0.5), ("0.95", 0.95)])
def test_parse_fraction(text, value):
    assert parse_fraction(text) == value


@pytest.mark.parametrize("text", ["1", "-0.1", "nan", "inf", "half"])
def test_parse_fraction_refuses(text):
    with pytest.raises(ValueError):
        parse_fraction(text)


def test_from_env():
    assert from_env({}) is None
    assert from_env({engineload.ENV: "0"}) is None
    load = from_env({engineload.ENV: "0.3"})
    try:
        assert load is not None and load.fraction == 0.3
    finally:
        load.stop()
    with pytest.raises(ValueError):
        from_env({engineload.ENV: "2"})


def test_load_keeps_the_interpreter_for_its_fraction():
    load = EngineLoad(0.5, period_s=0.01).start()
    time.sleep(0.4)
    busy = load.stop()
    assert 0.3 <= busy <= 0.65, busy  # asked 0.5 (a loaded host computes less of it)
    assert not load._thread.is_alive()


def test_the_loads_cpu_is_counted_apart_from_the_process():
    """``engine_cpu_s`` is the CPU of the running loads' threads (what a bench subtracts from
    its process's to count a pull's own), and nothing once they stopped."""
    assert engineload.engine_cpu_s() == 0.0
    load = EngineLoad(0.5, period_s=0.01).start()
    try:
        c0, p0 = engineload.engine_cpu_s(), time.process_time()
        time.sleep(0.4)
        used, process = engineload.engine_cpu_s() - c0, time.process_time() - p0
        assert 0.08 <= used <= process + 0.01, (used, process)  # (asked 0.2 s of 0.4)
    finally:
        load.stop()
    assert engineload.engine_cpu_s() == 0.0


def test_a_thread_waits_for_the_lock_under_load():
    """What the load stands for: a thread that wakes (here from a 1 ms sleep) needs the
    interpreter, which the engine's thread holds until the interpreter forces a switch."""
    def oversleep(n: int) -> float:
        late = []
        for _ in range(n):
            t = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)
        return sorted(late)[n // 2]

    idle = oversleep(40)
    load = EngineLoad(0.9, period_s=0.02).start()
    try:
        loaded = oversleep(40)
    finally:
        load.stop()
    assert loaded > max(5 * idle, 5e-4), (idle, loaded)


def test_bench_records_the_engine_load():
    if rma_unavailable() is not None:
        pytest.skip(f"one-sided reads unavailable: {rma_unavailable()}")
    cmd = [sys.executable, "-m", "kvkern", "bench", "xfer", "--cases", "pull", "--sizes",
           "1MiB", "--repeats", "2", "--data-path", "read", "--engine-load", "0.4",
           "--timeout", "60", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    load = res["env"]["engine_load"]
    assert load["fraction"] == 0.4 and 0.1 < load["busy"] < 0.6, load
    assert res["cases"]["pull"][str(1 << 20)]["pull_gbps"] > 0


def test_bench_refuses_a_load_of_one():
    out = subprocess.run([sys.executable, "-m", "kvkern", "bench", "xfer", "--engine-load",
                          "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "fraction in [0, 1)" in out.stderr
