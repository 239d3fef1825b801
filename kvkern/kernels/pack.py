"""Pack scattered paged KV blocks into contiguous staging, and unpack staging into blocks.

::

    pool (any engine layout)                      staging [n, L', 2, H', T, D] contiguous
    block_ids = [7, 2, -1, 5]                     row r = ((i*L' + l)*2 + kv)*H' + h
    +----+----+----+----+----+----+----+----+     +-----------+-----------+-----------+
    |    |    | b2 |    |    | b5 |    | b7 | --> | i=0: b7   | i=1: b2   | i=2: pad  | ...
    +----+----+----+----+----+----+----+----+     +-----------+-----------+-----------+
                                                   each row is one T x D run; padding rows
                                                   (negative ids) are neither read nor written

``layers=(l0, l1)`` and ``heads=(h0, h1)`` select a sub-slab (L' = l1 - l0 layers,
H' = h1 - h0 heads), the pieces that TP/PP resharding moves.

One jit kernel serves both directions (``PACK`` is a constexpr). It copies machine words:
every tensor is reinterpreted as the widest integer type that divides head_dim bytes, every
stride and every base address, so any dtype (fp8, NaN payloads) round-trips bit-exactly.
Dispatch: CUDA tensors run the Triton kernel; CPU tensors run a vectorized torch path;
``backend="triton"`` on CPU runs the kernel under the Triton interpreter
(``TRITON_INTERPRET=1`` must be set before kvkern's kernels are first used).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvkern.layout.kv_layout import KVLayout, staging_shape

try:  # Triton is optional for the CPU path; the kernel exists only where Triton does.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = ["pack", "unpack", "warm_up", "Backend", "launch_config", "config_override",
           "tuning_key"]

Backend = str  # "auto" | "triton" | "torch"
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# --------------------------------------------------------------------------------------
# jit kernel
# --------------------------------------------------------------------------------------

# The counts and starts change with every pull's pieces (layers and heads of a reshard, rows
# of a chunk): specialised on their values (1, multiples of 16), each new mix would compile
# again on the request path. The strides and the pool size stay specialised: they are fixed
# per pool and give the vector width.
NOT_SPECIALISED = ("layer_start", "head_start", "n_layers", "n_heads", "n_rows", "n_groups")

if triton is not None:

    @triton.jit(do_not_specialize=list(NOT_SPECIALISED))
    def _kv_copy_kernel(
        pool_ptr,        # [*] word view of the pool, based at layer 0's tensor
        staging_ptr,     # [n_rows, T, DW] contiguous words
        block_ids_ptr,   # [n_blocks] int64, negative = padding
        layer_off_ptr,   # [num_layers] int64 word offset of each layer from pool_ptr
        stride_block, stride_kv, stride_head, stride_token,  # pool word strides (int64)
        layer_start, head_start, n_layers, n_heads, n_rows, n_groups, num_blocks,
        T: tl.constexpr, DW: tl.constexpr, LOFF_ALIGN: tl.constexpr,
        PACK: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs_r = tl.arange(0, BLOCK_R)
        offs_t = tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < DW
        # Grid-stride over groups of BLOCK_R rows: a capped grid (max_programs) still
        # covers every row, leaving the remaining SMs to the forward pass.
        for g in range(pid, n_groups, nprog):
            r = tl.cast(g, tl.int64) * BLOCK_R + offs_r
            r_mask = r < n_rows
            h = r % n_heads
            kv = (r // n_heads) % 2
            l = (r // (2 * n_heads)) % n_layers
            i = r // (2 * n_heads * n_layers)
            bid = tl.load(block_ids_ptr + i, mask=r_mask, other=-1).to(tl.int64)
            # padding rows (and, as a safety net, ids past the pool): nothing read or written
            r_mask = r_mask & (bid >= 0) & (bid < num_blocks)
            loff = tl.load(layer_off_ptr + layer_start + l, mask=r_mask, other=0).to(tl.int64)
            # A loaded offset hides its alignment from the compiler; the launcher proved it,
            # and saying so keeps 16-byte vector loads (without it: 8-byte scalar loads).
            loff = tl.multiple_of(loff, LOFF_ALIGN)
            pool_row = bid * stride_block + loff + kv * stride_kv + (head_start + h) * stride_head
            stg_row = r * (T * DW)
            for t0 in tl.static_range(0, T, BLOCK_T):
                t = t0 + offs_t
                mask = r_mask[:, None, None] & (t < T)[None, :, None] & d_mask[None, None, :]
                p_off = (pool_row[:, None, None] + t[None, :, None].to(tl.int64) * stride_token
                         + offs_d[None, None, :])
                s_off = stg_row[:, None, None] + t[None, :, None] * DW + offs_d[None, None, :]
                if PACK:
                    x = tl.load(pool_ptr + p_off, mask=mask)
                    tl.store(staging_ptr + s_off, x, mask=mask)
                else:
                    x = tl.load(staging_ptr + s_off, mask=mask)
                    tl.store(pool_ptr + p_off, x, mask=mask)


# --------------------------------------------------------------------------------------
# launch configuration: tuned table (bench/autotune.py) first, heuristics otherwise
# --------------------------------------------------------------------------------------

_TUNED_PATH = Path(__file__).with_name("tuned_configs.json")
_OVERRIDE: dict = {}  # set by config_override (bench/autotune.py); empty in normal use


@functools.lru_cache(maxsize=8)
def _tuned_table(device_name: str) -> dict:
    path = Path(os.environ.get("KVKERN_TUNED_CONFIGS", _TUNED_PATH))
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entry = table.get(device_name, {}) if isinstance(table, dict) else {}
    return entry.get("configs", {}) if isinstance(entry, dict) else {}


@contextlib.contextmanager
def config_override(*, tile_bytes: int, num_warps: int):
    """Force one launch configuration (for the autotuner); not thread-safe."""
    _OVERRIDE.update(tile_bytes=int(tile_bytes), num_warps=int(num_warps))
    try:
        yield
    finally:
        _OVERRIDE.clear()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tuning_key(row_bytes: int, dense_rows: bool) -> str:
    """Key of the tuned table: row kind and the row size bucket (a power of two <= 64 KiB).
    A row is one (block, layer, kv, head): ``T x D``; dense when tokens follow head_dim."""
    return f"{'dense' if dense_rows else 'strided'}:{min(_next_pow2(row_bytes), 1 << 16)}"


def launch_config(device: torch.device, t: int, dw: int, word_bytes: int,
                  dense_rows: bool = True) -> dict:
    """Tile sizes and warps for one (block_size, head_dim words) shape on ``device``.

    Heuristic: a tile of ~16 KiB of words per iteration (enough loads in flight per SM to
    cover HBM latency; 256 B runs need several rows per program), 4 warps, 8 for big tiles.
    A table written by ``bench/autotune.py`` for this device name overrides tile and warps.
    """
    tile_bytes, warps = 16 * 1024, 4
    if _OVERRIDE:
        tile_bytes, warps = _OVERRIDE["tile_bytes"], _OVERRIDE["num_warps"]
    elif device.type == "cuda":
        tuned = _tuned_table(torch.cuda.get_device_name(device)).get(
            tuning_key(t * dw * word_bytes, dense_rows))
        if tuned:
            tile_bytes, warps = int(tuned["tile_bytes"]), int(tuned["num_warps"])
    tile_words = max(1, tile_bytes // word_bytes)
    block_d = _next_pow2(dw)
    block_t = min(_next_pow2(t), max(1, tile_words // block_d))
    block_r = max(1, tile_words // (block_t * block_d)) if block_t >= t else 1
    if not _OVERRIDE and block_r * block_t * block_d * word_bytes >= 32 * 1024:
        warps = max(warps, 8)
    return {"BLOCK_R": block_r, "BLOCK_T": block_t, "BLOCK_D": block_d, "num_warps": warps}


# --------------------------------------------------------------------------------------
# typed launcher: validates, reinterprets as words, launches
# --------------------------------------------------------------------------------------


def _word_bytes(layout: KVLayout, tensors: Sequence[torch.Tensor], staging: torch.Tensor) -> int:
    item = layout.itemsize
    quantities = [layout.head_dim * item, staging.data_ptr()]
    quantities += [s * item for s in layout.strides[:-1]]
    quantities += [t.data_ptr() for t in tensors]
    for w in (8, 4, 2, 1):
        if all(q % w == 0 for q in quantities):
            return w
    return 1  # pragma: no cover - 1 divides everything


def _as_words(t: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """The same memory as ``word_bytes``-wide integers (the last dim shrinks or grows)."""
    return t.view(torch.uint8).view(_WORD_DTYPES[word_bytes])


@functools.lru_cache(maxsize=64)
def _layer_offsets_tensor(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Layer offsets on the device, cached per pool (an H2D copy per call cost ~10 us).
    Each launch that reads it marks it used by its stream (:func:`_launch_triton`): an
    entry evicted while a kernel on another stream still reads it keeps its memory until
    that kernel has run."""
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def _launch_triton(tensors, layout: KVLayout, ids: torch.Tensor, staging: torch.Tensor,
                   l0: int, l1: int, h0: int, h1: int, pack_dir: bool,
                   max_programs: int | None) -> None:
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    if staging.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors runs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before kvkern's kernels are first used"
        )
    launch = _launch_args(tensors, layout, ids, staging, l0, l1, h0, h1, pack_dir, max_programs)
    if launch is not None:
        grid, args, kwargs = launch
        # (launched on the tensors' device, whatever device the calling thread has current)
        with (torch.cuda.device(staging.device) if staging.device.type == "cuda"
              else contextlib.nullcontext()):
            _kv_copy_kernel[grid](*args, **kwargs)
            if staging.device.type == "cuda":  # the cached layer offsets (_launch_args)
                args[3].record_stream(torch.cuda.current_stream(staging.device))


