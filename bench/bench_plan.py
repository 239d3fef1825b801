"""Planning cost for 64 ranks a side (pure Python; must stay well under a millisecond cold).

    .venv/bin/python -m pytest -q bench/bench_plan.py --benchmark-enable --benchmark-only
    .venv/bin/python bench/bench_plan.py        # plain timing table

"cold" calls the uncached planner (what the first request between two workers pays);
"cached" is the ``lru_cache`` hit every later request between the same pair pays.
"""

from __future__ import annotations

import platform
import statistics
import sys
import timeit

import pytest

from kvkern.layout.plan import plan_transfer
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology

# Llama-3-70B-like KV: 80 layers, 8 KV heads (GQA); and an MHA model with 64 KV heads.
GQA = ModelKVSpec(num_layers=80, num_kv_heads=8, head_dim=128, block_size=32, dtype="bfloat16")
MHA = ModelKVSpec(num_layers=80, num_kv_heads=64, head_dim=128, block_size=32, dtype="bfloat16")


def _t(model, **par) -> Topology:
    return Topology(model=model, parallel=Parallelism(**par))


CASES = {
    "gqa8-tp8pp8-to-tp4pp16": (_t(GQA, tp_size=8, pp_size=8), 0,
                               _t(GQA, tp_size=4, pp_size=16), 0),
    "gqa8-tp64-to-tp8": (_t(GQA, tp_size=64), 0, _t(GQA, tp_size=8), 0),
    "mha64-tp64-to-tp8pp8": (_t(MHA, tp_size=64), 0, _t(MHA, tp_size=8, pp_size=8), 0),
    "mha64-tp8pp8-to-tp64": (_t(MHA, tp_size=8, pp_size=8), 0, _t(MHA, tp_size=64), 0),
    "gqa8-adp-tp64dp8-dp7-to-tp4pp16": (
        _t(GQA, tp_size=64, dp_size=8, attention_dp=True), 7, _t(GQA, tp_size=4, pp_size=16), 0),
}

_uncached = plan_transfer.__wrapped__


@pytest.mark.parametrize("name", list(CASES))
def test_plan_cold(benchmark, name):
    args = CASES[name]
    plan = benchmark(_uncached, *args)
    benchmark.extra_info["pairs"] = len(plan.transfers)
    assert len(plan.dst_ranks) == args[2].parallel.world_size // args[2].parallel.dp_size


@pytest.mark.parametrize("name", list(CASES))
def test_plan_cached(benchmark, name):
    args = CASES[name]
    plan_transfer(*args)
    benchmark(plan_transfer, *args)


def main() -> None:
    print(f"python {platform.python_version()} on {platform.machine()} ({platform.node()})")
    print(f"{'case':36} {'pairs':>5} {'cold median':>12} {'cold min':>10} {'cached':>8}")
    for name, args in CASES.items():
        pairs = len(_uncached(*args).transfers)
        number = 200
        cold = [t / number * 1e6 for t in timeit.repeat(lambda a=args: _uncached(*a),
                                                          number=number, repeat=7)]
        plan_transfer(*args)
        warm = min(timeit.repeat(lambda a=args: plan_transfer(*a), number=10_000, repeat=5))
        print(f"{name:36} {pairs:5d} {statistics.median(cold):10.1f}us {min(cold):8.1f}us "
              f"{warm / 10_000 * 1e6:6.2f}us")


if __name__ == "__main__":
    sys.exit(main())
