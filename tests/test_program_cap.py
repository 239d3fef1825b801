"""The program cap (``max_programs``) reaches the launch grid through pack, unpack and the
sharded per-peer calls, and changes no byte (Triton interpreter, tiny sizes)."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvkern.kernels.pack import config_override, pack, unpack
from kvkern.kernels.sharded import pack_for_peer, unpack_from_peer
from kvkern.layout.plan import plan_transfer
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology

pack_mod = importlib.import_module("kvkern.kernels.pack")  # the package exports pack()
MODEL = ModelKVSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=2, dtype="float16")


@pytest.fixture
def grids(monkeypatch):
    """The grid of every launch the launcher makes, with tiles of one row."""
    seen: list[tuple[int, ...]] = []
    real = pack_mod._launch_args

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        if launch is not None:
            seen.append(launch[0])
        return launch

    monkeypatch.setattr(pack_mod, "_launch_args", spy)
    with config_override(tile_bytes=32, num_warps=1):  # one 32 B row per program: many groups
        yield seen


def _pool(topo: Topology, rank: int, seed: int | None):
    lay = topo.local_layout(rank, 6, "vllm_hnd")
    if seed is None:
        return lay, lay.allocate(fill="zeros")
    return lay, lay.allocate(fill="random", generator=torch.Generator().manual_seed(seed))


@pytest.mark.interpreter
def test_sharded_cap_reaches_every_launch_and_changes_no_byte(grids):
    src_topo = Topology(model=MODEL, parallel=Parallelism(tp_size=1))
    dst_topo = Topology(model=MODEL, parallel=Parallelism(tp_size=2))
    plan = plan_transfer(src_topo, 0, dst_topo, 0)
    src_lay, src_pool = _pool(src_topo, 0, seed=1)
    ids = [4, 0, 5]
    free = pack_for_peer(plan, 0, 1, src_pool, src_lay, ids, backend="torch")
    capped = pack_for_peer(plan, 0, 1, src_pool, src_lay, ids, backend="triton",
                           max_programs=2)
    assert torch.equal(capped, free)
    assert grids and all(g == (2,) for g in grids)  # more row groups than 2, capped at 2
    grids.clear()
    dst_lay, dst_pool = _pool(dst_topo, 1, seed=None)
    want_lay, want_pool = _pool(dst_topo, 1, seed=None)
    unpack_from_peer(plan, 0, 1, free, want_pool, want_lay, [1, 3, 2], backend="torch")
    unpack_from_peer(plan, 0, 1, capped, dst_pool, dst_lay, [1, 3, 2], backend="triton",
                     max_programs=1)
    got, want = dst_lay.tensors(dst_pool), want_lay.tensors(want_pool)  # per-layer tensors
    assert any(bool(t.view(torch.int16).any()) for t in want)  # the unpack wrote blocks
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(got, want, strict=True))
    assert grids and all(g == (1,) for g in grids)


@pytest.mark.interpreter
def test_uncapped_grid_is_one_program_per_row_group(grids):
    lay, pool = _pool(Topology(model=MODEL, parallel=Parallelism()), 0, seed=2)
    pack(pool, lay, [0, 1], backend="triton")
    pack(pool, lay, [0, 1], backend="triton", max_programs=10_000)  # above the groups
    assert grids[0] == grids[1] and grids[0][0] >= 1


@pytest.mark.parametrize("bad", [0, -1, True])
def test_bad_program_cap_rejected(bad):
    lay, pool = _pool(Topology(model=MODEL, parallel=Parallelism()), 0, seed=3)
    with pytest.raises(ValueError, match="max_programs"):
        pack(pool, lay, [0], max_programs=bad)
    with pytest.raises(ValueError, match="max_programs"):
        unpack(pack(pool, lay, [0]), pool, lay, [1], max_programs=bad)