def _launch_args(tensors, layout: KVLayout, ids: torch.Tensor, staging: torch.Tensor,
                 l0: int, l1: int, h0: int, h1: int, pack_dir: bool,
                 max_programs: int | None) -> tuple[tuple[int], tuple, dict] | None:
    """The kernel launch for one call: ``(grid, positional args, keyword args)`` exactly as
    :func:`_launch_triton` passes them (``None`` when there is nothing to copy).
    ``kvkern.kernels.aot`` compiles from it ahead of time, with the launch's own
    specialisation."""
    wb = _word_bytes(layout, tensors, staging)
    words = [_as_words(t, wb) for t in tensors]
    base = words[0]

    def wstride(axis) -> int:
        s = layout.stride(axis) * layout.itemsize
        return s // wb

    if layout.per_layer:
        layer_off = [(t.data_ptr() - base.data_ptr()) // wb for t in words]
    else:
        layer_off = [li * wstride("layer") for li in range(layout.num_layers)]
    layer_off_t = _layer_offsets_tensor(tuple(layer_off), staging.device)
    loff_align = 16
    while loff_align > 1 and any(o % loff_align for o in layer_off):
        loff_align //= 2
    dw = layout.head_dim * layout.itemsize // wb
    t = layout.block_size
    n_layers, n_heads = l1 - l0, h1 - h0
    n_rows = ids.numel() * n_layers * 2 * n_heads
    if n_rows == 0:
        return None
    cfg = launch_config(staging.device, t, dw, wb, dense_rows=wstride("token") == dw or t == 1)
    n_groups = -(-n_rows // cfg["BLOCK_R"])
    grid = n_groups if max_programs is None else max(1, min(n_groups, int(max_programs)))
    args = (base, _as_words(staging, wb), ids, layer_off_t,
            wstride("block"), wstride("kv"), wstride("head"), wstride("token"),
            l0, h0, n_layers, n_heads, n_rows, n_groups, layout.num_blocks)
    kwargs = dict(T=t, DW=dw, LOFF_ALIGN=loff_align, PACK=pack_dir,
                  BLOCK_R=cfg["BLOCK_R"], BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"],
                  num_warps=cfg["num_warps"])
    return (grid,), args, kwargs


# --------------------------------------------------------------------------------------
# vectorized torch path (CPU tensors)
# --------------------------------------------------------------------------------------


_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()  # (packing threads and the loop may ask at once)
_SPLIT_BYTES = 8 << 20  # below this a second thread costs more than it brings


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, torch.get_num_threads()), thread_name_prefix="kvkern-copy")
        return _EXECUTOR


