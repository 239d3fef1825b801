"""One-sided reads (kvkern.xfer.ucp_rma): the ctypes binding against the UCX headers, the
pure helpers by property, and real ``ucp_get_nbx`` reads on loopback.

The loopback tests read through a read lane (kvkern.xfer.read_lanes) of this process from a
randomly filled source buffer registered in its read target into poisoned destination
buffers. The lanes' own rules (cancellation, drains, stuck reads) are in
tests/test_read_lanes.py.

Observed on this machine (ucxx 0.52, libucx 1.21, reads over ``cma/memory``, i.e.
``process_vm_readv`` on the peer's pid, which is our own pid here):

* a read completes inside ``ucp_get_nbx`` or very shortly after, so a read cannot be made
  to run "long" with real memory; the timeout test holds the batch's completion polling
  instead (the requests themselves are real);
* CMA does not look at the remote key's bounds: a read past the end of a registered region
  into mapped memory of the peer returns those bytes, and an all-zero "rkey" unpacks and
  reads fine. Only an unmapped remote address fails (UCS_ERR_IO_ERROR);
* ``ucs_status_t`` is a 1-byte packed enum (``ucp_request_check_status`` zero-extends it
  in a register): the binding must read it as a signed byte, else a failed read reports
  ``status 253`` instead of ``UCS_ERR_IO_ERROR`` (``test_status_return_type_matches_header``).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkern.layout.hostmem import host_buffer
from kvkern.xfer import read_lanes, ucp_rma, ucxcompat
from kvkern.xfer.read_lanes import ReadLanes
from kvkern.xfer.transport import ReadsStuck, TransportError
from kvkern.xfer.ucp_rma import RmaError, coalesce, expand, scatter_arrays

from .rma_helpers import random_host_buffer

pytestmark = pytest.mark.timeout(30)
aio = pytest.mark.asyncio(loop_scope="module")
HOST = "127.0.0.1"
POISON = 0xA5
SRC_BYTES = 64 << 20
UCX_INCLUDE = (Path(__file__).resolve().parents[1] / ".venv" / "lib" / "python3.11"
               / "site-packages" / "libucx" / "include")


# ------------------------------------------------------------------ binding vs headers

# The libucp prototypes ucxcompat binds (ucp/api/ucp.h), checked by the compiler below.
SIGNATURES = {
    "ucp_mem_map": ("ucs_status_t", ["ucp_context_h", "const ucp_mem_map_params_t *",
                                     "ucp_mem_h *"]),
    "ucp_mem_unmap": ("ucs_status_t", ["ucp_context_h", "ucp_mem_h"]),
    "ucp_rkey_pack": ("ucs_status_t", ["ucp_context_h", "ucp_mem_h", "void **", "size_t *"]),
    "ucp_rkey_buffer_release": ("void", ["void *"]),
    "ucp_ep_rkey_unpack": ("ucs_status_t", ["ucp_ep_h", "const void *", "ucp_rkey_h *"]),
    "ucp_rkey_destroy": ("void", ["ucp_rkey_h"]),
    "ucp_get_nbx": ("ucs_status_ptr_t", ["ucp_ep_h", "void *", "size_t", "uint64_t",
                                         "ucp_rkey_h", "const ucp_request_param_t *"]),
    "ucp_request_check_status": ("ucs_status_t", ["void *"]),
    "ucp_request_free": ("void", ["void *"]),
    "ucp_worker_progress": ("unsigned", ["ucp_worker_h"]),
    "ucp_ep_query": ("ucs_status_t", ["ucp_ep_h", "ucp_ep_attr_t *"]),
    "ucp_conn_request_query": ("ucs_status_t", ["ucp_conn_request_h",
                                                "ucp_conn_request_attr_t *"]),
    "ucp_listener_reject": ("ucs_status_t", ["ucp_listener_h", "ucp_conn_request_h"]),
}
CONSTANTS = {  # header name -> the value kvkern uses
    "UCP_MEM_MAP_PARAM_FIELD_ADDRESS": ucxcompat.MAP_FIELD_ADDRESS,
    "UCP_MEM_MAP_PARAM_FIELD_LENGTH": ucxcompat.MAP_FIELD_LENGTH,
    "UCP_MEM_MAP_PARAM_FIELD_PROT": ucxcompat.MAP_FIELD_PROT,
    "UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE": ucxcompat.MAP_FIELD_MEMORY_TYPE,
    "UCP_MEM_MAP_PROT_LOCAL_READ": ucxcompat.PROT_LOCAL_READ,
    "UCP_MEM_MAP_PROT_LOCAL_WRITE": ucxcompat.PROT_LOCAL_WRITE,
    "UCP_MEM_MAP_PROT_REMOTE_READ": ucxcompat.PROT_REMOTE_READ,
    "UCP_OP_ATTR_FIELD_MEMORY_TYPE": ucxcompat.OP_ATTR_FIELD_MEMORY_TYPE,
    "UCP_OP_ATTR_FIELD_DATATYPE": ucxcompat.OP_ATTR_FIELD_DATATYPE,
    "ucp_dt_make_iov()": ucxcompat.DATATYPE_IOV,
    "UCP_FEATURE_RMA": ucxcompat.UCP_FEATURE_RMA,
    "UCS_MEMORY_TYPE_HOST": ucp_rma.MEMORY_TYPES["host"],
    "UCS_MEMORY_TYPE_CUDA": ucp_rma.MEMORY_TYPES["cuda"],
    "UCS_OK": ucp_rma.UCS_OK,
    "UCS_INPROGRESS": ucp_rma.UCS_INPROGRESS,
    "UCS_ERR_CANCELED": ucp_rma.UCS_ERR_CANCELED,
    "UCS_ERR_UNREACHABLE": ucp_rma.UCS_ERR_UNREACHABLE,
    "UCP_EP_ATTR_FIELD_TRANSPORTS": ucxcompat.EP_ATTR_FIELD_TRANSPORTS,
    "UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR": ucxcompat.EP_ATTR_FIELD_REMOTE_SOCKADDR,
    "UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR": ucxcompat.CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR,
    "UCS_ERR_LAST": ucxcompat.UCS_ERR_LAST,
}
STRUCTS = {"ucp_mem_map_params_t": ucxcompat.MemMapParams,
           "ucp_request_param_t": ucxcompat.RequestParam,
           "ucp_dt_iov_t": ucp_rma.DtIov,
           "ucp_ep_attr_t": ucxcompat.EpAttr,
           "ucp_transports_t": ucxcompat.Transports,
           "ucp_transport_entry_t": ucxcompat.TransportEntry,
           "ucp_conn_request_attr_t": ucxcompat.ConnRequestAttr}
# ucs_status_ptr_t values at the edges of UCS_PTR_IS_PTR / UCS_PTR_IS_ERR
PTR_PROBES = [0, 1, 4096, (1 << 63) - 1, 1 << 63, 2**64 - 101, 2**64 - 100, 2**64 - 25,
              2**64 - 16, 2**64 - 1]


def _c_program() -> str:
    out = ["#include <stddef.h>", "#include <stdint.h>", "#include <stdio.h>",
           "#include <ucp/api/ucp.h>", "int main(void) {"]
    for cname, cls in STRUCTS.items():
        out.append(f'printf("size {cname} %zu\\n", sizeof({cname}));')
        for fname, _ in cls._fields_:
            out.append(f'printf("field {cname}.{fname} %zu %zu\\n", offsetof({cname}, {fname}),'
                       f" sizeof((({cname} *)0)->{fname}));")
    for name in CONSTANTS:
        out.append(f'printf("const {name} %lld\\n", (long long)({name}));')
    for fn, (ret, args) in SIGNATURES.items():
        proto = f"{ret} (*)({', '.join(args)})"
        out.append(f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{fn}), {proto}),"
                   f' "{fn} prototype");')
        sizes = ["0" if ret == "void" else f"sizeof({ret})"] + [f"sizeof({a})" for a in args]
        out.append(f'printf("sig {fn}' + " %zu" * len(sizes) + '\\n", ' + ", ".join(sizes)
                   + ");")
    for p in PTR_PROBES:
        out.append(f"{{ void *p = (void *)(uintptr_t){p}ULL; printf(\"ptr {p} %d %d\\n\", "
                   "(int)UCS_PTR_IS_PTR(p), (int)UCS_PTR_STATUS(p)); }")
    out += ["return 0;", "}"]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def header_facts(tmp_path_factory) -> dict:
    """What the C compiler says about the UCX headers shipped in the venv."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not on PATH")
    if not (UCX_INCLUDE / "ucp" / "api" / "ucp.h").exists():
        pytest.skip(f"no UCX headers under {UCX_INCLUDE}")
    d = tmp_path_factory.mktemp("ucp_abi")
    (d / "abi.c").write_text(_c_program())
    subprocess.run([gcc, "-std=gnu11", "-I", str(UCX_INCLUDE), "-o", str(d / "abi"),
                    str(d / "abi.c")], check=True, timeout=60, capture_output=True)
    out = subprocess.run([str(d / "abi")], check=True, timeout=10, capture_output=True,
                         text=True).stdout
    facts: dict = {"size": {}, "field": {}, "const": {}, "sig": {}, "ptr": {}}
    for line in out.splitlines():
        kind, name, *vals = line.split()
        facts[kind][name] = [int(v) for v in vals]
    return facts


