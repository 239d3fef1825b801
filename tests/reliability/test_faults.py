"""Fault matrix of the pull path between real worker processes on 127.0.0.1.

Destination D1 and sources S / K are fault workers (the real ``kvkern worker`` with test
routes, ``peers/fault_worker.py``). For every case:

1. a fresh prefix is prefilled on the source (its blocks cached there);
2. the fault is armed (a state URL query, a reply knob, a signal, a cancel);
3. a hinted request (hint timeouts: metadata 1 s, transfer 2 s, deadline 3 s unless the case
   says otherwise) goes to D1 and must fall back within its bound with the expected reason,
   and produce exactly the tokens and logits of a cold recompute (no hint);
4. both workers' leak counters (pool used/referenced/pinned/pins/leased/leases/private,
   source pins and active sends, puller pulls in flight) must return to 0;
5. the next hinted pull from the (living) source must succeed, its blocks equal to the
   source's by checksum and its tokens equal to the source's.

Data-path cases name their transport. D1's pool (trtllm) is whole block rows, so by default
the source answers with a one-sided **read** (reply -> the destination reads -> ReadDone ->
ReadAck); a ``stream`` case first switches the source's reads off (``remote_read`` knob: no
"read/1" in its state, so the destination asks for chunks). Either way the case checks which
kind of reply the source really sent, whether the destination had read the blocks before it
fell back, and (where the outcome reason alone could hide another failure) a phrase of the
outcome's detail. The ``read_*`` cases act once the source holds the ReadAck (after the
destination's reads and ReadDone): the source sleeps ``slow_send_ms`` there.
"""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

from kvkern.serve.httpjson import get_json, post_json
from tests.reliability.harness import (
    COMMON,
    T,
    pool_hashes,
    start_fault_workers,
    stop_hard,
    toks,
)

pytestmark = pytest.mark.timeout(120)

HINT_T = {"metadata_timeout_s": 1.0, "transfer_timeout_s": 2.0, "deadline_s": 3.0}
BLOCK_BYTES = 2048  # one block of the tiny model's pool (a read reply's stride)
SLACK_S = 1.5  # CPU contention on 2 shared cores


@dataclass
class Case:
    name: str
    expect: str  # the outcome reason
    what: str  # one line for the report
    state_fault: str | None = None  # ?fault= on the state URL
    reply_fault: str | None = None
    action: str | None = None  # kill | stop_mid | stop_state | cancel | refused | evict
    hint: dict = field(default_factory=dict)  # hint timeout overrides
    policy: str = "strict"
    source: str = "S"
    transport: str | None = None  # "stream" | "read": the reply the source must send
    read_first: bool | None = None  # the destination read the blocks before falling back
    detail: str | None = None  # a phrase of the outcome's detail that names the fault

    @property
    def timeouts(self) -> dict:
        return {**HINT_T, **self.hint}

    @property
    def bound_s(self) -> float:
        """The wait that should end this case (the one the fault exhausts)."""
        t = self.timeouts
        if self.expect == "metadata_timeout":
            return t["metadata_timeout_s"]
        if self.expect == "transfer_timeout":
            return t["transfer_timeout_s"]
        return t["deadline_s"]


