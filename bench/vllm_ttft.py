"""Time to first token in vLLM with a kvkern pull against recomputing the prefix.

Two real vLLM engines (CPU build) with the kvkern connector, each in its own process
(``tests/vllm/engine.py``): engine A computes a prompt; engine B then serves the same prompt
twice over, once with a signed hint naming A (B pulls the prefix's blocks, then prefills the
rest) and once without (B prefills it all). Every prompt is fresh, so no run hits B's own
prefix cache. Writes one JSON record (``bench/results/vllm/``) with the environment and
prints the table and the crossover: the shortest prefix from which the pull wins.

    make bench-vllm                                  # 32, 128, 512, 2k and 8k prefix tokens
    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_ttft.py --prefixes 2048,8192 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BS = 32
#: A larger random-weight Llama than the tests' (recompute cost grows with the model, the
#: pull's with its KV bytes): 4 layers, 4 KV heads of 64, 8 KiB of KV per token.
BENCH_MODEL = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, num_hidden_layers=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", default="32,128,512,2048,8192", help="prefix lengths in tokens")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "vllm"))
    args = p.parse_args()
    prefixes = [int(x) for x in args.prefixes.split(",")]
    sys.path.insert(0, str(ROOT))
    from kvkern.xfer.auth import Credential, generate_secret, sign_hint
    from kvkern.xfer.hints import decode_hint
    from tests.vllm.conftest import Engine, free_port
    from tests.vllm.tiny_model import write_model

    secret = generate_secret()
    os.environ["KVKERN_FLEET_SECRET"] = secret
    router = Credential(secret, peer_id="bench-router")
    max_len = max(prefixes) + 2 * BS
    work = Path(tempfile.mkdtemp(prefix="kvkern-vllm-bench-"))
    model = write_model(work / "model", max_position_embeddings=max_len + BS, **BENCH_MODEL)
    extra = ("--max-model-len", str(max_len), "--kv-cache-mib", "1024",
             "--transfer-timeout-s", "30")
    a = Engine("a", model, free_port(), work, *extra)
    b = Engine("b", model, free_port(), work, *extra)
    try:
        a.wait_ready(), b.wait_ready()
        # untimed: the first prefill of each engine, B's first connection to A
        measure(a, b, 4 * BS, 1, router, sign_hint, decode_hint, salt=-1)
        rows = [measure(a, b, n, args.reps, router, sign_hint, decode_hint) for n in prefixes]
    finally:
        a.close(), b.close()
    record = {"bench": "vllm_ttft", "model": BENCH_MODEL, "block_size": BS, "rows": rows,
              "crossover_tokens": next((r["prefix_tokens"] for r in rows
                                        if r["pull_s"] < r["recompute_s"]), None),
              "env": environment()}
    print(f"{'prefix':>7} {'KV MiB':>7} {'pull TTFT s':>12} {'recompute s':>12} {'speedup':>8}")
    for r in rows:
        print(f"{r['prefix_tokens']:>7} {r['kv_mib']:>7.1f} {r['pull_s']:>12.3f} "
              f"{r['recompute_s']:>12.3f} {r['speedup']:>7.2f}x")
    print(f"crossover: {record['crossover_tokens']} tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{record['env']['commit']}-ttft.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    print(f"wrote {path}", file=sys.stderr)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 995) for _ in range(n)]


def measure(a, b, prefix: int, reps: int, router, sign_hint, decode_hint,
            salt: int = 0) -> dict:
    """Median TTFT on B with a pull and without, over ``reps`` fresh prompts (no prompt is
    ever seen twice by B, so neither measurement hits B's own prefix cache)."""
    pulls, recomputes, cached = [], [], []
    for rep in range(reps):
        seed = (salt * 1000 + prefix) * 1000 + rep
        toks = _tokens(seed, prefix + BS // 2)  # the shared prefix, then a question
        a.generate({"id": f"a{seed}", "tokens": toks, "max_tokens": 1})
        params = {"kv_hint": {"source": f"127.0.0.1:{a.port}"}}
        params.update(sign_hint(router, decode_hint(params), toks))
        got = b.generate({"id": f"b{seed}", "tokens": toks, "max_tokens": 1,
                          "kv_transfer_params": params})[f"b{seed}"]
        if got["cached"] != prefix:  # a measurement of something else: stop
            raise RuntimeError(f"the hinted request found {got['cached']} of {prefix} "
                               f"prefix tokens computed (a pull, not a local hit, is timed)")
        pulls.append(got["ttft_s"])
        cached.append(got["cached"])
        fresh = _tokens(seed + 10**9, len(toks))  # same length, cached nowhere
        ref = b.generate({"id": f"r{seed}", "tokens": fresh, "max_tokens": 1})[f"r{seed}"]
        if ref["cached"]:
            raise RuntimeError(f"the recompute run found {ref['cached']} tokens cached")
        recomputes.append(ref["ttft_s"])
    pull, recompute = statistics.median(pulls), statistics.median(recomputes)
    return {"prefix_tokens": prefix, "kv_mib": prefix * 8192 / 2**20,
            "pull_s": pull, "recompute_s": recompute, "speedup": recompute / pull,
            "pull_runs": pulls, "recompute_runs": recomputes, "cached_tokens": cached}


def environment() -> dict:
    import torch
    import vllm

    from kvkern.tools.provenance import git_state

    return {**git_state(ROOT),
            "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__,
            "device": "cpu", "transport": "UCX over loopback"}


if __name__ == "__main__":
    main()
