"""Direct reads (kvkern.xfer.direct): a pull that reads a real source process's blocks with no
message to it, validated against the source's read directory; anything the directory does not
confirm goes the granted way. Same source peer, model and checks as tests/test_pull.py."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.cache.directory import MAX_GROUP
from kvkern.cache.hashing import local_block_hashes
from kvkern.xfer import direct, ucxcompat
from kvkern.xfer.outcome import Reason
from kvkern.xfer.state import parse_read_index
from tests import test_pull as tp
from tests.test_pull import (
    BS,
    assert_clean,
    assert_only_changed,
    claim_check_release,
    fresh_tokens,
    hint_for,
    make_group,
    pull,
    served_kinds,
    snapshot,
)

rt, src, make_puller = tp.rt, tp.src, tp.make_puller  # the fixtures, shared


@pytest.fixture(params=["whole", "spans", "apart"])
def lookup(request, monkeypatch):
    """How a direct read reads the directory: the whole table, the wanted buckets and slots
    in spans, or each one alone."""
    whole = request.param == "whole"
    monkeypatch.setattr(direct, "read_whole", lambda dir_buckets, k: whole)
    if request.param == "apart":
        monkeypatch.setattr(direct, "DIRECTORY_READ_COST_BYTES", 0)
    return request.param


@pytest.fixture
def rounds(monkeypatch) -> list[int]:
    """How many buckets each of the direct reads' bucket-reading rounds read (home, then
    plain), in order."""
    counts: list[int] = []
    buckets = direct.DirectRead._buckets

    def counted(self, read, which, wanted, plan=None):
        counts.append(len(self.want) if which is None else len(which))
        return buckets(self, read, which, wanted, plan)

    monkeypatch.setattr(direct.DirectRead, "_buckets", counted)
    return counts


def stats(src) -> dict:
    return src.http("GET", "/test/stats")["replies"]


@pytest.mark.parametrize("n_blocks", [1, 16])
def test_direct_read_sends_no_message(src, make_puller, n_blocks, lookup):
    tokens = fresh_tokens(n_blocks * BS + 1)
    hashes = src.commit(tokens)
    group = make_group()
    before, sent = snapshot(group), stats(src)
    p = make_puller(group, direct_reads=True)
    o = pull(p, f"direct-{n_blocks}", tokens, hint_for(src, tokens))
    assert o.used and o.reason is Reason.OK and o.blocks_transferred == n_blocks, o
    assert o.messages == 0 and o.reads >= 1 and "direct" in o.phases, o
    assert served_kinds(src, sent) == {k: 0 for k in sent}  # the source saw no request
    assert p.metrics.value("kvkern_direct_reads_total", result="used") == 1
    ids = claim_check_release(p, group, src, f"direct-{n_blocks}", hashes)
    assert_only_changed(group, before, set(ids))
    assert_clean(group)
    src.wait_no_pins()


@pytest.mark.parametrize("n_blocks", [1, 16], ids=["loop-lane", "lanes"])
def test_a_puller_opens_its_read_lanes_before_the_first_pull(src, make_puller, monkeypatch,
                                                              n_blocks):
    """The read lanes' UCX workers (the loop lane's and every thread lane's) are made when
    the puller is, each on its own thread, so the first pull makes none: a 1-block pull
    reads on the loop lane, 16 blocks (above loop_read_bytes) on the threads' lanes."""
    made = []
    real = ucxcompat.new_worker
    monkeypatch.setattr(ucxcompat, "new_worker", lambda context: (
        made.append(threading.current_thread().name), real(context))[1])
    group = make_group()
    p = make_puller(group, direct_reads=True, loop_read_bytes=4096)
    lanes = p._reads.lanes
    for fut in lanes.open(p._loop.loop):  # (already open: these do nothing)
        fut.result(10)
    n = lanes.n
    assert len(made) == n + 1 and len(set(made)) == n + 1, made  # one per lane, each its own
    assert all(lane.opened for lane in [*lanes._lanes, lanes._on_loop])  # (set 0: the others
    assert not any(lane.opened for lane in lanes._all[n:-1])  # open once a source stalls)
    tokens = fresh_tokens(n_blocks * BS + 1)
    hashes = src.commit(tokens)
    o = pull(p, "first", tokens, hint_for(src, tokens))
    assert o.used and o.messages == 0 and "direct" in o.phases, o
    assert len(made) == n + 1, made  # the pull made no worker
    claim_check_release(p, group, src, "first", hashes)
    p.close()
    assert not any(lane.opened for lane in lanes._all)


@pytest.mark.parametrize("cfg", [{"remote_read": False}, {"read_lanes": 0}],
                         ids=["streams-only", "no-lanes"])
def test_a_puller_that_cannot_read_opens_no_lanes(make_puller, cfg):
    assert make_puller(make_group(), **cfg)._reads.lanes is None