CASES = [
    Case("source_killed_mid_transfer", "transfer_failed",
         "stream: source SIGKILLed after pinning and replying, before its first chunk",
         action="kill", source="K", transport="stream"),
    Case("source_frozen_mid_transfer_deadline", "deadline_exceeded",
         "stream: source SIGSTOPped mid-transfer until the pull deadline (2 s)",
         action="stop_mid", hint={"deadline_s": 2.0, "transfer_timeout_s": 5.0},
         transport="stream"),
    Case("source_frozen_mid_transfer_no_progress", "transfer_timeout",
         "stream: source SIGSTOPped mid-transfer; no progress for transfer_timeout (1 s)",
         action="stop_mid", hint={"deadline_s": 5.0, "transfer_timeout_s": 1.0},
         transport="stream"),
    Case("source_frozen_at_state", "metadata_timeout",
         "source SIGSTOPped before the state GET (metadata_timeout 1 s)", action="stop_state"),
    Case("evicted_between_state_and_pull", "source_miss",
         "source evicts every hinted block right after serving its state (strict)",
         state_fault="evict", action="evict"),
    Case("evicted_tail_best_effort", "partial",
         "source evicts the hinted tail after serving its state; best effort keeps the head",
         state_fault="evict", action="evict_tail", policy="best_effort"),
    Case("state_http_500", "metadata_fetch_failed", "state endpoint answers 500",
         state_fault="500"),
    Case("state_garbage", "metadata_invalid", "state body is 512 random bytes",
         state_fault="garbage"),
    Case("state_json_array", "metadata_invalid", "state body is a JSON array",
         state_fault="array"),
    Case("state_bad_schema", "metadata_invalid", "state JSON misses required fields",
         state_fault="bad_schema"),
    Case("state_oversized", "metadata_fetch_failed", "state body of 2 MiB (cap 1 MiB)",
         state_fault="oversized"),
    Case("state_slow_headers", "metadata_timeout", "state endpoint answers after 20 s",
         state_fault="slow"),
    Case("state_slow_body", "metadata_timeout", "state body trickles one byte a second",
         state_fault="slow_body"),
    Case("state_redirect", "metadata_fetch_failed",
         "state endpoint redirects to the cloud metadata address", state_fault="redirect"),
    Case("state_protocol", "protocol_mismatch", "state names protocol kvkern/9",
         state_fault="protocol"),
    Case("state_hash_scheme", "hash_scheme_mismatch", "state names another hash scheme",
         state_fault="scheme"),
    Case("state_block_size", "incompatible_topology", "state names another block size",
         state_fault="block_size"),
    Case("state_foreign_ucx_address", "source_not_allowed",
         "state advertises a UCX address outside the allowlist (10.9.9.9)",
         state_fault="ucx_foreign"),
    Case("connection_refused", "metadata_fetch_failed", "nothing listens at the hinted port",
         action="refused"),
    Case("destination_cancels_mid_pull", "cancelled",
         "stream: the destination cancels the request while the source streams (frozen after "
         "reply)", action="cancel", transport="stream"),
    Case("reply_served_over_range", "hash_mismatch",
         "stream: reply claims 2 more blocks than requested, with hashes outside the range",
         reply_fault="served_over", transport="stream",
         detail="hashes that are not the requested"),
    Case("reply_wrong_hashes", "hash_mismatch", "reply names other block hashes",
         reply_fault="wrong_hashes", detail="hashes that are not the requested"),
    Case("reply_chunk_over_limit", "transfer_failed",
         "stream: reply announces a chunk larger than the agreed chunk_bytes",
         reply_fault="chunk_oversize", transport="stream", detail="in chunks <="),
    Case("reply_bytes_over_blocks", "transfer_failed",
         "stream: reply announces 4 KiB more than the served blocks hold",
         reply_fault="total_mismatch", transport="stream", detail="in chunks <="),
    Case("reply_wrong_transfer_id", "transfer_failed",
         "reply on this transfer's tag names another transfer id", reply_fault="wrong_tid",
         detail="expected PullReply for transfer"),
    Case("reply_status_error", "transfer_failed", "source answers ERROR",
         reply_fault="status_error", detail="internal: injected"),
    Case("chunk_longer_than_announced", "transfer_failed",
         "stream: first data chunk carries 4 KiB more than the reply announced",
         reply_fault="chunk_overrun", transport="stream", detail="Message truncated"),
    Case("chunk_shorter_than_announced", "transfer_failed",
         "stream: first data chunk carries 4 KiB less than the reply announced (UCX takes it "
         "as whole; the canary at the end of its buffer does not)",
         reply_fault="chunk_underrun", transport="stream", detail="arrived shorter than"),
    # ---- the one-sided read path
    Case("read_source_killed_before_ack", "transfer_failed",
         "read: source SIGKILLed after the destination read the blocks and sent ReadDone, "
         "before its ReadAck", action="kill", source="K2", transport="read", read_first=True),
    Case("read_source_frozen_before_ack_deadline", "deadline_exceeded",
         "read: source SIGSTOPped after ReadDone, before its ReadAck, until the pull deadline "
         "(2 s)", action="stop_mid", hint={"deadline_s": 2.0, "transfer_timeout_s": 5.0},
         transport="read", read_first=True),
    Case("read_source_frozen_before_ack_no_progress", "transfer_timeout",
         "read: source SIGSTOPped after ReadDone, before its ReadAck; no ack for "
         "transfer_timeout (1 s)", action="stop_mid",
         hint={"deadline_s": 5.0, "transfer_timeout_s": 1.0}, transport="read",
         read_first=True),
    Case("read_destination_cancels_before_ack", "cancelled",
         "read: the destination cancels the request while it waits for the ReadAck",
         action="cancel", transport="read", read_first=True),
    Case("read_ack_not_held", "transfer_failed",
         "read: the ReadAck says the source did not hold the blocks through the read",
         reply_fault="ack_not_held", transport="read", read_first=True,
         detail="did not confirm it held the blocks"),
    Case("read_reply_served_over_range", "hash_mismatch",
         "read: read reply claims 2 more blocks than requested (hashes outside the range, "
         "2 more pool blocks to read)", reply_fault="served_over", transport="read",
         read_first=False, detail="hashes that are not the requested"),
    Case("read_reply_stride_short", "transfer_failed",
         "read: read reply puts blocks half a block apart (stride below the block size)",
         reply_fault="read_stride_short", transport="read", read_first=False,
         detail="outside the registered pool its state announces"),
    Case("read_reply_bytes_over_blocks", "transfer_failed",
         "read: read reply announces 4 KiB more than the served blocks hold",
         reply_fault="read_bytes_over", transport="read", read_first=False,
         detail="expected 2048 B blocks"),
    Case("read_reply_order_flipped", "transfer_failed",
         "read: read reply says its (canonical) segments are in the pool's own order",
         reply_fault="read_order_flipped", transport="read", read_first=False,
         detail="its state says"),
]