@pytest.mark.parametrize("cname", sorted(STRUCTS))
def test_struct_layout_matches_header(header_facts, cname):
    cls = STRUCTS[cname]
    assert ctypes.sizeof(cls) == header_facts["size"][cname][0]
    for fname, _ in cls._fields_:
        off, size = header_facts["field"][f"{cname}.{fname}"]
        desc = getattr(cls, fname)
        assert (desc.offset, desc.size) == (off, size), f"{cname}.{fname}"


def test_constants_match_header(header_facts):
    got = {name: header_facts["const"][name][0] for name in CONSTANTS}
    assert got == CONSTANTS


def test_argument_types_match_header(header_facts):
    """Every function ucxcompat binds is listed here (and so checked by the compiler), and
    its argument (and non-status return) sizes match the prototype."""
    lib = ucxcompat.libucp()
    bound = {name for name in dir(lib) if name.startswith("ucp_")
             and getattr(lib, name).argtypes is not None}
    assert bound and bound <= set(SIGNATURES), f"not checked here: {bound - set(SIGNATURES)}"
    for fn in bound:
        ret = SIGNATURES[fn][0]
        c_ret, *c_args = header_facts["sig"][fn]
        f = getattr(lib, fn)
        assert [ctypes.sizeof(a) for a in f.argtypes] == c_args, fn
        if ret == "void":
            assert f.restype is None, fn
        elif ret == "ucs_status_ptr_t":
            assert f.restype is ctypes.c_void_p, fn  # _ptr_status decodes it
        else:
            assert ctypes.sizeof(f.restype) == c_ret, fn


