"""Block-hash schemes: golden values from REFERENCE.md, chaining, normalisation, trtllm-v1."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.cache.hashing import (
    DEFAULT_SCHEME,
    HINT_SCHEME,
    U64_MASK,
    get_scheme,
    known_schemes,
    local_block_hashes,
    normalize_hash,
    normalize_hashes,
    salt_key,
    sequence_hashes,
    trtllm_block_key,
    vllm_block_digests,
    vllm_u64,
)

XXH3 = "public-xxh3-v1"

# Verified against Dynamo 1.6.1 (REFERENCE.md, "Block-hash schemes").
GOLDEN = [
    pytest.param(32, 32, [5756925433886871916], id="tokens0-31_block32"),
    pytest.param(64, 32, [5756925433886871916, 13958166640625465031], id="tokens0-63_block32"),
    pytest.param(
        64,
        16,
        [15310707395893867146, 15292316782987903195, 5532946206955930018, 14928757266181269122],
        id="tokens0-63_block16",
    ),
]


@pytest.mark.parametrize("n_tokens,block_size,expected", GOLDEN)
def test_public_xxh3_golden(n_tokens, block_size, expected):
    assert local_block_hashes(list(range(n_tokens)), block_size, XXH3) == expected


def test_public_second_block_is_position_independent():
    # Dynamo's local hash of block 1 of 0..63 equals the hash of tokens 32..63 on their own.
    assert local_block_hashes(list(range(32, 64)), 32, XXH3) == [13958166640625465031]


@pytest.mark.parametrize("scheme", [XXH3, DEFAULT_SCHEME])
def test_partial_block_never_hashed(scheme):
    assert local_block_hashes(list(range(31)), 32, scheme) == []
    assert local_block_hashes(list(range(63)), 32, scheme) == \
        local_block_hashes(list(range(32)), 32, scheme)
    assert sequence_hashes([], 16, scheme) == []
    assert sequence_hashes(list(range(15)), 16, "trtllm-v1") == []


def _b2(data: bytes, person: bytes) -> int:
    """BLAKE2b-64 as the reference: hashlib, no kvkern code."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(),
                          "little")


def test_the_default_scheme_is_blake2b_and_its_formula():
    assert DEFAULT_SCHEME == "kvkern-blake2b-v1" and HINT_SCHEME == XXH3
    toks = list(range(1000, 1064))
    local = local_block_hashes(toks, 16)
    assert local == [_b2(struct.pack("<16I", *toks[i:i + 16]), b"kvkern-block/v1")
                     for i in range(0, 64, 16)]
    for salt in (None, salt_key("tenant-a")):
        seq = sequence_hashes(toks, 16, cache_salt=salt)
        prev = salt
        for i in range(4):
            want = local[i] if prev is None else _b2(struct.pack("<QQ", prev, local[i]),
                                                     b"kvkern-chain/v1")
            assert seq[i] == want
            prev = want
    assert salt_key("tenant-a") == _b2(b"tenant-a", b"kvkern-salt/v1")
    assert salt_key("") is None and salt_key(None) is None


@pytest.mark.parametrize("scheme", [XXH3, DEFAULT_SCHEME])
def test_sequence_hash_formula(scheme):
    local = local_block_hashes(list(range(64)), 16, scheme)
    seq = sequence_hashes(list(range(64)), 16, scheme)
    assert seq[0] == local[0]
    for i in range(1, 4):
        pair = struct.pack("<QQ", seq[i - 1], local[i])
        want = (xxhash.xxh3_64_intdigest(pair, seed=1337) if scheme == XXH3
                else _b2(pair, b"kvkern-chain/v1"))
        assert seq[i] == want
    assert len(set(seq)) == 4


@pytest.mark.parametrize("scheme", [XXH3, DEFAULT_SCHEME])
def test_chain_continues_from_parent(scheme):
    s = get_scheme(scheme)
    local = local_block_hashes(list(range(64)), 16, scheme)
    full = s.chain(local)
    assert s.chain(local[2:], parent=full[1]) == full[2:]


@pytest.mark.parametrize("scheme", [XXH3, DEFAULT_SCHEME])
def test_chained_hash_depends_on_prefix_local_does_not(scheme):
    a = list(range(32))
    b = [7] * 16 + list(range(16, 32))
    assert local_block_hashes(a, 16, scheme)[1] == local_block_hashes(b, 16, scheme)[1]
    assert sequence_hashes(a, 16, scheme)[1] != sequence_hashes(b, 16, scheme)[1]
    assert sequence_hashes(a, 16, "trtllm-v1")[1] != sequence_hashes(b, 16, "trtllm-v1")[1]


