"""Time to first token in vLLM with a kvkern pull against recomputing the prefix.

Three real vLLM engines (CPU build) with the kvkern connector, each in its own process
(``tests/vllm/engine.py``): source A streams its blocks, source R lets its host pool be read
(``remote_read: host``), B pulls. A and R each compute a prompt; B then serves it with a
signed hint naming that source (B pulls the prefix's blocks, streamed from A or read from R
straight into the blocks vLLM allocated, then prefills the rest), and a prompt as long
without a hint (B prefills it all). B reads R with its own same-host calls, and once more
through UCX with those calls refused, as it reads a source on another host. Every prompt
is fresh, so no run hits B's own prefix cache, and B's ``kvkern_pairs_pulled_total``
confirms each pull's path. Writes one JSON record (``bench/results/vllm/``) with the
environment and prints the table and the crossovers: the shortest prefix from which each
pull wins.

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
    r = Engine("r", model, free_port(), work, *extra, "--remote-read", "host")
    b = Engine("b", model, free_port(), work, *extra)
    engines = (a, r, b)
    try:
        for e in engines:
            e.wait_ready()
        signer = (router, sign_hint, decode_hint)
        # untimed: the first prefill of each engine, B's first connections to A and R
        measure((a, r, b), 4 * BS, 1, signer, salt=-1)
        rows = [measure((a, r, b), n, args.reps, signer) for n in prefixes]
    finally:
        for e in engines:
            e.close()
    record = {"bench": "vllm_ttft", "model": BENCH_MODEL, "block_size": BS, "rows": rows,
              "crossover_tokens": _crossover(rows, "pull_s"),
              "read_crossover_tokens": _crossover(rows, "read_s"),
              "ucx_crossover_tokens": _crossover(rows, "ucx_s"),
              "env": environment()}
    print(f"{'prefix':>7} {'KV MiB':>7} {'streamed s':>11} {'read s':>9} {'UCX s':>8} "
          f"{'recompute s':>12} {'speedup':>8} {'read':>7} {'UCX':>7}")
    for row in rows:
        print(f"{row['prefix_tokens']:>7} {row['kv_mib']:>7.1f} {row['pull_s']:>11.3f} "
              f"{row['read_s']:>9.3f} {row['ucx_s']:>8.3f} {row['recompute_s']:>12.3f} "
              f"{row['speedup']:>7.2f}x {row['read_speedup']:>6.2f}x {row['ucx_speedup']:>6.2f}x")
    print(f"crossover: {record['crossover_tokens']} tokens streamed, "
          f"{record['read_crossover_tokens']} read, {record['ucx_crossover_tokens']} through UCX")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{record['env']['commit']}-ttft.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    print(f"wrote {path}", file=sys.stderr)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 995) for _ in range(n)]


def _crossover(rows: list[dict], key: str) -> int | None:
    return next((r["prefix_tokens"] for r in rows if r[key] < r["recompute_s"]), None)


def _pulled(b, source, toks: list[int], rid: str, path: str, prefix: int, signer) -> float:
    """B's TTFT for ``toks`` with a signed hint naming ``source``, which computed them; the
    pull must fill the whole prefix by ``path`` (else something else would be timed)."""
    router, sign_hint, decode_hint = signer
    source.generate({"id": f"{source.name}{rid}", "tokens": toks, "max_tokens": 1})
    params = {"kv_hint": {"source": f"127.0.0.1:{source.port}"}}
    params.update(sign_hint(router, decode_hint(params), toks))
    key = f"kvkern_pairs_pulled_total[{path}]"
    before = b.ask("stats")["counters"].get(key, 0)
    got = b.generate({"id": f"b{rid}", "tokens": toks, "max_tokens": 1,
                      "kv_transfer_params": params})[f"b{rid}"]
    if got["cached"] != prefix:
        raise RuntimeError(f"the hinted request found {got['cached']} of {prefix} "
                           f"prefix tokens computed (a pull, not a local hit, is timed)")
    if b.ask("stats")["counters"].get(key, 0) != before + 1:
        raise RuntimeError(f"the pull from {source.name} did not take the {path} path")
    return got["ttft_s"]


def measure(engines, prefix: int, reps: int, signer, salt: int = 0) -> dict:
    """Median TTFT on B with a streamed pull (from A), a read one (from R, with B's own calls
    and through UCX) and none, over ``reps`` fresh prompts each (no prompt is ever seen twice
    by B, so no measurement hits B's own prefix cache)."""
    a, r, b = engines
    pulls, reads, ucx, recomputes = [], [], [], []
    for rep in range(reps):
        seed = (salt * 1000 + prefix) * 1000 + rep
        toks = _tokens(seed, prefix + BS // 2)  # the shared prefix, then a question
        pulls.append(_pulled(b, a, toks, f"{seed}", "stream", prefix, signer))
        other = _tokens(seed + 5 * 10**8, len(toks))
        reads.append(_pulled(b, r, other, f"{seed}r", "direct", prefix, signer))
        b.ask("local_reads", on=False)  # as across hosts: B's same-host calls refused
        try:
            third = _tokens(seed + 7 * 10**8, len(toks))
            ucx.append(_pulled(b, r, third, f"{seed}u", "direct", prefix, signer))
        finally:
            b.ask("local_reads", on=True)
        fresh = _tokens(seed + 10**9, len(toks))  # same length, cached nowhere
        ref = b.generate({"id": f"x{seed}", "tokens": fresh, "max_tokens": 1})[f"x{seed}"]
        if ref["cached"]:
            raise RuntimeError(f"the recompute run found {ref['cached']} tokens cached")
        recomputes.append(ref["ttft_s"])
    pull, read, via_ucx = (statistics.median(x) for x in (pulls, reads, ucx))
    recompute = statistics.median(recomputes)
    return {"prefix_tokens": prefix, "kv_mib": prefix * 8192 / 2**20,
            "pull_s": pull, "read_s": read, "ucx_s": via_ucx, "recompute_s": recompute,
            "speedup": recompute / pull, "read_speedup": recompute / read,
            "ucx_speedup": recompute / via_ucx, "pull_runs": pulls, "read_runs": reads,
            "ucx_runs": ucx, "recompute_runs": recomputes}


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
