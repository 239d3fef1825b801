"""NIXL's side of ``kvkern bench xfer --compare nixl`` (optional: ``make bench-nixl`` installs
nixl): both of its ways of reading, every transfer verified, and each per-request
notification received by the target."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_nixl_reads_alone_and_per_request_with_notifications():
    pytest.importorskip("nixl")
    out = subprocess.run([sys.executable, "-m", "kvkern.tools.nixlbench", "--sizes", "1MiB",
                          "--repeats", "2", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    row = res["cases"][str(1 << 20)]
    for key in ("consecutive", "scattered", "consecutive_per_request", "scattered_per_request"):
        assert row[key]["gbps"] > 0 and row[key]["verified"] == 3, row
    assert res["notifications"] == 2 * 3  # per-request READs, warm-up included
