"""Pulls into an engine's own blocks (:meth:`Puller.pull_into`, what engine connectors use) on
the in-memory transport: the scheduler admits, the engine allocates, the pull fills exactly
those blocks and reports through :meth:`Puller.take_finished`; nothing is committed, leased or
freed by kvkern, on any path."""

from __future__ import annotations

import time

import pytest
import torch

from kvkern.kernels.pack import pack
from kvkern.xfer.admission import Admitted, WorkerFacts, admit
from kvkern.xfer.hints import decode_hint
from kvkern.xfer.outcome import Reason
from kvkern.xfer.policy import CostGuard
from kvkern.xfer.puller import Puller
from tests.test_pull_memory import BS, HINT, commit, fleet, loop, tokens  # noqa: F401  (fixtures, requested by name)


def admitted(p: Puller, toks: list[int], *, local: int = 0, policy: str | None = None):
    """What an engine's scheduler does: decode the hint and admit it with its own prefix."""
    body = {"kv_hint": dict(HINT["kv_hint"], **({"policy": policy} if policy else {}))}
    hint = decode_hint(body)
    facts = WorkerFacts(block_size=BS, hash_scheme=p.group.hash_scheme, bytes_per_block=1,
                        longest_prefix=lambda hashes: local)
    got = admit(toks, hint, worker=facts, config=p.config, cost_guard=CostGuard(p.config))
    assert isinstance(got, Admitted), got
    return hint, got


def finished(p: Puller, request_id: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rid, outcome in p.take_finished():
            assert rid == request_id
            return outcome
        time.sleep(0.005)
    raise AssertionError(f"{request_id} did not finish")


def test_a_pull_into_fills_the_engines_blocks_and_nothing_else(fleet):
    src, make = fleet
    toks = tokens(6, 11)
    hs = commit(src.group, toks)
    p = make()
    hint, adm = admitted(p, toks, local=2)
    engine_ids = p.group.manager.allocate(4)  # the engine's allocation for the tail
    before = p.group.ranks[0].pool.clone()
    p.pull_into("r", hint, adm, engine_ids)
    o = finished(p, "r")
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == 4, o
    a, b = src.group.ranks[0], p.group.ranks[0]
    want = pack(a.pool, a.layout, src.group.manager.match_prefix(hs)[2:])
    assert torch.equal(want.view(torch.int16), pack(b.pool, b.layout, engine_ids).view(torch.int16))
    others = [i for i in range(p.group.num_blocks) if i not in engine_ids]
    assert torch.equal(before[others].view(torch.int16), b.pool[others].view(torch.int16))
    # kvkern neither committed nor freed the engine's blocks
    assert p.group.manager.longest_prefix(hs) == 0
    assert p.group.manager.num_free == p.group.num_blocks - 4
    assert p.claim("r") is None and p.take_finished() == []
    p.group.manager.release(engine_ids)
    p.group.manager.check_invariants()
    assert src.pins_outstanding == 0


@pytest.mark.parametrize("fault,value,reason", [
    ("drop", True, Reason.TRANSFER_TIMEOUT),
    ("corrupt", "hashes", Reason.HASH_MISMATCH),
    ("disconnect", "stream", Reason.TRANSFER_FAILED),
])
def test_a_failed_pull_into_leaves_the_blocks_to_the_engine(fleet, fault, value, reason):
    src, make = fleet
    toks = tokens(4, 12)
    commit(src.group, toks)
    setattr(src.faults, fault, value)
    p = make(chunk_bytes=1024, chunks_in_flight=2)
    hint, adm = admitted(p, toks)
    engine_ids = p.group.manager.allocate(4)
    p.pull_into("r", hint, adm, engine_ids)
    o = finished(p, "r")
    assert not o.used and o.reason is reason and o.blocks_transferred == 0, o
    assert p.group.manager.num_free == p.group.num_blocks - 4  # still the engine's
    p.group.manager.release(engine_ids)
    p.group.manager.check_invariants()
    assert src.pins_outstanding == 0


def test_best_effort_reports_the_leading_blocks_it_filled(fleet):
    src, make = fleet
    toks = tokens(5, 13)
    commit(src.group, toks[:3 * BS])
    p = make()
    hint, adm = admitted(p, toks, policy="best_effort")
    engine_ids = p.group.manager.allocate(5)
    p.pull_into("r", hint, adm, engine_ids)
    o = finished(p, "r")
    assert o.used and o.reason is Reason.PARTIAL and o.blocks_transferred == 3, o
    p.group.manager.release(engine_ids)


def test_identical_pulls_into_are_not_deduplicated_and_bad_ids_are_refused(fleet):
    src, make = fleet
    toks = tokens(3, 14)
    commit(src.group, toks)
    src.faults.delay_s = 0.02
    p = make()
    hint, adm = admitted(p, toks)
    a, b = p.group.manager.allocate(3), p.group.manager.allocate(3)
    p.pull_into("a", hint, adm, a)
    p.pull_into("b", hint, adm, b)
    got = {}
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got.update(p.take_finished())
        time.sleep(0.005)
    assert {r: o.reason for r, o in got.items()} == {"a": Reason.OK, "b": Reason.OK}
    with pytest.raises(ValueError, match="2 block ids for a pull of 3"):
        p.pull_into("c", hint, adm, a[:2])
    with pytest.raises(ValueError, match="distinct"):
        p.pull_into("c", hint, adm, [a[0], a[0], a[1]])
    p.group.manager.release(a)
    p.group.manager.release(b)


def test_a_stream_into_the_engines_blocks_is_cut_at_their_runs(fleet, monkeypatch):
    """The engine's blocks keep their order (hash order); the stream still asks for chunks
    cut where their runs of consecutive ids break, so each run lands in place."""
    from kvkern.xfer import runner as runner_mod
    from kvkern.xfer.memtransport import MemorySource

    src, make = fleet
    seen = []
    real = MemorySource.serve
    monkeypatch.setattr(MemorySource, "serve", lambda self, req: (seen.append(req),
                                                                  real(self, req))[1])
    monkeypatch.setattr(runner_mod, "STREAM_MIN_RUN_BYTES", 1)  # every run its own chunks
    toks = tokens(6, 12)
    hs = commit(src.group, toks)
    p = make(chunk_bytes=1 << 20)
    hint, adm = admitted(p, toks, local=2)
    mgr = p.group.manager
    taken = mgr.allocate(p.group.num_blocks)
    engine_ids = [12, 13, 14, 7]  # hash order: a run of three, then one block
    mgr.release([b for b in taken if b not in engine_ids])
    p.pull_into("runs", hint, adm, engine_ids)
    o = finished(p, "runs")
    assert o.used and o.blocks_transferred == 4, o
    assert [r.chunk_blocks for r in seen] == [[3, 1]]
    a, b = src.group.ranks[0], p.group.ranks[0]
    want = pack(a.pool, a.layout, src.group.manager.match_prefix(hs)[2:])
    assert torch.equal(want.view(torch.int16), pack(b.pool, b.layout, engine_ids).view(torch.int16))
    mgr.release(engine_ids)
    mgr.check_invariants()
    assert src.pins_outstanding == 0
