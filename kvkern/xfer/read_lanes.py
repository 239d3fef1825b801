"""Read lanes: a pull's one-sided reads split over dedicated UCX workers, one thread each.

On one host UCX moves a read with CMA (``process_vm_readv``), and one thread copies at
5.8-6.3 GB/s on a 2-vCPU VM while two copy 10.9-11.7 GB/s (``bench/RESULTS.md``): the
copy is bound by one core's page walking, not by memory. A UCX worker copies on whichever
thread progresses it, under its lock, so the reads of ucxx's one worker are copied one at a
time whatever thread posts them. :class:`ReadLanes` gives each lane its own UCP context and
worker, and its own thread::

    destination (Puller._read_pair)                         source (SourceService)
    ReadLanes.read(source worker address, parts)
      split_parts: n shares of the runs, by bytes
      lane k thread: worker k --endpoint--> the source's ucxx worker (address from its state,
                                            "read_worker")
                     ucp_get_nbx per run; progresses worker k until every read is done

Everything a lane owns (UCP context, worker, endpoints, unpacked rkeys) is created, used and
closed on its own thread, so no lock or state is shared with ucxx's progress thread or
another lane (ucxx's context is not made for workers on several threads: no
``mt_workers_shared``). A lane keeps one endpoint per source worker address (least recently
used first out, :data:`MAX_PEERS`; see :mod:`kvkern.xfer.tuning`), with the rkeys unpacked on
it. The source needs nothing:
a read is one-sided, and its UCX worker answers the endpoints' wire-up on its own progress
thread.

A lane's thread costs a pull two thread hand-offs (onto the first lane and back to the
event loop: 0.2-0.5 ms of a 1-block pull in ``kvkern bench xfer``'s ``one_block_phases_ms``),
more than the copy of a small pull. So a pull of at most
``loop_bytes`` runs on the **loop lane** instead: a worker of its own made, progressed and
closed on the event loop's thread, whose script (:meth:`ReadLanes.run_script`) yields to the
loop between polls (:mod:`kvkern.xfer.pauses`), one script at a time (a second small pull
meanwhile takes the lanes' threads). A CMA copy then runs on the loop thread, which bounds
``loop_bytes``; an RDMA read does not copy on the host at all.

Larger pulls' scripts run one at a time on a *lane set* (:class:`_Dispatch`): set 0 runs
them in turn while every source answers, since copies that share a host's memory finish
soonest one after another. A script still running past its due time (``LANE_DUE_S`` plus
its bytes at ``LANE_DUE_BYTES_PER_S``: a source whose reads stall, until the pull's own
bound) sends the scripts waiting behind it to the next set (``sets``, opened on its first
read), so one stalled source holds one set, not every pull of the process. A script that
waits past its pull's bound for a set fails as a timeout with nothing read.

Failures never cost the control connection: a failed, timed-out or stopped lane closes its
endpoint to that source (a forced close: UCX cancels the reads still running), drains its
requests for up to ``READ_DRAIN_S`` and raises; the next read opens a new endpoint. A
cancelled :meth:`ReadLanes.read` lets the reads finish for up to ``READ_CANCEL_GRACE_S``,
then stops the lanes. Reads that outlive the drain raise :class:`ReadsStuck` (quarantine the
local memory) naming them (:class:`~kvkern.xfer.quarantine.Outstanding`): their lane keeps
them and retires them when asked (:meth:`_Lane.retire_later`) once they have completed.

Memory the engine owns (``owned``: :meth:`Puller.pull_into
<kvkern.xfer.puller.Puller.pull_into>`) has no quarantine: the engine reuses its blocks once
the pull ends. Such a read ends only after every read it posted has completed, with or
without an error, however long past the drain that takes: a completed UCX read writes nothing
more (a forced close completes the reads still running only once the transport has stopped
them, e.g. an RDMA queue pair flushed), and a same-host call has returned.

Trust: the worker address and the addresses read come from the state (and grants) of a
source the allowlist admitted, but any peer can publish another process's worker address. On
one host UCX reads through transports that take any address of the process at the other end,
whatever the key (CMA, KNEM, XPMEM: :data:`NEAR_TRANSPORTS`), so a lane reads through them
only where its caller allows it for that source rank (``same_host``:
:meth:`kvkern.xfer.receive.ReadReceiver.near_reads`: only with kvkern's own same-host
reads turned off, and for ranks whose announcement :func:`kvkern.xfer.local_reads.serves`
checked); elsewhere the read fails, and the puller streams from the process that answers
its control connection. Across hosts a registered key bounds every read. The lanes' contexts
use no TCP (:func:`kvkern.xfer.ucxcompat.new_rma_context`): a source reached over TCP alone
is streamed from.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvkern.checks import check_non_negative_int, check_positive_int
from kvkern.xfer import local_reads, tuning, ucxcompat
from kvkern.xfer.pauses import Steps, run_blocking
from kvkern.xfer.quarantine import Outstanding
from kvkern.xfer.runtime import through_cancels
from kvkern.xfer.transport import ReadsStuck, TransportError
from kvkern.xfer.tuning import (
    LANE_DRAIN_POLL_S,
    LANE_DUE_BYTES_PER_S,
    LANE_DUE_S,
    LANE_OPEN_S,
    LANE_UCX_CONFIG,
    LOOP_SPIN_S,
    MAX_CACHED_RKEYS,
    MAX_LANE_PEERS,
    OWNED_DRAIN_POLL_S,
    SPLIT_ALIGN,
)
from kvkern.xfer.ucp_rma import Scatter

if TYPE_CHECKING:
    from ucxx._lib.libucxx import UCXAddress, UCXContext, UCXEndpoint, UCXWorker

    from kvkern.xfer.local_reads import LocalSource
    from kvkern.xfer.ucp_rma import ReadBatch, RemoteKey

__all__ = ["ReadLanes", "split_parts", "address_usable", "lane_set_spills", "reads_past_drain",
           "MAX_PEERS", "MAX_WORKER_ADDRESS_BYTES", "NEAR_TRANSPORTS"]

Run = tuple[int, int, int]  # (local address, remote address, nbytes)
Part = tuple[bytes, Sequence[Run]]  # (packed rkey, runs)
Reader = Callable[[Sequence[Part]], "Steps[float | None]"]  # what a script reads with
T = TypeVar("T")

MAX_PEERS = MAX_LANE_PEERS
MAX_WORKER_ADDRESS_BYTES = 16 << 10  # a UCX worker address is ~0.1-2 KiB
# progress calls a lane makes before it looks at its stuck reads again (each completes what
# the transport finished; a worker with nothing to do returns at once)
RETIRE_PROGRESS_CALLS = 64
# UCX transports that read any address of a process on this host, whatever the remote key
NEAR_TRANSPORTS = frozenset({"cma", "knem", "xpmem"})

log = logging.getLogger("kvkern.xfer")

# Drains whose reads were still running READ_DRAIN_S after their endpoint's forced close, in
# this process, by the memory they write: the puller's own or the engine's.
_past_drain = {"private": 0, "engine": 0}
_counts_lock = threading.Lock()


# Scripts run on a lane set other than the first, in this process: the sets before it were
# each running a script past its due time (a source whose reads stall).
_spills = [0]


def lane_set_spills() -> int:
    """How many read scripts in this process ran on a spare lane set (:class:`_Dispatch`)."""
    with _counts_lock:
        return _spills[0]


def reads_past_drain() -> dict[str, int]:
    """How many lane drains in this process had reads still running ``READ_DRAIN_S`` after
    their endpoint's forced close, by memory: ``private`` (the puller's own blocks, then
    quarantined) and ``engine`` (an engine's blocks: the pull waited until they ended)."""
    with _counts_lock:
        return dict(_past_drain)


def split_parts(parts: Sequence[Part], n: int, *, min_bytes: int = 0,
                align: int = SPLIT_ALIGN) -> list[list[tuple[bytes, list[Run]]]]:
    """Split the runs of ``parts`` into at most ``n`` shares of about equal bytes, keeping
    their order: one share per lane. A share gets at least ``min_bytes`` (fewer shares
    otherwise). Share j ends at byte ``(j + 1) * ceil(total / shares)`` of the whole read,
    moved back to a multiple of ``align`` bytes from the start of the run it falls in, so
    each share is within ``align`` of that size (a :class:`~kvkern.xfer.ucp_rma.Scatter`
    is never cut: its share ends before it). Every byte of every run lands in exactly
    one share; runs between the cuts are passed through as they are. No share is empty (but
    for no bytes at all: one empty share)."""
    check_positive_int("n", n)
    sizes = [[run[2] for run in runs] for _, runs in parts]
    total = sum(map(sum, sizes))
    k = max(1, min(n, total // max(min_bytes, 1)))
    if k == 1:
        return [[(key, list(runs)) for key, runs in parts if runs]]
    quota = -(-total // k)
    shares: list[list[tuple[bytes, list[Run]]]] = [[] for _ in range(k)]
    lane, pos = 0, 0

    def emit(key: bytes, runs: Sequence[Run], i: int, off: int, m: int, cut: int) -> None:
        """Run i from byte ``off`` up to run m's byte ``cut`` into the current share."""
        out: list[Run] = []
        if i < m:
            lo, re, nb = runs[i]
            out.append((lo + off, re + off, nb - off) if off else runs[i])
            out.extend(runs[i + 1:m])
            if cut:
                out.append((runs[m][0], runs[m][1], cut))
        elif cut > off:
            lo, re, _ = runs[i]
            out.append((lo + off, re + off, cut - off))
        if out:
            share = shares[lane]
            if share and share[-1][0] == key:
                share[-1][1].extend(out)
            else:
                share.append((key, out))

    for (key, runs), nbs in zip(parts, sizes, strict=True):
        starts = list(itertools.accumulate(nbs, initial=pos))  # run m spans starts[m:m+2]
        i, off = 0, 0  # the next byte of this part not in a share yet: run i, byte off
        while lane < k - 1 and (lane + 1) * quota < starts[-1]:
            bound = (lane + 1) * quota
            m = bisect.bisect_right(starts, bound, lo=i) - 1
            # a Scatter is one read: never cut (it goes to the next share whole)
            cut = 0 if type(runs[m]) is Scatter else (bound - starts[m]) // align * align
            if m == i:
                cut = max(cut, off)
            emit(key, runs, i, off, m, cut)
            i, off = m, cut
            lane += 1
        emit(key, runs, i, off, len(runs), 0)
        pos = starts[-1]
    return [share for share in shares if share] or [[]]


_ADDRESS_VERSION_MASK = 0x0F  # low bits of a UCX worker address's first byte (ucp/address.c)
_local_version: int | None = None


def address_usable(address: bytes) -> bool:
    """Whether a worker address may be handed to UCX: non-empty, not too long, and packed
    in this process's UCX address version. libucp asserts on an unknown version (seen: a
    random first byte aborts the process), so an address from another UCX release, or a
    corrupted one, must never reach ``ucp_ep_create``; a source whose address fails here is
    streamed from instead. (Random bytes after a valid first byte were
    rejected or tolerated by UCX in 200 fuzzed tries, never fatal.)"""
    global _local_version
    if not address or len(address) > MAX_WORKER_ADDRESS_BYTES:
        return False
    if _local_version is None:
        _local_version = ucxcompat.worker_address()[0] & _ADDRESS_VERSION_MASK
    return address[0] & _ADDRESS_VERSION_MASK == _local_version


def _lane_context() -> UCXContext:
    """A UCP context for one lane: RMA only, LANE_UCX_CONFIG where this UCX knows it."""
    try:
        return ucxcompat.new_rma_context(LANE_UCX_CONFIG)
    except Exception:  # noqa: BLE001 (e.g. a UCX built without CMA: no such setting)
        return ucxcompat.new_rma_context({})


class _Stuck(Exception):
    """Reads still running after their endpoint was closed and the drain ran out (or a lane
    call still running when its wait gave up): ``outstanding`` says which."""

    def __init__(self, what: str, outstanding: Outstanding | None = None) -> None:
        super().__init__(what)
        self.outstanding = outstanding if outstanding is not None else Outstanding()


class _Peer:
    """One lane's endpoint to one source worker, and the rkeys unpacked on it. Keeps the
    address object the endpoint was made from for as long as the endpoint."""

    def __init__(self, ep: UCXEndpoint, address: UCXAddress, handle: int) -> None:
        self.ep: UCXEndpoint | None = ep
        self.address: UCXAddress | None = address
        self.handle = handle
        self.rkeys: dict[bytes, RemoteKey] = {}
        names = ucxcompat.endpoint_transports(handle)
        # reads any address of a process on this host (unknown transports: assumed to)
        self.near = names is None or not NEAR_TRANSPORTS.isdisjoint(names)

    def make_room(self, packed: Sequence[bytes]) -> None:
        """Before a read posts anything: if its new keys would overflow the cache, destroy
        the cached ones (no read is using them now)."""
        new = {p for p in packed if p not in self.rkeys}
        if len(new) > MAX_CACHED_RKEYS:
            raise ValueError(f"{len(new)} remote keys in one read, at most "
                             f"{MAX_CACHED_RKEYS}")
        if len(self.rkeys) + len(new) > MAX_CACHED_RKEYS:
            self.destroy_keys()

    def rkey(self, packed: bytes) -> RemoteKey:
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        key = self.rkeys.get(packed)
        if key is None:
            key = self.rkeys[packed] = ucp_rma.RemoteKey(self.handle, packed)
        return key

    def destroy_keys(self) -> None:
        for key in self.rkeys.values():
            key.destroy()
        self.rkeys.clear()


class _Lane:
    """A UCX worker and the one thread that creates, progresses and closes it: a thread of
    its own (``thread=True``), or the event loop's (the loop lane: :meth:`ReadLanes.run_script`
    drives its :meth:`reading` in the pulling task, one script at a time)."""

    def __init__(self, index: int, *, thread: bool = True, name: str = "") -> None:
        self.index = index
        self.executor = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=name or f"kvkern-lane{index}") if thread else None)
        self._handing = threading.Lock()  # (submit against retire_unstarted)
        self.started = False  # whether anything was handed to its thread (which it then has)
        self._retired = False
        self._context: UCXContext | None = None
        self._worker: UCXWorker | None = None
        self._worker_handle = 0
        self._peers: collections.OrderedDict[bytes, _Peer] = collections.OrderedDict()
        # reads that outlived their endpoint's close, with its peer (its keys kept for them):
        # never freed while UCX may still write their memory
        self._stuck: list[tuple[_Peer, list[ReadBatch]]] = []
        self._retiring = False  # a retire_stuck is queued on the lane's thread
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """``fn(*args)`` on the lane's thread (started by the first call); RuntimeError once
        the lane is closed without one (:meth:`retire_unstarted`) or its executor shut down."""
        with self._handing:
            if self._retired:
                raise RuntimeError("read lane closed")
            self.started = True
            return self.executor.submit(fn, *args)

    def retire_unstarted(self) -> bool:
        """Close the lane here if nothing was ever handed to its thread (a spare set's lane
        never used): no thread is started to close it. False if it has one."""
        with self._handing:
            if self.started:
                return False
            self._retired = True
        self.close()
        return True

    # ---- on the lane's thread only

    def open(self) -> None:
        """Create the lane's UCP context and worker, if not yet made (never after
        :meth:`close`: a script queued before it finds the lane closed)."""
        if self._closed:
            raise TransportError("closed", "read lane closed")
        if self._worker is None:
            # A UCP context of its own: ucxx creates its context without
            # mt_workers_shared, so workers of that context must not run on several threads
            self._context = _lane_context()
            self._worker, self._worker_handle = ucxcompat.new_worker(self._context)

    def _peer(self, address: bytes) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None:
            self._peers.move_to_end(address)
            return peer
        self.open()
        while len(self._peers) >= MAX_PEERS:
            _, old = self._peers.popitem(last=False)
            self._close_peer(old, [])
        if not address_usable(address):
            raise ValueError(f"unusable UCX worker address ({len(address)} B, first byte "
                             f"{address[:1].hex()})")
        ep, ucx_address, handle = ucxcompat.endpoint_to_address(self._worker, address)
        peer = self._peers[address] = _Peer(ep, ucx_address, handle)
        return peer

    def _close_peer(self, peer: _Peer, batches: list[ReadBatch]) -> None:
        run_blocking(self._closing_peer(peer, batches))

    def _closing_peer(self, peer: _Peer, batches: list[ReadBatch],
                      owned: bool = False) -> Steps[None]:
        """Close the endpoint (UCX cancels its running reads), drain ``batches``, then
        destroy the keys (libucp 1.21 releases a key through its worker, so after the
        endpoint is fine). Raises _Stuck if reads outlive READ_DRAIN_S; ``owned`` (their
        memory is the engine's): drains until every read has completed instead."""
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        ucp_rma.forget_endpoint(peer.handle)
        with contextlib.suppress(Exception):
            peer.ep.close_blocking()
        deadline = time.monotonic() + tuning.READ_DRAIN_S
        progress = ucxcompat.request_calls()[2]
        pause, past = LANE_DRAIN_POLL_S, False
        while not all(b.poll() for b in batches):
            if not past and time.monotonic() >= deadline:
                past, running = True, sum(b.posted for b in batches)
                with _counts_lock:
                    _past_drain["engine" if owned else "private"] += 1
                if not owned:
                    stuck = [b for b in batches if b.stuck]
                    self._stuck.append((peer, stuck))
                    raise _Stuck(f"{running} reads still running after their endpoint was "
                                 f"closed (waited {tuning.READ_DRAIN_S} s)",
                                 Outstanding(batches=[(self, b) for b in stuck]))
                log.error("%d reads into memory the engine owns still running %s s after "
                          "their endpoint was closed; the read ends when they have",
                          running, tuning.READ_DRAIN_S)
                pause = OWNED_DRAIN_POLL_S
            if not progress(self._worker_handle):
                yield pause
        peer.destroy_keys()
        peer.ep = peer.address = None  # released here, on the lane's thread

    def run(self, address: bytes, parts: Sequence[tuple[bytes, Sequence[Run]]],
            timeout: float, stop: threading.Event, local: LocalSource | None = None,
            owned: bool = False, same_host: bool = False) -> float | None:
        """:meth:`reading` on this thread."""
        return run_blocking(self.reading(address, parts, timeout, stop, local, owned,
                                         same_host))

    def reading(self, address: bytes, parts: Sequence[tuple[bytes, Sequence[Run]]],
                timeout: float, stop: threading.Event, local: LocalSource | None = None,
                owned: bool = False, same_host: bool = False) -> Steps[float | None]:
        """Read ``parts`` from the source worker at ``address`` (from the process ``local``
        on this host with :mod:`kvkern.xfer.local_reads` instead, when given); the time the
        first run completed. Raises RmaError (a failed read, or an endpoint through
        :data:`NEAR_TRANSPORTS` without ``same_host``), TimeoutError (``timeout`` passed or
        ``stop`` set) or _Stuck (never when ``owned``: see the module docstring), having
        closed the endpoint and drained its reads in each case."""
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        if stop.is_set():
            raise TimeoutError("read stopped before it started")
        deadline = time.perf_counter() + timeout
        if local is not None:
            try:
                return (yield from local_reads.reading(local, parts, deadline, stop))
            except local_reads.LocalReadError:
                local_reads.forget(local)
                raise
        batches: list[ReadBatch] = []
        peer = None
        try:
            peer = self._peer(address)
            if peer.near and not same_host:
                raise ucp_rma.RmaError("the source worker is a process on this host, read "
                                       "only for a state it served itself (kvkern.xfer."
                                       "local_reads.serves)", ucp_rma.UCS_ERR_UNREACHABLE)
            peer.make_room([packed for packed, _ in parts])
            for packed, runs in parts:
                batch = ucp_rma.ReadBatch(peer.rkey(packed), runs,
                                          worker_handle=self._worker_handle, source=address)
                batches.append(batch)
                batch.post(peer.handle)
            firsts = []
            for b in batches:
                firsts.append((yield from b.waiting(max(deadline - time.perf_counter(), 0.0),
                                                    stop)))
            return min((f for f in firsts if f is not None), default=None)
        except BaseException as exc:
            if peer is not None:
                self._peers.pop(address, None)
                closing = self._closing_peer(peer, batches, owned)
                if isinstance(exc, GeneratorExit):  # (the driver stopped: no more pauses)
                    run_blocking(closing)
                else:
                    yield from closing
            raise

    def retire_stuck(self) -> None:
        """Retire the stuck batches whose reads have completed since (on the lane's thread):
        :class:`~kvkern.xfer.quarantine.Outstanding` then sees them ended; an endpoint whose
        stuck reads all ended gives up its keys."""
        self._retiring = False
        if not self._stuck or not self._worker_handle:
            return
        progress = ucxcompat.request_calls()[2]
        for _ in range(RETIRE_PROGRESS_CALLS):
            if not progress(self._worker_handle):
                break
        left = []
        for peer, batches in self._stuck:
            batches = [b for b in batches if not b.poll()]
            if batches:
                left.append((peer, batches))
            else:  # (every read through that endpoint ended: its keys may go)
                peer.destroy_keys()
                peer.ep = peer.address = None
        self._stuck = left
        if not self._stuck and self._closed:  # (kept only for them: see close)
            self._worker = self._context = None

    @property
    def stuck_batches(self) -> list[ReadBatch]:
        """The read batches still running past their endpoint's close."""
        return [b for _, batches in self._stuck for b in batches]

    def retire_later(self) -> None:
        """:meth:`retire_stuck` on the lane's thread (here, for the loop lane: on the event
        loop's thread, which alone calls this), once however often it is asked before it
        runs; nothing once the lane is closed for good."""
        if self.executor is None:
            self._retire_logged()
            return
        if self._retiring:  # (one queued already: a busy lane's queue does not grow)
            return
        self._retiring = True
        try:
            self.submit(self._retire_logged)
        except RuntimeError:  # (closed: its reads stay held)
            self._retiring = False

    def _retire_logged(self) -> None:
        try:
            self.retire_stuck()
        except Exception:  # noqa: BLE001 (the reads stay held)
            log.exception("read lane %d: stuck reads not retired", self.index)

    def close(self) -> None:
        self._closed = True
        while self._peers:
            _, peer = self._peers.popitem(last=False)
            with contextlib.suppress(_Stuck):
                self._close_peer(peer, [])
        if not self._stuck:  # (else UCX still owns requests of this worker: keep it)
            self._worker = self._context = None

    @property
    def opened(self) -> bool:
        return self._worker is not None

    @property
    def peers(self) -> int:
        return len(self._peers)


class ReadLanes:
    """``sets`` lane sets of ``n`` read lanes each (see the module docstring; the first set
    opens with :meth:`open`, the others on their first read), and the loop lane for small
    reads. :meth:`read` and :meth:`run_script` are called on the event loop; :meth:`close`
    from any thread but the lanes'."""

    def __init__(self, n: int, *, min_bytes: int = 4 << 20, loop_bytes: int = 0,
                 sets: int = 1) -> None:
        check_positive_int("read lanes", n)
        check_non_negative_int("loop_bytes", loop_bytes)
        check_positive_int("lane sets", sets)
        self.n = n
        self.min_bytes = min_bytes
        self.loop_bytes = loop_bytes
        self._dispatch = _Dispatch(sets, n)
        self._lanes = self._dispatch.sets[0].lanes  # the set that runs scripts while none stalls
        self._on_loop = _Lane(-1, thread=False)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop lane's thread's
        self._loop_busy = False
        self._closed = False

    @property
    def _all(self) -> list[_Lane]:
        return [*(lane for st in self._dispatch.sets for lane in st.lanes), self._on_loop]

    def open(self, loop: asyncio.AbstractEventLoop) -> list[concurrent.futures.Future]:
        """Create every lane's UCP context and worker now, each on its own thread (the loop
        lane's on ``loop``, the running loop that will run its scripts), rather than in a
        first read: one costs milliseconds, and more where UCX opens network devices. Callable
        from any thread; returns the futures of the lanes' openings. A lane whose opening
        fails stays closed and opens on its first read instead."""
        if self._closed:
            return []
        futs = [lane.submit(lane.open) for lane in self._lanes]
        if self.loop_bytes and self._loop in (None, loop):
            self._loop = loop  # (close() now closes the loop lane on this loop, after this)

            def open_here() -> None:
                if not self._closed:
                    self._on_loop.open()

            futs.append(_on_loop_thread(loop, open_here))
        for fut in futs:
            fut.add_done_callback(_log_failed_open)
        return futs

    @property
    def peers(self) -> int:
        """Open endpoints over all lanes."""
        return sum(lane.peers for lane in self._all)

    @property
    def stuck_reads(self) -> int:
        return sum(len(lane.stuck_batches) for lane in self._all)

    async def read(self, address: bytes, parts: Sequence[Part], *, timeout: float,
                   local: LocalSource | None = None, owned: bool = False,
                   same_host: bool = False) -> float | None:
        """Read every part's runs from the source worker at ``address``, split over the
        lanes (shares of at least ``min_bytes``; on the loop lane when they are at most
        ``loop_bytes``); returns the ``perf_counter`` time the first run was seen complete.
        Raises :class:`TransportError` (``transfer_failed``, ``transfer_timeout``,
        ``closed``) or :class:`ReadsStuck`; after a raise no lane writes to any run's local
        memory, except for ReadsStuck. ``local``, ``owned``, ``same_host``: as
        :meth:`run_script`."""
        nbytes = sum(run[2] for _, runs in parts for run in runs)
        return await self.run_script(address, lambda read: read(parts), timeout=timeout,
                                     nbytes=nbytes, local=local, owned=owned,
                                     same_host=same_host)

    async def run_script(self, address: bytes, script: Callable[[Reader], Steps[T]], *,
                         timeout: float, nbytes: int | None = None,
                         local: LocalSource | None = None, owned: bool = False,
                         same_host: bool = False) -> T:
        """Run ``script(read)``, where ``read(parts)`` reads ``parts`` from the source worker
        at ``address`` (steps that return when all of them landed, as :meth:`read`): a
        sequence of dependent reads (look up, read, validate) with no hop through the event
        loop between them. Where the script reads at most ``loop_bytes`` (``nbytes``, as
        its caller counts them) and no other script is on the loop lane, it runs on the
        event loop, its reads on the loop lane's worker (no thread hand-off either way);
        else on the first lane's thread, each read split over every lane. ``script`` must
        not block and may only pause through ``read``. Errors and cancellation as
        :meth:`read`. ``local``: the source process on this host (its state's
        ``read_local``), read with large ``process_vm_readv`` calls instead of UCX's where
        :func:`kvkern.xfer.local_reads.usable` says it may be. ``same_host``: the source's
        state was served by a process of this host (see the module docstring); without it a
        read through UCX to a process on this host fails.

        ``owned``: memory that the engine owns (:meth:`Puller.pull_into
        <kvkern.xfer.puller.Puller.pull_into>`). A cancelled, failed or timed-out script is
        waited for until every call it made has returned and every UCX read it posted has
        completed, however long: no byte lands after this returns or raises (but for
        :class:`ReadsStuck`, raised only when a second cancellation ends that wait)."""
        from kvkern.xfer import ucp_rma  # noqa: PLC0415

        if self._closed:
            raise TransportError("closed", "read lanes closed")
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        deadline = time.perf_counter() + timeout
        left = lambda: max(deadline - time.perf_counter(), 0.0)  # noqa: E731
        if local is not None and not local_reads.usable(local):
            why = local_reads.gone(local)
            if why is not None:  # the process read so far: no other route reaches it
                raise TransportError("transfer_failed", f"one-sided read: {why}")
            local = None
        if nbytes is not None and nbytes <= self.loop_bytes and not self._loop_busy \
                and self._loop in (None, loop):
            self._loop, self._loop_busy = loop, True
            try:
                result, error, cancelled = await _drive_here(script(
                    lambda parts: self._on_loop.reading(address, parts, left(), stop, local,
                                                        owned, same_host)),
                    stop)
            finally:
                self._loop_busy = False
                if self._closed:  # closed meanwhile: the close left the lane to this script
                    self._on_loop.close()
        else:
            result, error, cancelled = await self._on_a_set(
                loop, lambda lanes: run_blocking(script(
                    lambda parts: self._reading_all(lanes, address, parts, deadline, stop,
                                                    local, owned, same_host))),
                stop, source=_dispatch_key(address, local), wait=left(),
                due=LANE_DUE_S + (nbytes or 0) / LANE_DUE_BYTES_PER_S, until_done=owned)
        if isinstance(error, _Stuck):
            raise ReadsStuck(str(error), error.outstanding)
        if cancelled:
            raise asyncio.CancelledError
        if error is None:
            return result
        if isinstance(error, ucp_rma.RmaError):
            raise TransportError("transfer_failed", f"one-sided read: {error}") from error
        if isinstance(error, TimeoutError):
            raise TransportError("transfer_timeout",
                                 f"reads not done within {timeout} s: {error}") from error
        if isinstance(error, TransportError):
            raise error
        raise TransportError("transfer_failed",
                             f"read lane: {type(error).__name__}: {error}") from error

    async def _on_a_set(self, loop: asyncio.AbstractEventLoop,
                        call: Callable[[list[_Lane]], T], stop: threading.Event, *,
                        source: bytes, wait: float, due: float, until_done: bool = False,
                        ) -> tuple[T | None, BaseException | None, bool]:
        """``call(lanes)``, which reads ``source``, on the first lane's thread of a lane set
        (:class:`_Dispatch`; the set is held until the call has returned, expected within
        ``due`` seconds; waited for at most ``wait`` seconds, then a TimeoutError with
        nothing run): its result, its error, and whether this wait was cancelled (the reads
        then finish within READ_CANCEL_GRACE_S or are stopped, and the call ends by its own
        bounds;
        ``until_done``: waited for until it has, through further cancellations, since its
        reads write into memory the engine owns and may hand to another request once the
        pull has ended). A call still waiting for a set, or queued on the lane's thread, is
        withdrawn: nothing of it ran, so nothing is stuck."""
        try:
            lane_set = await self._dispatch.acquire(source, due, wait)
        except asyncio.CancelledError:
            stop.set()
            return None, None, True
        except TimeoutError as exc:
            return None, exc, False
        try:
            if self._closed:  # (closed while this script waited for a set)
                raise TransportError("closed", "read lanes closed")
            cf = lane_set.lanes[0].submit(call, lane_set.lanes)
        except RuntimeError as exc:  # (the lanes closed meanwhile)
            self._dispatch.release(lane_set)
            raise TransportError("closed", "read lanes closed") from exc
        except BaseException:
            self._dispatch.release(lane_set)
            raise
        fut = asyncio.wrap_future(cf, loop=loop)
        fut.add_done_callback(lambda _: self._dispatch.release(lane_set))
        try:
            return await asyncio.shield(fut), None, False
        except asyncio.CancelledError:
            if cf.cancel():  # (queued: the lane is busy with another pull's script)
                stop.set()
                return None, None, True
            # The copies are local and short: let them finish, then stop what is left.
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(fut), tuning.READ_CANCEL_GRACE_S)
            if not fut.done():
                stop.set()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(fut), tuning.READ_DRAIN_S + 1.0)
            if not fut.done() and until_done:
                log.error("a read into the engine's blocks is still running %s s after its "
                          "stop; the pull ends when it does", tuning.READ_DRAIN_S + 1.0)
                await through_cancels(fut)
            return None, (fut.exception() if fut.done() and not fut.cancelled()
                          else _Stuck("lanes did not end", Outstanding(calls=[cf]))), True
        except BaseException as exc:  # noqa: BLE001 (mapped by the caller)
            return None, exc, False

    def _reading_all(self, lanes: list[_Lane], address: bytes, parts: Sequence[Part],
                     deadline: float, stop: threading.Event, local: LocalSource | None = None,
                     owned: bool = False, same_host: bool = False) -> Steps[float | None]:
        """On the first of ``lanes``' threads (a lane set's): its share here, the others'
        on their threads (which never wait on another lane, so no wait cycle); one failing
        stops the rest. Raises the first error that is not a timeout caused by the stop
        (_Stuck first). Steps for the script's driver on this thread, which alone runs them
        (the other lanes' results are waited for by blocking)."""
        shares = split_parts(parts, len(lanes), min_bytes=self.min_bytes)
        if not shares:
            return None
        left = lambda: max(deadline - time.perf_counter(), 0.0)  # noqa: E731
        futs = []
        firsts: list[float | None] = []
        errors: list[BaseException] = []
        for lane, share in zip(lanes[1:], shares[1:], strict=False):
            try:
                fut = lane.submit(lane.run, address, share, left(), stop, local, owned,
                                  same_host)
            except RuntimeError:  # (the lanes closed meanwhile)
                stop.set()
                errors.append(TransportError("closed", "read lanes closed"))
                break
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                  or stop.set())  # one lane failing stops the others at once
            futs.append(fut)
        try:
            if not errors:
                firsts.append((yield from lanes[0].reading(address, shares[0], left(), stop,
                                                           local, owned, same_host)))
        except GeneratorExit:
            stop.set()
            raise
        except BaseException as exc:  # noqa: BLE001 (collected, raised below)
            stop.set()
            errors.append(exc)
        for fut in futs:
            try:  # a lane ends by its deadline or the stop, then its bounded drain
                firsts.append(fut.result())
            except BaseException as exc:  # noqa: BLE001
                stop.set()
                errors.append(exc)
        if errors:
            stuck = [e for e in errors if isinstance(e, _Stuck)]
            for e in stuck[1:]:  # (every lane's reads that outlived it, in the one raised)
                stuck[0].outstanding.absorb(e.outstanding)
            raise next(iter(stuck), next((e for e in errors if not isinstance(e, TimeoutError)),
                                         errors[0]))
        return min((f for f in firsts if f is not None), default=None)

    def close(self, timeout: float = 5.0) -> None:
        """Close every endpoint and worker on its lane's thread (the loop lane's on the event
        loop, while it runs); idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self._dispatch.close_soon()
        lanes = [lane for st in self._dispatch.sets for lane in st.lanes]
        # (a spare set's lanes that never ran anything close here: no thread to start)
        futs = [lane.submit(lane.close) for lane in lanes if not lane.retire_unstarted()]
        if self._on_loop.opened or self._loop is not None:  # (opened, or an open() queued)
            futs.append(_on_loop_thread(self._loop, self._close_loop_lane))
        for fut in futs:
            with contextlib.suppress(Exception):
                fut.result(max(0.0, deadline - time.monotonic()))
        for lane in lanes:
            lane.executor.shutdown(wait=False)

    def _close_loop_lane(self) -> None:
        """On the loop's thread: close the loop lane now, or, while a script runs on it
        (paused between its polls), when that script ends (as a lane's thread closes its
        lane after the script it is running)."""
        if not self._loop_busy:
            self._on_loop.close()


class _LaneSet:
    """``n`` lanes that run one script at a time, on the first lane's thread, each read split
    over all ``n``; while ``busy``, the script it runs reads from ``source`` (a worker
    address), started at ``since`` (``perf_counter``) and is expected to end within ``due``
    seconds."""

    __slots__ = ("lanes", "busy", "source", "since", "due")

    def __init__(self, index: int, n: int) -> None:
        prefix = "kvkern-lane" if index == 0 else f"kvkern-set{index}-lane"
        self.lanes = [_Lane(i, name=f"{prefix}{i}") for i in range(n)]
        self.busy = False
        self.source = b""
        self.since = self.due = 0.0

    def overdue(self, now: float) -> bool:
        return self.busy and now - self.since > self.due

    @property
    def opened(self) -> bool:
        return all(lane.opened for lane in self.lanes)


class _Waiter:
    __slots__ = ("fut", "source", "due")

    def __init__(self, fut: asyncio.Future[_LaneSet], source: bytes, due: float) -> None:
        self.fut, self.source, self.due = fut, source, due


def _dispatch_key(address: bytes, local: LocalSource | None) -> bytes:
    """The source a script's lane set is held for (:class:`_Dispatch`): a process on this
    host read with its own calls by its process id, which it cannot vary, not by the worker
    address it announces (one process announcing several would hold a set for each)."""
    return address if local is None else b"pid:%d" % local.pid


class _Dispatch:
    """Which lane set runs each script, on the event loop's thread. Scripts wait in one
    queue, in order; the first goes to the first set that is free once every set before it
    is *overdue* (running a script past its due time: a source whose reads stall). So while
    no source stalls, set 0 runs every script, one after another (copies that share a host's
    memory finish soonest in turn, and its endpoints are warm). A script whose source holds
    an overdue set waits, and the scripts behind it from other sources go first: a stalled
    source holds one set, not every pull of the process. A set's lanes open on their first
    read, which the set's first script is given ``LANE_OPEN_S`` more for."""

    def __init__(self, sets: int, n: int) -> None:
        self.sets = [_LaneSet(i, n) for i in range(sets)]
        self._waiting: list[_Waiter] = []
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiting scripts' loop

    async def acquire(self, source: bytes, due: float, wait: float) -> _LaneSet:
        """A set for a script that reads ``source`` and is expected to run ``due`` seconds,
        held until :meth:`release`; TimeoutError after ``wait`` seconds, TransportError
        ``closed`` on :meth:`close`. A wait that ends so, or is cancelled, holds none."""
        loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[_LaneSet] = loop.create_future()
        self._waiting.append(_Waiter(fut, source, due))
        self._dispatch()
        timer = None if fut.done() else loop.call_later(wait, _expire, fut, wait)
        try:
            lane_set = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # (handed a set as the task was cancelled)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if lane_set is not self.sets[0]:  # (counted once the script holds it)
            with _counts_lock:
                _spills[0] += 1
        return lane_set

    def release(self, lane_set: _LaneSet) -> None:
        lane_set.busy = False
        self._dispatch()

    def close_soon(self) -> None:
        """From any thread: :meth:`close` on the waiting scripts' loop."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (that loop has ended)
                self._loop.call_soon_threadsafe(self.close)

    def close(self) -> None:
        """On the loop's thread: every waiting script fails as closed."""
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            if not w.fut.done():
                w.fut.set_exception(TransportError("closed", "read lanes closed"))

    def _dispatch(self) -> None:
        now = time.perf_counter()
        stalled = {st.source for st in self.sets if st.overdue(now)}
        self._waiting = [w for w in self._waiting if not w.fut.done()]
        for w in list(self._waiting):
            if w.source in stalled:
                continue  # (waits for its source's set, or its own bound)
            lane_set = self._free(now)
            if lane_set is None:
                break
            self._waiting.remove(w)
            lane_set.busy, lane_set.source, lane_set.since = True, w.source, now
            lane_set.due = w.due + (0.0 if lane_set.opened else LANE_OPEN_S)
            w.fut.set_result(lane_set)
        self._arm(now)

    def _free(self, now: float) -> _LaneSet | None:
        for lane_set in self.sets:
            if not lane_set.busy:
                return lane_set
            if not lane_set.overdue(now):
                return None
        return None

    def _arm(self, now: float) -> None:
        """While a script waits behind a set that is not yet overdue, with a free set after
        it: dispatch again when that set becomes overdue."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting or self._loop is None:
            return
        for i, lane_set in enumerate(self.sets):
            if not lane_set.busy:  # (only scripts of stalled sources wait: a release wakes them)
                return
            if not lane_set.overdue(now):
                if any(not later.busy for later in self.sets[i + 1:]):
                    self._timer = self._loop.call_later(
                        lane_set.since + lane_set.due - now + 1e-4, self._dispatch)
                return


def _expire(fut: asyncio.Future, wait: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"no lane set free within {wait:.3g} s"))


async def _drive_here(steps: Steps[T], stop: threading.Event) -> tuple[
        T | None, BaseException | None, bool]:
    """Run the loop lane's ``steps`` in this task, on the event loop: their result, their
    error, and whether this task was cancelled meanwhile. For the first LOOP_SPIN_S of
    pauses each one only yields to the loop (other ready work runs, then the next poll: no
    timer); after that each pause is a timer (the selector sleeps at millisecond granularity),
    so a slow read never keeps the loop busy. A CMA read lands during its first poll, so a
    small pull's steps usually run through without pausing at all. A cancellation does not
    cut the steps short (their reads write into memory the caller is about to reuse): they
    go on for READ_CANCEL_GRACE_S, then with ``stop`` set, which ends them by their own
    bounds (a drain of at most READ_DRAIN_S)."""
    spent, cancelled_at = 0.0, None
    while True:
        try:
            pause = next(steps)
        except StopIteration as done:
            return done.value, None, cancelled_at is not None
        except BaseException as exc:  # noqa: BLE001 (mapped by the caller)
            return None, exc, cancelled_at is not None
        if cancelled_at is not None and \
                time.perf_counter() - cancelled_at >= tuning.READ_CANCEL_GRACE_S:
            stop.set()
        t = time.perf_counter()
        try:
            await asyncio.sleep(0 if spent < LOOP_SPIN_S else pause)
        except asyncio.CancelledError:
            cancelled_at = cancelled_at or time.perf_counter()
        spent += time.perf_counter() - t


def _log_failed_open(fut: concurrent.futures.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("a read lane did not open (it opens on its first read): %s",
                    fut.exception())


def _on_loop_thread(loop: asyncio.AbstractEventLoop | None,
                    call: Callable[[], None]) -> concurrent.futures.Future:
    """``call()`` on ``loop``'s thread while that loop runs (from another thread), else here
    (on that thread, or once nothing runs on the loop any more)."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if loop is not None and loop.is_running() and not loop.is_closed() and not here:
        async def run() -> None:
            call()
        return asyncio.run_coroutine_threadsafe(run(), loop)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    try:
        call()
        fut.set_result(None)
    except Exception as exc:  # noqa: BLE001 (reported through the future)
        fut.set_exception(exc)
    return fut
