"""GPU sweep of kvkern's pack/unpack kernels against copy baselines of the same bytes.

Run from the source tree with only torch and Triton installed::

    PYTHONPATH=. python3 bench/gpu_kernels.py [--out DIR] [--quick]

It sweeps the contiguous run size (64 B .. 64 KiB, HND rows of ``block_size x head_dim``),
the layouts (TRT-LLM, vLLM NHD, vLLM HND), head-sliced packs (a TP shard), bf16 and fp8,
and a capped program count. For each case it reports payload GB/s and read+write GB/s, the
ratio to max(torch contiguous ``copy_``, a plain Triton copy) of the same bytes, and the ratio
to a per-block ``copy_`` loop and to ``index_select``. It writes a CSV and (when matplotlib
is present) a PNG, and prints its summary table last. ``--smoke`` runs tiny sizes on CPU
under the Triton interpreter to check the script itself.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvkern.kernels.pack import pack, unpack  # noqa: E402
from kvkern.kernels.reference import as_bits  # noqa: E402
from kvkern.layout.kv_layout import KVLayout  # noqa: E402
from kvkern.tools.provenance import git_state  # noqa: E402


@triton.jit
def _plain_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """The simplest vectorised Triton copy: the Triton baseline for the same bytes."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def plain_triton_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.numel()
    _plain_copy_kernel[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=8)


def env_info() -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    git = git_state()
    commit = "" if git["commit"] == "unknown" else git["commit"]
    return {
        "device": torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({platform.processor()})",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "commit": commit or os.environ.get("KVKERN_COMMIT", "unknown"),
        "dirty": git["dirty"],
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def timer(device: torch.device, rep_ms: int):
    """Returns f(fn) -> (median, p20, p80) seconds."""
    if device.type == "cuda":
        def bench(fn):
            q = triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms,
                                        quantiles=[0.5, 0.2, 0.8])
            return tuple(x / 1e3 for x in q)
        return bench

    def bench_cpu(fn):
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[1], ts[0], ts[-1]
    return bench_cpu


def loop_units(layout: KVLayout, pool, ids, staging, heads):
    """The per-block baseline: one ``copy_`` per contiguous unit an engine would memcpy
    (a whole block for one-tensor pools, a block of one layer for per-layer pools)."""
    h0, h1 = heads
    pairs = []
    tensors = layout.tensors(pool)
    for i, b in enumerate(ids.tolist()):
        if layout.per_layer:
            for li, t in enumerate(tensors):
                pairs.append((staging[i, li], layout.canonical_view(t)[b][:, h0:h1]))
        else:
            pairs.append((staging[i], layout.canonical_view(tensors[0])[b][:, :, h0:h1]))
    return pairs


