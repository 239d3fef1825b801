"""The kernel demo: pack a random set of blocks out of a TRT-LLM-layout pool, unpack them
into a vLLM HND pool, check the logical KV bit for bit, and print the bandwidth next to a
contiguous copy of the same bytes on the current device."""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvkern.kernels.pack import pack, unpack
from kvkern.kernels.reference import as_bits
from kvkern.layout.kv_layout import KVLayout


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run(*, num_blocks: int = 2048, n_pull: int = 512, num_layers: int = 8, num_heads: int = 8,
        block_size: int = 16, head_dim: int = 128, dtype=torch.bfloat16, device=None,
        iters: int = 5, seed: int = 0) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = dict(num_blocks=num_blocks, num_layers=num_layers, num_heads=num_heads,
                 block_size=block_size, head_dim=head_dim, dtype=dtype)
    src_layout, dst_layout = KVLayout.trtllm(**sizes), KVLayout.vllm_hnd(**sizes)
    gen = torch.Generator().manual_seed(seed)
    src = src_layout.allocate(device, fill="random", generator=gen)
    dst = dst_layout.allocate(device, fill="zeros")
    src_ids = torch.randperm(num_blocks, generator=gen)[:n_pull].to(device)
    dst_ids = torch.randperm(num_blocks, generator=gen)[:n_pull].to(device)

    staging = pack(src, src_layout, src_ids)
    unpack(staging, dst, dst_layout, dst_ids)
    exact = torch.equal(as_bits(src_layout.logical(src)[src_ids.cpu()]),
                        as_bits(dst_layout.logical(dst)[dst_ids.cpu()]))

    nbytes = staging.numel() * staging.element_size()
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    t_pack = _time(lambda: pack(src, src_layout, src_ids, staging), device, iters)
    t_unpack = _time(lambda: unpack(staging, dst, dst_layout, dst_ids), device, iters)
    t_copy = _time(lambda: flat_dst.copy_(flat_src), device, iters)
    gbps = lambda t: nbytes / t / 1e9
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": "triton" if device.type == "cuda" else "torch",
        "blocks": n_pull, "bytes": nbytes, "bit_exact": bool(exact),
        "pack_gbps": gbps(t_pack), "unpack_gbps": gbps(t_unpack), "copy_gbps": gbps(t_copy),
        "pack_ratio": t_copy / t_pack, "unpack_ratio": t_copy / t_unpack,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvkern demo --kernels", description=__doc__)
    parser.add_argument("--blocks", type=int, default=512, help="blocks to move")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    print("kvkern kernel demo: TRT-LLM [NB, L, 2, H, T, D] pool -> staging -> vLLM HND pool")
    r = run(n_pull=args.blocks, device=args.device)
    print(f"  device {r['device']} ({r['backend']} path), {r['blocks']} blocks, "
          f"{r['bytes'] / 2**20:.1f} MiB")
    print(f"  bit-exact logical KV after TRT-LLM -> HND: {'yes' if r['bit_exact'] else 'NO'}")
    print(f"  pack    {r['pack_gbps']:7.2f} GB/s  ({r['pack_ratio']:.2f}x contiguous copy)")
    print(f"  unpack  {r['unpack_gbps']:7.2f} GB/s  ({r['unpack_ratio']:.2f}x contiguous copy)")
    print(f"  copy_   {r['copy_gbps']:7.2f} GB/s  (contiguous copy of the same bytes)")
    if args.json:
        print(json.dumps(r))
    return 0 if r["bit_exact"] else 1
