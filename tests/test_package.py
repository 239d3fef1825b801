"""Packaging promises: `import kvkern` is light, the CLI answers, the kernel demo is exact."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("ucxx", "aiohttp", "msgspec", "prometheus_client")  # pynvml: triton loads it itself


def test_import_kvkern_and_kernels_stays_light():
    code = ("import sys, kvkern; kvkern.pack; kvkern.KVLayout; kvkern.plan_transfer; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "kvkern", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for name in ("demo", "worker", "router", "check-endpoint", "bench"):
        assert name in out.stdout


def test_kernel_demo_is_bit_exact_small():
    from kvkern.tools.kernel_demo import run

    r = run(num_blocks=64, n_pull=16, num_layers=2, num_heads=2, block_size=4, head_dim=16,
            iters=1)
    assert r["bit_exact"] is True
    assert r["bytes"] == 16 * 2 * 2 * 2 * 4 * 16 * 2
    json.dumps(r)
