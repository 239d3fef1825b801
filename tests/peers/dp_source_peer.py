"""A test source worker with attention DP: ``--dp N`` DP groups (``--tp`` total TP, so the
attention TP per group is ``tp // dp``), each with its own reference BlockPool and random KV,
all served by one SourceService on 127.0.0.1.

Run as ``python tests/peers/dp_source_peer.py --dp 2 --tp 2 --seq 1:0:64``. ``--seq
DP:A:B`` commits tokens ``range(A, B)`` into DP group ``DP``. Prints one line (look for the
prefix; UCX may print on stdout too)::

    KVKERN_READY {"http_port": ..., "ucx_ports": {...}, "pid": ..., "incarnation": ...}

Test routes: ``GET /test/stats`` (``{"pools": {dp: stats}, "pins_outstanding", ...}``),
``GET /test/blocks?dp=D&hashes=h1,h2[&layers=A:B][&heads=C:D]`` (per hash, per rank of
group ``D``, the sha256 of the block's canonical staging, as source_peer.py). Exits with its
parent, on SIGTERM/SIGINT, or after ``--lifetime-s``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))

from source_peer import READY_PREFIX, FaultySource, parse_range  # noqa: E402

from kvkern.cache.hashing import sequence_hashes  # noqa: E402
from kvkern.cache.pool import BlockPool  # noqa: E402
from kvkern.kernels.pack import pack  # noqa: E402
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology  # noqa: E402
from kvkern.xfer.kvgroup import KVGroup, RankKV  # noqa: E402
from kvkern.xfer.runtime import EventLoopThread  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seq", action="append", default=[])
    ap.add_argument("--lifetime-s", type=float, default=120.0)
    args = ap.parse_args()

    model = ModelKVSpec(num_layers=args.layers, num_kv_heads=args.kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype)
    topo = Topology(model=model, parallel=Parallelism(tp_size=args.tp, dp_size=args.dp,
                                                      attention_dp=args.dp > 1))
    gen = torch.Generator().manual_seed(1)
    groups = []
    for dp in range(args.dp):
        pool = BlockPool(args.num_blocks, block_size=args.block_size)
        ranks = {}
        for r in topo.ranks_of_dp(dp):
            layout = topo.local_layout(r, args.num_blocks)
            ranks[r] = RankKV(r, layout, layout.allocate(fill="random", generator=gen))
        groups.append(KVGroup(topo, dp, pool, ranks))
    for spec in args.seq:
        dp, a, b = (int(x) for x in spec.split(":"))
        g = groups[dp]
        hs = sequence_hashes(list(range(a, b)), args.block_size)
        ids = g.manager.allocate(len(hs))
        g.manager.commit(ids, hs)
        g.manager.release(ids)
    lock = threading.Lock()

    async def h_stats(request: web.Request) -> web.Response:
        return web.json_response({"pools": {str(g.dp_rank): g.manager.stats() for g in groups},
                                  "pins_outstanding": service.pins_outstanding,
                                  "active_sends": service.active_sends})

    async def h_blocks(request: web.Request) -> web.Response:
        q = request.query
        g = groups[int(q.get("dp", "0"))]
        layers, heads = parse_range(q.get("layers")), parse_range(q.get("heads"))
        out = {}
        with lock:
            for h in (int(x) for x in q.get("hashes", "").split(",") if x):
                ids = g.manager.match_prefix([h])
                if not ids:
                    out[str(h)] = None
                    continue
                out[str(h)] = {"block_id": ids[0], "sha256": {
                    str(r): hashlib.sha256(pack(rkv.pool, rkv.layout, ids, layers=layers,
                                                heads=heads).contiguous().view(-1)
                                           .view(torch.uint8).numpy().tobytes()).hexdigest()
                    for r, rkv in g.ranks.items()}}
        return web.json_response(out)

    service = FaultySource(groups, worker_id="dp-source-peer",
                           extra_routes=[web.get("/test/stats", h_stats),
                                         web.get("/test/blocks", h_blocks)])
    parent = os.getppid()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    rt = EventLoopThread("dp-source-peer")
    try:
        rt.run(service.start(), 30)
        ready = {"http_port": service.http_port,
                 "ucx_ports": {str(r): p for r, p in service.ucx_ports.items()},
                 "pid": os.getpid(), "incarnation": service.incarnation}
        sys.stdout.write(READY_PREFIX + json.dumps(ready) + "\n")
        sys.stdout.flush()
        end = time.monotonic() + args.lifetime_s
        while not stop.wait(0.2):
            if os.getppid() != parent or time.monotonic() > end:
                break
    finally:
        try:
            rt.run(service.close(), 10)
        except Exception as exc:  # noqa: BLE001 (exiting anyway)
            print(f"dp source peer close failed: {exc!r}", file=sys.stderr)
        rt.close(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