def test_status_return_type_matches_header(header_facts):
    lib = ucxcompat.libucp()
    for fn, (ret, _) in SIGNATURES.items():
        if ret == "ucs_status_t":
            f = getattr(lib, fn)
            assert ctypes.sizeof(f.restype) == header_facts["sig"][fn][0], fn
            assert f.restype(-1).value == -1, f"{fn}: ucs_status_t is signed"


def test_ptr_status_matches_header_macros(header_facts):
    for p in PTR_PROBES:
        is_ptr, status = header_facts["ptr"][str(p)]
        assert ucxcompat.ptr_status(p) == (None if is_ptr else status), hex(p)
    assert ucxcompat.ptr_status(None) == ucp_rma.UCS_OK  # ctypes turns NULL into None


def test_status_names_match_header():
    path = UCX_INCLUDE / "ucs" / "type" / "status.h"
    if not path.exists():
        pytest.skip(f"no UCX headers under {UCX_INCLUDE}")
    text = path.read_text()
    header = {int(v): n for n, v in re.findall(r"^\s*(UCS_(?:OK|ERR_\w+))\s*=\s*(-?\d+)", text,
                                              re.M)
              if "_FIRST_" not in n and "_LAST" not in n}
    assert header[-16] == "UCS_ERR_CANCELED" and header[0] == "UCS_OK" and len(header) > 20
    assert header == ucp_rma._STATUS_NAMES
    assert str(RmaError("x", -16)) == "x: UCS_ERR_CANCELED"
    assert RmaError("x", -77).status == -77 and "status -77" in str(RmaError("x", -77))


# ----------------------------------------------------------------------- pure helpers


@st.composite
def block_addresses(draw):
    """(local, remote, nbytes): address lists built from steps that continue on both
    sides, on one side only, or jump anywhere (possibly backwards or onto each other)."""
    nbytes = draw(st.integers(1, 1 << 21))
    n = draw(st.integers(0, 40))
    lo, rem = draw(st.integers(0, 1 << 47)), draw(st.integers(0, 1 << 47))
    jump = st.integers(-(1 << 22), 1 << 22)
    local, remote = [], []
    for i in range(n):
        if i:
            step = draw(st.sampled_from(["both", "both", "local", "remote", "jump"]))
            lo += nbytes if step in ("both", "local") else draw(jump)
            rem += nbytes if step in ("both", "remote") else draw(jump)
        local.append(lo)
        remote.append(rem)
    return local, remote, nbytes


@settings(max_examples=300, deadline=None)
@given(block_addresses())
def test_coalesce_properties(case):
    local, remote, nbytes = case
    runs = coalesce(local, remote, nbytes)
    if min(local + remote, default=0) >= 0:  # the vectorized twin the pull path uses
        arrays = np.asarray(local, dtype=np.uint64), np.asarray(remote, dtype=np.uint64)
        assert ucp_rma.coalesce_arrays(*arrays, nbytes) == runs
        small, ucp_rma._SMALL_RUNS = ucp_rma._SMALL_RUNS, -1  # (its numpy path, any length)
        try:
            assert ucp_rma.coalesce_arrays(*arrays, nbytes) == runs
        finally:
            ucp_rma._SMALL_RUNS = small
    # the runs cover exactly the blocks, in order
    expanded = []
    for lo, rem, n in runs:
        assert isinstance(n, int) and n > 0 and n % nbytes == 0
        expanded += [(lo + j * nbytes, rem + j * nbytes) for j in range(n // nbytes)]
    assert expanded == list(zip(local, remote, strict=True))
    # merged only when consecutive on both sides; maximal: no two neighbours could merge
    for (lo, rem, n), (lo2, rem2, _) in zip(runs, runs[1:], strict=False):
        assert not (lo + n == lo2 and rem + n == rem2)
    breaks = sum(1 for i in range(1, len(local)) if not (
        local[i] == local[i - 1] + nbytes and remote[i] == remote[i - 1] + nbytes))
    assert len(runs) == (breaks + 1 if local else 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), max_size=5), st.lists(st.integers(0, 1 << 40),
                                                              max_size=5))
def test_coalesce_rejects_mismatched_lengths(local, remote):
    if len(local) == len(remote):
        assert len(coalesce(local, remote, 8)) <= len(local)
    else:
        with pytest.raises(ValueError, match="local vs"):
            coalesce(local, remote, 8)


def test_coalesce_examples():
    assert coalesce([], [], 4096) == []
    assert coalesce([0, 8, 16], [100, 108, 116], 8) == [(0, 100, 24)]
    assert coalesce([0, 8, 16], [100, 108, 200], 8) == [(0, 100, 16), (16, 200, 8)]
    assert coalesce([16, 8, 0], [116, 108, 100], 8) == [(16, 116, 8), (8, 108, 8), (0, 100, 8)]
    assert coalesce([0, 8], [100, 100], 8) == [(0, 100, 8), (8, 100, 8)]


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64 - 200, 2**64 - 1),
                 st.integers(0, 200)))
@example(None)
@example(0)
@example(2**64 - 100)
@example(2**64 - 101)
def test_ptr_status_property(ptr):
    """``ucs_status_ptr_t`` decoding as UCS_PTR_IS_ERR / UCS_PTR_IS_PTR define it."""
    got = ucxcompat.ptr_status(ptr)
    if not ptr:
        assert got == ucp_rma.UCS_OK
    elif ptr >= 2**64 - 100:  # (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST
        assert got == ptr - 2**64 and ucxcompat.UCS_ERR_LAST <= got < 0
    else:
        assert got is None  # a request handle