def test_a_puller_closed_at_once_leaves_no_lane_open(make_puller):
    """A close that follows the construction before the lanes' openings ran: each lane's
    close runs after its opening, on its thread, so nothing is left open."""
    for _ in range(5):
        p = make_puller(make_group(), direct_reads=True)
        lanes = p._reads.lanes
        p.close()
        assert not any(lane.opened for lane in lanes._all)


@pytest.mark.parametrize("local", [0, 14], ids=["whole-prefix", "local-head"])
def test_blocks_placed_by_chain_and_by_hash_are_both_read_directly(src, make_puller, lookup,
                                                                    local, rounds):
    """The source placed a prompt's first 18 blocks with their chain (two directory groups)
    and the last 4 by hash alone (committed under a parent it did not hold): the look-up
    finds the first at home and the rest in their plain buckets, with no message; with a
    ``local`` head the pull's hashes start inside the first group."""
    tokens = fresh_tokens(22 * BS)
    src.commit(tokens[:18 * BS])
    hashes = src.commit(tokens, placement="hash")
    group = make_group()
    mgr = group.manager
    if local:
        ids = mgr.allocate(local)
        mgr.commit(ids, hashes[:local])
        mgr.release(ids)
    p = make_puller(group, direct_reads=True)
    sent = stats(src)
    o = pull(p, f"placed-{local}", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == 22 - local and o.messages == 0, o
    assert served_kinds(src, sent) == {k: 0 for k in sent}
    # home buckets of every wanted hash, then the plain buckets of the last four
    assert rounds == ([] if lookup == "whole" else [22 - local, 4])
    claim_check_release(p, group, src, f"placed-{local}", hashes[local:])
    assert_clean(group)
    src.wait_no_pins()


def test_a_source_that_announces_no_group_is_read_by_plain_bucket(src, make_puller,
                                                                   monkeypatch, rounds):
    """A source whose state has no ``dir_group`` places every hash in its plain bucket: the
    destination looks there at once, in one round, with no message."""
    from kvkern.xfer import state as state_mod  # noqa: PLC0415

    parse = state_mod.parse_read_index
    monkeypatch.setattr(state_mod, "parse_read_index", lambda doc: parse(
        {k: v for k, v in doc.items() if k != "dir_group"} if isinstance(doc, dict) else doc))
    monkeypatch.setattr(direct, "read_whole", lambda dir_buckets, k: False)
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens, placement="hash")
    group = make_group()
    p = make_puller(group, direct_reads=True)
    o = pull(p, "plain", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == 6 and o.messages == 0, o
    assert rounds == [6]  # the plain buckets only
    claim_check_release(p, group, src, "plain", hashes)
    assert_clean(group)
    src.wait_no_pins()


def test_a_source_that_announces_no_check_words_is_asked_for_grants_unread(
        src, make_puller, monkeypatch, rounds):
    """A source whose directory slots carry no check words (its index has no ``dir_check``:
    an older source in a rolling upgrade) has no slot a reader may use: its blocks are
    granted, without a directory read first."""
    from kvkern.xfer import state as state_mod  # noqa: PLC0415

    parse = state_mod.parse_read_index
    monkeypatch.setattr(state_mod, "parse_read_index", lambda doc: parse(
        {k: v for k, v in doc.items() if k != "dir_check"} if isinstance(doc, dict) else doc))
    monkeypatch.setattr(direct, "read_whole", lambda dir_buckets, k: False)
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    p = make_puller(group, direct_reads=True)
    o = pull(p, "unchecked", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == 6 and o.messages > 0, o
    assert rounds == []  # its directory was never read
    claim_check_release(p, group, src, "unchecked", hashes)
    assert_clean(group)
    src.wait_no_pins()


def test_a_hash_missing_from_the_directory_asks_for_a_grant(src, make_puller):
    tokens = fresh_tokens(8 * BS)
    hashes = src.commit(tokens)
    src.evict(hashes[5:])
    group = make_group()
    sent = stats(src)
    p = make_puller(group, direct_reads=True, default_policy="best_effort")
    o = pull(p, "missing", tokens, hint_for(src, tokens))
    assert o.used and o.reason is Reason.PARTIAL and o.blocks_transferred == 5, o
    assert o.messages >= 2 and served_kinds(src, sent)["read"] == 1, o  # the granted way
    assert p.metrics.value("kvkern_direct_reads_total", result="missing") == 1
    claim_check_release(p, group, src, "missing", hashes[:5])
    assert_clean(group)


@pytest.mark.parametrize("recommit", [True, False], ids=["same-hashes-new-bytes", "evicted"])
def test_blocks_changed_during_the_read_are_never_used(src, make_puller, monkeypatch,
                                                       recommit, lookup):
    """Between the block reads and the second directory read, the source evicts the blocks
    and (``recommit``) computes the same prefix again into reused blocks with other bytes,
    so every hash is cached again under a new tag. The bytes already read are the old
    ones: the directory's tags reject them, the pull asks for a grant, and what it commits
    is the source's current blocks (or, evicted, nothing)."""
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    calls = []
    confirm = direct.DirectRead._confirm

    def change_then_confirm(self, read, rows, slot, where):
        if not calls:  # the first direct read only (the granted one follows)
            calls.append(1)
            src.evict(hashes)
            src.commit(fresh_tokens(40 * BS))  # takes the freed blocks: new bytes in them
            if recommit:
                assert src.commit(tokens) == hashes
        return confirm(self, read, rows, slot, where)

    monkeypatch.setattr(direct.DirectRead, "_confirm", change_then_confirm)
    p = make_puller(group, direct_reads=True)
    sent = stats(src)
    o = pull(p, f"changed-{recommit}", tokens, hint_for(src, tokens))
    assert calls == [1]
    assert p.metrics.value("kvkern_direct_reads_total", result="changed") == 1
    if recommit:
        assert o.used and o.blocks_transferred == 6 and served_kinds(src, sent)["read"] == 1, o
        claim_check_release(p, group, src, f"changed-{recommit}", hashes)
    else:
        assert not o.used and o.reason is Reason.SOURCE_MISS, o
        assert group.manager.longest_prefix(local_block_hashes(tokens, BS)) == 0
    assert_clean(group)


@pytest.mark.parametrize("lookup", ["spans", "apart"], indirect=True)
def test_a_bucket_changed_elsewhere_during_the_read_keeps_the_blocks(src, make_puller,
                                                                      monkeypatch, lookup):
    """Between the block reads and the confirmation the source caches an unrelated block in
    one of the buckets the look-up read: those bytes differ, so the confirmation compares
    the found slots one by one, finds them unchanged, and keeps every block (no grant)."""
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    confirm = direct.DirectRead._confirm
    compared = []
    real_stable = direct.stable
    monkeypatch.setattr(direct, "stable", lambda *a: compared.append(1) or real_stable(*a))

    def neighbour_then_confirm(self, read, rows, slot, where):
        if not compared and not getattr(self, "_moved", False):
            self._moved = True
            mask = self.index.dir_buckets - 1
            read_buckets = {int(b) for b in self.home}
            for _ in range(100_000):  # a one-block prompt whose bucket the look-up read
                other = fresh_tokens(BS)
                h = local_block_hashes(other, BS)[0]
                if h & mask in read_buckets:
                    break
            assert src.commit(other) == [h]
        return confirm(self, read, rows, slot, where)

    monkeypatch.setattr(direct.DirectRead, "_confirm", neighbour_then_confirm)
    p = make_puller(group, direct_reads=True)
    o = pull(p, "neighbour", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == 6 and o.messages == 0, o
    assert compared == [1]  # the bytes differed: the slots were compared
    claim_check_release(p, group, src, "neighbour", hashes)
    assert_clean(group)


def test_an_unchanged_directory_is_confirmed_without_comparing_slots(src, make_puller,
                                                                     monkeypatch):
    tokens = fresh_tokens(6 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    monkeypatch.setattr(direct, "read_whole", lambda dir_buckets, k: False)
    monkeypatch.setattr(direct, "stable", lambda *a: pytest.fail("slots compared"))
    p = make_puller(group, direct_reads=True)
    o = pull(p, "unchanged", tokens, hint_for(src, tokens))
    assert o.used and o.blocks_transferred == 6 and o.messages == 0, o
    claim_check_release(p, group, src, "unchanged", hashes)
    assert_clean(group)


@pytest.mark.parametrize("lookup", ["whole", "spans"], indirect=True)
def test_reads_that_outlive_their_abort_keep_every_buffer_they_target(src, make_puller,
                                                                     monkeypatch, lookup):
    """A direct read whose reads are still running after their endpoint was aborted
    (ReadsStuck): its private blocks are quarantined and every directory buffer UCX may still
    write (the reused scratch among them) is kept and never handed to a later read, which
    reads into new ones and is used."""
    from kvkern.xfer.transport import ReadsStuck  # noqa: PLC0415

    tokens = fresh_tokens(4 * BS)
    hashes = src.commit(tokens)
    group = make_group()
    p = make_puller(group, direct_reads=True)
    confirm = direct.DirectRead._confirm
    stuck = []
    scratches = []  # each read's kept buffers (its thread's, or the loop lane's)

    def stuck_after_confirming(self, read, rows, slot, where):
        out = yield from confirm(self, read, rows, slot, where)
        scratches.append(self.scratch)
        if not stuck:
            stuck.append([*self.buffers, *self.scratch.values()])
            raise ReadsStuck("reads still running after their endpoint was closed")
        return out

    monkeypatch.setattr(direct.DirectRead, "_confirm", stuck_after_confirming)
    o = pull(p, "stuck", tokens, hint_for(src, tokens))
    assert not o.used and p.quarantined_blocks == 4, o
    assert p.metrics.value("kvkern_blocks_quarantined_total") == 4
    kept = {id(b) for b in p._reads.stuck_buffers}
    assert stuck[0] and all(id(b) in kept for b in stuck[0])
    assert not scratches[0]  # (given up by the read that failed)
    o = pull(p, "after", tokens, hint_for(src, tokens))
    assert o.used and o.messages == 0 and o.blocks_transferred == 4, o
    assert not kept & {id(b) for b in [*scratches[-1].values(),
                                       *p._reads.loop_scratch.values()]}
    claim_check_release(p, group, src, "after", hashes)
    src.wait_no_pins()


def test_read_index_is_advisory_and_bounded():
    """A state's read_index is used only when every field is well-formed and every address
    it implies fits in 64 bits; anything else means reads by grant (None), never an error."""
    good = {"keys": ["ab" * 8], "bases": [1 << 20], "stride": 4096, "segment_bytes": 2048,
            "blocks": 256, "dir_key": "cd" * 8, "dir_base": 1 << 30, "dir_buckets": 128}
    index = parse_read_index(good)
    assert index is not None and index.keys == (bytes.fromhex("ab" * 8),)
    assert index.dir_buckets == 128 and index.blocks == 256
    assert index.dir_group == 0  # (a source that places every hash in its plain bucket)
    assert parse_read_index({**good, "dir_group": 16}).dir_group == 16
    assert not index.dir_check  # (a source whose slots carry no check words)
    assert parse_read_index({**good, "dir_check": 1}).dir_check
    assert not any(parse_read_index({**good, "dir_check": v}).dir_check
                   for v in (True, 2, "1", 1.0))
    bad = [None, [], {**good, "keys": []}, {**good, "keys": ["zz"]},
           {**good, "dir_group": MAX_GROUP + 1}, {**good, "dir_group": True},
           {**good, "dir_group": -1}, {**good, "dir_group": "16"},
           {**good, "bases": [1, 2]}, {**good, "stride": 0}, {**good, "segment_bytes": 8192},
           {**good, "blocks": 0}, {**good, "dir_buckets": 100}, {**good, "dir_buckets": True},
           {**good, "bases": [(1 << 64) - 4096]}, {**good, "dir_base": (1 << 64) - 1},
           {**good, "dir_key": ""}, {**good, "stride": -1}, {**good, "blocks": "256"},
           {k: v for k, v in good.items() if k != "dir_key"}]
    for doc in bad:
        assert parse_read_index(doc) is None, doc


def test_a_killed_source_ends_a_direct_read_promptly(make_puller):
    """The destination holds the source's state (cached) and an open read endpoint when
    the source dies: the next pull's direct read fails, the grant it then asks for cannot
    connect, and the request runs unhinted within the transfer timeout, leaving nothing
    behind."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    from tests.test_pull import Source  # noqa: PLC0415

    first, second = list(range(9, 9 + 4 * BS)), list(range(90_009, 90_009 + 4 * BS))
    s = Source("source_peer.py", "--seq", f"9:{9 + 4 * BS}").wait_ready()
    try:
        s.commit(second)
        group = make_group()
        p = make_puller(group, direct_reads=True, transfer_timeout_s=2.0)
        o = pull(p, "warm", first, hint_for(s, first))
        assert o.used and o.messages == 0, o  # state cached, read endpoint open
        group.manager.release(p.claim("warm"))
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
        t0 = time.monotonic()
        o = pull(p, "dead", second, hint_for(s, second))
        assert not o.used and o.reason in (Reason.TRANSFER_FAILED, Reason.TRANSFER_TIMEOUT,
                                           Reason.METADATA_FETCH_FAILED,
                                           Reason.METADATA_TIMEOUT), o
        assert time.monotonic() - t0 < 5, o
        assert_clean(group)
    finally:
        s.kill()


@pytest.mark.parametrize(("src_tp", "reads"), [(1, "local"), (2, "local"), (2, "ucx")])
@pytest.mark.parametrize("lookup", ["whole", "spans"], indirect=True)
def test_pulls_while_the_source_churns_its_blocks_are_exact(make_puller, monkeypatch, src_tp,
                                                           lookup, reads):
    """The source keeps evicting a prefix, writing another prefix's KV into the freed blocks,
    evicting that and committing the prefix again (its KV a function of its hashes, so the
    same bytes each time), while the destination pulls the prefix over and over. Every pull
    the destination uses holds exactly the prefix's bytes: a block overwritten during a
    direct read is caught by the directory (or the read asks for a grant), never used. From
    a TP2 source each destination row gathers both ranks' heads: reads scattered over an
    iov, the first on each endpoint checked while the blocks change. The source runs on this
    host, so its reads are kernel calls of kvkern's own (kvkern.xfer.local_reads), and from
    the TP2 source also through UCX, as a source on another host is read."""
    import collections  # noqa: PLC0415
    import time  # noqa: PLC0415

    from kvkern.xfer import ucp_rma  # noqa: PLC0415
    from tests.test_pull import Source, block_bytes, sha  # noqa: PLC0415

    # (scattered-read checks that fail under the churn change process-wide state: restored)
    for name in ("_iov_reads", "_iov_mismatches"):
        monkeypatch.setattr(ucp_rma, name, getattr(ucp_rma, name))
    tokens, other = list(range(5, 5 + 8 * BS)), list(range(70_005, 70_005 + 8 * BS))
    s = Source("source_peer.py", "--num-blocks", "24", "--kv-by-hash", "--tp", str(src_tp),
               tp=src_tp).wait_ready()
    try:
        hashes = s.commit(tokens)
        heads = {r: s.topology.head_range(r) if src_tp > 1 else None for r in range(src_tp)}
        want = {int(k): v["sha256"] for k, v in s.blocks(hashes).items()}
        group = make_group()
        # (a TP2 source's head slices are small runs: read them anyway)
        p = make_puller(group, direct_reads=True, default_policy="strict",
                        read_min_run_bytes=0, local_reads=reads == "local",
                        ucx_same_host_reads=reads != "local")
        misses: list[str] = []
        call = direct.DirectRead.__call__

        def counted(self, read):
            first = yield from call(self, read)
            if self.miss:
                misses.append(self.miss)
            return first

        monkeypatch.setattr(direct.DirectRead, "__call__", counted)
        # the prefix held 2 ms a round (a round takes about as long): pulls meet it cached,
        # absent, and changing under their reads
        s.http("POST", "/test/churn", {"tokens": tokens, "other": other, "seconds": 6.0,
                                       "pause_s": 0.002})
        seen: dict[str, int] = {}
        used = unasked = 0
        end = time.monotonic() + 5.0
        i = 0
        while time.monotonic() < end:
            i += 1
            o = pull(p, f"churn-{i}", tokens, hint_for(s, tokens))
            seen[o.reason.value] = seen.get(o.reason.value, 0) + 1
            if not o.used:
                continue
            used += 1
            unasked += o.messages == 0
            ids = p.claim(f"churn-{i}")
            for h, bid in zip(hashes, ids, strict=True):
                for r, rows in heads.items():
                    assert sha(block_bytes(group, 0, bid, heads=rows)) == want[h][str(r)], \
                        (i, r, o)
            group.manager.release(ids)
            group.manager.evict(hashes)  # pull it again next time
        churned = s.http("GET", "/test/churn")
        stats = (seen, used, unasked, churned, collections.Counter(m.split(" ", 1)[-1]
                                                                  for m in misses))
        assert churned["error"] is None and churned["rounds"] > 20, stats
        assert used and unasked, stats  # reads without a message ran during the churn
        assert set(seen) <= {"ok", "source_miss"}, stats
        print("churn:", stats)
        assert_clean(group)
        s.wait_no_pins()
    finally:
        s.kill()


def _spans_reference(offsets, item, gap):
    """read_spans by brute force: each offset's entry index and the reads."""
    reads, pos = [], 0
    for off in sorted(set(offsets)):
        if reads and off - (reads[-1][1] + reads[-1][2]) <= gap:
            reads[-1][2] = off + item - reads[-1][1]
        else:
            pos = reads[-1][0] + reads[-1][2] if reads else 0
            reads.append([pos, off, item])
    index = []
    for off in offsets:
        p, o, _ = next(r for r in reads if r[1] <= off < r[1] + r[2])
        index.append((p + off - o) // item)
    return index, [tuple(r) for r in reads]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=40), st.sampled_from([32, 256]),
       st.sampled_from([0, 32, 256, 1000, 16 << 10]), st.booleans())
def test_read_spans_reads_each_entry_once_in_order(entries, item, gap, vectorized):
    """Every wanted entry lands where its index says, each entry is read once, reads are
    ascending, never overlap, and merge exactly the neighbours at most ``gap`` bytes apart;
    the loop for a few offsets and the vectorized one give the same plan."""
    import numpy as np  # noqa: PLC0415

    from kvkern.cache import directory  # noqa: PLC0415

    offsets = [e * item for e in entries]
    small = directory.SMALL
    try:
        if vectorized:
            direct.SMALL = -1
        index, reads = direct.read_spans(np.array(offsets, np.int64), item, gap)
    finally:
        direct.SMALL = small
    want_index, want_reads = _spans_reference(offsets, item, gap)
    assert index.tolist() == want_index and reads == want_reads
    # read a table whose entry i holds i: each offset's index finds its own entry
    buf = np.full(sum(n for *_, n in reads) // item, -1)
    for p, o, n in reads:
        buf[p // item:(p + n) // item] = np.arange(o // item, (o + n) // item)
    assert buf[index].tolist() == [o // item for o in offsets]
    assert sum(n for *_, n in reads) <= len(set(offsets)) * (item + gap)
    for (p, o, n), (p2, o2, _) in zip(reads, reads[1:], strict=False):
        assert p2 == p + n and o2 - (o + n) > gap


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), min_size=1, max_size=12),
       st.sampled_from([32, 256]), st.booleans())
def test_plan_reads_reads_runs_in_order_and_else_spans(chunks, item, vectorized):
    """Runs of entries that follow each other in the order wanted (a chain's home buckets,
    several groups) are read one read per run, landing in that order; offsets that do not
    form such runs get :func:`read_spans`' plan. Either way every wanted entry lands where
    the plan says, and the loop and the vectorized detection agree."""
    import numpy as np  # noqa: PLC0415

    offsets = [(start + i) * item for start, n in chunks for i in range(n)]
    small = direct.SMALL
    try:
        if vectorized:
            direct.SMALL = -1
        index, reads = direct.plan_reads(np.array(offsets, np.int64), item, 0)
    finally:
        direct.SMALL = small
    runs = 1 + sum(1 for a, b in zip(offsets, offsets[1:], strict=False) if b != a + item)
    if len(offsets) >= 4 and 4 * runs <= len(offsets):
        assert index is None and len(reads) == runs
        assert [p for p, *_ in reads] == list(itertools.accumulate(
            [n for *_, n in reads[:-1]], initial=0))
    else:
        want_index, want_reads = direct.read_spans(np.array(offsets), item, 0)
        assert index.tolist() == want_index.tolist() and reads == want_reads
    buf = np.full(sum(n for *_, n in reads) // item, -1)
    for p, o, n in reads:
        buf[p // item:(p + n) // item] = np.arange(o // item, (o + n) // item)
    got = buf if index is None else buf[index]
    assert got.tolist() == [o // item for o in offsets]


def test_read_spans_refuses_unaligned_offsets():
    import numpy as np  # noqa: PLC0415

    with pytest.raises(ValueError, match="multiples of 32"):
        direct.read_spans(np.array([0, 40]), 32, 0)
    with pytest.raises(ValueError, match="non-negative"):
        direct.read_spans(np.array([-32]), 32, 0)


def test_the_whole_directory_is_read_only_when_small():
    """By bucket when the directory is larger than the wanted hashes' small reads cost, and
    always beyond 64 MiB: a source announcing 2**30 buckets (256 GiB) makes no pull read or
    allocate it whole, however many blocks it asks for."""
    assert direct.read_whole(1024, 16) and not direct.read_whole(1024, 15)  # 256 KiB
    assert direct.read_whole(1 << 18, 1 << 20)  # 64 MiB, a million hashes
    assert not direct.read_whole((1 << 18) + 1, 1 << 20)
    assert not direct.read_whole(1 << 30, 1 << 20)


@pytest.mark.parametrize("dst_tp", [1, 2])
def test_pairs_of_one_source_pool_share_one_look_up(make_puller, dst_tp):
    """A TP2 source's two ranks announce one read directory and one read worker: a TP1
    destination (each row gathers both ranks' heads, one read scattered per rank) or a
    TP2 one (whole blocks per rank) reads both pairs in one direct read, bit for bit, with
    no message to the source."""
    tokens = list(range(5, 5 + 8 * BS))
    s = tp.Source("source_peer.py", "--tp", "2", "--seq", f"5:{5 + 8 * BS}", tp=2).wait_ready()
    try:
        hashes = tp.sequence_hashes(tokens, BS)
        group = make_group(tp=dst_tp)
        before, sent = snapshot(group), stats(s)
        p = make_puller(group, direct_reads=True, read_min_run_bytes=0)
        o = pull(p, "tp2-direct", tokens, hint_for(s, tokens))
        assert o.used and o.pairs == 2 and o.blocks_transferred == 8, o
        assert o.messages == 0 and o.reads == 2, o  # the 8 blocks of each rank in one read
        assert p.metrics.value("kvkern_direct_reads_total", result="used") == 1
        assert served_kinds(s, sent) == {k: 0 for k in sent}
        if dst_tp == 1:
            ids = claim_check_release(p, group, s, "tp2-direct", hashes)
            assert_only_changed(group, before, set(ids))
        else:
            ids = p.claim("tp2-direct")
            want = s.blocks(hashes)
            for h, bid in zip(hashes, ids, strict=True):
                for r in (0, 1):
                    assert tp.sha(tp.block_bytes(group, r, bid)) == \
                        want[str(h)]["sha256"][str(r)]
            group.manager.release(ids)
        assert_clean(group)
    finally:
        s.kill()


def test_ranks_of_a_narrower_destination_read_each_source_block_once(src, make_puller):
    """TP1 -> TP2: each destination rank takes a head range of every source layer, runs
    too small to read alone (read_min_run_bytes between a rank's run and the whole
    block): read directly, both pairs together are one read per stretch of consecutive
    source blocks (one for all 8 in a fresh pool) scattered over both ranks' rows; asked
    for grants, each pair streams."""
    tokens = fresh_tokens(8 * BS)
    done = src.http("POST", "/test/commit", {"tokens": tokens})
    hashes, ids = done["hashes"], done["block_ids"]
    stretches = 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:], strict=False))
    block = tp.MODEL.num_layers * 2 * tp.MODEL.num_kv_heads * BS * tp.MODEL.head_dim * 2
    for direct_reads in (True, False):
        group = make_group(tp=2)
        before, sent = snapshot(group), stats(src)
        p = make_puller(group, direct_reads=direct_reads, read_min_run_bytes=block // 2)
        rid = f"narrower-{direct_reads}"
        o = pull(p, rid, tokens, hint_for(src, tokens))
        assert o.used and o.pairs == 2 and o.blocks_transferred == 8, o
        if direct_reads:
            assert o.messages == 0 and o.reads == stretches, (o, ids)
            assert served_kinds(src, sent) == {k: 0 for k in sent}
        else:
            assert o.reads == 0 and served_kinds(src, sent)["stream"] == 2, o
        ids = claim_check_release(p, group, src, rid, hashes)
        assert_only_changed(group, before, set(ids))
        assert_clean(group)
    src.wait_no_pins()


def test_a_failed_scattered_read_check_costs_one_grant_not_the_lanes(make_puller, monkeypatch):
    """A TP2 -> TP1 direct read whose first scattered read fails its check (as when the
    source rewrote the block between the read and its re-read): that pull asks for a grant
    and is exact, the read lanes stay up, and the next pull reads directly again."""
    from kvkern.xfer import ucp_rma  # noqa: PLC0415

    tokens = list(range(9, 9 + 8 * BS))
    s = tp.Source("source_peer.py", "--tp", "2", "--seq", f"9:{9 + 8 * BS}", tp=2).wait_ready()
    try:
        hashes = tp.sequence_hashes(tokens, BS)
        group = make_group()
        # (the check is UCX's: a source on this host is read through UCX here)
        p = make_puller(group, direct_reads=True, read_min_run_bytes=0, local_reads=False,
                        ucx_same_host_reads=True)
        monkeypatch.setattr(ucp_rma, "_iov_reads", True)
        monkeypatch.setattr(ucp_rma, "_iov_verified", type(ucp_rma._iov_verified)())
        monkeypatch.setattr(ucp_rma, "_iov_mismatches", 0)
        real, failed = ucp_rma.ReadBatch._verify, []

        def verify_once_wrong(self, run, *a):
            if not failed:
                failed.append(run)
                ucp_rma._iov_mismatches += 1
                raise ucp_rma.ScatterCheckError("scattered read check", ucp_rma.UCS_ERR_IO_ERROR)
            return real(self, run, *a)

        monkeypatch.setattr(ucp_rma.ReadBatch, "_verify", verify_once_wrong)
        for i, direct_read in enumerate((False, True)):
            o = pull(p, f"checked-{i}", tokens, hint_for(s, tokens))
            assert o.used and o.blocks_transferred == 8, o
            assert (o.messages == 0) is direct_read, o
            claim_check_release(p, group, s, f"checked-{i}", hashes)
            group.manager.evict(hashes)
        assert failed and ucp_rma._iov_reads and not p._runner.reads._lanes_down
        assert p.metrics.value("kvkern_direct_reads_total", result="changed") == 1
        assert_clean(group)
    finally:
        s.kill()


def test_each_thread_keeps_its_own_directory_buffers():
    """Lane sets run scripts at once, one per set's first thread: each thread's direct reads
    keep their directory buffers apart, so one script never reuses (or replaces and frees)
    a buffer that another's read may still be writing."""
    import threading

    from kvkern.xfer.config import XferConfig
    from kvkern.xfer.receive import ReadReceiver

    receiver = ReadReceiver(XferConfig(allowlist="127.0.0.1"), closed=lambda: False,
                            spawn=lambda coro: coro.close())
    mine = receiver.thread_scratch()
    assert receiver.thread_scratch() is mine
    other: list[dict] = []
    t = threading.Thread(target=lambda: other.append(receiver.thread_scratch()))
    t.start()
    t.join()
    assert other[0] is not mine and other[0] is not receiver.loop_scratch


def test_a_script_whose_reads_outlived_their_drain_keeps_its_buffers_itself(monkeypatch):
    """A direct read's look-up and confirmation buffers are the lane thread's scratch. When
    its reads outlive their endpoint (the drain ran out) the pull may already have let go of
    the script (a second cancellation cut its wait short) and kept nothing: the script hands
    them to the reads that outlived it (held until those end), or keeps them in the
    receiver's stuck buffers for good when the reads are not tracked. Other failures only
    take them out of reuse."""
    from types import SimpleNamespace

    import numpy as np

    from kvkern.xfer.read_lanes import _Stuck
    from kvkern.xfer.transport import ReadsStuck

    for exc, kept in ((_Stuck("lanes did not end"), True), (ReadsStuck("stuck"), True),
                      (RuntimeError("a read failed"), False)):
        table, scratch_buf = np.zeros(64, np.uint8), np.zeros(32, np.uint8)
        scratch: dict = {}
        receiver = SimpleNamespace(thread_scratch=lambda s=scratch: s, stuck_buffers=[])

        def steps(self, read, t0, exc=exc, buf=scratch_buf, scratch=scratch):
            scratch[("spans",)] = buf
            yield
            raise exc

        monkeypatch.setattr(direct.DirectRead, "_steps", steps)
        script = direct.DirectRead.__new__(direct.DirectRead)
        script._receiver, script.buffers = receiver, [table]
        gen = script(read=None)
        next(gen)
        with pytest.raises(type(exc)):
            next(gen)
        assert not scratch and any(b is scratch_buf for b in script.kept)
        held = getattr(exc, "outstanding", None)
        stuck = receiver.stuck_buffers if held is None else held.kept
        assert (any(b is table for b in stuck) and any(b is scratch_buf for b in stuck)) is kept
        assert kept or not stuck
        assert held is None or not receiver.stuck_buffers


@pytest.mark.parametrize("whole", [False, True], ids=["spans", "whole"])
@pytest.mark.parametrize("order", ["torn", "in-order"])
def test_a_slot_read_whose_words_straddle_two_publishes_keeps_no_wrong_bytes(whole, order):
    """A read of a slot takes each word whole but not the slot at one moment, its words in
    any order (a copy's loads, an RDMA read's fragments). The look-up takes the slot's hash
    and block words, then the slot is withdrawn, its block rewritten and another hash
    published there, then the look-up takes the tag; the confirmation takes the tag, then
    the first hash is published again into the same block and slot, then the confirmation
    takes the hash and block words. Both reads then show the same hash, block and tag while
    the block read between them held other bytes: the check word, which only the publish
    of that tag wrote to fit it, leaves the block unkept."""
    import ctypes

    import numpy as np

    from kvkern.cache.directory import ReadDirectory
    from kvkern.xfer.direct import DirectRead
    from kvkern.xfer.pauses import run_blocking
    from kvkern.xfer.state import ReadIndex

    nb, blk = 8, 64
    d = ReadDirectory(nb, group=1)
    pool = np.zeros((nb, blk), np.uint8)
    h = 0x1234_5678_9ABC_DEF0 | 1
    h2 = (0x0BAD_F00D << 8) | (h & (d.buckets - 1))  # the same (plain) bucket
    pool[3] = 0xAA  # h's bytes
    assert d.publish(3, h)
    flat = d.slot_of(3)
    at = d.slot_address(flat)
    index = ReadIndex(keys=(b"k",), bases=(pool.ctypes.data,), stride=blk, segment_bytes=blk,
                      blocks=nb, dir_key=b"d", dir_base=d.address, dir_buckets=d.buckets)
    dr = object.__new__(DirectRead)
    dr.index, dr.want, dr.whole = index, np.array([h], np.uint64), whole
    dr._home_plan = dr._plain = dr._home = dr.job = None
    dr._rounds, dr._raw, dr.scratch, dr.buffers, dr.kept = [], [], {}, [], []

    def reuse():  # during the look-up's read of the slot
        d.withdraw(3)
        pool[3] = 0x55  # block 3 handed to a writer
        assert d.publish(5, h2) and d.slot_of(5) == flat

    def again():  # during the confirmation's read
        d.withdraw(5)
        pool[3] = 0xAA  # h computed again into block 3
        assert d.publish(3, h) and d.slot_of(3) == flat

    during = [reuse]

    def read(parts):
        for key, runs in parts:
            for local, remote, n in runs:
                ctypes.memmove(local, remote, n)
                if key == b"d" and remote <= at < remote + n and during:
                    lo = local + at - remote
                    word = [(lo + 8 * i, at + 8 * i) for i in range(4)]
                    event = during.pop(0)
                    if order == "torn" and event is again:  # tag and check first
                        first, last = (word[2], word[3]), (word[0], word[1])
                    else:  # hash and block first
                        first, last = (word[0], word[1]), (word[2], word[3])
                    for w in first:
                        ctypes.memmove(*w, 8)
                    event()
                    for w in last:
                        ctypes.memmove(*w, 8)
        return 0.0
        yield  # (steps)

    rows, slot, block, where = run_blocking(dr._look_up(read))
    if block[0] < 0:  # (the torn look-up found nothing: a grant is asked for)
        return
    assert block[0] == 3
    data = pool[3].copy()  # step 2: the block's bytes
    during.append(again)
    kept = run_blocking(dr._confirm(read, rows, slot, where))
    assert not kept[0] or (data == 0xAA).all(), "kept bytes that are not h's"
