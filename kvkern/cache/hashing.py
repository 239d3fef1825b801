"""Block-hash schemes, selected by name.

A request's tokens are split into full blocks of ``block_size`` tokens; the trailing partial
block is never hashed (no serving engine transfers it; it is always recomputed)::

    tokens     |<- block 0 ->|<- block 1 ->|<- block 2 ->|<- partial ->|
    block hash      b0            b1            b2          (none)
    chained         c0 = b0       c1 = H(c0,b1) c2 = H(c1,b2)

Two forms exist for every scheme:

* ``block_hashes`` / :func:`local_block_hashes`: what the scheme computes per block.
* ``chain`` / :func:`sequence_hashes`: the chained form, where hash ``i`` names the whole
  prefix ``tokens[: (i + 1) * block_size]``. The prefix index of the reference pool keys on it,
  so one dict lookup per block answers "is this prefix cached".

Schemes
-------
``kvkern-blake2b-v1`` (the default for pools)
    The structure of ``public-xxh3-v1`` below, with BLAKE2b (8-byte digests) in place of
    XXH3-64: a block's local hash is ``BLAKE2b-64(le32 tokens, person="kvkern-block/v1")``,
    chained ``c[i] = BLAKE2b-64(le64(c[i-1]) || le64(b[i]), person="kvkern-chain/v1")`` from
    the cache salt as root parent (none: ``c[0] = b[0]``). A pool keys cached KV on these
    hashes alone, so a prompt whose blocks hash like another's would be served that other's
    KV: XXH3 is built for speed, and blocks of real token ids that hash like a chosen block
    can be computed (a few seconds for a 16-token block), which lets anyone who can send a
    prompt plant KV under a prefix others use. Finding such a block for BLAKE2b-64 takes
    about 2**64 hashes.

``public-xxh3-v1``
    Dynamo's router hash. Local hash of a block: XXH3-64 over its token ids as 4-byte
    little-endian unsigned integers, seed 1337; it does **not** depend on earlier blocks.
    Chained (Dynamo's "sequence hash"): ``c[0] = b[0]``,
    ``c[i] = XXH3-64(le64(c[i-1]) || le64(b[i]), seed=1337)``.
    Its local hashes take no cache salt and no LoRA id (passing one raises: silently ignoring
    it would make hashes of different adapters collide). The chained form takes a cache salt
    as the chain's root parent (a kvkern extension; Dynamo's router chains from no parent)::

        c[0] = XXH3-64(le64(salt) || le64(b[0]), seed=1337),  then as above

    What routers send in hints (``HINT_SCHEME``), and fit to name prefixes for routing; a
    pool that serves many clients keys its KV on ``kvkern-blake2b-v1`` instead.

``vllm-sha256-v1`` / ``vllm-sha256-cbor-v1``
    vLLM v1's prefix-cache block hash with ``prefix_caching_hash_algo`` ``sha256`` (pickle,
    vLLM's default) or ``sha256_cbor``: a 32-byte digest chained through its parent::

        NONE_HASH = H(seed)                 # seed "vllm-none-hash" unless PYTHONHASHSEED
        d[i] = H((d[i-1] or NONE_HASH, tuple(block_tokens), extra_keys))

    ``extra_keys`` is ``None``, or ``(("cache_salt", salt),)`` on the root block of a salted
    request (vLLM's own salt string, not a u64). As a kvkern u64 a digest is its low 64
    bits, ``int.from_bytes(d, "big") & (2**64 - 1)``: what vLLM publishes in its KV events and
    Dynamo routes on. :func:`vllm_block_digests` gives the digests themselves. LoRA and
    multimodal extra keys are not reproduced: an engine passes its own hashes instead
    (``kvkern.integrations.vllm`` does).

``cache_salt`` (the BLAKE2b, xxh3 and TRT-LLM schemes) is a u64; :func:`salt_key` maps a
request's salt string (vLLM's ``cache_salt``) to one. Tenants with different salts share no
chained hash, so neither a prefix-index hit nor a pull crosses between them.

``trtllm-v1``
    TRT-LLM V1's ``BlockKeyHasher``. It is chained by construction (the parent hash seeds each
    block), so it has no per-block "local" hash: ``block_hashes`` returns the chained block
    keys and ``chain`` is the identity on them (it only normalises). For a block with ``n``
    tokens and parent hash ``p`` (0 at the root), all arithmetic mod 2**64::

        seed = n ^ (p * 0xbf58476d1ce4e5b9)
        root block only, if given: seed = mix64(cache salt id, seed)
        for t in tokens:                      # t as uint32
            a = ((t >> 16) ^ t) * 0x45d9f3b    (mod 2**32)
            a = ((a >> 16) ^ a) * 0x45d9f3b    (mod 2**32)
            a = (a >> 16) ^ a
            seed ^= ((a + 0x9e3779b9) mod 2**32) + (seed << 6) + (seed >> 2)
        if given: seed = mix64(LoRA task id, seed)

    where ``mix64(x, seed)`` is ``seed ^ (m(x) + 0x9e3779b9 + (seed << 6) + (seed >> 2))`` with
    ``m`` the splitmix64 finaliser, as TRT-LLM's ``hash64Mix``: the salt enters before the
    tokens, the LoRA id after them. ``cache_salt`` is TRT-LLM's cache salt id, which the
    scheme derives from a request's salt string as TRT-LLM does (``salt_id``:
    :func:`trtllm_salt_id`, BLAKE3); builds of TRT-LLM that mix ``std::hash`` of the string
    instead match only unsalted requests.

    ``a + 0x9e3779b9`` wraps at 32 bits because in the C++ source both operands are 32-bit
    unsigned; the sum is widened only when added to the 64-bit ``seed << 6``. LoRA and salt
    values are 64-bit, so their sum does not wrap at 32 bits.

Hashes are u64 everywhere in kvkern. Engines that report i64 bit-casts are normalised with
:func:`normalize_hash` (``-1 -> 2**64 - 1``); anything outside ``[-2**63, 2**64)`` or a bool is
rejected.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "DEFAULT_SCHEME",
    "HINT_SCHEME",
    "HashScheme",
    "U64_MASK",
    "get_scheme",
    "salt_key",
    "trtllm_salt_id",
    "known_schemes",
    "local_block_hashes",
    "normalize_hash",
    "normalize_hashes",
    "sequence_hashes",
    "vllm_block_digests",
    "vllm_u64",
]

U64_MASK = (1 << 64) - 1
_U32_MASK = (1 << 32) - 1
DEFAULT_SCHEME = "kvkern-blake2b-v1"  # a pool's, unless its engine hashes otherwise
HINT_SCHEME = "public-xxh3-v1"  # a hint's block_hashes without a hash_scheme (Dynamo's)
DYNAMO_SEED = 1337
_PAIR = struct.Struct("<QQ")  # (parent, block) hash pair of the xxh3 chain


def normalize_hash(value: int) -> int:
    """Return ``value`` as a u64: i64 bit-casts (``-2**63 <= value < 0``) wrap to their u64
    twin; ``0 <= value < 2**64`` is returned as is; bools and anything else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"block hash must be an int, got {type(value).__name__} {value!r}")
    if 0 <= value <= U64_MASK:
        return value
    if -(1 << 63) <= value < 0:
        return value & U64_MASK
    raise ValueError(f"block hash {value} outside u64 [0, 2**64) and i64 [-2**63, 0)")


