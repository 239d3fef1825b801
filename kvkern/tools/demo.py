"""``kvkern demo``: two real workers, a KV-aware router, a small transformer; pull versus
recompute.

What it does (CPU by default, the GPU when one is present; loopback only)::

    1 start workers A and B (`kvkern worker`, one torch thread each) and an in-process router
    2 warm-up: one small request on each, one small hinted pull (UCX connection, state cache)
    3 route the shared prefix (P tokens) -> A by load; A prefills and caches it
    4 route prefix + question -> B by load; the router hints "A holds P tokens"
      B pulls P/T blocks from A (UCXX), then prefills only the question       = TTFT pull
    5 B recomputes the same prompt without its cache                          = TTFT recompute
    6 A answers the same prompt from its own cached prefix                    = the reference
      correct = B's first-token logits are bit-identical to A's (same KV, same arithmetic),
                within fp32 rounding of B's full prefill, and all greedy tokens agree
    7 sweep prefix lengths (steps 3-5 with fresh prompts) -> the pull/recompute crossover

``--json`` prints one JSON object as the last line; ``--plot FILE.png`` draws TTFT against
prefix length; ``--kernels`` runs the kernel demo instead (:mod:`kvkern.tools.kernel_demo`);
``--kill-source`` runs the fault check instead: the source is killed mid-pull and the request
must complete by recompute with the right tokens.

Every worker runs with the same ``--threads`` (default 1): torch's CPU kernels split work by
thread count, so bit identity across processes needs equal counts (see
:mod:`kvkern.serve.model`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DemoOptions", "main", "run_demo", "run_kill_check"]


@dataclass(kw_only=True)
class DemoOptions:
    model: str = "demo"
    device: str = "auto"
    prefix_tokens: int = 2048   # 4096 shows a larger gap, but its recomputes double the run
    question_tokens: int = 16
    new_tokens: int = 8
    sweep: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    threads: int = 1
    source_layout: str = "trtllm"
    dest_layout: str = "vllm_hnd"
    dialect: str = "kv_hint"
    num_blocks: int | None = None
    seed: int = 0
    repeats: int = 3            # each sweep point: best TTFT of this many runs
    start_timeout_s: float = 90.0
    request_timeout_s: float = 120.0
    extra_worker_args: tuple[str, ...] = ()
    log: Any = field(default=None, repr=False)  # progress printer


def _say(opts: DemoOptions, msg: str) -> None:
    if opts.log is not None:
        opts.log(msg)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _worker_args(opts: DemoOptions, layout: str, worker_id: str, num_blocks: int,
                 extra: tuple[str, ...] = ()) -> list[str]:
    return ["--model", opts.model, "--device", opts.device, "--layout", layout,
            "--num-blocks", str(num_blocks), "--worker-id", worker_id,
            "--host", "127.0.0.1", "--port", "0", "--allow", "127.0.0.0/8",
            # One-sided reads of the source's pool: both workers run on one host under one
            # user, where the OS lets each process read the other's memory anyway.
            "--remote-read", "host",
            # The sweep measures both sides at every length, so the cost guard must not skip
            # the short pulls it would judge not worth it.
            "--cost-guard", "off", "--log-level", "ERROR",
            *opts.extra_worker_args, *extra]


class _Fleet:
    """A fresh fleet secret for the demo's workers (in their environment) and its router."""

    def __init__(self) -> None:
        from kvkern.xfer.auth import SECRET_ENV, SECRET_FILE_ENV, Credential, generate_secret  # noqa: PLC0415,E501

        secret = generate_secret()
        self.env = {SECRET_ENV: secret, SECRET_FILE_ENV: ""}
        self.credential = Credential(secret, peer_id="demo-router")


def _model_config(name: str):
    from kvkern.serve.engine import MODELS  # noqa: PLC0415

    return MODELS[name]()