def run_case(case: dict, device: torch.device, bench, target_bytes: int, check: bool) -> dict:
    dtype = case["dtype"]
    layout = KVLayout.named(case["layout"], num_blocks=case["num_blocks"], num_layers=case["L"],
                            num_heads=case["H"], block_size=case["T"], head_dim=case["D"],
                            dtype=dtype)
    h0, h1 = case.get("heads") or (0, case["H"])
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    per_block = layout.bytes_per_block * (h1 - h0) // case["H"]
    n = max(1, min(layout.num_blocks // 2, target_bytes // per_block))
    pool = layout.allocate(device, fill="zeros")
    for t in layout.tensors(pool):  # random bytes, made on the device
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, device=device))
    ids = torch.randperm(layout.num_blocks, generator=gen)[:n].to(device)
    heads = (h0, h1)
    staging = pack(pool, layout, ids, heads=heads)
    nbytes = staging.numel() * staging.element_size()
    if check:
        expect = as_bits(layout.logical(pool)[ids][:, :, :, h0:h1]).cpu()
        assert torch.equal(as_bits(staging).cpu(), expect), f"pack mismatch in {case}"
        dst = layout.allocate(device, fill="zeros")
        unpack(staging, dst, layout, ids, heads=heads)
        got = as_bits(layout.logical(dst)[ids][:, :, :, h0:h1]).cpu()
        assert torch.equal(got, expect), f"unpack mismatch in {case}"
        del dst, got, expect
    mp = case.get("max_programs")
    # kernel figures: ids already on the device and trusted (validate=False), as an engine's
    # block table; the full call with host-validated list ids is reported beside them
    t_pack = bench(lambda: pack(pool, layout, ids, staging, heads=heads, max_programs=mp,
                                validate=False))
    t_unpack = bench(lambda: unpack(staging, pool, layout, ids, heads=heads, max_programs=mp,
                                    validate=False))
    id_list = ids.tolist()
    t_pack_full = bench(lambda: pack(pool, layout, id_list, staging, heads=heads, max_programs=mp))
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_b = torch.empty_like(flat_a)
    t_copy = bench(lambda: flat_b.copy_(flat_a))
    t_tcopy = bench(lambda: plain_triton_copy(flat_a, flat_b))
    best_copy = min(t_copy[0], t_tcopy[0])

    # per-block copy_ loop over at most 2048 units, compared as bandwidth
    loop_n = max(1, min(n, 2048 // (layout.num_layers if layout.per_layer else 1)))
    pairs = loop_units(layout, pool, ids[:loop_n], staging[:loop_n], heads)
    loop_bytes = sum(d.numel() * d.element_size() for d, _ in pairs)

    def loop():
        for d, s in pairs:
            d.copy_(s)
    t_loop = bench(loop)

    def idx_select():
        if layout.per_layer:
            for t in layout.tensors(pool):
                torch.index_select(layout.canonical_view(t)[:, :, h0:h1], 0, ids)
        else:
            torch.index_select(layout.canonical_view(pool)[:, :, :, h0:h1], 0, ids)
    t_idx = bench(idx_select)
    gbps = lambda b, t: b / t / 1e9
    pack_gbps, unpack_gbps = gbps(nbytes, t_pack[0]), gbps(nbytes, t_unpack[0])
    return {
        **{k: (str(v).removeprefix("torch.") if k == "dtype" else v) for k, v in case.items()
           if k != "heads"},
        "heads": f"{h0}:{h1}", "run_bytes": layout.contiguous_run_bytes, "blocks": n,
        "bytes": nbytes, "loop_unit_bytes": loop_bytes // max(1, len(pairs)),
        "pack_gbps": pack_gbps, "pack_gbps_p20": gbps(nbytes, t_pack[2]),
        "pack_call_gbps": gbps(nbytes, t_pack_full[0]),
        "call_overhead_us": (t_pack_full[0] - t_pack[0]) * 1e6,
        "pack_gbps_p80": gbps(nbytes, t_pack[1]), "unpack_gbps": unpack_gbps,
        "pack_rw_gbps": 2 * pack_gbps, "unpack_rw_gbps": 2 * unpack_gbps,
        "copy_gbps": gbps(nbytes, t_copy[0]), "triton_copy_gbps": gbps(nbytes, t_tcopy[0]),
        "pack_vs_copy": best_copy / t_pack[0], "unpack_vs_copy": best_copy / t_unpack[0],
        "loop_gbps": gbps(loop_bytes, t_loop[0]), "index_select_gbps": gbps(nbytes, t_idx[0]),
        "pack_vs_loop": pack_gbps / gbps(loop_bytes, t_loop[0]),
        "pack_vs_index_select": t_idx[0] / t_pack[0],
    }


def cases(quick: bool, smoke: bool) -> list[dict]:
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    base = dict(L=8, H=8, D=128, dtype=bf16)
    out = []
    if smoke:
        return [dict(name="smoke-hnd", layout="vllm_hnd", L=2, H=4, T=4, D=8, dtype=bf16,
                     num_blocks=16),
                dict(name="smoke-trt-heads", layout="trtllm", L=2, H=4, T=4, D=8, dtype=fp8,
                     num_blocks=16, heads=(1, 3))]
    # run-size sweep: HND rows of T x D; 64 B .. 64 KiB
    sweep = [(32, 1), (64, 1), (128, 1), (128, 2), (128, 4), (128, 8), (128, 16), (128, 32),
             (128, 64), (128, 128), (128, 256)]
    if quick:
        sweep = [(32, 1), (128, 1), (128, 8), (128, 16), (128, 64), (128, 256)]
    for d, t in sweep:
        out.append(dict(base, name=f"run-{d * t * 2}B", layout="vllm_hnd", T=t, D=d,
                        num_blocks=max(64, (1 << 30) // (8 * 2 * 8 * t * d * 2) // 2 * 2)))
    for name in ("trtllm", "vllm_nhd", "vllm_hnd"):
        for dtype, tag in ((bf16, "bf16"), (fp8, "fp8")):
            out.append(dict(base, name=f"{name}-{tag}", layout=name, T=16, dtype=dtype,
                            num_blocks=4096))
        out.append(dict(base, name=f"{name}-tp4-heads", layout=name, T=16, num_blocks=4096,
                        heads=(2, 4)))
    out.append(dict(base, name="trtllm-32prog", layout="trtllm", T=16, num_blocks=4096,
                    max_programs=32))
    return out


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = [r for r in rows if str(r["name"]).startswith("run-")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("pack_gbps", "kvkern pack"), ("unpack_gbps", "kvkern unpack"),
                       ("copy_gbps", "torch copy_"), ("triton_copy_gbps", "Triton copy"),
                       ("loop_gbps", "per-block copy_ loop")):
        ax.plot([r["run_bytes"] for r in sweep], [r[key] for r in sweep], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("contiguous run (bytes)")
    ax.set_ylabel("payload GB/s")
    ax.set_title(f"kvkern pack/unpack, {rows[0].get('device', '')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter)")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--plot-only", metavar="CSV", help="only draw the PNG from an earlier CSV")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        with open(args.plot_only) as f:
            rows = [{k: (float(v) if k.endswith(("gbps", "bytes")) else v) for k, v in r.items()}
                    for r in csv.DictReader(f)]
        print("plot:", plot(rows, Path(args.plot_only).with_suffix(".png")))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: use --smoke to check the script on CPU", file=sys.stderr)
        return 2
    info = env_info()
    print("env:", " | ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    bench = timer(device, args.rep_ms)
    target = (8 << 20) if args.smoke else (256 << 20)
    rows = []
    t_start = time.time()
    for case in cases(args.quick, args.smoke):
        row = {**info, **run_case(case, device, bench, target, check=True)}
        rows.append(row)
        best_copy = max(row["copy_gbps"], row["triton_copy_gbps"])
        print(f"{row['name']:>18s} run={row['run_bytes']:>6d}B pack={row['pack_gbps']:8.1f} "
              f"unpack={row['unpack_gbps']:8.1f} copy={best_copy:8.1f} GB/s "
              f"({time.time() - t_start:.0f}s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    csv_path = out / "gpu_kernels.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    drew = plot(rows, out / "gpu_kernels.png")
    print(f"wrote {csv_path}" + (f" and {out / 'gpu_kernels.png'}" if drew else
                                 " (no matplotlib: plot later with --plot-only CSV)"))
    print()
    print(f"SUMMARY  device={info['device']} torch={info['torch']} triton={info['triton']} "
          f"commit={info['commit']} date={info['date']}")
    hdr = (f"{'case':>18s} {'dtype':>13s} {'run B':>6s} {'heads':>5s} {'pack GB/s':>9s} "
           f"{'unpack':>7s} {'rw pack':>8s} {'xcopy p':>7s} {'xcopy u':>7s} {'xloop':>6s} "
           f"{'xidxsel':>7s} {'call GB/s':>9s}")
    print(hdr)
    for r in rows:
        print(f"{r['name']:>18s} {r['dtype']:>13s} {r['run_bytes']:>6d} {r['heads']:>5s} "
              f"{r['pack_gbps']:9.1f} {r['unpack_gbps']:7.1f} {r['pack_rw_gbps']:8.1f} "
              f"{r['pack_vs_copy']:7.2f} {r['unpack_vs_copy']:7.2f} {r['pack_vs_loop']:6.1f} "
              f"{r['pack_vs_index_select']:7.2f} {r['pack_call_gbps']:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
