"""Admission as a pure function (:func:`kvkern.xfer.admission.admit`): tokens, hint, local
prefix and configuration in, a pull or a named skip out. No network, no pool, no loop."""

from __future__ import annotations

import pytest
from blake3 import blake3

from kvkern.cache.hashing import (
    DEFAULT_SCHEME,
    HINT_SCHEME,
    get_scheme,
    salt_key,
    sequence_hashes,
)
from kvkern.xfer.admission import Admitted, Skip, WorkerFacts, admit, read_hint
from kvkern.xfer.config import XferConfig
from kvkern.xfer.hints import HintLimits, HintRejected, KvHint
from kvkern.xfer.outcome import Reason
from kvkern.xfer.policy import CostGuard

BS = 4
TOKENS = list(range(1, 4 * BS + 3))  # 4 full blocks and a partial one
CONFIG = XferConfig(allowlist="127.0.0.1", cost_guard=False)


def worker(local: int = 0, scheme: str = DEFAULT_SCHEME) -> WorkerFacts:
    return WorkerFacts(block_size=BS, hash_scheme=scheme, bytes_per_block=1024,
                       longest_prefix=lambda hashes: min(local, len(hashes)))


def hint(**kw) -> KvHint:
    fields = dict(source="http://127.0.0.1:1/kvkern/v1/state", block_hashes=None,
                  hash_scheme=None, dialect="kvkern")
    fields.update(kw)
    return KvHint(**fields)


def run(h: KvHint, *, local: int = 0, config: XferConfig = CONFIG, salt: str = "",
        tokens=TOKENS) -> Admitted | Skip:
    return admit(tokens, h, worker=worker(local), config=config,
                 cost_guard=CostGuard(config), cache_salt=salt)


def test_a_hint_without_hashes_covers_every_full_block():
    got = run(hint(), local=1)
    assert isinstance(got, Admitted)
    assert (got.hinted, got.local, got.count) == (4, 1, 3)
    assert got.chained == sequence_hashes(TOKENS[:4 * BS], BS, DEFAULT_SCHEME)
    assert got.base["blocks_hinted"] == 4 and got.base["blocks_local"] == 1


@pytest.mark.parametrize("scheme_name", [HINT_SCHEME, DEFAULT_SCHEME])
@pytest.mark.parametrize("chained", [False, True], ids=["per-block", "chained"])
def test_hint_hashes_that_name_the_prompt_are_admitted(chained, scheme_name):
    """Hashes without a hash_scheme: Dynamo's (the hints' default) or the worker's own."""
    scheme = get_scheme(scheme_name)
    mine = scheme.block_hashes(TOKENS[:3 * BS], BS)
    hashes = scheme.salted_chain(mine, None) if chained else mine
    got = run(hint(block_hashes=tuple(hashes)))
    assert isinstance(got, Admitted) and got.hinted == 3
    assert got.chained == sequence_hashes(TOKENS[:3 * BS], BS, DEFAULT_SCHEME)


def test_hashes_of_another_prompt_are_a_hash_mismatch():
    scheme = get_scheme(HINT_SCHEME)
    other = scheme.block_hashes([t + 1 for t in TOKENS[:2 * BS]], BS)
    got = run(hint(block_hashes=tuple(other)))
    assert isinstance(got, Skip) and got.reason is Reason.HASH_MISMATCH
    assert "hint hash 0" in got.detail


def test_more_hinted_blocks_than_the_prompt_has_is_a_hash_mismatch():
    got = run(hint(block_hashes=tuple(range(1, 7))))
    assert isinstance(got, Skip) and got.reason is Reason.HASH_MISMATCH


def test_unknown_hash_scheme_is_named():
    got = run(hint(block_hashes=(1,), hash_scheme="no-such-scheme"))
    assert isinstance(got, Skip) and got.reason is Reason.HASH_SCHEME_MISMATCH


@pytest.mark.parametrize("worker_scheme,named", [
    (DEFAULT_SCHEME, "vllm-sha256-v1"), ("vllm-sha256-v1", None)],
    ids=["vllm-hint", "vllm-worker"])