def _take_rows(src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[k] = src[ids[k]]`` for C-contiguous ``src`` and ``out`` on the host: one row
    copy after another on the calling thread, the interpreter lock released. Called from
    the copy threads, ``index_select`` spreads its rows over a thread team of its own per
    calling thread, as large as torch's intra-op setting (in an engine, its compute thread
    count): 32 rows of 512 KiB took 2.9 ms that way against 1.2 ms here. Ids past ``src``
    raise IndexError."""
    top = int(ids.max())
    if top >= src.shape[0]:
        raise IndexError(f"block id {top} outside a pool of {src.shape[0]} blocks")
    np.take(src.numpy(), ids.numpy(), axis=0, out=out.numpy(), mode="clip")  # (in range)


def _torch_copy(tensors, layout: KVLayout, ids: torch.Tensor, staging: torch.Tensor,
                l0: int, l1: int, h0: int, h1: int, pack_dir: bool) -> None:
    """One gather or scatter per tensor, straight between the pool and the strided staging
    slice, on integer views of the same memory; large copies split their blocks over
    ``torch.get_num_threads()`` threads (both calls release the GIL).

    Pack gathers whole rows of a dense pool with :func:`_take_rows` and any other slice with
    ``index_select(out=...)`` (a gather into a temporary and a second copy reached 0.13x a
    contiguous copy). Unpack uses numpy fancy assignment on shared-memory
    views, which copies each block slice as a strided run (``index_copy_`` reached 0.1-0.3x).
    Two threads: 19.8 -> 35 GB/s for an HND unpack against a 40 GB/s ``copy_``."""
    # Gathers from token-strided rows (NHD, flash, cross-layer) walk 8-byte words: 11 ->
    # 20 GB/s for NHD pack; dense rows keep the element size (index_select's fast path).
    strided_rows = layout.stride("token") != layout.head_dim and layout.block_size > 1
    wb = _word_bytes(layout, tensors, staging) if pack_dir and strided_rows else layout.itemsize
    stg = _as_words(staging, wb)
    if layout.per_layer:
        pieces = [(layout.canonical_view(_as_words(tensors[li], wb))[:, :, h0:h1],
                   (slice(None), li - l0)) for li in range(l0, l1)]
    else:
        pieces = [(layout.canonical_view(_as_words(tensors[0], wb))[:, l0:l1, :, h0:h1],
                   (slice(None),))]

    def run(lo: int, hi: int) -> None:
        part_ids = ids[lo:hi]
        valid = part_ids >= 0
        all_valid = bool(valid.all())
        pos = None if all_valid else valid.nonzero().squeeze(1)
        sel = part_ids if all_valid else part_ids[pos]
        if sel.numel() == 0:
            return
        rows = stg[lo:hi]
        sel_np = None if pack_dir else sel.numpy()
        for pool_part, index in pieces:
            stg_part = rows[index]
            if pack_dir:
                if all_valid and pool_part.is_contiguous() and stg_part.is_contiguous():
                    _take_rows(pool_part, sel, stg_part)
                elif all_valid:
                    torch.index_select(pool_part, 0, sel, out=stg_part)
                else:
                    stg_part[pos] = pool_part.index_select(0, sel)
            else:
                src = stg_part if all_valid else stg_part[pos]
                pool_part.numpy()[sel_np] = src.numpy()

    n = ids.numel()
    workers = min(torch.get_num_threads(), n, staging.numel() * staging.element_size() // _SPLIT_BYTES)
    if workers <= 1:
        run(0, n)
        return
    bounds = [n * k // workers for k in range(workers + 1)]
    futures = [_executor().submit(run, bounds[k], bounds[k + 1]) for k in range(1, workers)]
    try:
        run(bounds[0], bounds[1])  # the caller copies the first share instead of waiting
    finally:
        concurrent.futures.wait(futures)  # no share outlives the call
    for f in futures:
        f.result()


# --------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------


def _ids_tensor(block_ids, layout: KVLayout, device: torch.device, unique: bool,
                validate: bool) -> torch.Tensor:
    """Block ids as int64 on ``device``, checked on the host before they are moved (no GPU
    sync for ids given as lists or CPU tensors; one sync for ids already on a GPU)."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool \
                or block_ids.dtype.is_complex:
            raise TypeError(f"block_ids must be an integer tensor, got dtype {block_ids.dtype}")
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
        # the kernels index ids densely; a host tensor is copied, since the copy to a device
        # may run after this returns (pinned memory), while the caller rewrites its tensor
        ids = block_ids.to(dtype=torch.int64, copy=block_ids.device.type == "cpu").contiguous()
        if block_ids.dtype == torch.uint64 and ids.numel() and bool((ids < 0).any()):
            # (an unsigned id past int64 would wrap to a negative, the padding id)
            raise ValueError("block_ids holds an unsigned id of 2**63 or more")
    else:
        values = []
        for v in block_ids:
            try:
                if isinstance(v, bool):
                    raise TypeError
                values.append(operator.index(v))
            except TypeError:
                raise TypeError(f"block id {v!r} is {type(v).__name__}, not an int") from None
        ids = torch.tensor(values, dtype=torch.int64)
    if validate and ids.numel():
        _check_ids(ids, layout.num_blocks, unique)
    return ids.to(device, non_blocking=ids.device.type == "cpu" and device.type == "cuda")