class _Client:
    """The demo's view of the two workers and the router (blocking HTTP, bounded)."""

    def __init__(self, router, urls: dict[str, str], timeout: float, credential) -> None:
        self.router = router
        self.urls = urls
        self.timeout = timeout
        self.credential = credential  # signs the router's hints, as `kvkern router` does

    def generate(self, worker: str, body: dict[str, Any]) -> dict[str, Any]:
        from kvkern.serve.httpjson import post_json  # noqa: PLC0415

        return post_json(f"{self.urls[worker]}/v1/generate", body, timeout=self.timeout)

    def routed(self, tokens: list[int], *, destination: str | None = None,
               **body: Any) -> tuple[Any, dict[str, Any]]:
        """Route through the router (hint attached), send, report the outcome back."""
        from kvkern.xfer.auth import sign_hint  # noqa: PLC0415
        from kvkern.xfer.hints import decode_hint  # noqa: PLC0415

        decision = self.router.route(tokens, destination=destination)
        hint = dict(decision.hint or {})
        if hint:
            hint.update(sign_hint(self.credential, decode_hint(hint), tokens))
        ok = False
        try:
            out = self.generate(decision.destination, {"token_ids": tokens, **body, **hint})
            ok = True
            return decision, out
        finally:
            self.router.finish(decision, ok=ok)


def _logits(out: dict[str, Any]):
    from kvkern.serve.engine import decode_logits  # noqa: PLC0415

    return decode_logits(out["logits"])


def _measure(client: _Client, source: str, dest: str, prefix: list[int],
             question: list[int], new_tokens: int, *, via_load: bool = False) -> dict[str, Any]:
    """Warm ``source`` with ``prefix``; run prefix+question on ``dest`` cold (recompute) and
    hinted (pull). Returns both responses and the routing decisions."""
    prompt = prefix + question
    warm_dec, _ = client.routed(prefix, destination=None if via_load else source,
                                max_new_tokens=1)
    dec, pulled = client.routed(prompt, destination=None if via_load else dest,
                                max_new_tokens=new_tokens, return_logits=True)
    recompute = client.generate(dec.destination, {"token_ids": prompt, "use_cache": False,
                                                  "max_new_tokens": new_tokens,
                                                  "return_logits": True})
    return {"warm": warm_dec, "decision": dec, "recompute": recompute, "pulled": pulled,
            "prompt": prompt}


def _row(prefix_len: int, m: dict[str, Any]) -> dict[str, Any]:
    pulled, rec = m["pulled"], m["recompute"]
    pull = pulled.get("pull") or {}
    phases = pull.get("phases") or {}
    nbytes = int(pull.get("bytes_transferred") or 0)
    xfer_s = phases.get("transfer") or 0.0
    return {
        "prefix_tokens": prefix_len,
        "prompt_tokens": len(m["prompt"]),
        "ttft_pull_s": pulled["ttft_s"],
        "ttft_recompute_s": rec["ttft_s"],
        "pull_wait_s": pulled.get("pull_wait_s", 0.0),
        "pulled_tokens": pulled.get("pulled_tokens", 0),
        "cached_tokens": pulled.get("cached_tokens", 0),
        "blocks_transferred": int(pull.get("blocks_transferred") or 0),
        "bytes_transferred": nbytes,
        "transfer_gbps": (nbytes / xfer_s / 1e9) if xfer_s > 0 else None,
        "pull_total_s": phases.get("total"),
        "fallback": pulled.get("fallback"),
        "tokens_equal": pulled["tokens"] == rec["tokens"],
    }