def test_a_salted_prompt_is_never_hashed_here_in_an_engine_scheme_that_salts_itself(
        worker_scheme, named):
    """vLLM's schemes take the salt inside the engine: a salted request's hint in one (or a
    router's hashes that do not match, on a vLLM-scheme worker, which would try it next) is
    a named skip, never an exception out of admission."""
    h = hint(block_hashes=(1, 2), hash_scheme=named)
    got = admit(TOKENS, h, worker=worker(scheme=worker_scheme), config=CONFIG,
                cost_guard=CostGuard(CONFIG), cache_salt="tenant-a")
    assert isinstance(got, Skip), got
    assert got.reason in (Reason.HASH_SCHEME_MISMATCH, Reason.HASH_MISMATCH), got


def test_a_prompt_without_a_full_block_needs_no_pull():
    got = run(hint(), tokens=TOKENS[:BS - 1])
    assert isinstance(got, Skip) and got.reason is Reason.LOCAL_PREFIX_SUFFICIENT


def test_everything_cached_here_needs_no_pull():
    got = run(hint(), local=4)
    assert isinstance(got, Skip) and got.reason is Reason.LOCAL_PREFIX_SUFFICIENT
    assert got.fields == {"blocks_hinted": 4, "blocks_local": 4}


def test_the_cost_guard_skips_pulls_not_worth_it():
    config = XferConfig(allowlist="127.0.0.1", cost_guard=True, min_blocks=8)
    got = run(hint(), config=config)
    assert isinstance(got, Skip) and got.reason is Reason.NOT_WORTH_IT


def test_a_cache_salt_changes_every_hash_asked_for():
    plain, salted = run(hint()), run(hint(), salt="tenant-a")
    assert isinstance(plain, Admitted) and isinstance(salted, Admitted)
    assert not set(plain.chained) & set(salted.chained)


def test_hint_timeouts_are_capped_by_the_config():
    got = run(hint(deadline_s=1e9, metadata_timeout_s=0.5))
    assert isinstance(got, Admitted)
    md, _, deadline = got.timeouts
    assert md == 0.5 and deadline == CONFIG.max_deadline_s


def test_missing_and_rejected_hints_are_named_skips():
    limits = HintLimits()
    none = read_hint(None, limits)
    assert isinstance(none, Skip) and none.reason is Reason.NO_HINT
    bad = read_hint(HintRejected(reason="bad_field", detail="x", dialect="kvkern"), limits)
    assert isinstance(bad, Skip) and bad.reason is Reason.HINT_INVALID
    assert bad.fields == {"dialect": "kvkern"}
    decoded = read_hint({"kv_hint": {"source": "http://127.0.0.1:1/kvkern/v1/state"}}, limits)
    assert isinstance(decoded, KvHint)
    with pytest.raises(TypeError):
        read_hint(42, limits)


def test_engine_scheme_hints_are_checked_in_the_workers_scheme():
    """Dynamo's dialects carry the engine's own block hashes: a TRT-LLM worker checks them as
    TRT-LLM block keys, not as the router's XXH3 hashes."""
    keys = sequence_hashes(TOKENS[:3 * BS], BS, "trtllm-v1")
    facts = worker(scheme="trtllm-v1")
    got = admit(TOKENS, hint(block_hashes=tuple(keys), hash_scheme="engine", dialect="dynamo"),
                worker=facts, config=CONFIG, cost_guard=CostGuard(CONFIG))
    assert isinstance(got, Admitted) and got.hinted == 3 and got.chained == keys
    xxh3 = sequence_hashes(TOKENS[:3 * BS], BS, DEFAULT_SCHEME)
    got = admit(TOKENS, hint(block_hashes=tuple(xxh3), hash_scheme="engine", dialect="dynamo"),
                worker=facts, config=CONFIG, cost_guard=CostGuard(CONFIG))
    assert isinstance(got, Skip) and got.reason is Reason.HASH_MISMATCH


