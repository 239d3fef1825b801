"""Ahead-of-time compilation of the pack/unpack kernel for CUDA targets, with no GPU present.

A :class:`Case` names one launch (engine layout, dtype, head_dim, block_size, direction, head
slice). :func:`launch_spec` builds the pool, ids and staging of that launch on the host, with
every allocation placed as PyTorch's CUDA caching allocator places it (512-byte aligned), and
asks the launcher (:func:`kvkern.kernels.pack._launch_args`) for the exact arguments it would
pass; Triton's own binder then derives the specialisation a real launch gets (pointer
alignment, divisibility of every integer argument by 16, constexprs, warps).
:func:`compile_case` compiles that for ``sm_80``, ``sm_90`` or ``sm_100`` with the ptxas that
ships with Triton and reads back:

* every ``ld.global`` / ``st.global`` of the PTX with its width in bytes; a load is a data load
  when a store writes the registers it loaded (the kernel stores only copied data), otherwise
  an index load (block ids, layer offsets);
* registers and local memory (spills) of the cubin, from ``cuobjdump --dump-resource-usage``:
  the same facts the driver reports as ``n_regs`` and ``n_spills`` when it loads the kernel.

:func:`vector_problems` lists what stops a compiled case from moving data in 16-byte accesses.
``python -m kvkern.kernels.aot --out FILE`` compiles a matrix and writes the figures as JSON.

Uses Triton internals (``create_function_from_signature``, ``JITFunction._pack_args``), as the
JIT launcher does, so the specialisation is the launcher's, not a copy of its rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from kvkern.layout.kv_layout import ENGINE_ORDERS, KVLayout, staging_shape

__all__ = ["ARCHS", "Case", "Compiled", "compile_case", "launch_spec", "global_accesses",
           "alignment_allows", "alignment_not_told", "specialised",
           "vector_problems", "default_matrix", "exhaustive_matrix"]

ARCHS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
LAYOUTS = tuple(ENGINE_ORDERS)
CUDA_ALLOC_ALIGN = 512  # PyTorch's CUDA caching allocator rounds every block to 512 bytes
VECTOR_BYTES = 16

_pack_mod = importlib.import_module("kvkern.kernels.pack")


@dataclass(frozen=True)
class Case:
    """One launch of the kernel: what the launcher is called with, and the target."""

    layout: str = "vllm_hnd"
    dtype: str = "bf16"
    head_dim: int = 128
    block_size: int = 16
    pack: bool = True
    heads: tuple[int, int] | None = None  # a TP head slice; None = all heads
    arch: str = "sm_90"
    num_layers: int = 4
    num_heads: int = 8
    num_blocks: int = 64
    n_ids: int = 6
    # Overrides of the launch (for tests that prove the checker fails): constexpr values
    # replacing the launcher's, and argument positions whose 16-alignment fact is withheld.
    override: tuple[tuple[str, int], ...] = ()
    drop_align: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        heads = f"-h{self.heads[0]}:{self.heads[1]}" if self.heads else ""
        extra = "".join(f"-{k}={v}" for k, v in self.override)
        extra += "".join(f"-noalign{i}" for i in self.drop_align)
        return (f"{self.arch}-{'pack' if self.pack else 'unpack'}-{self.layout}-{self.dtype}"
                f"-D{self.head_dim}-T{self.block_size}{heads}{extra}")


def _arena(nbytes_list: list[int]) -> list[torch.Tensor]:
    """Byte tensors carved from one buffer at 512-byte aligned offsets (each a separate
    allocation, placed as the CUDA caching allocator would place it)."""
    up = lambda n: -(-max(n, 1) // CUDA_ALLOC_ALIGN) * CUDA_ALLOC_ALIGN
    total = sum(up(n) for n in nbytes_list) + CUDA_ALLOC_ALIGN
    raw = torch.zeros(total, dtype=torch.uint8)
    off = (-raw.data_ptr()) % CUDA_ALLOC_ALIGN
    out = []
    for n in nbytes_list:
        out.append(raw[off:off + n])
        off += up(n)
    return out


def launch_spec(case: Case):
    """``(layout, grid, args, kwargs)``: the launcher's own launch for ``case``, on host
    tensors placed like CUDA allocations."""
    layout = KVLayout.named(case.layout, num_blocks=case.num_blocks, num_layers=case.num_layers,
                            num_heads=case.num_heads, block_size=case.block_size,
                            head_dim=case.head_dim, dtype=DTYPES[case.dtype])
    h0, h1 = case.heads or (0, layout.num_heads)
    shape = staging_shape(case.n_ids, layout.num_layers, h1 - h0, layout.block_size,
                          layout.head_dim)
    tensor_bytes = int(torch.Size(layout.shape).numel()) * layout.itemsize
    stg_bytes = int(torch.Size(shape).numel()) * layout.itemsize
    bufs = _arena([tensor_bytes] * layout.num_tensors + [stg_bytes])
    tensors = [b.view(layout.dtype).view(layout.shape) for b in bufs[:-1]]
    staging = bufs[-1].view(layout.dtype).view(shape)
    ids = torch.arange(case.n_ids, dtype=torch.int64) * 3 % layout.num_blocks
    ids[1] = -1  # a padding row, as pulls of partial prefixes send
    launch = _pack_mod._launch_args(tensors, layout, ids, staging, 0, layout.num_layers,
                                    h0, h1, case.pack, None)
    assert launch is not None, "a case with rows to copy"
    grid, args, kwargs = launch
    return layout, grid, args, kwargs


@functools.lru_cache(maxsize=1)
def _jit_kernel():
    """The kernel as a JITFunction (under TRITON_INTERPRET=1 the module holds an
    interpreter wrapper around the same Python function)."""
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    k = _pack_mod._kv_copy_kernel
    return k if isinstance(k, JITFunction) else JITFunction(
        k.fn, do_not_specialize=list(_pack_mod.NOT_SPECIALISED))


def specialise(case: Case):
    """``(kernel, signature, constexprs, attrs, options, target)`` for ``case``: what
    Triton's JIT hands its compiler for this launch on a GPU of ``case.arch``."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import make_backend  # noqa: PLC0415
    from triton.runtime.jit import create_function_from_signature  # noqa: PLC0415

    kernel = _jit_kernel()
    target = GPUTarget("cuda", ARCHS[case.arch], 32)
    backend = make_backend(target)
    _layout, _grid, args, kwargs = launch_spec(case)
    kwargs = {**kwargs, **dict(case.override)}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    for i in case.drop_align:
        spec[i] = (spec[i][0], "")
    options, signature, constexprs, attrs = kernel._pack_args(backend, opts, bound, spec, opts)
    return kernel, signature, constexprs, attrs, options, target