def _check_ids(ids: torch.Tensor, num_blocks: int, unique: bool) -> None:
    valid = ids[ids >= 0]
    if valid.numel() == 0:
        return
    ordered = valid.sort().values
    dup_mask = ordered[1:] == ordered[:-1]
    # one host read for everything (a single sync when the ids live on a GPU)
    hi, n_dup = torch.stack([ordered[-1], dup_mask.sum()]).tolist()
    if hi >= num_blocks:
        raise ValueError(f"block id {hi} out of range for pool of {num_blocks} blocks")
    if unique and n_dup:
        dup = int(ordered[1:][dup_mask][0])
        raise ValueError(f"duplicate destination block id {dup} in unpack block_ids")


def _range(name: str, rng, size: int) -> tuple[int, int]:
    if rng is None:
        return 0, size
    lo, hi = (int(x) for x in rng)
    if not 0 <= lo <= hi <= size:
        raise ValueError(f"{name} range ({lo}, {hi}) not within [0, {size}]")
    return lo, hi


def _prepare(pool, layout: KVLayout, block_ids, staging, layers, heads, unique: bool,
             validate: bool = True):
    tensors = layout.check(pool)
    device = tensors[0].device
    l0, l1 = _range("layer", layers, layout.num_layers)
    h0, h1 = _range("head", heads, layout.num_heads)
    ids = _ids_tensor(block_ids, layout, device, unique, validate)
    shape = staging_shape(ids.numel(), l1 - l0, h1 - h0, layout.block_size, layout.head_dim)
    if staging is not None:
        if not isinstance(staging, torch.Tensor):
            raise TypeError(f"staging must be a torch.Tensor, got {type(staging).__name__}")
        if staging.dtype != layout.dtype:
            raise TypeError(f"staging dtype {staging.dtype} does not match pool dtype {layout.dtype}")
        if staging.device != device:
            raise ValueError(f"staging is on {staging.device}, pool on {device}")
        if tuple(staging.shape) != shape:
            raise ValueError(f"staging shape {tuple(staging.shape)} != expected {shape}")
        if not staging.is_contiguous():
            raise ValueError(f"staging must be contiguous, got strides {staging.stride()}")
    return tensors, device, ids, shape, (l0, l1, h0, h1)