@pytest.mark.parametrize(
    "value,expected",
    [
        pytest.param(0, 0, id="zero"),
        pytest.param(U64_MASK, U64_MASK, id="u64_max"),
        pytest.param(-1, U64_MASK, id="i64_minus1"),
        pytest.param(-(1 << 63), 1 << 63, id="i64_min"),
        pytest.param(1 << 63, 1 << 63, id="u64_high_bit"),
    ],
)
def test_normalize_hash(value, expected):
    assert normalize_hash(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(1 << 64, id="u64_overflow"),
        pytest.param(-(1 << 63) - 1, id="i64_underflow"),
        pytest.param(True, id="bool"),
        pytest.param(1.0, id="float"),
        pytest.param("1", id="str"),
        pytest.param(None, id="none"),
    ],
)
def test_normalize_hash_rejects(value):
    with pytest.raises(ValueError, match="block hash"):
        normalize_hash(value)


def test_normalize_hashes_names_index():
    with pytest.raises(ValueError, match=r"block_hashes\[2\]"):
        normalize_hashes([1, 2, True])


@given(st.integers(min_value=-(1 << 63), max_value=U64_MASK))
@settings(max_examples=200)
def test_i64_bitcast_round_trip(value):
    u = normalize_hash(value)
    assert 0 <= u <= U64_MASK
    assert struct.pack("<Q", u) == (
        struct.pack("<q", value) if value < 0 else struct.pack("<Q", value)
    )


def test_chain_accepts_i64_spelling():
    local = local_block_hashes(list(range(64)), 16)
    signed = [h - (1 << 64) if h >= 1 << 63 else h for h in local]
    assert any(h < 0 for h in signed)
    scheme = get_scheme("public-xxh3-v1")
    assert scheme.chain(signed) == scheme.chain(local)


def _ref_trtllm_block(tokens, parent, salt=None, lora=None):
    """A line-by-line transcription of TRT-LLM's own C++ (``hash32Mix``, ``hash64Mix`` and
    ``EventManager::hashV1BlockKey``, the same as ``BlockKeyHasher::hash`` of a block with
    a cache salt id): C++ unsigned arithmetic as explicit masks."""
    u32, u64 = (1 << 32) - 1, (1 << 64) - 1

    def hash32_mix(value, seed):
        value &= u32
        value = (((value >> 16) ^ value) * 0x045D9F3B) & u32
        value = (((value >> 16) ^ value) * 0x045D9F3B) & u32
        value = (value >> 16) ^ value
        value = (value + 0x9E3779B9) & u32
        return seed ^ ((value + ((seed << 6) & u64) + (seed >> 2)) & u64)

    def hash64_mix(value, seed):
        value &= u64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & u64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & u64
        value ^= value >> 31
        return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & u64) + (seed >> 2)) & u64)

    seed = (len(tokens) ^ ((parent * 0xBF58476D1CE4E5B9) & u64)) & u64
    if parent == 0 and salt is not None:
        seed = hash64_mix(salt, seed)
    for token in tokens:
        seed = hash32_mix(token, seed)
    if lora is not None:
        seed = hash64_mix(lora, seed)
    return seed


def test_trtllm_matches_formula_and_chains_through_parent():
    tokens = [3, 70000, 2**32 - 1, 0, 12345, 99, 5, 6]
    keys = sequence_hashes(tokens, 4, "trtllm-v1")
    k0 = _ref_trtllm_block(tokens[:4], 0)
    k1 = _ref_trtllm_block(tokens[4:], k0)
    assert keys == [k0, k1]
    assert trtllm_block_key(tokens[4:], k0) == k1
    # trtllm-v1 has no unchained form: local_block_hashes returns the chained keys.
    assert local_block_hashes(tokens, 4, "trtllm-v1") == keys
    assert get_scheme("trtllm-v1").chain(keys) == keys
    assert get_scheme("trtllm-v1").chained and not get_scheme("public-xxh3-v1").chained


def test_trtllm_salt_changes_root_and_therefore_every_key():
    tokens = list(range(48))
    plain = sequence_hashes(tokens, 16, "trtllm-v1")
    salted = sequence_hashes(tokens, 16, "trtllm-v1", cache_salt=42)
    other = sequence_hashes(tokens, 16, "trtllm-v1", cache_salt=43)
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert salted != other
    assert salted[0] == _ref_trtllm_block(tokens[:16], 0, salt=42)
    # Salt only enters the root block's own mix; later blocks inherit it through the parent.
    assert salted[1] == _ref_trtllm_block(tokens[16:32], salted[0])


def test_trtllm_lora_changes_every_key():
    tokens = list(range(32))
    plain = sequence_hashes(tokens, 16, "trtllm-v1")
    lora = sequence_hashes(tokens, 16, "trtllm-v1", lora_id=7)
    assert all(a != b for a, b in zip(plain, lora, strict=True))
    assert lora[1] == _ref_trtllm_block(tokens[16:], lora[0], lora=7)


def test_trtllm_salt_id_is_trtllms_own():
    """trtllm-v1 derives a salt string's id as TRT-LLM's request handling does (the first 8
    bytes of its BLAKE3 digest, little-endian); kvkern's own schemes keep salt_key; no salt
    and the empty string are no salt in both."""
    from blake3 import blake3

    trt = get_scheme("trtllm-v1")
    assert trt.salt_id("tenant-a") == int.from_bytes(blake3(b"tenant-a").digest()[:8], "little")
    assert trt.salt_id("") is None and trt.salt_id(None) is None
    assert get_scheme("public-xxh3-v1").salt_id("tenant-a") == salt_key("tenant-a")
    assert get_scheme("kvkern-blake2b-v1").salt_id("tenant-a") == salt_key("tenant-a")