def normalize_hashes(values: Sequence[int]) -> list[int]:
    """:func:`normalize_hash` over a sequence; the error names the offending index."""
    vals = list(values)
    # Fast path, in C loops: plain ints already in u64 range (what every caller has once
    # the wire decoder or a scheme produced them) come back as a new list, unchanged.
    if not vals or (set(map(type, vals)) == {int} and min(vals) >= 0
                    and max(vals) <= U64_MASK):
        return vals
    out = []
    for i, v in enumerate(vals):
        try:
            out.append(normalize_hash(v))
        except ValueError as exc:
            raise ValueError(f"block_hashes[{i}]: {exc}") from None
    return out


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _token_bytes(token_ids: Sequence[int], n: int) -> bytes:
    """The first ``n`` token ids as little-endian u32; ValueError naming the bad token.

    Ints and anything with ``__index__`` (numpy integers) are accepted; bools are not."""
    toks = token_ids[:n]
    try:
        data = struct.pack(f"<{n}I", *toks)
    except struct.error:
        data = None
    if data is not None and bool not in set(map(type, toks)):  # (C loops: ~4x a genexpr)
        return data
    for i, t in enumerate(toks):
        try:
            ok = not isinstance(t, bool) and 0 <= operator.index(t) <= _U32_MASK
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"token_ids[{i}] = {t!r} is not a u32 token id in [0, 2**32)")
    raise ValueError(f"token_ids could not be packed as {n} u32 values")

