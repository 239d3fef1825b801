"""Same-host reads (kvkern.xfer.local_reads): the announcement's parsing against hostile
documents, the batching of runs into system calls by property, and real reads from another
OS process into poisoned buffers, checked byte for byte."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
import time
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.xfer import local_reads
from kvkern.xfer.local_reads import IOV_MAX, LocalReadError, LocalSource, calls, parse
from kvkern.xfer.pauses import run_blocking
from kvkern.xfer.ucp_rma import Scatter, expand

pytestmark = pytest.mark.timeout(60)

SOURCE_BYTES = 1 << 20
SEED = 20261203

# A source process: a seeded buffer and the Beacon a source announces, then it waits for a
# line on stdin (or its parent's end) before it exits.
# It listens on a TCP port of its own, as a source serves its state.
_CHILD = f"""
import json, socket, sys
import numpy as np
from kvkern.xfer.local_reads import Beacon
buf = np.random.default_rng({SEED}).integers(0, 256, {SOURCE_BYTES}, dtype=np.uint8)
beacon = Beacon()
server = socket.create_server(("127.0.0.1", 0))
print(json.dumps({{"doc": beacon.doc(), "buf": int(buf.ctypes.data),
                   "port": server.getsockname()[1]}}), flush=True)
sys.stdin.readline()
"""


def source_bytes() -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def source():
    """(LocalSource, address of the child's buffer, the child)."""
    if local_reads.host_id() is None:
        pytest.skip("no host id (not Linux)")
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        info = json.loads(line)
        src = parse(info["doc"])
        assert src is not None and src.pid == child.pid
        child.doc, child.port = info["doc"], info["port"]
        if not local_reads.usable(src):
            pytest.skip("process_vm_readv is not permitted between these processes")
        yield src, info["buf"], child
    finally:
        child.kill()
        child.wait(10)


def poisoned(nbytes: int) -> np.ndarray:
    return np.full(nbytes, 0xA5, np.uint8)


def read(src: LocalSource, runs, stop: threading.Event | None = None,
         deadline: float | None = None) -> float | None:
    return run_blocking(local_reads.reading(
        src, [(b"", runs)], deadline or time.perf_counter() + 10, stop or threading.Event()))


def reference(dst: np.ndarray, runs, local_base: int, remote: np.ndarray,
              remote_base: int) -> np.ndarray:
    """What ``runs`` should leave in a copy of ``dst`` (the poison everywhere else)."""
    want = dst.copy()
    for lo, re, n in expand(runs):
        want[lo - local_base:lo - local_base + n] = remote[re - remote_base:re - remote_base + n]
    return want


# ---- the announcement

def doc(**over) -> dict:
    base = {"host": local_reads.host_id(), "pid": os.getpid() + 1, "at": 4096,
            "token": "ab" * local_reads.TOKEN_BYTES}
    return {**base, **over}


def test_parse_takes_a_well_formed_same_host_announcement():
    src = parse(doc())
    assert src == LocalSource(os.getpid() + 1, 4096, b"\xab" * local_reads.TOKEN_BYTES)


@pytest.mark.parametrize("over", [
    {"host": "another-host/1:2"}, {"host": 7}, {"host": "x" * 200},
    {"pid": os.getpid()}, {"pid": 0}, {"pid": -3}, {"pid": 1 << 22}, {"pid": True},
    {"pid": 12.0}, {"pid": "12"}, {"at": 0}, {"at": 1 << 64}, {"at": -1}, {"at": None},
    {"token": "ab"}, {"token": "zz" * local_reads.TOKEN_BYTES}, {"token": 5},
    {"token": "ab" * (local_reads.TOKEN_BYTES + 1)},
])
def test_parse_rejects_what_it_cannot_use(over):
    assert parse(doc(**over)) is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.text(max_size=20),
                 st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.sampled_from(["host", "pid", "at", "token", "x"]),
                                 st.one_of(st.none(), st.booleans(), st.integers(),
                                           st.text(max_size=40), st.floats()),
                                 max_size=5)))
def test_parse_never_raises(value):
    got = parse(value)
    assert got is None or isinstance(got, LocalSource)


# ---- runs into calls

@st.composite
def run_lists(draw):
    """Plain runs and Scatters in any order, at made-up addresses (never dereferenced)."""
    runs, addr = [], 1 << 20
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            for _ in range(draw(st.integers(1, 700))):
                n = draw(st.integers(1, 64))
                runs.append((addr, addr + (1 << 40), n))
                addr += n + draw(st.integers(0, 3))
        else:
            pieces = draw(st.integers(1, 300))
            rows = np.array([(addr + 16 * i, 8) for i in range(pieces)], np.uint64)
            runs.append(Scatter(rows, addr + (1 << 41), 8 * pieces))
            addr += 16 * pieces
        if draw(st.booleans()):  # a long run (cut into calls of CALL_BYTES)
            n = draw(st.integers(1, 3000))
            runs.append((addr, addr + (1 << 40), n))
            addr += n
    return runs


