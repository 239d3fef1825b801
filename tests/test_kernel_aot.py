"""The pack/unpack kernel compiled ahead of time for sm_80, sm_90 and sm_100, no GPU needed.

Each case is a launch the launcher really makes (its own arguments and Triton's own
specialisation of them, see :mod:`kvkern.kernels.aot`). A case must compile, must not spill,
must move data only between the pool and staging, and where the bytes allow and the launch
tells the compiler so, every data load and store in the PTX must be 16 bytes wide. The
negative tests drop the alignment facts and require the checker to report narrow accesses.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("triton")

from kvkern.kernels import aot  # noqa: E402
from kvkern.kernels.aot import Case  # noqa: E402

GAP_REASON = ("alignment allows 16-byte accesses but a pool stride is a multiple of 8 words, "
              "not 16, and the launch does not tell the compiler (8-byte pool accesses)")


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=GAP_REASON)] if aot.alignment_not_told(case) else []
    return pytest.param(case, id=case.name, marks=marks)


# the default matrix holds one known gap: fp8 with head_dim 64 (64-byte rows, 8-word strides)
CASES = [_param(c) for c in aot.default_matrix()]


def _direction_ok(c: aot.Compiled) -> None:
    src, dst = ("pool_ptr", "staging_ptr") if c.case.pack else ("staging_ptr", "pool_ptr")
    assert c.bases("ld") == {src}, c.accesses
    assert c.bases("st") == {dst}, c.accesses
    assert c.bases("ld", data=False) == {"block_ids_ptr", "layer_off_ptr"}
    assert not c.widths("st", data=False), "the kernel stores nothing but copied data"


@pytest.mark.parametrize("case", CASES)
def test_compiles_without_spills_and_moves_16_byte_words(case):
    c = aot.compile_case(case)
    target = {"sm_80": "sm_80", "sm_90": "sm_90a", "sm_100": "sm_100a"}[case.arch]
    assert re.search(rf"^\.target {target}$", c.ptx, re.M)
    assert c.n_regs > 0
    assert c.n_spills == 0, f"{c.n_regs} registers, {c.spill_bytes} bytes of local memory"
    _direction_ok(c)
    assert aot.alignment_allows(case)
    assert aot.vector_problems(c) == []
    assert set(c.widths("ld")) == set(c.widths("st")) == {16}


def test_specialisation_is_the_launchers():
    """Constexprs are the launcher's keyword arguments; pointers of 512-byte aligned
    allocations are known 16-aligned; the counts and starts of a pull's pieces are never
    specialised, so a head slice, another layer range or another number of blocks runs the
    kernel already compiled (no compile on the request path)."""
    layout, grid, args, kwargs = aot.launch_spec(Case(layout="trtllm", heads=(2, 4)))
    spec = aot.specialised(Case(layout="trtllm", heads=(2, 4)))
    assert spec["num_warps"] == kwargs["num_warps"]
    assert spec["constexprs"] == {k: v for k, v in kwargs.items() if k != "num_warps"}
    assert {"pool_ptr", "staging_ptr", "block_ids_ptr", "layer_off_ptr"} <= set(spec["aligned16"])
    assert not set(spec["aligned16"]) & {"head_start", "n_heads", "n_rows", "n_groups"}
    for other in (Case(layout="trtllm"), Case(layout="trtllm", n_ids=16),
                  Case(layout="trtllm", heads=(0, 1))):
        assert aot.specialised(other) == spec, other
    assert grid[0] >= 1 and layout.name == "trtllm"
    # the launcher marks the cached layer offsets (its fourth argument) used by the
    # launch's stream, so an evicted entry is not reused under a running kernel
    assert args[3] is aot._pack_mod._layer_offsets_tensor(
        tuple(args[3].tolist()), args[3].device)


# ---------------------------------------------------------------------------------------
# the check can fail
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pack_dir", [True, False], ids=["pack", "unpack"])
def test_dropping_the_layer_offset_hint_loses_16_byte_pool_accesses(pack_dir):
    """LOFF_ALIGN=1 is the kernel without ``tl.multiple_of`` on the loaded layer offset: the
    pool side (loads for pack, stores for unpack) falls back to 8-byte accesses, the staging
    side keeps 16, and the checker names the narrow side."""
    base = Case(layout="vllm_hnd", pack=pack_dir)
    c = aot.compile_case(dataclasses.replace(base, override=(("LOFF_ALIGN", 1),)))
    pool_op, stg_op = ("ld", "st") if pack_dir else ("st", "ld")
    assert set(c.widths(pool_op)) == {8}
    assert set(c.widths(stg_op)) == {16}
    problems = aot.vector_problems(c)
    word = "load" if pack_dir else "store"
    assert len(problems) == 1 and re.search(rf"data {word}s are \[8\] bytes wide", problems[0])
    assert aot.vector_problems(aot.compile_case(base)) == []


def test_withholding_pointer_alignment_loses_16_byte_accesses():
    """Without the pool pointer's 16-byte alignment fact (a pointer argument the JIT saw
    misaligned) the pool loads are 8 bytes wide."""
    case = Case(layout="trtllm", drop_align=(0,))
    c = aot.compile_case(case)
    assert "pool_ptr" not in c.specialisation["aligned16"]
    assert aot.vector_problems(c) and set(c.widths("ld")) == {8}


def test_checker_reads_ptx_widths_and_bases():
    ptx = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .u32 k_param_3
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	ld.param.b64 	%rd3, [k_param_2];
	ld.param.b32 	%r1, [k_param_3];
	mad.wide.s32 	%rd4, %r1, 8, %rd3;
	@%p1 ld.global.b64 { %rd5 }, [ %rd4 + 0 ];
	shl.b64 	%rd6, %rd5, 3;
	add.s64 	%rd7, %rd1, %rd6;
	@%p1 ld.global.L1::evict_last.v2.b64 { %rd8, %rd9 }, [ %rd7 + 0 ];
	@!%p2 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd7 + 16 ];
	add.s64 	%rd10, %rd2, %rd6;
	st.global.v2.b64 [ %rd10 + 0 ], { %rd8, %rd9 };
	st.global.b32 [ %rd10 + 16 ], %r2;
	st.global.u8 [ %rd10 + 20 ], %rs1;
}
"""
    acc = aot.global_accesses(ptx, ["pool_ptr", "staging_ptr", "block_ids_ptr", "n"])
    assert [(a.op, a.width, a.bases, a.data) for a in acc] == [
        ("ld", 8, ("block_ids_ptr",), False),   # an id load; its value carries no pointer
        ("ld", 16, ("pool_ptr",), True),
        ("ld", 16, ("pool_ptr",), True),
        ("st", 16, ("staging_ptr",), True),
        ("st", 4, ("staging_ptr",), True),
        ("st", 1, ("staging_ptr",), True),
    ]
    c = aot.Compiled(Case(), acc, 10, 0, 0.0, {})
    assert aot.vector_problems(c) == ["2 of 3 data stores are [1, 4] bytes wide, not 16"]
    assert aot.vector_problems(aot.Compiled(Case(), acc[:1], 10, 0, 0.0, {})) == [
        "no data loads found in the PTX"]


# ---------------------------------------------------------------------------------------
# exhaustive (slow): every layout x dtype x head_dim x block_size x direction x arch
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_exhaustive_matrix():
    failures, spills, narrow, gap_vectorised = [], [], [], []
    for case in aot.exhaustive_matrix():
        try:
            c = aot.compile_case(case)
        except Exception as e:  # noqa: BLE001 - collect every failing case
            failures.append(f"{case.name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if c.n_spills:
            spills.append(f"{case.name}: {c.spill_bytes} B")
        _direction_ok(c)
        if aot.alignment_allows(case):
            problems = aot.vector_problems(c)
            if aot.alignment_not_told(case):
                if not problems:
                    gap_vectorised.append(case.name)
            elif problems:
                narrow.append(f"{case.name}: {problems}")
    assert not failures, failures[:20]
    assert not spills, spills[:20]
    assert not narrow, narrow[:20]
    # the known gap closed: update alignment_not_told and this test's expectations
    assert not gap_vectorised, gap_vectorised[:20]