# ------------------------------------------- public-xxh3-v1 and kvkern-blake2b-v1 (one shape)

Digest = Callable[[bytes | memoryview], int]  # bytes -> u64


def _per_block(name: str, digest: Digest) -> Callable[..., list[int]]:
    """The local hashes of an unchained scheme: ``digest`` of each full block's tokens as
    little-endian u32; no salt or LoRA id per block (a salt enters the chain)."""

    def block_hashes(token_ids: Sequence[int], block_size: int, *, cache_salt: int | None,
                     lora_id: int | None) -> list[int]:
        if cache_salt is not None or lora_id is not None:
            raise ValueError(
                f"scheme {name!r} takes no cache_salt or lora_id per block (a salt enters "
                f"its chain; got cache_salt={cache_salt!r}, lora_id={lora_id!r})"
            )
        n_full = len(token_ids) // block_size
        data = _token_bytes(token_ids, n_full * block_size)
        step = 4 * block_size
        view = memoryview(data)
        return [digest(view[i : i + step]) for i in range(0, n_full * step, step)]

    return block_hashes


def _pair_chain(digest: Digest) -> Callable[[Sequence[int], int | None], list[int]]:
    """``c[i] = digest(le64(c[i-1]) || le64(b[i]))`` from ``parent`` (none: ``c[0] = b[0]``)."""

    def chain(block_hashes: Sequence[int], parent: int | None) -> list[int]:
        out = []
        prev = None if parent is None else normalize_hash(parent)
        pack = _PAIR.pack
        for h in normalize_hashes(block_hashes):
            cur = h if prev is None else digest(pack(prev, h))
            out.append(cur)
            prev = cur
        return out

    return chain


def _xxh3(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data, DYNAMO_SEED)


# copies of a keyed-up state cost half a fresh hasher's set-up with its person string
_B2_BLOCK, _B2_CHAIN, _B2_SALT = (hashlib.blake2b(digest_size=8, person=p) for p in (
    b"kvkern-block/v1", b"kvkern-chain/v1", b"kvkern-salt/v1"))


def _b2_u64(data: bytes | memoryview, base: hashlib.blake2b) -> int:
    h = base.copy()
    h.update(data)
    return int.from_bytes(h.digest(), "little")


def _b2_block(data: bytes | memoryview) -> int:
    return _b2_u64(data, _B2_BLOCK)


def _b2_chain(data: bytes | memoryview) -> int:
    return _b2_u64(data, _B2_CHAIN)


# --------------------------------------------------------------------------------- trtllm-v1


def _splitmix64_final(x: int) -> int:
    x &= U64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64_MASK
    return x ^ (x >> 31)


def _fold64(seed: int, value: int) -> int:
    return seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & U64_MASK)


def trtllm_block_key(
    tokens: Sequence[int], parent: int, *, cache_salt: int | None = None, lora_id: int | None = None
) -> int:
    """One TRT-LLM V1 block key (see the module docstring for the formula)."""
    seed = (len(tokens) ^ (parent * 0xBF58476D1CE4E5B9)) & U64_MASK
    if cache_salt is not None and parent == 0:
        seed = _fold64(seed, _splitmix64_final(cache_salt))
    for t in tokens:
        a = t & _U32_MASK
        a = (((a >> 16) ^ a) * 0x45D9F3B) & _U32_MASK
        a = (((a >> 16) ^ a) * 0x45D9F3B) & _U32_MASK
        a = (a >> 16) ^ a
        seed ^= (((a + 0x9E3779B9) & _U32_MASK) + (seed << 6) + (seed >> 2)) & U64_MASK
    if lora_id is not None:
        seed = _fold64(seed, _splitmix64_final(lora_id))
    return seed


def trtllm_salt_id(cache_salt: str | None) -> int | None:
    """TRT-LLM's cache salt id of a request's salt string, as its request handling derives
    it: the first 8 bytes of the string's BLAKE3 digest, little-endian (None for no salt or
    the empty string, as :func:`salt_key`)."""
    if not cache_salt:
        return None
    from blake3 import blake3  # noqa: PLC0415

    return int.from_bytes(blake3(cache_salt.encode("utf-8")).digest(length=8), "little")