def test_trtllm_salt_enters_before_the_tokens_and_lora_after():
    """TRT-LLM mixes a root block's cache salt id into the seed before its tokens and the
    LoRA id after them; a salt of 0 and a LoRA id of 0 count (C++ optionals that hold 0)."""
    tokens = [5, 2**31 + 7, 0, 65535]
    for salt, lora in ((42, None), (42, 9), (0, None), (None, 0), (2**64 - 1, 2**64 - 1)):
        got = sequence_hashes(tokens, 4, "trtllm-v1", cache_salt=salt, lora_id=lora)
        assert got == [_ref_trtllm_block(tokens, 0, salt=salt, lora=lora)], (salt, lora)
    assert sequence_hashes(tokens, 4, "trtllm-v1", cache_salt=0) != \
        sequence_hashes(tokens, 4, "trtllm-v1")


def test_public_scheme_refuses_salt_and_lora():
    with pytest.raises(ValueError, match="cache_salt"):
        local_block_hashes(list(range(32)), 16, cache_salt=1)
    with pytest.raises(ValueError, match="lora_id=3"):
        sequence_hashes(list(range(32)), 16, lora_id=3)


def test_unknown_scheme_lists_known():
    with pytest.raises(ValueError, match="kvkern-blake2b-v1.*public-xxh3-v1.*trtllm-v1"):
        local_block_hashes([1, 2], 1, "vllm-sha1")
    assert known_schemes() == ("kvkern-blake2b-v1", "public-xxh3-v1", "trtllm-v1",
                               "vllm-sha256-cbor-v1", "vllm-sha256-v1")


# Values computed by vLLM 0.32's own ``hash_block_tokens`` (sha256 over pickle, NONE_HASH from
# the default seed), reduced as vLLM's ``maybe_convert_block_hash`` does for its KV events.
VLLM_TOKENS_0_63_BS32 = [13907755898995373680, 17701127471491950661]
VLLM_SALTED_TENANT_A = [17050038076495021658, 566515669255957052]


def test_vllm_scheme_matches_vllm():
    assert sequence_hashes(list(range(64)), 32, "vllm-sha256-v1") == VLLM_TOKENS_0_63_BS32
    digests = vllm_block_digests(list(range(64)), 32, cache_salt="tenant-a")
    assert [vllm_u64(d) for d in digests] == VLLM_SALTED_TENANT_A
    # chained: the second block's hash depends on the first
    other = sequence_hashes([1] + list(range(1, 64)), 32, "vllm-sha256-v1")
    assert other[1] != VLLM_TOKENS_0_63_BS32[1]
    # the trailing partial block is never hashed
    assert sequence_hashes(list(range(95)), 32, "vllm-sha256-v1")[:2] == VLLM_TOKENS_0_63_BS32


def test_vllm_scheme_takes_no_u64_salt():
    with pytest.raises(ValueError, match="salt string"):
        sequence_hashes(list(range(64)), 32, "vllm-sha256-v1", cache_salt=5)
    with pytest.raises(ValueError, match="at least 8"):
        vllm_u64(b"abc")


@pytest.mark.parametrize("scheme", ["public-xxh3-v1", "trtllm-v1", "vllm-sha256-v1"])
@pytest.mark.parametrize(
    "tokens,match",
    [
        pytest.param([1, -1], r"token_ids\[1\] = -1", id="negative"),
        pytest.param([1, 2**32], r"token_ids\[1\]", id="overflow"),
        pytest.param([True, 1], r"token_ids\[0\]", id="bool"),
    ],
)
def test_bad_tokens_raise(scheme, tokens, match):
    with pytest.raises(ValueError, match=match):
        local_block_hashes(tokens, 2, scheme)


@pytest.mark.parametrize("block_size", [0, -4, True, 2.0])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        local_block_hashes([1, 2, 3, 4], block_size)


def _runnable_schemes() -> list[str]:
    """Every scheme whose serialiser is installed (the cbor one needs cbor2)."""
    try:
        import cbor2  # noqa: F401
    except ImportError:
        return [s for s in known_schemes() if s != "vllm-sha256-cbor-v1"]
    return list(known_schemes())


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 16))
@settings(max_examples=60, deadline=None)
def test_prefix_property(tokens, block_size):
    """Hashes of a prefix are a prefix of the hashes (every scheme, both forms)."""
    cut = len(tokens) // 2
    for scheme in _runnable_schemes():
        full = sequence_hashes(tokens, block_size, scheme)
        part = sequence_hashes(tokens[:cut], block_size, scheme)
        assert full[: len(part)] == part
        assert len(full) == len(tokens) // block_size
        assert all(0 <= h <= U64_MASK for h in full)