# ------------------------------------------------------------------ loopback fixtures


@pytest.fixture(scope="module")
def source():
    """SRC_BYTES random bytes registered for remote read in this process's read target:
    (buffer, Region)."""
    why = ucp_rma.rma_unavailable()
    if why is not None:
        pytest.skip(f"one-sided reads unavailable: {why}")
    buf = random_host_buffer(SRC_BYTES)
    region = ucp_rma.Region(buf.data_ptr(), SRC_BYTES)
    try:
        yield buf, region
    finally:
        region.close()


class LaneReader:
    """Reads as a destination makes them: on a read lane of its own
    (:class:`kvkern.xfer.read_lanes.ReadLanes`, one lane, one endpoint) to the worker of this
    process's read target; a failed read closes that endpoint, the next one opens another."""

    def __init__(self) -> None:
        self.lanes = ReadLanes(1, min_bytes=1)
        self.address = ucxcompat.read_target().address

    async def read(self, rkey: bytes, runs, *, timeout: float) -> float | None:
        return await self.read_parts([(rkey, runs)], timeout=timeout)

    async def read_parts(self, parts, *, timeout: float) -> float | None:
        return await self.lanes.read(self.address, parts, timeout=timeout, same_host=True)

    def close(self) -> None:
        self.lanes.close()


@pytest.fixture
def readers():
    """``readers()``: a new :class:`LaneReader` (a new endpoint), closed after the test."""
    made: list[LaneReader] = []

    def make() -> LaneReader:
        made.append(LaneReader())
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def raw_endpoint():
    """``(worker handle, endpoint handle)`` of a lane context's worker connected to the read
    target, for ReadBatch and RemoteKey without a lane around them."""
    worker, worker_handle = ucxcompat.new_worker(read_lanes._lane_context())
    ep, address, ep_handle = ucxcompat.endpoint_to_address(worker,
                                                           ucxcompat.read_target().address)
    yield worker_handle, ep_handle
    ucp_rma.forget_endpoint(ep_handle)
    ucxcompat.close_endpoint(ep)
    del address, worker


def poisoned(nbytes: int) -> torch.Tensor:
    t = host_buffer(nbytes)
    t.fill_(POISON)
    return t


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a != b).nonzero().flatten()
    return f"{bad.numel()} bytes differ, first at {bad[:5].tolist()}"


@st.composite
def scatter_cases(draw):
    """Blocks of ``m`` pieces each, the blocks' remote starts continuing or jumping."""
    m = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 5000), min_size=m, max_size=m))
    total = sum(sizes)
    n = draw(st.integers(0, 30))
    remote, at = [], draw(st.integers(0, 1 << 40))
    for i in range(n):
        if i and draw(st.booleans()):
            at += draw(st.integers(0, 1 << 20))
        elif i:
            at += total
        remote.append(at)
    local = [[draw(st.integers(0, 1 << 40)) for _ in range(m)] for _ in range(n)]
    return (local, remote, sizes, draw(st.integers(1, 40)), draw(st.integers(1, 1 << 16)))


@settings(max_examples=300, deadline=None)
@given(scatter_cases())
def test_scatter_arrays_properties(case):
    """Expanded, the reads are each block's pieces in order at its remote bytes; each read
    is contiguous remotely, within the caps (or one block), and only merges blocks that
    continue one another remotely."""
    local, remote, sizes, max_pieces, max_bytes = case
    m, total = len(sizes), sum(sizes)
    reads = scatter_arrays(np.asarray(local, np.uint64).reshape(len(local), m),
                           np.asarray(remote, np.uint64), sizes, max_pieces=max_pieces,
                           max_bytes=max_bytes)
    want = []
    for lo, at in zip(local, remote, strict=True):
        for a, n in zip(lo, sizes, strict=True):
            want.append((a, at, n))
            at += n
    assert list(expand(reads)) == want
    b = 0
    for r in reads:
        k = len(r.local) // m
        assert r.nbytes == k * total and int(r.local[:, 1].sum()) == r.nbytes
        assert k == 1 or (len(r.local) <= max_pieces and r.nbytes <= max_bytes)
        assert r.remote == remote[b] and remote[b:b + k] == [remote[b] + i * total
                                                              for i in range(k)]
        b += k
    assert b == len(local)
    plain = (1, 2, 3)
    assert list(expand([plain, *reads[:1]]))[0] == plain


# ---------------------------------------------------------------------- loopback reads


def scatter(rng: random.Random, n_src: int, n_dst: int) -> tuple[list, int]:
    """(src block, dst slot) pairs in segments of 1-4 blocks consecutive on both sides,
    segments at shuffled places on each side and never touching one another."""
    src_starts, dst_starts = list(range(0, n_src - 4, 5)), list(range(0, n_dst - 4, 5))
    rng.shuffle(src_starts)
    rng.shuffle(dst_starts)
    pairs, segments = [], 0
    for s, d in zip(src_starts, dst_starts, strict=False):
        n = rng.randint(1, 4)
        pairs += [(s + j, d + j) for j in range(n)]
        segments += 1
    return pairs, segments


