"""Source discovery for the destination side: resolve a hint's endpoint once and check it
against the allowlist, fetch the source's state (cached per source and incarnation, one fetch
at a time per source), check that the source can serve this worker at all, and resolve the
UCX address of every source rank a plan needs (each allowlist-checked too).

Verdicts and states are cached for ``XferConfig.state_cache_ttl_s``. One used when older than
:data:`~kvkern.xfer.tuning.REFRESH_AHEAD` of that is resolved or fetched again in the
background once the pull that used it has ended (:meth:`SourceDiscovery.after_pull`; a fetch
running beside a pull takes the interpreter from its reads), so a source pulled from steadily
is never waited for. Past its time to live an entry is still used for
``XferConfig.state_max_stale_s`` (and fetched again after the pull that used it), so a source
pulled from rarely costs no fetch per pull either: a state changes only with its source's
incarnation, and a pull on the state of a source that restarted fails its connection or its
direct read, which drops the entry and asks again (:meth:`SourceDiscovery.connect_failed`).
None older than both is used, and a refresh that fails drops the entry (the next pull asks
again and meets the failure itself), but for one refused for want of a lookup thread
(``busy``), which looked nothing up.

Everything here happens before a block is allocated; every refusal is a
:class:`~kvkern.xfer.pulljob.Fallback` with a named reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, TypeVar

from kvkern.xfer.auth import Credential
from kvkern.xfer.codes import fetch_reason
from kvkern.xfer.config import XferConfig
from kvkern.xfer.hints import KvHint
from kvkern.xfer.outcome import Reason
from kvkern.xfer.pulljob import Fallback, PullJob
from kvkern.xfer.state import PROTOCOL, SourceState, parse_state
from kvkern.xfer.tuning import MAX_CACHED_SOURCES, REFRESH_AHEAD, STATE_CACHE_BYTES

if TYPE_CHECKING:
    from kvkern.xfer.endpoint import Allowlist, ResolvedEndpoint, Resolver
    from kvkern.xfer.kvgroup import KVGroup

__all__ = ["MAX_CACHED_SOURCES", "SourceDiscovery", "bounded_put"]

log = logging.getLogger("kvkern.xfer")


K = TypeVar("K")
V = TypeVar("V")


def _served_state(state: SourceState, resolved: ResolvedEndpoint) -> SourceState:
    """``state`` without the same-host announcements (``read_local``) of processes other
    than the one that served it (:func:`kvkern.xfer.local_reads.serves`): any peer can copy
    another process's announcement into its own state. Those ranks are read through UCX,
    which reads a process on this host only for a rank kept here
    (:meth:`~kvkern.xfer.receive.ReadReceiver.near_reads`).

    One process serves a state, so one is checked: the one its first announcement names;
    the ranks announcing any other are dropped unchecked (a state naming thousands of
    processes costs one check, and one log line)."""
    from kvkern.xfer import local_reads  # noqa: PLC0415

    pid = next(iter(state.read_locals.values())).pid
    why = local_reads.serves(pid, resolved.ip, resolved.port)
    kept = {key: src for key, src in state.read_locals.items()
            if why is None and src.pid == pid}
    if len(kept) < len(state.read_locals):
        named = len({src.pid for src in state.read_locals.values()})
        log.warning("source %s announces %d process(es) on this host for same-host reads; only "
                    "the one serving its state is read so (process %d, the first named, %s): "
                    "%d of its ranks are read through UCX", resolved.display_url, named, pid,
                    "serves it" if why is None else f"does not: {why}",
                    len(state.read_locals) - len(kept))
    return dataclasses.replace(state, read_locals=kept)


def bounded_put(cache: dict[K, V], key: K, value: V, limit: int = MAX_CACHED_SOURCES) -> None:
    """Insert as the newest entry, dropping the oldest ones beyond ``limit``."""
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]


class SourceDiscovery:
    """Endpoint verdicts and source states for one puller (loop thread only)."""

    def __init__(self, config: XferConfig, credential: Credential | None,
                 resolver: Resolver | None = None) -> None:
        self.config = config
        self.credential = credential
        self._resolver = resolver  # kvkern.xfer.endpoint resolver (tests pass a fake DNS)
        self._endpoint_config = None
        # key -> (state, time cached, bytes of its document): at most MAX_CACHED_SOURCES,
        # their documents at most STATE_CACHE_BYTES together (the oldest go first)
        self._state_cache: dict[tuple, tuple[SourceState, float, int]] = {}
        self._state_fetches: dict[tuple, asyncio.Future] = {}
        self._refreshes: dict[tuple, asyncio.Task] = {}  # verdicts resolved again meanwhile
        self._resolving: dict[tuple, asyncio.Task] = {}  # first resolutions, shared by pulls
        # allowed endpoints, with the time of the verdict
        self._verdicts: dict[tuple, tuple[ResolvedEndpoint, float]] = {}
        # UCX addresses of source ranks the allowlist allowed: (host, port) as a state names
        # it -> (address, port) as checked (the allowlist is fixed for the config's life;
        # refusals are not kept)
        self._ucx_allowed: dict[tuple[str, int], tuple[str, int]] = {}
        self._closed = False  # aclose: no refresh starts after it

    def allowlist(self) -> Allowlist:
        from kvkern.xfer.endpoint import Allowlist  # noqa: PLC0415

        allow = self.config.allowlist
        return allow if isinstance(allow, Allowlist) else Allowlist.parse(list(allow))

    async def discover(self, job: PullJob) -> SourceState:
        """The hinted source's state (sets ``job.state``), or :class:`Fallback`."""
        md_t = job.timeouts[0]
        resolved = await self.resolve(job, md_t)
        return await self.state(job, resolved, md_t)

    def after_pull(self, job: PullJob) -> None:
        """``job`` has ended: start the refreshes it found due (each only if its entry is
        still the one the pull used and none is running; none once closed)."""
        later, job.refreshes = job.refreshes, []
        if not self._closed:
            for start in later:
                start()

    async def resolve(self, job: PullJob, md_t: float) -> ResolvedEndpoint:
        """Parse, resolve once and allowlist-check the hint's endpoint. Allowed verdicts are
        cached for ``state_cache_ttl_s`` (refusals never are), so a warm pull skips the
        resolver thread (and one older than REFRESH_AHEAD of that is resolved again once
        ``job`` has ended); the connection still goes to the address that was checked."""
        if self._endpoint_config is None:
            self._endpoint_config = self.config.endpoint_config()
        hint = job.hint
        key = (hint.source, hint.source_dp_rank)
        hit = self._verdicts.get(key)
        usable, refresh = self._cached(hit)
        if usable:
            if refresh:
                job.refreshes.append(lambda: self._resolve_again(key, hit, hint, md_t))
            return hit[0]
        # one resolution per endpoint at a time: concurrent pulls of a source not yet
        # resolved share it (each resolution holds a thread while the resolver answers)
        task = self._resolving.get(key)
        if task is None:
            task = self._resolving[key] = asyncio.ensure_future(self._resolve(hint, md_t))
            task.add_done_callback(lambda t, k=key: self._resolved(k, t))
        return await asyncio.shield(task)

    def _resolved(self, key: tuple, task: asyncio.Task) -> None:
        if self._resolving.get(key) is task:
            del self._resolving[key]
        if not task.cancelled():
            task.exception()  # (retrieved: a pull that gave up waiting may have left it)

    def _resolve_again(self, key: tuple, hit: tuple, hint: KvHint, md_t: float) -> None:
        if self._verdicts.get(key) is not hit or key in self._refreshes:
            return  # resolved again, dropped or being resolved meanwhile
        task = asyncio.ensure_future(self._resolve(hint, md_t))
        self._refreshes[key] = task
        task.add_done_callback(lambda t, k=key: self._resolved_again(k, t))

    def _cached(self, hit: tuple | None) -> tuple[bool, bool]:
        """Whether a cached ``(value, time cached)`` may be used, and whether to fetch it
        again meanwhile (past REFRESH_AHEAD of its time to live, stale ones included)."""
        if hit is None:
            return False, False
        age, ttl = time.monotonic() - hit[1], self.config.state_cache_ttl_s
        usable = age < ttl + self.config.state_max_stale_s
        return usable, usable and age >= REFRESH_AHEAD * ttl

    async def _resolve(self, hint: KvHint, md_t: float) -> ResolvedEndpoint:
        from kvkern.xfer.endpoint import resolve_endpoint_async  # noqa: PLC0415

        try:
            verdict = await asyncio.wait_for(resolve_endpoint_async(
                hint.source, self.allowlist(), dp_rank=hint.source_dp_rank,
                config=self._endpoint_config, resolver=self._resolver), md_t)
        except (asyncio.TimeoutError, TimeoutError):
            raise Fallback(Reason.METADATA_TIMEOUT, f"resolving {hint.source!r} took over "
                           f"{md_t} s") from None
        if verdict.reason == "resolve_busy":  # (this worker's lookups, not the source)
            raise Fallback(Reason.BUSY, f"{hint.source!r}: {verdict.detail}")
        if not verdict.allowed:
            raise Fallback(Reason.SOURCE_NOT_ALLOWED, f"{hint.source!r}: {verdict.reason}: "
                           f"{verdict.detail}")
        bounded_put(self._verdicts, (hint.source, hint.source_dp_rank),
                    (verdict.endpoint, time.monotonic()))
        return verdict.endpoint

    def _resolved_again(self, key: tuple, task: asyncio.Task) -> None:
        """A background re-resolution ended: on success :meth:`_resolve` stored the fresh
        verdict; on any failure (a refusal, a timeout) the old one is dropped."""
        if self._refreshes.get(key) is task:
            del self._refreshes[key]
        if task.cancelled() or task.exception() is not None:
            exc = None if task.cancelled() else task.exception()
            if isinstance(exc, Fallback) and exc.reason == Reason.BUSY:
                return  # not looked up at all: the verdict stands until the next refresh
            if exc is not None:
                log.debug("source %s: re-resolving failed: %s", key[0], exc)
            self._verdicts.pop(key, None)

    @staticmethod
    def _state_key(resolved: ResolvedEndpoint) -> tuple:
        return (resolved.scheme, resolved.host, resolved.ip, resolved.port, resolved.path)

    async def state(self, job: PullJob, resolved: ResolvedEndpoint,
                    md_t: float) -> SourceState:
        key = self._state_key(resolved)
        hit = self._state_cache.get(key)
        usable, refresh = self._cached(hit)
        if usable:
            if refresh:  # for the pulls after this one
                job.refreshes.append(lambda: self._fetch_again(key, hit, resolved, md_t))
            job.state, job.state_cached = hit[0], True
            return hit[0]
        state, _ = await asyncio.shield(self._fetching(key, resolved, md_t))
        job.state = state
        return state

    def _fetch_again(self, key: tuple, hit: tuple, resolved: ResolvedEndpoint,
                     md_t: float) -> None:
        if self._state_cache.get(key) is hit:  # not fetched again or dropped meanwhile
            self._fetching(key, resolved, md_t)

    def _fetching(self, key: tuple, resolved: ResolvedEndpoint, md_t: float) -> asyncio.Future:
        """The running fetch of the source's state, started if there is none: one per source
        at a time, shared by concurrent pulls."""
        fut = self._state_fetches.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._fetch(resolved, md_t))
            self._state_fetches[key] = fut
            fut.add_done_callback(lambda f, k=key: self._fetched(k, f))
        return fut

    async def aclose(self) -> None:
        """Cancel the fetches and re-resolutions still running (a refresh no pull waits
        for would otherwise outlive the puller) and wait for them to end."""
        self._closed = True
        tasks = [*self._state_fetches.values(), *self._refreshes.values(),
                 *self._resolving.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    def _fetched(self, key: tuple, fut: asyncio.Future) -> None:
        if self._state_fetches.get(key) is fut:
            del self._state_fetches[key]
        if fut.cancelled() or fut.exception() is not None:
            self._state_cache.pop(key, None)
            return
        state, nbytes = fut.result()
        old = self._state_cache.get(key)
        if old is not None and old[0].incarnation != state.incarnation:
            log.info("source %s restarted: incarnation %s -> %s", key[1],
                     old[0].incarnation, state.incarnation)
        cache = self._state_cache
        bounded_put(cache, key, (state, time.monotonic(), nbytes))
        total = sum(entry[2] for entry in cache.values())
        while total > STATE_CACHE_BYTES and len(cache) > 1:
            total -= cache.pop(next(iter(cache)))[2]

    async def _fetch(self, resolved: ResolvedEndpoint, md_t: float) -> tuple[SourceState, int]:
        """The source's state and the bytes of its document."""
        from kvkern.xfer.endpoint import FetchError, fetch_state  # noqa: PLC0415

        if self.credential is None:
            raise Fallback(Reason.UNAUTHENTICATED, "this worker has no fleet credential "
                           "(KVKERN_FLEET_SECRET_FILE / KVKERN_FLEET_SECRET)")
        t0 = time.monotonic()
        try:
            body = await fetch_state(resolved, timeout_s=md_t,
                                     max_bytes=self.config.max_state_bytes,
                                     credential=self.credential)
        except FetchError as exc:
            raise Fallback(fetch_reason(exc.reason), f"{exc.reason}: {exc.detail}") from None
        try:
            state = parse_state(body)
        except ValueError as exc:
            raise Fallback(Reason.METADATA_INVALID, f"{resolved.display_url}: {exc}") from None
        if state.read_locals:
            # (a thread: /proc is read; bounded with the fetch by md_t, the thread left to
            # end on its own)
            left = max(md_t - (time.monotonic() - t0), 0.0)
            try:
                state = await asyncio.wait_for(
                    asyncio.to_thread(_served_state, state, resolved), left)
            except (asyncio.TimeoutError, TimeoutError):
                raise Fallback(Reason.METADATA_TIMEOUT, f"{resolved.display_url}: checking "
                               f"its same-host announcements took the state's fetch over "
                               f"{md_t} s") from None
        return state, len(body)

    async def connect_failed(self, job: PullJob, exc: Exception) -> None:
        """A connection to a source rank failed before any data, or a direct read of it
        failed: if its state came from the cache, drop it and re-check the incarnation (the
        source may have restarted; a refresh may already have replaced the entry, then that
        answers). The fresh state goes to the cache only: ``job`` keeps the state its pull
        was planned with (one with the same incarnation may still name other ranks, workers
        or directories)."""
        self._verdicts.pop((job.hint.source, job.hint.source_dp_rank), None)
        old = job.state
        if not job.state_cached or old is None:
            return
        for key, (state, *_) in list(self._state_cache.items()):
            if state is old:
                del self._state_cache[key]
                break
        try:
            fresh = await self.discover(job)
        except Fallback:
            return
        finally:
            job.state, job.state_cached = old, True
        if fresh.incarnation != old.incarnation:
            raise Fallback(Reason.SOURCE_INCARNATION_CHANGED,
                           f"source incarnation {old.incarnation} -> "
                           f"{fresh.incarnation} ({exc})") from exc

    # ------------------------------------------------------------------ compatibility

    @staticmethod
    def check_compatible(state: SourceState, group: KVGroup, codec_fingerprint: int) -> None:
        """The source speaks our protocol and codec, hashes like us, has our block size and
        our model; else :class:`Fallback`."""
        if state.protocol != PROTOCOL or "pull/1" not in state.capabilities:
            raise Fallback(Reason.PROTOCOL_MISMATCH, f"source speaks {state.protocol!r} "
                           f"{list(state.capabilities)}, we speak {PROTOCOL!r} pull/1")
        if state.codec_fingerprint != codec_fingerprint:
            raise Fallback(Reason.PROTOCOL_MISMATCH,
                           f"source codec fingerprint {state.codec_fingerprint:#018x} != ours "
                           f"{codec_fingerprint:#018x}")
        if state.hash_scheme != group.hash_scheme:
            raise Fallback(Reason.HASH_SCHEME_MISMATCH, f"source hashes with "
                           f"{state.hash_scheme!r}, this worker with {group.hash_scheme!r}")
        if state.block_size != group.block_size:
            raise Fallback(Reason.INCOMPATIBLE_TOPOLOGY, f"source block size "
                           f"{state.block_size} != ours {group.block_size}")
        if state.model != getattr(group, "model_id", ""):
            raise Fallback(Reason.INCOMPATIBLE_MODEL, f"source model {state.model!r} != "
                           f"ours {getattr(group, 'model_id', '')!r}")

    def rank_addresses(self, state: SourceState, src_dp: int,
                       src_ranks: list[int]) -> dict[int, tuple[str, int]]:
        """The allowlist-checked UCX address of each of ``src_ranks``; else Fallback."""
        addrs: dict[int, tuple[str, int]] = {}
        for rank in src_ranks:
            addr = state.ranks.get((src_dp, rank))
            if addr is None:
                raise Fallback(Reason.METADATA_INVALID, f"source state has no UCX address "
                               f"for DP {src_dp} rank {rank}")
            allowed = self._ucx_allowed.get(addr)
            if allowed is None:
                allowed = self._check_ucx_address(addr, rank)
                bounded_put(self._ucx_allowed, addr, allowed)
            addrs[rank] = allowed
        return addrs

    def _check_ucx_address(self, addr: tuple[str, int], rank: int) -> tuple[str, int]:
        from kvkern.xfer.endpoint import normalize_host  # noqa: PLC0415

        try:
            ip = normalize_host(addr[0])
        except Exception as exc:  # noqa: BLE001 (endpoint's refusal type is private)
            raise Fallback(Reason.SOURCE_NOT_ALLOWED, f"UCX host {addr[0]!r}: "
                           f"{exc}") from None
        if isinstance(ip, str):
            raise Fallback(Reason.SOURCE_NOT_ALLOWED, f"UCX host {addr[0]!r} of rank "
                           f"{rank} is a name, not an address")
        why, what = self.allowlist().check(ip, None, addr[1])
        if why != "allowed":
            raise Fallback(Reason.SOURCE_NOT_ALLOWED, f"UCX address of source rank "
                           f"{rank}: {why}: {what}")
        return str(ip), addr[1]
