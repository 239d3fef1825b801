"""``kvkern bench xfer`` end to end on tiny sizes: two real processes on 127.0.0.1, the
pull case against its raw baseline, its JSON contract (the last stdout line) and the read
path it claims to measure (direct reads: no message, reads counted; the granted read in the same
run: a round trip), for block rows and a per-layer pool.
Bounded by the bench's own --timeout and the subprocess timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvkern.xfer.ucp_rma import rma_unavailable


@pytest.mark.parametrize("layout,tp,pp,reads", [
    ("trtllm", "1:1", "1:1", 1), ("vllm_hnd", "1:1", "1:1", 8), ("trtllm", "2:1", "1:1", 2),
    ("trtllm", "1:2", "1:1", 1), ("trtllm", "1:1", "2:1", 4)])
def test_bench_xfer_pull_json(layout, tp, pp, reads):
    """(A TP 2:1 reshard reads each source rank's consecutive blocks in one read scattered
    over the destination's rows: 2 pairs, 2 reads; in a TP 1:2 reshard both destination
    ranks read the source's consecutive blocks together, one read scattered over both; a
    PP 2:1 reshard reads each stage's block into half a destination block: 2 pairs of 2
    reads.)"""
    if rma_unavailable() is not None:
        pytest.skip(f"one-sided reads unavailable: {rma_unavailable()}")
    cmd = [sys.executable, "-m", "kvkern", "bench", "xfer", "--cases", "raw,pull",
           "--sizes", "1MiB", "--repeats", "2", "--pull-layout", layout, "--pull-tp", tp,
           "--pull-pp", pp,
           "--timeout", "60", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("bytes", "blocks", "pull_gbps", "raw_gbps", "ratio", "messages"):
        assert key in res, res
    assert res["bytes"] == 1 << 20 and res["blocks"] == 2
    assert res["env"]["device"] == "cpu"
    # OpenMP threads that sleep once their work is done, unless the caller named a policy
    assert res["env"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert res["pull_gbps"] > 0 and res["raw_gbps"] > 0
    assert res["ratio"] == pytest.approx(res["pull_gbps"] / res["raw_gbps"], rel=0.01)
    pull = res["cases"]["pull"]
    assert pull["layout"] == layout and pull["data_path"] == "both"
    assert (pull["tp"], pull["pp"]) == (tp, pp)
    assert pull["source_blocks"] == 16384  # a serving engine's pool: its directory's size
    one = pull[str(1 << 20)]
    assert one["reads"] == reads, one  # consecutive source blocks
    assert one["messages"] == (0 if reads else 2 * (2 + 1)), one  # 2 pairs: 1 chunk each
    assert one["stream_pull_gbps"] > 0 and one["scattered_pull_gbps"] > 0
    # as an engine connector pulls (Puller.pull_into), read and streamed
    assert one["into_pull_gbps"] > 0 and one["into_stream_pull_gbps"] > 0
    assert one["into_ucx_pull_gbps"] > 0  # and through UCX, as from a source on another host
    # every variant also pulled once, untimed, into poisoned blocks, each block checked
    assert {"pull", "scattered", "stream", "stream_scattered", "into", "into_stream",
            "into_ucx"} <= set(one["checked"]), one["checked"]
    # the scattered source packs its streams: the time it took, from its own metrics
    assert one["stream_scattered_pack_ms"] > 0 and one["stream_scattered_pack_gbps"] > 0
    assert pull["hint_to_first_byte_ms"] > 0 and pull["one_block_cpu_ms"] > 0
    if reads:  # the copy is timed apart; the granted read is measured in the same run
        assert 0 < pull["one_block_overhead_ms"] < pull["one_block_total_ms"]
        assert one["copy_gbps"] >= one["pull_gbps"] > 0  # the copy alone is the faster
        assert one["phases_ms"]["data"] <= one["phases_ms"]["total"]
        # the steps of a direct read are disjoint: what none covers is not negative
        ph = one["phases_ms"]
        assert ph["queue"] > 0 and ph["handoff"] > 0 and ph["rest"] >= -0.005, ph
        assert 0 < one["overhead_ms"] < ph["total"]
        assert one["granted_pull_gbps"] > 0 and pull["granted"]["hint_to_first_byte_ms"] > 0
        assert one["ucx_pull_gbps"] > 0 and "ucx_ratio" in res["by_size"][str(1 << 20)]
        # the 1-block pulls' steps, and the same pulls on a lane's thread in the same run
        assert pull["one_block_phases_ms"]["lookup"] > 0, pull["one_block_phases_ms"]
        thread = pull["lane_thread"]
        assert 0 < thread["one_block_overhead_ms"] < thread["one_block_total_ms"]
        assert thread["one_block_phases_ms"]["handoff"] > 0
    # a state past its time to live used at once, against waiting for its fetch (HTTP)
    past = pull["past_ttl"]
    assert sorted(k for k in past if k.isdigit()) == sorted({str(pull["block_bytes"]),
                                                             str(1 << 20)}), past
    for row in (past[k] for k in past if k.isdigit()):
        assert row["stale"]["metadata_ms"] < row["refetch"]["metadata_ms"], past
        assert row["stale_over_fresh"] > 0 and row["refetch_over_fresh"] > 0


def test_bench_xfer_one_destination_rank_reads_its_head_slices():
    """--pull-one-rank: this process hosts rank 0 of a TP2 destination alone, so it pulls
    that rank's half of each source block, 16 KiB head slices: read from the same-host
    source (above local_read_min_run_bytes), where the same pull through UCX streams."""
    if rma_unavailable() is not None:
        pytest.skip(f"one-sided reads unavailable: {rma_unavailable()}")
    cmd = [sys.executable, "-m", "kvkern", "bench", "xfer", "--cases", "raw,pull",
           "--sizes", "1MiB", "--repeats", "2", "--pull-tp", "1:2", "--pull-one-rank",
           "--data-path", "read", "--timeout", "60", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    pull = res["cases"]["pull"]
    assert pull["ranks"] == [0] and pull["one_rank"] is True and pull["tp"] == "1:2"
    one = pull[str(1 << 20)]
    assert one["bytes"] == 1 << 20 and one["blocks"] == 4  # 256 KiB of each block here
    assert one["reads"] > 0 and one["messages"] == 0, one  # read directly, not streamed
    assert one["ucx_pull_gbps"] > 0


def test_bench_xfer_device_cuda_needs_a_device():
    """``--device cuda`` puts both processes' buffers and pools in device memory (the GPU
    call's pull of 256 MiB); without a visible device it stops with one line."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the device script runs --device cuda")
    out = subprocess.run([sys.executable, "-m", "kvkern", "bench", "xfer", "--device", "cuda"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no CUDA device" in out.stderr.splitlines()[-1]


def test_bench_xfer_reshards_and_targets_in_the_same_run():
    """``--reshards`` pulls through each reshard with a peer of its own, against the raw send
    of the same bytes, and the targets are judged on the figures of this one run."""
    if rma_unavailable() is not None:
        pytest.skip(f"one-sided reads unavailable: {rma_unavailable()}")
    cmd = [sys.executable, "-m", "kvkern", "bench", "xfer", "--cases", "raw,pull",
           "--sizes", "1MiB", "--repeats", "1", "--reshards", "tp2:1", "--timeout", "60",
           "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    sub = res["reshards"]["tp2:1"]["cases"]["pull"]
    assert (sub["tp"], sub["pp"]) == ("2:1", "1:1")
    row = sub[str(1 << 20)]
    assert row["ratio"] > 0 and row["reads"] == 2 and row["stream_pull_gbps"] > 0
    assert "granted_ratio" not in row and "lanes1_ratio" not in row  # headline paths only
    assert "into_ratio" not in row
    targets = {(t["target"], t["where"]): t for t in res["targets"]}
    assert targets[("reshard_vs_raw", "TP 2:1, 1 MiB")]["value"] == round(row["ratio"], 3)
    assert targets[("hint_to_first_byte_ms", "1 block")]["value"] == \
        round(res["cases"]["pull"]["hint_to_first_byte_ms"], 3)


def test_bench_xfer_interleaves_nixl_with_the_pulls():
    """``--compare nixl``: NIXL's READ of the same blocks, each of its ways, is one more
    variant of the pull case, in the same shuffled rounds; kvkern / NIXL comes from those
    (and the targets judge them), NIXL's own run is kept beside."""
    pytest.importorskip("nixl")
    if rma_unavailable() is not None:
        pytest.skip(f"one-sided reads unavailable: {rma_unavailable()}")
    cmd = [sys.executable, "-m", "kvkern", "bench", "xfer", "--cases", "raw,pull",
           "--sizes", "1MiB", "--repeats", "2", "--compare", "nixl", "--reshards", "none",
           "--timeout", "60", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    pull = res["cases"]["pull"]
    assert pull["nixl"]["agent"] == "lean" and "error" not in pull["nixl"], pull["nixl"]
    # per-request READs of both mappings: a warm-up and two rounds each
    assert pull["nixl"]["notifications"] == 2 * 3
    row = pull[str(1 << 20)]
    ways = row["nixl"]
    assert set(ways) == {"consecutive", "consecutive_per_request", "scattered",
                         "scattered_per_request"}
    assert all(w["gbps"] > 0 for w in ways.values())
    assert row["kvkern_vs_nixl"] == round(row["pull_gbps"] / ways["consecutive"]["gbps"], 3)
    assert row["kvkern_vs_nixl_per_request_scattered"] == round(
        row["scattered_pull_gbps"] / ways["scattered_per_request"]["gbps"], 3)
    targets = {(t["target"], t["where"]): t["value"] for t in res["targets"]}
    assert targets[("kvkern_vs_nixl", "1 MiB")] == min(row["kvkern_vs_nixl"],
                                                       row["kvkern_vs_nixl_per_request"])
    assert "consecutive" in res["compare"]["nixl"].get("cases", {}).get(str(1 << 20), {}), \
        res["compare"]


@pytest.mark.parametrize("into", [False, True])
async def test_a_checked_bench_pull_catches_a_block_in_anothers_place(into):
    """The bench's checked pull poisons every destination block, then compares each pulled
    block word for word with the source's: a pull that lands block 1's bytes in block 0's
    place, leaves a block untouched, or swaps two heads (or K and V) inside a block of a TP
    reshard's destination fails the run."""
    import torch

    from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
    from kvkern.tools import benchcli
    from kvkern.xfer.kvgroup import RankKV

    model = ModelKVSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
                        dtype="bfloat16")
    src_topo = Topology(model=model, parallel=Parallelism(tp_size=2))
    topo = Topology(model=model, parallel=Parallelism())
    layout = topo.local_layout(0, 6)
    rkv = RankKV(0, layout, layout.allocate("cpu", fill="zeros"))
    manager = type("Manager", (), {"evict": lambda self, hs: {"held": []},
                                   "match_prefix": lambda self, hs: list(range(len(hs)))})()
    pb = type("Bench", (), {})()
    pb.ranks, pb.n_max, pb.bs = {0: rkv}, 3, 4
    pb.group = type("Group", (), {"manager": manager, "hash_scheme": "kvkern-blake2b-v1",
                                  "topology": topo})()

    def gather(i: int, swap: str = "") -> torch.Tensor:
        """Destination block i as a TP 2:1 reshard gathers it: each source rank's heads."""
        src = []
        for r in (0, 1):
            lay = src_topo.local_layout(r, 1)
            pool = lay.allocate("cpu", fill="zeros")
            benchcli._fill_block(src_topo, RankKV(r, lay, pool), 0, i)
            src.append(lay.canonical_view(pool)[0])
        block = torch.cat(src, dim=2)  # [L, 2, H, T, D]: rank 0's heads, then rank 1's
        if swap == "heads":
            block = block[:, :, [1, 0, 2, 3]]
        elif swap == "kv":
            block = block.flip(1)
        return block

    def land(blocks):
        async def pull(n, port=None, via=None, *, into=False, check=None):
            for b, block in enumerate(blocks):
                if block is not None:
                    layout.canonical_view(rkv.pool)[b].copy_(block)
            if into:
                check(list(range(n)))
            return "outcome"
        return pull

    pb.pull = land([gather(i) for i in range(3)])
    assert await benchcli._PullBench.checked(pb, 3, into=into) == "outcome"
    for wrong in ([gather(1), gather(1), gather(2)], [gather(0), None, gather(2)],
                  [gather(0), gather(1, "heads"), gather(2)],
                  [gather(0), gather(1), gather(2, "kv")]):
        pb.pull = land(wrong)
        with pytest.raises(RuntimeError, match="wrong bytes in block"):
            await benchcli._PullBench.checked(pb, 3, into=into)
        if wrong[1] is None:  # the block left untouched still holds the poison
            assert torch.all(benchcli._words(layout.canonical_view(rkv.pool)[1])
                             == benchcli.POISON)