@dataclass(frozen=True)
class Access:
    op: str                 # "ld" | "st"
    width: int              # bytes per thread
    bases: tuple[str, ...]  # the pointer arguments its address is computed from
    text: str

    @property
    def data(self) -> bool:
        """A pool or staging access (not a block-id or layer-offset load)."""
        return bool({"pool_ptr", "staging_ptr"} & set(self.bases))


@dataclass
class Compiled:
    case: Case
    accesses: list[Access]
    n_regs: int
    spill_bytes: int  # local memory per thread (spilled registers live there)
    compile_s: float
    specialisation: dict
    ptx: str = dataclasses.field(repr=False, default="")

    @property
    def n_spills(self) -> int:
        """As the CUDA driver reports it to Triton: local bytes / 4."""
        return self.spill_bytes // 4

    def widths(self, op: str, data: bool = True) -> list[int]:
        return [a.width for a in self.accesses if a.op == op and a.data == data]

    def bases(self, op: str, data: bool = True) -> set[str]:
        return {b for a in self.accesses if a.op == op and a.data == data for b in a.bases}

    def summary(self) -> dict:
        c = self.case
        return {
            "case": c.name, "arch": c.arch, "layout": c.layout, "dtype": c.dtype,
            "head_dim": c.head_dim, "block_size": c.block_size,
            "direction": "pack" if c.pack else "unpack",
            "heads": list(c.heads) if c.heads else None,
            "n_regs": self.n_regs, "n_spills": self.n_spills, "spill_bytes": self.spill_bytes,
            "data_load_bytes": sorted(set(self.widths("ld"))),
            "data_store_bytes": sorted(set(self.widths("st"))),
            "data_loads": len(self.widths("ld")), "data_stores": len(self.widths("st")),
            "index_loads": len(self.widths("ld", data=False)),
            "index_load_bytes": sorted(set(self.widths("ld", data=False))),
            "data_loads_from": sorted(self.bases("ld")), "data_stores_to": sorted(self.bases("st")),
            "index_loads_from": sorted(self.bases("ld", data=False)),
            "specialisation": self.specialisation, "compile_s": round(self.compile_s, 3),
            "vector_problems": vector_problems(self),
        }


