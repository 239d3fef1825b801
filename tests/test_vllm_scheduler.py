"""The vLLM connector's scheduler half (:class:`kvkern.integrations.vllm.scheduler.SchedulerSide`)
on stand-ins for vLLM's request and block objects: the admission, the loads it hands the
worker half, and the rules that keep vLLM from waiting forever. No vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

from kvkern.cache.hashing import DEFAULT_SCHEME, salt_key, sequence_hashes, vllm_block_digests
from kvkern.integrations.vllm.blocks import VllmBlocks
from kvkern.integrations.vllm.config import ConnectorConfig
from kvkern.integrations.vllm.runtime import EngineFacts, EngineRuntime
from kvkern.integrations.vllm.scheduler import LoadMetadataBase, SchedulerSide
from kvkern.xfer.auth import sign_hint
from kvkern.xfer.hints import decode_hint
from tests.fleet import CREDENTIAL

BS = 32
TOKENS = list(range(100, 100 + 5 * BS + 7))  # 5 full blocks and a partial one


def side(**config) -> SchedulerSide:
    facts = EngineFacts(engine_id="e", block_size=BS, hash_scheme="vllm-sha256-v1",
                        model_id="m", head_dim=64)
    rt = EngineRuntime(facts=facts, config=ConnectorConfig(**config),
                       blocks=VllmBlocks(block_size=BS, hash_scheme=facts.hash_scheme),
                       credential=CREDENTIAL)
    return SchedulerSide(rt)


def request(rid: str = "r", *, sign: bool = True, params: dict | None = None,
            salt: str | None = None):
    params = dict(params if params is not None else {"kv_hint": {"source": "127.0.0.1:9"}})
    if sign:
        body = {**params, "kv_transfer_params": params}  # as the connector reads it
        params.update(sign_hint(CREDENTIAL, decode_hint(body), TOKENS, cache_salt=salt or ""))
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, kv_transfer_params=params,
                           kv_hints=None, cache_salt=salt, num_computed_tokens=0,
                           block_hashes=vllm_block_digests(TOKENS, BS, cache_salt=salt))


def blocks(ids: list[int]):
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def counter(s: SchedulerSide, name: str) -> float:
    return sum(x.value for m in s.rt.metrics.registry.collect() for x in m.samples
               if x.name == name)


def test_a_hinted_request_loads_the_tail_into_the_blocks_vllm_allocated():
    s, req = side(), request()
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, True)  # 5 full, 2 local
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, True)  # no side effect
    s.update_state_after_alloc(req, blocks([7, 8, 40, 41, 42]), 3 * BS)
    meta = s.build_connector_meta(LoadMetadataBase, scheduled_tokens=0)
    (load,) = meta.loads
    assert meta.idle and load.block_ids == (40, 41, 42)
    assert (load.admitted.local, load.admitted.count) == (2, 3)
    assert s.build_connector_meta(LoadMetadataBase, scheduled_tokens=5).loads == []
    assert s.request_finished(req) == (True, None)  # aborted mid-pull: blocks kept
    s.update_connector_output(SimpleNamespace(finished_recving={"r"}))
    assert s.request_finished(req) == (False, None)


def test_a_request_is_pulled_for_once():
    s, req = side(), request()
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 5 * BS)
    s.update_connector_output(SimpleNamespace(finished_recving={"r"}))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # after a failed load: recompute


def test_fewer_tokens_taken_pull_fewer_blocks():
    s, req = side(), request()
    assert s.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    s.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 2 * BS)
    (load,) = s.build_connector_meta(LoadMetadataBase, 0).loads
    assert load.block_ids == (1, 2) and load.admitted.count == 2


def test_a_load_that_cannot_start_is_still_reported():
    s, req = side(), request()
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, blocks([1, 2]), 5 * BS)  # fewer blocks than the tail
    (load,) = s.build_connector_meta(LoadMetadataBase, 0).loads
    assert load.admitted is None and load.block_ids == (1, 2)  # the worker fails it at once


def test_a_load_vllm_waits_for_without_a_pull_fails_only_the_external_blocks():
    """vLLM holding a request for external tokens the connector did not offer (no admitted
    pull): the load is reported failed for the blocks of those tokens only, never for the
    local prefix hit before them, which other requests share."""
    s, req = side(), request()
    s.update_state_after_alloc(req, blocks([7, 8, 40, 41, 42]), 3 * BS)
    (load,) = s.build_connector_meta(LoadMetadataBase, 0).loads
    assert load.admitted is None and load.block_ids == (40, 41, 42)


def test_unsigned_wrong_and_missing_hints_load_nothing():
    s = side()
    assert s.get_num_new_matched_tokens(request("u", sign=False), 0) == (0, False)
    assert counter(s, "kvkern_fallbacks_total") == 1
    wrong = {"router_hint": {"source_control_endpoint": "tcp://127.0.0.1:9",
                             "block_hashes": [1, 2, 3]}}
    assert s.get_num_new_matched_tokens(request("w", params=wrong), 0) == (0, False)
    plain = request("p", sign=False, params={"something": "else"})
    assert s.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert counter(s, "kvkern_hints_received_total") == 2  # no hint is not a hint
    assert side(trust_unsigned_hints=True).get_num_new_matched_tokens(
        request("t", sign=False), 0) == (5 * BS, True)


def test_a_hint_that_makes_admission_raise_leaves_the_request_unhinted(monkeypatch):
    """The scheduler half runs inside vLLM's ``schedule()``, where an exception ends the
    engine: whatever a request's hint makes admission raise is logged, counted as
    ``internal_error`` and the request runs as if unhinted."""
    from kvkern.integrations.vllm import scheduler

    s = side()
    huge = {"kv_hint": {"source": "127.0.0.1:9"},
            "kvkern_hint_auth": {"v": 1, "exp": 10 ** 400, "by": "x", "mac": "00"}}
    assert s.get_num_new_matched_tokens(request("huge", sign=False, params=huge), 0) == (
        0, False)

    def broken(*_a, **_k):
        raise OverflowError("integer division result too large for a float")

    monkeypatch.setattr(scheduler, "check_hint", broken)
    assert s.get_num_new_matched_tokens(request("raises"), 0) == (0, False)
    assert counter(s, "kvkern_fallbacks_total") == 2
    assert sum(x.value for m in s.rt.metrics.registry.collect() for x in m.samples
               if x.labels.get("reason") == "internal_error") >= 1
    monkeypatch.undo()
    assert s.get_num_new_matched_tokens(request("fine"), 0) == (5 * BS, True)


def test_a_salted_router_hint_in_another_scheme_is_checked_under_the_requests_salt():
    """A router that hashes in its own scheme salts a tenant's hashes; the scheduler checks
    them under the request's cache salt and pulls vLLM's own (salted) block hashes."""
    salted = sequence_hashes(TOKENS[:5 * BS], BS, DEFAULT_SCHEME, cache_salt=salt_key("t"))
    hint = {"kv_hint": {"source": "127.0.0.1:9", "block_hashes": salted[:4],
                        "hash_scheme": DEFAULT_SCHEME}}
    s = side()
    assert s.get_num_new_matched_tokens(request("a", params=hint, salt="t"), 0) == (4 * BS, True)
    plain = side()  # the same hashes for a request without that salt name another prompt
    assert plain.get_num_new_matched_tokens(request("b", params=hint), 0) == (0, False)