def _best(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Merge two runs of one sweep point: the lower TTFT of each side (a shared machine
    adds noise, never removes it)."""
    out = dict(a)
    for key in ("ttft_pull_s", "ttft_recompute_s"):
        out[key] = min(a[key], b[key])
    out["fallback"] = a["fallback"] or b["fallback"]
    out["tokens_equal"] = a["tokens_equal"] and b["tokens_equal"]
    out["repeats"] = a.get("repeats", 1) + 1
    return out


def _crossover(rows: list[dict[str, Any]]) -> tuple[int | None, int | None, str]:
    """Where pulling starts to win, from measured points only: ``(tokens, below, note)``.

    ``tokens`` is the shortest measured prefix length from which the pull's TTFT is below
    recompute's at that and every longer measured length, when some shorter length lost;
    ``below`` is the shortest measured length when the pull won at every one (the crossover
    lies below it, unmeasured); both are None when the pull never wins at the longest."""
    pts = sorted((r["prefix_tokens"], r["ttft_recompute_s"] - r["ttft_pull_s"])
                 for r in rows if r["fallback"] is None)
    if not pts:
        return None, None, "no successful pull"
    last_loss = max((i for i, (_, d) in enumerate(pts) if d <= 0), default=None)
    if last_loss is None:
        return None, pts[0][0], (f"below {pts[0][0]} tokens: the pull wins at every measured "
                                 f"length, {pts[0][0]}-{pts[-1][0]}")
    if last_loss == len(pts) - 1:
        return None, None, f"none: the pull does not win up to {pts[-1][0]} tokens"
    x0, x1 = pts[last_loss][0], pts[last_loss + 1][0]
    return x1, None, f"{x1} tokens: the pull wins from {x1} on and loses at {x0}"


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the demo; returns the result dictionary (see :func:`main` for the printout)."""
    from kvkern.serve.procs import start_workers  # noqa: PLC0415
    from kvkern.serve.router import KVRouter  # noqa: PLC0415

    t_start = time.perf_counter()
    fleet = _Fleet()
    cfg = _model_config(opts.model)
    T = cfg.block_size
    sweep = sorted({n for n in opts.sweep if 0 < n <= cfg.max_seq_len} | {opts.prefix_tokens})
    need = sum(-(-(n + opts.question_tokens + opts.new_tokens) // T) for n in sweep)
    num_blocks = opts.num_blocks or max(256, 2 * need + 64)
    _say(opts, f"starting workers A ({opts.source_layout}) and B ({opts.dest_layout}): "
               f"model {opts.model}, {num_blocks} blocks of {T} tokens, "
               f"{opts.threads} thread(s) each")
    procs = start_workers({
        "A": _worker_args(opts, opts.source_layout, "A", num_blocks),
        "B": _worker_args(opts, opts.dest_layout, "B", num_blocks),
    }, threads=opts.threads, timeout=opts.start_timeout_s, env=fleet.env)
    try:
        info = {n: p.info for n, p in procs.items()}
        _say(opts, f"  A {info['A']['url']}  B {info['B']['url']}  device "
                   f"{info['A']['device']}  ({time.perf_counter() - t_start:.1f} s)")
        router = KVRouter(T, dialect=opts.dialect)
        for name, p in procs.items():
            router.add_worker(name, p.url)
        client = _Client(router, {n: p.url for n, p in procs.items()}, opts.request_timeout_s,
                         fleet.credential)
        fallbacks: Counter[str] = Counter()
        first_pull = _warm_up(opts, client, cfg, fallbacks)
        question = _tokens(opts.question_tokens, cfg.vocab_size, opts.seed + 1)
        rows = _sweep(opts, client, cfg.vocab_size,
                      [n for n in sweep if n != opts.prefix_tokens], question, fallbacks)
        res = _main_run(opts, client, cfg.vocab_size, question, fallbacks)
        rows.append(res.pop("_row"))
        rows.sort(key=lambda r: r["prefix_tokens"])
        crossover, crossover_below, crossover_note = _crossover(rows)
        _say(opts, f"crossover: {crossover_note}")
        res.update({
            "first_pull_ttft_s": first_pull["ttft_s"] if first_pull else None,
            "crossover_tokens": crossover,
            "crossover_below": crossover_below,
            "crossover_note": crossover_note,
            "fallbacks": dict(fallbacks),
            "sweep": rows,
            "model": opts.model,
            "device": info["A"]["device"],
            "layouts": {"A": opts.source_layout, "B": opts.dest_layout},
            "threads": opts.threads,
            "elapsed_s": time.perf_counter() - t_start,
        })
        return res
    finally:
        for p in procs.values():
            p.stop()


def _warm_up(opts: DemoOptions, client: _Client, cfg: Any,
             fallbacks: Counter[str]) -> dict | None:
    """First forwards, first UCX connection and state fetch (both ways); the first pull
    A -> B."""
    T, vocab = cfg.block_size, cfg.vocab_size
    _say(opts, "warm-up: first forwards and a first small pull each way")
    for name in ("A", "B"):
        client.generate(name, {"token_ids": _tokens(3 * T, vocab, 99), "max_new_tokens": 2,
                               "use_cache": False})
    first_pull = None
    # B -> A first, so that A was chosen longest ago and the load rule sends the
    # main prefix to A and the main prompt to B.
    for src, dst, seed in (("B", "A", 102), ("A", "B", 101)):
        m = _measure(client, src, dst, _tokens(2 * T, vocab, seed), [1, 2, 3], 1)
        fb = m["pulled"].get("fallback")
        if fb:
            fallbacks[fb] += 1
        if src == "A":
            first_pull = m["pulled"]
    return first_pull


def _sweep(opts: DemoOptions, client: _Client, vocab: int, sizes: list[int],
           question: list[int], fallbacks: Counter[str]) -> list[dict]:
    """TTFT with a pull and by recompute per prefix size, best of ``opts.repeats`` (before
    the main run, so the main run sees warm buffers and connections)."""
    rows = []
    _say(opts, f"sweep: {', '.join(map(str, sizes))} tokens (TTFT, best of "
               f"{opts.repeats} runs each)")
    for i, n in enumerate(sizes):
        row = None
        for rep in range(opts.repeats):
            m = _measure(client, "A", "B",
                         _tokens(n, vocab, opts.seed + 1000 + 100 * i + rep), question, 1)
            r = _row(n, m)
            if r["fallback"]:
                fallbacks[r["fallback"]] += 1
            row = r if row is None else _best(row, r)
        rows.append(row)
        _say(opts, f"  {n:6d} tokens: pull {row['ttft_pull_s'] * 1e3:8.1f} ms  recompute "
                   f"{row['ttft_recompute_s'] * 1e3:8.1f} ms"
                   + (f"  [fallback {row['fallback']}]" if row["fallback"] else ""))
    return rows


def _main_run(opts: DemoOptions, client: _Client, vocab: int, question: list[int],
              fallbacks: Counter[str]) -> dict[str, Any]:
    """The main run: destination and hint chosen by the router; the correctness check."""
    from kvkern.serve.router import DIALECT_NAMES  # noqa: PLC0415

    P = opts.prefix_tokens
    _say(opts, f"main: shared prefix of {P} tokens + a {opts.question_tokens}-token "
               "question")
    prefix = _tokens(P, vocab, opts.seed)
    main_m = _measure(client, "A", "B", prefix, question, opts.new_tokens, via_load=True)
    source, dest = main_m["warm"].destination, main_m["decision"].destination
    pulled, recompute = main_m["pulled"], main_m["recompute"]
    if pulled.get("fallback"):
        fallbacks[pulled["fallback"]] += 1
    _say(opts, f"  router: prefix -> {source} (load); prompt -> {dest} (load), hint "
               f"source {main_m['decision'].hint_source} with "
               f"{main_m['decision'].hint_blocks} blocks")
    reference = client.generate(source, {"token_ids": main_m["prompt"],
                                         "max_new_tokens": opts.new_tokens,
                                         "return_logits": True})
    check = _check(pulled, reference, recompute)
    correct = check["correct"] and source != dest \
        and main_m["decision"].hint_source == source
    r0 = _row(P, main_m)
    _say(opts, f"  pulled {r0['blocks_transferred']} blocks, "
               f"{r0['bytes_transferred'] / 2**20:.1f} MiB in "
               f"{(r0['pull_total_s'] or 0) * 1e3:.1f} ms"
               + (f" ({r0['transfer_gbps']:.2f} GB/s)"
                  if r0["transfer_gbps"] else ""))
    _say(opts, f"  TTFT pull {pulled['ttft_s'] * 1e3:.1f} ms vs recompute "
               f"{recompute['ttft_s'] * 1e3:.1f} ms "
               f"({recompute['ttft_s'] / max(pulled['ttft_s'], 1e-9):.1f}x)")
    _say(opts, f"  correct: {correct} (bit-identical to {source}'s own cache: "
               f"{check['bit_identical']}; vs full prefill max |diff| "
               f"{check['max_abs_diff']:.2e}; tokens equal: {check['tokens_equal']})")
    return {
        "correct": correct,
        "bit_identical": check["bit_identical"],
        "max_abs_diff_vs_recompute": check["max_abs_diff"],
        "tokens_equal": check["tokens_equal"],
        "tokens": pulled["tokens"],
        "prefix_tokens": P,
        "prompt_tokens": len(main_m["prompt"]),
        "source": source,
        "destination": dest,
        "hint_dialect": DIALECT_NAMES[opts.dialect],  # as workers and the router name it
        "blocks_transferred": r0["blocks_transferred"],
        "bytes_transferred": r0["bytes_transferred"],
        "transfer_gbps": r0["transfer_gbps"],
        "pull_total_s": r0["pull_total_s"],
        "pull_phases_s": (pulled.get("pull") or {}).get("phases"),
        "ttft_pull_s": pulled["ttft_s"],
        "ttft_recompute_s": recompute["ttft_s"],
        "speedup": recompute["ttft_s"] / max(pulled["ttft_s"], 1e-9),
        "_row": r0,
    }


def _check(pulled: dict, reference: dict, recompute: dict) -> dict[str, Any]:
    """Pulled logits bit-identical to the source's own cache and close to a full prefill;
    tokens equal on all three; the pull really used the source's prefix."""
    import torch  # noqa: PLC0415

    lp, lr, lf = _logits(pulled), _logits(reference), _logits(recompute)
    bit_identical = bool(torch.equal(lp.view(torch.int32), lr.view(torch.int32)))
    max_abs_diff = float((lp - lf).abs().max())
    scale = float(lf.abs().max())
    close = bool(torch.allclose(lp, lf, rtol=1e-4, atol=1e-4 * max(1.0, scale)))
    tokens_equal = pulled["tokens"] == reference["tokens"] == recompute["tokens"]
    same_prefix = (pulled["cached_tokens"] == reference["cached_tokens"]
                   and pulled["pulled_tokens"] > 0)
    return {"correct": bit_identical and close and tokens_equal and same_prefix,
            "bit_identical": bit_identical, "max_abs_diff": max_abs_diff,
            "tokens_equal": tokens_equal}


def run_kill_check(opts: DemoOptions, *, stall_s: float = 30.0) -> dict[str, Any]:
    """Kill the source mid-pull: A stalls before every chunk it sends; once A reports a send
    in flight, A gets SIGKILL. B's request must complete by recompute (a named fallback) with
    the tokens of a cold run."""
    from kvkern.serve.httpjson import get_text  # noqa: PLC0415
    from kvkern.serve.procs import start_workers  # noqa: PLC0415
    from kvkern.serve.router import KVRouter  # noqa: PLC0415

    t_start = time.perf_counter()
    fleet = _Fleet()
    cfg = _model_config(opts.model)
    T = cfg.block_size
    # B asks A before reading (--direct-reads off), so A's stalled reply is what B waits on
    bounds = ("--metadata-timeout-s", "2", "--transfer-timeout-s", "5", "--deadline-s", "10",
              "--direct-reads", "off")
    procs = start_workers({
        "A": _worker_args(opts, opts.source_layout, "A", 256,
                          ("--debug-send-delay-s", str(stall_s))),
        "B": _worker_args(opts, opts.dest_layout, "B", 256, bounds),
    }, threads=opts.threads, timeout=opts.start_timeout_s, env=fleet.env)
    try:
        router = KVRouter(T, dialect=opts.dialect)
        for name, p in procs.items():
            router.add_worker(name, p.url)
        client = _Client(router, {n: p.url for n, p in procs.items()}, opts.request_timeout_s,
                         fleet.credential)
        prefix = _tokens(opts.prefix_tokens, cfg.vocab_size, opts.seed)
        question = _tokens(opts.question_tokens, cfg.vocab_size, opts.seed + 1)
        prompt = prefix + question
        client.routed(prefix, destination="A", max_new_tokens=1)
        _say(opts, "kill check: A holds the prefix and stalls its sends; B pulls from A")
        result: dict[str, Any] = {}

        def request() -> None:
            try:
                result["decision"], result["out"] = client.routed(
                    prompt, destination="B", max_new_tokens=opts.new_tokens)
            except Exception as exc:  # noqa: BLE001 (reported below)
                result["error"] = repr(exc)

        th = threading.Thread(target=request, daemon=True)
        th.start()
        deadline = time.monotonic() + 20.0
        in_flight = False
        while time.monotonic() < deadline and th.is_alive():
            with contextlib.suppress(Exception):
                metrics = get_text(f"{procs['A'].url}/metrics", timeout=2.0)
                in_flight = any(line.startswith("kvkern_source_sends_in_flight")
                                and float(line.split()[-1]) >= 1
                                for line in metrics.splitlines())
            if in_flight:
                break
            time.sleep(0.05)
        t_kill = time.perf_counter()
        procs["A"].kill()
        _say(opts, f"  A killed (send in flight: {in_flight})")
        th.join(opts.request_timeout_s)
        if th.is_alive() or "out" not in result:
            raise RuntimeError(f"B's request did not complete: {result.get('error')}\n"
                               f"{procs['B'].output()}")
        out = result["out"]
        cold = client.generate("B", {"token_ids": prompt, "max_new_tokens": opts.new_tokens,
                                     "use_cache": False})
        ok = (out["fallback"] is not None and out["pulled_tokens"] == 0
              and out["tokens"] == cold["tokens"])
        _say(opts, f"  B completed by recompute: fallback {out['fallback']!r}, tokens "
                   f"{'match' if out['tokens'] == cold['tokens'] else 'DIFFER'} "
                   f"({time.perf_counter() - t_kill:.2f} s after the kill)")
        return {"ok": ok, "send_in_flight_at_kill": in_flight, "fallback": out["fallback"],
                "tokens": out["tokens"], "expected_tokens": cold["tokens"],
                "pull": out.get("pull"), "recovered_s": time.perf_counter() - t_kill,
                "elapsed_s": time.perf_counter() - t_start}
    finally:
        for p in procs.values():
            p.stop()


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in result["sweep"] if r["fallback"] is None]
    xs = [r["prefix_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["ttft_recompute_s"] * 1e3 for r in rows], "o-", label="local recompute")
    ax.plot(xs, [r["ttft_pull_s"] * 1e3 for r in rows], "s-", label="pull from peer + prefill")
    if result["crossover_tokens"]:
        ax.axvline(result["crossover_tokens"], color="gray", ls="--",
                   label=f"crossover ~{result['crossover_tokens']} tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"kvkern demo: {result['model']} model on {result['device']}, "
                 f"{result['threads']} thread(s)/worker")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ints(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(int(x) for x in text.split(","))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default."""


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--kernels" in argv:
        from kvkern.tools.kernel_demo import main as kernel_main  # noqa: PLC0415

        argv.remove("--kernels")
        return kernel_main(argv)
    d = DemoOptions()
    p = argparse.ArgumentParser(prog="kvkern demo", description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--kernels", action="store_true", help="run the kernel demo instead")
    p.add_argument("--model", choices=("tiny", "demo"), default=d.model,
                   help="the workers' built-in model")
    p.add_argument("--device", default=d.device, help="cpu, cuda or auto")
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                   help="length of the shared prefix B pulls from A")
    p.add_argument("--question-tokens", type=int, default=d.question_tokens,
                   help="tokens after the prefix, prefilled by B")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens,
                   help="tokens generated per request")
    p.add_argument("--sweep", type=_ints, default=d.sweep,
                   help="comma-separated prefix lengths, or none")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads per worker (equal on both for bit identity)")
    p.add_argument("--source-layout", default=d.source_layout, help="KV pool layout of A")
    p.add_argument("--dest-layout", default=d.dest_layout, help="KV pool layout of B")
    p.add_argument("--dialect", default=d.dialect,
                   choices=("kv_hint", "kv_hints", "dynamo", "llm-d"),
                   help="hint dialect the router writes")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random prompts")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="best of this many runs per sweep point")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw TTFT against prefix length into this file (matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--kill-source", action="store_true",
                   help="instead: kill the source mid-pull and check the recompute fallback")
    a = p.parse_args(argv)
    out = sys.stderr if a.json else sys.stdout
    opts = DemoOptions(model=a.model, device=a.device, prefix_tokens=a.prefix_tokens,
                       question_tokens=a.question_tokens, new_tokens=a.new_tokens,
                       sweep=a.sweep, threads=a.threads, source_layout=a.source_layout,
                       dest_layout=a.dest_layout, dialect=a.dialect, seed=a.seed,
                       repeats=max(1, a.repeats),
                       log=lambda m: print(m, file=out, flush=True))
    if a.kill_source:
        res = run_kill_check(opts)
        if a.json:
            print(json.dumps(res), flush=True)
        return 0 if res["ok"] else 1
    res = run_demo(opts)
    if a.plot:
        try:
            _plot(res, a.plot)
            print(f"plot written to {a.plot}", file=out, flush=True)
        except ImportError as exc:
            print(f"no plot: {exc} (pip install matplotlib)", file=out, flush=True)
    print(f"done in {res['elapsed_s']:.1f} s: correct={res['correct']}, TTFT pull "
          f"{res['ttft_pull_s'] * 1e3:.1f} ms vs recompute {res['ttft_recompute_s'] * 1e3:.1f} "
          f"ms at {res['prefix_tokens']} tokens, crossover {res['crossover_note']}, "
          f"fallbacks {res['fallbacks'] or 'none'}", file=out, flush=True)
    if a.json:
        print(json.dumps(res), flush=True)
    return 0 if res["correct"] else 1
