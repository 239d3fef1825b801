"""A benchmark's processes run torch's OpenMP pool with threads that sleep once their work
is done (:mod:`kvkern.tools.threadpools`), set before torch loads, unless the caller's
environment names a policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvkern.tools import benchcli, threadpools


def test_a_policy_is_given_only_where_none_is_named():
    env: dict[str, str] = {}
    threadpools.settle(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    threadpools.settle(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_bench_sets_it_before_anything_loads_torch():
    """In a fresh process, ``kvkern bench`` gives the policy before torch is imported
    (OpenMP reads it when torch loads it): the record has no ``omp_late``."""
    code = ("import os\n"
            "os.environ.pop('OMP_WAIT_POLICY', None)\n"
            "from kvkern.tools import benchcli, threadpools\n"
            "try:\n"
            "    benchcli.main(['xfer', '--cases', 'unknown'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), threadpools.record())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "PASSIVE {'omp_wait_policy': 'PASSIVE'}"


def test_a_policy_set_after_torch_loaded_is_recorded_as_late(monkeypatch):
    import torch  # noqa: F401  (this process's pool has started with its default)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threadpools, "_late", False)
    threadpools.settle()
    assert threadpools.record() == {"omp_wait_policy": "PASSIVE", "omp_late": True}


def test_a_named_policy_is_kept_by_the_bench(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with pytest.raises(SystemExit):
        benchcli.main(["xfer", "--cases", "unknown"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