@pytest.mark.parametrize("nbytes,lstride,rstride,seed", [
    (4096, 4096, 4096, 1),
    (65536, 65536 + 4096, 65536, 2),
    (12345, 20000, 13001, 3),
    (256 << 10, 256 << 10, 256 << 10, 4),
], ids=["4KiB-rows", "64KiB-gapped-dst", "odd-unaligned", "256KiB-rows"])
@aio
async def test_scattered_blocks_bit_exact(readers, source, nbytes, lstride, rstride,
                                          seed):
    """Shuffled source blocks into shuffled destination slots: every block bit-exact, every
    other destination byte (gaps, margins) still poison; neighbours on both sides merge."""
    src, region = source
    reader = readers()
    n_dst = 120
    pairs, segments = scatter(random.Random(seed), SRC_BYTES // rstride, n_dst)
    margin = 4096 + 3
    dst = poisoned(margin + n_dst * lstride + margin)
    base = dst.data_ptr() + margin
    runs = coalesce([base + d * lstride for _, d in pairs],
                    [region.address + s * rstride for s, _ in pairs], nbytes)
    contiguous = lstride == rstride == nbytes
    assert len(runs) == (segments if contiguous else len(pairs))
    expected = torch.full_like(dst, POISON)
    for s, d in pairs:
        at = margin + d * lstride
        expected[at:at + nbytes] = src[s * rstride:s * rstride + nbytes]
    t0 = time.perf_counter()
    first = await reader.read(region.rkey, runs, timeout=10)
    assert first is not None and t0 <= first <= time.perf_counter()
    assert torch.equal(dst, expected), diff(dst, expected)


@aio
async def test_zero_runs(readers, source):
    _, region = source
    reader = readers()
    assert await reader.read(region.rkey, [], timeout=1) is None


@aio
async def test_one_huge_run(readers, source):
    """Almost the whole 64 MiB region in one run, at odd offsets on both sides."""
    src, region = source
    reader = readers()
    n = SRC_BYTES - 5 - 4091
    dst = poisoned(3 + n + 4096)
    runs = coalesce([dst.data_ptr() + 3], [region.address + 5], n)
    assert runs == [(dst.data_ptr() + 3, region.address + 5, n)]
    await reader.read(region.rkey, runs, timeout=10)
    assert torch.equal(dst[3:3 + n], src[5:5 + n]), diff(dst[3:3 + n], src[5:5 + n])
    assert (dst[:3] == POISON).all() and (dst[3 + n:] == POISON).all()


@aio
async def test_many_tiny_runs(readers, source):
    """300 x 4 KiB, shuffled, strided on both sides so that nothing merges."""
    src, region = source
    reader = readers()
    k, nb, ls, rs = 300, 4096, 8192, 12288
    srcs, dsts = random.Random(5).sample(range(SRC_BYTES // rs), k), list(range(k))
    random.Random(6).shuffle(dsts)
    dst = poisoned(k * ls)
    runs = coalesce([dst.data_ptr() + d * ls for d in dsts],
                    [region.address + s * rs for s in srcs], nb)
    assert len(runs) == k
    await reader.read(region.rkey, runs, timeout=10)
    expected = torch.full_like(dst, POISON)
    for s, d in zip(srcs, dsts, strict=True):
        expected[d * ls:d * ls + nb] = src[s * rs:s * rs + nb]
    assert torch.equal(dst, expected), diff(dst, expected)


@aio
async def test_read_batch_directly(source, raw_endpoint):
    """ReadBatch without a lane: post and wait off the loop (the wait progresses the
    worker), then every request is retired (freed) and nothing is stuck; a destroyed key
    refuses to post."""
    src, region = source
    worker, ep = raw_endpoint
    dst = poisoned(3 * 4096)
    key = ucp_rma.RemoteKey(ep, region.rkey)
    runs = [(dst.data_ptr() + i * 4096, region.address + (7 - i) * 4096, 4096) for i in range(3)]
    batch = ucp_rma.ReadBatch(key, runs, worker_handle=worker)
    await asyncio.to_thread(batch.post, ep)
    first = await asyncio.to_thread(batch.wait, 5.0)
    assert first is not None and batch.posted == 3 and batch.nbytes == 3 * 4096
    assert not batch.stuck and batch.poll()
    for i in range(3):
        assert torch.equal(dst[i * 4096:(i + 1) * 4096], src[(7 - i) * 4096:(8 - i) * 4096])
    empty = ucp_rma.ReadBatch(key, [], worker_handle=worker)
    empty.post(ep)
    assert empty.wait(1.0) is None and empty.posted == 0 and not empty.stuck
    key.destroy()
    key.destroy()  # idempotent
    late = ucp_rma.ReadBatch(key, runs, worker_handle=worker)
    with pytest.raises(ValueError, match="destroyed"):
        late.post(ep)
    assert late.posted == 0 and not late.stuck


@aio
async def test_region_arguments_and_close(source):
    buf = host_buffer(8192)
    addr = buf.data_ptr()
    for a, n in [(0, 10), (addr, 0), (addr, -1), (-4096, 10)]:
        with pytest.raises(ValueError, match="cannot register"):
            ucp_rma.Region(a, n)
    for mt in ["gpu", "", "HOST"]:
        with pytest.raises(ValueError, match="memory_type"):
            ucp_rma.Region(addr, 8192, memory_type=mt)
    region = ucp_rma.Region(addr, 8192)
    assert region.rkey and "mapped" in repr(region)
    assert region.contains(addr, 8192) and region.contains(addr + 8191, 1)
    assert not region.contains(addr + 1, 8192) and not region.contains(addr - 1, 2)
    region.close()
    region.close()  # idempotent
    assert "closed" in repr(region)


@aio
async def test_remote_key_garbage(source, raw_endpoint):
    """Empty bytes: ValueError before UCX sees them. Bytes naming memory domains this
    worker cannot unpack: RmaError (UCS_ERR_UNSUPPORTED here). An all-zero key (no memory
    domain at all) unpacks without complaint on this machine: reads over CMA need none."""
    _, region = source
    _, ep = raw_endpoint
    with pytest.raises(ValueError, match="empty"):
        ucp_rma.RemoteKey(ep, b"")
    with pytest.raises(RmaError, match="ucp_ep_rkey_unpack") as info:
        ucp_rma.RemoteKey(ep, b"\xff" * 64)
    assert info.value.status != ucp_rma.UCS_OK
    try:
        key = ucp_rma.RemoteKey(ep, bytes(64))
    except RmaError as exc:
        assert exc.status != ucp_rma.UCS_OK
    else:
        key.destroy()
    good = ucp_rma.RemoteKey(ep, region.rkey)
    assert good.handle and good.ep_handle == ep
    good.destroy()
    assert good.handle is None


async def failed_read(readers, key: bytes, remote: int):
    """(error, reader, poisoned destination) of a 4 KiB read of ``remote`` through ``key``,
    which must fail with a TransportError."""
    reader = readers()
    dst = poisoned(4096)
    with pytest.raises(TransportError) as info:
        await reader.read(key, [(dst.data_ptr(), remote, 4096)], timeout=2)
    return info.value, reader, dst


@aio
async def test_read_with_garbage_key_fails_and_closes_its_endpoint(readers, source):
    _, region = source
    err, reader, dst = await failed_read(readers, b"\xff" * 64, region.address)
    assert err.reason == "transfer_failed" and "ucp_ep_rkey_unpack" in str(err)
    assert reader.lanes.peers == 0 and (dst == POISON).all()


@aio
async def test_read_past_region_end_on_loopback(readers, source):
    """A remote address outside the registered region, in memory the peer has mapped.

    Observed here: the read SUCCEEDS and returns the peer's bytes (CMA's process_vm_readv
    checks the peer's address space, not the rkey's bounds), so on one host the rkey is no
    capability and the bounds checks of the callers are what keeps reads inside the pool.
    Across hosts (RDMA) the memory registration bounds the read. This test only asserts a
    clear outcome: the exact bytes, or transfer_failed with the endpoint closed."""
    src, _ = source
    reader = readers()
    small = ucp_rma.Region(src.data_ptr(), 512 << 10)  # only the first 512 KiB
    try:
        off = 768 << 10
        dst = poisoned(4096)
        try:
            await reader.read(small.rkey, [(dst.data_ptr(), small.address + off, 4096)], timeout=2)
        except TransportError as exc:
            assert exc.reason == "transfer_failed" and reader.lanes.peers == 0
            assert (dst == POISON).all()
        else:
            assert torch.equal(dst, src[off:off + 4096])
    finally:
        small.close()


@aio
async def test_read_from_unmapped_address_fails_cleanly(readers, source):
    """Remote address 4096 (below mmap_min_addr: never mapped). Observed: the read's request
    completes with an error (UCS_ERR_IO_ERROR): TransportError('transfer_failed'), the
    lane's endpoint closed, our memory untouched, no ReadsStuck, and the next read opens a
    new endpoint. (This relies on UCX reading over CMA, as UCX_PROTO_INFO=y shows here; a
    memcpy transport would fault the process instead.)"""
    src, region = source
    reader = readers()
    dst = poisoned(3 * 4096)
    runs = [(dst.data_ptr(), region.address, 4096), (dst.data_ptr() + 4096, 4096, 4096)]
    with pytest.raises(TransportError) as info:
        await reader.read(region.rkey, runs, timeout=2)
    err = info.value
    assert not isinstance(err, ReadsStuck)
    assert err.reason == "transfer_failed" and "UCS_ERR_" in str(err), err
    assert reader.lanes.peers == 0
    assert (dst[4096:] == POISON).all()
    await reader.read(region.rkey, [(dst.data_ptr(), region.address, 4096)], timeout=2)
    assert torch.equal(dst[:4096], src[:4096]) and reader.lanes.peers == 1


@aio
async def test_failed_read_names_its_ucs_status_and_keeps_the_cause(readers, source):
    _, region = source
    err, _, _ = await failed_read(readers, region.rkey, 4096)  # 4096: never mapped
    assert "UCS_ERR_" in str(err), str(err)
    cause = err.__cause__
    assert isinstance(cause, RmaError) and cause.status < 0, repr(cause)


@aio
async def test_read_parts_from_two_regions_interleave_into_one_buffer(readers, source):
    """One read over two registered regions (as from a per-layer pool: one key per layer):
    each part's runs land where they say, the poison between them stays."""
    src, region = source
    other = host_buffer(1 << 20)
    other.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8).flip(0))
    second = ucp_rma.Region(other.data_ptr(), other.numel())
    try:
        reader = readers()
        dst = poisoned(8 * 4096 + 4096)
        seg = 4096
        a = [(dst.data_ptr() + 2 * i * seg, region.address + 3 * i * seg, seg) for i in range(4)]
        b = [(dst.data_ptr() + (2 * i + 1) * seg, second.address + 5 * i * seg, seg)
             for i in range(4)]
        first = await reader.read_parts([(region.rkey, a), (second.rkey, b)], timeout=5)
        assert first is not None
        for i in range(4):
            assert torch.equal(dst[2 * i * seg:(2 * i + 1) * seg],
                               src[3 * i * seg:(3 * i + 1) * seg])
            assert torch.equal(dst[(2 * i + 1) * seg:(2 * i + 2) * seg],
                               other[5 * i * seg:(5 * i + 1) * seg])
        assert bool((dst[8 * seg:] == POISON).all())
    finally:
        second.close()


# ---------------------------------------------------------------- scattered reads (iov)


def _scatter_reads(region, dst: torch.Tensor, seed: int):
    """Source blocks of 4 pieces (3000, 8192, 1, 5000 B) at shuffled places, each piece
    at its own shuffled slot of ``dst``: the reads and the bytes ``dst`` must end with."""
    rng = random.Random(seed)
    sizes = [3000, 8192, 1, 5000]
    total, slot = sum(sizes), 8192
    blocks = rng.sample(range(SRC_BYTES // total - 1), 24)
    blocks[5:9] = [blocks[5] + i for i in range(4)]  # a run of consecutive source blocks
    slots = rng.sample(range(dst.numel() // slot - 1), 24 * 4)
    local = np.asarray([dst.data_ptr() + s * slot + 7 for s in slots], np.uint64).reshape(24, 4)
    remote = np.asarray([region.address + b * total for b in blocks], np.uint64)
    reads = scatter_arrays(local, remote, sizes, max_pieces=64, max_bytes=1 << 20)
    return reads, local, remote, sizes


def _expected(src, dst, local, remote, region, sizes) -> torch.Tensor:
    out = torch.full_like(dst, POISON)
    for lo, start in zip(local.tolist(), remote.tolist(), strict=True):
        at = start - region.address
        for a, n in zip(lo, sizes, strict=True):
            d = a - dst.data_ptr()
            out[d:d + n] = src[at:at + n]
            at += n
    return out


@pytest.fixture
def fresh_iov(monkeypatch):
    """Iov reads allowed again and no endpoint checked yet."""
    monkeypatch.setattr(ucp_rma, "_iov_reads", True)
    monkeypatch.setattr(ucp_rma, "_iov_verified", collections.OrderedDict())
    monkeypatch.setattr(ucp_rma, "_iov_mismatches", 0)
    monkeypatch.setattr(ucp_rma, "_iov_mismatched", None)
    monkeypatch.setattr(ucp_rma, "_iov_failures", collections.OrderedDict())


@aio
async def test_scattered_reads_land_bit_exact_and_are_checked_once(readers, source,
                                                                   fresh_iov):
    """Scatter reads (with plain runs in the same part): every piece bit-exact, the rest
    poison; the endpoint's first iov read is checked against a whole re-read, once, and
    again on a new endpoint once the old one is gone."""
    src, region = source
    reader = readers()
    dst = poisoned(4 << 20)
    reads, local, remote, sizes = _scatter_reads(region, dst, 1)
    assert len(reads) < 24 and any(len(r.local) > 4 for r in reads)
    extra = poisoned(4096)
    plain = (extra.data_ptr(), region.address + 12345, 4096)
    await reader.read(region.rkey, [plain, *reads], timeout=10)
    assert torch.equal(dst, _expected(src, dst, local, remote, region, sizes))
    assert torch.equal(extra, src[12345:12345 + 4096])
    assert ucp_rma._iov_reads and len(ucp_rma._iov_verified) == 1
    checks = []
    real = ucp_rma.ReadBatch._verify
    ucp_rma.ReadBatch._verify = lambda self, *a: checks.append(1) or real(self, *a)
    try:
        dst.fill_(POISON)
        await reader.read(region.rkey, reads, timeout=10)
    finally:
        ucp_rma.ReadBatch._verify = real
    assert checks == [] and torch.equal(dst, _expected(src, dst, local, remote, region, sizes))
    reader.close()  # its handle may come back for another endpoint: checked again there
    assert not ucp_rma._iov_verified
    reader = readers()
    await reader.read(region.rkey, reads, timeout=10)
    assert len(ucp_rma._iov_verified) == 1


def _fake_iov(monkeypatch, answer):
    """ucp_get_nbx over an iov replaced by ``answer(ep, iov, count, remote, rkey)``."""
    real = ucxcompat.read_poster

    def poster(memory_type, *, iov=False):
        return answer if iov else real(memory_type)

    monkeypatch.setattr(ucxcompat, "read_poster", poster)


@aio
async def test_a_ucx_refusing_iov_reads_gets_pieces(readers, source, fresh_iov,
                                                    monkeypatch):
    src, region = source
    reader = readers()
    _fake_iov(monkeypatch, lambda *a: (1 << 64) + ucp_rma.UCS_ERR_UNSUPPORTED_STATUS)
    dst = poisoned(4 << 20)
    reads, local, remote, sizes = _scatter_reads(region, dst, 2)
    await reader.read(region.rkey, reads, timeout=10)
    assert torch.equal(dst, _expected(src, dst, local, remote, region, sizes))
    assert not ucp_rma._iov_reads and reader.lanes.peers == 1


@aio
async def test_an_iov_read_that_moves_nothing_is_caught(readers, source, fresh_iov,
                                                        monkeypatch):
    """A UCX that completes an iov read without moving its bytes (and scribbles over the
    iov it was given): the check fails the read, and again on the retry, after which later
    reads from that source go piece by piece (from every source once a second one fails);
    the reads' own iovs were never touched."""
    src, region = source

    def no_op(ep, iov, count, remote, rkey):
        ctypes.memset(iov, 0x5A, count)  # as a UCX taking the iov for a contiguous buffer
        return 0

    _fake_iov(monkeypatch, no_op)
    dst = poisoned(4 << 20)
    reads, local, remote, sizes = _scatter_reads(region, dst, 3)
    before = [r.local.copy() for r in reads]
    for failures in (1, 2):
        reader = readers()
        with pytest.raises(TransportError, match="scattered read check"):
            await reader.read(region.rkey, reads, timeout=10)
        assert list(ucp_rma._iov_failures.values()) == [failures]
        assert ucp_rma._iov_reads  # (one source: its own reads only)
    assert all(np.array_equal(r.local, b) for r, b in zip(reads, before, strict=True))
    reader = readers()
    await reader.read(region.rkey, reads, timeout=10)
    assert torch.equal(dst, _expected(src, dst, local, remote, region, sizes))


@aio
async def test_a_source_rewriting_a_checked_read_costs_that_read_only(readers, source,
                                                                      fresh_iov,
                                                                      monkeypatch):
    """The source's bytes change between an endpoint's first iov read and its whole
    re-read (a block evicted and rewritten under load): that read fails, iov reads stay on,
    and the endpoint's next scattered read is checked again and passes. Such failures
    apart, with passing checks between them, never turn iov reads off."""
    src, region = source
    dst = poisoned(4 << 20)
    reads, local, remote, sizes = _scatter_reads(region, dst, 4)
    real = ucp_rma.ReadBatch._verify
    saved = src.clone()

    def rewritten(self, run, *a):
        at = run.remote - region.address
        src[at:at + run.nbytes] ^= 0xFF  # after the iov read, before the re-read
        return real(self, run, *a)

    for _ in range(3):
        reader = readers()
        monkeypatch.setattr(ucp_rma.ReadBatch, "_verify", rewritten)
        with pytest.raises(TransportError, match="scattered read check"):
            await reader.read(region.rkey, reads, timeout=10)
        monkeypatch.setattr(ucp_rma.ReadBatch, "_verify", real)
        src.copy_(saved)
        assert ucp_rma._iov_reads and not ucp_rma._iov_verified
        reader = readers()
        dst.fill_(POISON)
        await reader.read(region.rkey, reads, timeout=10)
        assert torch.equal(dst, _expected(src, dst, local, remote, region, sizes))
        assert ucp_rma._iov_reads and len(ucp_rma._iov_verified) == 1
        reader.close()  # the next round's endpoint is checked again


@aio
async def test_a_source_rewriting_its_bytes_between_the_whole_reads_never_turns_iov_off(
        readers, source, fresh_iov, monkeypatch):
    """A source whose bytes differ between an endpoint's first iov read and each of its
    whole re-reads (as a source rewriting its pinned blocks on purpose): each such read
    fails, but a mismatch whose two whole reads differ is the source's doing, counted
    against nothing, so iov reads stay on however often it happens."""
    src, region = source
    saved = src.clone()
    real = ucxcompat.read_poster

    def poster(memory_type, *, iov=False):
        post = real(memory_type, iov=iov)
        if iov:
            return post

        def rewriting(ep, local, count, remote, rkey):  # (only the checks read whole here)
            at = remote - region.address
            src[at:at + count] ^= 0xFF  # before each whole re-read: every one differs
            return post(ep, local, count, remote, rkey)

        return rewriting

    dst = poisoned(4 << 20)
    reads, local, remote, sizes = _scatter_reads(region, dst, 5)
    try:
        monkeypatch.setattr(ucxcompat, "read_poster", poster)
        for _ in range(3):
            reader = readers()
            with pytest.raises(TransportError, match=r"scattered read check \(the source"):
                await reader.read(region.rkey, reads, timeout=10)
            assert ucp_rma._iov_reads and ucp_rma._iov_mismatches == 0
        monkeypatch.setattr(ucxcompat, "read_poster", real)
    finally:
        src.copy_(saved)
    reader = readers()
    dst.fill_(POISON)
    await reader.read(region.rkey, reads, timeout=10)
    assert torch.equal(dst, _expected(src, dst, local, remote, region, sizes))
    assert ucp_rma._iov_reads and len(ucp_rma._iov_verified) == 1


def test_iov_mismatches_count_per_source(source, raw_endpoint, fresh_iov, monkeypatch):
    """A UCX whose iov reads move nothing (the whole re-reads agree, so the mismatch is
    not the source's doing): a source's second failed check makes that source's reads go
    piece by piece (and land), iov reads stay on for the others, and a failed check against
    a second source turns them off for the process."""
    src, region = source
    worker, ep = raw_endpoint

    def no_op(ep, iov, count, remote, rkey):
        return 0

    _fake_iov(monkeypatch, no_op)
    key = ucp_rma.RemoteKey(ep, region.rkey)
    dst = poisoned(4 << 20)
    reads, local, remote, sizes = _scatter_reads(region, dst, 6)

    def read(source: bytes) -> None:
        batch = ucp_rma.ReadBatch(key, reads, worker_handle=worker, source=source)
        batch.post(ep)
        batch.wait(10.0)

    try:
        for n in (1, 2):
            with pytest.raises(ucp_rma.ScatterCheckError, match=r"check: "):
                read(b"source A")
            assert ucp_rma._iov_reads and ucp_rma._iov_failures == {b"source A": n}
        dst.fill_(POISON)
        read(b"source A")  # piece by piece: no iov read, no check
        assert torch.equal(dst, _expected(src, dst, local, remote, region, sizes))
        assert ucp_rma._iov_reads and not ucp_rma._iov_verified
        dst.fill_(POISON)
        with pytest.raises(ucp_rma.ScatterCheckError):
            read(b"source B")
        assert not ucp_rma._iov_reads
    finally:
        key.destroy()