def _check_programs(max_programs: int | None) -> None:
    if max_programs is not None and (isinstance(max_programs, bool)
                                     or operator.index(max_programs) < 1):
        raise ValueError(f"max_programs {max_programs!r} must be None or an int >= 1")


def _dispatch(backend: Backend, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return backend


def pack(pool, layout: KVLayout, block_ids, out: torch.Tensor | None = None, *,
         layers: tuple[int, int] | None = None, heads: tuple[int, int] | None = None,
         max_programs: int | None = None, backend: Backend = "auto",
         validate: bool = True) -> torch.Tensor:
    """Gather ``block_ids`` of ``pool`` into canonical staging.

    Args:
        pool: a tensor, or a list of per-layer tensors, matching ``layout``.
        block_ids: ints or a 1-D integer tensor; a negative id is padding: its staging
            rows are left untouched.
        out: optional contiguous staging ``[n, L', 2, H', T, D]`` of the pool's dtype
            (may be a view into a larger flat buffer).
        layers, heads: half-open local ranges ``(lo, hi)`` selecting a sub-slab.
        max_programs: cap on the Triton kernel's grid: its grid-stride loop covers every
            row with fewer programs, leaving the other SMs to the forward pass
            (:mod:`kvkern.xfer.devstream` derives it from the SM count). The torch path
            (CPU tensors) has no grid and ignores it; results are the same either way.
        backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
        validate: check ids on the host (range; duplicates for unpack) and raise
            ``ValueError``. ``False`` skips the check for ids the caller already trusts
            (engine block tables); a bad id still never addresses memory outside the
            pool: the Triton kernel skips ids outside ``[0, num_blocks)`` and the torch
            path raises ``IndexError``.

    Returns:
        the staging tensor.
    """
    _check_programs(max_programs)
    tensors, device, ids, shape, (l0, l1, h0, h1) = _prepare(
        pool, layout, block_ids, out, layers, heads, unique=False, validate=validate)
    if out is None:
        out = torch.empty(shape, dtype=layout.dtype, device=device)
    if out.numel() == 0:
        return out
    if _dispatch(backend, device) == "triton":
        _launch_triton(tensors, layout, ids, out, l0, l1, h0, h1, True, max_programs)
    else:
        _torch_copy(tensors, layout, ids, out, l0, l1, h0, h1, True)
    return out


def unpack(staging: torch.Tensor, pool, layout: KVLayout, block_ids, *,
           layers: tuple[int, int] | None = None, heads: tuple[int, int] | None = None,
           max_programs: int | None = None, backend: Backend = "auto",
           validate: bool = True) -> None:
    """Scatter canonical ``staging`` into ``block_ids`` of ``pool`` (the inverse of
    :func:`pack`). Duplicate non-negative ids raise ``ValueError``: two rows racing for one
    destination block would leave it undefined."""
    if not isinstance(staging, torch.Tensor):
        raise TypeError(f"staging must be a torch.Tensor, got {type(staging).__name__}")
    _check_programs(max_programs)
    tensors, device, ids, _shape, (l0, l1, h0, h1) = _prepare(
        pool, layout, block_ids, staging, layers, heads, unique=True, validate=validate)
    if staging.numel() == 0:
        return
    if _dispatch(backend, device) == "triton":
        _launch_triton(tensors, layout, ids, staging, l0, l1, h0, h1, False, max_programs)
    else:
        _torch_copy(tensors, layout, ids, staging, l0, l1, h0, h1, False)


def warm_up(pool, layout: KVLayout, *, max_programs: int | None = None,
            backend: Backend = "auto") -> bool:
    """Compile the Triton pack and unpack of ``layout`` over ``pool`` now, for whole blocks:
    a kernel's first launch compiles on the host, about a second per specialisation, on
    whatever thread launches it (otherwise a first pull's, which then holds up every other
    pull on its event loop). Reads block 0 into a scratch buffer and writes nothing into the
    pool (the unpack names padding only). False where the torch path serves the pool's
    device (CPU, with ``backend="auto"``)."""
    device = (pool[0] if isinstance(pool, (list, tuple)) else pool).device
    if layout.num_blocks == 0 or _dispatch(backend, device) != "triton":
        return False
    staging = pack(pool, layout, [0], max_programs=max_programs, backend=backend)
    unpack(staging, pool, layout, [-1], max_programs=max_programs, backend=backend)
    return True