def _check_u64_opt(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MASK:
        raise ValueError(f"{name} must be a u64 int or None, got {value!r}")


def _trtllm_block_hashes(
    token_ids: Sequence[int], block_size: int, *, cache_salt: int | None, lora_id: int | None
) -> list[int]:
    _check_u64_opt("cache_salt", cache_salt)
    _check_u64_opt("lora_id", lora_id)
    n_full = len(token_ids) // block_size
    _token_bytes(token_ids, n_full * block_size)  # validates the token ids
    out = []
    parent = 0
    for i in range(n_full):
        parent = trtllm_block_key(
            token_ids[i * block_size : (i + 1) * block_size],
            parent,
            cache_salt=cache_salt,
            lora_id=lora_id,
        )
        out.append(parent)
    return out


def _identity_chain(block_hashes: Sequence[int], parent: int | None) -> list[int]:
    if parent is not None:
        raise ValueError(
            "scheme 'trtllm-v1' hashes are chained already; pass the parent to block_hashes "
            f"by hashing the whole prefix instead (got parent={parent!r})"
        )
    return normalize_hashes(block_hashes)


# ------------------------------------------------------------------------------------- vLLM

VLLM_NONE_HASH_SEED = "vllm-none-hash"
_VLLM_ALGOS = {"vllm-sha256-v1": "sha256", "vllm-sha256-cbor-v1": "sha256_cbor"}


def _vllm_serialize(algo: str, obj: object) -> bytes:
    if algo == "sha256":
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if algo == "sha256_cbor":
        try:
            import cbor2  # noqa: PLC0415
        except ImportError:
            raise ValueError("hash algorithm 'sha256_cbor' needs the cbor2 package") from None
        return cbor2.dumps(obj, canonical=True)
    raise ValueError(f"unknown vLLM hash algorithm {algo!r}; known: sha256, sha256_cbor")


def vllm_block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    none_hash_seed: str = VLLM_NONE_HASH_SEED,
    cache_salt: str | None = None,
) -> list[bytes]:
    """vLLM v1's chained 32-byte block hashes of the full blocks of ``token_ids`` (see the
    module docstring); ``cache_salt`` is the request's salt string."""
    _check_block_size(block_size)
    n_full = len(token_ids) // block_size
    _token_bytes(token_ids, n_full * block_size)  # validates the token ids
    parent = hashlib.sha256(_vllm_serialize(algo, none_hash_seed)).digest()
    out = []
    for i in range(n_full):
        block = tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size])
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = hashlib.sha256(_vllm_serialize(algo, (parent, block, extra))).digest()
        out.append(parent)
    return out


def vllm_u64(digest: bytes) -> int:
    """A vLLM block hash as a kvkern u64: its low 64 bits, read big-endian."""
    if not isinstance(digest, (bytes, bytearray)) or len(digest) < 8:
        raise ValueError(f"a vLLM block hash is bytes of at least 8, got {digest!r:.80}")
    return int.from_bytes(digest[-8:], "big")


def _vllm_scheme_hashes(algo: str) -> Callable[..., list[int]]:
    def block_hashes(token_ids: Sequence[int], block_size: int, *, cache_salt: int | None,
                     lora_id: int | None) -> list[int]:
        if cache_salt is not None or lora_id is not None:
            raise ValueError(
                "the vLLM schemes take the request's own cache salt string "
                "(vllm_block_digests(..., cache_salt=...)) and no LoRA id here; an engine "
                f"passes its own block hashes (got cache_salt={cache_salt!r}, "
                f"lora_id={lora_id!r})")
        return [vllm_u64(d) for d in vllm_block_digests(token_ids, block_size, algo=algo)]
    return block_hashes


def _vllm_chain(block_hashes: Sequence[int], parent: int | None) -> list[int]:
    if parent is not None:
        raise ValueError("vLLM block hashes are chained already and take no parent "
                         f"(got parent={parent!r})")
    return normalize_hashes(block_hashes)


# ---------------------------------------------------------------------------------- registry