@settings(max_examples=60, deadline=None)
@given(run_lists(), st.sampled_from([64, 1000, 1 << 30]))
def test_calls_move_every_byte_once_in_order_within_the_limits(runs, call_bytes):
    want = [(lo, re, n) for lo, re, n in expand(runs)]
    local_bytes, remote_bytes = [], []
    with mock.patch.object(local_reads, "CALL_BYTES", call_bytes):
        made = [(rows(local), rows(remote), nbytes) for local, remote, nbytes in calls(runs)]
    for local, remote, nbytes in made:
        assert 0 < len(local) <= IOV_MAX and 0 < len(remote) <= IOV_MAX
        # (a Scatter is never cut: one alone may pass the bytes bound)
        assert nbytes <= call_bytes or len(remote) == 1
        assert int(local[:, 1].sum()) == int(remote[:, 1].sum()) == nbytes
        local_bytes += [(int(a), int(n)) for a, n in local]
        remote_bytes += [(int(a), int(n)) for a, n in remote]
    # the byte-by-byte pairing of both sides equals the runs' own
    def flat(rows):
        return [a + k for a, n in rows for k in range(n)]
    assert flat(local_bytes) == flat([(lo, n) for lo, _, n in want])
    assert flat(remote_bytes) == flat([(re, n) for _, re, n in want])


def rows(iov) -> np.ndarray:
    """A call's iovec rows (a numpy array, or ctypes' for a few runs) as ``uint64 [n, 2]``,
    checked to be what the system call is handed."""
    address, count = local_reads._iov(iov)
    out = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(address))
    return out.reshape(count, 2).copy()


# ---- real reads from another process

