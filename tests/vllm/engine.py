"""One vLLM engine with the kvkern connector, driven over stdin/stdout (one JSON object per
line each way), for the tests in this folder: a real engine in its own OS process.

    python -m tests.vllm.engine --model DIR --listen 127.0.0.1:PORT [--no-connector]

Commands: ``{"op": "generate", "requests": [...]}`` (all requests run together; each
``{"id", "tokens", "max_tokens", "kv_transfer_params"?, "kv_hints"?, "cache_salt"?}``) answers
per request the sampled tokens, the first token's logprobs as exact hex floats, the prompt's
cached tokens and how long the first token took; ``{"op": "stats"}`` answers the scheduler's
free blocks, kvkern's outstanding pins and its counters; ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build(args: argparse.Namespace):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if not args.no_connector:
        extra = {"listen": args.listen, "allowlist": "127.0.0.1",
                 "transfer_timeout_s": args.transfer_timeout_s, "deadline_s": 10.0}
        if args.trust_unsigned_hints:
            extra["trust_unsigned_hints"] = True
        if args.remote_read != "off":
            extra["remote_read"] = args.remote_read
        kv = KVTransferConfig(kv_connector="KvkernConnector",
                              kv_connector_module_path="kvkern.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config=extra)
    return LLM(model=args.model, skip_tokenizer_init=True, block_size=32, dtype="float32",
               max_model_len=args.max_model_len, enforce_eager=True,
               kv_cache_memory_bytes=args.kv_cache_mib << 20, enable_prefix_caching=True,
               seed=0, kv_transfer_config=kv, max_num_batched_tokens=args.max_model_len)


def core(llm):
    return llm.llm_engine.engine_core.engine_core  # in-process engine core


def generate(llm, requests: list[dict]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_hints import KvHintsEnvelope

    engine = llm.llm_engine
    t0, first, ids = time.perf_counter(), {}, {}
    for r in requests:
        extra = {"kv_transfer_params": r["kv_transfer_params"]} \
            if r.get("kv_transfer_params") else None
        sp = SamplingParams(max_tokens=r.get("max_tokens", 4), temperature=0.0, logprobs=5,
                            detokenize=False, extra_args=extra)
        hints = r.get("kv_hints")
        envelope = None
        if hints is not None:
            import msgspec
            envelope = msgspec.convert(hints, KvHintsEnvelope)
        prompt = TokensPrompt(prompt_token_ids=r["tokens"])
        if r.get("cache_salt"):
            prompt["cache_salt"] = r["cache_salt"]
        ids[engine.add_request(r["id"], prompt, sp, kv_hints=envelope)] = r["id"]
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            rid = ids.get(o.request_id, o.request_id)
            if rid not in first and o.outputs and o.outputs[0].token_ids:
                first[rid] = time.perf_counter() - t0
            if o.finished:
                c = o.outputs[0]
                lp = {str(k): v.logprob.hex() for k, v in c.logprobs[0].items()}
                out[rid] = {"tokens": list(c.token_ids), "logprobs": lp,
                            "cached": o.num_cached_tokens, "ttft_s": first.get(rid)}
    return {"results": out}


def stats(llm) -> dict:
    sched = core(llm).scheduler
    pool = sched.kv_cache_manager.block_pool
    res = {"free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks}
    conn = sched.connector
    if conn is not None:
        rt = conn.runtime
        res["pins"] = rt.blocks.pins_outstanding
        res["source_port"] = None if rt.source is None else rt.source.http_port
        counts = {}
        for metric in rt.metrics.registry.collect():
            for s in metric.samples:
                if s.name.endswith("_total") and s.value:
                    key = s.name + "".join(f"[{v}]" for v in s.labels.values())
                    counts[key] = s.value
        res["counters"] = counts
    return res


def local_reads(llm, on: bool) -> dict:
    """The puller's same-host reads on or off (``XferConfig.local_reads``): off, every
    source is read through UCX, as across hosts (``ucx_same_host_reads``)."""
    import dataclasses

    reads = core(llm).scheduler.connector.runtime.puller._reads
    reads.config = dataclasses.replace(reads.config, local_reads=on,
                                       ucx_same_host_reads=not on)
    return {"local_reads": on}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--no-connector", action="store_true")
    p.add_argument("--trust-unsigned-hints", action="store_true")
    p.add_argument("--remote-read", default="off", choices=["off", "host", "all"])
    p.add_argument("--transfer-timeout-s", type=float, default=3.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=64)
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    real_stdout = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to stderr; stdout carries only answers
    llm = build(args)
    real_stdout.write(json.dumps({"ready": True, **stats(llm)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "generate":
                ans = generate(llm, cmd["requests"])
            elif cmd["op"] == "stats":
                ans = stats(llm)
            elif cmd["op"] == "local_reads":  # off: every source read through UCX, as
                # across hosts
                ans = local_reads(llm, cmd["on"])
            elif cmd["op"] == "quit":
                break
            else:
                ans = {"error": f"unknown op {cmd['op']!r}"}
        except Exception as exc:  # the test reads the error
            import traceback
            traceback.print_exc()
            ans = {"error": f"{type(exc).__name__}: {exc}"}
        real_stdout.write(json.dumps(ans) + "\n")
    os._exit(0)  # vLLM's atexit hooks can outlive a test's patience


if __name__ == "__main__":
    main()
