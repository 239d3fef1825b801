"""Load: many concurrent hinted requests from 4 destination worker processes (trtllm,
vllm_flash, vllm_nhd, trtllm pools) against one source worker, all on 127.0.0.1.

Random prefixes are prefilled on the source; each request takes a random leading cut of a
random prefix plus a short tail (under one block, so the prompt's full blocks are the cut),
in a random hint dialect, to a destination in turn. Every request must answer 200 with a
reason from {ok, duplicate, local_prefix_sufficient}; every pulled block is compared with
the source's by sha256 of its canonical bytes right after its request; every answer whose
cached prefix length equals the source's own for that prompt must have the source's tokens
and logits bits; afterwards every leak counter on all five workers is 0.

The quick profile (default ``make test``) sends 64 requests at once with prefixes of 4-24
blocks; the slow one 512 requests, 64 in flight, prefixes of 8-96 blocks.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections import Counter

import pytest

from kvkern.serve.router import DIALECTS, hint_fragment, router_hashes
from tests.reliability.harness import T, percentiles, pool_hashes, toks

pytestmark = pytest.mark.timeout(600)

ALLOWED = {"ok", "duplicate", "local_prefix_sufficient"}


def run_load(cluster, record, *, case: str, n_requests: int, concurrency: int,
             n_prefixes: int, blocks: tuple[int, int], seed: int) -> None:
    rng = random.Random(seed)
    src = cluster["S"]
    dests = [cluster[f"D{i}"] for i in range(1, 5)]
    prefixes = [toks(rng.randint(*blocks) * T, rng) for _ in range(n_prefixes)]
    for p in prefixes:
        src.generate({"token_ids": p, "max_new_tokens": 0})
    for w in (src, *dests):
        lk = w.wait_clean()
        assert not any(lk.values()), (w.name, lk)

    jobs = []
    for i in range(n_requests):
        p = rng.choice(prefixes)
        cut = rng.randint(1, len(p) // T) * T
        prompt = p[:cut] + toks(rng.randint(1, T - 1), rng)
        dialect = DIALECTS[i % len(DIALECTS)]
        body = {"token_ids": prompt, "max_new_tokens": 2,
                **hint_fragment(dialect, src.url, router_hashes(p[:cut], T))}
        jobs.append((dests[i % len(dests)], body, dialect))

    gate = threading.Barrier(min(concurrency, n_requests))
    verify_lock = threading.Lock()
    verified = Counter()

    def one(job) -> dict:
        dst, body, dialect = job
        if concurrency >= n_requests:
            gate.wait(30)  # every request in flight at once
        t0 = time.perf_counter()
        out = dst.generate(body, timeout=120)
        lat = time.perf_counter() - t0
        pull = out["pull"] or {}
        res = {"dst": dst.name, "dialect": dialect, "latency_s": lat, "reason": pull.get(
            "reason"), "fallback": out["fallback"], "out": out, "body": body}
        if pull.get("used"):
            hs = pool_hashes(body["token_ids"])
            lo = pull["blocks_local"]
            pulled = hs[lo:lo + pull["blocks_transferred"]]
            d, s = dst.digests(pulled), src.digests(pulled)
            with verify_lock:
                for h in pulled:
                    dd, ss = d[str(h)], s[str(h)]
                    verified["missing" if dd is None or ss is None
                             else "verified" if dd == ss else "corrupted"] += 1
        return res

    t_start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(one, jobs))
    wall = time.perf_counter() - t_start

    # Outputs: same cached prefix length as the source's own answer -> same tokens and bits.
    outputs = Counter()
    for r in results:
        ref = src.generate({"token_ids": r["body"]["token_ids"], "max_new_tokens": 2})
        if ref["cached_tokens"] != r["out"]["cached_tokens"]:
            outputs["not_comparable"] += 1
        elif (ref["tokens"], ref["logits_sha256"]) == (r["out"]["tokens"],
                                                      r["out"]["logits_sha256"]):
            outputs["identical"] += 1
        else:
            outputs["different"] += 1
    leaks = {w.name: w.wait_clean() for w in (src, *dests)}
    n_leaks = sum(sum(v.values()) for v in leaks.values())

    reasons = Counter(r["reason"] for r in results)
    pulls = [r for r in results if r["reason"] in ("ok", "partial")]
    n_blocks = sum(r["out"]["pull"]["blocks_transferred"] for r in pulls)
    nbytes = sum(r["out"]["pull"]["bytes_transferred"] for r in pulls)
    pull_s = [r["out"]["pull"]["phases"]["total"] for r in pulls]
    lat = [r["latency_s"] for r in results]
    figures = dict(
        requests=n_requests, concurrency=concurrency, destinations=len(dests),
        prefixes=n_prefixes, prefix_blocks=list(blocks), wall_s=round(wall, 3),
        requests_per_s=round(n_requests / wall, 1), pulls=len(pulls), blocks_pulled=n_blocks,
        bytes_pulled=nbytes, pulled_mb_per_s=round(nbytes / wall / 1e6, 2),
        blocks_per_s=round(n_blocks / wall, 1),
        latency_s={k: round(v, 4) for k, v in percentiles(lat).items()},
        pull_s={k: round(v, 4) for k, v in percentiles(pull_s).items()},
        reasons=dict(reasons), per_destination=dict(Counter(r["dst"] for r in results)),
        blocks_verified=verified["verified"], blocks_corrupted=verified["corrupted"],
        blocks_missing=verified["missing"], outputs=dict(outputs), leaks=n_leaks,
        leak_detail={k: {f: n for f, n in v.items() if n} for k, v in leaks.items()})
    try:
        assert set(reasons) <= ALLOWED, reasons
        assert verified["corrupted"] == 0 and verified["missing"] == 0, verified
        assert verified["verified"] == n_blocks and n_blocks > 0
        assert outputs["different"] == 0, outputs
        assert n_leaks == 0, leaks
    finally:
        record("load", case, **figures)


def test_load_quick(cluster, record):
    run_load(cluster, record, case="quick_64x4", n_requests=64, concurrency=64,
             n_prefixes=24, blocks=(4, 24), seed=11)


@pytest.mark.slow
def test_load_long(cluster, record):
    run_load(cluster, record, case="long_512x4", n_requests=512, concurrency=64,
             n_prefixes=48, blocks=(8, 96), seed=12)