_PTR_PARAM = re.compile(r"\.param\s+\.u64\s+\.ptr\b[^,)]*?_param_(\d+)")
_PARAM_LOAD = re.compile(r"\[\w+_param_(\d+)\]")
_REG = re.compile(r"%[a-z]+\d+")
_TYPE = re.compile(r"\.(?:b|u|s|f)(\d+)$")
_NO_DEST = ("st.", "bra", "ret", "bar", "membar", "fence", "exit", "trap", "prefetch")


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands (braces and brackets kept whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "{["
        depth -= ch in "}]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def global_accesses(ptx: str, arg_names: list[str]) -> list[Access]:
    """Every global load and store of ``ptx`` with its width and the pointer arguments its
    address is computed from: register arithmetic is followed from each ``ld.param`` of a
    pointer argument (to a fixed point, for loop-carried registers); a loaded value carries
    no pointer, so a pool address computed from loaded block ids names only ``pool_ptr``.
    ``arg_names`` are the kernel's non-constexpr arguments, in PTX parameter order."""
    ptr_params = {int(i) for i in _PTR_PARAM.findall(ptx)}
    insts = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].strip()
        if not line or line.startswith((".", "$", "{", "}", ")")) or not line.endswith(";"):
            continue
        line = re.sub(r"^@!?%p\d+\s+", "", line[:-1])
        opcode, _, rest = line.partition(" ")
        insts.append((opcode, _operands(rest.strip())))
    taint: dict[str, frozenset[int]] = {}
    changed = True
    while changed:
        changed = False
        for opcode, ops in insts:
            if not ops or opcode.startswith(_NO_DEST):
                continue
            if opcode.startswith("ld.param"):
                m = _PARAM_LOAD.search(ops[1]) if len(ops) > 1 else None
                new = frozenset({int(m.group(1))} & ptr_params) if m else frozenset()
            elif opcode.startswith("ld."):
                continue  # a loaded value is data, not a pointer
            else:
                new = frozenset().union(*(taint.get(r, frozenset())
                                          for op in ops[1:] for r in _REG.findall(op)))
            for r in _REG.findall(ops[0]):
                if not new <= taint.get(r, frozenset()):
                    taint[r] = taint.get(r, frozenset()) | new
                    changed = True
    out = []
    for opcode, ops in insts:
        m = re.fullmatch(r"(ld|st)\.global((?:\.[\w:]+)*)", opcode)
        if not m:
            continue
        mods = m.group(2)
        vec = next((int(p[1:]) for p in mods.split(".") if re.fullmatch(r"v\d+", p)), 1)
        bits = _TYPE.search(mods)
        if bits is None:
            raise ValueError(f"no element type in {opcode!r}")
        addr = next(op for op in ops if op.startswith("["))
        params = frozenset().union(*(taint.get(r, frozenset()) for r in _REG.findall(addr)))
        bases = tuple(sorted(arg_names[i] if i < len(arg_names) else f"param_{i}" for i in params))
        out.append(Access(m.group(1), vec * int(bits.group(1)) // 8, bases,
                          f"{opcode} {', '.join(ops)}"))
    return out