def _engine(h: KvHint, engine: list[int], *, local: int = 0, max_blocks: int | None = None):
    return admit(TOKENS, h, worker=worker(local, scheme="vllm-sha256-v1"), config=CONFIG,
                 cost_guard=CostGuard(CONFIG), engine_hashes=engine, max_blocks=max_blocks)


def test_engine_hashes_are_used_as_given():
    """An engine that hashes its own requests (vLLM: salted, with LoRA and multimodal keys)
    passes its hashes; they are compared with the hint and sent to the source unchanged."""
    engine = [11, 22, 33, 44]
    got = _engine(hint(block_hashes=(11, 22, 33), hash_scheme="engine"), engine, local=1)
    assert isinstance(got, Admitted)
    assert (got.hinted, got.local, got.chained) == (3, 1, [11, 22, 33])
    got = _engine(hint(), engine, max_blocks=2)  # no hashes: every full block, capped
    assert isinstance(got, Admitted) and got.chained == [11, 22]
    bad = _engine(hint(block_hashes=(11, 99), hash_scheme="engine"), engine)
    assert isinstance(bad, Skip) and bad.reason is Reason.HASH_MISMATCH
    assert "hint hash 1 is 99" in bad.detail
    long = _engine(hint(block_hashes=(11, 22, 33, 44, 55), hash_scheme="engine"), engine)
    assert isinstance(long, Skip) and long.reason is Reason.HASH_MISMATCH
    nothing = _engine(hint(), engine, max_blocks=0)
    assert isinstance(nothing, Skip) and nothing.reason is Reason.LOCAL_PREFIX_SUFFICIENT


def test_a_hint_in_another_scheme_is_checked_on_the_tokens_and_the_engine_hashes_pulled():
    """A router hashing in its own scheme names the prompt in that scheme: with the engine's
    hashes given, the hint is checked against the tokens in the hint's scheme, and the pull
    asks for the engine's hashes (never the router's)."""
    engine = [11, 22, 33, 44]
    router = sequence_hashes(TOKENS[:2 * BS], BS, "trtllm-v1")
    got = _engine(hint(block_hashes=tuple(router), hash_scheme="trtllm-v1"), engine)
    assert isinstance(got, Admitted) and (got.hinted, got.chained) == (2, [11, 22])
    wrong = _engine(hint(block_hashes=(router[0], router[1] ^ 1), hash_scheme="trtllm-v1"),
                    engine)
    assert isinstance(wrong, Skip) and wrong.reason is Reason.HASH_MISMATCH
    assert "hint hash 1" in wrong.detail
    unknown = _engine(hint(block_hashes=(11,), hash_scheme="no-such-scheme"), engine)
    assert isinstance(unknown, Skip) and unknown.reason is Reason.HASH_SCHEME_MISMATCH
    # a TRT-LLM router salts with TRT-LLM's own id of the salt string (BLAKE3), not kvkern's
    trt_id = int.from_bytes(blake3(b"t").digest(length=8), "little")
    salted = sequence_hashes(TOKENS[:2 * BS], BS, "trtllm-v1", cache_salt=trt_id)
    got = admit(TOKENS, hint(block_hashes=tuple(salted), hash_scheme="trtllm-v1"),
                worker=worker(scheme="vllm-sha256-v1"), config=CONFIG,
                cost_guard=CostGuard(CONFIG), cache_salt="t", engine_hashes=engine)
    assert isinstance(got, Admitted) and got.chained == [11, 22]
    ours = sequence_hashes(TOKENS[:2 * BS], BS, "trtllm-v1", cache_salt=salt_key("t"))
    other = admit(TOKENS, hint(block_hashes=tuple(ours), hash_scheme="trtllm-v1"),
                  worker=worker(scheme="vllm-sha256-v1"), config=CONFIG,
                  cost_guard=CostGuard(CONFIG), cache_salt="t", engine_hashes=engine)
    assert isinstance(other, Skip) and other.reason is Reason.HASH_MISMATCH
