"""One-sided UCX reads (``ucp_get_nbx``) for the pull path, through the libucp ucxx loaded
(bound in :mod:`kvkern.xfer.ucxcompat`).

ucxx 0.52's Python API has tags, streams and active messages but no RMA, and kvkern creates
ucxx's own context (the one it listens on) without RMA (:data:`ucxcompat.APP_FEATURES`).
Reads use UCP contexts of their own, on transports other than TCP
(:func:`ucxcompat.new_rma_context`): the source registers its pools in its
:func:`ucxcompat.read_target`, whose worker address its state publishes, and a destination
reads on its read lanes' workers (:mod:`kvkern.xfer.read_lanes`).
:mod:`kvkern.xfer.ucxcompat` binds the few libucp calls a remote read needs; this module
keeps their rules::

    source                                         destination
    Region(pool address, length)   rkey bytes ->   RemoteKey(lane endpoint, rkey bytes)
      ucp_mem_map (remote read only)                 ucp_ep_rkey_unpack
      ucp_rkey_pack                                ReadBatch(key, runs)
                                                     ucp_get_nbx per run, into local memory
                                                     ucp_request_check_status until done

Why: a source whose blocks are scattered in its pool must otherwise pack them into staging
before a tag send, and on one host that is a second full copy through memory. With a read the
destination's UCX copies each block once, straight from the source's pool into its own
private blocks (CMA's ``process_vm_readv`` on loopback, RDMA reads across hosts): no pack, no
staging, no unpack, on either side. Measured in ``kvkern bench xfer`` (``bench/RESULTS.md``).

Safety rules the callers keep (and the tests check):

* A :class:`Region` grants **remote read** only (no remote write) and lives until the source
  service closes. The source keeps the served blocks pinned until the destination says it
  has finished reading (or gives up), and never less than the hold it granted in its
  reply; the destination commits only reads that completed inside that hold (counted from
  before it sent the request) or that the source confirmed with ``ReadAck(held=True)``.
* Local addresses are always computed by the caller from its own block ids, never taken
  from the wire; remote addresses are checked against the advertised region.
* Every request is polled to completion (or to an error) before its local memory is reused;
  an aborted endpoint completes its requests with ``UCS_ERR_CANCELED``. A batch that does not
  finish in its bound reports ``stuck`` so the caller can quarantine the local blocks rather
  than risk a late write into reused memory.
* A :class:`RemoteKey` is destroyed only after every read through it has completed or been
  cancelled (UCX's rule). UCX also asks for it to go before its endpoint; after a failure
  the endpoint is aborted first (only that cancels the reads), and the key is destroyed
  once they drained: libucp 1.21 releases a key through its worker, not the endpoint.

Host memory only by default: device memory would work the same way through UCX's CUDA
transports (``memory_type`` below), but no GPU has run this code yet.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from kvkern.xfer import ucxcompat
from kvkern.xfer.pauses import Steps, run_blocking

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RmaError", "Region", "RemoteKey", "ReadBatch", "Scatter", "ScatterCheckError",
           "coalesce", "coalesce_arrays", "expand", "forget_endpoint", "rma_unavailable",
           "scatter_arrays", "scatter_check_failed", "MEMORY_TYPES"]

log = logging.getLogger("kvkern.xfer")

UCS_OK = ucxcompat.UCS_OK
UCS_INPROGRESS = 1
MEMORY_TYPES = {"host": 0, "cuda": 1}  # ucs_memory_type_t

# names of the UCS status codes (ucs/type/status.h: -1 .. -25 in this order)
_ERR_NAMES = ("NO_MESSAGE", "NO_RESOURCE", "IO_ERROR", "NO_MEMORY", "INVALID_PARAM",
              "UNREACHABLE", "INVALID_ADDR", "NOT_IMPLEMENTED", "MESSAGE_TRUNCATED",
              "NO_PROGRESS", "BUFFER_TOO_SMALL", "NO_ELEM", "SOME_CONNECTS_FAILED", "NO_DEVICE",
              "BUSY", "CANCELED", "SHMEM_SEGMENT", "ALREADY_EXISTS", "OUT_OF_RANGE", "TIMED_OUT",
              "EXCEEDS_LIMIT", "UNSUPPORTED", "REJECTED", "NOT_CONNECTED", "CONNECTION_RESET")
_STATUS_NAMES = {0: "UCS_OK", -80: "UCS_ERR_ENDPOINT_TIMEOUT",
                 **{-1 - i: f"UCS_ERR_{n}" for i, n in enumerate(_ERR_NAMES)}}
UCS_ERR_CANCELED = -16
UCS_ERR_IO_ERROR = -3
UCS_ERR_UNREACHABLE = -6
UCS_ERR_UNSUPPORTED_STATUS = -22
# what a UCX that cannot scatter a read over a local iov answers (the read is then posted
# piece by piece): INVALID_PARAM, NOT_IMPLEMENTED, UNSUPPORTED
_NO_IOV = frozenset((-5, -8, UCS_ERR_UNSUPPORTED_STATUS))
_iov_reads = True  # this UCX scatters a read over an iov (until it refuses one, or fails checks)
# Endpoints whose first scattered read matched the same bytes read whole (see
# ReadBatch.wait): ucp.h documents only contiguous reads, and a UCX that takes an iov read
# without moving a byte was seen (the v1 protocols, UCX_PROTO_ENABLE=n).
_iov_verified: collections.OrderedDict[int, None] = collections.OrderedDict()
_IOV_VERIFIED_MAX = 1024
# A check that finds other bytes than the whole re-read reads them whole once more: two whole
# reads that differ are the source rewriting the block meanwhile (an eviction under load, or a
# hostile source), which counts against nothing. Otherwise the mismatch counts against the
# source (ReadBatch's ``source``): a UCX that does not scatter fails every check, a source
# may rewrite its bytes once more between the iov read and the re-reads. So a source's
# second mismatch since a passing check of its own makes its reads go piece by piece, and
# iov reads go off for the process only once two sources mismatched with no passing check
# in between (one source cannot turn them off for every other).
_IOV_MISMATCHES_TO_STOP = 2
_IOV_FAILURES_MAX = 1024
# source -> mismatches since its last passing check (least recently failed first)
_iov_failures: collections.OrderedDict[bytes, int] = collections.OrderedDict()
_iov_mismatches = 0  # mismatches since the last passing check (any source's)
_iov_mismatched: object = None  # the source of the first of them


def forget_endpoint(ep_handle: int) -> None:
    """An endpoint is going away: its handle may come back for another endpoint, whose
    first scattered read must be checked again."""
    _iov_verified.pop(ep_handle, None)


class DtIov(ctypes.Structure):  # ucp_dt_iov_t (ucp/api/ucp.h); Scatter.local rows
    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class Scatter(NamedTuple):
    """One read of ``nbytes`` contiguous remote bytes at ``remote``, scattered on arrival
    over ``local``: a ``uint64`` array of ``(address, nbytes)`` rows (``ucp_dt_iov_t``),
    whose lengths add up to ``nbytes``. Unpacks like a run, ``(local, remote, nbytes)``."""

    local: np.ndarray
    remote: int
    nbytes: int


def expand(runs: Sequence[tuple]) -> Iterator[tuple[int, int, int]]:
    """``runs`` as plain ``(local, remote, nbytes)`` runs: a :class:`Scatter` as one run
    per local piece."""
    for run in runs:
        if type(run) is Scatter:
            remote = run.remote
            for local, n in run.local.tolist():
                yield local, remote, n
                remote += n
        else:
            yield run


class RmaError(Exception):
    """A failed libucp call; ``status`` is the (negative) ``ucs_status_t``."""

    def __init__(self, what: str, status: int) -> None:
        name = _STATUS_NAMES.get(status, f"status {status}")
        super().__init__(f"{what}: {name}")
        self.status = status


class ScatterCheckError(RmaError):
    """An endpoint's first scattered read did not match the same bytes read whole (see
    :meth:`ReadBatch.wait`): that read is not used; the endpoint and its transport are
    not at fault unless it happens again (or the source rewrote those bytes)."""


def scatter_check_failed(exc: BaseException) -> bool:
    """``exc`` (or what it was raised from) is a :class:`ScatterCheckError`."""
    while exc is not None:
        if isinstance(exc, ScatterCheckError):
            return True
        exc = exc.__cause__
    return False


def rma_unavailable() -> str | None:
    """Why one-sided reads cannot be used in this process, or None when they can."""
    try:
        ucxcompat.libucp()
        ucxcompat.read_target()
    except Exception as exc:  # noqa: BLE001 (any binding failure means: use the stream)
        return f"{type(exc).__name__}: {exc}"
    return None


class Region:
    """``length`` bytes at ``address`` registered for **remote read** in this process's
    :func:`ucxcompat.read_target`;
    ``rkey`` is the packed remote key a peer unpacks with :class:`RemoteKey`. ``close()``
    unmaps it (idempotent); the memory must stay alive until then."""

    def __init__(self, address: int, length: int, *, memory_type: str = "host") -> None:
        if address <= 0 or length <= 0:
            raise ValueError(f"cannot register {length} bytes at {address:#x}")
        if memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type {memory_type!r} not in {sorted(MEMORY_TYPES)}")
        self._ctx = ucxcompat.read_target().handle
        self.address = int(address)
        self.length = int(length)
        self.memory_type = memory_type
        status, memh = ucxcompat.map_for_remote_read(self._ctx, self.address, self.length,
                                                     MEMORY_TYPES[memory_type])
        if status != UCS_OK:
            raise RmaError(f"ucp_mem_map of {length} B at {address:#x}", status)
        self._memh: int | None = memh
        status, self.rkey = ucxcompat.pack_rkey(self._ctx, memh)
        if status != UCS_OK:
            self.close()
            raise RmaError("ucp_rkey_pack", status)

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.length

    def close(self) -> None:
        memh, self._memh = self._memh, None
        if memh is not None:
            ucxcompat.unmap(self._ctx, memh)

    def __repr__(self) -> str:
        state = "mapped" if self._memh is not None else "closed"
        return f"Region({self.length} B at {self.address:#x}, {self.memory_type}, {state})"


class RemoteKey:
    """A peer's packed rkey unpacked on one endpoint (``ucp_ep_h`` as an int).
    ``destroy()`` is idempotent and must run before that endpoint is destroyed."""

    def __init__(self, ep_handle: int, packed: bytes) -> None:
        if not packed:
            raise ValueError("empty remote key")
        status, handle = ucxcompat.unpack_rkey(ep_handle, packed)  # (zero-padded: see there)
        if status != UCS_OK:
            raise RmaError("ucp_ep_rkey_unpack", status)
        self.ep_handle = ep_handle
        self.handle: int | None = handle

    def destroy(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            ucxcompat.destroy_rkey(handle)


class ReadBatch:
    """Reads ``runs`` of ``(local_address, remote_address, nbytes)`` through ``key``.

    :meth:`post` issues every read (``ucp_get_nbx``; the waits progress ``worker_handle``,
    the lane's worker; a :class:`Scatter` is one read over an iov, the first on an endpoint
    checked against the same bytes read whole, or one read per piece); a read that cannot be
    posted stops the posting and is reported by :meth:`wait`. ``source`` names the source
    process (its worker address) that failed checks count against (:meth:`_verify`); None
    counts each batch as a source of its own.
    :meth:`wait` blocks (call both off the event loop: a copy runs inside a post or a
    progress call) until every posted read has completed, polling with a
    short sleep (:meth:`waiting` is the same wait for a driver that passes the pauses
    itself: a worker owned by the event loop's thread); it returns the time the first run
    completed and raises :class:`RmaError` for the first failed read. Requests are freed
    only once complete; :attr:`stuck` says some were still running when ``wait`` gave
    up."""

    _POLL_MIN_S = 10e-6
    _POLL_MAX_S = 200e-6

    def __init__(self, key: RemoteKey, runs: Sequence[tuple[int, int, int]], *,
                 memory_type: str = "host", worker_handle: int | None = None,
                 source: bytes | None = None) -> None:
        self._post = ucxcompat.read_poster(MEMORY_TYPES[memory_type])
        self._post_iov = ucxcompat.read_poster(MEMORY_TYPES[memory_type], iov=True)
        self._host = memory_type == "host"  # (a scattered read is checked on the host)
        self._check, self._free, self._progress = ucxcompat.request_calls()
        self._worker = worker_handle
        self._source = source
        self._key = key
        self._runs = runs
        self._reqs: list[int | None] = []  # None: completed (at post time or retired)
        self._failed: tuple[int, int] | None = None  # (run index, status)
        self._next = 0  # reads before this index are complete and freed
        self._ep: int | None = None
        self._unverified: Scatter | None = None  # a first iov read on an endpoint
        self._check_batch: ReadBatch | None = None  # its whole re-read (see _verify)
        self._check_buffer: np.ndarray | None = None  # what that re-read writes
        self._iovs: list[np.ndarray] = []  # what the iov reads were posted with
        # held while a read is posted after :meth:`post` (the check of a scattered read):
        # an endpoint that other threads may abort is kept open meanwhile, or it raises
        self.nbytes = 0

    def post(self, ep_handle: int) -> None:
        """Issue the reads on ``ep_handle`` (the caller keeps the endpoint alive meanwhile)."""
        if self._key.handle is None:
            raise ValueError("remote key already destroyed")
        self._ep = ep_handle
        for i, run in enumerate(self._runs):
            local, remote, n = run
            status = (self._scatter(ep_handle, run) if type(run) is Scatter
                      else self._get(ep_handle, self._post, local, n, remote))
            if status is not None:
                self._failed = (i, status)
                break
            self.nbytes += n

    def _get(self, ep_handle: int, post: Callable, local: int, count: int,
             remote: int) -> int | None:
        """One ``ucp_get_nbx``; None when it is running or done, else its failed status."""
        ptr = post(ep_handle, local, count, remote, self._key.handle)
        status = ucxcompat.ptr_status(ptr)
        if status is None:
            self._reqs.append(ptr)
        elif status == UCS_OK:
            self._reqs.append(None)
        else:
            return status
        return None

    def _scatter(self, ep_handle: int, run: Scatter) -> int | None:
        """A :class:`Scatter` as one read over its iov, or piece by piece where this UCX
        refuses an iov for a read (then for the rest of the process) or its reads from this
        source failed their checks (:meth:`_verify`)."""
        global _iov_reads
        local = run.local
        if _iov_reads and self._host and len(local) > 1 and (
                self._source is None
                or _iov_failures.get(self._source, 0) < _IOV_MISMATCHES_TO_STOP):
            # UCX gets a copy of the iov, kept until the batch is dropped (a UCX that took
            # the iov for a contiguous buffer wrote into it): run.local stays as built
            iov = local.copy()
            self._iovs.append(iov)
            status = self._get(ep_handle, self._post_iov, iov.ctypes.data, len(iov),
                               run.remote)
            if status not in _NO_IOV:
                if status is None and self._unverified is None \
                        and ep_handle not in _iov_verified:
                    self._unverified = run
                return status
            _iov_reads = False
        for lo, re, n in expand([run]):
            status = self._get(ep_handle, self._post, lo, n, re)
            if status is not None:
                return status
        return None

    @property
    def posted(self) -> int:
        return len(self._reqs)

    @property
    def stuck(self) -> bool:
        return self._next < len(self._reqs) or (self._check_batch is not None
                                                and self._check_batch.stuck)

    def poll(self) -> bool:
        """Retire completed reads in order; True when all are done (no blocking)."""
        if self._check_batch is not None and not self._check_batch.poll():
            return False
        check, free = self._check, self._free
        reqs = self._reqs
        while self._next < len(reqs):
            req = reqs[self._next]
            if req is not None:
                status = check(req)
                if status == UCS_INPROGRESS:
                    return False
                free(req)
                reqs[self._next] = None
                if status != UCS_OK and self._failed is None:
                    self._failed = (self._next, status)
            self._next += 1
        return True

    def wait(self, timeout: float, cancelled: threading.Event | None = None) -> float | None:
        """Block until every posted read completed; raise RmaError for a failed one,
        TimeoutError when ``timeout`` passes first (or ``cancelled`` is set). Returns the
        ``perf_counter`` time the first run was seen complete (None for no runs)."""
        return run_blocking(self.waiting(timeout, cancelled))

    def waiting(self, timeout: float,
                cancelled: threading.Event | None = None) -> Steps[float | None]:
        """:meth:`wait` as steps (:mod:`kvkern.xfer.pauses`): yields the pause before each
        next poll instead of sleeping it, for a thread or an event loop to drive."""
        deadline = time.perf_counter() + timeout
        first = None
        delay = self._POLL_MIN_S
        while True:
            progressed = self._next
            done = self.poll()
            if first is None and self._next > 0:
                first = time.perf_counter()
            if done:
                break
            now = time.perf_counter()
            if now >= deadline:
                raise TimeoutError(f"{len(self._reqs) - self._next} of {len(self._reqs)} "
                                   f"reads still running after {timeout} s")
            if cancelled is not None and cancelled.is_set():
                raise TimeoutError("read cancelled")
            if self._worker is not None and self._progress(self._worker):
                # Progress the worker here, where the read waits: a progress thread
                # sleeping in epoll between rounds is woken by no event for a read (~0.9 ms
                # per read on ucxx's, a 512-block read twice one big one).
                delay = self._POLL_MIN_S
                continue
            delay = self._POLL_MIN_S if self._next > progressed else min(
                delay * 2, self._POLL_MAX_S)
            yield delay
        if self._failed is not None:
            i, status = self._failed
            raise RmaError(f"read {i} of {len(self._reqs)}", status)
        if self._unverified is not None:
            yield from self._verify(self._unverified, max(deadline - time.perf_counter(), 0.0),
                                    cancelled)
        return first

    def _verify(self, run: Scatter, timeout: float,
                cancelled: threading.Event | None) -> Steps[None]:
        """Read ``run``'s remote bytes again whole and compare them with what its iov read
        left in the pieces: equal, the endpoint's iov reads are trusted from now on. Else
        this batch fails (ScatterCheckError), so what it read is not used, and the
        endpoint's next scattered read is checked again; the bytes are read whole once more,
        and unless the two whole reads differ (the source rewrote them meanwhile) the
        mismatch counts against the source (see :data:`_IOV_MISMATCHES_TO_STOP`)."""
        global _iov_mismatches
        import numpy as np  # noqa: PLC0415

        deadline = time.perf_counter() + timeout
        whole = yield from self._read_whole(run, deadline, cancelled)
        pos = 0
        for address, n in run.local.tolist():
            got = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(address))
            if not np.array_equal(got, whole[pos:pos + n]):
                again = yield from self._read_whole(run, deadline, cancelled)
                self._mismatched(changed=not np.array_equal(whole, again))
            pos += n
        self._unverified = None
        if self._source is not None:
            _iov_failures.pop(self._source, None)
        _iov_mismatches = 0
        _iov_verified[self._ep] = None
        while len(_iov_verified) > _IOV_VERIFIED_MAX:
            _iov_verified.popitem(last=False)

    def _read_whole(self, run: Scatter, deadline: float,
                    cancelled: threading.Event | None) -> Steps[np.ndarray]:
        """``run``'s remote bytes read whole into a new buffer."""
        import numpy as np  # noqa: PLC0415

        whole = np.empty(run.nbytes, np.uint8)
        check = ReadBatch(self._key, [(whole.ctypes.data, run.remote, run.nbytes)],
                          worker_handle=self._worker)
        # drained (and kept, if stuck) with this batch, and its buffer with it: a wait cut
        # short (a timeout, another lane's failure) leaves the read to the caller's drain
        self._check_batch, self._check_buffer = check, whole
        check.post(self._ep)
        yield from check.waiting(max(deadline - time.perf_counter(), 0.0), cancelled)
        return whole

    def _mismatched(self, *, changed: bool) -> NoReturn:
        """A check found other bytes than the whole re-read: count it against the source
        unless its bytes ``changed`` between two whole reads, and fail the batch."""
        global _iov_reads, _iov_mismatches, _iov_mismatched
        if changed:
            log.info("a read scattered over an iov did not land as the same bytes read whole, "
                     "which the source rewrote meanwhile: the read fails, and the endpoint's "
                     "next one is checked again")
            raise ScatterCheckError("scattered read check (the source's bytes changed)",
                                    UCS_ERR_IO_ERROR)
        source = self._source if self._source is not None else object()
        failures = 1
        if self._source is not None:
            failures += _iov_failures.pop(source, 0)
            _iov_failures[source] = failures
            while len(_iov_failures) > _IOV_FAILURES_MAX:
                _iov_failures.popitem(last=False)
        if not _iov_mismatches:
            _iov_mismatched = source
        _iov_mismatches += 1
        if source != _iov_mismatched:  # a second source since the last passing check
            _iov_reads = False
            log.warning("reads scattered over an iov did not land as the same bytes read "
                        "whole, from two sources: reads are posted piece by piece from now on")
        elif failures >= _IOV_MISMATCHES_TO_STOP:
            log.warning("a read scattered over an iov did not land as the same bytes read "
                        "whole, again from this source: its reads are posted piece by piece "
                        "from now on")
        else:
            log.warning("a read scattered over an iov did not land as the same bytes read "
                        "whole: the read fails, and the endpoint's next one is checked again")
        raise ScatterCheckError("scattered read check", UCS_ERR_IO_ERROR)


_SMALL_RUNS = 32  # as kvkern.cache.directory.SMALL: the cold crossover of looped vs vectorized


def coalesce_arrays(local: np.ndarray, remote: np.ndarray,
                    nbytes: int) -> list[tuple[int, int, int]]:
    """:func:`coalesce` for numpy ``uint64`` arrays of addresses, vectorized (a per-layer
    pool makes layers x blocks of them; the pull path uses this one, :func:`coalesce` is
    its plain-Python reference)."""
    import numpy as np  # noqa: PLC0415

    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local vs {len(remote)} remote addresses")
    if len(local) <= _SMALL_RUNS:  # below numpy's fixed cost per call
        return coalesce(local.tolist(), remote.tolist(), nbytes)
    if not len(local):
        return []
    n = np.uint64(nbytes)
    cut = np.flatnonzero((local[1:] != local[:-1] + n) | (remote[1:] != remote[:-1] + n)) + 1
    starts = np.concatenate(([0], cut))
    sizes = np.diff(np.concatenate((starts, [len(local)]))) * nbytes
    return list(zip(local[starts].tolist(), remote[starts].tolist(), sizes.tolist(),
                    strict=True))


def scatter_arrays(local: np.ndarray, remote: np.ndarray, sizes: Sequence[int], *,
                   max_pieces: int, max_bytes: int) -> list[Scatter]:
    """:class:`Scatter` reads for blocks whose bytes are contiguous at ``remote`` (``uint64``,
    one per block) and land at ``local`` (``uint64 [blocks, pieces]``), piece ``i`` being
    ``sizes[i]`` bytes: consecutive blocks that are consecutive on the remote side share
    one read of at most ``max_pieces`` pieces and ``max_bytes`` bytes (or one block)."""
    import numpy as np  # noqa: PLC0415

    blocks, m = local.shape
    if len(remote) != blocks or len(sizes) != m:
        raise ValueError(f"{blocks}x{m} local pieces for {len(remote)} blocks of "
                         f"{len(sizes)} pieces")
    if not blocks:
        return []
    total = int(sum(sizes))
    rows = np.empty((blocks, m, 2), np.uint64)
    rows[:, :, 0] = local
    rows[:, :, 1] = np.asarray(sizes, dtype=np.uint64)
    per = max(1, min(max_pieces // m, max_bytes // max(total, 1)))
    cut = np.flatnonzero(remote[1:] != remote[:-1] + np.uint64(total)) + 1
    bounds = [0, *cut.tolist(), blocks]
    out = []
    for a, b in itertools.pairwise(bounds):
        for c in range(a, b, per):
            e = min(c + per, b)
            out.append(Scatter(rows[c:e].reshape(-1, 2), int(remote[c]), total * (e - c)))
    return out


def coalesce(local: Sequence[int], remote: Sequence[int], nbytes: int) -> list[tuple[int, int, int]]:
    """Runs for ``len(local)`` blocks of ``nbytes`` at the given local and remote addresses,
    merging neighbours that are consecutive on both sides into one read."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local vs {len(remote)} remote addresses")
    runs: list[list[int]] = []
    for lo, re in zip(local, remote, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == re:
            runs[-1][2] += nbytes
        else:
            runs.append([lo, re, nbytes])
    return [tuple(r) for r in runs]