def _cuda_tool(name: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK``, ``LOCAL``... of the cubin's one kernel (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuda_tool("cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}


def specialised(case: Case) -> dict:
    """The launch's specialisation in words: arguments known 16-divisible, constexprs, warps."""
    kernel, _signature, constexprs, attrs, options, _target = specialise(case)
    names = kernel.arg_names
    return {
        "aligned16": [names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v],
        "constexprs": {names[k[0]]: v for k, v in constexprs.items()},
        "num_warps": options.num_warps,
    }


@functools.cache
def compile_case(case: Case) -> Compiled:
    """Compile ``case`` ahead of time (cached per process); raises on a compile failure."""
    import triton  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    kernel, signature, constexprs, attrs, options, target = specialise(case)
    t0 = time.perf_counter()
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    elapsed = time.perf_counter() - t0
    usage = resource_usage(compiled.asm["cubin"])
    names = kernel.arg_names
    spec = specialised(case)
    ptx = compiled.asm["ptx"]
    runtime_args = [n for i, n in enumerate(names) if (i,) not in constexprs]
    return Compiled(case, global_accesses(ptx, runtime_args), usage["REG"],
                    usage.get("STACK", 0) + usage.get("LOCAL", 0), elapsed, spec, ptx)


def alignment_allows(case: Case) -> bool:
    """Whether the bytes of the launch allow 16-byte accesses on both sides (a fact of the
    layout, independent of what the compiler is told): 16-aligned allocations, and the
    contiguous run of a row, every other pool stride and every layer offset a multiple of
    16 bytes. A row's run is ``T x D`` when tokens follow head_dim densely, else ``D``."""
    layout, _grid, args, _kwargs = launch_spec(case)
    item = layout.itemsize
    dense = layout.contiguous_run_bytes != layout.bytes_per_token_head or layout.block_size == 1
    skip = {"dim", "token"} if dense else {"dim"}
    facts = [layout.contiguous_run_bytes]
    facts += [layout.stride(a) * item for a in layout.order if a.value not in skip]
    facts += [a.data_ptr() for a in args[:2]]
    if layout.per_layer:  # each layer its own allocation: offsets are allocation-aligned
        facts.append(CUDA_ALLOC_ALIGN)
    else:
        facts.append(layout.stride("layer") * item)
    return all(f % VECTOR_BYTES == 0 for f in facts)


_POOL_STRIDES = ("stride_block", "stride_kv", "stride_head", "stride_token")


def alignment_not_told(case: Case) -> list[str]:
    """Pool strides whose bytes are 16-byte multiples but which the launch does not tell the
    compiler are (Triton specialises an integer argument only as divisible by 16 *elements*,
    here words): accesses through them cannot be proven 16-byte aligned."""
    layout, _grid, args, kwargs = launch_spec(case)
    kernel = _jit_kernel()
    word_bytes = layout.head_dim * layout.itemsize // kwargs["DW"]
    aligned = specialised(case)["aligned16"]
    out = []
    for name in _POOL_STRIDES:
        if name == "stride_token" and layout.block_size == 1:
            continue  # one token: the stride is never multiplied by anything but 0
        words = args[kernel.arg_names.index(name)]
        if words != 1 and (words * word_bytes) % VECTOR_BYTES == 0 and name not in aligned:
            out.append(f"{name}={words} words")
    return out


def vector_problems(c: Compiled) -> list[str]:
    """What keeps ``c`` from moving every data word in 16-byte accesses (empty: nothing)."""
    problems = []
    loads, stores = c.widths("ld"), c.widths("st")
    if not loads or not stores:
        problems.append(f"no data {'loads' if not loads else 'stores'} found in the PTX")
    for op, widths in (("load", loads), ("store", stores)):
        narrow = sorted({w for w in widths if w < VECTOR_BYTES})
        if narrow:
            n = sum(w < VECTOR_BYTES for w in widths)
            problems.append(f"{n} of {len(widths)} data {op}s are {narrow} bytes wide, "
                            f"not {VECTOR_BYTES}")
    return problems


# --------------------------------------------------------------------------------------
# matrices
# --------------------------------------------------------------------------------------


def default_matrix() -> list[Case]:
    """The representative matrix of ``make test``: every layout x dtype on sm_90 (pack), every
    layout on sm_80 and sm_100, unpack on every layout, other head dims and block sizes, head
    slices."""
    cases = [Case(layout=lay, dtype=dt) for lay in LAYOUTS for dt in DTYPES]
    cases += [Case(layout=lay, arch=a) for lay in LAYOUTS for a in ("sm_80", "sm_100")]
    cases += [Case(layout=lay, pack=False) for lay in LAYOUTS]
    cases += [Case(layout="vllm_hnd", dtype="fp8_e4m3", arch=a, pack=False)
              for a in ("sm_80", "sm_100")]
    cases += [Case(layout=lay, head_dim=d) for lay in ("vllm_hnd", "vllm_nhd") for d in (64, 256)]
    cases += [Case(layout="trtllm", block_size=t) for t in (1, 32, 64)]
    cases += [Case(layout=lay, heads=(2, 4)) for lay in ("trtllm", "vllm_nhd")]
    # 64-byte rows (8-word strides): alignment allows 16 bytes, the launch does not say so
    cases += [Case(dtype="fp8_e4m3", head_dim=64)]
    return list(dict.fromkeys(cases))


def exhaustive_matrix() -> list[Case]:
    """Every layout x dtype x head_dim x block_size x direction x arch (slow)."""
    return [Case(layout=lay, dtype=dt, head_dim=d, block_size=t, pack=p, arch=a)
            for lay, dt, d, t, p, a in itertools.product(
                LAYOUTS, DTYPES, (64, 128, 256), (1, 16, 32), (True, False), ARCHS)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvkern.kernels.aot", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/kernel_aot.json")
    ap.add_argument("--exhaustive", action="store_true", help="the full matrix (minutes)")
    args = ap.parse_args(argv)
    import triton  # noqa: PLC0415

    matrix = exhaustive_matrix() if args.exhaustive else default_matrix()
    rows, failures = [], []
    for case in matrix:
        try:
            row = compile_case(case).summary()
        except Exception as e:  # noqa: BLE001 - a failed compile is a result to record
            failures.append({"case": case.name, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        row["alignment_allows_16B"] = alignment_allows(case)
        row["alignment_not_told"] = alignment_not_told(case)
        rows.append(row)
    doc = {
        "what": "pack/unpack kernel compiled ahead of time (no GPU): registers, spills and "
                "global access widths per launch configuration",
        "triton": triton.__version__, "torch": torch.__version__,
        "matrix": "exhaustive" if args.exhaustive else "default",
        "cases": rows, "failures": failures,
        "spilling": [r["case"] for r in rows if r["n_spills"]],
        "not_16B": [r["case"] for r in rows if r["vector_problems"]],
        "not_16B_alignment_not_told": [r["case"] for r in rows
                                       if r["vector_problems"] and r["alignment_not_told"]],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{len(rows)} compiled, {len(failures)} failed, {len(doc['spilling'])} spilling, "
          f"{len(doc['not_16B'])} not 16-byte -> {args.out}")
    return 1 if failures or doc["spilling"] else 0


if __name__ == "__main__":
    sys.exit(main())
