"""Admission: whether a hinted request pulls, decided without the network.

:func:`admit` is a pure function of the prompt's tokens, the hint, the worker's local prefix
and the configuration; it returns an :class:`Admitted` pull or a :class:`Skip` with a named
reason. The :class:`~kvkern.xfer.puller.Puller` facade applies what follows from it
(de-duplication, the concurrency cap) and schedules the pull.

Hashes: hint hashes are checked against the prompt in the hint's scheme, either in the
per-block form (Dynamo's router) or the chained form; a hint in the engine's own hashes
(:data:`~kvkern.xfer.hints.ENGINE_SCHEME`, Dynamo's dialects) is checked in the worker's
scheme. The request to the source always carries the chained hashes of the worker's scheme
from the root. An engine that hashes its requests itself (vLLM) passes those hashes as
``engine_hashes``; they are used as they are, never recomputed: a hint in them is compared
with them, a hint in another scheme (a router's) is checked against the prompt's tokens in
that scheme. A hint without hashes (llm-d) covers every full block of the prompt. The
trailing partial block is never pulled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvkern.cache.hashing import HINT_SCHEME, get_scheme
from kvkern.xfer.config import XferConfig
from kvkern.xfer.hints import ENGINE_SCHEME, HintLimits, HintRejected, KvHint, decode_hint
from kvkern.xfer.outcome import Reason
from kvkern.xfer.policy import CostGuard

__all__ = ["Admitted", "Skip", "WorkerFacts", "admit", "read_hint"]

HINT_REASONS = {"no_hint": Reason.NO_HINT, "unknown_hash_scheme": Reason.HASH_SCHEME_MISMATCH}


@dataclass(frozen=True)
class WorkerFacts:
    """What admission needs to know of the destination worker."""

    block_size: int
    hash_scheme: str
    bytes_per_block: int  # of every hosted rank together
    longest_prefix: Callable[[list[int]], int]  # the engine's cached prefix, in blocks


@dataclass(frozen=True)
class Skip:
    """No pull: ``reason`` and its ``detail``; ``fields`` are outcome fields known so far."""

    reason: Reason
    detail: str
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Admitted:
    """A pull to run: the chained hashes of the hinted blocks from the root, how many are
    hinted and how many are cached here, the effective timeouts and common outcome fields."""

    chained: list[int]
    hinted: int
    local: int
    timeouts: tuple[float, float, float]
    base: dict

    @property
    def count(self) -> int:
        return self.hinted - self.local


def read_hint(hint: KvHint | HintRejected | dict | None, limits: HintLimits) -> KvHint | Skip:
    """A decoded hint, or the :class:`Skip` that a missing or rejected one means."""
    if isinstance(hint, dict):
        hint = decode_hint(hint, limits=limits)
    if hint is None:
        hint = HintRejected(reason="no_hint", detail="no hint given")
    if isinstance(hint, HintRejected):
        return Skip(HINT_REASONS.get(hint.reason, Reason.HINT_INVALID),
                    f"{hint.reason}: {hint.detail}"[:2000], {"dialect": hint.dialect})
    if not isinstance(hint, KvHint):
        raise TypeError(f"hint must be a KvHint, HintRejected, dict or None, got "
                        f"{type(hint).__name__}")
    return hint


def admit(token_ids: Sequence[int], hint: KvHint, *, worker: WorkerFacts, config: XferConfig,
          cost_guard: CostGuard, cache_salt: str | None = None,
          engine_hashes: Sequence[int] | None = None,
          max_blocks: int | None = None) -> Admitted | Skip:
    """Decide whether ``hint`` is worth a pull for a prompt of ``token_ids`` (CPU only).

    ``cache_salt``: the request's salt string (each scheme derives its own id of it,
    :meth:`~kvkern.cache.hashing.HashScheme.salt_id`); ``engine_hashes``: the engine's own
    chained hashes of the prompt's full blocks in the worker's scheme (salted as the engine
    salts them); ``max_blocks`` caps the blocks a pull may cover (an engine that must
    compute at least one prompt token)."""
    bs = worker.block_size
    n_full = len(token_ids) // bs
    tokens = list(token_ids[:n_full * bs])
    if engine_hashes is not None:
        engine_hashes = list(engine_hashes)
        if len(engine_hashes) < n_full:
            return Skip(Reason.INTERNAL_ERROR, f"engine gave {len(engine_hashes)} block hashes "
                        f"for a prompt of {n_full} full blocks")
        checked = _check_engine_hashes(engine_hashes[:n_full], hint, worker.hash_scheme)
        if checked is None or isinstance(checked, Skip):  # checked on the tokens instead
            on_tokens = _check_hint_hashes(tokens, hint, bs, n_full, cache_salt,
                                           worker.hash_scheme)
            if checked is None or not isinstance(on_tokens, Skip):
                checked = on_tokens  # (else the engine's mismatch, which says more)
    else:
        checked = _check_hint_hashes(tokens, hint, bs, n_full, cache_salt, worker.hash_scheme)
    if isinstance(checked, Skip):
        return checked
    hinted, scheme_name, mine = checked
    if max_blocks is not None:
        hinted = min(hinted, max(0, max_blocks))
        mine = None if mine is None else mine[:hinted]
    if hinted == 0:
        return Skip(Reason.LOCAL_PREFIX_SUFFICIENT,
                    f"prompt of {len(token_ids)} tokens has no full block of {bs} to pull")
    if engine_hashes is not None:
        chained = engine_hashes[:hinted]
    else:
        scheme = get_scheme(worker.hash_scheme)
        salt = scheme.salt_id(cache_salt)
        if mine is not None and scheme_name == worker.hash_scheme:
            chained = scheme.salted_chain(mine, salt)  # tokens hashed once
        else:
            chained = scheme.sequence_hashes(tokens[:hinted * bs], bs, cache_salt=salt)
    local = worker.longest_prefix(chained)
    counts = dict(blocks_hinted=hinted, blocks_local=local)
    if local >= hinted:
        return Skip(Reason.LOCAL_PREFIX_SUFFICIENT,
                    f"all {hinted} hinted blocks are cached here", counts)
    count = hinted - local
    ok, detail = cost_guard.check(blocks=count, nbytes=count * worker.bytes_per_block,
                                  tokens=count * bs)
    if not ok:
        return Skip(Reason.NOT_WORTH_IT, detail, counts)
    timeouts = config.effective_timeouts(
        metadata_timeout_s=hint.metadata_timeout_s,
        transfer_timeout_s=hint.transfer_timeout_s, deadline_s=hint.deadline_s)
    base = dict(policy=hint.policy, source=hint.source, source_dp_rank=hint.source_dp_rank,
                dialect=hint.dialect, **counts)
    return Admitted(chained=chained, hinted=hinted, local=local, timeouts=timeouts, base=base)


def _check_engine_hashes(engine: list[int], hint: KvHint, worker_scheme: str
                         ) -> tuple[int, str, list[int] | None] | Skip | None:
    """(hinted blocks, the worker's scheme, the engine's hashes) when the hint names this
    prompt in the engine's own hashes; a hint without hashes covers every full block.
    None when the hint's hashes are in another scheme, or in the worker's scheme but not
    the engine's chained ones (the per-block form): those are checked on the tokens, as
    are an engine-scheme hint's that differ (a router may name the prompt in Dynamo's)."""
    if hint.block_hashes is None:
        return len(engine), worker_scheme, engine
    scheme_name = hint.hash_scheme or HINT_SCHEME
    if scheme_name not in (ENGINE_SCHEME, worker_scheme, HINT_SCHEME):
        return None
    want = list(hint.block_hashes)
    if len(want) > len(engine):
        return Skip(Reason.HASH_MISMATCH, f"hint names {len(want)} blocks, the prompt has "
                    f"{len(engine)} full blocks")
    if engine[:len(want)] != want:
        if scheme_name != ENGINE_SCHEME:
            return None
        i = next(i for i, (a, b) in enumerate(zip(engine, want, strict=False)) if a != b)
        return Skip(Reason.HASH_MISMATCH, f"hint hash {i} is {want[i]}, the engine's block "
                    f"{i} hashes to {engine[i]} in {worker_scheme}")
    return len(want), worker_scheme, engine[:len(want)]


def _check_hint_hashes(tokens: list[int], hint: KvHint, bs: int, n_full: int,
                       cache_salt: str | None, worker_scheme: str
                       ) -> tuple[int, str, list[int] | None] | Skip:
    """(hinted blocks, the hint's scheme, the prompt's hashes in it) when the hint's hashes
    name this prompt; a hint without hashes covers every full block."""
    if hint.block_hashes is None:
        return n_full, "", None
    named = hint.hash_scheme or HINT_SCHEME
    # A router's hashes of a prompt are the worker's own or Dynamo's (which routers hash
    # with, and which a worker's pool may not use): either names the prompt, being computed
    # here from its very tokens.
    names = ([named] if named not in (ENGINE_SCHEME, HINT_SCHEME) else list(dict.fromkeys(
        (worker_scheme if named == ENGINE_SCHEME else HINT_SCHEME, worker_scheme,
         HINT_SCHEME))))
    hinted = len(hint.block_hashes)
    if hinted > n_full:
        return Skip(Reason.HASH_MISMATCH, f"hint names {hinted} blocks, the prompt has "
                    f"{n_full} full blocks of {bs} tokens")
    want = list(hint.block_hashes)
    first: tuple[str, list[int]] | None = None  # (a scheme, the prompt's hashes in it)
    for name in names:
        try:
            scheme = get_scheme(name)
        except ValueError as exc:
            return Skip(Reason.HASH_SCHEME_MISMATCH, str(exc))
        salt = scheme.salt_id(cache_salt)
        if salt is not None and scheme.chained and not scheme.supports_salt:
            continue  # (an engine's scheme that salts inside the engine: only its own hashes)
        mine = scheme.block_hashes(tokens[:hinted * bs], bs,
                                   cache_salt=salt if scheme.chained else None)
        if mine == want or scheme.salted_chain(mine, salt) == want:
            return hinted, name, mine
        if first is None:
            first = name, mine
    if first is None:
        return Skip(Reason.HASH_SCHEME_MISMATCH, f"a salted prompt is not hashed here in "
                    f"{', '.join(names)}: only the engine's own block hashes name it")
    name, mine = first
    i = next(i for i, (a, b) in enumerate(zip(mine, want, strict=True)) if a != b)
    return Skip(Reason.HASH_MISMATCH, f"hint hash {i} is {want[i]}, the prompt's block "
                f"{i} hashes to {mine[i]} in {name}")