@pytest.fixture(scope="module")
def rng():
    return random.Random(7)


def _wait(pred, timeout: float, what: str, step: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def _hint(src_url: str, prefix: list[int], case: Case, nonce: str) -> dict:
    q = f"?n={nonce}" + (f"&fault={case.state_fault}" if case.state_fault else "")
    return {"kv_hint": {"source": f"{src_url}/kvkern/v1/state{q}",
                        "block_hashes": pool_hashes(prefix), "policy": case.policy,
                        **case.timeouts}}


def _check_next_request(src, dst, rng) -> dict:
    """The next hinted request from src to dst pulls, bit-exactly, and continues like src."""
    prefix, tail = toks(6 * T, rng), toks(2, rng)
    src.generate({"token_ids": prefix, "max_new_tokens": 0})
    body = {"token_ids": prefix + tail, "max_new_tokens": 2,
            "kv_hint": {"source": src.url, "block_hashes": pool_hashes(prefix)}}
    out = dst.generate(body)
    assert out["fallback"] is None and out["pull"]["reason"] == "ok", out["pull"]
    assert out["pulled_tokens"] == 6 * T
    hs = pool_hashes(prefix)
    d, s = dst.digests(hs), src.digests(hs)
    assert all(d[str(h)] is not None and d[str(h)] == s[str(h)] for h in hs), (d, s)
    ref = src.generate({"token_ids": prefix + tail, "max_new_tokens": 2})
    assert out["tokens"] == ref["tokens"] and out["logits_sha256"] == ref["logits_sha256"]
    return {"next_pull": "ok", "next_blocks_verified": len(hs)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault(cluster, record, rng, case: Case):
    dst, src = cluster["D1"], cluster[case.source]
    prefix, tail = toks(8 * T, rng), toks(2, rng)
    prompt = prefix + tail
    assert src.generate({"token_ids": prefix, "max_new_tokens": 0})["blocks_committed"] == 8
    base_dst, base_src = dst.wait_clean(), src.wait_clean()
    assert not any(base_dst.values()) and not any(base_src.values()), (base_dst, base_src)
    cold = dst.generate({"token_ids": prompt, "max_new_tokens": 2, "use_cache": False})

    rid = f"{case.name}-{uuid.uuid4().hex[:8]}"
    nonce = uuid.uuid4().hex[:8]
    hint = _hint(src.url, prefix, case, nonce)
    if case.action == "refused":
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        hint["kv_hint"]["source"] = f"127.0.0.1:{port}"
    if case.action in ("evict", "evict_tail"):
        hs = pool_hashes(prefix)
        src.faults(evict_armed=hs if case.action == "evict" else hs[4:])
    if case.transport == "stream":
        src.faults(remote_read=False)
    elif case.transport == "read":  # no granted hold: only ReadAck(held=True) makes reads
        src.faults(read_hold_s=0)  # count, the path these cases break (reads inside a
        # granted hold count without the ack: tests/test_pull.py)
    if case.reply_fault:
        src.faults(reply_fault=case.reply_fault)
    if case.action in ("kill", "stop_mid") or (case.action == "cancel"
                                               and case.transport == "read"):
        src.faults(slow_send_ms=3000)  # before each chunk; for a read, before its ReadAck
    if case.action == "cancel" and case.transport != "read":
        src.faults(freeze_after_reply=True)
    sent0 = src.stats()
    seen = [sent0]  # the source's last stats (a killed source answers no more)

    def source_reached(pred) -> bool:
        st = src.stats(2.0)
        seen[0] = st
        return pred(st)

    result: dict = {}

    def send() -> None:
        t0 = time.perf_counter()
        try:
            result["out"] = dst.generate({"token_ids": prompt, "max_new_tokens": 2,
                                          "request_id": rid, **hint}, timeout=60)
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            result["error"] = exc
        result["wall_s"] = time.perf_counter() - t0

    stopped = False
    th = threading.Thread(target=send, daemon=True)
    try:
        if case.action == "stop_state":
            src.signal(signal.SIGSTOP)
            stopped = True
        th.start()
        if case.action in ("kill", "stop_mid", "cancel"):
            if case.transport == "read":  # the destination read and sent ReadDone
                _wait(lambda: source_reached(
                    lambda st: st["acks_delayed"] > sent0["acks_delayed"]), 10,
                    "the source to receive ReadDone")
            else:  # mid-transfer: the source has pinned the blocks and replied
                _wait(lambda: source_reached(
                    lambda st: st["pins_outstanding"] > 0
                    and st["replies"]["stream"] > sent0["replies"]["stream"]), 10,
                    "the source to pin and reply")
            if case.action == "kill":
                src.signal(signal.SIGKILL)
            elif case.action == "stop_mid":
                src.signal(signal.SIGSTOP)
                stopped = True
            else:
                _wait(lambda: get_json(f"{dst.url}/test/request?id={rid}", timeout=5)["state"]
                      == "CONTEXT_PREFETCH_IN_PROGRESS", 10, "the pull to run")
                assert post_json(f"{dst.url}/test/cancel", {"request_id": rid},
                                 timeout=5)["cancelled"]
        th.join(30)
        assert not th.is_alive(), "the hinted request did not return"
    finally:
        if stopped:
            src.signal(signal.SIGCONT)
        if case.action == "kill":
            src.proc.wait(10)
        if src.proc.poll() is None:
            src.faults(slow_send_ms=0, freeze_after_reply=False, reply_fault=None,
                       evict_armed=[], remote_read=True, read_hold_s=5.0)
            seen[0] = src.stats()
    assert "error" in result or "out" in result
    assert "error" not in result, result.get("error")
    out = result["out"]
    pull = dict(out["pull"])
    pull["detail"] = get_json(f"{dst.url}/test/request?id={out['request_id']}",
                              timeout=5)["detail"] or ""
    observed = pull["reason"]
    fallback_s = pull["phases"].get("total", result["wall_s"])
    rec = dict(what=case.what, expected=case.expect, observed=observed,
               fallback_s=round(fallback_s, 3), request_wall_s=round(result["wall_s"], 3),
               bound_s=case.bound_s, deadline_s=case.timeouts["deadline_s"],
               detail=pull["detail"][:200], used=pull["used"])
    replies = {k: seen[0]["replies"][k] - sent0["replies"][k] for k in ("read", "stream")}
    rec.update(transport=case.transport, replies=replies, reads=pull.get("reads"))
    try:
        assert observed == case.expect, pull
        assert fallback_s <= case.bound_s + SLACK_S, (fallback_s, case.bound_s)
        if case.detail is not None:
            assert case.detail in pull["detail"], pull["detail"]
        if case.transport is not None:  # the source answered with that kind of reply, once
            other = "stream" if case.transport == "read" else "read"
            assert replies == {case.transport: 1, other: 0}, replies
        if case.transport == "stream" or case.read_first is False:
            assert pull["reads"] == 0, pull
        if case.read_first:  # read in full, then refused: nothing of it was committed
            assert pull["reads"] >= 1 and pull["bytes_transferred"] == 8 * BLOCK_BYTES, pull
        if case.expect == "partial":  # best effort kept the head: verify it, then continue
            assert out["fallback"] is None and out["pulled_tokens"] == 4 * T
            hs = pool_hashes(prefix)[:4]
            d, s = dst.digests(hs), src.digests(hs)
            assert all(d[str(h)] == s[str(h)] is not None for h in hs)
            rec["blocks_verified"] = len(hs)
        else:
            # Exactly as without the hint: the cold recompute's tokens and logits bits.
            assert out["fallback"] == case.expect and out["pulled_tokens"] == 0
            assert out["tokens"] == cold["tokens"]
            assert out["logits_sha256"] == cold["logits_sha256"]
            rec["same_as_no_hint"] = True
        leak_dst = dst.wait_clean()
        rec["leaks_dst"] = sum(leak_dst.values())
        assert not any(leak_dst.values()), leak_dst
        if src.proc.poll() is None:
            leak_src = src.wait_clean()
            rec["leaks_src"] = sum(leak_src.values())
            assert not any(leak_src.values()), leak_src
            rec.update(_check_next_request(src, dst, rng))
        else:
            rec["leaks_src"] = None  # the source is gone (killed)
            rec.update(_check_next_request(cluster["S"], dst, rng))
        assert not any(dst.wait_clean().values())
    finally:
        record("faults", case.name, **rec)


@pytest.mark.parametrize("dst_name", ["D1", "D4"], ids=["granted", "direct"])
def test_source_restarted_at_its_address(cluster, record, rng, dst_name):
    """A source restarts at the same address (a new incarnation with new UCX addresses)
    while a destination holds its cached state (one asking for grants, one reading
    directly): the next hinted request falls back naming the restart at once (its
    connection or its read fails), exactly as without the hint, nothing leaked; the
    request after it pulls from the new incarnation."""
    dst = cluster[dst_name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"R": [*COMMON, "--worker-id", "R", "--port", str(port)]}
    old = start_fault_workers(spec)["R"]
    new = None
    reads = "asks for grants" if dst_name == "D1" else "reads directly"
    rec: dict = {"what": f"{dst_name} ({reads}) holds the state of a source that then "
                         "restarts at its address (new incarnation, new UCX addresses)",
                 "expected": "source_incarnation_changed", "bound_s": HINT_T["deadline_s"]}
    try:
        rec.update(_check_next_request(old, dst, rng))  # dst caches the source's state
        old_incarnation = get_json(f"{old.url}/healthz", timeout=5)["incarnation"]
        old.kill()
        new = start_fault_workers(spec)["R"]
        assert new.url == old.url
        assert get_json(f"{new.url}/healthz", timeout=5)["incarnation"] != old_incarnation
        prefix, tail = toks(8 * T, rng), toks(2, rng)
        new.generate({"token_ids": prefix, "max_new_tokens": 0})
        cold = dst.generate({"token_ids": prefix + tail, "max_new_tokens": 2,
                             "use_cache": False})
        hint = {"kv_hint": {"source": new.url, "block_hashes": pool_hashes(prefix),
                            **HINT_T}}
        t0 = time.perf_counter()
        out = dst.generate({"token_ids": prefix + tail, "max_new_tokens": 2, **hint})
        wall = time.perf_counter() - t0
        pull = dict(out["pull"])
        pull["detail"] = get_json(f"{dst.url}/test/request?id={out['request_id']}",
                                  timeout=5)["detail"] or ""
        rec.update(observed=pull["reason"], request_wall_s=round(wall, 3),
                   fallback_s=round(pull["phases"].get("total", wall), 3),
                   leaks_src=None)
        assert pull["reason"] == "source_incarnation_changed", (pull["detail"], pull["phases"])
        assert rec["fallback_s"] < 1.0, rec  # not a connect waiting out its timeout
        assert out["fallback"] == "source_incarnation_changed" and out["pulled_tokens"] == 0
        assert out["tokens"] == cold["tokens"]
        assert out["logits_sha256"] == cold["logits_sha256"]
        rec["same_as_no_hint"] = True
        leak_dst, leak_src = dst.wait_clean(), new.wait_clean()
        rec.update(leaks_dst=sum(leak_dst.values()), leaks_src=sum(leak_src.values()))
        assert not any(leak_dst.values()) and not any(leak_src.values()), (leak_dst, leak_src)
        rec.update(_check_next_request(new, dst, rng))  # from the new incarnation
        assert not any(dst.wait_clean().values())
    finally:
        record("faults", f"source_restarted_at_its_address_{dst_name}", **rec)
        stop_hard(old)
        if new is not None:
            stop_hard(new)
