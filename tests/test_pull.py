"""The destination puller against real source processes on 127.0.0.1.

Sources are child processes (tests/peers/source_peer.py, tests/peers/dp_source_peer.py); the
puller runs in the test process on one shared EventLoopThread. One TP1 source serves most
tests (each test commits its own token range there); tests that kill a source, or need
another topology, start their own. Every test checks the received bytes against the source's
block checksums and that nothing is left behind on either side: destination pool back to
no pins / leases / private / referenced blocks, source pins 0.

The model everywhere: 2 layers, 4 KV heads, head_dim 16, block size 4, float16 (2 KiB per
block on a TP1 rank).

A pair between two trtllm pools (whole contiguous block rows) is read one-sided by default
(``XferConfig.remote_read``, the source's "read/1"); tests about the stream's chunks ask for
the stream explicitly (``remote_read=False``), the fault tests run both, and the tests at the
end cover the read path itself. Pullers here ask the source for every read (a grant:
``direct_reads=False``; a few tests run both ways), so the protocol's messages stay visible;
reads without a message are covered in tests/test_direct_read.py. The source peer counts the
replies it sent by kind (``/test/stats`` "replies"), so a test can tell which path a pull took.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from kvkern.cache.hashing import DEFAULT_SCHEME, local_block_hashes, sequence_hashes
from kvkern.cache.pool import BlockPool
from kvkern.kernels.pack import pack
from kvkern.layout.topology import ModelKVSpec, Parallelism, Topology
from kvkern.xfer import tuning, ucp_rma
from kvkern.xfer.config import XferConfig
from kvkern.xfer.kvgroup import KVGroup, RankKV
from kvkern.xfer.metrics import XferMetrics
from kvkern.xfer.outcome import PullOutcome, Reason, RequestState
from kvkern.xfer.puller import Puller
from kvkern.xfer.runtime import EventLoopThread
from kvkern.xfer.ucp_rma import coalesce
from tests.fleet import CREDENTIAL, peer_headers

pytestmark = pytest.mark.timeout(60)

PEERS = Path(__file__).parent / "peers"
HOST = "127.0.0.1"
BS = 4
MODEL = ModelKVSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=BS, dtype="float16")
ALLOW = "127.0.0.1/32"


# ------------------------------------------------------------------------------ processes


def _exit_text(code: int) -> str:
    """A child's exit status in words (a negative one is the signal that ended it)."""
    if code >= 0:
        return "exit status"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Source:
    """A source peer child process and its test routes."""

    def __init__(self, script: str, *args: str, tp: int = 1, dp: int = 1) -> None:
        self.tp, self.dp = tp, dp
        self.proc = subprocess.Popen([sys.executable, str(PEERS / script), *args],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.ready: dict | None = None

    def wait_ready(self, timeout: float = 40.0) -> Source:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"source peer did not start (exit {self.proc.poll()})")
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if r:
                line = self.proc.stdout.readline()
                if line.startswith("KVKERN_READY "):
                    self.ready = json.loads(line[len("KVKERN_READY "):])
        return self

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.ready['http_port']}"

    @property
    def topology(self) -> Topology:
        return Topology(model=MODEL, parallel=Parallelism(tp_size=self.tp, dp_size=self.dp,
                                                          attention_dp=self.dp > 1))

    def http(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.endpoint}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **peer_headers(method, path, self.endpoint)})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.URLError as exc:
            code = self.proc.poll()
            if code is None:
                raise
            raise RuntimeError(f"source peer exited with {code} ({_exit_text(code)}) before "
                               f"{method} {path}") from exc

    def commit(self, tokens: list[int], placement: str = "chain") -> list[int]:
        return self.http("POST", "/test/commit", {"tokens": tokens,
                                                  "placement": placement})["hashes"]

    def evict(self, hashes: list[int]) -> dict:
        return self.http("POST", "/test/evict", {"hashes": hashes})

    def faults(self, **kw) -> dict:
        return self.http("POST", "/test/faults", kw)

    def blocks(self, hashes: list[int], *, dp: int = 0, heads=None) -> dict:
        q = "hashes=" + ",".join(str(h) for h in hashes) + f"&dp={dp}"
        if heads is not None:
            q += f"&heads={heads[0]}:{heads[1]}"
        return self.http("GET", f"/test/blocks?{q}")

    def wait_no_pins(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = self.http("GET", "/test/stats")
            pools = st["pools"].values() if "pools" in st else [st["pool"]]
            if st["pins_outstanding"] == 0 and st["active_sends"] == 0 and all(
                    p["pinned"] == 0 and p["pins"] == 0 for p in pools):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"source still holds pins: {st}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a SIGSTOPped process too
        try:
            self.proc.wait(timeout=10)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@pytest.fixture(scope="module")
def rt():
    loop = EventLoopThread("test-pull")
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture(scope="module")
def src():
    # (runs of 2 blocks and more leave from the pool unpacked, as 4 MiB runs do in a pool
    # of real blocks)
    s = Source("source_peer.py", "--num-blocks", "256", "--chunk-bytes", str(8 << 10),
               "--stream-min-run-bytes", str(2 * 2048))
    try:
        yield s.wait_ready()
    finally:
        s.kill()


_seq_base = [100_000]


def fresh_tokens(n_tokens: int) -> list[int]:
    """Token ids no other test uses (so prefixes never collide across tests)."""
    base = _seq_base[0]
    _seq_base[0] += 10_000
    return list(range(base, base + n_tokens))


# ---------------------------------------------------------------------------- destination


def make_group(tp: int = 1, *, num_blocks: int = 64, scheme: str = DEFAULT_SCHEME,
               layout: str = "trtllm") -> KVGroup:
    topo = Topology(model=MODEL, parallel=Parallelism(tp_size=tp))
    pool = BlockPool(num_blocks, block_size=BS, hash_scheme=scheme)
    gen = torch.Generator().manual_seed(7)
    ranks = {}
    for r in topo.ranks_of_dp(0):
        lay = topo.local_layout(r, num_blocks, layout)
        ranks[r] = RankKV(r, lay, lay.allocate(fill="random", generator=gen))
    return KVGroup(topo, 0, pool, ranks)


def snapshot(group: KVGroup) -> dict:
    return {r: [t.clone() for t in rkv.layout.tensors(rkv.pool)] if rkv.layout.per_layer
            else rkv.pool.clone() for r, rkv in group.ranks.items()}


def block_bytes(group: KVGroup, rank: int, block_id: int, heads=None) -> bytes:
    rkv = group.ranks[rank]
    staged = pack(rkv.pool, rkv.layout, [block_id], heads=heads)
    return staged.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def check_bytes(src: Source, group: KVGroup, hashes: list[int], block_ids: list[int], *,
                dp: int = 0) -> None:
    """Destination blocks ``block_ids`` hold exactly the source's blocks ``hashes``."""
    assert len(hashes) == len(block_ids)
    dtopo = group.topology
    stopo = src.topology
    if stopo.parallel.attn_tp_size == 1:
        # every destination rank's (global) heads are a local head range of the source rank
        for d in group.ranks:
            want = src.blocks(hashes, dp=dp, heads=dtopo.head_range(d))
            (r,) = {k for v in want.values() for k in v["sha256"]}
            for h, bid in zip(hashes, block_ids, strict=True):
                assert want[str(h)] is not None, f"source lost block {h}"
                assert sha(block_bytes(group, d, bid)) == want[str(h)]["sha256"][r], \
                    f"dst rank {d} block {bid} (hash {h}) differs from source rank {r}"
    else:
        assert dtopo.parallel.tp_size == 1
        want = src.blocks(hashes, dp=dp)
        for h, bid in zip(hashes, block_ids, strict=True):
            for r, digest in want[str(h)]["sha256"].items():
                heads = stopo.head_range(int(r))
                assert sha(block_bytes(group, 0, bid, heads=heads)) == digest, \
                    f"block {bid} heads {heads} differ from source rank {r}"


def served_kinds(src: Source, before: dict) -> dict:
    """Data-carrying replies the source sent since ``before`` (its /test/stats "replies")."""
    now = src.http("GET", "/test/stats")["replies"]
    return {k: now[k] - before[k] for k in now}


def assert_clean(group: KVGroup) -> None:
    st = group.manager.stats()
    for k in ("pinned", "pins", "leased", "leases", "private", "referenced"):
        assert st[k] == 0, f"destination leaks {k}: {st}"
    assert st["free"] == st["blocks"], st
    group.manager.check_invariants()


def assert_only_changed(group: KVGroup, before: dict, changed: set[int]) -> None:
    """Every block not in ``changed`` kept its bytes, on every rank."""
    for r, rkv in group.ranks.items():
        n = rkv.layout.num_blocks
        for b in range(n):
            if b in changed:
                continue
            same = torch.equal(pack(before[r], rkv.layout, [b]).view(-1).view(torch.uint8),
                               pack(rkv.pool, rkv.layout, [b]).view(-1).view(torch.uint8))
            assert same, f"rank {r} block {b} was written but is not a received block"


def hint_for(src: Source, tokens: list[int], n_blocks: int | None = None, **extra) -> dict:
    hs = local_block_hashes(tokens, BS)
    if n_blocks is not None:
        hs = hs[:n_blocks]
    return {"kv_hint": {"source": src.endpoint, "block_hashes": hs, **extra}}


@pytest.fixture
def make_puller(rt):
    made: list[Puller] = []

    def make(group: KVGroup, **cfg) -> Puller:
        cfg.setdefault("allowlist", ALLOW)
        cfg.setdefault("direct_reads", False)  # see the module docstring
        p = Puller(group, config=XferConfig(**cfg), metrics=XferMetrics(), loop=rt)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def pull(puller: Puller, rid: str, tokens, hint, timeout: float = 30.0):
    puller.submit(rid, tokens, hint)
    return puller.result(rid, timeout)


def claim_check_release(puller, group, src, rid, hashes, *, dp: int = 0) -> list[int]:
    ids = puller.claim(rid)
    assert ids is not None and len(ids) == len(hashes)
    assert puller.state(rid) is RequestState.CONTEXT_INIT
    check_bytes(src, group, hashes, ids, dp=dp)
    group.manager.release(ids)
    return ids


# ---------------------------------------------------------------------------------- tests


def test_full_prefix_pull(src, make_puller):
    tokens = fresh_tokens(16 * BS + 2)  # 16 full blocks + a partial one (never pulled)
    hashes = src.commit(tokens)
    assert len(hashes) == 16
    group = make_group()
    before = snapshot(group)
    p = make_puller(group)
    state = p.submit("full", tokens, hint_for(src, tokens))
    assert state in (RequestState.CONTEXT_PREFETCH_INIT,
                     RequestState.CONTEXT_PREFETCH_IN_PROGRESS)
    assert not p.is_schedulable("full")
    o = p.result("full", 30)
    assert o.used and o.reason is Reason.OK, o
    assert (o.blocks_hinted, o.blocks_local, o.blocks_requested, o.blocks_transferred) == \
        (16, 0, 16, 16)
    assert o.bytes_transferred == 16 * group.ranks[0].layout.bytes_per_block
    assert o.messages >= 3 and o.pairs == 1
    # the cost guard learns the copy's rate and, apart, the rest of the pull as fixed cost
    copy = o.phases.get("data", o.phases.get("read"))
    copy = o.phases["transfer"] - o.phases.get("rtt", 0.0) if copy is None else copy
    guard = p.cost_guard
    assert guard.pulls_observed == 1
    assert guard.bandwidth_bps == pytest.approx(o.bytes_transferred / copy, rel=0.05)
    assert guard.rtt_s == p.config.rtt_prior_s  # (a first contact: its state was fetched)
    assert p.state("full") is RequestState.CONTEXT_PREFETCH_COMPLETE and p.is_schedulable("full")
    json.loads(o.to_log())
    assert p.metrics.value("kvkern_pulls_total", outcome="ok") == 1
    assert p.metrics.value("kvkern_blocks_transferred_total") == 16
    ids = claim_check_release(p, group, src, "full", hashes)
    assert group.manager.longest_prefix(sequence_hashes(tokens, BS)) == 16
    assert p.claim("full") is None  # claimed once
    more = fresh_tokens(4 * BS)  # a pull from a source whose state is cached
    more_hashes = src.commit(more)
    o2 = pull(p, "again", more, hint_for(src, more))
    copy2 = o2.phases.get("data", o2.phases.get("read"))
    copy2 = o2.phases["transfer"] - o2.phases.get("rtt", 0.0) if copy2 is None else copy2
    assert guard.pulls_observed == 2 and 0 < guard.rtt_s < o2.phases["total"] - 0.9 * copy2
    ids += claim_check_release(p, group, src, "again", more_hashes)
    assert_only_changed(group, before, set(ids))
    assert_clean(group)
    src.wait_no_pins()


@pytest.mark.parametrize("layout,chunk_bytes", [("vllm_nhd", 16 << 20), ("vllm_hnd", 1500),
                                                ("trtllm", 1500)])
def test_other_engine_layouts_and_split_blocks(src, make_puller, layout, chunk_bytes):
    # A per-layer NHD/HND pool has no contiguous canonical view: every chunk goes through
    # the staging ring and the unpack kernel; 1500-byte chunks cut every 2 KiB block in two
    # (the carry path).
    # The stream explicitly: trtllm and HND pools would otherwise be read one-sided (whole
    # blocks, no chunks; see test_read_*).
    tokens = fresh_tokens(5 * BS)
    hashes = src.commit(tokens)
    group = make_group(layout=layout)
    before = snapshot(group)
    p = make_puller(group, chunk_bytes=chunk_bytes, remote_read=False)
    o = pull(p, "lay", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == 5, o
    assert o.reads == 0, o
    if chunk_bytes < 2048:
        assert o.messages == 2 + 5 * 2  # request, reply, two slices per block
    ids = claim_check_release(p, group, src, "lay", hashes)
    assert_only_changed(group, before, set(ids))
    assert_clean(group)
    src.wait_no_pins()


@pytest.mark.parametrize("direct", [False, True], ids=["streamed", "direct"])
def test_local_prefix_and_remote_tail(src, make_puller, direct):
    """(``direct``: the tail read without a message, kvkern.xfer.direct.)"""
    tokens = fresh_tokens(12 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    mgr = group.manager
    local_ids = mgr.allocate(5)  # the destination computed the first 5 blocks itself
    mgr.commit(local_ids, hashes[:5])
    mgr.release(local_ids)
    before = snapshot(group)
    p = make_puller(group, direct_reads=direct)
    o = pull(p, "tail", tokens, hint_for(src, tokens))
    assert o.used and (o.blocks_local, o.blocks_requested, o.blocks_transferred) == (5, 7, 7), o
    assert (o.messages == 0) == direct, o
    assert o.bytes_transferred == 7 * group.ranks[0].layout.bytes_per_block
    ids = claim_check_release(p, group, src, "tail", hashes[5:])
    assert not set(ids) & set(local_ids)
    assert_only_changed(group, before, set(ids))  # local blocks untouched
    assert mgr.longest_prefix(hashes) == 12
    assert_clean(group)
    src.wait_no_pins()


def pull_into(p: Puller, rid: str, tokens: list[int], hint: dict, block_ids: list[int],
              timeout: float = 30.0):
    """What an engine connector does: admit the hint on its scheduler side, pull into the
    blocks it allocated, and poll for the end."""
    from kvkern.xfer.admission import Admitted, WorkerFacts, admit
    from kvkern.xfer.hints import decode_hint
    from kvkern.xfer.policy import CostGuard
    from tests.test_pull_into import finished

    decoded = decode_hint(hint)
    facts = WorkerFacts(block_size=BS, hash_scheme=p.group.hash_scheme, bytes_per_block=1,
                        longest_prefix=lambda hashes: 0)
    admitted = admit(tokens, decoded, worker=facts, config=p.config,
                     cost_guard=CostGuard(p.config))
    assert isinstance(admitted, Admitted), admitted
    p.pull_into(rid, decoded, admitted, block_ids)
    return finished(p, rid, timeout)


@pytest.mark.parametrize("how", ["granted", "direct", "ucx", "ucx_direct", "no_lanes"])
def test_a_pull_into_the_engines_blocks_reads_them_on_the_lanes(src, make_puller, how,
                                                                monkeypatch):
    """Into the engine's own blocks (``Puller.pull_into``) the source is read one-sided on
    the read lanes, asking for a grant or directly (kvkern.xfer.direct): with kvkern's own
    calls (a source process on this host), or through UCX (``local_reads`` off, as for a
    source on another host). A puller without read lanes streams.
    Bit-exact in the engine's blocks (scattered, in reverse order), every other block
    untouched, nothing committed or freed."""
    from kvkern.xfer import local_reads

    calls = []
    real_call = local_reads._call_once
    monkeypatch.setattr(local_reads, "_call_once", lambda *a: (calls.append(a),
                                                               real_call(*a))[1])
    n = 8
    tokens = fresh_tokens(n * BS)
    hashes = src.commit(tokens)
    group = make_group()
    engine = group.manager.allocate(2 * n)
    ids = engine[::-2]  # the pull's blocks: scattered, descending
    before = snapshot(group)
    direct = how in ("direct", "ucx_direct")
    p = make_puller(group, direct_reads=direct, local_reads=not how.startswith("ucx"),
                    ucx_same_host_reads=how.startswith("ucx"),
                    **({"read_lanes": 0} if how == "no_lanes" else {}))
    sent = src.http("GET", "/test/stats")["replies"]
    o = pull_into(p, "into", tokens, hint_for(src, tokens), ids)
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == n, o
    check_bytes(src, group, hashes, ids)
    read = how != "no_lanes"
    assert bool(calls) == (how in ("granted", "direct"))  # else through UCX, or streamed
    assert served_kinds(src, sent) == {"read": int(read and not direct), "stream": int(not read)}
    assert (o.reads > 0) == read and (o.messages == 0) == direct, o
    assert p.metrics.value("kvkern_direct_reads_total", result="used") == direct
    path = "stream" if not read else "direct" if direct else "read"
    assert {k: p.metrics.value("kvkern_pairs_pulled_total", path=k)
            for k in ("direct", "read", "stream")} == {k: int(k == path)
                                                       for k in ("direct", "read", "stream")}
    assert_only_changed(group, before, set(ids))
    assert group.manager.longest_prefix(sequence_hashes(tokens, BS)) == 0  # not committed
    group.manager.release(engine)
    assert_clean(group)
    src.wait_no_pins()


def test_a_source_on_this_host_whose_own_reads_fail_is_never_read_through_ucx(src,
                                                                            make_puller,
                                                                            monkeypatch):
    """Same-host reads are on, but the source process's own reads are refused (its token
    does not check out: it may have announced one on purpose). UCX's same-host transports
    read any address of any process, so the lanes never read it through them for lack of
    kvkern's own calls: the pull into the engine's blocks falls back (the engine
    recomputes), and the next one streams while those lanes rest."""
    from kvkern.xfer import local_reads

    monkeypatch.setattr(local_reads, "usable", lambda source: False)
    n = 4
    tokens = fresh_tokens(n * BS)
    hashes = src.commit(tokens)
    group = make_group()
    engine = group.manager.allocate(n)
    p = make_puller(group)
    o = pull_into(p, "refused", tokens, hint_for(src, tokens), engine)
    assert not o.used and o.reason is Reason.TRANSFER_FAILED, o
    assert "this host" in o.detail, o
    again = pull_into(p, "streamed", tokens, hint_for(src, tokens), engine)
    assert again.used and again.reads == 0, again
    check_bytes(src, group, hashes, engine)
    group.manager.release(engine)
    assert_clean(group)
    src.wait_no_pins()


LATE = {"transfer_timeout_s": 0.3}  # a late pull's reads time out, then drain


def late_batch_class(done: threading.Event, made: list) -> type:
    """A ReadBatch of real reads, seen complete only once ``done`` is set; each one made is
    appended to ``made``."""

    class Late(ucp_rma.ReadBatch):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        def poll(self):
            return done.is_set() and super().poll()

    return Late


def late_reads_puller(src, make_puller, direct: bool, n: int):
    """A puller reading through UCX, warmed by one pull (the state and the lanes made), and
    ``n`` blocks committed at the source: (puller, group, tokens, hashes). Its late pulls
    state a short transfer timeout (:data:`LATE`)."""
    tokens = fresh_tokens(n * BS)
    hashes = src.commit(tokens)
    group = make_group()
    p = make_puller(group, local_reads=False, ucx_same_host_reads=True, direct_reads=direct)
    warm = fresh_tokens(BS)
    src.commit(warm)
    assert pull(p, "warm", warm, hint_for(src, warm)).used
    p.release("warm")
    return p, group, tokens, hashes


@pytest.mark.parametrize("direct", [False, True], ids=["streamed", "direct"])
def test_a_ucx_read_into_the_engines_blocks_ends_only_after_its_reads(src, make_puller,
                                                                      monkeypatch, direct):
    """Reads into the engine's blocks through UCX that are still running when their wait
    times out, and after their endpoint's forced close and the drain: the pull ends (and
    tells the engine its blocks are free) only once they have completed, with no block
    counted and nothing quarantined; a later pull reads again. Asking for a grant, or
    directly (the directory look-up's reads are the ones held then)."""

    done, done_at, made = threading.Event(), [], []
    n = 6
    p, group, tokens, hashes = late_reads_puller(src, make_puller, direct, n)
    engine = group.manager.allocate(n)
    Late = late_batch_class(done, made)
    before = snapshot(group)
    monkeypatch.setattr(ucp_rma, "ReadBatch", Late)
    monkeypatch.setattr(tuning, "READ_DRAIN_S", 0.05)

    def complete_later():
        while not made:
            time.sleep(0.005)
        time.sleep(1.0)  # past the wait's timeout and 10 drains
        done_at.append(time.monotonic())
        done.set()

    threading.Thread(target=complete_later, daemon=True).start()
    o = pull_into(p, "into-late", tokens, hint_for(src, tokens, **LATE), engine)
    ended = time.monotonic()
    assert done_at and ended >= done_at[0], "the pull ended before its reads had"
    assert not o.used and o.reason is Reason.TRANSFER_TIMEOUT and o.blocks_transferred == 0, o
    assert_only_changed(group, before, set(engine))
    assert group.manager.num_free == group.num_blocks - n  # still the engine's
    assert p.quarantined_blocks == 0
    monkeypatch.undo()
    o = pull_into(p, "into-after", tokens, hint_for(src, tokens), engine)
    assert o.used and o.blocks_transferred == n, o
    check_bytes(src, group, hashes, engine)
    group.manager.release(engine)
    assert_clean(group)
    src.wait_no_pins()


@pytest.mark.parametrize("direct", [False, True], ids=["granted", "direct"])
def test_blocks_quarantined_for_reads_that_outlived_their_abort_are_freed_once_they_end(
        src, make_puller, monkeypatch, direct):
    """Reads into the puller's own blocks through UCX still running after their endpoint's
    forced close and the drain: the pull ends at once, its private blocks quarantined (the
    pool runs that many short); while the reads run they stay held, and once the reads
    complete the blocks go back to the pool, counted, and a later pull reads again."""
    from kvkern.xfer import quarantine

    done, made = threading.Event(), []
    n = 6
    p, group, tokens, hashes = late_reads_puller(src, make_puller, direct, n)
    Late = late_batch_class(done, made)
    free = group.manager.num_free
    monkeypatch.setattr(ucp_rma, "ReadBatch", Late)
    monkeypatch.setattr(tuning, "READ_DRAIN_S", 0.05)
    monkeypatch.setattr(quarantine, "QUARANTINE_POLL_S", 0.05)
    o = pull(p, "late", tokens, hint_for(src, tokens, **LATE))
    assert not o.used and o.blocks_transferred == 0, o
    assert made and p.quarantined_blocks == n
    assert group.manager.num_free == free - n
    time.sleep(0.3)  # six checks: the reads still run
    assert p.quarantined_blocks == n and group.manager.num_free == free - n
    done.set()
    deadline = time.monotonic() + 10
    while p.quarantined_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.quarantined_blocks == 0 and group.manager.num_free == free
    assert p.metrics.value("kvkern_blocks_quarantined_total") == n
    assert p.metrics.value("kvkern_blocks_quarantine_freed_total") == n
    assert p._reads.lanes.stuck_reads == 0
    monkeypatch.undo()
    o = pull(p, "after", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == n, o
    claim_check_release(p, group, src, "after", hashes)
    assert_clean(group)
    src.wait_no_pins()


def test_a_read_into_the_engines_blocks_that_its_source_never_confirms_counts_nothing(
        src, make_puller):
    """A granted read into the engine's blocks with no hold (it counts only on the source's
    ReadAck) from a source that freezes after its reply: the read itself completes, the
    pull ends at its deadline with no block counted (the engine recomputes them all),
    nothing beyond the pull's blocks is written, and the source's pins go once it answers
    again."""
    n = 6
    tokens = fresh_tokens(n * BS)
    src.commit(tokens)
    group = make_group()
    engine = group.manager.allocate(n)
    p = make_puller(group)
    warm = fresh_tokens(BS)  # the state and the lanes made: the deadline is the pull's own
    src.commit(warm)
    assert pull(p, "warm", warm, hint_for(src, warm)).used
    p.release("warm")
    before = snapshot(group)
    sent = src.http("GET", "/test/stats")["replies"]
    src.faults(freeze_after_reply=True, read_hold_s=0)
    try:
        o = pull_into(p, "into-frozen", tokens, hint_for(src, tokens, deadline_s=0.6), engine)
    finally:
        src.faults(freeze_after_reply=False, read_hold_s=5.0)
    assert not o.used and o.reason is Reason.DEADLINE_EXCEEDED, o
    assert o.blocks_transferred == 0 and o.reads >= 1, o
    assert served_kinds(src, sent) == {"read": 1, "stream": 0}
    assert_only_changed(group, before, set(engine))
    assert group.manager.num_free == group.num_blocks - n  # still the engine's
    group.manager.release(engine)
    assert p.quarantined_blocks == 0
    assert_clean(group)
    src.wait_no_pins()


def test_partial_local_leaf_is_never_overwritten(src, make_puller):
    tokens = fresh_tokens(10 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    mgr = group.manager
    # The destination holds blocks 0..2 committed and block 3 as a partially filled leaf
    # (2 of 4 tokens) owned by a running request: never committed, never a pull target.
    full = mgr.allocate(3)
    mgr.commit(full, hashes[:3])
    leaf = mgr.allocate(1)
    leaf_before = block_bytes(group, 0, leaf[0])
    before = snapshot(group)
    p = make_puller(group)
    o = pull(p, "leaf", tokens, hint_for(src, tokens))
    assert o.used and (o.blocks_local, o.blocks_transferred) == (3, 7), o
    ids = p.claim("leaf")
    assert leaf[0] not in ids
    assert block_bytes(group, 0, leaf[0]) == leaf_before
    check_bytes(src, group, hashes[3:], ids)
    assert_only_changed(group, before, set(ids))
    mgr.release(ids)
    mgr.release(full)
    mgr.release(leaf)
    assert_clean(group)
    src.wait_no_pins()


def test_strict_falls_back_on_source_miss(src, make_puller):
    tokens = fresh_tokens(10 * BS)
    hashes = src.commit(tokens)
    assert src.evict(hashes[6:])["evicted"] == hashes[6:]
    group = make_group()
    before = snapshot(group)
    p = make_puller(group)
    o = pull(p, "strict", tokens, hint_for(src, tokens, policy="strict"))
    assert not o.used and o.reason is Reason.SOURCE_MISS, o
    assert o.blocks_transferred == 0 and "6 of 10" in o.detail
    assert p.state("strict") is RequestState.CONTEXT_INIT
    assert p.claim("strict") is None
    assert group.manager.longest_prefix(sequence_hashes(tokens, BS)) == 0
    assert_only_changed(group, before, set())  # received blocks freed, none committed
    assert_clean(group)
    assert p.metrics.value("kvkern_fallbacks_total", reason="source_miss") == 1
    src.wait_no_pins()


def test_strict_miss_leaves_a_concurrent_pull_on_the_connection_alone(src, make_puller):
    """A strict pull asks the source for all-or-nothing (``require_all``): its miss is a MISS
    reply, not a PARTIAL it must cancel, so the connection (and the pull streaming on it)
    is never aborted."""
    full_tokens = fresh_tokens(8 * BS)
    full_hashes = src.commit(full_tokens)
    miss_tokens = fresh_tokens(10 * BS)
    src.evict(src.commit(miss_tokens)[6:])
    group = make_group()
    p = make_puller(group)
    # the full pull sits between its reply and its chunk (stream) or its ReadAck (a read
    # granted no hold waits for the ack)
    src.faults(slow_send_ms=300, read_hold_s=0)
    try:
        p.submit("full", full_tokens, hint_for(src, full_tokens, policy="strict"))
        deadline = time.monotonic() + 5
        while p.state("full") is not RequestState.CONTEXT_PREFETCH_IN_PROGRESS:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        o = pull(p, "miss", miss_tokens, hint_for(src, miss_tokens, policy="strict"))
        assert not o.used and o.reason is Reason.SOURCE_MISS, o
        assert "6 of 10" in o.detail and "require_all" in o.detail
        assert p.state("full") is RequestState.CONTEXT_PREFETCH_IN_PROGRESS  # still streaming
        full = p.result("full", 30)
    finally:
        src.faults(slow_send_ms=0, read_hold_s=5.0)
    assert full.used and full.reason is Reason.OK, full
    assert p._pool.connects == 1  # never aborted, so never reconnected
    claim_check_release(p, group, src, "full", full_hashes)
    assert_clean(group)
    src.wait_no_pins()


def test_best_effort_keeps_the_served_prefix(src, make_puller):
    tokens = fresh_tokens(10 * BS)
    hashes = src.commit(tokens)
    src.evict(hashes[6:])
    group = make_group()
    p = make_puller(group)
    o = pull(p, "be", tokens, hint_for(src, tokens, policy="best_effort"))
    assert o.used and o.reason is Reason.PARTIAL, o
    assert (o.blocks_requested, o.blocks_transferred, o.blocks_skipped) == (10, 6, 4)
    claim_check_release(p, group, src, "be", hashes[:6])
    assert_clean(group)
    src.wait_no_pins()


def test_stale_hint_after_source_eviction(src, make_puller):
    tokens = fresh_tokens(8 * BS)
    hashes = src.commit(tokens)
    src.evict(hashes)  # the router saw them; the source evicted them since
    group = make_group()
    p = make_puller(group)
    for policy in ("strict", "best_effort"):
        o = pull(p, f"stale-{policy}", tokens, hint_for(src, tokens, policy=policy))
        assert not o.used and o.reason is Reason.SOURCE_MISS, o
    assert_clean(group)
    src.wait_no_pins()


def test_hint_problems_fall_back_without_a_pull(src, make_puller):
    tokens = fresh_tokens(8 * BS)
    src.commit(tokens)
    group = make_group()
    p = make_puller(group)
    # hashes of another prompt
    other = fresh_tokens(8 * BS)
    o = pull(p, "mismatch", tokens, {"kv_hint": {"source": src.endpoint,
                                                 "block_hashes": local_block_hashes(other, BS)}})
    assert o.reason is Reason.HASH_MISMATCH and "hint hash 0" in o.detail
    # more hashes than the prompt has full blocks
    o = pull(p, "toolong", tokens[:5 * BS], hint_for(src, tokens))
    assert o.reason is Reason.HASH_MISMATCH
    # malformed hint, no hint, rejected hint object
    assert pull(p, "bad", tokens, {"kv_hint": {"source": 5}}).reason is Reason.HINT_INVALID
    assert pull(p, "none", tokens, None).reason is Reason.NO_HINT
    assert pull(p, "nohint", tokens, {"prompt": "x"}).reason is Reason.NO_HINT
    o = pull(p, "scheme", tokens, {"kv_hint": {"source": src.endpoint, "block_hashes": [1],
                                               "hash_scheme": "sha256-v9"}})
    assert o.reason in (Reason.HASH_SCHEME_MISMATCH, Reason.HINT_INVALID)
    # chained (sequence) hashes are accepted as well as per-block ones
    o = pull(p, "chained", tokens, {"kv_hint": {"source": src.endpoint,
                                                "block_hashes": sequence_hashes(tokens, BS)}})
    assert o.used, o
    p.release("chained")
    for rid in ("mismatch", "toolong", "bad", "none", "nohint"):
        assert p.state(rid) is RequestState.CONTEXT_INIT
    assert_clean(group)


def test_source_not_allowed(src, make_puller):
    tokens = fresh_tokens(4 * BS)
    src.commit(tokens)
    group = make_group()
    for allow, why in (((), "empty_allowlist"), ("10.0.0.0/8", "loopback"),
                       (f"127.0.0.1:{src.ready['http_port'] + 1}", "port_not_allowed")):
        p = make_puller(group, allowlist=allow)
        o = pull(p, "na", tokens, hint_for(src, tokens))
        assert o.reason is Reason.SOURCE_NOT_ALLOWED and why in o.detail, o
    # the state endpoint allowed by port, the UCX port not: the UCX address is checked too
    p = make_puller(group, allowlist=f"127.0.0.1:{src.ready['http_port']}")
    o = pull(p, "ucx", tokens, hint_for(src, tokens))
    assert o.reason is Reason.SOURCE_NOT_ALLOWED and "UCX" in o.detail, o
    assert_clean(group)


def test_the_engines_own_hashes_are_pulled_without_hashing_the_prompt(src, make_puller,
                                                                     monkeypatch):
    """``submit(block_hashes=)``: an engine that has hashed its prompt already passes the
    hashes; the pull asks for exactly those (a hint without hashes: the tokens are not
    hashed at all) and a hint's router hashes are still checked against the tokens."""
    from kvkern.xfer import admission  # noqa: PLC0415

    tokens = fresh_tokens(6 * BS + 1)
    hashes = src.commit(tokens)
    group = make_group()
    p = make_puller(group)
    with pytest.raises(ValueError, match="outside u64"):
        p.submit("bad", tokens, hint_for(src, tokens), block_hashes=[1 << 64] * 6)

    def no_hashing(*args, **kwargs):
        raise AssertionError("the prompt was hashed again")

    monkeypatch.setattr(admission, "get_scheme", no_hashing)  # (its every hashing)
    p.submit("own", tokens, {"kv_hint": {"source": src.endpoint}}, block_hashes=hashes)
    o = p.result("own", 30)
    assert o.used and o.blocks_transferred == 6, o
    claim_check_release(p, group, src, "own", hashes)
    monkeypatch.undo()
    # a router's per-block hashes of this prompt pass the check on the tokens; the engine's
    # hashes then find every block cached here
    p.submit("again", tokens, hint_for(src, tokens), block_hashes=hashes)
    o = p.result("again", 30)
    assert not o.used and o.reason is Reason.LOCAL_PREFIX_SUFFICIENT, o
    # the hint names another prompt: its hashes are checked on the tokens, not trusted
    other = fresh_tokens(6 * BS)
    p.submit("other", tokens, hint_for(src, other), block_hashes=hashes)
    o = p.result("other", 30)
    assert not o.used and o.reason is Reason.HASH_MISMATCH, o
    assert_clean(group)
    src.wait_no_pins()


def test_hash_scheme_mismatch(src, make_puller):
    tokens = fresh_tokens(4 * BS)
    src.commit(tokens)
    group = make_group(scheme="trtllm-v1")  # the worker hashes with another scheme
    p = make_puller(group)
    o = pull(p, "scheme", tokens, hint_for(src, tokens, hash_scheme=DEFAULT_SCHEME))
    assert not o.used and o.reason is Reason.HASH_SCHEME_MISMATCH, o
    assert DEFAULT_SCHEME in o.detail and "trtllm-v1" in o.detail
    assert_clean(group)


def test_not_worth_it(src, make_puller):
    tokens = fresh_tokens(4 * BS)
    src.commit(tokens)
    group = make_group()
    p = make_puller(group, prefill_s_per_token=1e-12)
    o = pull(p, "nwi", tokens, hint_for(src, tokens))
    assert o.reason is Reason.NOT_WORTH_IT and "recompute" in o.detail
    p2 = make_puller(group)
    p2.observe_prefill(1000, 1e-9)  # learned: prefill is nearly free
    assert pull(p2, "nwi2", tokens, hint_for(src, tokens)).reason is Reason.NOT_WORTH_IT
    assert p.metrics.value("kvkern_hints_ignored_total", reason="not_worth_it") == 1
    assert_clean(group)


class _StateStub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.startswith("/slow"):
            time.sleep(1.5)
            body, code = b"{}", 200
        elif self.path.startswith("/500"):
            body, code = b"oops", 500
        else:
            body, code = b"<html>not state</html>", 200
        sign = {}
        if self.path.startswith("/signed"):  # a fleet member answering garbage
            nonce = self.headers.get("X-Kvkern-Auth", "").partition("nonce=")[2].split()[0]
            sign = {"X-Kvkern-Auth-Response": CREDENTIAL.response_mac(nonce, body)}
        try:
            self.send_response(code)
            for k, v in sign.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_server():
    srv = http.server.ThreadingHTTPServer((HOST, 0), _StateStub)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_metadata_fetch_failures(make_puller, stub_server):
    import socket

    s = socket.socket()
    s.bind((HOST, 0))  # bound, never listening, until the end: connection refused
    closed_port = s.getsockname()[1]
    tokens = fresh_tokens(4 * BS)
    hs = local_block_hashes(tokens, BS)
    group = make_group()
    p = make_puller(group, metadata_timeout_s=0.5)
    cases = [(f"{HOST}:{closed_port}", Reason.METADATA_FETCH_FAILED),
             (f"http://{HOST}:{stub_server}/500", Reason.METADATA_FETCH_FAILED),
             (f"http://{HOST}:{stub_server}/garbage", Reason.UNAUTHENTICATED),
             (f"http://{HOST}:{stub_server}/signed-garbage", Reason.METADATA_INVALID),
             (f"http://{HOST}:{stub_server}/slow", Reason.METADATA_TIMEOUT)]
    for i, (source, reason) in enumerate(cases):
        t0 = time.monotonic()
        o = pull(p, f"md{i}", tokens, {"kv_hint": {"source": source, "block_hashes": hs}})
        assert o.reason is reason, (source, o)
        assert time.monotonic() - t0 < 1.4  # bounded by metadata_timeout_s, not the server
        assert not o.used and p.state(f"md{i}") is RequestState.CONTEXT_INIT
    s.close()
    assert p.metrics.value("kvkern_metadata_fetch_failures_total",
                           reason="metadata_timeout") == 1
    assert_clean(group)


def _a_faulty_stream_is_not_used(src, make_puller, fault: dict, healed: dict,
                                 detail: str) -> PullOutcome:
    """A streamed pull of 6 blocks from ``src`` with ``fault`` set: it falls back
    (``transfer_failed``, ``detail`` in its detail) with nothing committed and no block
    leaked; with ``healed`` set again, the next pull is used."""
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    free = group.manager.num_free
    p = make_puller(group, remote_read=False)
    src.faults(**fault)
    try:
        o = pull(p, "faulty", tokens, hint_for(src, tokens))
    finally:
        src.faults(**healed)
    assert not o.used and o.reason is Reason.TRANSFER_FAILED, o
    assert detail in o.detail, o
    assert group.manager.longest_prefix(hashes) == 0 and p.claim("faulty") is None
    assert group.manager.num_free == free
    assert_clean(group)
    src.wait_no_pins()
    whole = pull(p, "whole", tokens, hint_for(src, tokens))
    assert whole.used and whole.reason is Reason.OK, whole
    claim_check_release(p, group, src, "whole", hashes)
    return o


def test_a_stream_chunk_shorter_than_announced_is_not_used(src, make_puller):
    """The source sends the first chunk a block short of its reply's chunk size: UCX
    completes the receive as if whole, the canary at the buffer's end shows it, and the
    pull falls back with nothing committed and no block leaked; the next pull is whole."""
    _a_faulty_stream_is_not_used(src, make_puller, {"short_chunk_bytes": 2048},
                                 {"short_chunk_bytes": 0}, "arrived shorter than")


def test_a_stream_cut_finer_than_the_protocol_allows_is_refused_before_any_receive(
        src, make_puller):
    """A source that announces more chunks than one per block (these blocks are smaller
    than the protocol's smallest chunk, MIN_CHUNK_BYTES) is refused on its reply: every
    chunk would cost a receive and a step of Python here. Nothing is committed or leaked,
    and the next pull from a source cutting whole blocks is used."""
    block = make_group().ranks[0].layout.bytes_per_block
    o = _a_faulty_stream_is_not_used(src, make_puller, {"chunk_bytes": block // 2},
                                     {"chunk_bytes": 16 << 20},
                                     "12 chunks for 6 blocks, more than the 6")
    assert o.bytes_transferred == 0


@pytest.mark.parametrize("remote_read", [True, False], ids=["read", "stream"])
def test_transfer_timeout_when_source_stops_responding(src, make_puller, remote_read):
    # read: the source replies, then never acks (the destination has read the blocks and
    # sent ReadDone); stream: the source replies, then sends no chunk.
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    p = make_puller(group, transfer_timeout_s=0.5, remote_read=remote_read)
    sent = src.http("GET", "/test/stats")["replies"]
    src.faults(freeze_after_reply=True, read_hold_s=0)  # no hold: reads count on the ack only
    try:
        t0 = time.monotonic()
        o = pull(p, "frozen", tokens, hint_for(src, tokens))
        assert o.reason is Reason.TRANSFER_TIMEOUT, o
        assert time.monotonic() - t0 < 5
    finally:
        src.faults(freeze_after_reply=False, read_hold_s=5.0)
    assert served_kinds(src, sent) == ({"read": 1, "stream": 0} if remote_read
                                       else {"read": 0, "stream": 1})
    if remote_read:  # the reads ran, the ack never came: nothing committed
        assert o.reads >= 1 and o.bytes_transferred == 6 * 2048, o
    else:
        assert o.reads == 0 and o.bytes_transferred == 0, o
    assert group.manager.longest_prefix(hashes) == 0 and p.claim("frozen") is None
    assert p.quarantined_blocks == 0
    assert_clean(group)
    src.wait_no_pins()
    # the pool reconnects after the aborted connection: the next pull works
    o = pull(p, "after", tokens, hint_for(src, tokens))
    assert o.used and (o.reads >= 1) == remote_read, o
    claim_check_release(p, group, src, "after", hashes)
    assert_clean(group)


@pytest.mark.parametrize("remote_read", [True, False], ids=["read", "stream"])
def test_deadline_and_cancel(src, make_puller, remote_read):
    tokens = fresh_tokens(6 * BS)
    src.commit(tokens)
    group = make_group()
    p = make_puller(group, transfer_timeout_s=5.0, remote_read=remote_read)
    warm = fresh_tokens(BS)  # the state, the connection and the lanes made: the deadline
    src.commit(warm)         # below is the late pull's own, not the first contact's
    assert pull(p, "warm", warm, hint_for(src, warm)).used
    p.release("warm")
    sent = src.http("GET", "/test/stats")["replies"]
    src.faults(freeze_after_reply=True, read_hold_s=0)  # no hold: reads count on the ack only
    try:
        o = pull(p, "late", tokens, hint_for(src, tokens, deadline_s=0.6))
        assert o.reason is Reason.DEADLINE_EXCEEDED, o
        assert (o.reads >= 1) == remote_read, o
        p2 = make_puller(group, remote_read=remote_read)
        p2.submit("cx", tokens, hint_for(src, tokens))
        deadline = time.monotonic() + 5
        while p2.state("cx") is not RequestState.CONTEXT_PREFETCH_IN_PROGRESS:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert p2.cancel("cx")
        o = p2.result("cx", 10)
        assert o.reason is Reason.CANCELLED and p2.state("cx") is RequestState.CONTEXT_INIT
        assert not p2.cancel("cx")
    finally:
        src.faults(freeze_after_reply=False, read_hold_s=5.0)
    kind = "read" if remote_read else "stream"
    assert served_kinds(src, sent) == {"read": 0, "stream": 0, kind: 2}
    assert p.quarantined_blocks == p2.quarantined_blocks == 0
    assert_clean(group)
    src.wait_no_pins()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_pull_cancelled_before_its_reply_releases_the_pins_at_once(src, make_puller, how):
    """Cancelled (or out of time) while the source holds its read reply back: the pull ends
    cancelled (deadline_exceeded), the source releases the pins at once (a read's hold only
    starts when its reply goes out), and the next pull from the same source reads, over a
    new connection (the aborted receive took the old one down)."""
    tokens, other = fresh_tokens(4 * BS), fresh_tokens(4 * BS)
    src.commit(tokens)
    hashes = src.commit(other)
    group = make_group()
    p = make_puller(group, deadline_s=0.5 if how == "deadline" else 15.0)
    warm = fresh_tokens(BS)
    src.commit(warm)
    assert pull(p, "warm", warm, hint_for(src, warm)).used  # the connection exists
    p.release("warm")
    connects = p._pool.connects
    src.faults(read_reply_delay_ms=1500)
    try:
        p.submit("held", tokens, hint_for(src, tokens))
        deadline = time.monotonic() + 5
        while src.http("GET", "/test/stats")["pins_outstanding"] == 0:
            assert time.monotonic() < deadline, "the source never pinned the blocks"
            time.sleep(0.01)
        if how == "cancel":
            assert p.cancel("held")
        o = p.result("held", 10)
        want = Reason.CANCELLED if how == "cancel" else Reason.DEADLINE_EXCEEDED
        assert o.reason is want and not o.used, o
    finally:
        src.faults(read_reply_delay_ms=0)
    src.wait_no_pins(timeout=1.0)  # released on the Cancel, not after a 5 s read hold
    o = pull(p, "next", other, hint_for(src, other))
    assert o.used and o.reads >= 1, o
    assert p._pool.connects == connects + 1  # see the module docstring of transport
    ids = p.claim("next")
    check_bytes(src, group, hashes, ids)
    group.manager.release(ids)
    assert p.quarantined_blocks == 0
    assert_clean(group)


def test_reads_inside_the_granted_hold_count_without_the_ack(src, make_puller):
    """The source grants a hold (default 5 s, capped by the deadline) and stops right after
    its reply: the reads still complete (one-sided) inside the hold, so the pull commits
    without waiting for the ReadAck that never comes, bit for bit the source's blocks. The
    destination's ReadDone releases the pins although the frozen task has not ended."""
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    p = make_puller(group, deadline_s=1.5, transfer_timeout_s=1.0)
    sent = src.http("GET", "/test/stats")["replies"]
    src.faults(freeze_after_reply=True)
    try:
        o = pull(p, "held", tokens, hint_for(src, tokens))
        assert o.used and o.reason is Reason.OK and o.reads >= 1, o
        assert "ack" not in o.phases and o.total_s < 1.0, o  # did not wait for the ack
        # ReadDone (sent after the reads) releases the pins; the frozen send itself stays
        # active until the source's 1.5 s deadline
        t0, st = time.monotonic(), src.http("GET", "/test/stats")
        while st["pins_outstanding"] and time.monotonic() - t0 < 5.0:
            time.sleep(0.02)
            st = src.http("GET", "/test/stats")
        assert st["pins_outstanding"] == 0 and st["pool"]["pinned"] == 0, st
        assert time.monotonic() - t0 < 1.0, st  # long before the deadline
    finally:
        src.faults(freeze_after_reply=False)
    assert served_kinds(src, sent) == {"read": 1, "stream": 0}
    claim_check_release(p, group, src, "held", hashes)
    assert_clean(group)
    src.wait_no_pins()  # the frozen send ended at its deadline


def test_source_killed_mid_transfer(make_puller):
    # The stream explicitly (chunks of one block, 150 ms apart); the read path's kill is
    # test_source_killed_while_the_destination_waits_for_the_read_ack.
    tokens = list(range(7, 7 + 16 * BS))
    s = Source("source_peer.py", "--seq", f"7:{7 + 16 * BS}", "--chunk-bytes", "2048",
               "--slow-send-ms", "150", "--chunks-in-flight", "1").wait_ready()
    try:
        group = make_group()
        p = make_puller(group, remote_read=False)
        p.submit("killed", tokens, hint_for(s, tokens))
        deadline = time.monotonic() + 10
        while p.outcome("killed") is None and time.monotonic() < deadline:
            st = s.http("GET", "/test/stats")
            if st["active_sends"]:
                break
            time.sleep(0.02)
        time.sleep(0.3)  # a few chunks in
        s.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        o = p.result("killed", 10)
        assert o.reason is Reason.TRANSFER_FAILED, o
        assert time.monotonic() - t0 < 2  # a killed peer surfaces at once
        assert 0 < o.bytes_transferred < 16 * 2048 and o.reads == 0
        assert_clean(group)
    finally:
        s.kill()


@pytest.mark.parametrize("remote_read", [True, False], ids=["granted", "stream"])
def test_a_connection_the_source_closed_for_idleness_is_opened_again(make_puller,
                                                                      remote_read):
    """The source closes a connection idle for ``idle_connection_s``; the destination's next
    pull connects again and is used, with nothing left behind on either side."""
    tokens = list(range(9, 9 + 4 * BS))
    s = Source("source_peer.py", "--seq", f"9:{9 + 4 * BS}",
               "--idle-connection-s", "0.3").wait_ready()
    try:
        group = make_group()
        p = make_puller(group, remote_read=remote_read)
        hashes = sequence_hashes(tokens, BS)
        for i in range(2):
            o = pull(p, f"idle-{i}", tokens, hint_for(s, tokens))
            assert o.used and o.blocks_transferred == 4, o
            claim_check_release(p, group, s, f"idle-{i}", hashes)
            group.manager.evict(hashes)  # (so that the next pull asks the source again)
            if i == 0:
                time.sleep(1.0)  # (idle past its bound: the source closes it)
        assert p._pool.connects == 2  # (the first connection was closed, not reused)
        s.wait_no_pins()
        assert_clean(group)
    finally:
        s.kill()


# A reshard reads only when each read is big enough (read_min_run_bytes, default 64 KiB:
# smaller ones read slower than the stream); this tiny model's are 256 B - 1 KiB, so the
# "read" variants lower the threshold to exercise the read path, and "auto" checks the
# default. "read" reads the source on this host with kvkern's own system calls
# (kvkern.xfer.local_reads), "read_ucx" through UCX as a source on another host is read, and
# "read_pieces" through a UCX that refuses to scatter a read over an iov; the "_bound"
# variants lower only the bound for same-host reads (local_read_min_run_bytes), which
# reads where the source is read locally and streams where it is read through UCX.
UCX = dict(local_reads=False, ucx_same_host_reads=True)  # a same-host source read as a remote
RESHARD = {"read": dict(read_min_run_bytes=0), "stream": dict(remote_read=False),
           "auto": {}, "read_ucx": dict(read_min_run_bytes=0, **UCX),
           "read_pieces": dict(read_min_run_bytes=0, **UCX),
           "read_local_bound": dict(local_read_min_run_bytes=0),  # (read: the source is local)
           "stream_ucx_bound": dict(local_read_min_run_bytes=0, **UCX)}


@pytest.mark.parametrize("how", sorted(RESHARD))
def test_tp2_source_to_tp1_destination(make_puller, how, monkeypatch):
    """Each source rank's heads land in a head range of the TP1 destination's blocks: read
    one-sided (the source rank's consecutive blocks in one read, scattered over a piece
    per layer and K/V of each destination row, where the two ranks' heads interleave) or
    streamed; a TP2 destination of the same source reads whole blocks whatever the
    threshold."""
    if how == "read_pieces":
        monkeypatch.setattr(ucp_rma, "_iov_reads", False)
    tokens = list(range(3, 3 + 8 * BS))
    s = Source("source_peer.py", "--tp", "2", "--seq", f"3:{3 + 8 * BS}", tp=2).wait_ready()
    try:
        hashes = sequence_hashes(tokens, BS)
        group = make_group(tp=1)
        before = snapshot(group)
        p = make_puller(group, **RESHARD[how])
        o = pull(p, "tp21", tokens, hint_for(s, tokens))
        assert o.used and o.pairs == 2 and o.blocks_transferred == 8, o
        assert o.reads == (2 if how.startswith("read") else 0), o  # a read per source rank
        ids = claim_check_release(p, group, s, "tp21", hashes)
        assert_only_changed(group, before, set(ids))
        assert_clean(group)
        # and a TP2 destination (both ranks hosted here) from the same TP2 source
        g2 = make_group(tp=2)
        p2 = make_puller(g2, **RESHARD[how])
        o = pull(p2, "tp22", tokens, hint_for(s, tokens))
        assert o.used and o.pairs == 2 and (o.reads > 0) == (how != "stream"), o
        ids = p2.claim("tp22")
        want = s.blocks(hashes)
        for h, bid in zip(hashes, ids, strict=True):
            for r in (0, 1):
                assert sha(block_bytes(g2, r, bid)) == want[str(h)]["sha256"][str(r)]
        g2.manager.release(ids)
        assert_clean(g2)
        s.wait_no_pins()
    finally:
        s.kill()


@pytest.mark.parametrize("how", sorted(RESHARD))
def test_tp1_source_to_tp2_destination(src, make_puller, how):
    """Each destination rank reads (or is streamed) its half of the source's heads."""
    tokens = fresh_tokens(8 * BS)
    hashes = src.commit(tokens)
    group = make_group(tp=2)
    before = snapshot(group)
    p = make_puller(group, **RESHARD[how])
    sent = src.http("GET", "/test/stats")["replies"]
    o = pull(p, "tp12", tokens, hint_for(src, tokens))
    assert o.used and o.pairs == 2 and o.blocks_transferred == 8, o
    assert o.bytes_transferred == 8 * 2048  # each rank gets its half of the heads
    kind = "read" if how.startswith("read") else "stream"
    assert served_kinds(src, sent) == {"read": 0, "stream": 0, kind: 2}
    ids = claim_check_release(p, group, src, "tp12", hashes)
    assert_only_changed(group, before, set(ids))
    assert_clean(group)
    src.wait_no_pins()


def test_attention_dp_source_rank(make_puller):
    tokens = list(range(11, 11 + 6 * BS))
    s = Source("dp_source_peer.py", "--dp", "2", "--tp", "2", "--seq",
               f"1:11:{11 + 6 * BS}", tp=2, dp=2).wait_ready()
    try:
        hashes = sequence_hashes(tokens, BS)
        group = make_group()
        p = make_puller(group)
        o = pull(p, "dp0", tokens, hint_for(s, tokens, source_dp_rank=0))
        assert o.reason is Reason.SOURCE_MISS, o  # group 0 never held them
        o = pull(p, "dp5", tokens, hint_for(s, tokens, source_dp_rank=5))
        assert o.reason is Reason.INCOMPATIBLE_TOPOLOGY, o
        o = pull(p, "dp1", tokens, hint_for(s, tokens, source_dp_rank=1))
        assert o.used and o.source_dp_rank == 1 and o.blocks_transferred == 6, o
        claim_check_release(p, group, s, "dp1", hashes, dp=1)
        assert_clean(group)
        s.wait_no_pins()
    finally:
        s.kill()


def test_concurrent_pulls_dedup_and_cap(src, make_puller):
    seqs = [fresh_tokens(6 * BS) for _ in range(5)]
    hashes = [src.commit(t) for t in seqs]
    group = make_group(num_blocks=128)
    p = make_puller(group, max_inflight_pulls=4)
    src.faults(slow_send_ms=60)  # keep the first four in flight while the rest arrive
    try:
        # 0-3 lead; 4 is a fifth distinct pull (busy); 5-7 duplicate 0-2 (attach)
        plan = [(f"c{i}", seqs[i]) for i in range(5)] + [(f"c{5 + i}", seqs[i])
                                                        for i in range(3)]
        threads = []
        for rid, toks in plan:
            th = threading.Thread(target=p.submit, args=(rid, toks, hint_for(src, toks)))
            threads.append(th)
        for i, th in enumerate(threads):  # leaders first, then the rest, all within ms
            th.start()
            if i < 4:
                th.join()
        for th in threads:
            th.join()
        outs = {rid: p.result(rid, 30) for rid, _ in plan}
    finally:
        src.faults(slow_send_ms=0)
    reasons = {rid: o.reason for rid, o in outs.items()}
    assert [reasons[f"c{i}"] for i in range(4)] == [Reason.OK] * 4, outs
    assert reasons["c4"] is Reason.BUSY
    for i in range(3):
        o = outs[f"c{5 + i}"]
        assert o.reason is Reason.DUPLICATE and not o.used, o
        assert o.blocks_local == 6  # the leader's committed blocks, found locally
    assert p.inflight == 0
    for i in range(4):
        claim_check_release(p, group, src, f"c{i}", hashes[i])
    assert_clean(group)
    src.wait_no_pins()


def test_lease_release_and_close(src, make_puller):
    tokens = fresh_tokens(4 * BS)
    src.commit(tokens)
    group = make_group()
    p = make_puller(group)
    assert pull(p, "rel", tokens, hint_for(src, tokens)).used
    assert group.manager.stats()["leases"] == 1
    assert p.release("rel") and not p.release("rel")
    assert p.state("rel") is RequestState.CONTEXT_INIT
    assert_clean(group)
    tokens2 = fresh_tokens(4 * BS)
    src.commit(tokens2)
    assert pull(p, "unclaimed", tokens2, hint_for(src, tokens2, no_retain=False)).used
    p.close()  # releases unclaimed leases
    assert_clean(group)
    st = p.submit("after-close", tokens2, hint_for(src, tokens2))
    assert st is RequestState.CONTEXT_INIT
    with pytest.raises(KeyError):
        p.result("never-submitted", 0.1)



def test_a_source_pulled_from_steadily_never_waits_for_its_state(src, make_puller,
                                                                  monkeypatch):
    """A cached source state and endpoint verdict older than REFRESH_AHEAD of their time to
    live are used at once and fetched again meanwhile (the pull ends while that fetch is
    held), and so are ones past their time to live by less than ``state_max_stale_s`` (a
    source pulled from rarely); older ones are not used (the pull waits for the fetch); a
    refresh that fails drops the state; closing the puller ends a refresh still held."""
    from kvkern.xfer import discovery, endpoint
    from kvkern.xfer.tuning import REFRESH_AHEAD

    ttl, stale = 10.0, 40.0
    offset = [0.0]  # added to discovery's clock
    monkeypatch.setattr(discovery, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() + offset[0]))
    gate, fetches, resolves, fail = threading.Event(), [], [], [False]
    gate.set()
    real_fetch, real_resolve = endpoint.fetch_state, endpoint.resolve_endpoint_async

    async def held() -> None:
        while not gate.is_set():
            await asyncio.sleep(0.01)

    in_flight = []  # pulls running when each fetch or resolution began

    def running() -> float:
        return p.metrics.pulls_in_flight._value.get()

    async def fetch(*a, **kw):
        fetches.append(offset[0])
        in_flight.append(running())
        await held()
        if fail[0]:
            raise endpoint.FetchError("metadata_fetch_failed", "refused by the test")
        return await real_fetch(*a, **kw)

    async def resolve(*a, **kw):
        resolves.append(offset[0])
        in_flight.append(running())
        await held()
        return await real_resolve(*a, **kw)

    monkeypatch.setattr(endpoint, "fetch_state", fetch)
    monkeypatch.setattr(endpoint, "resolve_endpoint_async", resolve)
    p = make_puller(make_group(), state_cache_ttl_s=ttl, state_max_stale_s=stale)

    def prompt() -> list[int]:  # (each pull its own blocks: none is cached here yet)
        toks = fresh_tokens(2 * BS)
        src.commit(toks)
        return toks

    def pulled(rid: str) -> None:
        toks = prompt()
        o = pull(p, rid, toks, hint_for(src, toks))
        assert o.used, o
        p.release(rid)

    def until(cond) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    pulled("a")
    assert (len(fetches), len(resolves)) == (1, 1)
    pulled("b")  # fresh: nothing asked again
    assert (len(fetches), len(resolves)) == (1, 1)
    offset[0] = REFRESH_AHEAD * ttl + 0.5
    gate.clear()
    pulled("c")  # ends while its refreshes are held
    until(lambda: (len(fetches), len(resolves)) == (2, 2))
    assert in_flight[2:] == [0, 0], in_flight  # each refresh began once "c" had ended
    pulled("d")  # one refresh at a time
    assert (len(fetches), len(resolves)) == (2, 2)
    gate.set()
    until(lambda: not p._runner.discovery._state_fetches
          and not p._runner.discovery._refreshes)
    offset[0] += ttl + stale / 2  # past their time to live, not stale for long: used at once
    gate.clear()
    pulled("stale")
    until(lambda: (len(fetches), len(resolves)) == (3, 3))
    gate.set()
    until(lambda: not p._runner.discovery._state_fetches
          and not p._runner.discovery._refreshes)
    offset[0] += ttl + stale + 1  # past their time to live and the stale allowance: it waits
    gate.clear()
    toks = prompt()
    p.submit("e", toks, hint_for(src, toks))
    until(lambda: len(resolves) == 4)
    time.sleep(0.2)
    assert p.outcome("e") is None
    gate.set()
    assert p.result("e", 10).used and len(fetches) == 4
    p.release("e")
    offset[0] += REFRESH_AHEAD * ttl + 0.5
    fail[0] = True
    pulled("f")  # its refresh fails: the state is dropped, the next pull meets the failure
    until(lambda: not p._runner.discovery._state_fetches)
    toks = prompt()
    o = pull(p, "g", toks, hint_for(src, toks))
    assert not o.used and o.reason is Reason.METADATA_FETCH_FAILED, o
    fail[0] = False
    pulled("h")
    offset[0] += REFRESH_AHEAD * ttl + 0.5
    gate.clear()
    pulled("i")
    t0 = time.monotonic()
    p.close()  # its refreshes still held: cancelled, not waited for
    assert time.monotonic() - t0 < 5
    gate.set()


@pytest.mark.parametrize("read", [False, True], ids=["stream", "granted-read"])
def test_a_pull_whose_connection_dies_before_its_reply_asks_once_more(src, make_puller, read):
    """The pooled connection dies under a pull's request, before any reply (its source
    aborted it: another transfer on it failed, or it restarted its listener's side): the
    pull asks again once, on a fresh connection, and is used. A second death in one pull
    falls back."""
    group = make_group()
    p = make_puller(group, remote_read=read)
    toks = fresh_tokens(4 * BS)
    hashes = src.commit(toks)
    assert pull(p, "warm", toks, hint_for(src, toks)).used
    p.release("warm")
    group.manager.evict(hashes)
    assert p._pool.connects == 1
    aborted = src.faults()["requests_aborted"]  # (the source serves the whole module)
    src.faults(abort_before_replies=1)
    o = pull(p, "again", toks, hint_for(src, toks))
    assert o.used and o.reason is Reason.OK, o
    assert src.faults()["requests_aborted"] == aborted + 1 and p._pool.connects == 2
    claim_check_release(p, group, src, "again", hashes)
    group.manager.evict(hashes)
    src.faults(abort_before_replies=2)
    o = pull(p, "twice", toks, hint_for(src, toks))
    assert not o.used and o.reason is Reason.TRANSFER_FAILED and "peer_closed" in o.detail, o
    assert src.faults()["requests_aborted"] == aborted + 3
    assert_clean(group)
    src.wait_no_pins()
    assert pull(p, "after", toks, hint_for(src, toks)).used


@pytest.mark.parametrize("direct", [False, True], ids=["streamed", "direct"])
@pytest.mark.parametrize("stale", [False, True], ids=["cached", "past-its-ttl"])
def test_source_restart_is_detected(make_puller, monkeypatch, stale, direct):
    """A pull on the cached state of a source that restarted (fresh, or past its time to
    live and used while fetched again) fails its connection, asks again and names the
    restart, or pulls from the new incarnation; the next pull does."""
    import socket

    from kvkern.xfer import discovery

    with socket.socket() as sk:
        sk.bind((HOST, 0))
        http_port = sk.getsockname()[1]
    a = list(range(5, 5 + 4 * BS))
    b = list(range(50_005, 50_005 + 4 * BS))
    s1 = Source("source_peer.py", "--http-port", str(http_port), "--seq",
                f"5:{5 + 4 * BS}").wait_ready()
    s2 = None
    try:
        group = make_group()
        p = make_puller(group, direct_reads=direct, remote_read=direct)
        assert pull(p, "first", a, hint_for(s1, a)).used  # caches s1's state
        p.release("first")
        if stale:
            later = p.config.state_cache_ttl_s + 1.0
            assert later < p.config.state_cache_ttl_s + p.config.state_max_stale_s
            monkeypatch.setattr(discovery, "time", types.SimpleNamespace(
                monotonic=lambda: time.monotonic() + later))
        s1.kill()
        # same state endpoint, new incarnation and new UCX ports
        s2 = Source("source_peer.py", "--http-port", str(http_port), "--seq",
                    f"50005:{50_005 + 4 * BS}").wait_ready()
        assert s2.ready["incarnation"] != s1.ready["incarnation"]
        t0 = time.monotonic()
        o = pull(p, "second", b, hint_for(s2, b))
        if stale:  # used at once: it named the dead incarnation's UCX address
            assert not o.used, o
        if not o.used:  # the cached state named the dead incarnation's UCX address
            assert o.reason is Reason.SOURCE_INCARNATION_CHANGED, o
            assert s1.ready["incarnation"] in o.detail and s2.ready["incarnation"] in o.detail
            if direct:  # its direct read failed: no connection to the dead address tried
                assert "one-sided read" in o.detail, o
        assert time.monotonic() - t0 < 10
        o = pull(p, "third", b, hint_for(s2, b))
        assert o.used and o.incarnation == s2.ready["incarnation"], o
        assert (o.messages == 0) == direct, o  # a direct read: no message
        claim_check_release(p, group, s2, "third", sequence_hashes(b, BS))
        assert_clean(group)
        s2.wait_no_pins()
    finally:
        s1.kill()
        if s2 is not None:
            s2.kill()


def test_wait_timeout_leaves_the_outcome_intact(src, make_puller, rt):
    tokens = fresh_tokens(4 * BS)
    src.commit(tokens)
    group = make_group()
    p = make_puller(group)
    src.faults(slow_send_ms=300, read_hold_s=0)  # a read without a hold waits for its ack
    try:
        p.submit("w", tokens, hint_for(src, tokens))
        with pytest.raises(TimeoutError):
            rt.run(p.wait("w", timeout=0.05), 5)
        with pytest.raises(TimeoutError):
            p.result("w", 0.01)
        o = rt.run(p.wait("w", timeout=20), 25)
    finally:
        src.faults(slow_send_ms=0, read_hold_s=5.0)
    assert o.used and p.result("w", 0) is o
    p.release("w")
    assert_clean(group)
    src.wait_no_pins()


# ------------------------------------------------------------------------ one-sided reads
#
# A trtllm pool is whole contiguous block rows: by default the destination asks for a read
# (PullRequest.read), the source replies where the pinned blocks are, the destination reads
# them straight into its private blocks (one run per stretch of blocks consecutive on both
# sides) and, the reads having ended inside the granted hold, commits and sends
# ReadDone(ack=False): 3 messages in all (a read past the hold waits for ReadAck(held=True)).


def source_block_ids(src: Source, hashes: list[int]) -> list[int]:
    got = src.blocks(hashes)
    return [got[str(h)]["block_id"] for h in hashes]


def commit_scattered(src: Source, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Commit ``tokens`` on the source so that no block's pool id is one above its
    predecessor's (a read can then merge no two blocks into one run): commit, evict in a
    chosen order (each evicted block goes to the free-queue head), commit again (allocation
    pops the head, last evicted first). Returns (hashes, source block ids)."""
    hashes = src.commit(tokens)
    assert len(hashes) >= 3
    ids = source_block_ids(src, hashes)
    order = sorted(ids)
    want = order[0::2] + order[1::2]  # ascending neighbours differ by >= 2
    by_id = dict(zip(ids, hashes, strict=True))
    ev = src.evict([by_id[b] for b in reversed(want)])
    assert sorted(ev["evicted"]) == sorted(hashes), ev
    assert src.commit(tokens) == hashes
    got = source_block_ids(src, hashes)
    assert got == want, (got, want)
    assert all(b != a + 1 for a, b in zip(got, got[1:], strict=False)), got
    return hashes, got


def fragment(group: KVGroup) -> list[int]:
    """Hold every even block of the destination pool, so its free blocks, hence a pull's
    private blocks, are the odd ones: no two consecutive. Returns the held ids."""
    mgr = group.manager
    ids = mgr.allocate(group.num_blocks)
    mgr.release(ids[1::2])
    return ids[0::2]


@pytest.mark.parametrize("layout,remote_read,rings", [("trtllm", True, 0),
                                                       ("trtllm", False, 1),
                                                       ("vllm_hnd", True, 0),
                                                       ("vllm_nhd", True, 1)])
def test_receive_rings_are_prewarmed_only_for_ranks_that_stream(make_puller, layout,
                                                                remote_read, rings):
    """A host rank whose blocks are whole segments reads (no ring faulted in at start); a
    rank that streams (reads off, an NHD pool) gets its ring of chunks_in_flight slots."""
    p = make_puller(make_group(layout=layout), remote_read=remote_read, chunk_bytes=1 << 20,
                    chunks_in_flight=3)
    assert p._staging.idle_bytes == rings * 3 * (1 << 20)


LANES = {"loop-lane": {}, "one-lane": dict(loop_read_bytes=0),
         "two-lanes": dict(read_lane_min_bytes=1, loop_read_bytes=0)}


@pytest.mark.parametrize(("lanes", "reads"), [
    (lanes, reads) for lanes in sorted(LANES) for reads in ("ucx", "local")])
def test_read_scattered_source_blocks_into_scattered_private_blocks(src, make_puller, lanes,
                                                                    reads, monkeypatch):
    """Read on the loop lane (the default for a pull of
    at most 4 MiB), on one read lane (the default below 8 MiB) and split over two
    (kvkern.xfer.read_lanes); through UCX, or with kvkern's own system calls from this
    host's source (kvkern.xfer.local_reads), on the same lanes' threads."""
    from kvkern.xfer import local_reads

    threads: list[str] = []
    real_reading = local_reads.reading

    def reading(*a):
        threads.append(threading.current_thread().name)
        return (yield from real_reading(*a))

    monkeypatch.setattr(local_reads, "reading", reading)
    n = 12
    tokens = fresh_tokens(n * BS)
    hashes, remote = commit_scattered(src, tokens)
    group = make_group()
    held = fragment(group)
    before = snapshot(group)
    p = make_puller(group, local_reads=reads == "local", ucx_same_host_reads=reads != "local",
                    **LANES[lanes])
    sent = src.http("GET", "/test/stats")["replies"]
    o = pull(p, "scattered", tokens, hint_for(src, tokens))
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == n, o
    assert o.messages == 3, o  # request, reply, ReadDone: no data message, no ReadAck
    assert o.reads == n, o  # scattered on both sides: one run per block
    assert o.bytes_transferred == n * 2048
    assert served_kinds(src, sent) == {"read": 1, "stream": 0}
    ids = p.claim("scattered")
    assert ids is not None and len(ids) == n and not set(ids) & set(held), ids
    assert all(b != a + 1 for a, b in zip(ids, ids[1:], strict=False)), ids
    check_bytes(src, group, hashes, ids)
    assert source_block_ids(src, hashes) == remote  # what was read is still there
    lane_set = p._reads.lanes
    two = min(2, len(os.sched_getaffinity(0)))  # lanes are capped at the usable CPUs
    if reads == "ucx":
        assert not threads
        assert (lane_set.peers if lane_set else 0) == {"connection": 0, "loop-lane": 1,
                                                       "one-lane": 1, "two-lanes": two}[lanes]
        assert (lane_set._on_loop.peers if lane_set else 0) == (lanes == "loop-lane")
    else:  # no UCX endpoint at all; the reads ran where UCX's would have
        assert lane_set.peers == 0
        lane_threads = {t for t in threads if t.startswith("kvkern-lane")}
        # (an executor's thread is named kvkern-lane<i>_0)
        assert {t.split("_")[0] for t in lane_threads} == {
            "loop-lane": set(), "one-lane": {"kvkern-lane0"},
            "two-lanes": {f"kvkern-lane{i}" for i in range(two)}}[lanes]
        assert len(threads) == {"loop-lane": 1, "one-lane": 1, "two-lanes": two}[lanes]
    assert_only_changed(group, before, set(ids))  # the held blocks kept their bytes
    group.manager.release(ids)
    group.manager.release(held)
    assert p.quarantined_blocks == 0
    assert_clean(group)
    src.wait_no_pins()
    p.close()  # closes the lanes' endpoints and workers too
    assert p._reads.lanes is None and (lane_set is None or lane_set.peers == 0)


def fail_read_lanes(monkeypatch) -> list[bool]:
    """Every read on read lanes fails, not by time; per read, whether it was into memory
    the engine owns."""
    from kvkern.xfer.read_lanes import ReadLanes
    from kvkern.xfer.transport import TransportError

    calls = []

    async def failing(self, address, parts, *, timeout, local=None, owned=False,
                      same_host=False):
        calls.append(owned)
        raise TransportError("transfer_failed", "injected lane failure")

    monkeypatch.setattr(ReadLanes, "read", failing)
    return calls


def test_failed_read_lanes_stream_the_pair_and_rest(src, make_puller, monkeypatch):
    """Read lanes that fail (not by time) cost no pull: the grant is given up and the same
    pull streams the pair (a UCX connection does not read: its worker has no RMA), and
    later pulls from that source worker stream without trying the lanes until LANE_RETRY_S
    has passed."""
    from kvkern.xfer import receive as receive_mod

    calls = fail_read_lanes(monkeypatch)
    group = make_group()
    p = make_puller(group, direct_reads=False)
    for i in range(2):
        tokens = fresh_tokens(6 * BS)
        hashes = src.commit(tokens)
        sent = src.http("GET", "/test/stats")["replies"]
        o = pull(p, f"lanes-down-{i}", tokens, hint_for(src, tokens))
        assert o.used and o.reason is Reason.OK and o.blocks_transferred == 6, o
        claim_check_release(p, group, src, f"lanes-down-{i}", hashes)
        assert len(calls) == 1  # the second pull did not try the lanes
        assert served_kinds(src, sent) == {"read": int(i == 0), "stream": 1}
        src.wait_no_pins()  # the first pull's grant was given up
    monkeypatch.setattr(receive_mod, "LANE_RETRY_S", 0.0)
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    o = pull(p, "lanes-retried", tokens, hint_for(src, tokens))
    assert o.used and len(calls) == 2, o  # tried again, failed again, streamed
    claim_check_release(p, group, src, "lanes-retried", hashes)
    assert_clean(group)
    src.wait_no_pins()


def test_failed_read_lanes_fail_a_pull_into_the_engines_blocks_and_the_next_streams(
        src, make_puller, monkeypatch):
    """Into the engine's blocks, read lanes that fail (not by time) fail that pull (the
    engine recomputes; it is not asked again as a stream) and rest: the next pull
    into the engine's blocks streams."""
    calls = fail_read_lanes(monkeypatch)
    group = make_group()
    engine = group.manager.allocate(6)
    p = make_puller(group)
    before = snapshot(group)
    tokens = fresh_tokens(6 * BS)
    src.commit(tokens)
    o = pull_into(p, "into-lanes-down", tokens, hint_for(src, tokens), engine)
    assert not o.used and o.reason is Reason.TRANSFER_FAILED and calls == [True], o
    assert_only_changed(group, before, set(engine))
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    sent = src.http("GET", "/test/stats")["replies"]
    o = pull_into(p, "into-streamed", tokens, hint_for(src, tokens), engine)
    assert o.used and o.blocks_transferred == 6 and calls == [True], o
    assert served_kinds(src, sent) == {"read": 0, "stream": 1}
    check_bytes(src, group, hashes, engine)
    group.manager.release(engine)
    assert_clean(group)
    src.wait_no_pins()


@pytest.fixture(scope="module")
def src_hnd():
    """A source whose pool is per-layer HND (vLLM/FlashInfer): one read segment per layer."""
    s = Source("source_peer.py", "--layout", "vllm_hnd", "--num-blocks", "128",
               "--chunk-bytes", str(8 << 10))
    try:
        yield s.wait_ready()
    finally:
        s.kill()


@pytest.mark.parametrize("src_layout,dst_layout,scattered", [
    ("trtllm", "vllm_hnd", True), ("vllm_hnd", "vllm_hnd", True),
    ("vllm_hnd", "trtllm", True), ("vllm_hnd", "vllm_hnd", False)])
def test_read_per_layer_pools(src, src_hnd, make_puller, src_layout, dst_layout, scattered):
    """A per-layer HND pool reads too, one segment (its ``[2, H, T, D]``) per layer and
    block, into or out of TRT-LLM's block rows or another HND pool; stretches of blocks
    consecutive on both sides merge per layer between two HND pools, and a TRT-LLM row is
    one read scattered over the HND pool's layers."""
    source = src if src_layout == "trtllm" else src_hnd
    n, layers = 12, MODEL.num_layers
    tokens = fresh_tokens(n * BS)
    if scattered:
        hashes, remote = commit_scattered(source, tokens)
    else:
        hashes = source.commit(tokens)
        remote = source_block_ids(source, hashes)
    group = make_group(layout=dst_layout)
    held = fragment(group) if scattered else []
    before = snapshot(group)
    # every layer's runs over two lanes (not the loop lane, which would take so small a pull)
    p = make_puller(group, read_lane_min_bytes=1, loop_read_bytes=0)
    sent = source.http("GET", "/test/stats")["replies"]
    o = pull(p, "per-layer", tokens, hint_for(source, tokens))
    assert o.used and o.blocks_transferred == n and o.bytes_transferred == n * 2048, o
    assert served_kinds(source, sent) == {"read": 1, "stream": 0}
    assert o.messages == 3, o
    ids = p.claim("per-layer")
    if src_layout == dst_layout == "vllm_hnd":
        assert o.reads == layers * len(coalesce(ids, remote, 1)), (o, ids, remote)
        if not scattered:
            assert o.reads < n * layers, (o, ids, remote)
    elif src_layout == "trtllm":  # a source row is one read, scattered over the layers
        assert o.reads == n, o
    else:  # a TRT-LLM row holds every layer of one block: nothing merges across blocks
        assert o.reads == n * layers, o
    check_and_release(p, group, source, hashes, ids, before, held)


def check_and_release(p, group, source, hashes, ids, before, held) -> None:
    """The claimed ``ids`` hold the source's blocks bit for bit, nothing else changed; then
    every block goes back and nothing is left pinned or quarantined on either side."""
    check_bytes(source, group, hashes, ids)
    assert_only_changed(group, before, set(ids))
    group.manager.release(ids)
    group.manager.release(held)
    assert p.quarantined_blocks == 0
    assert_clean(group)
    source.wait_no_pins()


@pytest.mark.parametrize("layout,segments", [("vllm_nhd", 2), ("vllm_flash", 4),
                                              ("cross_layer", 1)])
def test_read_in_the_pools_own_order_between_pools_of_one_layout(make_puller, layout,
                                                                 segments):
    """Pools whose canonical bytes are not contiguous (vLLM NHD and ``[2, NB, ...]``, the
    cross-layer ``[NB, L, 2, T, H, D]``) are read block for block in their own order between
    two workers of the same layout: one read per segment (a layer, or a K/V plane of one)
    and block of a scattered source; a destination of another layout gets the stream."""
    tokens = fresh_tokens(6 * BS)
    s = Source("source_peer.py", "--layout", layout, "--num-blocks", "64",
               "--chunk-bytes", str(8 << 10)).wait_ready()
    try:
        st = s.http("GET", "/kvkern/v1/state")
        assert st["dp_groups"]["0"]["ranks"]["0"]["read"] == "native"
        hashes, remote = commit_scattered(s, tokens)
        for dst_layout, read in ((layout, True), ("trtllm", False)):
            group = make_group(layout=dst_layout)
            held = fragment(group)
            before = snapshot(group)
            p = make_puller(group)
            sent = s.http("GET", "/test/stats")["replies"]
            o = pull(p, f"native-{dst_layout}", tokens, hint_for(s, tokens))
            assert o.used and o.blocks_transferred == 6 and o.bytes_transferred == 6 * 2048, o
            kind = "read" if read else "stream"
            assert served_kinds(s, sent) == {"read": 0, "stream": 0, kind: 1}
            assert o.reads == (6 * segments if read else 0), o
            ids = p.claim(f"native-{dst_layout}")
            check_and_release(p, group, s, hashes, ids, before, held)
        assert source_block_ids(s, hashes) == remote
    finally:
        s.kill()


def source_pieces(ids: list[int], min_run: int, per: int) -> int:
    """How many chunks a source sends of one planned chunk of its blocks ``ids``: one per
    run of at least ``min_run`` consecutive blocks (sent from its pool), and the blocks
    between such runs packed together, ``per`` at a time."""
    out = pending = 0
    start = 0
    for i in range(1, len(ids) + 1):
        if i < len(ids) and ids[i] == ids[i - 1] + 1:
            continue
        if i - start >= min_run:
            out += 1 + (pending > 0)
            pending = 0
        else:
            pending += i - start
            out += pending // per
            pending %= per
        start = i
    return out + (pending > 0)


@pytest.mark.parametrize("min_run_bytes,unpacked", [(2 * 2048, False), (1 << 30, True)],
                         ids=["runs-land-in-place", "runs-too-short"])
def test_stream_chunks_follow_the_runs_of_receive_blocks(src, make_puller, monkeypatch,
                                                         min_run_bytes, unpacked):
    """A stream into receive blocks in runs of 3 (the source's chunks hold up to 4 blocks)
    asks for chunks cut at the runs (PullRequest.chunk_blocks): each lands in place, no
    unpack; runs shorter than STREAM_MIN_RUN_BYTES share chunks unpacked from staging, in
    chunks of up to 4 blocks cut where the source's blocks stop being consecutive (each part
    leaves the source's pool unpacked). The bytes are the source's either way."""
    from kvkern.xfer import runner as runner_mod

    monkeypatch.setattr(runner_mod, "STREAM_MIN_RUN_BYTES", min_run_bytes)
    n = 12
    tokens = fresh_tokens(n * BS)
    hashes = src.commit(tokens)
    remote = source_block_ids(src, hashes)
    planned = [(b, b + 3) for b in range(0, n, 3)] if not unpacked else \
        [(b, b + 4) for b in range(0, n, 4)]
    chunks = sum(source_pieces(remote[a:b], 2, 4) for a, b in planned)
    group = make_group()
    mgr = group.manager
    taken = mgr.allocate(group.num_blocks)
    free = [b for start in (10, 20, 30, 40) for b in range(start, start + 3)]
    mgr.release(free)
    held = [b for b in taken if b not in set(free)]
    before = snapshot(group)
    p = make_puller(group, remote_read=False, chunk_bytes=8 << 10)
    o = pull(p, f"runs-{unpacked}", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == n, o
    assert ("unpack" in o.phases) is unpacked, o.phases
    assert o.messages == 2 + chunks, o  # request, reply, the chunks
    ids = p.claim(f"runs-{unpacked}")
    assert sorted(ids) == free
    check_and_release(p, group, src, hashes, ids, before, held)


def test_a_run_landing_in_place_travels_in_one_chunk_above_both_chunk_sizes(make_puller,
                                                                           monkeypatch):
    """Consecutive blocks on both sides: no staging holds the stream, so the planned run is
    one chunk of 12 blocks, though each side stages at most 4 (``chunk_bytes``)."""
    from kvkern.xfer import runner as runner_mod

    monkeypatch.setattr(runner_mod, "STREAM_MIN_RUN_BYTES", 2 * 2048)
    s = Source("source_peer.py", "--num-blocks", "32", "--chunk-bytes", str(8 << 10),
               "--stream-min-run-bytes", str(2 * 2048)).wait_ready()
    try:
        n = 12
        tokens = fresh_tokens(n * BS)
        hashes = s.commit(tokens)
        remote = source_block_ids(s, hashes)
        assert remote == list(range(remote[0], remote[0] + n))  # consecutive at the source
        group = make_group()
        before = snapshot(group)
        p = make_puller(group, remote_read=False, chunk_bytes=8 << 10)
        o = pull(p, "one-chunk", tokens, hint_for(s, tokens))
        assert o.used and o.blocks_transferred == n and o.bytes_transferred == n * 2048, o
        assert o.messages == 3 and "unpack" not in o.phases, o  # request, reply, one chunk
        ids = p.claim("one-chunk")
        assert ids == list(range(ids[0], ids[0] + n))
        check_and_release(p, group, s, hashes, ids, before, [])
    finally:
        s.kill()


def test_read_and_stream_commit_the_same_bytes(src, make_puller):
    n = 12
    tokens = fresh_tokens(n * BS)
    hashes = src.commit(tokens)
    remote = source_block_ids(src, hashes)
    assert "read/1" in src.http("GET", "/kvkern/v1/state")["capabilities"]
    got = {}
    for remote_read in (True, False):
        group = make_group()
        p = make_puller(group, remote_read=remote_read)
        sent = src.http("GET", "/test/stats")["replies"]
        o = pull(p, "same", tokens, hint_for(src, tokens))
        assert o.used and o.blocks_transferred == n and o.bytes_transferred == n * 2048, o
        kinds = served_kinds(src, sent)
        ids = p.claim("same")
        check_bytes(src, group, hashes, ids)
        got[remote_read] = (o, ids, [block_bytes(group, 0, b) for b in ids], kinds)
        group.manager.release(ids)
        assert p.quarantined_blocks == 0
        assert_clean(group)
    (ro, rids, rbytes, rkinds), (so, _, sbytes, skinds) = got[True], got[False]
    assert rbytes == sbytes
    assert rkinds == {"read": 1, "stream": 0} and ro.messages == 3, ro
    # one read per stretch of blocks consecutive in both pools
    assert ro.reads == len(coalesce(rids, remote, 1)), (ro, rids, remote)
    # remote_read=False streams although the source offers reads: a request, its reply and
    # the chunks (how many depends on where the shared source's pool put the blocks: runs of
    # consecutive blocks leave unpacked, the rest in packed 8 KiB chunks)
    assert skinds == {"read": 0, "stream": 1}
    assert so.reads == 0 and 2 + 1 <= so.messages <= 2 + n, so
    src.wait_no_pins()


def test_stream_from_a_source_without_reads(make_puller):
    tokens = list(range(13, 13 + 8 * BS))
    s = Source("source_peer.py", "--remote-read", "off", "--seq", f"13:{13 + 8 * BS}",
               "--chunk-bytes", "8192").wait_ready()
    try:
        assert "read/1" not in s.http("GET", "/kvkern/v1/state")["capabilities"]
        group = make_group()
        p = make_puller(group)
        assert p.config.remote_read  # it would read from a source offering it
        o = pull(p, "off", tokens, hint_for(s, tokens))
        assert o.used and o.blocks_transferred == 8, o
        assert o.reads == 0 and o.messages == 2 + 2, o  # 16 KiB in two 8 KiB chunks
        assert s.http("GET", "/test/stats")["replies"] == {"read": 0, "stream": 1}
        claim_check_release(p, group, s, "off", sequence_hashes(tokens, BS))
        assert_clean(group)
        s.wait_no_pins()
    finally:
        s.kill()


def test_source_killed_while_the_destination_waits_for_the_read_ack(make_puller):
    n = 16
    tokens = list(range(9, 9 + n * BS))
    s = Source("source_peer.py", "--seq", f"9:{9 + n * BS}", "--read-hold-s", "0",
               "--slow-send-ms", "5000").wait_ready()  # the ack would come 5 s after ReadDone
    try:
        group = make_group()
        p = make_puller(group)
        p.submit("killed-ack", tokens, hint_for(s, tokens))
        deadline = time.monotonic() + 10
        while s.http("GET", "/test/stats")["acks_delayed"] == 0:  # until ReadDone arrived
            assert p.outcome("killed-ack") is None, p.outcome("killed-ack")
            assert time.monotonic() < deadline, "the source never received ReadDone"
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        o = p.result("killed-ack", 10)
        assert o.reason is Reason.TRANSFER_FAILED and not o.used, o
        assert time.monotonic() - t0 < 2  # a killed peer surfaces at once
        assert o.reads >= 1 and o.bytes_transferred == n * 2048, o  # read, never confirmed
        assert p.claim("killed-ack") is None
        assert group.manager.longest_prefix(sequence_hashes(tokens, BS)) == 0
        assert p.quarantined_blocks == 0
        assert_clean(group)
    finally:
        s.kill()