@dataclass(frozen=True, kw_only=True)
class HashScheme:
    """A named block-hash scheme.

    ``block_hashes(token_ids, block_size, *, cache_salt=None, lora_id=None)`` returns the
    scheme's per-block hashes of the full blocks; ``chain(block_hashes, parent=None)`` turns
    them into the chained form the prefix index keys on. ``chained`` says whether
    ``block_hashes`` is chained already (then ``chain`` is the identity).
    """

    name: str
    chained: bool
    supports_salt: bool
    supports_lora: bool
    _block_hashes: Callable[..., list[int]]
    _chain: Callable[[Sequence[int], int | None], list[int]]
    _salt_id: Callable[[str | None], int | None] | None = None

    def salt_id(self, cache_salt: str | None) -> int | None:
        """The u64 this scheme mixes for a request's salt string (``cache_salt`` of
        :meth:`block_hashes`): :func:`salt_key`, or the engine's own derivation where the
        scheme is an engine's (``trtllm-v1``: :func:`trtllm_salt_id`)."""
        return (self._salt_id or salt_key)(cache_salt)

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        cache_salt: int | None = None,
        lora_id: int | None = None,
    ) -> list[int]:
        _check_block_size(block_size)
        return self._block_hashes(token_ids, block_size, cache_salt=cache_salt, lora_id=lora_id)

    def chain(self, block_hashes: Sequence[int], parent: int | None = None) -> list[int]:
        return self._chain(block_hashes, parent)

    def sequence_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        cache_salt: int | None = None,
        lora_id: int | None = None,
    ) -> list[int]:
        if self.chained:  # the salt enters the root block's key
            return self.chain(
                self.block_hashes(token_ids, block_size, cache_salt=cache_salt, lora_id=lora_id)
            )
        return self.salted_chain(self.block_hashes(token_ids, block_size, lora_id=lora_id),
                                 cache_salt)

    def salted_chain(self, block_hashes: Sequence[int], cache_salt: int | None) -> list[int]:
        """The chained form of this scheme's ``block_hashes`` under ``cache_salt``: for an
        unchained scheme the salt is the chain's root parent; a chained scheme's hashes
        already carry it (computed with ``cache_salt``), so they are returned normalised."""
        return self.chain(block_hashes, None if self.chained else cache_salt)


_SCHEMES: dict[str, HashScheme] = {
    s.name: s
    for s in (
        *(HashScheme(name=name, chained=False, supports_salt=True, supports_lora=False,
                     _block_hashes=_per_block(name, block), _chain=_pair_chain(chain))
          for name, block, chain in (("kvkern-blake2b-v1", _b2_block, _b2_chain),
                                     ("public-xxh3-v1", _xxh3, _xxh3))),
        HashScheme(
            name="trtllm-v1",
            chained=True,
            supports_salt=True,
            supports_lora=True,
            _block_hashes=_trtllm_block_hashes,
            _chain=_identity_chain,
            _salt_id=trtllm_salt_id,
        ),
        *(HashScheme(name=name, chained=True, supports_salt=False, supports_lora=False,
                     _block_hashes=_vllm_scheme_hashes(algo), _chain=_vllm_chain)
          for name, algo in _VLLM_ALGOS.items()),
    )
}


def salt_key(cache_salt: str | None) -> int | None:
    """The u64 a request's cache salt string stands for in kvkern's own schemes
    (:meth:`HashScheme.salt_id`; None for no salt or the empty string, so unsalted requests
    keep the schemes' published values): BLAKE2b, so
    no one finds another salt string that stands for the same u64 (and shares that tenant's
    hashes) short of about 2**64 tries."""
    if not cache_salt:
        return None
    return _b2_u64(cache_salt.encode("utf-8"), _B2_SALT)


def known_schemes() -> tuple[str, ...]:
    return tuple(sorted(_SCHEMES))


def get_scheme(name: str) -> HashScheme:
    """The scheme called ``name``; ValueError listing the known ones otherwise."""
    try:
        return _SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown hash scheme {name!r}; known schemes: {', '.join(known_schemes())}"
        ) from None


def local_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    scheme: str = DEFAULT_SCHEME,
    *,
    cache_salt: int | None = None,
    lora_id: int | None = None,
) -> list[int]:
    """Per-block hashes of the full blocks of ``token_ids`` (u64, unchained for
    ``kvkern-blake2b-v1`` and ``public-xxh3-v1``; for the chained schemes, which have no
    unchained form, the chained keys)."""
    return get_scheme(scheme).block_hashes(
        token_ids, block_size, cache_salt=cache_salt, lora_id=lora_id
    )


def sequence_hashes(
    token_ids: Sequence[int],
    block_size: int,
    scheme: str = DEFAULT_SCHEME,
    *,
    cache_salt: int | None = None,
    lora_id: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks: element ``i`` names ``tokens[:(i+1)*block_size]``."""
    return get_scheme(scheme).sequence_hashes(
        token_ids, block_size, cache_salt=cache_salt, lora_id=lora_id
    )
