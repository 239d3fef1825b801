"""Tune kvkern's pack/unpack launch configuration for the current GPU.

    PYTHONPATH=. python3 bench/autotune.py [--write] [--table PATH]

For each row kind (dense HND/TRT-LLM rows, strided NHD rows) and row-size bucket it times
pack and unpack for every (tile bytes, warps) candidate, keeps the best by the slower of the
two, and with ``--write`` merges the winners into ``kvkern/kernels/tuned_configs.json`` under
this device's name. The kernels read that table at launch (``KVKERN_TUNED_CONFIGS`` points
elsewhere) and fall back to heuristics for devices or buckets it lacks. Few knobs, a narrow
key: the tile size and warps are what moved bandwidth in the sweeps; block ids and layer
counts do not change the best configuration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from kvkern.kernels.pack import _TUNED_PATH, config_override, pack, tuning_key, unpack  # noqa: E402
from kvkern.layout.kv_layout import KVLayout  # noqa: E402

TILE_BYTES = (4096, 8192, 16384, 32768)
WARPS = (2, 4, 8)
# (layout, block_size, head_dim) per bucket; bf16 rows of T x D
SHAPES = [("vllm_hnd", 1, 128), ("vllm_hnd", 4, 128), ("vllm_hnd", 16, 128),
          ("vllm_hnd", 64, 128), ("vllm_hnd", 256, 128), ("vllm_nhd", 16, 128),
          ("vllm_nhd", 64, 128)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--write", action="store_true", help="merge winners into the tuned table")
    ap.add_argument("--table", default=os.environ.get("KVKERN_TUNED_CONFIGS", str(_TUNED_PATH)))
    ap.add_argument("--bytes", type=int, default=128 << 20, help="payload per measurement")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not smoke:
        print("no CUDA device: use --smoke to check the script on CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-interpreter"
    shapes = [("vllm_hnd", 2, 8), ("vllm_nhd", 2, 8)] if smoke else SHAPES
    tiles, warps_list = ((4096,), (4,)) if smoke else (TILE_BYTES, WARPS)
    target = 1 << 16 if smoke else args.bytes

    def timeit(fn) -> float:
        if device.type == "cuda":
            return triton.testing.do_bench(fn, warmup=10, rep=40) / 1e3
        fn()
        return 1.0

    def tune_shape(layout_name: str, t: int, d: int) -> tuple[str, dict]:
        per_block = 4 * 2 * 8 * t * d * 2
        nb = max(8, 2 * (target // per_block))
        layout = KVLayout.named(layout_name, num_blocks=nb, num_layers=4, num_heads=8,
                                block_size=t, head_dim=d, dtype=torch.bfloat16)
        pool = layout.allocate(device, fill="zeros")
        ids = torch.randperm(nb)[: nb // 2].to(device)
        staging = pack(pool, layout, ids)
        nbytes = staging.numel() * staging.element_size()
        key = tuning_key(t * d * 2, dense_rows=layout_name != "vllm_nhd" or t == 1)
        best = None
        for tile in tiles:
            for warps in warps_list:
                with config_override(tile_bytes=tile, num_warps=warps):  # (ids checked once)
                    tp = timeit(lambda: pack(pool, layout, ids, staging, validate=False))
                    tu = timeit(lambda: unpack(staging, pool, layout, ids, validate=False))
                gbps = nbytes / max(tp, tu) / 1e9
                if best is None or gbps > best["gbps"]:
                    best = {"tile_bytes": tile, "num_warps": warps, "gbps": round(gbps, 1)}
        return key, best

    def save(winners: dict) -> None:
        """The table with this device's winners so far: a run stopped at its time limit keeps
        the shapes it finished."""
        entry = {"configs": winners, "torch": torch.__version__, "triton": triton.__version__,
                 "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")}
        print(json.dumps({name: entry}, indent=1), flush=True)
        if args.write and not smoke:
            path = Path(args.table)
            table = json.loads(path.read_text()) if path.exists() else {}
            table[name] = entry
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            print(f"wrote {path}", flush=True)

    winners = {}
    for layout_name, t, d in shapes:
        key, best = tune_shape(layout_name, t, d)
        winners[key] = best
        print(f"{key:>14s} ({layout_name} T={t} D={d}): tile {best['tile_bytes']} B, "
              f"{best['num_warps']} warps, {best['gbps']} GB/s (slower of pack/unpack)",
              flush=True)
        save(winners)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