def test_plain_runs_and_scatters_land_bit_exact(source):
    src, base, _ = source
    theirs = source_bytes()
    dst = poisoned(SOURCE_BYTES)
    here = int(dst.ctypes.data)
    rng = np.random.default_rng(1)
    runs = []
    # 2500 plain runs of 64 B at shuffled source offsets (three calls), then Scatters of
    # 300 pieces each with three plain runs among them, then plain runs again
    offs = rng.permutation(SOURCE_BYTES // 256)[:2500] * 256
    runs += [(here + i * 64, base + int(o), 64) for i, o in enumerate(offs)]
    at = 2500 * 64
    for k in range(4):
        pieces = np.array([(here + at + 2 * 32 * i, 32) for i in range(300)], np.uint64)
        runs.append(Scatter(pieces, base + 500_000 + k * 9600, 300 * 32))
        at += 2 * 32 * 300
        if k == 1:  # a few plain runs between Scatters (laid out without numpy)
            runs += [(here + at + 48 * i, base + 700_000 + 100 * i, 40) for i in range(3)]
            at += 3 * 48
    runs += [(here + at + i * 128, base + 900_000 + i * 256, 128) for i in range(100)]
    want = reference(dst, runs, here, theirs, base)
    assert read(src, runs) is not None
    assert np.array_equal(dst, want)


def test_a_long_run_is_read_in_calls_of_call_bytes(source, monkeypatch):
    src, base, _ = source
    monkeypatch.setattr(local_reads, "CALL_BYTES", 64 << 10)
    made = []
    real = local_reads._call_once
    monkeypatch.setattr(local_reads, "_call_once", lambda *a: made.append(a[3]) or real(*a))
    dst = poisoned(SOURCE_BYTES)
    here = int(dst.ctypes.data)
    runs = [(here + 4096, base + 8192, 300_000), (here + 400_000, base, 1000)]
    want = reference(dst, runs, here, source_bytes(), base)
    read(src, runs)
    assert np.array_equal(dst, want)
    assert made == [64 << 10] * 4 + [300_000 - (256 << 10) + 1000]


def test_small_calls_keep_the_interpreter_lock_and_large_ones_release_it(source, monkeypatch):
    """A call of at most HOLD_BYTES goes through ``ctypes.PyDLL`` (the lock kept: taking it
    back in a busy engine can cost more than the call), a larger one through ``ctypes.CDLL``
    (the other lanes and the engine run during the copy); both read the same bytes."""
    assert local_reads._readv(True)._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert not local_reads._readv(False)._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    src, base, _ = source
    held = []
    real = local_reads._readv
    monkeypatch.setattr(local_reads, "_readv", lambda hold=False: held.append(hold) or real(hold))
    small, large = local_reads.HOLD_BYTES, local_reads.HOLD_BYTES + 4096
    dst = poisoned(small + large)
    here = int(dst.ctypes.data)
    runs = [(here, base, small), (here + small, base + 8192, large)]
    want = reference(dst, runs, here, source_bytes(), base)
    read(src, runs[:1])
    read(src, runs[1:])
    assert held == [True, False]
    assert np.array_equal(dst, want)
    # a failed held call reports its errno as a released one does
    with pytest.raises(LocalReadError, match="EFAULT|Bad address"):
        read(src, [(here, 4096, 4096)])


def test_a_call_fails_whole_on_an_unmapped_source_address(source):
    src, base, _ = source
    dst = poisoned(8192)
    here = int(dst.ctypes.data)
    with pytest.raises(LocalReadError, match="process_vm_readv"):
        read(src, [(here, base, 4096), (here + 4096, 4096, 4096)])  # page 1 of the child


def test_a_stop_or_passed_deadline_reads_nothing(source):
    src, base, _ = source
    dst = poisoned(4096)
    stop = threading.Event()
    stop.set()
    with pytest.raises(TimeoutError, match="stopped"):
        read(src, [(int(dst.ctypes.data), base, 4096)], stop=stop)
    with pytest.raises(TimeoutError, match="deadline"):
        read(src, [(int(dst.ctypes.data), base, 4096)], deadline=time.perf_counter() - 1)
    assert (dst == 0xA5).all()


def test_usable_checks_the_token_and_remembers(source, monkeypatch):
    """Each check that refuses counts once in ``kvkern_local_read_refusals_total``; a
    remembered verdict does not."""
    from kvkern.xfer.metrics import XferMetrics

    metrics = XferMetrics()
    refused = metrics.value("kvkern_local_read_refusals_total")
    src, _, _ = source
    wrong = src._replace(token=bytes(b ^ 1 for b in src.token))
    assert local_reads.usable(src)
    assert not local_reads.usable(wrong)
    assert metrics.value("kvkern_local_read_refusals_total") == refused + 1
    # remembered: no second call for either
    monkeypatch.setattr(local_reads, "PASS_TTL_S", 60.0)
    monkeypatch.setattr(local_reads, "_call_once", lambda *a: pytest.fail("called again"))
    assert local_reads.usable(src) and not local_reads.usable(wrong)
    monkeypatch.undo()
    local_reads.forget(wrong)
    assert not local_reads.usable(wrong)
    # a refusal is checked again once it is REFUSAL_TTL_S old
    checks = []
    real = local_reads._call_once
    monkeypatch.setattr(local_reads, "_call_once", lambda *a: checks.append(1) or real(*a))
    assert not local_reads.usable(wrong) and not checks
    monkeypatch.setattr(local_reads, "REFUSAL_TTL_S", 0.0)
    assert not local_reads.usable(wrong) and checks == [1]
    assert metrics.value("kvkern_local_read_refusals_total") == refused + 3
    assert local_reads.refusals() == refused + 3


def test_a_pass_is_checked_again_and_a_process_id_taken_by_another_is_refused(source,
                                                                            monkeypatch):
    """A pass is remembered for PASS_TTL_S only: after it, the token is read again, so a
    process id that another process now holds (a different token at the address) is
    refused before a read trusts it, and is gone: no route reads it."""
    src, _, _ = source
    local_reads.forget(src)
    assert local_reads.usable(src)
    checks = []
    real = local_reads._call_once
    monkeypatch.setattr(local_reads, "_call_once", lambda *a: checks.append(1) or real(*a))
    monkeypatch.setattr(local_reads, "PASS_TTL_S", 60.0)
    assert local_reads.usable(src) and not checks  # remembered
    monkeypatch.setattr(local_reads, "PASS_TTL_S", 0.0)
    assert local_reads.usable(src) and checks == [1]  # proved again
    # the same process id and address now hold another token: another process has the id
    reused = src._replace(token=bytes(b ^ 0xFF for b in src.token))
    with local_reads._lock:  # as if it had passed when its process was the announced one
        local_reads._verdicts[reused] = (True, time.monotonic() - 1.0, None)
    assert not local_reads.usable(reused) and checks == [1, 1]
    # refused after it had passed: gone (its reads fail, never through UCX), and remembered
    assert "token differs" in local_reads.gone(reused)
    assert not local_reads.usable(reused) and checks == [1, 1]
    local_reads.forget(reused)
    assert local_reads.gone(reused) is None
    # refused from the first: read through UCX, not gone
    assert not local_reads.usable(reused) and local_reads.gone(reused) is None
    local_reads.forget(reused)


def test_a_process_gone_is_not_usable_and_its_reads_fail():
    if local_reads.host_id() is None:
        pytest.skip("no host id (not Linux)")
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    info = json.loads(child.stdout.readline())
    src = parse(info["doc"])
    child.stdin.close()
    child.wait(10)
    assert not local_reads.usable(src)
    dst = poisoned(64)
    with pytest.raises(LocalReadError, match="ESRCH"):
        read(src, [(int(dst.ctypes.data), info["buf"], 64)])


# ---- who may be read: the process that served the state, and no other

def test_serves_names_only_the_process_listening_on_the_address(source):
    src, _, child = source
    assert local_reads.serves(child.pid, "127.0.0.1", child.port) is None
    assert local_reads.serves(child.pid, "::ffff:127.0.0.1", child.port) is None
    with socket.create_server(("127.0.0.1", 0)) as own:
        port = own.getsockname()[1]
        assert local_reads.serves(os.getpid(), "127.0.0.1", port) is None
        assert "does not hold" in local_reads.serves(child.pid, "127.0.0.1", port)
    assert "does not hold" in local_reads.serves(os.getpid(), "127.0.0.1", child.port)
    assert "no socket" in local_reads.serves(child.pid, "127.0.0.1", port)  # (closed)
    assert "not an address of this host" in local_reads.serves(child.pid, "192.0.2.1",
                                                               child.port)
    assert "not an IP address" in local_reads.serves(child.pid, "localhost", child.port)


def _state_body(read_local: dict) -> bytes:
    from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology  # noqa: PLC0415
    from kvkern.xfer.state import PROTOCOL, DpGroupDoc, RankDoc, StateDoc  # noqa: PLC0415

    topo = Topology(model=ModelKVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4,
                                      dtype="float16"), parallel=Parallelism())
    return msgspec.json.encode(StateDoc(
        protocol=PROTOCOL, worker_id="w", incarnation="i", hash_scheme="s", block_size=4,
        codec_fingerprint=f"{7:016x}", topology=topo.to_dict(), model="m",
        capabilities=["pull/1", "read/1"],
        dp_groups={"0": DpGroupDoc(ranks={"0": RankDoc(
            ucx_host="127.0.0.1", ucx_port=5000, read="canonical", read_worker="abcd",
            read_local=read_local)})}))


@pytest.mark.parametrize("served_by", ["announced", "another"])
def test_a_state_keeps_only_the_announcement_of_the_process_that_served_it(
        source, served_by, monkeypatch):
    """A peer that copies another process's announcement (its process id and token, public
    in that process's own state) into the state it serves gets no same-host reads of that
    process: only the process listening on the address the state came from is read."""
    from kvkern.xfer import endpoint  # noqa: PLC0415
    from kvkern.xfer.auth import Credential  # noqa: PLC0415
    from kvkern.xfer.config import XferConfig  # noqa: PLC0415
    from kvkern.xfer.discovery import SourceDiscovery  # noqa: PLC0415

    _, _, child = source
    body = _state_body(child.doc)

    async def fetch_state(resolved, **_):
        return body

    monkeypatch.setattr(endpoint, "fetch_state", fetch_state)
    with socket.create_server(("127.0.0.1", 0)) as own:
        port = child.port if served_by == "announced" else own.getsockname()[1]
        resolved = endpoint.ResolvedEndpoint(scheme="http", host="127.0.0.1", ip="127.0.0.1",
                                             port=port, path="/kvkern/v1/state",
                                             addresses=("127.0.0.1",))
        discovery = SourceDiscovery(XferConfig(), Credential("k" * 32))
        state, _ = asyncio.run(discovery._fetch(resolved, 5.0))
    assert state.read_workers == {(0, 0): b"\xab\xcd"}
    if served_by == "announced":
        assert state.read_locals == {(0, 0): parse(child.doc)}
    else:
        assert state.read_locals == {}


def test_a_same_host_source_is_read_through_ucx_only_when_told():
    """UCX's same-host transports read any address of the process that owns the worker a
    state names, and nothing ties that worker to the process whose pid was checked: a member
    could name another process's. So a puller with its own same-host reads off streams such
    a source, unless told to read it through UCX (a measurement on one host)."""
    from types import SimpleNamespace

    from kvkern.xfer.config import XferConfig
    from kvkern.xfer.receive import ReadReceiver

    key = (0, 0)
    state = SimpleNamespace(read_locals={key: object()})
    for local, ucx, near, own in [(True, False, False, True), (False, False, False, False),
                                  (False, True, True, False), (True, True, False, True)]:
        cfg = XferConfig(local_reads=local, ucx_same_host_reads=ucx)
        receiver = ReadReceiver(cfg, closed=lambda: False, spawn=lambda coro: coro.close())
        assert receiver.near_reads(state, key) is near, (local, ucx)
        assert (receiver.local_source(state, key) is not None) is own, (local, ucx)
        assert not receiver.near_reads(SimpleNamespace(read_locals={}), key)
    with pytest.raises(ValueError, match="ucx_same_host_reads"):
        XferConfig(ucx_same_host_reads="yes")
